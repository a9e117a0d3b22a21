from .candidate_generator import DSparkCandidateGenerator
from .policies import (
    POLICIES,
    FixedLengthPolicy,
    FullBlockPolicy,
    HardwareAwarePolicy,
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
    "POLICIES",
    "get_policy",
]
