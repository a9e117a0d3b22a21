"""Shared fixtures: tiny random targets and drafters built in-process (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

import dspark_hf  # noqa: F401  (installs the generate integration)
from dspark_hf import DSparkDrafter


# Property tests draw the same examples on every run, so the suite passes or fails the same way in CI;
# `HYPOTHESIS_PROFILE=explore pytest ...` draws fresh random examples to hunt for new counterexamples.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

# Tiny models run ~10x faster single-threaded than fighting over two shared cores.
torch.set_num_threads(1)

# The default policy ("auto": hardware-aware on this machine's measured speeds) makes verification lengths depend on
# timings; tests pin the full block so that every draft is verified, and tests of "auto" unset this
# (tests/test_default_policy.py).
os.environ["DSPARK_HF_VERIFICATION_POLICY"] = "full"


TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
TARGET_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def make_target(arch: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random decoder-only target in eval mode."""
    config_class, model_class = TARGET_CLASSES[arch]
    kwargs = {**TINY, **overrides}
    if arch == "qwen3":
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    torch.manual_seed(seed)
    return model_class(config_class(**kwargs)).eval()


def make_drafter(target, seed: int = 1, **overrides) -> DSparkDrafter:
    kwargs = dict(block_size=4, num_hidden_layers=1, markov_rank=8)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return DSparkDrafter.from_target(target, **kwargs).eval()


@pytest.fixture
def target():
    return make_target()


@pytest.fixture
def drafter(target):
    return make_drafter(target)


@pytest.fixture
def modules_cache(tmp_path, monkeypatch):
    """Keeps transformers' dynamic-module copies of custom_generate/generate.py inside tmp_path."""
    import sys

    import transformers.dynamic_module_utils as dynamic_module_utils

    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
