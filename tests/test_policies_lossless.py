"""Verification policies keep generation lossless: greedy output is the target's, sampled output follows the target's
distribution, whatever the policy truncates."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf.generation.policies import (
    POLICIES,
    FullBlockPolicy,
    HardwareAwarePolicy,
    ThresholdPolicy,
    get_policy,
)


# Speeds chosen so that the hardware-aware policy keeps between 0 and all drafts depending on the confidences.
STEPS_PER_SECOND = {1: 1.0, 2: 0.7, 3: 0.6, 4: 0.55, 5: 0.5}
# Tiny temperatures spread the random head's confidences (logits ~ ±0.1) over (0, 1), so truncation varies.
SHARP_TEMPERATURES = 0.03


@pytest.fixture
def single_thread():
    """Tiny models run ~10x faster on one thread than on two shared cores (no intra-op thread spinning)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _policies():
    return {
        "full": FullBlockPolicy(),
        "threshold": ThresholdPolicy(0.5),
        "threshold_cumulative": ThresholdPolicy(0.3, cumulative=True),
        "hardware_aware": HardwareAwarePolicy(STEPS_PER_SECOND, draft_seconds=0.0),
        # drafting costs as much as 0.4 decode steps: the plan often skips the drafter (and probes again)
        "hardware_aware_skipping": HardwareAwarePolicy(STEPS_PER_SECOND, draft_seconds=0.4, max_idle_rounds=2),
        "hardware_aware_smoothed": HardwareAwarePolicy(STEPS_PER_SECOND, draft_seconds=0.2, plan_smoothing=0.5),
    }


class _Guarded(list):
    """Confidences that fail the test if a policy reads past the slot it is asked about."""

    def __init__(self, values, position):
        super().__init__(values)
        self.position = position

    def __getitem__(self, index):
        indices = range(len(self))[index] if isinstance(index, slice) else [index % len(self)]
        if any(i >= self.position for i in indices):
            raise AssertionError(f"policy read confidence index {index} while deciding slot {self.position}")
        return super().__getitem__(index)

    def __iter__(self):
        raise AssertionError("policies must index or slice, not iterate the whole sequence")


@pytest.mark.parametrize("name", sorted(_policies()))
def test_policies_only_read_confidences_up_to_the_slot(name):
    policy = _policies()[name]
    confidences = [0.9, 0.8, 0.7, 0.6]
    for position in range(1, 5):
        policy.should_verify(position, _Guarded(confidences, position))


def test_policies_by_name():
    assert sorted(POLICIES) == ["fixed", "full", "hardware_aware", "threshold"]
    assert get_policy("fixed", length=2).verification_length([0.0] * 7) == 2
    with pytest.raises(ValueError, match="length must be >= 1"):
        get_policy("fixed", length=0)
    assert isinstance(get_policy(None), FullBlockPolicy)
    assert get_policy("threshold", threshold=0.2).threshold == 0.2
    policy = get_policy("hardware_aware", steps_per_second=STEPS_PER_SECOND)
    assert policy.verification_length([0.95, 0.9, 0.2]) == 2
    with pytest.raises(ValueError, match="dspark-hf profile"):
        get_policy("hardware_aware")
    with pytest.raises(ValueError, match="choose one of"):
        get_policy("fastest")
    with pytest.raises(ValueError, match=r"threshold must be in \[0, 1\]"):
        ThresholdPolicy(1.5)


def test_threshold_policy_matches_spec_3_9():
    # ℓ = index of the first k with c_k < τ; τ <= 0 verifies everything.
    assert ThresholdPolicy(0.5).verification_length([0.9, 0.6, 0.4, 0.9]) == 2
    assert ThresholdPolicy(0.0).verification_length([0.0, 0.0]) == 2
    assert ThresholdPolicy(0.5, cumulative=True).verification_length([0.9, 0.6, 0.9]) == 2  # a_3 = 0.486


def test_hardware_aware_policy_from_a_saved_profile(tmp_path):
    from dspark_hf.profiling import PROFILE_FILE_NAME

    (tmp_path / PROFILE_FILE_NAME).write_text(json.dumps({str(k): v for k, v in STEPS_PER_SECOND.items()}))
    for source in (tmp_path, tmp_path / PROFILE_FILE_NAME, str(tmp_path / PROFILE_FILE_NAME)):
        policy = HardwareAwarePolicy.from_profile(source)
        assert policy.verification_length([0.95, 0.9, 0.2]) == 2
    assert get_policy("hardware_aware", steps_per_second=str(tmp_path)).verification_length([0.1]) == 0


def _sharp_drafter(target, **kwargs):
    drafter = make_drafter(target, **kwargs)
    drafter.config.confidence_temperatures = [SHARP_TEMPERATURES] * drafter.config.block_size
    return drafter


def test_fixed_length_policy_verifies_that_many_drafts(single_thread):
    from dspark_hf.generation.policies import FixedLengthPolicy

    target = make_target("llama", vocab_size=16)
    drafter = make_drafter(target, block_size=4)
    drafter.verification_policy = FixedLengthPolicy(2)
    input_ids = torch.tensor([[1, 5, 7, 3]])
    output = target.generate(input_ids, assistant_model=drafter, do_sample=False, max_new_tokens=30, pad_token_id=0)
    assert torch.equal(output, target.generate(input_ids, do_sample=False, max_new_tokens=30, pad_token_id=0))
    assert {r.verified for r in drafter.generation_stats.rounds[:-1]} == {2}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("name", sorted(_policies()))
def test_greedy_output_is_the_targets_with_every_policy(arch, name, single_thread):
    target = make_target(arch, vocab_size=16)  # a small vocabulary so that random drafts are sometimes accepted
    drafter = _sharp_drafter(target, block_size=4)
    drafter.verification_policy = _policies()[name]
    verified = set()
    for prompt in ([[1, 5, 7, 3]], [[1, 9, 4, 4, 12, 6, 8]]):
        input_ids = torch.tensor(prompt)
        expected = target.generate(input_ids, do_sample=False, max_new_tokens=40, pad_token_id=0)
        output = target.generate(input_ids, assistant_model=drafter, do_sample=False, max_new_tokens=40, pad_token_id=0)
        torch.testing.assert_close(output, expected, rtol=0, atol=0)
        verified |= {r.verified for r in drafter.generation_stats.rounds}
    if name != "full":  # the policy did truncate, differently from round to round
        assert len(verified) >= 2, verified


def test_planned_rounds_observe_only_the_slots_that_can_change_the_plan(single_thread):
    """With unconfident drafts on a steep curve the next plan settles after a slot or two: the rest of the block is
    not sampled, the output is still the target's, and each verified round's outcome reaches the policy."""
    target = make_target("llama", vocab_size=16)
    drafter = _sharp_drafter(target, block_size=6)
    policy = HardwareAwarePolicy({1: 10.0, 2: 6.0, 3: 5.0, 4: 4.5, 5: 4.0, 6: 3.5, 7: 3.0}, draft_seconds=0.0)
    drafter.verification_policy = policy
    markov_calls = []
    drafter.markov_head.register_forward_hook(lambda *args: markov_calls.append(1))
    input_ids = torch.tensor([[1, 9, 4, 4, 12, 6, 8]])
    output = target.generate(input_ids, assistant_model=drafter, do_sample=False, max_new_tokens=40, pad_token_id=0)
    assert torch.equal(output, target.generate(input_ids, do_sample=False, max_new_tokens=40, pad_token_id=0))
    drafted = [r for r in drafter.generation_stats.rounds if r.drafted]
    observed = [len(r.confidences) for r in drafted]
    assert min(observed) < 6 and len(markov_calls) < 6 * len(drafted), observed  # blocks cut short
    assert all(len(r.confidences) >= r.verified for r in drafted)
    if any(r.verified for r in drafted):
        assert policy._predicted > 0  # verified rounds were reported back (online acceptance correction)


# ----------------------------------------------------------------------------------------------------------------------
# Sampling exactness
# ----------------------------------------------------------------------------------------------------------------------

VOCAB = 3
TESTED_TOKENS = 3  # y_1 comes from the target's prefill, y_2 and y_3 from the first draft-and-verify round
NUM_SAMPLES = 1000
PROMPT = torch.tensor([[1, 2, 0, 1]])
# Each generation's first drafted round, the one that makes y_2 and y_3, runs Algorithm 1 on its own confidences. A
# gentler curve than STEPS_PER_SECOND makes it verify slot 2 often, which the power check below needs.
SAMPLING_STEPS_PER_SECOND = {1: 1.0, 2: 0.9, 3: 0.85, 4: 0.8}


def _sampling_pair(policy=None):
    """A tiny target with peaked next-token distributions and a random drafter that disagrees with it often."""
    target = make_target("llama", vocab_size=VOCAB, eos_token_id=None, bos_token_id=None, pad_token_id=0,
                         num_hidden_layers=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)  # random logits are nearly flat; sharpen them (the drafter copies the head)
    drafter = _sharp_drafter(target, block_size=3)
    # Without the online acceptance correction the random drafter keeps being verified, which gives the test power.
    drafter.verification_policy = policy or HardwareAwarePolicy(SAMPLING_STEPS_PER_SECOND, draft_seconds=0.0,
                                                                  outcome_decay=None)
    return target, drafter


def _target_joint(target, prompt):
    """Exact P(y_1..y_TESTED_TOKENS | prompt) of the target by enumerating every continuation, `(VOCAB,) * 3`."""
    joint = torch.ones(())
    for step in range(TESTED_TOKENS):
        continuations = list(itertools.product(range(VOCAB), repeat=step))
        prefixes = torch.tensor(continuations, dtype=torch.long).reshape(len(continuations), step)
        ids = torch.cat([prompt.expand(len(prefixes), -1), prefixes], dim=1)
        with torch.no_grad():
            probs = target(ids).logits[:, -1].double().softmax(-1)
        joint = joint.unsqueeze(-1) * probs.reshape(*[VOCAB] * step, VOCAB)
    return joint


def _sample_counts(target, drafter, num_samples, seed=1234):
    """Counts of (y_1, y_2, y_3) over `num_samples` speculative generations, plus the verified lengths seen and the
    total of accepted drafts."""
    counts = torch.zeros([VOCAB] * TESTED_TOKENS)
    verified, accepted, skipped = set(), 0, 0
    torch.manual_seed(seed)
    for _ in range(num_samples):
        output = target.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), assistant_model=drafter,
                                 do_sample=True, top_k=0, top_p=1.0, max_new_tokens=TESTED_TOKENS + 1, pad_token_id=0)
        counts[tuple(output[0, PROMPT.shape[1]:PROMPT.shape[1] + TESTED_TOKENS].tolist())] += 1
        verified |= {r.verified for r in drafter.generation_stats.rounds}
        accepted += drafter.generation_stats.accepted
        skipped += drafter.generation_stats.skipped_rounds
    return counts, verified, accepted, skipped


def _chi_square_p_value(counts, expected_probs, min_expected=5.0):
    """Pearson's χ² goodness-of-fit p-value, pooling cells with fewer than `min_expected` expected counts."""
    counts, expected = counts.flatten().double(), expected_probs.flatten() * counts.sum()
    small = expected < min_expected
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    statistic = ((counts - expected) ** 2 / expected).sum()
    degrees = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2.0, dtype=torch.float64), statistic / 2))


def test_sampled_output_follows_the_target_distribution(single_thread, lossless_cases):
    """With a policy that truncates by sampled-token-dependent confidences, the joint distribution of the first
    tokens is the target's (χ² over all VOCAB^3 outcomes; fixed seeds, so the outcome is deterministic)."""
    target, drafter = _sampling_pair()
    counts, verified, accepted, _ = _sample_counts(target, drafter, NUM_SAMPLES)
    assert verified == {0, 1, 2} and accepted > NUM_SAMPLES // 2, (verified, accepted)  # the policy and drafts matter
    assert _chi_square_p_value(counts, _target_joint(target, PROMPT)) > 1e-3
    lossless_cases["sampling"] += NUM_SAMPLES


def test_threshold_policy_sampling_follows_the_target_distribution(single_thread, lossless_cases):
    """The threshold cuts each block at the first confidence below it: c_k reads the drafts before slot k only."""
    target, drafter = _sampling_pair(ThresholdPolicy(0.5))
    counts, verified, accepted, _ = _sample_counts(target, drafter, NUM_SAMPLES)
    assert {0, 1, 2} <= verified and accepted > NUM_SAMPLES // 10, (verified, accepted)
    assert _chi_square_p_value(counts, _target_joint(target, PROMPT)) > 1e-3
    lossless_cases["sampling"] += NUM_SAMPLES


def test_sampling_stays_exact_when_the_drafter_is_skipped(single_thread, lossless_cases):
    """Rounds without drafting (plan 0 under a costly drafter, with probes in between) mixed with drafted ones."""
    target, drafter = _sampling_pair(HardwareAwarePolicy(STEPS_PER_SECOND, draft_seconds=0.4, max_idle_rounds=2))
    counts, verified, accepted, skipped = _sample_counts(target, drafter, NUM_SAMPLES)
    assert skipped > NUM_SAMPLES // 10 and accepted > NUM_SAMPLES // 10, (skipped, accepted)  # both kinds of round
    assert _chi_square_p_value(counts, _target_joint(target, PROMPT)) > 1e-3
    lossless_cases["sampling"] += NUM_SAMPLES


@pytest.mark.slow
def test_the_sampling_test_catches_a_subtly_wrong_draft_distribution(single_thread, monkeypatch):
    """Power check of the test above: verifying slot 2 against slot 1's draft distribution (as if the Markov
    correction were dropped from the returned logits) must fail it at the same sample size."""
    from dspark_hf.generation.candidate_generator import DSparkCandidateGenerator

    get_candidates = DSparkCandidateGenerator.get_candidates

    def wrong_logits(self, *args, **kwargs):
        ids, logits = get_candidates(self, *args, **kwargs)
        return ids, None if logits is None else logits[:, :1].expand_as(logits).contiguous()

    monkeypatch.setattr(DSparkCandidateGenerator, "get_candidates", wrong_logits)
    target, drafter = _sampling_pair()
    counts, _, _, _ = _sample_counts(target, drafter, NUM_SAMPLES)
    assert _chi_square_p_value(counts, _target_joint(target, PROMPT)) < 1e-3


def test_full_policy_never_truncates():
    assert FullBlockPolicy().verification_length([0.0] * 7) == 7
