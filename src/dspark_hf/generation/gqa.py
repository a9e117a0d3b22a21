"""Grouped-query attention without copying K/V, for the multi-token forwards of speculative decoding on CPUs.

transformers' SDPA attention, for a model with fewer K/V heads than query heads, repeats every K/V head for its query
heads (`repeat_kv`: a copy of the layer's whole cache, every layer, every forward) when the forward has more than one
query token and an attention mask, as verification forwards do, unless `TRANSFORMERS_SDPA_FORCE_GQA=1` hands the
grouping to torch's kernel (`enable_gqa`). On CPUs that kernel gives bitwise the same outputs for multi-token queries
(`tests/test_gqa.py`) without the copy: SmolLM2-135M in bf16 (9 query heads over 3 K/V heads, 250-token cache)
verified 8 tokens at batch 1 in 68 instead of 72 ms, and 2 tokens per row at 32 rows in 156 instead of 223 ms
(`benchmarks/results/gqa/`).

Batch 1 uses it for the target's verification forwards (`DSparkCandidateGenerator`), the batched engine for every
forward of 2+ tokens per row (verification, the drafter's block, admission prefills). There its hardware-aware policy
verifies more under load; replayed on measured costs with the measured native / copied ratios at 8-32 rows, that pays
(+2 to +10% at full load, `benchmarks/results/gqa/sim-engine/`), while bench-load runs on a host whose speed swung by
up to 40% could not tell either way (README there).

Single-token forwards keep transformers' own path (`pack_gqa`), whose rounding differs from `enable_gqa`'s in the
last bits: plain decoding rounds stay bitwise target-only decoding. A `TRANSFORMERS_SDPA_FORCE_GQA` the user set is
left alone, and GPUs keep transformers' choice (there `enable_gqa` with a mask falls back to the math kernel).
"""

from __future__ import annotations

import contextlib
import os

import torch

FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"
_set_by_us = False


def use_native_gqa(on: bool) -> None:
    """Sets `TRANSFORMERS_SDPA_FORCE_GQA=1` (`on`) or removes it if this module set it (`not on`)."""
    global _set_by_us
    if on and FORCE_GQA not in os.environ:
        os.environ[FORCE_GQA], _set_by_us = "1", True
    elif not on and _set_by_us:
        os.environ.pop(FORCE_GQA, None)
        _set_by_us = False


def wanted(device: torch.device | str, num_new_tokens: int) -> bool:
    """Whether a forward of `num_new_tokens` per row on `device` should run with native grouped-query attention."""
    return num_new_tokens > 1 and torch.device(device).type == "cpu"


@contextlib.contextmanager
def native_gqa(device: torch.device | str, num_new_tokens: int):
    """Native grouped-query attention inside the block when [`wanted`] (and not already set by someone else)."""
    if not wanted(device, num_new_tokens) or FORCE_GQA in os.environ:
        yield
        return
    use_native_gqa(True)
    try:
        yield
    finally:
        use_native_gqa(False)
