"""Prompt lookup inside DSpark rounds (`prompt_lookup_num_tokens` with a DSpark drafter): where lookup drafts come from,
how many are verified, and that greedy output stays the target's own. Sampling: tests/test_sampling_exact.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import left_pad, make_drafter, make_target, solo
from dspark_hf.generation.lookup import NgramIndex, PromptLookup, find_continuation, match_continuation
from dspark_hf.generation.policies import FixedLengthPolicy, HardwareAwarePolicy


def test_find_continuation_takes_the_latest_occurrence_of_the_longest_suffix():
    ids = torch.tensor([7, 5, 6, 1, 2, 8, 5, 6, 3, 4, 7, 5, 6])
    assert find_continuation(ids, 2, max_ngram=2).tolist() == [3, 4]  # "5 6": the latest earlier occurrence
    assert find_continuation(ids, 2, max_ngram=3).tolist() == [1, 2]  # "7 5 6" occurred only at the start
    assert find_continuation(ids, 10, max_ngram=3).tolist() == [1, 2, 8, 5, 6, 3, 4, 7, 5, 6]


def test_find_continuation_needs_two_matching_tokens():
    assert find_continuation(torch.tensor([4, 9, 1, 4]), 3).numel() == 0  # "4" alone recurs: not a match
    assert find_continuation(torch.tensor([4, 9, 1, 2, 4, 9]), 3).tolist() == [1, 2, 4]
    assert find_continuation(torch.tensor([3]), 3).numel() == 0
    assert find_continuation(torch.tensor([3, 3, 3]), 4).tolist() == [3]  # overlapping: "3 3" at 0 is followed by 3


def test_lookup_drafts_stop_before_eos_and_within_the_budget():
    lookup = PromptLookup(num_tokens=5, eos_token_ids=[2])
    ids = torch.tensor([[8, 9, 4, 6, 2, 7, 8, 9]])
    assert lookup.candidates(ids, budget=5).tolist() == [4, 6]
    assert lookup.candidates(ids, budget=1).tolist() == [4]
    assert PromptLookup(num_tokens=5).candidates(ids, budget=5).tolist() == [4, 6, 2, 7, 8]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.lists(st.integers(1, 7), min_size=1, max_size=12),
       st.integers(1, 3), st.integers(1, 4))
def test_the_incremental_index_matches_what_a_rescan_finds(sequence, chunks, min_ngram, max_ngram):
    """Grown chunk by chunk (rounds commit 1-8 tokens), the index finds what scanning the whole sequence finds."""
    index, grown, position = NgramIndex(max_ngram), [], 0
    for size in chunks * 10:
        if position >= len(sequence):
            break
        chunk, position = sequence[position:position + size], position + size
        index.extend(chunk)
        grown += chunk
        found, ngram = match_continuation(torch.tensor(grown), 4, max_ngram, min_ngram)
        assert index.match(4, min_ngram) == (found.tolist(), ngram)


def test_match_sequence_cuts_at_eos_and_starts_over_for_another_sequence():
    lookup = PromptLookup(num_tokens=5, max_ngram=3, eos_token_ids=[2])
    sequence = [5, 6, 7, 2, 8, 1, 5, 6]
    found, ngram = lookup.match_sequence(sequence, budget=10)
    assert found.tolist() == [7] and ngram == 2  # "5 6" was followed by 7, then EOS
    rescanned, rescanned_ngram = lookup.match(torch.tensor(sequence), 10)
    assert rescanned.tolist() == [7] and rescanned_ngram == 2
    found, ngram = lookup.match_sequence(sequence + [9, 5, 6], budget=1)
    assert found.tolist() == [9] and ngram == 2
    assert lookup.match_sequence([1, 3, 4, 1, 3], budget=4)[0].tolist() == [4, 1, 3]  # not an extension: re-indexed
    assert lookup.match_sequence([1, 3, 4, 1, 3], budget=0)[0].numel() == 0


def test_lookup_length_follows_the_speed_curve_and_the_measured_acceptance():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 1, 2]])
    flat = {1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0, 5: 10.0, 6: 10.0}
    cliff = {1: 10.0, 2: 4.0, 3: 3.0, 4: 2.5, 5: 2.0, 6: 1.8}
    lookup = PromptLookup(num_tokens=5)
    assert lookup.candidates(ids, 5, flat).tolist() == [3, 4, 5, 6, 7]  # verification is free: all of them
    assert lookup.candidates(ids, 5, cliff).numel() == 0  # at acceptance 0.5 a second token costs more than it gives
    for _ in range(30):
        lookup.record(verified=5, accepted=5, ngram=2)
    assert lookup.acceptance(2) > 0.9
    assert lookup.candidates(ids, 5, cliff).numel() >= 1  # a reliable lookup pays even on the cliff
    for _ in range(60):
        lookup.record(verified=3, accepted=0, ngram=2)
    assert lookup.acceptance(2) < 0.1
    assert lookup.candidates(ids, 5, {1: 10.0, 2: 9.0, 3: 8.0, 4: 7.0, 5: 6.0, 6: 5.0}).numel() == 0


def test_acceptance_is_kept_per_match_length():
    lookup = PromptLookup(num_tokens=4)
    three, two = torch.tensor([[1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3]]), torch.tensor([[1, 2, 3, 4, 5, 9, 2, 3]])
    flat = {k: 10.0 for k in range(1, 6)}
    assert lookup.candidates(three, 4, flat).tolist() == [4, 5, 9, 2] and lookup.last_ngram == 3
    lookup.record(verified=4, accepted=4)  # credited to the last match: three tokens
    assert lookup.acceptance(3) > 0.5 and lookup.acceptance(2) == 0.5
    assert lookup.candidates(two, 4, flat).tolist() == [4, 5, 9, 2] and lookup.last_ngram == 2
    lookup.record(verified=4, accepted=0)
    assert lookup.acceptance(2) < 0.5 and lookup.acceptance(3) > 0.5
    lookup.reset()
    assert lookup.acceptance(3) == 0.5 and lookup.acceptance(1) == 0.25


def test_one_token_matches_need_a_speed_profile_and_must_beat_the_drafter():
    ids = torch.tensor([[4, 9, 1, 2, 6, 4]])  # only "4" recurs
    flat = {k: 10.0 for k in range(1, 6)}
    lookup = PromptLookup(num_tokens=3)
    assert lookup.candidates(ids, 3).numel() == 0  # no profile: one-token matches are not worth a round
    for _ in range(20):
        lookup.record(verified=3, accepted=3, ngram=1)
    for _ in range(20):  # the drafter has been accepting whole blocks
        lookup.record_drafted(verified=4, accepted=4)
    assert lookup.candidates(ids, 3, flat, draft_seconds=0.0).numel() == 0  # 5 tokens a round beat lookup's 4
    assert lookup.candidates(ids, 3, flat, drafting=False).tolist() == [9, 1, 2]  # the policy skips the drafter
    assert lookup.last_ngram == 1
    for _ in range(20):
        lookup.record_drafted(verified=4, accepted=0)
    assert lookup.candidates(ids, 3, flat, draft_seconds=0.01).tolist() == [9, 1, 2]  # now lookup beats it


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    target_seed=st.integers(0, 10_000),
    block_size=st.integers(1, 5),
    num_tokens=st.integers(1, 8),
    policy=st.sampled_from(["full", "fixed", "hardware_aware"]),
    prompt=st.lists(st.integers(3, 12), min_size=2, max_size=16),  # few distinct ids: n-grams recur
    max_new_tokens=st.integers(1, 40),
)
def test_greedy_with_prompt_lookup_is_identical_to_target(target_seed, block_size, num_tokens, policy, prompt,
                                                          max_new_tokens, lossless_cases):
    target = make_target("llama", seed=target_seed)
    drafter = make_drafter(target, block_size=block_size)
    drafter.verification_policy = {"full": "full", "fixed": FixedLengthPolicy(1), "hardware_aware": HardwareAwarePolicy(
        {1: 10.0, 2: 9.8, 3: 9.6, 4: 9.4, 5: 9.2, 6: 9.0, 7: 8.0, 8: 7.0, 9: 6.0}, draft_seconds=0.0)}[policy]
    input_ids = torch.tensor([prompt])
    expected = target.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens)
    actual = target.generate(input_ids, assistant_model=drafter, do_sample=False, max_new_tokens=max_new_tokens,
                             prompt_lookup_num_tokens=num_tokens)
    assert actual.tolist() == expected.tolist()
    stats = drafter.generation_stats
    assert all(r.verified <= num_tokens and not r.drafted and not r.confidences
               for r in stats.rounds if r.source == "lookup")
    lossless_cases["greedy prompt lookup"] += 1


def test_lookup_rounds_happen_and_are_accepted_on_repetitive_output():
    """Tiny random targets fall into loops: over a few of them, lookup rounds run and their drafts get accepted, the
    drafter runs in the other rounds, and each output is the target's own."""
    lookup_accepted = drafter_rounds = 0
    for seed in range(4):
        target = make_target("llama", seed=seed)
        drafter = make_drafter(target, block_size=4)
        prompt = torch.tensor([[5, 17, 42, 90, 7, 8, 9, 5, 17]])
        expected = target.generate(prompt, do_sample=False, max_new_tokens=40)
        actual = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=40,
                                 prompt_lookup_num_tokens=6)
        assert actual.tolist() == expected.tolist()
        rounds = drafter.generation_stats.rounds
        lookup_accepted += sum(r.accepted for r in rounds if r.source == "lookup")
        drafter_rounds += sum(r.source == "drafter" for r in rounds)
        assert drafter.generation_stats.lookup_rounds == sum(r.source == "lookup" for r in rounds)
    assert lookup_accepted > 0 and drafter_rounds > 0


# Speeds by tokens in the verification forward: nearly flat (verification almost free, as in bf16), and a cliff where a
# second token per row costs more than it can give.
FLAT = {tokens: 10.0 - 0.01 * tokens for tokens in range(1, 129)}
CLIFF = {tokens: 10.0 if tokens <= 4 else 1.0 for tokens in range(1, 129)}
BATCH_POLICIES = {"full": lambda: "full", "hardware_aware": lambda: HardwareAwarePolicy(FLAT, draft_seconds=0.0),
                  "cliff": lambda: HardwareAwarePolicy(CLIFF, draft_seconds=0.0), "no drafter": lambda: None}


@pytest.mark.parametrize("policy", sorted(BATCH_POLICIES))
def test_batched_engine_with_prompt_lookup_keeps_every_row_the_targets_greedy_output(policy, lossless_cases):
    """Rows take lookup drafts where their sequence repeats and the drafter's elsewhere, in one forward; every row stays
    its solo greedy output. On the cliff no lookup width pays; without a drafter the engine is batched prompt lookup."""
    from dspark_hf.generation.batched import DSparkBatchEngine

    lookup_accepted = rounds = 0
    prompts = [[5, 17, 42, 90, 7, 8, 9, 5, 17], [3, 4, 3, 4, 3], [60, 61, 62], [8, 9, 10, 8, 9, 10, 8]]
    for seed in range(3):
        target = make_target("llama", seed=seed)
        drafter = None if policy == "no drafter" else make_drafter(target, block_size=4)
        engine = DSparkBatchEngine(target, drafter, policy=BATCH_POLICIES[policy](), pad_token_id=0,
                                   prompt_lookup_num_tokens=5)
        requests = [engine.add_request(prompt, 30) for prompt in prompts]
        engine.run()
        for prompt, request in zip(prompts, requests):
            assert request.output_ids == solo(target, prompt, 30, eos_token_id=None)
            lookup = [r for r in request.stats.rounds if r.source == "lookup"]
            assert all(0 < r.verified <= 5 and not r.drafted and not r.confidences for r in lookup)
            lookup_accepted += sum(r.accepted for r in lookup)
            rounds += len(lookup)
        lossless_cases["greedy batched prompt lookup"] += len(prompts)
    if policy == "cliff":
        assert rounds == 0
    else:
        assert lookup_accepted > 0


def test_generate_with_a_batch_and_prompt_lookup_runs_the_batched_engine(target, drafter):
    prompts = [[5, 6, 7, 5, 6], [8, 9]]
    input_ids, attention_mask = left_pad(prompts)
    out = target.generate(input_ids, attention_mask=attention_mask, assistant_model=drafter, do_sample=False,
                          max_new_tokens=12, prompt_lookup_num_tokens=4, pad_token_id=0)
    for row, prompt in enumerate(prompts):
        assert out[row, input_ids.shape[1]:].tolist() == solo(target, prompt, 12, eos_token_id=None)
    assert len(drafter.batch_generation_stats) == 2
