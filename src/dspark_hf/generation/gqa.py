"""Grouped-query attention without copying K/V, for the multi-token forwards of speculative decoding on CPUs.

transformers' SDPA attention, for a model with fewer K/V heads than query heads, repeats every K/V head for its query
heads (`repeat_kv`: a copy of the layer's whole cache, every layer, every forward) when the forward has more than one
query token and an attention mask, as verification forwards do, unless `TRANSFORMERS_SDPA_FORCE_GQA=1` hands the
grouping to torch's kernel (`enable_gqa`). On CPUs that kernel gives bitwise the same outputs for multi-token queries
without the copy from torch 2.9 on (`tests/test_gqa.py`; on 2.6-2.8, which round differently, the copy stays):
SmolLM2-135M in bf16 (9 query heads over 3 K/V heads, 250-token cache) verified 8 tokens at batch 1 in 68 instead of
72 ms, and 2 tokens per row at 32 rows in 156 instead of 223 ms (`benchmarks/results/gqa/`).

Batch 1 uses it for the target's verification forwards (`DSparkCandidateGenerator`), the batched engine for every
forward of 2+ tokens per row (verification, the drafter's block, admission prefills). There its hardware-aware policy
verifies more under load; replayed on measured costs with the measured native / copied ratios at 8-32 rows, that pays
(+2 to +10% at full load, `benchmarks/results/gqa/sim-engine/`), while bench-load runs on a host whose speed swung by
up to 40% could not tell either way (README there).

Single-token forwards keep transformers' own path (`pack_gqa`), whose rounding differs from `enable_gqa`'s in the
last bits: plain decoding rounds stay bitwise target-only decoding. A `TRANSFORMERS_SDPA_FORCE_GQA` the user set is
left alone, and GPUs keep transformers' choice (there `enable_gqa` with a mask falls back to the math kernel).

Short multi-token forwards go one step further in the batched engine ([`packed_gqa`]): torch's CPU kernel runs
`enable_gqa` head by head, each head's few query rows against the whole cache, so that a 4-token verification at 32
rows cost 3x a 1-token step in attention. Packing each K/V head's query heads into one query of `groups x tokens`
rows (as transformers' `pack_gqa` does for one token), with the mask repeated for each head, reads every K/V head
once per forward: per layer, 2-4 tokens at 16-32 rows in bf16 in 0.5-0.6x the time, 8 tokens in 0.75x; whole
forwards of 2-8 tokens at 16-32 rows in 0.86-0.94x, at 8 rows 0.87-0.97x, logits bitwise equal to the unpacked
kernel's in all 20 cases measured (`benchmarks/results/gqa/packed.json`). In float32 packing did not pay and was not
bitwise at 2 tokens (`packed-fp32.json`), so it runs in half precision only.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch
from packaging import version
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

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


# torch's CPU kernel gives `enable_gqa` bitwise the outputs of repeated K/V from torch 2.9 on; 2.6-2.8 round
# differently in the last bits (tests/test_gqa.py, run under each), so there verification keeps transformers' copy.
NATIVE_GQA = version.parse(torch.__version__).release[:2] >= (2, 9)


def wanted(device: torch.device | str, num_new_tokens: int) -> bool:
    """Whether a forward of `num_new_tokens` per row on `device` should run with native grouped-query attention."""
    return NATIVE_GQA and num_new_tokens > 1 and torch.device(device).type == "cpu"


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


# The attention implementation [`packed_gqa`] switches a target to for a forward: SDPA with packed query heads.
PACKED = "dspark_packed_sdpa"
# Packing pays up to this many new tokens per row (16 tokens ran slower packed than unpacked at 8-32 rows).
MAX_PACKED_TOKENS = 8


def packed_sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention with each K/V head's query heads packed into one query: `query` (batch, heads,
    tokens, dim) runs as (batch, kv_heads, groups · tokens, dim) against the unrepeated K/V, under the mask repeated
    for every head of a group. Anything else (no grouping, one token, no 4-D mask shared by all heads, dropout, a
    position bias or softcap) is transformers' SDPA attention unchanged."""
    batch, heads, tokens, dim = query.shape
    groups = heads // key.shape[1]
    packable = (groups > 1 and tokens > 1 and not dropout and attention_mask is not None and attention_mask.dim() == 4
                and attention_mask.shape[1] == 1 and kwargs.get("position_bias") is None
                and kwargs.get("softcap") is None)
    if not packable:
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    rows, slots = attention_mask.shape[0], attention_mask.shape[-1]
    mask = attention_mask[:, :, None].expand(rows, 1, groups, tokens, slots).reshape(rows, 1, groups * tokens, slots)
    output = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, heads // groups, groups * tokens, dim), key, value, attn_mask=mask, scale=scaling)
    return output.reshape(batch, heads, tokens, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED, packed_sdpa_attention_forward)
AttentionMaskInterface.register(PACKED, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])

_switchable: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def _packable_model(model: torch.nn.Module) -> bool:
    """Whether every attention module of `model` reads one config that runs SDPA (checked once per model)."""
    if model not in _switchable:
        config = getattr(model, "config", None)
        _switchable[model] = config is not None and not getattr(config, "sub_configs", None) and all(
            module.config is config for module in model.modules() if isinstance(module, PreTrainedModel))
    return _switchable[model] and model.config._attn_implementation == "sdpa"


def packing_wanted(device: torch.device | str, num_new_tokens: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a forward of `num_new_tokens` per row on `device` in `dtype` should pack query heads ([`packed_gqa`]):
    on CPUs, in half precision. In float32 it did not pay (0.86-1.10x the unpacked time at 1-32 rows, 2-8 tokens),
    and 2-token forwards rounded differently in the last bits, where float32 is the dtype of bitwise claims."""
    return (1 < num_new_tokens <= MAX_PACKED_TOKENS and torch.device(device).type == "cpu"
            and dtype in (torch.bfloat16, torch.float16))


@contextlib.contextmanager
def packed_gqa(model: torch.nn.Module, num_new_tokens: int):
    """Runs `model` on packed grouped-query attention ([`packed_sdpa_attention_forward`]) inside the block when
    [`packing_wanted`] and the model runs SDPA (a text model with one config); its implementation is restored after."""
    if not (packing_wanted(model.device, num_new_tokens, getattr(model, "dtype", None)) and _packable_model(model)):
        yield
        return
    model.config._attn_implementation = PACKED
    try:
        yield
    finally:
        model.config._attn_implementation = "sdpa"
