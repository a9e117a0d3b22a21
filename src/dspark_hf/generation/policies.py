"""Verification-length policies: how many of a block's drafts the target verifies.

Every policy implements the batch-shaped interface of `dspark_hf.generation.verification_policy` (batch 1 is one row),
which the batch-1 candidate generator, the batched engine, the ``custom_generate`` recipe and the trace simulator all
drive the same way. This module adds the hardware-aware policies, which plan with a measured [`SpeedModel`] and the
pure arithmetic of `dspark_hf.scheduling`, and the lookup from names.

By default (``drafter.verification_policy == "auto"``) generation uses the hardware-aware policy with this machine's
measured speeds (see `resolve_policy`). Select another by name on the drafter (``drafter.verification_policy =
"threshold"``) or pass an instance:

```python
>>> from dspark_hf.generation.policies import get_policy
>>> get_policy("threshold", threshold=0.3, cumulative=True)
ThresholdPolicy(threshold=0.3, cumulative=True)
>>> policy = get_policy("hardware_aware", steps_per_second={1: 10.0, 2: 6.0, 3: 5.5})
>>> policy.verification_lengths([[0.9, 0.8, 0.2]])
[2]

```
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..scheduling import (
    StepsPerSecondCurve,
    acceptance_ratio,
    blend_survival,
    corrected_confidences,
    expected_accepted_drafts,
    keeps_verifying,
    plan_is_settled,
    plan_verification_width,
    schedule_verification_lengths,
    verification_capacity,
)
from .speed_model import SpeedModel
from .verification_policy import (
    FixedLengthPolicy,
    FullBlockPolicy,
    RoundOutcome,
    ThresholdPolicy,
    VerificationPolicy,
)


__all__ = [
    "VerificationPolicy",
    "RoundOutcome",
    "FullBlockPolicy",
    "FixedLengthPolicy",
    "ThresholdPolicy",
    "HardwareAwarePolicy",
    "PlannedWidthPolicy",
    "SpeedModel",
    "POLICIES",
    "AUTO",
    "get_policy",
    "resolve_policy",
    "policy_for_call",
    "check_policy_name",
]


# The batched engine's margin over plain decoding (`PlannedWidthPolicy.min_gain`): drafting must promise this much more
# throughput. 0: in a noise-free replay of bench-load's prompts (docs/batched-engine.md) a 10% margin cost 1-3%
# at 1-4 requests and changed nothing at 16-32, and on this machine an A/B could not tell 0 from 0.1 at 16-32.
ENGINE_MIN_GAIN = 0.0

# The batched engine's check of its plans against what planned rounds returned (`PlannedWidthPolicy.payoff_guard`):
# a planned round's payoff is the tokens it committed per row over its drafting and verification time in plain steps
# of that many rows. The running payoff per row count weighs each round by its rows (a round of 32 rows is 32 rows'
# evidence, a round of 2 rows is a noisy one), decays by `PAYOFF_DECAY` per planned round (about twenty rounds of
# memory) and starts from `PAYOFF_PRIOR_ROWS` row-rounds at `PAYOFF_PRIOR`: at 32 rows a few rounds that lose stop
# the plans, at 2 rows, where drafting pays most, one unlucky round does not.
PAYOFF_DECAY = 0.95
PAYOFF_PRIOR_ROWS = 64.0
PAYOFF_PRIOR = 1.2


class _MeasuredPolicy(VerificationPolicy):
    """What the hardware-aware policies share: a [`SpeedModel`], the online correction of confidences by the drafts
    actually accepted, and the backoff of drafting while plans verify nothing."""

    # Pseudo-count (in expected accepted drafts) that starts the acceptance ratio at 1: the calibration is trusted
    # until a few rounds say otherwise.
    OUTCOME_PRIOR = 2.0

    name = "hardware_aware"
    requires_confidence = True

    def __init__(self, speed_model: SpeedModel, max_idle_rounds: int = 64, outcome_decay: float | None = 0.95):
        if max_idle_rounds < 1:
            raise ValueError(f"max_idle_rounds must be >= 1, got {max_idle_rounds}.")
        if outcome_decay is not None and not 0.0 <= outcome_decay < 1.0:
            raise ValueError(f"outcome_decay must be in [0, 1) (or None for no online correction), got {outcome_decay}.")
        self.speed_model = speed_model
        self.max_idle_rounds = max_idle_rounds
        self.outcome_decay = outcome_decay
        self.reset()

    def reset(self) -> None:
        # A generation is a new request: the backoff and acceptance ratio describe the last prompt, and carried over
        # they would keep a math prompt that follows a chat prompt from drafting for up to `max_idle_rounds` rounds.
        # What was measured about the machine (the speed model) outlives it; `forget` drops that too.
        self._idle_rounds, self._backoff = 0, 1
        self._accepted, self._predicted = 0.0, 0.0  # decayed sums behind `acceptance_ratio`
        self._round_outcome = [0.0, 0.0]  # accepted and predicted drafts of the last verified round (all rows)
        self._probing = False  # this round drafts although nothing was planned: it verifies by Algorithm 1
        self._probed = False  # the last round that drafted was a probe
        self._block_size: int | None = None

    def forget(self) -> None:
        """Drops everything learned: the speed model's measurements, the plan, the backoff and the acceptance ratio."""
        self.speed_model.forget()
        self.reset()

    @property
    def acceptance_ratio(self) -> float:
        """Accepted drafts per predicted accepted draft over recent verified rounds (1 before any)."""
        return acceptance_ratio(self._accepted, self._predicted, self.OUTCOME_PRIOR)

    def corrected(self, confidences: Sequence[float]) -> list[float]:
        """Confidences with every survival probability scaled by `acceptance_ratio` (capped at 1)."""
        return corrected_confidences(confidences, None if self.outcome_decay is None else self.acceptance_ratio)

    def drafting_cost(self, rows: int = 1) -> float:
        """Seconds of one drafting pass over `rows` rows ([`SpeedModel.drafting_cost`])."""
        return self.speed_model.drafting_cost(rows)

    def draft_this_round(self, nothing_planned: bool) -> bool:
        """Exponential backoff of drafting while the plan verifies nothing: after a probe that still plans 0, skip
        1, 2, 4, ... `max_idle_rounds` rounds before the next probe; any plan above 0 drafts every round again. The
        backoff starts over at 1 only after a planned round (not a probe) whose drafts were accepted at least as often
        as their confidences predicted: a probe that plans drafts which then fail does not restart frequent probing,
        and neither does a probe whose drafts did as predicted while the plan still says drafting does not pay (with
        calibrated confidences that is every other probe, and under load, where a padded probe costs most, probing
        would never back off)."""
        accepted, predicted = self._round_outcome
        self._round_outcome = [0.0, 0.0]
        if predicted > 0 and accepted >= predicted and not self._probed:
            self._backoff = 1
        if not nothing_planned:
            self._idle_rounds, self._probed = 0, False
            return True
        if self._idle_rounds < self._backoff:
            self._idle_rounds += 1
            return False
        self._idle_rounds, self._backoff = 0, min(2 * self._backoff, self.max_idle_rounds)
        self._probing = self._probed = True
        return True

    def _record(self, outcome: RoundOutcome) -> None:
        """Feeds a finished round's timings to the speed model and its accepted drafts to the acceptance ratio."""
        rows = len(outcome.verified)
        if outcome.draft_seconds is not None:
            self.speed_model.record_draft_seconds(outcome.draft_seconds, rows)
        for confidences, verified, accepted in zip(outcome.confidences, outcome.verified, outcome.accepted):
            self._record_outcome(confidences, verified, accepted)
        if outcome.step_seconds is not None:
            self.speed_model.record_step_seconds(outcome.step_seconds, rows, outcome.width)

    def _record_outcome(self, confidences: Sequence[float], verified: int, accepted: int) -> None:
        if verified <= 0 or len(confidences) < verified:
            return
        predicted = expected_accepted_drafts(confidences, verified)
        self._round_outcome[0] += accepted
        self._round_outcome[1] += predicted
        if self.outcome_decay is None:
            return
        self._accepted = self.outcome_decay * self._accepted + accepted
        self._predicted = self.outcome_decay * self._predicted + predicted

    def _started(self) -> int:
        if self._block_size is None:
            raise RuntimeError(f"{type(self).__name__} plans per round: call begin_round(stale_confidences, "
                               "block_size) first (the drafting paths do).")
        return self._block_size


class HardwareAwarePolicy(_MeasuredPolicy):
    """Verification lengths that maximize expected tokens per second on the profiled hardware.

    - ``mode="algorithm1"``: the paper's Algorithm 1 for one request: extend the verified prefix while
      ``(1 + Σ_{j<=k} a_j) · SPS(1 + k)`` strictly improves, stop at the first slot that does not
      ([`schedule_verification_lengths`] on c_1..c_k). On a curve with a cliff (verifying 2 tokens at under half the
      speed of 1, as on small CPUs) the early stop never gets past it.
    - ``mode="planned"`` (default): the production scheduler (docs/design.md, "Production scheduler") at one request:
      the length is the capacity K that a global search over the whole curve picks from the previous round's
      confidences ([`verification_capacity`]), so cliffs do not trap it; being planned from stale information, it is
      non-anticipating. The first round of a generation, with nothing observed yet, uses Algorithm 1. A planned round
      samples the unverified tail of its block only as far as the next plan could still change
      ([`plan_is_settled`]). With `replan` the round then cuts its planned length short where its own confidences,
      as they arrive slot by slot, say the rest does not pay ([`keeps_verifying`]).

    Plans also correct the confidences online: the policy keeps a running ratio of the drafts the target accepted
    to the number their confidences predicted (``Σ_{j<=ℓ} a_j`` per verified round, decaying with
    `outcome_decay`), and scales the survival probabilities of later plans by it (``c_1 ← min(1, ratio · c_1)``).
    A calibration fitted on other prompts is then pulled toward what this prompt, this machine and this sampling
    mode actually accept. The ratio reads finished rounds only, so plans stay non-anticipating.

    The planned mode also weighs the drafter's own cost: a round that verifies K >= 1 drafts takes
    ``1 / SPS(1 + K) + draft_seconds``, a round without drafts only ``1 / SPS(1)`` and no drafting at all. When the
    plan is 0 the drafter is not run; it probes again after 1, 2, 4, ... up to `max_idle_rounds` skipped rounds
    (exponential backoff), and a probe round verifies by Algorithm 1 on its own confidences. Each generation starts a
    new plan, backoff and acceptance ratio (`reset()`): they describe one prompt. The measured drafting and step times
    ([`SpeedModel`], `speed_model`) carry over (`forget()` clears them too).

    Rows are planned one by one, as independent requests whose rows stay in place from round to round (batch 1 is
    one row). The batched engine, whose rows come and go, runs [`PlannedWidthPolicy`] on the same speed model instead
    (`for_engine`).

    Args:
        steps_per_second (`Mapping[int, float]`, `Sequence[float]`, [`StepsPerSecondCurve`], or a path): the target's
            profiled forward steps per second by number of tokens in the verification forward (1 = plain decoding),
            or the path of a profile written by `dspark-hf profile` (a JSON file, or the drafter folder holding it).
            Sizes between profiled ones run at the next larger profiled size's speed; larger sizes are never
            verified (see `dspark_hf.scheduling`).
        mode (`str`, defaults to `"planned"`): `"planned"` or `"algorithm1"`.
        draft_seconds (`float`, *optional*): wall time of one drafting pass at batch size 1. By default it is
            measured while generating (the median of recent passes, so it follows the machine's load); 0 ignores it
            (the paper's GPU setting).
        max_idle_rounds (`int`, defaults to 64): the longest run of rounds without drafting between two probes.
        outcome_decay (`float`, defaults to 0.95): weight of the past per verified round in the acceptance ratio
            (about 1 / (1 - decay) rounds of memory); `None` turns the online correction off.
        plan_smoothing (`float`, defaults to 0.5): weight of earlier rounds in the survival probabilities a plan
            reads: the plan maximizes the expected rate for the *next* round, and one round's confidences are a noisy
            forecast of it. With w > 0 the plan reads ``w · S + (1 - w) · a`` (``S`` the running average over earlier
            observed rounds of this generation, ``a`` the last round's survival, [`blend_survival`]). 0 plans from the
            last round alone, as docs/design.md, "Production scheduler", states. Plans stay built from finished rounds
            only, so any value is lossless. Batch 1 only: the batched engine plans from every row's last round, whose
            sum over rows already averages.
        engine_min_gain (`float`, defaults to `ENGINE_MIN_GAIN`): the batched engine's margin: it drafts only for a
            width expected to beat plain decoding by this much ([`PlannedWidthPolicy`], `min_gain`).
        replan (`bool`, defaults to `True`): a planned round stops verifying at the first slot where this round's
            own confidences so far (and the plan's for the slots after) make stopping faster than any longer prefix
            up to the plan ([`keeps_verifying`]; the drafting is paid by then). Non-anticipating, so lossless when
            sampling too; `False` verifies the plan as it is (the paper's production scheduler).
        payoff_guard (`bool`, defaults to `True`): the batched engine stops drafting at a row count where its planned
            rounds have recently paid less than plain decoding ([`PlannedWidthPolicy`], `payoff_guard`).
    """

    def __init__(
        self,
        steps_per_second: Mapping[int, float] | Sequence[float] | StepsPerSecondCurve | str | os.PathLike,
        mode: str = "planned",
        draft_seconds: float | None = None,
        max_idle_rounds: int = 64,
        outcome_decay: float | None = 0.95,
        plan_smoothing: float = 0.5,
        engine_min_gain: float = ENGINE_MIN_GAIN,
        replan: bool = True,
        payoff_guard: bool = True,
    ):
        if isinstance(steps_per_second, (str, os.PathLike)):
            from ..profiling import load_steps_per_second  # lazy: profiling imports model loading

            steps_per_second = load_steps_per_second(steps_per_second)
        if mode not in ("planned", "algorithm1"):
            raise ValueError(f"mode must be 'planned' or 'algorithm1', got {mode!r}.")
        if draft_seconds is not None and not (math.isfinite(draft_seconds) and draft_seconds >= 0):
            raise ValueError(f"draft_seconds must be a finite time >= 0 (or None to measure it), got {draft_seconds}.")
        if not 0.0 <= plan_smoothing < 1.0:
            raise ValueError(f"plan_smoothing must be in [0, 1) (0: plan from the last round only), got {plan_smoothing}.")
        self.mode = mode
        self.plan_smoothing = plan_smoothing
        self.engine_min_gain = _check_min_gain(engine_min_gain)
        self.replan = bool(replan)
        self.payoff_guard = bool(payoff_guard)
        super().__init__(SpeedModel(steps_per_second, draft_seconds), max_idle_rounds, outcome_decay)

    @property
    def steps_per_second(self) -> StepsPerSecondCurve:
        """The profiled curve the plans read."""
        return self.speed_model.curve

    @property
    def draft_seconds(self) -> float | None:
        return self.speed_model.draft_seconds

    @classmethod
    def from_profile(cls, path: str | os.PathLike) -> "HardwareAwarePolicy":
        """The policy for a profile saved by `dspark-hf profile` (a JSON file, or the folder it was saved in)."""
        return cls(Path(path))

    def reset(self) -> None:
        super().reset()
        self._plans: dict[int, int] = {}  # row -> drafts planned for its next round
        self._plan_basis: dict[int, list[float]] = {}  # row -> the (uncorrected) confidences its plan read
        self._smoothed: dict[int, list[float]] = {}  # row -> running average of its observed rounds' survival

    def for_engine(self, steps_per_second_by_rows=None) -> "PlannedWidthPolicy":
        return PlannedWidthPolicy(self.speed_model, steps_per_second_by_rows, self.max_idle_rounds, self.outcome_decay,
                                  self.engine_min_gain, self.replan, self.payoff_guard)

    def begin_round(self, stale_confidences, block_size: int) -> bool:
        self._block_size = block_size
        nothing_planned = self.mode == "planned" and bool(self._plans) and not any(self._plans.values())
        return self.draft_this_round(nothing_planned)

    def num_slots(self, block_size: int, budgets: Sequence[int]) -> int:
        # A planned round reads the whole block's confidences for the next plan (as far as `settled` needs them).
        return block_size if self.mode == "planned" else super().num_slots(block_size, budgets)

    def verified(self, slot, confidences, candidates) -> list[bool]:
        return [candidate and self._verifies(row, slot + 1, values)
                for row, (candidate, values) in enumerate(zip(candidates, confidences))]

    def should_verify(self, position: int, confidences: Sequence[float]) -> bool:
        return self._verifies(0, position, confidences)

    def _verifies(self, row: int, position: int, confidences: Sequence[float]) -> bool:
        plan = self._plans.get(row)
        if self.mode == "planned" and plan is not None and not self._probing:
            if position > plan:
                return False
            if not self.replan:
                return True
            revised = self.corrected([*confidences[:position], *self._plan_basis[row][position:plan]])
            return keeps_verifying([revised], self.steps_per_second, position - 1, plan + 1)
        # Algorithm 1 on this round's confidences (also the planned mode's first round, before any observation)
        prefix = self.corrected(confidences[:position])
        return schedule_verification_lengths([prefix], self.steps_per_second)[0] >= position

    def settled(self, confidences) -> bool:
        if self.mode != "planned":
            return True
        block_size = self._started()
        return all(len(values) >= block_size or plan_is_settled(
            [self.corrected(values)], self.steps_per_second, block_size + 1, draft_seconds=self.drafting_cost(1))
            for values in confidences)  # fmt: skip

    def end_round(self, outcome: RoundOutcome) -> None:
        # Plans come first, from the measurements and acceptance ratio of earlier rounds: the length is planned by a
        # global search over the whole (jagged) curve from confidences that are stale by the time they are used.
        if outcome.observed:
            self._probing = False
            if self.mode == "planned":
                for row, values in enumerate(outcome.confidences):
                    self._plan_basis[row] = self.plan_confidences(values, row)
                    self._plans[row] = verification_capacity(
                        [self.corrected(self._plan_basis[row])], self.steps_per_second,
                        draft_seconds=self.drafting_cost(1))  # fmt: skip
        self._record(outcome)

    def plan_confidences(self, confidences: Sequence[float], row: int = 0) -> list[float]:
        """The confidences the next plan of `row` reads: this round's c_1..c_k, blended with earlier rounds' when
        `plan_smoothing` > 0 ([`blend_survival`]). Adds this round to the running average, so call it once per
        observed round (`end_round` does)."""
        if not self.plan_smoothing or not confidences:
            return [float(c) for c in confidences]
        self._smoothed[row], blended = blend_survival(self._smoothed.get(row), confidences, self.plan_smoothing)
        return blended

    def __repr__(self) -> str:
        table = dict(zip(self.steps_per_second.sizes, self.steps_per_second.speeds))
        return (f"HardwareAwarePolicy(steps_per_second={table}, mode={self.mode!r}, draft_seconds={self.draft_seconds!r}, "
                f"max_idle_rounds={self.max_idle_rounds}, outcome_decay={self.outcome_decay}, "
                f"plan_smoothing={self.plan_smoothing}, engine_min_gain={self.engine_min_gain}, "
                f"replan={self.replan}, payoff_guard={self.payoff_guard})")


class PlannedWidthPolicy(_MeasuredPolicy):
    """The hardware-aware policy for batches whose rows come and go (`DSparkBatchEngine`): the production scheduler
    (docs/design.md, "Production scheduler") over one padded verification width for all rows.

    Each round plans the width (1 + drafts per row) from every row's stale confidences (its last observed round; rows
    without one read the mean of the others, or 0.5 per slot) with [`plan_verification_width`], on the speed model's
    steps per second for this many rows and its drafting cost. Width 1 skips the drafter, with the same backoff and
    probes as [`HardwareAwarePolicy`]; a probe verifies while Algorithm 1 over widths on its own confidences extends
    the width. A planned round cuts its width short at the first slot where the rows' own confidences so far make
    stopping faster than any wider forward up to the plan ([`keeps_verifying`], with `replan`). A round samples
    unverified slots only while the next plan could still change ([`plan_is_settled`]).

    Plans read stale confidences, and where the policy drafts selectively, after rounds whose confidences were high,
    the next blocks regress toward the mean: at 32 rows on a 2-core CPU drafted rounds committed ~1.9 tokens per row
    for ~2.1 plain steps of time, although their plans expected a gain. With `payoff_guard` the policy keeps, per row
    count, the payoff its planned rounds actually had (`realized_payoff`: tokens per row over their cost in plain
    steps) and overrules a plan to draft while that payoff is below what plans must beat (``1 + min_gain``): those
    rounds decode plainly, except that after 1, 2, 4, ... `max_idle_rounds` of them one round runs its plan as a test
    (probes test what they would stop, the plans, not Algorithm 1's shorter widths), and tests that pay lift the
    guard. It reads finished rounds only, so it is lossless like the plan.

    Args:
        speed_model ([`SpeedModel`]): the profile and measurements (shared with the [`HardwareAwarePolicy`] it came
            from, so that measurements carry over between engines).
        steps_per_second_by_rows (`Mapping[int, Mapping[int, float]]`, *optional*): a profile's per-row-count tables
            (`by_batch_size` of `dspark-hf profile`); without them the curve is read at ``rows · width`` tokens.
        max_idle_rounds, outcome_decay: as for [`HardwareAwarePolicy`].
        min_gain (`float`, defaults to `ENGINE_MIN_GAIN`): a width above 1 is planned only when it is expected to
            beat plain decoding by this fraction ([`plan_verification_width`]).
        replan (`bool`, defaults to `True`): cut a planned width by the round's own confidences, as
            [`HardwareAwarePolicy`]'s `replan`.
        payoff_guard (`bool`, defaults to `True`): overrule plans to draft at a row count where planned rounds have
            recently paid less than plain decoding (above).
    """

    def __init__(
        self,
        speed_model: SpeedModel,
        steps_per_second_by_rows: Mapping[int, Mapping[int, float]] | None = None,
        max_idle_rounds: int = 64,
        outcome_decay: float | None = 0.95,
        min_gain: float = ENGINE_MIN_GAIN,
        replan: bool = True,
        payoff_guard: bool = True,
    ):
        self.steps_per_second_by_rows = steps_per_second_by_rows
        self.min_gain = _check_min_gain(min_gain)
        self.replan = bool(replan)
        self.payoff_guard = bool(payoff_guard)
        super().__init__(speed_model, max_idle_rounds, outcome_decay)

    def reset(self) -> None:
        super().reset()
        self._width: int | None = None
        self._basis: list[list[float]] = []  # the (uncorrected) confidences each row's share of the plan read
        self._explored: set[int] = set()  # row counts where a plain round was run to time plain decoding
        # rows -> decayed sums of (tokens, cost in plain steps x rows) of planned rounds (`realized_payoff`)
        self._payoff: dict[int, list[float]] = {}

    def for_engine(self, steps_per_second_by_rows=None) -> "PlannedWidthPolicy":
        if steps_per_second_by_rows is None:
            return self
        return PlannedWidthPolicy(self.speed_model, steps_per_second_by_rows, self.max_idle_rounds, self.outcome_decay,
                                  self.min_gain, self.replan, self.payoff_guard)

    def realized_payoff(self, rows: int) -> float:
        """Tokens per decoding row that recent planned rounds of `rows` rows committed per plain step of time they took
        (their drafting pass and verification forward), each round weighed by its decoding rows and decayed by
        `PAYOFF_DECAY` per round, from a prior of `PAYOFF_PRIOR_ROWS` row-rounds at `PAYOFF_PRIOR`. Above 1: the plans
        have paid at this row count."""
        tokens, cost = self._payoff.get(rows, (0.0, 0.0))
        return (tokens + PAYOFF_PRIOR_ROWS * PAYOFF_PRIOR) / (cost + PAYOFF_PRIOR_ROWS)

    def begin_round(self, stale_confidences, block_size: int) -> bool:
        self._block_size, rows = block_size, len(stale_confidences)
        prior = _mean_confidences(stale_confidences, block_size) if not all(stale_confidences) else None
        self._basis = [list(values or prior) for values in stale_confidences]
        stale = [self.corrected(values) for values in self._basis]
        self._width = plan_verification_width(stale, self.speed(rows), block_size + 1,
                                              draft_seconds=self.drafting_cost(rows), min_gain=self.min_gain)
        if self._width > 1 and not self.speed_model.has_step(rows, 1) and rows not in self._explored:
            # What drafting has to beat is plain decoding at this many rows on the live machine, which the profile
            # (idle, one context length) can misjudge by 10% and more; one plain round measures it (once: with prompt
            # lookup the round may verify lookup drafts instead, and then the profile stays the guess).
            self._explored.add(rows)
            self._width = 1
            return False
        if self._width > 1 and self.payoff_guard and self.realized_payoff(rows) < 1.0 + self.min_gain:
            # planned rounds have not paid here lately: decode plainly, testing the plan with the probes' backoff
            if self.draft_this_round(True):
                return True
            self._width = 1
            return False
        return self.draft_this_round(self._width == 1)

    def verified(self, slot, confidences, candidates) -> list[bool]:
        self._started()
        if self._width == 1:  # `>=`: on a flat curve float noise can make the probe width jump past the next slot
            verified = self._probe_width(confidences) >= slot + 2
        else:
            verified = slot < self._width - 1 and (not self.replan
                                                   or self._keeps_verifying(slot, confidences, candidates))
        return [candidate and verified for candidate in candidates]

    def _keeps_verifying(self, slot, confidences, candidates) -> bool:
        """[`keeps_verifying`] for the planned width: each row's fresh c_1..c_{slot+1}, then its plan's (a row that
        no longer verifies ends before the slot)."""
        end = self._width - 1
        revised = [self.corrected([*values[:slot + 1], *basis[slot + 1:end]] if candidate else values[:slot])
                   for values, basis, candidate in zip(confidences, self._basis, candidates)]
        return keeps_verifying(revised, self.speed(len(confidences)), slot, self._width)

    def settled(self, confidences) -> bool:
        rows = len(confidences)
        return plan_is_settled([self.corrected(values) for values in confidences], self.speed(rows),
                               self._started() + 1, draft_seconds=self.drafting_cost(rows), min_gain=self.min_gain)

    def end_round(self, outcome: RoundOutcome) -> None:
        self._record(outcome)
        # a round that verified a plan (or tested one for the guard) has a width above 1; probes and plain rounds do not
        rows, planned = len(outcome.verified), (self._width or 1) > 1
        if not (planned and outcome.drafted and outcome.decoding and outcome.draft_seconds is not None
                and outcome.step_seconds is not None):
            return
        plain = self.speed(rows)(1)
        if not plain:
            return
        # per decoding row: a held row (a finished request's, kept for a waiting one) commits nothing, and plain
        # decoding would carry it alike (`plain` is the speed of all `rows`)
        held = outcome.held or [False] * rows
        tokens = sum(accepted + 1 for accepted, idle in zip(outcome.accepted, held) if not idle)
        cost = (outcome.draft_seconds + outcome.step_seconds) * plain * outcome.decoding
        past = self._payoff.get(rows, (0.0, 0.0))
        self._payoff[rows] = [PAYOFF_DECAY * past[0] + tokens, PAYOFF_DECAY * past[1] + cost]

    def _probe_width(self, confidences) -> int:
        """A probe's width: Algorithm 1 over widths on this round's (corrected) confidences; its drafting is paid."""
        corrected = [self.corrected(values) for values in confidences]
        return plan_verification_width(corrected, self.speed(len(confidences)), self._started() + 1, early_stop=True)

    def speed(self, rows: int):
        """Steps per second of a verification forward by width, for `rows` rows (the speed model: profile and
        measurements)."""
        return self.speed_model.speed(rows, self.steps_per_second_by_rows)

    def __repr__(self) -> str:
        return (f"PlannedWidthPolicy({self.speed_model!r}, steps_per_second_by_rows={self.steps_per_second_by_rows!r}, "
                f"max_idle_rounds={self.max_idle_rounds}, outcome_decay={self.outcome_decay}, "
                f"min_gain={self.min_gain}, replan={self.replan}, payoff_guard={self.payoff_guard})")


def _check_min_gain(min_gain: float) -> float:
    if not (math.isfinite(min_gain) and min_gain >= 0):
        raise ValueError(f"min_gain must be a finite fraction >= 0 (0.1: drafting must promise 10% more tokens/s), "
                         f"got {min_gain}.")
    return float(min_gain)


def _mean_confidences(stale_confidences, block_size: int) -> list[float]:
    """Per-slot mean of the rows' stale confidences (0.5 per slot when no row has any): a new row's first plan."""
    seen = [values for values in stale_confidences if values]
    if not seen:
        return [0.5] * block_size
    return [sum(values) / len(values) for values in zip(*seen)]


POLICIES = {cls.name: cls for cls in (FullBlockPolicy, FixedLengthPolicy, ThresholdPolicy, HardwareAwarePolicy)}
# The default `drafter.verification_policy`: hardware-aware with this machine's speeds (full block without confidences).
AUTO = "auto"


def check_policy_name(policy: str | VerificationPolicy | None) -> None:
    """Refuses what `drafter.verification_policy` cannot take, when it is set rather than at the next generate."""
    if policy is None or isinstance(policy, VerificationPolicy) or policy == AUTO or policy in POLICIES:
        return
    raise ValueError(
        f"Unknown verification policy {policy!r}; choose one of {sorted([AUTO, *POLICIES])} or pass a "
        "VerificationPolicy instance (e.g. FixedLengthPolicy(2), ThresholdPolicy(0.5))."
    )


def policy_for_call(settings: Mapping[str, object]) -> VerificationPolicy | None:
    """The policy that transformers' own speculation settings of a `generate` call ask for, else `None`.

    `num_assistant_tokens=n` verifies the first n drafts of every block ([`FixedLengthPolicy`]);
    `assistant_confidence_threshold=t` stops at the first draft whose calibrated confidence is below t
    ([`ThresholdPolicy`], the counterpart of transformers' threshold on the assistant's token probability). Either
    overrides `drafter.verification_policy` for that call. A heuristic `num_assistant_tokens_schedule` tunes
    transformers' own assistants and is refused, as is asking for both a length and a threshold.
    """
    schedule = settings.get("num_assistant_tokens_schedule")
    if schedule is not None:
        raise ValueError(
            f"num_assistant_tokens_schedule={schedule!r} does not apply to a DSpark assistant, whose verification "
            "lengths come from drafter.verification_policy (hardware-aware by default); drop it."
        )
    length, threshold = settings.get("num_assistant_tokens"), settings.get("assistant_confidence_threshold")
    if length is not None and threshold is not None:
        raise ValueError(
            f"num_assistant_tokens={length} (a fixed length) and assistant_confidence_threshold={threshold} (a "
            "confidence threshold) are two verification policies; pass one of them."
        )
    if length is not None:
        return FixedLengthPolicy(length)
    return ThresholdPolicy(float(threshold)) if threshold is not None else None


def resolve_policy(drafter, target, policy: str | VerificationPolicy | None = None) -> VerificationPolicy:
    """The policy a generation with `drafter` on `target` uses: `policy`, else `drafter.verification_policy`.

    `"auto"` and `"hardware_aware"` become a [`HardwareAwarePolicy`] on this machine's speed profile
    (`dspark_hf.profiling.steps_per_second_here`: the drafter folder's when it matches this machine, else one measured
    on first use and cached), kept on the drafter per target so that its measured timings carry over between
    `generate` calls. `"auto"` is the full block for a drafter without confidence head.
    """
    policy = drafter.verification_policy if policy is None else policy
    if isinstance(policy, VerificationPolicy):
        return policy
    check_policy_name(policy)
    if policy not in (AUTO, HardwareAwarePolicy.name):
        return get_policy(policy)
    if drafter.confidence_head is None:
        if policy == AUTO:
            return FullBlockPolicy()
        raise ValueError("The 'hardware_aware' policy needs a drafter with a confidence head; use 'full'.")
    key = (id(target), str(target.dtype), str(target.device))
    resolved = drafter.__dict__.setdefault("_resolved_policies", {})
    if key not in resolved:
        from ..profiling import steps_per_second_here  # lazy: profiling imports model loading

        resolved[key] = HardwareAwarePolicy(steps_per_second_here(target, drafter)[0])
    return resolved[key]


def get_policy(policy: str | VerificationPolicy | None, **kwargs) -> VerificationPolicy:
    """A policy from its name (`"full"`, `"fixed"`, `"threshold"`, `"hardware_aware"`) and arguments, or the object
    itself.

    `"hardware_aware"` needs `steps_per_second=` (a table, or the path of a saved profile).
    """
    if policy is None:
        return FullBlockPolicy()
    if isinstance(policy, VerificationPolicy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"Unknown verification policy {policy!r}; choose one of {sorted(POLICIES)}.")
    if policy == HardwareAwarePolicy.name and "steps_per_second" not in kwargs:
        raise ValueError(
            "The 'hardware_aware' policy needs the target's profiled speeds: profile once with `dspark-hf profile "
            "--drafter DRAFTER_DIR`, then set drafter.verification_policy = "
            "HardwareAwarePolicy.from_profile(DRAFTER_DIR) (or get_policy('hardware_aware', steps_per_second=PATH))."
        )
    return POLICIES[policy](**kwargs)
