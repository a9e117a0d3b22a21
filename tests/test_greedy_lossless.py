"""Greedy DSpark output is token-for-token the target's own greedy output, whatever the drafter."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_drafter, make_target


drafter_settings = st.fixed_dictionaries(
    {
        "block_size": st.integers(1, 6),
        "num_hidden_layers": st.integers(1, 2),
        "markov_rank": st.sampled_from([0, 4, 16]),
        "markov_head_type": st.sampled_from(["vanilla", "gated", "rnn"]),
        "enable_confidence_head": st.booleans(),
        "confidence_head_with_markov": st.booleans(),
        "target_layer_ids": st.sampled_from([[0], [1, 2], [-1, 0, 2]]),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from(["llama", "qwen2", "qwen3"]),
    target_seed=st.integers(0, 10_000),
    drafter_seed=st.integers(0, 10_000),
    drafter_kwargs=drafter_settings,
    prompt=st.lists(st.integers(3, 96), min_size=1, max_size=12),
    max_new_tokens=st.integers(1, 24),
)
def test_greedy_identical_to_target(arch, target_seed, drafter_seed, drafter_kwargs, prompt, max_new_tokens):
    target = make_target(arch, seed=target_seed)
    drafter = make_drafter(target, seed=drafter_seed, **drafter_kwargs)
    input_ids = torch.tensor([prompt])
    expected = target.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens)
    actual = target.generate(input_ids, assistant_model=drafter, do_sample=False, max_new_tokens=max_new_tokens)
    assert actual.tolist() == expected.tolist()
    stats = drafter.generation_stats
    assert stats.accepted <= stats.verified <= stats.num_rounds * drafter.config.block_size


@settings(max_examples=25, deadline=None)
@given(target_seed=st.integers(0, 10_000), eos_index=st.integers(1, 15), block_size=st.integers(2, 6))
def test_eos_inside_a_draft_stops_like_the_target(target_seed, eos_index, block_size):
    """Pick the EOS among tokens the target really emits, so it lands inside accepted drafts."""
    target = make_target("llama", seed=target_seed)
    prompt = torch.tensor([[5, 17, 33, 8]])
    free_run = target.generate(prompt, do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    eos = int(free_run[0, prompt.shape[1] + eos_index - 1])
    # A drafter that copies the target's own greedy continuation gets long accepted runs through the EOS.
    drafter = make_drafter(target, block_size=block_size, markov_rank=0)
    expected = target.generate(prompt, do_sample=False, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    actual = target.generate(
        prompt, assistant_model=drafter, do_sample=False, max_new_tokens=30, eos_token_id=eos, pad_token_id=0
    )
    assert actual.tolist() == expected.tolist()
    assert int(actual[0, -1]) == eos


def test_max_new_tokens_cuts_a_draft(target):
    """With block_size > max_new_tokens every round's draft is cut by the length budget."""
    drafter = make_drafter(target, block_size=6)
    prompt = torch.tensor([[4, 9, 21]])
    for max_new_tokens in range(1, 9):
        expected = target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens)
        actual = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=max_new_tokens)
        assert actual.tolist() == expected.tolist()
        assert actual.shape[1] == prompt.shape[1] + max_new_tokens
        # No round may verify more drafts than the budget left after the bonus token.
        assert all(r.verified <= max(max_new_tokens - 2, 0) for r in drafter.generation_stats.rounds)
