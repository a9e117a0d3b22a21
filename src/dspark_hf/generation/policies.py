"""Verification-length policies: how many of a block's drafts the target verifies.

Every policy here is *non-anticipating* (spec 5.2, paper Appendix A): whether draft k is verified is decided before
x_k is sampled, from the calibrated confidences c_1..c_k only (c_k reads x_{k-1}, never x_k). The candidate
generator asks the policy once per slot, left to right, and stops drafting at the first "no"; that early stop is what
keeps speculative sampling exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


class VerificationPolicy:
    """Base class. Subclasses implement `should_verify`."""

    name: str = "base"
    requires_confidence: bool = False

    def should_verify(self, position: int, confidences: Sequence[float]) -> bool:
        """Whether to draft and verify slot `position` (1-based).

        Args:
            position (`int`): the slot about to be sampled, 1..block_size.
            confidences (`Sequence[float]`): calibrated c_1..c_position (empty for drafters without confidence head).
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class FullBlockPolicy(VerificationPolicy):
    """Verify the whole block (DFlash behaviour, and the mode used to collect calibration data)."""

    name = "full"

    def should_verify(self, position: int, confidences: Sequence[float]) -> bool:
        return True


class ThresholdPolicy(VerificationPolicy):
    """Stop at the first slot whose calibrated confidence c_k (or cumulative a_k = Π c_i if `cumulative`) is below
    `threshold`. With `threshold <= 0` it verifies the whole block, like DeepSpec's evaluator (spec 3.9)."""

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
    """Algorithm 1 of the paper for one request: keep extending the verified prefix while the expected tokens per
    second, ``(1 + Σ_{j<=k} a_j) · SPS(1 + k)``, strictly improves; stop at the first slot that does not improve it.

    Args:
        steps_per_second (`Mapping[int, float]`): the target's profiled forward steps per second by number of tokens
            in the verification forward (1 = plain decoding). Sizes missing from the table are not verified.
    """

    name = "hardware_aware"
    requires_confidence = True

    def __init__(self, steps_per_second: Mapping[int, float]):
        table = {int(k): float(v) for k, v in steps_per_second.items()}
        if 1 not in table or any(v <= 0 for v in table.values()):
            raise ValueError(
                f"steps_per_second must map token counts to positive speeds and include 1, got {steps_per_second}."
            )
        self.steps_per_second = table

    def should_verify(self, position: int, confidences: Sequence[float]) -> bool:
        if position + 1 not in self.steps_per_second:
            return False
        survival, expected, best = 1.0, 1.0, self.steps_per_second[1]
        for j in range(1, position + 1):
            survival *= confidences[j - 1]
            expected += survival
            theta = expected * self.steps_per_second.get(j + 1, 0.0)
            if theta <= best:
                return False
            best = theta
        return True


POLICIES = {cls.name: cls for cls in (FullBlockPolicy, ThresholdPolicy, HardwareAwarePolicy)}


def get_policy(policy: str | VerificationPolicy | None, **kwargs) -> VerificationPolicy:
    """A policy from its name (`"full"`, `"threshold"`, `"hardware_aware"`) and arguments, or the object itself."""
    if policy is None:
        return FullBlockPolicy()
    if isinstance(policy, VerificationPolicy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"Unknown verification policy {policy!r}; choose one of {sorted(POLICIES)}.")
    return POLICIES[policy](**kwargs)
