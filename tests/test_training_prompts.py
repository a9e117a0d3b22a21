"""The training prompt builder (scripts/build_training_prompts.py) and its evaluation-overlap check."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

import pytest

from dspark_hf.training.contamination import EvalOverlapIndex, prompt_file_texts


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

GSM8K_LIKE = ("Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for "
              "her friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh "
              "duck egg. How much in dollars does she make every day at the farmers' market?")
STUB_ASK = "Write a solution to the following problem and make sure that it passes the tests:"


def _eval_texts() -> list[str]:
    suffix = "\nPlease reason step by step, and put your final answer within \\boxed{}."
    stubs = [f"{STUB_ASK}\n```python\ndef f{i}(x):\n    \"\"\" Return x times {i}. \"\"\"\n```" for i in range(6)]
    return [GSM8K_LIKE + suffix] + [f"Tom has {i} apples and buys {i + 2} more.{suffix}" for i in range(6)] + stubs


@pytest.mark.parametrize("text", [
    GSM8K_LIKE.upper(),  # case and punctuation do not hide a copy
    "Here is a problem: " + GSM8K_LIKE.replace("$2", "two dollars"),  # a 13-gram survives the edit
    # every 13-gram broken, but 5 of the 8 8-grams are still in the eval prompt
    "janet's ducks lay 16 eggs per day. she eats THREE for breakfast every morning",
])
def test_overlap_rejects_near_copies(text):
    assert EvalOverlapIndex(_eval_texts()).overlap(text) is not None


@pytest.mark.parametrize("text", [
    "Translate the following text into French: the cat sleeps on the warm windowsill all afternoon long.",
    f"{STUB_ASK}\n```python\ndef count_vowels(word):\n    \"\"\" Return how many vowels the word has. \"\"\"\n```",
    "Maria has 12 apples and buys 3 more. How many apples does she have?\nPlease reason step by step, and put your "
    "final answer within \\boxed{}.",
])
def test_overlap_keeps_unrelated_text_and_shared_boilerplate(text):
    assert EvalOverlapIndex(_eval_texts()).overlap(text) is None


def test_short_prompts_are_rejected_only_when_equal():
    index = EvalOverlapIndex(["Write a python function to add two numbers."])
    assert index.overlap("write a Python function to add two numbers") is not None
    assert index.overlap("Write a python function to add three numbers.") is None


def test_prompt_file_texts_skips_lines(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps({"turns": [f"q{i}", f"follow-up {i}"]}) + "\n" for i in range(1, 5)))
    assert prompt_file_texts(path, skip_lines=(2, 3)) == ["q1", "follow-up 1", "q4", "follow-up 4"]
    path.write_text('{"question": "no turns"}\n')
    with pytest.raises(ValueError, match="set.jsonl:1"):
        prompt_file_texts(path)


# --- the builder on a tiny fake machine ------------------------------------------------------------------------------

DOC_PARAGRAPHS = [
    "The widget store keeps every widget in a single file. If the file does not exist, the store creates it the "
    "first time a widget is saved, so a new installation needs no setup at all.",
    "A widget is a small record with a name, a colour and a size. The store is a plain text file that people can "
    "read and edit with any editor, which makes mistakes easy to find and fix by hand.",
    "When two programs write to the store at the same time, the second one waits until the first has finished. "
    "This keeps the file consistent, but it also means that a program which never finishes blocks everyone else.",
    "Backups are simple copies of the store file. The recommended schedule is one copy every night, kept for a "
    "week, and one copy every month, kept for a year, in a different place from the original.",
]
MAN_PAGE = r""".TH FROB 1
.SH NAME
frob \- frobnicate the widgets of a store
.SH DESCRIPTION
The frob command reads the widget store and frobnicates every widget in it. If a widget is already frobnicated,
frob leaves it unchanged and reports it at the end of the run.
.PP
Frobnication is the process of sorting the fields of a widget and removing those that are empty. It is safe to
run frob many times on the same store, because a second run changes nothing.
.SH OPTIONS
.TP
.B \-v, \-\-verbose
Print the name of every widget as it is frobnicated, followed by the number of fields that were removed.
.TP
.B \-n, \-\-dry\-run
Show what would change without writing anything to the store file.
.TP
.B \-q, \-\-quiet
Print nothing except errors.
"""
FUNCTIONS = '''
def add_widget(store, name, colour="red"):
    """Add a widget called `name` to the store and return its new identifier number."""
    identifier = len(store) + 1
    store[identifier] = {"name": name, "colour": colour}
    return identifier


def count_colours(store):
    """Count how many widgets of each colour the store holds."""
    counts = {}
    for widget in store.values():
        counts[widget["colour"]] = counts.get(widget["colour"], 0) + 1
    return counts


def largest(values, limit=10):
    """Return the largest value below the limit, or None when there is none."""
    best = None
    for value in values:
        if value < limit and (best is None or value > best):
            best = value
    return best
'''


def _fake_machine(root: Path) -> list[str]:
    (root / "man" / "man1").mkdir(parents=True)
    (root / "man" / "man1" / "frob.1.gz").write_bytes(gzip.compress(MAN_PAGE.encode()))
    (root / "doc" / "widgets").mkdir(parents=True)
    (root / "doc" / "widgets" / "README").write_text("\n\n".join(DOC_PARAGRAPHS * 3))
    (root / "doc" / "widgets" / "NEWS").write_text("\n\n".join(reversed(DOC_PARAGRAPHS)))
    (root / "locale").mkdir()
    (root / "py" / "widgets").mkdir(parents=True)
    (root / "py" / "widgets" / "store.py").write_text(FUNCTIONS)
    (root / "eval").mkdir()
    (root / "eval" / "gsm8k.jsonl").write_text(json.dumps({"turns": [GSM8K_LIKE]}) + "\n")
    # A planted evaluation prompt: the store's backup paragraph, which the builder must keep out of training
    (root / "eval" / "planted.jsonl").write_text(json.dumps({"turns": [f"Summarize: {DOC_PARAGRAPHS[3]}"]}) + "\n")
    return ["--gsm8k", str(root / "eval" / "gsm8k.jsonl"), "--eval-dir", str(root / "eval"),
            "--man-root", str(root / "man"), "--doc-root", str(root / "doc"), "--locale-root", str(root / "locale"),
            "--python-root", f"fake={root / 'py'}", "--cache-dir", str(root / "cache"), "--total", "40",
            "--heldout-percent", "1", "--heldout-size", "2"]


@pytest.fixture
def builder(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import build_training_prompts

    return build_training_prompts


@pytest.mark.skipif(shutil.which("man") is None, reason="renders man pages with man-db")
def test_builder_on_fake_sources(tmp_path, builder):
    options = _fake_machine(tmp_path)
    report = builder.main(["--out", str(tmp_path / "out")] + options)
    rows = [json.loads(line) for line in (tmp_path / "out" / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == report["total"] == sum(report["counts"].values()) > 10
    assert {"code", "math"} <= {row["domain"] for row in rows}
    assert all(len(row["turns"]) == 1 and row["turns"][0] for row in rows)
    assert not any("one copy every month, kept for a year" in row["turns"][0] for row in rows)
    assert sum(report["rejected_eval_overlap"].values()) >= 1
    again = builder.main(["--out", str(tmp_path / "again")] + options)
    assert (tmp_path / "again" / "prompts.jsonl").read_text() == (tmp_path / "out" / "prompts.jsonl").read_text()
    assert again["counts"] == report["counts"]


def test_builder_names_a_missing_source(tmp_path, builder, capsys):
    options = _fake_machine(tmp_path)
    options[options.index("--doc-root") + 1] = str(tmp_path / "nowhere")
    with pytest.raises(SystemExit):
        builder.parse_args(["--out", str(tmp_path / "out")] + options)
    assert "--doc-root" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("man") is None, reason="renders man pages with man-db")
def test_committed_heldout_sets_are_kept_and_kept_out(tmp_path, builder):
    options = _fake_machine(tmp_path)
    builder.main(["--out", str(tmp_path / "out")] + options)
    first = [json.loads(line)["turns"][0] for line in (tmp_path / "out" / "prompts.jsonl").read_text().splitlines()]
    # Held-out sets built on another machine, which quote prompts this machine would train on
    heldout_dir = tmp_path / "heldout"
    heldout_dir.mkdir()
    for index, name in enumerate(builder.HELDOUT_SETS):
        (heldout_dir / f"{name}.jsonl").write_text(json.dumps({"turns": [first[index]]}) + "\n")
    before = {path.name: path.read_text() for path in heldout_dir.iterdir()}
    report = builder.main(["--out", str(tmp_path / "again"), "--heldout-dir", str(heldout_dir)] + options)
    assert {path.name: path.read_text() for path in heldout_dir.iterdir()} == before
    assert report["heldout_rebuilt"] is False and sum(report["rejected_heldout_overlap"].values()) >= 1
    again = [json.loads(line)["turns"][0] for line in (tmp_path / "again" / "prompts.jsonl").read_text().splitlines()]
    assert not set(first[:len(builder.HELDOUT_SETS)]) & set(again)
