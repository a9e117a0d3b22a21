"""Algorithm 1 (hardware-aware prefix scheduler), its production variant, and the paper's Appendix A counterexample.

The Appendix A tests enumerate the sampling randomness exactly (fractions, no Monte Carlo): a tiny speculative
sampler with γ = 2 over the vocabulary {A, B} whose confidence c_2 depends on the sampled x_1.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_hf.generation.policies import HardwareAwarePolicy, RoundOutcome, ThresholdPolicy
from dspark_hf.scheduling import (
    StepsPerSecondCurve,
    blend_survival,
    corrected_confidences,
    expected_throughput,
    plan_is_settled,
    plan_verification_width,
    prefix_survival_probabilities,
    schedule_verification_lengths,
    schedule_verification_lengths_async,
    keeps_verifying,
    top_k_verification_lengths,
    verification_capacity,
)


# The shape this CPU shows (docs/cpu-measurements.md): verifying 2+ tokens costs ~2-3x a decode step, then flattens.
CPU_LIKE = {1: 10.0, 2: 4.0, 3: 3.9, 4: 3.8, 5: 3.7, 6: 3.6, 7: 3.5, 8: 3.4}
SMOOTH = {b: 10.0 / (1 + 0.1 * (b - 1)) for b in range(1, 17)}


def observe(policy, confidences):
    """Ends a drafted round of one row whose confidences the drafting loop observed (the policy plans from them)."""
    policy.end_round(RoundOutcome([list(confidences)], [0], [0], observed=True))


def record_outcome(policy, confidences, verified, accepted):
    """Ends a round of one row that verified `verified` drafts and had `accepted` of them accepted."""
    policy.end_round(RoundOutcome([list(confidences)], [verified], [accepted]))


def should_draft(policy):
    return policy.begin_round([None], 4)


# ----------------------------------------------------------------------------------------------------------------------
# Hand-made tables
# ----------------------------------------------------------------------------------------------------------------------


def test_prefix_survival_is_the_running_product():
    assert prefix_survival_probabilities([[0.5, 0.5, 1.0], [0.9]]) == [[0.5, 0.25, 0.25], [0.9]]


def test_single_request_on_a_smooth_curve():
    # Θ_0 = 10, Θ_1 = 1.9·10/1.1 = 17.27, Θ_2 = 2.71·10/1.2 = 22.58, Θ_3 = (2.71 + 0.729)·10/1.3 = 26.45,
    # Θ_4 = (3.439 + 0.06561)·10/1.4 = 25.03 -> stop at 3.
    assert schedule_verification_lengths([[0.9, 0.9, 0.9, 0.09, 0.9]], SMOOTH) == [3]


def test_cpu_cliff_needs_confident_drafts():
    # Crossing the 1 -> 2 token cliff needs Θ_1 = (1 + a_1)·4 > 10, i.e. a_1 > 1.5: never worth it for one draft...
    assert schedule_verification_lengths([[0.99] * 7], CPU_LIKE) == [0]
    # ...and the early break stops there even though a long confident block would pay off later on this curve.
    assert expected_throughput([[0.99] * 7], [7], CPU_LIKE) > 10.0


def test_requests_are_interleaved_by_survival_probability():
    confidences = [[0.95, 0.9, 0.5], [0.6, 0.9], [0.99, 0.99, 0.99]]
    # a: r0 = .95, .855, .4275; r1 = .6, .54; r2 = .99, .9801, .970299
    # order: r2j1, r2j2, r2j3, r0j1, r0j2, r1j1, r1j2, r0j3
    curve = {b: 100.0 - b for b in range(1, 20)}  # nearly flat: admit everything
    assert schedule_verification_lengths(confidences, curve) == [3, 2, 3]
    # A step after 3 + 5 = 8 tokens: the first 5 candidates (r2 ×3, r0 ×2) fit, r1 gets nothing.
    cliff = {**{b: 100.0 for b in range(1, 9)}, **{b: 10.0 for b in range(9, 20)}}
    assert schedule_verification_lengths(confidences, cliff) == [2, 0, 3]


def test_ties_keep_position_order_then_request_order():
    # Every a equals 0.5 -> 1.0 then stays: stable order is r0j1, r0j2, r1j1, r1j2 (all a = 1.0 ties).
    curve = {1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0, 5: 0.1, 6: 0.1}
    assert schedule_verification_lengths([[1.0, 1.0], [1.0, 1.0]], curve) == [2, 0]


def test_zero_survival_is_never_admitted_even_when_speed_rises():
    rising = {1: 1.0, 2: 1.0, 3: 5.0, 4: 5.0}
    assert schedule_verification_lengths([[0.0, 1.0]], rising) == [0]
    # With a_1 > 0 the scheduler reaches size 2 (Θ = 1.5 > 1) and stops where a_2 = 0 (not a candidate).
    assert schedule_verification_lengths([[0.5, 0.0, 1.0]], rising) == [1]


def test_tensor_and_ragged_inputs():
    table = torch.tensor([[0.9, 0.9, 0.1], [0.2, 0.9, 0.9]])
    from_lists = schedule_verification_lengths(table.tolist(), SMOOTH)
    assert schedule_verification_lengths(table, SMOOTH) == from_lists
    assert schedule_verification_lengths([torch.tensor([0.9, 0.9]), [0.5]], SMOOTH) == [2, 1]
    assert schedule_verification_lengths([[], [0.9]], SMOOTH) == [0, 1]
    assert schedule_verification_lengths([], SMOOTH) == []


def test_steps_per_second_lookup():
    curve = StepsPerSecondCurve.from_table({"1": 10, "2": 4.0, "8": 3.0})  # JSON-style keys
    assert [curve(b) for b in (1, 2, 3, 8, 9)] == [10.0, 4.0, 3.0, 3.0, None]
    assert StepsPerSecondCurve.from_table([10.0, 4.0]) == StepsPerSecondCurve.from_table({1: 10.0, 2: 4.0})
    # Above the profiled range nothing more is admitted, however confident.
    assert schedule_verification_lengths([[1.0] * 5], {1: 1.0, 2: 1.9, 3: 2.8}) == [2]


@pytest.mark.parametrize(
    "confidences, table, message",
    [
        ([[1.2]], SMOOTH, "not a probability"),
        ([[float("nan")]], SMOOTH, "not a probability"),
        ([0.5, 0.5], SMOOTH, "one sequence per request"),
        (torch.tensor([0.5, 0.5]), SMOOTH, "must be 2-D"),
        ([[0.5]] * 3, {1: 1.0, 2: 0.5}, "up to 2 tokens"),
        ([[0.5]], {0: 1.0}, "token counts >= 1"),
        ([[0.5]], {1: -1.0}, "speeds > 0"),
        ([[0.5]], {}, "empty"),
        ([[0.5]], {"format": "dspark-hf-sps-profile"}, "load_steps_per_second"),
    ],
)
def test_bad_inputs_name_the_problem(confidences, table, message):
    with pytest.raises(ValueError, match=message):
        schedule_verification_lengths(confidences, table)


# ----------------------------------------------------------------------------------------------------------------------
# Properties
# ----------------------------------------------------------------------------------------------------------------------

probabilities = st.floats(0.0, 1.0, allow_nan=False)
confidence_tables = st.lists(st.lists(probabilities, min_size=0, max_size=7), min_size=1, max_size=4)
speed_curves = st.lists(st.floats(0.05, 20.0, allow_nan=False), min_size=4, max_size=30)


@settings(max_examples=300, deadline=None)
@given(confidence_tables, speed_curves)
def test_schedule_is_a_valid_prefix_allocation_and_never_worse_than_decoding(confidences, speeds):
    if len(confidences) > len(speeds):
        return
    lengths = schedule_verification_lengths(confidences, speeds)
    assert all(0 <= length <= len(row) for length, row in zip(lengths, confidences))
    survival = prefix_survival_probabilities(confidences)
    assert all(survival[r][j - 1] > 0 for r, length in enumerate(lengths) for j in range(1, length + 1))
    assert expected_throughput(confidences, lengths, speeds) >= expected_throughput(
        confidences, [0] * len(lengths), speeds
    )


@settings(max_examples=300, deadline=None)
@given(confidence_tables, speed_curves, st.data())
def test_admission_never_depends_on_later_confidences(confidences, speeds, data):
    """Non-anticipation: {ℓ_r >= k} is unchanged when c_{r,k+1..} (computed from x_{r,k} onwards) change."""
    if len(confidences) > len(speeds):
        return
    r = data.draw(st.integers(0, len(confidences) - 1))
    k = data.draw(st.integers(1, len(confidences[r]) + 1))
    future = data.draw(st.lists(probabilities, min_size=len(confidences[r][k:]), max_size=len(confidences[r][k:])))
    changed = [list(row) for row in confidences]
    changed[r][k:] = future
    before = schedule_verification_lengths(confidences, speeds)[r] >= k
    after = schedule_verification_lengths(changed, speeds)[r] >= k
    assert before == after


@settings(max_examples=300, deadline=None)
@given(st.lists(probabilities, min_size=0, max_size=9), speed_curves)
def test_hardware_aware_policy_equals_algorithm_1_for_one_request(confidences, speeds):
    """The candidate generator asks slot by slot with c_1..c_k; it must end where Algorithm 1 (R = 1) ends."""
    policy = HardwareAwarePolicy(speeds)
    assert policy.verification_length(confidences) == schedule_verification_lengths([confidences], speeds)[0]


@settings(max_examples=200, deadline=None)
@given(confidence_tables, speed_curves, st.data())
def test_production_variant(confidences, speeds, data):
    if len(confidences) > len(speeds):
        return
    capacity = verification_capacity(confidences, speeds)
    gains = sorted((a for row in prefix_survival_probabilities(confidences) for a in row if a > 0), reverse=True)
    admissible = [k for k in range(len(gains) + 1) if len(confidences) + k <= len(speeds)]
    thetas = [(len(confidences) + sum(gains[:k])) * speeds[len(confidences) + k - 1] for k in admissible]
    # Global search, no early break; equal up to float rounding (different summation orders), ties keep smaller K.
    assert thetas[admissible.index(capacity)] == pytest.approx(max(thetas), rel=1e-9, abs=1e-12)
    lengths = top_k_verification_lengths(confidences, capacity)
    assert sum(lengths) == capacity
    # Non-anticipating for a fixed capacity (K comes from stale confidences).
    r = data.draw(st.integers(0, len(confidences) - 1))
    k = data.draw(st.integers(1, len(confidences[r]) + 1))
    changed = [list(row) for row in confidences]
    changed[r][k:] = [data.draw(probabilities) for _ in confidences[r][k:]]
    assert (top_k_verification_lengths(changed, capacity)[r] >= k) == (lengths[r] >= k)


def test_production_variant_float_tie_keeps_smaller_capacity():
    """A float-rounding tie once drawn in CI: 1 + 2e-16 tokens at the same speed is no gain, so K stays 0."""
    assert verification_capacity([[], [2.220446049250313e-16, 1.0]], [1.0, 1.0, 1.0, 1.0]) == 0


def test_production_variant_crosses_cliffs_that_stop_algorithm_1():
    confidences = [[0.99] * 7]
    assert schedule_verification_lengths(confidences, CPU_LIKE) == [0]
    assert verification_capacity(confidences, CPU_LIKE) == 7
    stale = [[0.2] * 7]  # stale confidences plan the capacity, current ones rank the drafts
    assert schedule_verification_lengths_async(confidences, stale, CPU_LIKE) == [0]
    # Two requests: the profile stops at 8 tokens, so K <= 6, and all six go to the confident request.
    assert schedule_verification_lengths_async([[0.99] * 7, [0.1] * 7], confidences * 2, CPU_LIKE) == [6, 0]


# ----------------------------------------------------------------------------------------------------------------------
# Appendix A: exact speculative sampling with a scheduler in the loop
# ----------------------------------------------------------------------------------------------------------------------

A, B = 0, 1
F = Fraction


def _distribution(p_a):
    return (F(p_a), 1 - F(p_a))


def retrospective_global_search(confidences, speeds):
    """What the paper warns against: the best of every length, looking at c_{k+1} before admitting x_k."""
    thetas = []
    for length in range(len(confidences) + 1):
        survival = prefix_survival_probabilities([confidences[:length]])[0]
        thetas.append((1 + sum(survival)) * speeds[length])
    return max(range(len(thetas)), key=lambda length: (thetas[length], -length))


def exact_output_distribution(schedule, c1, c2_after, p_t1, p_d1, p_t2, p_d2):
    """Exact joint distribution of the first two output tokens of one speculative round (γ = 2) plus, when the round
    commits a single token, an exact target step for the second (what any lossless next round produces).

    Args:
        schedule: ``(c_1, c_2) -> ℓ``; c_2 = c2_after[x_1] depends on the sampled first draft (Markov confidence).
        p_t1, p_d1: target / draft distributions at position 1; p_t2[y], p_d2[y]: at position 2 after token y.
    """
    output = {(y1, y2): F(0) for y1 in (A, B) for y2 in (A, B)}

    def residual(p_t, p_d):
        mass = [max(t - d, F(0)) for t, d in zip(p_t, p_d)]
        total = sum(mass)
        return tuple(m / total for m in mass) if total > 0 else p_t

    for x1, x2 in itertools.product((A, B), repeat=2):
        p_drafts = p_d1[x1] * p_d2[x1][x2]
        length = schedule(c1, c2_after[x1])
        if length == 0:  # the target decodes y1 itself; the next round gives y2 ~ p_t2
            for y1, y2 in output:
                output[y1, y2] += p_drafts * p_t1[y1] * p_t2[y1][y2]
            continue
        accept1 = min(F(1), p_t1[x1] / p_d1[x1])
        for y1 in (A, B):  # rejected at 1: y1 from the residual, then a fresh step
            for y2 in (A, B):
                output[y1, y2] += p_drafts * (1 - accept1) * residual(p_t1, p_d1)[y1] * p_t2[y1][y2]
        if length == 1:  # accepted x1, bonus token from the target after it
            for y2 in (A, B):
                output[x1, y2] += p_drafts * accept1 * p_t2[x1][y2]
            continue
        accept2 = min(F(1), p_t2[x1][x2] / p_d2[x1][x2])
        output[x1, x2] += p_drafts * accept1 * accept2
        for y2 in (A, B):
            output[x1, y2] += p_drafts * accept1 * (1 - accept2) * residual(p_t2[x1], p_d2[x1])[y2]
    return output


PAPER = dict(
    c1=0.8, c2_after={A: 0.9, B: 0.0},
    p_t1=_distribution("0.7"), p_d1=_distribution("0.5"),
    p_t2={A: _distribution("0.6"), B: _distribution("0.1")}, p_d2={A: _distribution("0.2"), B: _distribution("0.9")},
)
PAPER_SPEEDS = [1.0, 0.5, 0.45]  # SPS(1), SPS(2), SPS(3)


def _first_token(output):
    return (output[A, A] + output[A, B], output[B, A] + output[B, B])


def _target_joint(case):
    return {(y1, y2): case["p_t1"][y1] * case["p_t2"][y1][y2] for y1 in (A, B) for y2 in (A, B)}


def test_appendix_a_retrospective_search_is_biased():
    schedule = lambda c1, c2: retrospective_global_search([c1, c2], PAPER_SPEEDS)  # noqa: E731
    assert schedule(0.8, 0.9) == 2 and schedule(0.8, 0.0) == 0  # the two cases of the paper
    assert _first_token(exact_output_distribution(schedule, **PAPER)) == (F("0.85"), F("0.15"))


def test_appendix_a_algorithm_1_is_exact():
    schedule = lambda c1, c2: schedule_verification_lengths([[c1, c2]], PAPER_SPEEDS)[0]  # noqa: E731
    assert schedule(0.8, 0.9) == 0  # Θ_1 = 0.9 < Θ_0 = 1: stops before looking at c_2
    output = exact_output_distribution(schedule, **PAPER)
    assert _first_token(output) == (F("0.7"), F("0.3"))
    assert output == _target_joint(PAPER)


SCHEDULERS = {
    "algorithm_1": lambda speeds: lambda c1, c2: schedule_verification_lengths([[c1, c2]], speeds)[0],
    "hardware_aware_policy": lambda speeds: lambda c1, c2: HardwareAwarePolicy(speeds).verification_length([c1, c2]),
    "threshold": lambda speeds: lambda c1, c2: ThresholdPolicy(0.5).verification_length([c1, c2]),
    "threshold_cumulative": lambda speeds: lambda c1, c2: ThresholdPolicy(0.45, cumulative=True).verification_length(
        [c1, c2]
    ),
    # Production variant: the capacity is fixed from stale confidences, before this round's drafts exist.
    "top_k_fixed_capacity": lambda speeds: lambda c1, c2: top_k_verification_lengths([[c1, c2]], 1),
    # ... and cut by this round's confidences as they arrive (`replan`, the default), from a confident and a weak plan
    "planned_replan_confident": lambda speeds: _planned([0.9, 0.9], speeds),
    "planned_replan_weak": lambda speeds: _planned([0.6, 0.3], speeds),
}


def _planned(stale, speeds):
    """A planned hardware-aware round (its plan from `stale`, an earlier round's confidences) as a schedule."""

    def schedule(c1, c2):
        policy = HardwareAwarePolicy(speeds, draft_seconds=0.0)
        observe(policy, stale)
        should_draft(policy)
        return policy.verification_length([c1, c2])

    return schedule


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
@pytest.mark.parametrize("speeds", [PAPER_SPEEDS, [1.0, 0.9, 0.85], [1.0, 0.6, 0.59]])
@pytest.mark.parametrize("c2_after", [{A: 0.9, B: 0.0}, {A: 0.1, B: 0.95}, {A: 0.6, B: 0.4}])
@pytest.mark.parametrize("c1", [0.3, 0.8, 1.0])
def test_non_anticipating_schedulers_are_exact(name, speeds, c2_after, c1):
    case = {**PAPER, "c1": c1, "c2_after": c2_after}
    assert exact_output_distribution(SCHEDULERS[name](speeds), **case) == _target_joint(case)


def test_the_simulator_detects_bias_on_other_settings_too():
    """The retrospective search is biased beyond the paper's exact numbers (the simulator has power)."""
    case = {**PAPER, "c2_after": {A: 0.1, B: 0.95}}
    schedule = lambda c1, c2: retrospective_global_search([c1, c2], PAPER_SPEEDS)  # noqa: E731
    assert exact_output_distribution(schedule, **case) != _target_joint(case)


def test_capacity_weighs_the_drafting_cost():
    speeds = {1: 10.0, 2: 9.0, 3: 8.5}
    assert verification_capacity([[0.5, 0.5]], speeds) == 2
    assert verification_capacity([[0.5, 0.5]], speeds, draft_seconds=0.0) == 2
    # 1 + 0.5 + 0.25 tokens in 1/8.5 s + 60 ms (9.85 tok/s) lose to plain decoding (10 tok/s)
    assert verification_capacity([[0.5, 0.5]], speeds, draft_seconds=0.06) == 0
    assert verification_capacity([[0.95, 0.95]], speeds, draft_seconds=0.06) == 2  # 2.85 tokens in 0.178 s
    with pytest.raises(ValueError, match="draft_seconds"):
        verification_capacity([[0.5]], speeds, draft_seconds=-1.0)


def test_hardware_aware_policy_backs_off_a_drafter_that_does_not_pay():
    policy = HardwareAwarePolicy({1: 10.0, 2: 9.0}, draft_seconds=0.05, max_idle_rounds=4)
    assert should_draft(policy)  # nothing planned yet: draft (Algorithm 1 on this round's confidences)
    observe(policy, [0.3])  # 1.3 tokens in 0.161 s < 10 tokens/s: plan 0
    pattern = []
    for _ in range(14):
        drafts = should_draft(policy)
        pattern.append(drafts)
        if drafts:
            assert policy.verification_length([0.9]) == 1  # a probe verifies by Algorithm 1 (its cost is sunk)
            observe(policy, [0.3])
    # skip 1, probe, skip 2, probe, skip 4, probe, skip 4 (the cap), probe
    assert pattern == [False, True, False, False, True, False, False, False, False, True, False, False, False, False]
    observe(policy, [0.99])  # a confident probe: 1.99 tokens in 0.161 s beat plain decoding, draft every round again
    assert should_draft(policy) and should_draft(policy) and policy.verification_length([0.9]) == 1
    assert policy.verification_length([0.05]) == 0  # this block's own draft is weak: the paid-for round verifies none
    record_outcome(policy, [0.99], verified=1, accepted=0)  # ... but the draft failed
    observe(policy, [0.3])
    assert [should_draft(policy) for _ in range(5)] == [False] * 4 + [True]  # backoff kept at the cap
    record_outcome(policy, [0.5], verified=1, accepted=1)  # that probe's draft did as its confidence said ...
    observe(policy, [0.3])  # ... and the plan still says drafting does not pay
    assert [should_draft(policy) for _ in range(5)] == [False] * 4 + [True]  # so the backoff stays at the cap
    for _ in range(2):
        observe(policy, [0.99])  # confident rounds (two: the plan reads them blended with the 0.3s before): plan 1
    assert should_draft(policy)  # a planned round ...
    record_outcome(policy, [0.5], verified=1, accepted=1)  # ... that paid what it promised
    observe(policy, [0.3])
    assert [should_draft(policy) for _ in range(2)] == [False, True]  # backoff starts over at 1
    policy.end_round(RoundOutcome([[0.9]], [1], [0], draft_seconds=0.02, step_seconds=0.1))
    assert policy.acceptance_ratio < 1.0
    policy.reset()  # a new generation (prompt): plan, backoff and acceptance ratio start over, timings stay
    assert policy.acceptance_ratio == 1.0
    assert should_draft(policy) and policy.verification_length([0.9]) == 1  # Algorithm 1 again, no backoff
    speeds = policy.speed_model
    assert speeds.drafting_cost() == 0.05  # the fixed draft_seconds wins over the measured 0.02
    assert speeds.step_seconds == {(1, 2): 0.1} and speeds.measured_speed(1, 2, {2: 9.0}.get) == pytest.approx(10.0)
    policy.forget()
    assert not speeds.step_seconds and speeds.measured_speed(1, 2, {2: 9.0}.get) == 9.0


def test_hardware_aware_policy_measures_the_drafting_cost():
    policy = HardwareAwarePolicy({1: 10.0, 2: 9.0})
    assert policy.drafting_cost() == 0.0  # nothing measured yet: the paper's free drafter
    for seconds in (0.010, 0.020):
        policy.end_round(RoundOutcome([[0.5]], [1], [1], draft_seconds=seconds))
    assert policy.drafting_cost() == pytest.approx(0.015)  # the median of recent passes
    policy.end_round(RoundOutcome([[0.5]] * 4, [1] * 4, [1] * 4, draft_seconds=0.040))
    assert policy.drafting_cost(4) == pytest.approx(0.040) and policy.drafting_cost(8) == pytest.approx(0.080)
    with pytest.raises(ValueError, match="draft_seconds"):
        HardwareAwarePolicy({1: 1.0}, draft_seconds=float("nan"))


@settings(max_examples=300, deadline=None)
@given(st.lists(probabilities, min_size=1, max_size=7), speed_curves, st.sampled_from([0.0, 0.01, 0.1, 1.0]),
       st.data())
def test_a_settled_plan_is_the_plan_of_the_whole_block(confidences, speeds, draft_seconds, data):
    """Stopping observation where `plan_is_settled` says so never changes the capacity planned for the next round."""
    block = len(confidences)
    curve = StepsPerSecondCurve.from_table(speeds)
    k = data.draw(st.integers(0, block))
    if plan_is_settled([confidences[:k]], curve, block + 1, draft_seconds):
        assert verification_capacity([confidences[:k]], speeds, draft_seconds=draft_seconds) == \
            verification_capacity([confidences], speeds, draft_seconds=draft_seconds)
    assert plan_is_settled([confidences], curve, block + 1, draft_seconds)  # the whole block always settles


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(probabilities, min_size=6, max_size=6), min_size=1, max_size=4), speed_curves,
       st.sampled_from([0.0, 0.05]), st.integers(0, 6))
def test_a_settled_batch_plan_is_the_plan_of_the_whole_block(rows, speeds, draft_seconds, k):
    curve = StepsPerSecondCurve.from_table(speeds)
    speed = lambda width: curve(len(rows) * width)  # noqa: E731  (padded forward of every row)
    if plan_is_settled([row[:k] for row in rows], speed, 7, draft_seconds):
        assert plan_verification_width([row[:k] for row in rows], speed, 7, draft_seconds) == \
            plan_verification_width(rows, speed, 7, draft_seconds)


def test_plan_settles_early_when_later_drafts_cannot_pay():
    speeds = {1: 10.0, 2: 9.0, 3: 8.0, 4: 7.0, 5: 6.0}
    assert plan_is_settled([[0.05]], StepsPerSecondCurve.from_table(speeds), 5)  # a_1 = 0.05: nothing later pays
    assert not plan_is_settled([[0.95]], StepsPerSecondCurve.from_table(speeds), 5)  # c_2 could make K = 2 best


def test_online_correction_pulls_overconfident_plans_down():
    speeds = {1: 10.0, 2: 9.0}
    policy = HardwareAwarePolicy(speeds, draft_seconds=0.0)
    assert policy.acceptance_ratio == 1.0 and policy.corrected([0.3, 0.5]) == [0.3, 0.5]
    observe(policy, [0.3])
    assert policy.verification_length([0.3]) == 1  # 1.3 tokens at 9/s beat 1 token at 10/s
    for _ in range(30):  # the drafter claims 0.3 but the target never accepts
        record_outcome(policy, [0.3, 0.9], verified=1, accepted=0)
    assert policy.acceptance_ratio < 0.3
    observe(policy, [0.3])
    assert policy.verification_length([0.3]) == 0  # corrected 1 + 0.3 * ratio tokens at 9/s lose to 10/s
    for _ in range(60):  # then it accepts everything it claims
        record_outcome(policy, [0.3], verified=1, accepted=1)
    assert policy.acceptance_ratio > 2.0 and policy.corrected([0.3, 0.5]) == [pytest.approx(min(1.0, 0.3 * policy.acceptance_ratio)), 0.5]
    policy.forget()
    assert policy.acceptance_ratio == 1.0
    off = HardwareAwarePolicy(speeds, outcome_decay=None)
    record_outcome(off, [0.3], verified=1, accepted=0)
    assert off.corrected([0.3]) == [0.3]
    with pytest.raises(ValueError, match="outcome_decay"):
        HardwareAwarePolicy(speeds, outcome_decay=1.0)


def test_plan_smoothing_averages_survival_over_observed_rounds():
    speeds = {1: 10.0, 2: 9.0}  # one draft pays when its survival a_1 > 1/9
    # the plans as they are (`replan=False`: this round's 0.05 would cut any plan)
    last_only = HardwareAwarePolicy(speeds, draft_seconds=0.0, plan_smoothing=0.0, replan=False)  # spec 5.3
    smoothed = HardwareAwarePolicy(speeds, draft_seconds=0.0, plan_smoothing=0.5, replan=False)
    assert smoothed.plan_confidences([0.5, 0.4]) == [0.5, 0.4]  # the first round is all there is
    # a 1-slot round continues its last confidence: survival [0.1, 0.01], blended with [0.5, 0.2]
    assert smoothed.plan_confidences([0.1]) == [pytest.approx(0.3), pytest.approx(0.105 / 0.3)]
    for policy in (last_only, smoothed):
        policy.forget()
        for c in ([0.6], [0.6], [0.05]):  # a drafter that usually pays, then one doubtful round
            observe(policy, c)
    assert last_only.verification_length([0.05]) == 0  # planned from the doubtful round alone
    assert smoothed.verification_length([0.05]) == 1  # blended a_1 = 0.5 * 0.6 + 0.5 * 0.05 still pays
    assert smoothed.plan_confidences([]) == []
    with pytest.raises(ValueError, match="plan_smoothing"):
        HardwareAwarePolicy(speeds, plan_smoothing=1.0)


def test_online_correction_and_plan_smoothing_rules():
    assert corrected_confidences([0.3, 0.5], 2.0) == [0.6, 0.5]  # scaling c_1 scales every survival probability
    assert corrected_confidences([0.8], 2.0) == [1.0] and corrected_confidences([0.3], None) == [0.3]
    assert blend_survival(None, [0.5, 0.4], 0.5) == ([0.5, 0.2], [0.5, 0.4])  # nothing earlier: this round's
    survival, confidences = blend_survival([0.5, 0.2], [0.1], 0.5)  # [0.1] continues as [0.1, 0.01]
    assert survival == [pytest.approx(0.3), pytest.approx(0.105)]
    assert confidences == [pytest.approx(0.3), pytest.approx(0.35)]


def test_engine_plans_time_plain_decoding_before_drafting_at_a_new_row_count():
    policy = HardwareAwarePolicy({1: 10.0, 2: 10.0, 3: 10.0, 4: 9.5, 6: 9.0, 9: 8.5}, draft_seconds=0.0).for_engine()
    confident = [0.9, 0.9]
    assert not policy.begin_round([confident] * 2, 2)  # drafting would pay by the profile: one plain round first
    policy.end_round(RoundOutcome([[], []], [0, 0], [0, 0], drafted=False, step_seconds=0.1))
    assert policy.begin_round([confident] * 2, 2)  # plain decoding timed at 2 rows: now the plan drafts
    assert not policy.begin_round([confident] * 3, 2)  # 3 rows: not timed yet
    # prompt lookup widened that round (2 lookup drafts): plain decoding is still untimed at 3 rows, but the plain round
    # is not tried again
    policy.end_round(RoundOutcome([[], [], []], [2, 0, 0], [1, 0, 0], drafted=False, step_seconds=0.2))
    assert policy.begin_round([confident] * 3, 2)
    policy.speed_model.record_step_seconds(0.01, rows=2, width=1)  # plain decoding runs 10x faster than profiled ...
    policy.speed_model.record_step_seconds(0.5, rows=2, width=2)  # ... and wider steps slower
    policy.speed_model.record_step_seconds(0.5, rows=2, width=3)
    assert not policy.begin_round([confident] * 2, 2)  # the plan says plain decoding


def test_plan_verification_width_margin_over_plain_decoding():
    from dspark_hf.scheduling import plan_verification_width, plan_is_settled

    speeds = {1: 10.0, 2: 9.0, 3: 8.5}.get
    # width 2: (1 + 0.25) * 9 = 11.25 tokens/s against plain decoding's 10: +12.5%
    assert plan_verification_width([[0.25]], speeds, 3) == 2
    assert plan_verification_width([[0.25]], speeds, 3, min_gain=0.1) == 2
    assert plan_verification_width([[0.25]], speeds, 3, min_gain=0.15) == 1
    # after c_1 = 0.1, width 3 could still reach (1.1 + 0.1) * 8.5 = 10.2 tokens/s: above plain decoding's 10, not
    # above it with a 5% margin, so the plan is settled there
    assert not plan_is_settled([[0.1]], speeds, 3) and plan_is_settled([[0.1]], speeds, 3, min_gain=0.05)
    with pytest.raises(ValueError, match="min_gain must be a finite fraction >= 0"):
        HardwareAwarePolicy({1: 1.0}, engine_min_gain=-0.1)


def test_speed_model_reads_wide_steps_relative_to_plain_decoding():
    speeds = HardwareAwarePolicy({1: 10.0, 2: 8.0}).speed_model
    profiled = {1: 10.0, 2: 8.0}.get
    speeds.record_step_seconds(0.1, rows=8, width=1)
    speeds.record_step_seconds(0.2, rows=8, width=2)  # timed once: twice a plain step
    assert speeds.measured_speed(8, 2, profiled) == pytest.approx(5.0)
    for _ in range(15):  # contexts grew (or the host slowed): plain steps now take 0.15 s
        speeds.record_step_seconds(0.15, rows=8, width=1)
    # the width not run since is expected to have slowed alike, not to cost what it did rounds ago
    assert speeds.measured_speed(8, 2, profiled) == pytest.approx(1 / 0.3)
    assert speeds.step_seconds[(8, 2)] == 0.2  # what was measured stays on record
    speeds.record_step_seconds(0.15, rows=4, width=2)  # no plain step timed at 4 rows: the time as measured
    assert speeds.measured_speed(4, 2, profiled) == pytest.approx(1 / 0.15)


def test_speed_model_prefers_measured_step_speeds():
    policy = HardwareAwarePolicy({1: 10.0, 2: 8.0}).speed_model
    profiled = {1: 10.0, 2: 8.0, 3: 6.0}.get
    assert policy.measured_speed(4, 2, profiled) == 8.0  # nothing measured: the profile
    policy.record_step_seconds(0.2, rows=4, width=1)  # plain steps run at 5/s here, half the profiled 10/s
    assert policy.measured_speed(4, 2, profiled) == pytest.approx(4.0)  # unmeasured widths scale with it
    policy.record_step_seconds(0.5, rows=4, width=2)
    assert policy.measured_speed(4, 2, profiled) == pytest.approx(2.0)  # measured: used as is
    policy.record_step_seconds(0.25, rows=4, width=2)
    assert policy.measured_speed(4, 2, profiled) == pytest.approx(1 / 0.375)  # the median of recent steps
    policy.record_step_seconds(5.0, rows=4, width=2)  # one slow step (a reallocation, another process)
    assert policy.measured_speed(4, 2, profiled) == pytest.approx(2.0)  # moves nothing
    for _ in range(3):
        policy.record_step_seconds(0.25, rows=4, width=2)  # the machine got faster: the median follows
    assert policy.measured_speed(4, 2, profiled) == pytest.approx(4.0)
    assert policy.measured_speed(8, 2, profiled) == 8.0  # other row counts keep the profile
    assert policy.measured_speed(4, 4, profiled) is None  # past the profile: still not admissible
    policy.forget()
    assert policy.measured_speed(4, 2, profiled) == 8.0


def test_keeps_verifying_revises_a_plan_with_the_rounds_own_confidences():
    speeds = {1: 10.0, 2: 8.0, 3: 7.5}.get
    # slot 0 of a width-3 plan: with c_1 = 0.5 and the plan's c_2 = 0.9, width 3 gives (1.5 + 0.45) * 7.5 = 14.6 > 10
    assert keeps_verifying([[0.5, 0.9]], speeds, slot=0, max_width=3)
    assert not keeps_verifying([[0.1, 0.9]], speeds, slot=0, max_width=3)  # 1.19 * 7.5 and 1.1 * 8 < 10: stop
    # slot 1: the fresh c_2 decides between width 2 (1.5 * 8 = 12) and 3
    assert keeps_verifying([[0.5, 0.9]], speeds, slot=1, max_width=3)
    assert not keeps_verifying([[0.5, 0.2]], speeds, slot=1, max_width=3)  # 1.6 * 7.5 = 12.0 does not beat 12
    assert not keeps_verifying([[0.9, 0.9]], speeds, slot=2, max_width=3)  # nothing left in the plan
    # rows add up over one padded width: a weak row does not stop a strong one
    assert keeps_verifying([[0.1, 0.1], [0.9, 0.9]], speeds, slot=0, max_width=3)


def test_planned_rounds_cut_their_plan_where_this_rounds_drafts_are_weak():
    speeds = {1: 10.0, 2: 9.0, 3: 8.5, 4: 8.0}
    policy = HardwareAwarePolicy(speeds, draft_seconds=0.0, plan_smoothing=0.0)
    observe(policy, [0.9, 0.9, 0.9])  # plan: 3 drafts
    assert should_draft(policy) and policy.verification_length([0.9, 0.9, 0.9]) == 3
    assert policy.verification_length([0.9, 0.05, 0.9]) == 1  # slot 2's own confidence is weak: stop before it
    unplanned = HardwareAwarePolicy(speeds, draft_seconds=0.0, plan_smoothing=0.0, replan=False)
    observe(unplanned, [0.9, 0.9, 0.9])
    assert should_draft(unplanned) and unplanned.verification_length([0.9, 0.05, 0.9]) == 3  # the plan as it is
    # the engine's width, cut for every row at once
    engine = HardwareAwarePolicy({**speeds, 6: 6.0, 8: 5.0}, draft_seconds=0.0).for_engine()  # 2 rows: 9, 8, 6, 5
    assert engine.replan and not unplanned.for_engine().replan
    assert not engine.begin_round([[0.9, 0.9, 0.9]] * 2, 3)  # a plain round first times plain decoding at 2 rows
    engine.end_round(RoundOutcome([[], []], [0, 0], [0, 0], drafted=False, step_seconds=1 / 9.0))
    assert engine.begin_round([[0.9, 0.9, 0.9]] * 2, 3)
    assert engine.verification_lengths([[0.9, 0.9, 0.9]] * 2) == [3, 3]
    assert engine.verification_lengths([[0.9, 0.05, 0.9], [0.9, 0.1, 0.9]]) == [1, 1]
    # a weak third draft in one row: (2 + 3.42) * 6 = 32.5 tokens/s at width 3 beat 6.19 * 5 at width 4
    assert engine.verification_lengths([[0.9, 0.9, 0.05], [0.9, 0.9, 0.9]]) == [2, 2]


def test_engine_stops_drafting_where_drafted_rounds_did_not_pay():
    speeds = {16: 10.0, 32: 10.0, 48: 9.5, 64: 9.0, 96: 8.5}  # by tokens in the forward: 16 rows verify 1-6 each
    confident = [[0.9, 0.9]] * 16

    def engine(**kwargs):
        # no online correction of the confidences: the plans stay as optimistic as stale confidences can make them
        policy = HardwareAwarePolicy(speeds, draft_seconds=0.0, outcome_decay=None, **kwargs).for_engine()
        policy.begin_round(confident, 2)  # the plain round that times plain decoding at 16 rows (0.1 s)
        policy.end_round(RoundOutcome([[]] * 16, [0] * 16, [0] * 16, drafted=False, step_seconds=0.1))
        return policy

    guarded, unguarded = engine(), engine(payoff_guard=False)
    assert guarded.payoff_guard and not unguarded.payoff_guard
    assert guarded.realized_payoff(16) == pytest.approx(1.2)  # the prior
    # every drafted round commits 1.5 tokens per row and costs two plain steps (drafting 0.05 s, verifying 0.15 s)
    weak = RoundOutcome(confident, [2] * 16, [1, 0] * 8, draft_seconds=0.05, step_seconds=0.15)
    drafted = []
    for policy in (guarded, unguarded):
        drafted.append(0)
        for _ in range(8):
            if not policy.begin_round(confident, 2):
                break
            drafted[-1] += 1
            policy.end_round(weak)
    assert drafted == [2, 8]  # the plan drafts all along; the guard stops it after two rounds of evidence, not one
    assert guarded.realized_payoff(16) < 1.0 < guarded.realized_payoff(15)  # per row count: none yet at 15 rows
    plain = RoundOutcome([[]] * 16, [0] * 16, [0] * 16, drafted=False, step_seconds=0.1)

    def run(policy, outcome, rounds=40):
        count = 0
        for _ in range(rounds):
            test = policy.begin_round(confident, 2)
            count += test
            policy.end_round(outcome if test else plain)
        return count

    # guarded, the rounds decode plainly and test the plan with backoff (after 1, 2, 4, ... plain rounds) ...
    assert run(guarded, weak) <= 6 and run(unguarded, weak) == 40
    assert guarded.realized_payoff(16) < 1.0
    # ... and tests that pay lift the guard: the plan drafts every round again
    paying = RoundOutcome(confident, [2] * 16, [2] * 16, draft_seconds=0.0, step_seconds=0.1)
    run(guarded, paying, rounds=200)
    assert guarded.realized_payoff(16) > 1.0 and run(guarded, paying) == 40


def test_payoff_guard_weighs_rounds_by_their_rows():
    weak = [1.5, 2.0]  # tokens per row and plain steps of a losing round (a payoff of 0.75)
    stopped = {}
    for rows in (2, 32):
        policy = HardwareAwarePolicy({64: 10.0}, draft_seconds=0.0).for_engine()
        rounds = 0
        while policy.realized_payoff(rows) >= 1.0:
            policy._width = 2  # a planned round
            policy.end_round(RoundOutcome([[0.9]] * rows, [1] * rows, [1] * (rows // 2) + [0] * (rows // 2),
                                          draft_seconds=0.0, step_seconds=weak[1] / policy.speed(rows)(1)))
            rounds += 1
        stopped[rows] = rounds
    assert stopped[32] <= 2 < 15 <= stopped[2]  # a round of 2 rows is a noisy forecast: it takes many to stop them


def test_payoff_guard_counts_planned_rounds_with_their_drafting_pass_and_every_rows_tokens():
    policy = HardwareAwarePolicy({1: 10.0, 2: 10.0, 4: 9.0}, draft_seconds=0.0).for_engine()
    policy.end_round(RoundOutcome([[], []], [0, 0], [0, 0], drafted=False, step_seconds=0.1))  # times plain decoding
    assert policy.begin_round([[0.9], [0.9]], 1)  # planned: one draft per row
    # 2 + 1 = 3 tokens for (0.1 + 0.2) s = 3 plain steps of 2 rows: a payoff of 0.5
    policy.end_round(RoundOutcome([[0.9], [0.9]], [1, 1], [1, 0], draft_seconds=0.1, step_seconds=0.2))
    tokens, cost = policy._payoff[2]
    assert tokens == pytest.approx(3.0) and cost == pytest.approx(6.0)
    policy.end_round(RoundOutcome([[], []], [0, 0], [0, 0], drafted=False, step_seconds=0.1))  # plain: not counted
    assert not policy.begin_round([[0.1], [0.1]], 1)  # nothing planned: plain (the backoff's first skip) ...
    policy.end_round(RoundOutcome([[], []], [0, 0], [0, 0], drafted=False, step_seconds=0.1))
    assert policy.begin_round([[0.1], [0.1]], 1)  # ... then a probe, which does not count either
    policy.end_round(RoundOutcome([[0.1], [0.1]], [0, 0], [0, 0], draft_seconds=0.1, step_seconds=0.1))
    assert policy._payoff[2] == [tokens, cost]


def test_payoff_guard_counts_only_the_rows_that_decode():
    # a row whose request finished, kept for a waiting request, commits nothing: neither a token nor a share of the cost
    def payoff(held):
        policy = HardwareAwarePolicy({1: 10.0, 4: 10.0, 8: 9.0}, draft_seconds=0.0).for_engine()
        policy.end_round(RoundOutcome([[]] * 4, [0] * 4, [0] * 4, drafted=False, step_seconds=0.1))
        assert policy.begin_round([[0.9]] * 4, 1)
        # two plain steps of 4 rows; the decoding rows accept their one draft (2 tokens each)
        policy.end_round(RoundOutcome([[0.9]] * 4, [1] * 4, [0 if idle else 1 for idle in held], draft_seconds=0.0,
                                      step_seconds=0.2, held=held))
        return policy._payoff[4]

    assert payoff([False] * 4) == pytest.approx([8.0, 8.0])  # 2 tokens per row for 2 steps: a payoff of 1
    assert payoff([False, True, True, False]) == pytest.approx([4.0, 4.0])  # still 1, not (4 + 2) / 8 = 0.75
