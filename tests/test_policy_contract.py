"""The verification-policy interface contract, table-driven over every policy, on batch 1 and on a batch of 3 rows.

Each policy is driven the way every decoding path drives it (`begin_round`, `num_slots`, the shared drafting loop
asking `verified` / `settled`, `end_round`) for several rounds of random confidences, with a stand-in drafter.
"""

from __future__ import annotations

import random

import pytest

from conftest import drafts_for
from dspark_hf.generation.policies import (
    FixedLengthPolicy,
    FullBlockPolicy,
    HardwareAwarePolicy,
    RoundOutcome,
    ThresholdPolicy,
)


BLOCK = 5
# A gently falling curve up to 3 rows of full blocks, so that the hardware-aware policies verify some drafts and not
# others.
SPS = {tokens: 10.0 / (1.0 + 0.08 * (tokens - 1)) for tokens in range(1, 3 * (BLOCK + 1) + 1)}
BY_ROWS = {1: {w: SPS[w] for w in range(1, BLOCK + 2)}, 4: {w: 0.8 * SPS[w] for w in range(1, BLOCK + 2)}}

POLICIES = {
    "full": FullBlockPolicy,
    "fixed:2": lambda: FixedLengthPolicy(2),
    "fixed:9": lambda: FixedLengthPolicy(9),  # longer than the block: the whole block
    "threshold": lambda: ThresholdPolicy(0.5),
    "threshold_cumulative": lambda: ThresholdPolicy(0.4, cumulative=True),
    "hardware_aware": lambda: HardwareAwarePolicy(SPS, draft_seconds=0.001),
    "hardware_aware_measured": lambda: HardwareAwarePolicy(SPS, plan_smoothing=0.0),
    "algorithm1": lambda: HardwareAwarePolicy(SPS, mode="algorithm1"),
    "planned_width": lambda: HardwareAwarePolicy(SPS).for_engine(),
    "planned_width_by_rows": lambda: HardwareAwarePolicy(SPS, draft_seconds=0.0005).for_engine(BY_ROWS),
}


def _run_rounds(policy, rows: int, budgets: list[int], num_rounds: int = 12, seed: int = 0) -> list[list[int]]:
    """Drives `policy` through `num_rounds` rounds of `rows` rows; returns each drafted round's lengths."""
    rng = random.Random(seed)
    policy.reset()
    stale: list[list[float] | None] = [None] * rows
    drafted_lengths = []
    for _ in range(num_rounds):
        drafts = policy.begin_round(stale, BLOCK)
        assert isinstance(drafts, bool)
        if not drafts:
            policy.end_round(RoundOutcome([[] for _ in range(rows)], [0] * rows, [0] * rows, drafted=False,
                                          step_seconds=0.01))  # fmt: skip
            continue
        num_slots = policy.num_slots(BLOCK, budgets)
        assert 0 <= num_slots <= BLOCK
        confidences = [[rng.random() for _ in range(BLOCK)] for _ in range(rows)]
        block = drafts_for(confidences, budgets, policy, num_slots=num_slots)
        lengths = block.lengths
        assert len(lengths) == rows
        for length, budget in zip(lengths, budgets):
            assert 0 <= length <= min(max(budget, 0), BLOCK, block.ids.shape[1])  # within [0, block] and the budget
        accepted = [rng.randint(0, length) for length in lengths]
        policy.end_round(RoundOutcome(block.confidences, lengths, accepted, observed=block.observed,
                                      draft_seconds=0.002 * rows, step_seconds=0.01 * (1 + max(lengths))))
        stale = [values if block.observed else old for values, old in zip(block.confidences, stale)]
        drafted_lengths.append(lengths)
    return drafted_lengths


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("budgets", [[BLOCK], [BLOCK, 0, 3]], ids=["batch1", "batch3"])
def test_policy_contract(name, budgets):
    policy = POLICIES[name]()
    rounds = _run_rounds(policy, len(budgets), budgets)
    assert rounds, f"{name} never drafted in 12 rounds"
    if len(budgets) == 3:
        assert all(lengths[1] == 0 for lengths in rounds)  # a row with no drafts left verifies none
    if name.startswith(("full", "fixed:9")):
        assert all(lengths == [min(b, BLOCK) for b in budgets] for lengths in rounds)
    if name == "fixed:2":
        assert all(lengths == [min(b, 2) for b in budgets] for lengths in rounds)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policies_decide_a_slot_from_the_confidences_before_it(name):
    """`verified(slot, ...)` gets c_1..c_{slot+1} of every row and nothing more (the drafting loop has no more), and
    never admits a row that is not a candidate."""
    policy = POLICIES[name]()
    policy.reset()
    policy.begin_round([None, [0.9] * BLOCK, None], BLOCK)
    rows = [[0.9, 0.8, 0.7, 0.6, 0.5], [0.2, 0.9, 0.9, 0.9, 0.9], [0.6, 0.6, 0.1, 0.6, 0.6]]
    for slot in range(BLOCK):
        prefixes = [row[: slot + 1] for row in rows]
        verified = policy.verified(slot, prefixes, [True] * 3)
        assert len(verified) == 3 and all(isinstance(v, bool) for v in verified)
        assert policy.verified(slot, prefixes, [False, True, False])[::2] == [False, False]


@pytest.mark.parametrize("name", ["full", "fixed:2", "threshold", "threshold_cumulative", "hardware_aware",
                                  "algorithm1"])
def test_rows_are_decided_alone_by_row_wise_policies(name):
    """Batch 1 is one row: for policies that decide each row alone, three rows verify what each would alone."""
    rows = [[0.9, 0.8, 0.7, 0.6, 0.5], [0.2, 0.9, 0.9, 0.9, 0.9], [0.6, 0.6, 0.1, 0.6, 0.6]]
    policy = POLICIES[name]()
    assert policy.verification_lengths(rows) == [policy.verification_length(row) for row in rows]
    assert policy.verification_lengths([[], rows[0]]) == [0, policy.verification_length(rows[0])]


def test_the_engine_runs_the_hardware_aware_policy_as_one_width_for_all_rows():
    policy = HardwareAwarePolicy(SPS)
    engine_policy = policy.for_engine(BY_ROWS)
    assert engine_policy.speed_model is policy.speed_model  # measurements carry over between engines
    assert FullBlockPolicy().for_engine(BY_ROWS).name == "full"  # other policies run as they are
    engine_policy.begin_round([[0.9] * BLOCK] * 3, BLOCK)
    lengths = [engine_policy.verification_lengths([[0.9] * BLOCK, [0.1] * BLOCK, [0.5] * BLOCK])]
    assert len(set(lengths[0])) == 1  # one padded width
    with pytest.raises(RuntimeError, match="begin_round"):
        HardwareAwarePolicy(SPS).for_engine().verified(0, [[0.5]], [True])
