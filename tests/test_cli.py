"""The command line as one program: one option spelling, helpful --help, one-line errors for bad paths and files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dspark_hf import cli
from dspark_hf.calibration import read_prompts


def _run(capsys, *argv):
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--drafter", "/nonexistent"],
        ["profile", "--drafter", "/nonexistent"],
        ["bench-load", "--drafter", "/nonexistent", "--prompts", "p.jsonl", "--output_dir", "out"],
        ["reduce-vocab", "--drafter", "/nonexistent", "--data", "d", "--output_dir", "out"],
    ],
)
def test_missing_drafter_folder_is_one_line(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(capsys, *argv)
    assert code == 2
    assert err.strip() == f"dspark-hf {argv[0]}: error: --drafter /nonexistent: no such folder."
    assert not any(tmp_path.iterdir())  # profile used to write a file at the path it was given


def test_bench_checks_both_drafters_before_loading(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["hi"]}) + "\n")
    code, _, err = _run(capsys, "bench", "--prompts", str(prompts), "--drafter", "untrained",
                        "--dflash_drafter", str(tmp_path / "missing"), "--output_dir", str(tmp_path / "out"))
    assert code == 2 and err.strip().endswith(f"--dflash_drafter {tmp_path / 'missing'}: no such folder.")


def test_folder_or_file_that_is_not_a_model(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.json").write_text("{}")
    for path, message in ((tmp_path / "empty", "the folder has no config.json"), (tmp_path / "file.json", "is a file"),
                          ("org/some-drafter", "no such local folder, and the Hub is offline")):
        code, _, err = _run(capsys, "demo", "--drafter", str(path))
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_calibrate_reads_the_prompt_formats_prepare_data_reads(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    records = [{"prompt": "one"}, {"turns": ["two", "later"]}, {"messages": [{"role": "user", "content": "three"}]},
               {"question": "four"}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert read_prompts(path) == ["one", "two", "three", "four"]
    assert read_prompts(path, first_line=2, num_prompts=2) == ["two", "three"]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"answer": 1}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: Cannot find a prompt"):
        read_prompts(tmp_path / "bad.jsonl")
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text("{}")
    code, _, err = _run(capsys, "calibrate", "--drafter", str(tmp_path / "drafter"), "--prompts",
                        str(tmp_path / "nope.jsonl"), "--output_dir", str(tmp_path / "out"))
    assert code == 2 and "--prompts" in err and "no such file" in err and len(err.strip().splitlines()) == 1


def test_one_spelling_with_the_other_accepted():
    from dspark_hf.demo import _parse_args

    snake = _parse_args(["--max_new_tokens", "5", "--drafter_dtype", "float32", "--no_stream"])
    kebab = _parse_args(["--max-new-tokens=5", "--drafter-dtype", "float32", "--no-stream"])
    assert vars(snake) == vars(kebab) and snake.max_new_tokens == 5
    with pytest.raises(SystemExit):
        _parse_args(["--max_new_token", "5"])  # a typo is still an error


@pytest.mark.parametrize("command", ["demo", "bench", "bench-load", "bench-merge", "reduce-vocab", "profile", "train",
                                     "prepare-data", "calibrate", "push", "trace", "simulate"])
def test_help_names_the_command_and_states_defaults_once(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dspark-hf {command}")
    assert "(default: None)" not in out
    for option_help in out.split("\n  -")[1:]:
        assert option_help.count("(default:") <= 1, option_help


def test_top_level_help_points_to_command_help():
    result = subprocess.run([sys.executable, "-m", "dspark_hf.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "COMMAND --help" in result.stdout


def test_errors_from_the_console_have_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "dspark_hf.cli", "demo", "--drafter", str(tmp_path / "x")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"dspark-hf demo: error: --drafter {tmp_path / 'x'}: no such folder."
