"""A target cache filled by an earlier call (the previous turn of a chat) continued with a DSpark assistant.

transformers' assisted loop forwards the whole prompt in its first round, which on a pre-filled cache appends the
cached positions again at shifted ones; with a DSpark assistant the first forward starts after the cached positions
(as generate's prefill does without one), and the drafter drafts from the new positions' target features."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import cache_of, imitate_transitions, make_drafter, make_target, with_cache
from dspark_hf.generation.candidate_generator import DrafterContext
from transformers import DynamicCache

GREEDY = dict(do_sample=False, pad_token_id=0)


def _filled_cache(target, ids: torch.LongTensor) -> DynamicCache:
    with torch.no_grad():
        return cache_of(target(ids, use_cache=True))


def _imitating_pair(seed: int):
    """A target and a drafter that drafts the target's greedy transitions from a random start (accepted drafts)."""
    target = make_target(seed=seed)
    drafter = make_drafter(target, seed=seed + 1, markov_rank=97)
    start = torch.tensor([[11 + seed, 40, 7, 23]])
    greedy = target.generate(start, max_new_tokens=40, min_new_tokens=40, **GREEDY)[0].tolist()
    return target, imitate_transitions(drafter, dict(zip(greedy, greedy[1:]))), greedy


@pytest.mark.parametrize("seed", range(1, 5))
@pytest.mark.parametrize("cached", [1, 5, 11])
def test_continues_a_prefilled_cache_as_the_target_does(seed, cached):
    target, drafter, greedy = _imitating_pair(seed)
    prompt = torch.tensor([greedy[:12]])
    settings = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=24, **GREEDY)
    fixed = dict(num_assistant_tokens=4)  # the drafts are verified whatever their confidences
    cache = _filled_cache(target, prompt[:, :cached])
    expected = target.generate(prompt, **with_cache(copy.deepcopy(cache)), **settings)
    assert torch.equal(expected, target.generate(prompt, **settings))  # the reference itself
    out = target.generate(prompt, **with_cache(cache), assistant_model=drafter, **settings, **fixed)
    assert out.tolist() == expected.tolist()
    rounds = drafter.generation_stats.rounds
    assert max(r.accepted for r in rounds if r.drafted) >= 2  # multi-token rounds on top of the cached positions
    assert cache.get_seq_length() == out.shape[1] - 1  # the cache was continued, rejected drafts cropped


def test_a_chat_continues_turn_after_turn(target):
    """The cache a DSpark call returns continues the next turn exactly, with prompt lookup inside rounds too."""
    drafter = make_drafter(target, markov_rank=97)
    for lookup in ({}, {"prompt_lookup_num_tokens": 4}):
        turn, dspark_cache, own_cache = torch.tensor([[5, 9, 14, 2, 7]]), None, None
        for new_turn in ([31, 8, 8], [44, 3], [9, 9, 9, 9, 12]):
            settings = dict(attention_mask=torch.ones_like(turn), max_new_tokens=10, return_dict_in_generate=True,
                            **GREEDY)
            own = target.generate(turn, **with_cache(own_cache), **settings)
            ours = target.generate(turn, **with_cache(dspark_cache), assistant_model=drafter, **settings, **lookup)
            assert ours.sequences.tolist() == own.sequences.tolist()
            own_cache, dspark_cache = cache_of(own), cache_of(ours)
            context = DrafterContext._by_cache[dspark_cache]  # carried to the next turn, lookup rounds' features too
            positions = torch.cat([context.positions, *context._pending_positions]).tolist()
            assert positions == sorted(set(positions)) and positions[-1] < dspark_cache.get_seq_length()
            assert context.cache.get_seq_length() == context.positions.numel()
            turn = torch.cat([ours.sequences, torch.tensor([new_turn])], dim=-1)


def _record_context_positions(drafter) -> list[list[int]]:
    """The positions of the new context each drafter forward ingests, appended to the returned list as it runs."""
    seen = []
    original = type(drafter).forward

    def forward(self, *args, **kwargs):
        seen.append(kwargs["context_position_ids"][0].tolist())
        return original(self, *args, **kwargs)

    drafter.forward = forward.__get__(drafter)
    return seen


def test_the_drafter_drafts_from_the_uncached_positions(target):
    drafter = make_drafter(target)
    prompt = torch.tensor([[5, 9, 14, 2, 7, 30, 31, 32]])
    seen = _record_context_positions(drafter)
    target.generate(prompt, **with_cache(_filled_cache(target, prompt[:, :6])), assistant_model=drafter,
                    max_new_tokens=4, num_assistant_tokens=2, **GREEDY)
    assert seen and seen[0][0] == 6  # the cached positions 0-5 have no target features in this call


def test_the_drafter_continues_the_context_it_left_beside_the_cache(target):
    """A call that extends a cache a DSpark call returned drafts from the earlier positions' context too (kept beside
    that cache object), cut to what the cache still holds; another drafter, or a cache it never saw, starts anew."""
    drafter = make_drafter(target, markov_rank=97)
    seen = _record_context_positions(drafter)
    settings = dict(max_new_tokens=8, num_assistant_tokens=2, return_dict_in_generate=True, **GREEDY)
    first = target.generate(torch.tensor([[5, 9, 14, 2, 7]]), assistant_model=drafter, **settings)
    cache = cache_of(first)
    context = DrafterContext._by_cache[cache]
    turn_one = context.positions.tolist()
    assert turn_one == list(range(len(turn_one))) and context.end <= cache.get_seq_length()
    cached = cache.get_seq_length()
    turn = torch.cat([first.sequences, torch.tensor([[31, 8, 8]])], dim=-1)
    expected = target.generate(turn, **{**settings, "num_assistant_tokens": None})
    seen.clear()
    out = target.generate(turn, **with_cache(cache), assistant_model=drafter, **settings)
    assert out.sequences.tolist() == expected.sequences.tolist()
    assert DrafterContext._by_cache[cache] is context and context.positions[: len(turn_one)].tolist() == turn_one
    assert seen[0][0] == cached  # the new positions follow the carried ones
    assert context.cache.get_seq_length() == context.positions.numel() > len(turn_one)

    cache.crop(3 - cache.get_seq_length())  # a cache cut back keeps the context of the positions it still holds
    seen.clear()
    cut = target.generate(out.sequences[:, :6], **with_cache(cache), assistant_model=drafter, **settings)
    assert context.positions[:3].tolist() == [0, 1, 2] and seen[0][0] == 3
    assert context.cache.get_seq_length() == context.positions.numel()

    unseen = _filled_cache(target, turn[:, :4])
    target.generate(turn, **with_cache(unseen), assistant_model=drafter, **settings)
    assert DrafterContext._by_cache[unseen].positions[0] == 4
    cached = cache.get_seq_length()
    target.generate(torch.cat([cut.sequences, torch.tensor([[9]])], dim=-1), **with_cache(cache),
                    assistant_model=make_drafter(target, seed=5), **settings)
    assert DrafterContext._by_cache[cache] is not context and DrafterContext._by_cache[cache].positions[0] == cached


def test_the_target_instance_is_left_as_it_was(target, drafter):
    prompt = torch.tensor([[5, 9, 14, 2, 7]])
    target.generate(prompt, **with_cache(_filled_cache(target, prompt[:, :3])), assistant_model=drafter,
                    max_new_tokens=4, **GREEDY)
    assert "prepare_inputs_for_generation" not in vars(target)
    with pytest.raises(ValueError):  # a failing call restores it too
        target.generate(prompt, **with_cache(_filled_cache(target, prompt[:, :3])), assistant_model=drafter,
                        max_new_tokens=4, num_beams=2, **GREEDY)
    assert "prepare_inputs_for_generation" not in vars(target)


def test_a_cache_holding_the_whole_prompt_is_refused_with_the_fix(target, drafter):
    prompt = torch.tensor([[5, 9, 14, 2, 7]])
    with pytest.raises(ValueError, match=r"holds 5 positions, the whole prompt.*cache.crop\(-1\)"):
        target.generate(prompt, **with_cache(_filled_cache(target, prompt)), assistant_model=drafter, max_new_tokens=4,
                        **GREEDY)


def test_a_lora_target_continues_its_cache(target, drafter):
    """PEFT generates through its own `prepare_inputs_for_generation`; the first forward still skips the cache."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    lora = get_peft_model(target, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    prompt = torch.tensor([[5, 9, 14, 2, 7, 30, 31]])
    settings = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=12, **GREEDY)
    cache = _filled_cache(lora, prompt[:, :4])
    expected = lora.generate(input_ids=prompt, **with_cache(copy.deepcopy(cache)), **settings)
    assert torch.equal(expected, lora.generate(input_ids=prompt, **settings))
    out = lora.generate(input_ids=prompt, **with_cache(cache), assistant_model=drafter, num_assistant_tokens=3,
                        **settings)
    assert out.tolist() == expected.tolist()


def test_an_instance_level_prepare_is_wrapped_and_restored(target, drafter):
    """A wrapper that set its own `prepare_inputs_for_generation` on the target instance gets it back, and it is the
    one the first forward went through."""
    calls = []
    bound = target.prepare_inputs_for_generation

    def own(*args, **kwargs):
        calls.append(kwargs.get("next_sequence_length"))
        return bound(*args, **kwargs)

    target.prepare_inputs_for_generation = own
    prompt = torch.tensor([[5, 9, 14, 2, 7, 30, 31]])
    settings = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=6, **GREEDY)
    expected = target.generate(prompt, **settings)
    calls.clear()
    cache = _filled_cache(target, prompt[:, :4])
    out = target.generate(prompt, **with_cache(cache), assistant_model=drafter, **settings)
    assert out.tolist() == expected.tolist()
    assert calls[0] == 3 and vars(target)["prepare_inputs_for_generation"] is own


def test_an_unhashable_cache_is_continued_without_the_carried_context(target, drafter):
    class Unhashable(DynamicCache):  # a cache class of one's own that defines equality, say
        __hash__ = None

    prompt = torch.tensor([[5, 9, 14, 2, 7, 30, 31]])
    settings = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=6, **GREEDY)
    expected = target.generate(prompt, **settings)
    cache = Unhashable()
    with torch.no_grad():
        target(prompt[:, :4], **with_cache(cache), use_cache=True)
    out = target.generate(prompt, **with_cache(cache), assistant_model=drafter, **settings)
    assert out.tolist() == expected.tolist()
