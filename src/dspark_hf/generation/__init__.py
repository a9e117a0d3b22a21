from .candidate_generator import DSparkCandidateGenerator
from .policies import (
    POLICIES,
    FixedLengthPolicy,
    FullBlockPolicy,
    HardwareAwarePolicy,
    PlannedWidthPolicy,
    RoundOutcome,
    SpeedModel,
    ThresholdPolicy,
    VerificationPolicy,
    get_policy,
)
from .stats import DSparkGenerationStats, DSparkRoundStats


__all__ = [
    "DSparkCandidateGenerator",
    "DSparkGenerationStats",
    "DSparkRoundStats",
    "VerificationPolicy",
    "FullBlockPolicy",
    "FixedLengthPolicy",
    "ThresholdPolicy",
    "HardwareAwarePolicy",
    "PlannedWidthPolicy",
    "RoundOutcome",
    "SpeedModel",
    "POLICIES",
    "get_policy",
]
