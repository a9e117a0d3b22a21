"""The verification-policy interface: how many of each row's drafts the target verifies, asked for a batch of rows
(batch 1 is one row), and the policies that need no measurements (full block, fixed length, static threshold).

Every decoding path drives a policy through the same round (docs/design.md, "Verification policies"):

1. `begin_round(stale_confidences, block_size)`, before drafting: whether to run the drafter at all this round, from
   earlier rounds only (`stale_confidences[r]` is row r's last observed round, `None` before it has one);
2. `num_slots(block_size, budgets)`: how many slots the drafting loop looks at;
3. `verified(slot, confidences, candidates)`, left to right, before slot `slot` is sampled: which rows verify it, from
   c_1..c_{slot+1} of every row (`drafting.sample_drafts` asks it); a row that says no verifies nothing after it;
4. `settled(confidences)`: whether the loop may stop once no row verifies (a policy that plans from whole rounds keeps
   the loop sampling unverified slots until more could not change its plan);
5. `end_round(outcome)`: what the round did ([`RoundOutcome`]: confidences, drafts verified and accepted per row, the
   drafting and step times).

Policies are *non-anticipating* (paper Appendix A): whether draft k is verified reads c_1..c_k only (c_k reads
x_{k-1}, never x_k). That, and the early stop at a row's first "no", keep speculative sampling exact.

The standalone ``custom_generate`` recipe runs these policies without dspark-hf installed (`dspark_hf.hub` inlines
this module into it): keep it to the standard library.

```python
>>> from dspark_hf.generation.verification_policy import ThresholdPolicy
>>> ThresholdPolicy(0.5).verification_lengths([[0.9, 0.6, 0.4], [0.3, 0.9, 0.9]])
[2, 0]

```
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class RoundOutcome:
    """One round as a policy is told it ([`VerificationPolicy.end_round`]), one entry per row.

    Attributes:
        confidences (`list[list[float]]`): the calibrated c_1, c_2, ... the drafting loop computed (empty lists when
            the drafter did not run or has no confidence head).
        verified (`list[int]`): drafts each row verified.
        accepted (`list[int]`): drafts each row had accepted.
        drafted (`bool`): whether the drafter ran (`False`: every row decoded one token without drafts).
        observed (`bool`): the drafting loop judged the confidences complete ([`VerificationPolicy.settled`]).
        draft_seconds (`float`, *optional*): wall time of the drafting pass over all rows.
        step_seconds (`float`, *optional*): wall time of the verification step (target forward and acceptance).
        held (`list[bool]`, *optional*): rows whose request had finished before the round, kept in the batch for a
            waiting request to take over (`DSparkBatchEngine`): computed along, committing nothing. `None`: none.
    """

    confidences: list[list[float]]
    verified: list[int]
    accepted: list[int]
    drafted: bool = True
    observed: bool = False
    draft_seconds: float | None = None
    step_seconds: float | None = None
    held: list[bool] | None = None

    @property
    def decoding(self) -> int:
        """Rows that decoded in the round (all but the `held` ones)."""
        return len(self.verified) - sum(self.held or ())

    @property
    def width(self) -> int:
        """Tokens per row in the verification forward: the anchor and the longest row's drafts."""
        return 1 + max(self.verified, default=0)


class VerificationPolicy:
    """The interface every verification policy implements, for a batch of rows. This base verifies every slot within
    the rows' budgets (per row through `should_verify`, for policies that decide each row alone), drafts every round
    and learns nothing from outcomes."""

    name: str = "base"
    requires_confidence: bool = False

    def reset(self) -> None:
        """Forgets what earlier rounds of a generation taught (called when a generation, or an engine, starts)."""

    def for_engine(self, steps_per_second_by_rows=None) -> "VerificationPolicy":
        """The policy `DSparkBatchEngine` runs for this one, whose rows come and go between rounds: this policy itself,
        unless it plans differently for such batches (the hardware-aware policy plans one padded width for all rows).

        Args:
            steps_per_second_by_rows (`Mapping[int, Mapping[int, float]]`, *optional*): a profile's per-row-count
                speed tables, for policies that read them.
        """
        return self

    def begin_round(self, stale_confidences: Sequence[Sequence[float] | None], block_size: int) -> bool:
        """Starts a round for `len(stale_confidences)` rows; returns whether to run the drafter (from earlier rounds
        only: nothing of this round exists yet).

        Args:
            stale_confidences: per row, the confidences of its last observed round (`None` before it has one).
            block_size (`int`): the drafter's block size.
        """
        return True

    def num_slots(self, block_size: int, budgets: Sequence[int]) -> int:
        """How many slots the drafting loop looks at this round: the most any row may verify (`budgets`), or more for
        a policy that learns from the confidences of slots it does not verify."""
        return max(0, min(block_size, max(budgets, default=0)))

    def verified(self, slot: int, confidences: Sequence[Sequence[float]], candidates: Sequence[bool]) -> list[bool]:
        """Per row, whether it verifies `slot` (0-based), asked before the slot is sampled.

        Args:
            slot (`int`): the slot about to be sampled.
            confidences: every row's c_1..c_{slot+1} (empty rows for a drafter without confidence head). A policy must
                not read past index `slot`.
            candidates: the rows still verifying and within their budget; a row that is not verifies nothing.
        """
        return [candidate and self.should_verify(slot + 1, values)
                for candidate, values in zip(candidates, confidences)]

    def should_verify(self, position: int, confidences: Sequence[float]) -> bool:
        """One row's decision for slot `position` (1-based) from its c_1..c_position, for policies that decide each
        row alone (the base `verified` asks it)."""
        return True

    def settled(self, confidences: Sequence[Sequence[float]]) -> bool:
        """Whether the confidences computed so far are all this round can teach the policy; the drafting loop samples on
        past the verified slots until this is `True`."""
        return True

    def end_round(self, outcome: RoundOutcome) -> None:
        """Receives what the round did (every round, including those without drafting)."""

    def verification_lengths(self, confidences: Sequence[Sequence[float]]) -> list[int]:
        """The drafts each row verifies when its whole block's confidences are `confidences[r]` (for analysis and tests;
        generation asks slot by slot): `verified` left to right, each row stopping at its first "no"."""
        lengths = [0] * len(confidences)
        verifying = [True] * len(confidences)
        for slot in range(max((len(values) for values in confidences), default=0)):
            candidates = [still and slot < len(values) for still, values in zip(verifying, confidences)]
            verifying = self.verified(slot, [values[: slot + 1] for values in confidences], candidates)
            lengths = [length + bool(more) for length, more in zip(lengths, verifying)]
        return lengths

    def verification_length(self, confidences: Sequence[float]) -> int:
        """`verification_lengths` for one row."""
        return self.verification_lengths([confidences])[0]

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({fields})"


class FullBlockPolicy(VerificationPolicy):
    """Verify the whole block (DFlash behaviour, and the mode used to collect calibration data)."""

    name = "full"


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
