"""Native grouped-query attention for multi-token forwards (`generation/gqa.py`): bitwise the same logits as
transformers' default path, switched on exactly for verification forwards on CPUs, and never left behind."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import DynamicCache

from conftest import make_drafter, make_target, with_cache
from dspark_hf.generation import gqa


# torch 2.6-2.8 round native GQA differently from repeated K/V: there it stays off (generation/gqa.py)
needs_native_gqa = pytest.mark.skipif(not gqa.NATIVE_GQA, reason="native GQA is off before torch 2.9")


@pytest.fixture(autouse=True)
def no_user_setting(monkeypatch):
    monkeypatch.delenv(gqa.FORCE_GQA, raising=False)


@needs_native_gqa
@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_token_forwards_are_bitwise_the_same(dtype):
    target = make_target("llama", num_attention_heads=4, num_key_value_heads=2).to(dtype)
    prompt = torch.tensor([[0, 0, 5, 17, 33, 8], [9, 12, 60, 61, 62, 63]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    cache = DynamicCache(config=target.config)
    target(input_ids=prompt, attention_mask=mask, **with_cache(cache), use_cache=True)
    new, new_mask = torch.tensor([[4, 5, 6], [7, 8, 9]]), torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], dim=1)
    positions = torch.tensor([[4, 5, 6], [6, 7, 8]])
    copied = target(input_ids=new, attention_mask=new_mask, position_ids=positions, **with_cache(cache)).logits
    cache.crop(-3)
    with gqa.native_gqa("cpu", 3):
        assert os.environ[gqa.FORCE_GQA] == "1"
        native = target(input_ids=new, attention_mask=new_mask, position_ids=positions, **with_cache(cache)).logits
    assert gqa.FORCE_GQA not in os.environ
    assert torch.equal(native, copied)


def test_only_multi_token_cpu_forwards_and_never_over_a_user_setting(monkeypatch):
    assert gqa.wanted("cpu", 2) == gqa.NATIVE_GQA and not gqa.wanted("cpu", 1) and not gqa.wanted("meta", 8)
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
    assert all((value == "1") == (width > 1 and gqa.NATIVE_GQA) for width, value in decoding), decoding
    assert gqa.FORCE_GQA not in os.environ


@needs_native_gqa
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


def _cached_step(target, width: int):
    """A left-padded 2-row cache and a forward of `width` new tokens per row over it: (logits, run again)."""
    prompt = torch.tensor([[0, 0, 5, 17, 33, 8, 2, 3], [9, 12, 60, 61, 62, 63, 64, 65]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    cache = DynamicCache(config=target.config)
    target(input_ids=prompt, attention_mask=mask, **with_cache(cache), use_cache=True)
    new = torch.randint(1, 90, (2, width), generator=torch.Generator().manual_seed(width))
    new_mask = torch.cat([mask, torch.ones(2, width, dtype=mask.dtype)], dim=1)
    new_mask[0, -1] = 0  # a hole among the new slots, as a shorter draft leaves
    positions = torch.tensor([[6], [8]]) + torch.arange(width)

    def forward():
        logits = target(input_ids=new, attention_mask=new_mask, position_ids=positions, **with_cache(cache)).logits
        cache.crop(-width)
        return logits

    return forward


@torch.no_grad()
@pytest.mark.parametrize("width", [2, 5, 8])
def test_packed_query_heads_give_the_same_logits(width):
    target = make_target("llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=2).to(torch.bfloat16)
    forward = _cached_step(target, width)
    copied = forward()
    with gqa.packed_gqa(target, width):
        assert target.config._attn_implementation == gqa.PACKED
        packed = forward()
    assert target.config._attn_implementation == "sdpa"
    torch.testing.assert_close(packed, copied, atol=2e-2, rtol=2e-2)  # bf16 rounding (bitwise on the CPUs measured)
    assert torch.equal(packed.argmax(-1), copied.argmax(-1))


@torch.no_grad()
def test_the_packed_implementation_itself_matches_in_float32():
    """The packing is exact arithmetic (each query row attends alone): float32 agrees to float32 rounding."""
    target = make_target("llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=2)
    forward = _cached_step(target, 5)
    copied = forward()
    target.config._attn_implementation = gqa.PACKED
    try:
        packed = forward()
    finally:
        target.config._attn_implementation = "sdpa"
    torch.testing.assert_close(packed, copied, atol=1e-5, rtol=1e-5)


def test_packing_only_for_short_multi_token_half_precision_forwards_of_sdpa_text_models():
    target = make_target("llama").to(torch.bfloat16)
    assert gqa.packing_wanted("cpu", 2) and gqa.packing_wanted("cpu", gqa.MAX_PACKED_TOKENS)
    assert not gqa.packing_wanted("cpu", 1) and not gqa.packing_wanted("cpu", gqa.MAX_PACKED_TOKENS + 1)
    assert not gqa.packing_wanted("meta", 4) and not gqa.packing_wanted("cpu", 4, torch.float32)
    with gqa.packed_gqa(target.float(), 4):
        assert target.config._attn_implementation == "sdpa"
    target.to(torch.bfloat16)
    for width in (1, gqa.MAX_PACKED_TOKENS + 1):
        with gqa.packed_gqa(target, width):
            assert target.config._attn_implementation == "sdpa"
    target.set_attn_implementation("eager")
    with gqa.packed_gqa(target, 4):
        assert target.config._attn_implementation == "eager"
    target.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="boom"), gqa.packed_gqa(target, 4):
        raise RuntimeError("boom")
    assert target.config._attn_implementation == "sdpa"


def test_ungrouped_or_unmasked_attention_is_transformers_sdpa():
    """Without query groups (or a mask to repeat) the packed implementation hands over to transformers' SDPA."""
    target = make_target("llama", num_attention_heads=4, num_key_value_heads=4).to(torch.bfloat16)
    forward = _cached_step(target, 3)
    copied = forward()
    with gqa.packed_gqa(target, 3):
        assert torch.equal(forward(), copied)


def test_the_batched_engine_packs_its_short_wide_forwards_and_the_drafters_block(monkeypatch):
    from dspark_hf.generation.batched import DSparkBatchEngine

    target = make_target("llama").to(torch.bfloat16)
    drafter = make_drafter(target, block_size=4).to(torch.bfloat16)
    seen, forward = [], target.forward
    drafted, draft_forward = [], drafter.forward

    def recording(*args, **kwargs):
        seen.append((kwargs["input_ids"].shape[1], target.config._attn_implementation))
        return forward(*args, **kwargs)

    def recording_drafter(*args, **kwargs):
        drafted.append(drafter.config._attn_implementation)
        return draft_forward(*args, **kwargs)

    prompts = [[5, 17, 33, 8, 41], [9, 12, 60, 61, 62, 70, 71, 72, 73, 74, 75]]
    monkeypatch.setattr(target, "forward", recording)
    monkeypatch.setattr(drafter, "forward", recording_drafter)
    engine = DSparkBatchEngine(target, drafter, policy="full", pad_token_id=0)
    for prompt in prompts:
        engine.add_request(prompt, max_new_tokens=12)
    # (bf16 outputs are compared with one-token decoding by the exactness benchmarks, not here: they may differ
    # at near-ties, by CPU)
    assert [len(r.output_ids) for r in engine.run()] == [12, 12]
    assert {width for width, _ in seen if 1 < width <= gqa.MAX_PACKED_TOKENS}
    assert all((name == gqa.PACKED) == (1 < width <= gqa.MAX_PACKED_TOKENS) for width, name in seen), seen
    assert drafted and set(drafted) == {gqa.PACKED}  # the drafter's block of 4
    assert target.config._attn_implementation == drafter.config._attn_implementation == "sdpa"
