"""Verification-length policies: how many of a block's drafts the target verifies.

Every policy here is *non-anticipating* (docs/design.md, "Scheduler: Algorithm 1", paper Appendix A): whether draft k is
verified is decided before x_k is sampled, from the calibrated confidences c_1..c_k only (c_k reads x_{k-1}, never x_k).
The drafting loop (`drafting.sample_drafts`, through [`PolicySlots`]) asks the policy once per slot and row, left to
right, and a row verifies nothing after its first "no"; that early stop is what keeps speculative sampling exact.

By default (``drafter.verification_policy == "auto"``) generation uses the hardware-aware policy with this machine's
measured speeds (see `resolve_policy`). Select another by name on the drafter (``drafter.verification_policy =
"threshold"``) or pass an instance:

```python
>>> from dspark_hf.generation.policies import get_policy
>>> get_policy("threshold", threshold=0.3, cumulative=True)
ThresholdPolicy(threshold=0.3, cumulative=True)
>>> policy = get_policy("hardware_aware", steps_per_second={1: 10.0, 2: 6.0, 3: 5.5})
>>> [policy.should_verify(k, [0.9, 0.8, 0.2][:k]) for k in (1, 2, 3)]
[True, True, False]

```
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..scheduling import (
    StepsPerSecondCurve,
    plan_is_settled,
    prefix_survival_probabilities,
    schedule_verification_lengths,
    verification_capacity,
)
from .drafting import SlotRule


class VerificationPolicy:
    """Base class. Subclasses implement `should_verify`."""

    name: str = "base"
    requires_confidence: bool = False
    # Policies that plan from earlier rounds set this: the candidate generator then computes all block_size
    # confidences every round (sampling the unverified slots too) and passes them to `observe`.
    observes_rounds: bool = False

    def reset(self) -> None:
        """Forgets what earlier rounds taught (called when a generation starts)."""

    def observe(self, confidences: Sequence[float]) -> None:
        """Receives a finished round's confidences c_1..c_B (after its verification length was fixed)."""

    def should_draft(self) -> bool:
        """Whether to run the drafter at all this round (asked before drafting, from earlier rounds only)."""
        return True

    def record_draft_seconds(self, seconds: float, rows: int = 1) -> None:
        """Receives the wall time of a drafting pass over `rows` requests (for policies that weigh its cost)."""

    def record_outcome(self, confidences: Sequence[float], verified: int, accepted: int) -> None:
        """Receives a verified round's outcome: its confidences, drafts verified and drafts accepted."""

    def observation_complete(self, confidences: Sequence[float], block_size: int) -> bool:
        """For policies that observe rounds: whether c_1..c_k suffice (later slots cannot change what is learned)."""
        return len(confidences) >= block_size

    def should_verify(self, position: int, confidences: Sequence[float]) -> bool:
        """Whether to draft and verify slot `position` (1-based).

        Args:
            position (`int`): the slot about to be sampled, 1..block_size.
            confidences (`Sequence[float]`): calibrated c_1..c_position (empty for drafters without confidence head).
                A policy must not read past index `position - 1`.
        """
        raise NotImplementedError

    def verification_length(self, confidences: Sequence[float]) -> int:
        """The number of drafts this policy verifies for a block with confidences c_1..c_B: what the candidate
        generator's slot-by-slot loop ends up with (for analysis and tests; generation asks slot by slot)."""
        length = 0
        while length < len(confidences) and self.should_verify(length + 1, confidences[: length + 1]):
            length += 1
        return length

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class PolicySlots(SlotRule):
    """A policy as the drafting loop asks it ([`dspark_hf.generation.drafting.sample_drafts`]): `should_verify` per
    slot and row, and, for a policy that observes rounds, sampling on past the verified slots until
    `observation_complete` (every row's).

    Args:
        policy ([`VerificationPolicy`]): the policy.
        block_size (`int`): the drafter's block size.
    """

    def __init__(self, policy: VerificationPolicy, block_size: int):
        self.policy, self.block_size = policy, block_size

    def verified(self, slot: int, confidences: list[list[float]], candidates: list[bool]) -> list[bool]:
        return [candidate and self.policy.should_verify(slot + 1, values)
                for candidate, values in zip(candidates, confidences)]

    def settled(self, confidences: list[list[float]]) -> bool:
        return not self.policy.observes_rounds or all(
            self.policy.observation_complete(values, self.block_size) for values in confidences)

    def num_slots(self, max_drafts: int) -> int:
        """The slots one row's round looks at: the whole block for a policy that observes rounds, else its budget."""
        return self.block_size if self.policy.observes_rounds else max_drafts


class FullBlockPolicy(VerificationPolicy):
    """Verify the whole block (DFlash behaviour, and the mode used to collect calibration data)."""

    name = "full"

    def should_verify(self, position: int, confidences: Sequence[float]) -> bool:
        return True


class FixedLengthPolicy(VerificationPolicy):
    """Verify the first `length` drafts of every block (a fixed, shorter block; the baseline a hardware-aware policy
    must beat: the best fixed length chosen in hindsight).

    Args:
        length (`int`): drafts verified per round, >= 1 (longer than the block means the whole block).
    """

    name = "fixed"

    def __init__(self, length: int):
        if int(length) < 1:
            raise ValueError(f"length must be >= 1 (use target-only decoding for 0), got {length}.")
        self.length = int(length)

    def should_verify(self, position: int, confidences: Sequence[float]) -> bool:
        return position <= self.length


class ThresholdPolicy(VerificationPolicy):
    """Static threshold (DeepSpec's evaluator, docs/design.md, "Static threshold"): stop at the first slot whose
    calibrated confidence c_k is below `threshold`, or, with `cumulative=True`, whose prefix survival probability ``a_k
    = Π_{i<=k} c_i`` is. With `threshold <= 0` it verifies the whole block.

    Args:
        threshold (`float`, defaults to 0.5): in [0, 1].
        cumulative (`bool`, defaults to `False`): compare ``a_k`` instead of ``c_k``.
    """

    name = "threshold"
    requires_confidence = True

    def __init__(self, threshold: float = 0.5, cumulative: bool = False):
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}.")
        self.threshold = threshold
        self.cumulative = cumulative

    def should_verify(self, position: int, confidences: Sequence[float]) -> bool:
        value = math.prod(confidences[:position]) if self.cumulative else confidences[position - 1]
        return value >= self.threshold


class HardwareAwarePolicy(VerificationPolicy):
    """Verification lengths that maximize expected tokens per second on the profiled hardware.

    - ``mode="algorithm1"``: the paper's Algorithm 1 for one request: extend the verified prefix while
      ``(1 + Σ_{j<=k} a_j) · SPS(1 + k)`` strictly improves, stop at the first slot that does not.
      `should_verify(k, c_1..c_k)` is `schedule_verification_lengths([c_1..c_k], SPS)[0] >= k`. On a curve with a
      cliff (verifying 2 tokens at under half the speed of 1, as on small CPUs) the early stop never gets past it.
    - ``mode="planned"`` (default): the production scheduler (docs/design.md, "Production scheduler") at one request:
    the length is the capacity K that
      a global search over the whole curve picks from the previous round's confidences (`verification_capacity`),
      so cliffs do not trap it; being planned from stale information, it is non-anticipating. The first round of a
      generation, with nothing observed yet, uses Algorithm 1.

    Plans also correct the confidences online: the policy keeps a running ratio of the drafts the target accepted
    to the number their confidences predicted (``Σ_{j<=ℓ} a_j`` per verified round, decaying with
    `outcome_decay`), and scales the survival probabilities of later plans by it (``c_1 ← min(1, ratio · c_1)``).
    A calibration fitted on other prompts is then pulled toward what this prompt, this machine and this sampling
    mode actually accept; an over-confident drafter stops planning drafts that are not accepted. The ratio reads
    finished rounds only, so plans stay non-anticipating.

    The planned mode also weighs the drafter's own cost: a round that verifies K >= 1 drafts takes
    ``1 / SPS(1 + K) + draft_seconds``, a round without drafts only ``1 / SPS(1)`` and no drafting at all. When the
    plan is 0 the drafter is not run; it probes again after 1, 2, 4, ... up to `max_idle_rounds` skipped rounds
    (exponential backoff), and a probe round verifies by Algorithm 1 on its own confidences. So a weak drafter on
    slow hardware costs about one probe in `max_idle_rounds` rounds instead of a draft every round. Each `generate`
    call starts a new plan, backoff and acceptance ratio (`reset()`): they describe one prompt. The measured drafting
    and step times carry over (`forget()` clears them too).

    Args:
        steps_per_second (`Mapping[int, float]`, `Sequence[float]`, [`StepsPerSecondCurve`], or a path): the target's
            profiled forward steps per second by number of tokens in the verification forward (1 = plain decoding),
            or the path of a profile written by `dspark-hf profile` (a JSON file, or the drafter folder holding it).
            Sizes between profiled ones run at the next larger profiled size's speed; larger sizes are never
            verified (see `dspark_hf.scheduling`).
        mode (`str`, defaults to `"planned"`): `"planned"` or `"algorithm1"`.
        draft_seconds (`float`, *optional*): wall time of one drafting pass at batch size 1. By default it is
            measured while generating (a moving average, so it follows the machine's load); 0 ignores it (the
            paper's GPU setting).
        max_idle_rounds (`int`, defaults to 64): the longest run of rounds without drafting between two probes.
        outcome_decay (`float`, defaults to 0.95): weight of the past per verified round in the acceptance ratio
            (about 1 / (1 - decay) rounds of memory); `None` turns the online correction off.
        plan_smoothing (`float`, defaults to 0.5): weight of earlier rounds in the survival probabilities a plan
            reads: the plan maximizes the expected rate for the *next* round, and one round's confidences are a noisy
            forecast of it. With w > 0 the plan reads ``w · S + (1 - w) · a`` (``S`` the running average over earlier
            observed rounds of this generation, ``a`` the last round's survival); slots a round did not observe (its
            plan had settled) continue its last confidence. 0 plans from the last round alone, as docs/design.md,
            "Production scheduler", states (the README's benchmarks compare the two). Plans stay built from finished
            rounds only, so any value is lossless. Batch 1 only: the batched engine plans from
            every row's last round, whose sum over rows already averages.
    """

    # Pseudo-count (in expected accepted drafts) that starts the acceptance ratio at 1: the calibration is trusted
    # until a few rounds say otherwise.
    OUTCOME_PRIOR = 2.0

    name = "hardware_aware"
    requires_confidence = True

    def __init__(
        self,
        steps_per_second: Mapping[int, float] | Sequence[float] | StepsPerSecondCurve | str | os.PathLike,
        mode: str = "planned",
        draft_seconds: float | None = None,
        max_idle_rounds: int = 64,
        outcome_decay: float | None = 0.95,
        plan_smoothing: float = 0.5,
    ):
        if isinstance(steps_per_second, (str, os.PathLike)):
            from ..profiling import load_steps_per_second  # lazy: profiling imports model loading

            steps_per_second = load_steps_per_second(steps_per_second)
        if mode not in ("planned", "algorithm1"):
            raise ValueError(f"mode must be 'planned' or 'algorithm1', got {mode!r}.")
        if draft_seconds is not None and not (math.isfinite(draft_seconds) and draft_seconds >= 0):
            raise ValueError(f"draft_seconds must be a finite time >= 0 (or None to measure it), got {draft_seconds}.")
        if max_idle_rounds < 1:
            raise ValueError(f"max_idle_rounds must be >= 1, got {max_idle_rounds}.")
        if outcome_decay is not None and not 0.0 <= outcome_decay < 1.0:
            raise ValueError(f"outcome_decay must be in [0, 1) (or None for no online correction), got {outcome_decay}.")
        if not 0.0 <= plan_smoothing < 1.0:
            raise ValueError(f"plan_smoothing must be in [0, 1) (0: plan from the last round only), got {plan_smoothing}.")
        self.steps_per_second = StepsPerSecondCurve.from_table(steps_per_second)
        self.mode = mode
        self.draft_seconds = draft_seconds
        self.max_idle_rounds = max_idle_rounds
        self.outcome_decay = outcome_decay
        self.plan_smoothing = plan_smoothing
        self._measured_seconds: dict[int, float] = {}  # rows -> moving average of a drafting pass
        self.forget()

    @property
    def observes_rounds(self) -> bool:
        return self.mode == "planned"

    def reset(self) -> None:
        # A generation is a new request: the plan, backoff and acceptance ratio describe the last prompt, and carried
        # over they would keep a math prompt that follows a chat prompt from drafting for up to `max_idle_rounds`
        # rounds. What was measured about the machine (drafting and step times) outlives it; `forget` drops that too.
        self._planned_length = None
        self._smoothed_survival: list[float] | None = None  # running average of observed rounds' survival
        self._idle_rounds, self._backoff, self._probing = 0, 1, False
        self._accepted, self._predicted = 0.0, 0.0  # decayed sums behind `acceptance_ratio`
        self._round_outcome = [0.0, 0.0]  # accepted and predicted drafts of the last verified round (all rows)

    def forget(self) -> None:
        """Drops everything learned: measured drafting and step times, the plan, the backoff and the acceptance
        ratio."""
        self._measured_seconds.clear()
        self._step_seconds: dict[tuple[int, int], float] = {}  # (rows, width) -> moving average of a step
        self.reset()

    def record_outcome(self, confidences: Sequence[float], verified: int, accepted: int) -> None:
        if verified <= 0 or len(confidences) < verified:
            return
        predicted = sum(prefix_survival_probabilities([list(confidences[:verified])])[0])
        self._round_outcome[0] += accepted
        self._round_outcome[1] += predicted
        if self.outcome_decay is None:
            return
        self._accepted = self.outcome_decay * self._accepted + accepted
        self._predicted = self.outcome_decay * self._predicted + predicted

    @property
    def acceptance_ratio(self) -> float:
        """Accepted drafts per predicted accepted draft over recent verified rounds (1 before any)."""
        return (self._accepted + self.OUTCOME_PRIOR) / (self._predicted + self.OUTCOME_PRIOR)

    def corrected(self, confidences: Sequence[float]) -> list[float]:
        """Confidences with every survival probability scaled by `acceptance_ratio` (capped at 1)."""
        values = [float(c) for c in confidences]
        if values and self.outcome_decay is not None:
            values[0] = min(1.0, values[0] * self.acceptance_ratio)
        return values

    def observation_complete(self, confidences: Sequence[float], block_size: int) -> bool:
        """Whether the plan from c_1..c_k would equal the plan from the whole block ([`plan_is_settled`])."""
        if self.mode != "planned" or len(confidences) >= block_size:
            return len(confidences) >= block_size
        return plan_is_settled([self.corrected(confidences)], self.steps_per_second, block_size + 1,
                               draft_seconds=self.drafting_cost(1))

    def record_draft_seconds(self, seconds: float, rows: int = 1) -> None:
        previous = self._measured_seconds.get(rows)
        self._measured_seconds[rows] = seconds if previous is None else 0.8 * previous + 0.2 * seconds

    def record_step_seconds(self, seconds: float, rows: int, width: int) -> None:
        """Receives the wall time of a verification step (target forward and acceptance) of `rows` rows verifying
        `width` tokens each; kept as a moving average per (rows, width)."""
        previous = self._step_seconds.get((rows, width))
        self._step_seconds[(rows, width)] = seconds if previous is None else 0.8 * previous + 0.2 * seconds

    def measured_speed(self, rows: int, width: int, profiled) -> float | None:
        """Steps per second of a (rows, width) verification step: measured here when this size has run, else the
        profile `profiled(width)` scaled by how much faster or slower than profiled this many rows decode now.

        A profile is measured once, at one context length, on an idle machine; the steps the engine actually runs
        (longer caches with holes, other load) can cost markedly more, and not uniformly across widths. Measured sizes
        replace the guess, so a plan that does not pay on the live machine stops being chosen."""
        measured = self._step_seconds.get((rows, width))
        if measured is not None:
            return 1.0 / measured
        speed = profiled(width)
        base, profiled_base = self._step_seconds.get((rows, 1)), profiled(1)
        if speed is None or base is None or not profiled_base:
            return speed
        return speed * (1.0 / base) / profiled_base

    def drafting_cost(self, rows: int = 1) -> float:
        """Seconds of one drafting pass over `rows` requests: `draft_seconds` (per row) when given, else measured
        (at the nearest measured row count, scaled linearly), else 0."""
        if self.draft_seconds is not None:
            return self.draft_seconds * rows
        if not self._measured_seconds:
            return 0.0
        if rows in self._measured_seconds:
            return self._measured_seconds[rows]
        nearest = min(self._measured_seconds, key=lambda r: abs(r - rows))
        return self._measured_seconds[nearest] * rows / nearest

    def observe(self, confidences: Sequence[float]) -> None:
        # Spec 5.3: the length is planned by a global search over the whole (jagged) curve, from confidences that
        # are stale by the time they are used, so it cannot depend on the drafts it will verify.
        self._probing = False
        if self.mode == "planned":
            self._planned_length = verification_capacity(
                [self.corrected(self.plan_confidences(confidences))], self.steps_per_second,
                draft_seconds=self.drafting_cost(1),
            )

    def plan_confidences(self, confidences: Sequence[float]) -> list[float]:
        """The confidences the next plan reads: this round's c_1..c_k, blended with earlier rounds' when
        `plan_smoothing` > 0 (the blend is of survival probabilities, returned as per-slot confidences). Adds this
        round to the running average, so call it once per observed round (`observe` does)."""
        if not self.plan_smoothing or not confidences:
            return [float(c) for c in confidences]
        survival = prefix_survival_probabilities([list(confidences)])[0]
        previous = self._smoothed_survival
        if previous is None:
            blended = survival
        else:
            length = max(len(survival), len(previous))
            weight = self.plan_smoothing
            blended = [weight * old + (1.0 - weight) * new
                       for old, new in zip(_continued(previous, length), _continued(survival, length))]
        self._smoothed_survival = blended
        return [blended[0]] + [b / a if a > 0 else 0.0 for a, b in zip(blended, blended[1:])]

    def should_draft(self) -> bool:
        return self.draft_this_round(self.mode == "planned" and self._planned_length == 0)

    def draft_this_round(self, nothing_planned: bool) -> bool:
        """Exponential backoff of drafting while the plan verifies nothing: after a probe that still plans 0, skip
        1, 2, 4, ... `max_idle_rounds` rounds before the next probe; any plan above 0 drafts every round again. The
        backoff starts over at 1 only after a round whose drafts were accepted at least as often as their confidences
        predicted, so a probe that plans drafts which then fail does not restart frequent probing."""
        accepted, predicted = self._round_outcome
        self._round_outcome = [0.0, 0.0]
        if predicted > 0 and accepted >= predicted:
            self._backoff = 1
        if not nothing_planned:
            self._idle_rounds = 0
            return True
        if self._idle_rounds < self._backoff:
            self._idle_rounds += 1
            return False
        self._idle_rounds, self._backoff = 0, min(2 * self._backoff, self.max_idle_rounds)
        self._probing = True
        return True

    @classmethod
    def from_profile(cls, path: str | os.PathLike) -> "HardwareAwarePolicy":
        """The policy for a profile saved by `dspark-hf profile` (a JSON file, or the folder it was saved in)."""
        return cls(Path(path))

    def should_verify(self, position: int, confidences: Sequence[float]) -> bool:
        if self.mode == "planned" and self._planned_length is not None and not self._probing:
            return position <= self._planned_length
        # Algorithm 1 on this round's confidences (also the planned mode's first round, before any observation)
        prefix = self.corrected(confidences[:position])
        return schedule_verification_lengths([prefix], self.steps_per_second)[0] >= position

    def __repr__(self) -> str:
        table = dict(zip(self.steps_per_second.sizes, self.steps_per_second.speeds))
        return (f"HardwareAwarePolicy(steps_per_second={table}, mode={self.mode!r}, draft_seconds={self.draft_seconds!r}, "
                f"max_idle_rounds={self.max_idle_rounds}, outcome_decay={self.outcome_decay}, "
                f"plan_smoothing={self.plan_smoothing})")


def _continued(survival: list[float], length: int) -> list[float]:
    """`survival` extended to `length` slots, each further slot keeping the last slot's confidence."""
    survival = list(survival)
    last = survival[-1] / survival[-2] if len(survival) > 1 and survival[-2] > 0 else survival[-1]
    while len(survival) < length:
        survival.append(survival[-1] * last)
    return survival


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
