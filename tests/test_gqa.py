"""Native grouped-query attention for multi-token forwards (`generation/gqa.py`): bitwise the same logits as
transformers' default path, switched on exactly for verification forwards on CPUs, and never left behind."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import DynamicCache

from conftest import make_drafter, make_target
from dspark_hf.generation import gqa


@pytest.fixture(autouse=True)
def no_user_setting(monkeypatch):
    monkeypatch.delenv(gqa.FORCE_GQA, raising=False)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_token_forwards_are_bitwise_the_same(dtype):
    target = make_target("llama", num_attention_heads=4, num_key_value_heads=2).to(dtype)
    prompt = torch.tensor([[0, 0, 5, 17, 33, 8], [9, 12, 60, 61, 62, 63]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    cache = DynamicCache(config=target.config)
    target(input_ids=prompt, attention_mask=mask, cache=cache, use_cache=True)
    new, new_mask = torch.tensor([[4, 5, 6], [7, 8, 9]]), torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], dim=1)
    positions = torch.tensor([[4, 5, 6], [6, 7, 8]])
    copied = target(input_ids=new, attention_mask=new_mask, position_ids=positions, cache=cache).logits
    cache.crop(-3)
    with gqa.native_gqa("cpu", 3):
        assert os.environ[gqa.FORCE_GQA] == "1"
        native = target(input_ids=new, attention_mask=new_mask, position_ids=positions, cache=cache).logits
    assert gqa.FORCE_GQA not in os.environ
    assert torch.equal(native, copied)


def test_only_multi_token_cpu_forwards_and_never_over_a_user_setting(monkeypatch):
    assert gqa.wanted("cpu", 2) and not gqa.wanted("cpu", 1) and not gqa.wanted("meta", 8)
    with gqa.native_gqa("cpu", 1):
        assert gqa.FORCE_GQA not in os.environ
    monkeypatch.setenv(gqa.FORCE_GQA, "0")
    with gqa.native_gqa("cpu", 4):
        assert os.environ[gqa.FORCE_GQA] == "0"
    gqa.use_native_gqa(True)
    gqa.use_native_gqa(False)
    assert os.environ[gqa.FORCE_GQA] == "0"


def _record_forwards(monkeypatch, target) -> list[tuple[int, str | None]]:
    """(new tokens per row, TRANSFORMERS_SDPA_FORCE_GQA) of every target forward."""
    seen, forward = [], target.forward

    def recording(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append((ids.shape[1], os.environ.get(gqa.FORCE_GQA)))
        return forward(*args, **kwargs)

    monkeypatch.setattr(target, "forward", recording)
    return seen


@pytest.mark.parametrize("rows", [1, 2])
def test_generate_uses_it_for_verification_forwards_only(monkeypatch, rows):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    drafter.verification_policy = "full"
    prompts = torch.tensor([[5, 17, 33, 8, 41], [9, 12, 60, 61, 62]][:rows])
    expected = target.generate(prompts, do_sample=False, max_new_tokens=12, pad_token_id=0)
    seen = _record_forwards(monkeypatch, target)
    actual = target.generate(prompts, assistant_model=drafter, do_sample=False, max_new_tokens=12, pad_token_id=0)
    assert actual.tolist() == expected.tolist()
    decoding = seen[1:]  # after the prefill
    assert any(width > 1 for width, _ in decoding)
    assert all((value == "1") == (width > 1) for width, value in decoding), decoding
    assert gqa.FORCE_GQA not in os.environ


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_left_padded_prefills_are_bitwise_the_same(dtype):
    """The batched engine admits under native GQA too: a left-padded multi-prompt prefill gives the same logits."""
    target = make_target("llama", num_attention_heads=4, num_key_value_heads=2).to(dtype)
    ids = torch.randint(1, 90, (3, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, :9], mask[2, :31] = 0, 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    copied = target(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    with gqa.native_gqa("cpu", ids.shape[1]):
        native = target(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    assert torch.equal(copied[mask.bool()], native[mask.bool()])


def test_an_error_inside_generate_leaves_nothing_behind(monkeypatch):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    drafter.verification_policy = "full"
    forward, calls = target.forward, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return forward(*args, **kwargs)

    monkeypatch.setattr(target, "forward", failing)
    with pytest.raises(RuntimeError, match="boom"):
        target.generate(torch.tensor([[5, 17, 33, 8, 41]]), assistant_model=drafter, do_sample=False,
                        max_new_tokens=12, pad_token_id=0)  # fmt: skip
    assert gqa.FORCE_GQA not in os.environ
