"""Builds the training prompt corpus of the 10x data campaign (issue 19, item 3), and the held-out prompt sets.

Domains and target mix (of `--total` prompts): code 30%, math 15%, chat/explanations 15%, summarization 10%,
translation 10%, question answering over a passage 10%, rewriting 10%. Every prompt is single-turn,
`{"turns": ["..."], "domain": "..."}`, and the file is shuffled across domains. Sources, all on the machine:

- math: GSM8K lines 501-1100 of the shared eval file (lines 1-500 are evaluation, 1101-1319 calibration), and word
  problems from 25 templates with varied names, numbers, units and questions (`training_prompts/math.py`);
- code: functions of the Python standard library and of the installed site-packages (PSF, MIT, BSD and Apache
  licences), as stubs to complete, one-line requests, "add a docstring", "fix the bug" (a planted bug), "explain"
  and "write tests"; functions named by the first campaign's prompts (`--exclude-prompts`, all standard-library
  functions) are left out by name, in every tree;
- chat: questions about the commands, C functions, file formats and SQL statements of the man pages in
  /usr/share/man, about Python modules and functions, and "explain this" over documentation passages;
- summarization, passage QA, rewriting and English-to-X translation: prose passages of the rendered man pages,
  of /usr/share/doc (README, NEWS, manuals; paragraphs the first campaign used are left out) and of module
  docstrings; passage QA asks questions answered in the passage (conditional sentences, definitions, options);
- X-to-English translation: French, Spanish, German, Italian, Portuguese and Chinese man pages and the gettext
  catalogs of /usr/share/locale (messages of GPL/LGPL programs, used as text to translate, not redistributed code).

A source unit (a man page, a documentation file, a Python file, a message catalog) is either training or held-out,
by a hash of its name (`--heldout-percent`); the held-out sets (`--heldout-dir`, 40 prompts each of summarization,
translation, passage QA, rewriting, code stubs and code requests) come from held-out units only. No training prompt
may overlap an evaluation prompt (every line of `--eval-dir`'s jsonl files except GSM8K 501-1100) nor the source
text (passage, function, messages) of a held-out prompt: see `dspark_hf.training.contamination`. With
`--tokenizer`, prompts longer than `--max-prompt-tokens` (chat template included) are dropped. Man pages are
rendered once by `man` and cached in `--cache-dir`. Deterministic for a given machine and seed.

    python scripts/build_training_prompts.py --out /work/data/prompts-v2 --heldout-dir benchmarks/prompts \\
        --gsm8k ../shared/data/eval/gsm8k.jsonl --eval-dir ../shared/data/eval \\
        --exclude-prompts /work/data/prompts-v1/*.jsonl --tokenizer smollm2-135m-instruct \\
        --report benchmarks/results/smollm2-training/prompts-v2.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))  # training_prompts/ and smollm2_prompts.py live beside it

from training_prompts import material as sources  # noqa: E402
from training_prompts.pools import HELDOUT_SETS, SHARES, heldout_sets, training_pools  # noqa: E402

from dspark_hf.training.contamination import EvalOverlapIndex, prompt_file_texts  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder (prompts.jsonl and report.json)")
    parser.add_argument("--gsm8k", type=Path, required=True, help="the GSM8K eval file (lines 501-1100 are used)")
    parser.add_argument("--eval-dir", type=Path, required=True, help="folder of the evaluation jsonl files")
    parser.add_argument("--heldout-dir", type=Path, default=None,
                        help="the held-out prompt sets: read when they exist (they stay fixed from machine to "
                             "machine), else written here")
    parser.add_argument("--rebuild-heldout", action="store_true",
                        help="write new held-out sets into --heldout-dir even where they exist")
    parser.add_argument("--exclude-prompts", type=Path, nargs="*", default=[],
                        help="earlier prompt files whose functions and doc paragraphs are not used again")
    parser.add_argument("--total", type=int, default=30000, help="training prompts to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout-percent", type=int, default=4, help="percent of source units held out")
    parser.add_argument("--heldout-size", type=int, default=40, help="prompts per held-out set")
    parser.add_argument("--man-root", type=Path, default=Path("/usr/share/man"))
    parser.add_argument("--doc-root", type=Path, nargs="+", default=[Path("/usr/share/doc")],
                        help="documentation folders (site-packages' READMEs are read too)")
    parser.add_argument("--locale-root", type=Path, default=Path("/usr/share/locale"))
    parser.add_argument("--python-root", action="append", default=None, metavar="NAME=FOLDER",
                        help="Python source trees (default: stdlib=the standard library, site=site-packages)")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/dspark-prompt-cache"))
    parser.add_argument("--tokenizer", default=None, help="target name or tokenizer folder, to measure prompt lengths")
    parser.add_argument("--max-prompt-tokens", type=int, default=700)
    parser.add_argument("--report", type=Path, default=None, help="also write the report JSON here")
    args = parser.parse_args(argv)
    for name in ("gsm8k", "eval_dir", "man_root", "doc_root", "locale_root"):
        for path in getattr(args, name) if name == "doc_root" else [getattr(args, name)]:
            if not path.exists():
                parser.error(f"--{name.replace('_', '-')} {path} does not exist; pass the right path.")
    for path in args.exclude_prompts:
        if not path.is_file():
            parser.error(f"--exclude-prompts: {path} is not a file; pass the earlier campaign's prompt jsonl files.")
    if args.total <= 0 or not 0 < args.heldout_percent < 50:
        parser.error(f"--total must be > 0 and --heldout-percent in 1..49, got {args.total}, {args.heldout_percent}.")
    try:
        args.python_roots = sources.python_roots(args.python_root)
    except ValueError as error:
        parser.error(str(error))
    return args


def committed_heldout(heldout_dir: Path | None) -> dict[str, list[tuple[str, str]]] | None:
    """The held-out sets already in `heldout_dir`, as (prompt, text to keep out of training) pairs; `None` if any is
    missing. The source material differs from machine to machine, so sets built elsewhere are kept, not rebuilt: a
    training prompt is then rejected when it overlaps the held-out prompt itself (which quotes its passage or code)."""
    if heldout_dir is None or not all((heldout_dir / f"{name}.jsonl").is_file() for name in HELDOUT_SETS):
        return None
    return {name: [(text, text) for text in prompt_file_texts(heldout_dir / f"{name}.jsonl")] for name in HELDOUT_SETS}


def eval_index(eval_dir: Path) -> tuple[EvalOverlapIndex, list[str]]:
    """The overlap index of every evaluation prompt, GSM8K's training lines 501-1100 left out."""
    files = sorted(eval_dir.glob("*.jsonl"))
    if not files:
        raise SystemExit(f"No *.jsonl files in --eval-dir {eval_dir}; pass the folder of the evaluation sets.")
    texts = []
    for path in files:
        texts += prompt_file_texts(path, skip_lines=(501, 1100) if path.stem == "gsm8k" else None)
    return EvalOverlapIndex(texts), [str(path) for path in files]


def prompt_lengths(tokenizer_name: str | None):
    """A function giving a prompt's token count under the tokenizer's chat template, or `None` without a tokenizer."""
    if tokenizer_name is None:
        return None
    from transformers import AutoTokenizer

    from dspark_hf.models import resolve_target_path

    path = tokenizer_name if Path(tokenizer_name).is_dir() else resolve_target_path(tokenizer_name)
    tokenizer = AutoTokenizer.from_pretrained(path)

    def length(prompt: str) -> int:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return length


def select(pools: dict[str, list[str]], quotas: dict[str, int], indexes: dict[str, EvalOverlapIndex], length,
           max_tokens: int) -> dict:
    """The first `quotas[domain]` prompts of each pool that overlap nothing in `indexes` and fit `max_tokens`, with
    the rejections counted per domain and per reason."""
    chosen, lengths, examples = {}, {}, {}
    rejected = {reason: Counter() for reason in list(indexes) + ["too_long"]}
    for domain, pool in pools.items():
        chosen[domain], lengths[domain], seen = [], [], set()
        for prompt in pool:
            if len(chosen[domain]) == quotas[domain]:
                break
            if prompt in seen:
                continue
            seen.add(prompt)
            overlaps = [(name, index.overlap(prompt)) for name, index in indexes.items()]
            name, reason = next(((name, reason) for name, reason in overlaps if reason), (None, None))
            if reason is not None:
                rejected[name][domain] += 1
                examples.setdefault(domain, f"{name}: {reason}: {prompt[:160]!r}")
                continue
            num_tokens = length(prompt) if length else None
            if num_tokens is not None and num_tokens > max_tokens:
                rejected["too_long"][domain] += 1
                continue
            chosen[domain].append(prompt)
            if num_tokens is not None:
                lengths[domain].append(num_tokens)
    return {"chosen": chosen, "rejected": rejected, "lengths": lengths, "examples": examples}


def _length_stats(values: list[int]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"mean": round(sum(ordered) / len(ordered), 1), "p50": ordered[len(ordered) // 2],
            "p95": ordered[int(len(ordered) * 0.95)], "max": ordered[-1]}


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    material = sources.gather(args)
    train, held = material.split(args.heldout_percent)
    index, eval_files = eval_index(args.eval_dir)
    heldout = committed_heldout(args.heldout_dir) if not args.rebuild_heldout else None
    rebuilt = heldout is None
    if rebuilt:
        heldout = {name: [(prompt, text) for prompt, text in pairs if index.overlap(prompt) is None][:args.heldout_size]
                   for name, pairs in heldout_sets(held, args.heldout_size, args.seed).items()}
    heldout_index = EvalOverlapIndex([text for pairs in heldout.values() for _, text in pairs])
    quotas = {domain: round(args.total * share) for domain, share in SHARES.items()}
    pools, code_shapes = training_pools(train, quotas, args.gsm8k, args.seed)
    length = prompt_lengths(args.tokenizer)
    picked = select(pools, quotas, {"eval": index, "heldout": heldout_index}, length, args.max_prompt_tokens)
    rows = [{"turns": [prompt], "domain": domain} for domain, prompts in picked["chosen"].items() for prompt in prompts]
    random.Random(args.seed).shuffle(rows)
    write_jsonl(rows, args.out / "prompts.jsonl")
    if args.heldout_dir is not None and rebuilt:
        for name in HELDOUT_SETS:
            write_jsonl([{"turns": [prompt]} for prompt, _ in heldout[name]], args.heldout_dir / f"{name}.jsonl")
    report = {
        "command": "python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "seed": args.seed, "total": len(rows), "target_total": args.total,
        "counts": {domain: len(prompts) for domain, prompts in picked["chosen"].items()}, "quotas": quotas,
        "candidates": {domain: len(pool) for domain, pool in pools.items()},
        "rejected_eval_overlap": dict(picked["rejected"]["eval"]),
        "rejected_heldout_overlap": dict(picked["rejected"]["heldout"]),
        "rejected_too_long": dict(picked["rejected"]["too_long"]),
        "max_prompt_tokens": args.max_prompt_tokens if length else None, "tokenizer": args.tokenizer,
        "prompt_tokens": {domain: _length_stats(values) for domain, values in picked["lengths"].items() if values},
        "code_shapes": code_shapes, "heldout_sets": {name: len(pairs) for name, pairs in heldout.items()},
        "heldout_rebuilt": rebuilt,
        "heldout_percent": args.heldout_percent, "sources": material.summary(), "eval_files": eval_files,
        "overlap_rule": "reject a shared 13-word n-gram, or >50% of the prompt's 8-grams in one eval prompt "
                        "(lower-cased words; 8-grams found in >=5 eval texts are boilerplate and ignored); checked "
                        "against the eval files and against the source text of every held-out prompt",
        "first_rejection_per_domain": picked["examples"],
    }
    for path in [args.out / "report.json"] + ([args.report] if args.report else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps({key: report[key] for key in ("total", "counts", "rejected_eval_overlap",
                                                   "rejected_heldout_overlap", "rejected_too_long")}))
    return report


if __name__ == "__main__":
    main()
