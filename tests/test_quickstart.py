"""The quickstart example runs as documented (on its tiny default model)."""

import subprocess
import sys
from pathlib import Path


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
