"""dspark-hf: DeepSeek's DSpark speculative decoding as a first-class `transformers` assistant model.

``import dspark_hf`` registers `DSparkConfig`/`DSparkDrafter` with the Auto classes and makes
``target.generate(..., assistant_model=drafter)`` use DSpark drafting.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from . import _transformers_compat
from .configuration_dspark import DSparkConfig
from .generation import (
    DSparkCandidateGenerator,
    DSparkGenerationStats,
    FullBlockPolicy,
    HardwareAwarePolicy,
    ThresholdPolicy,
    VerificationPolicy,
)
from .modeling_dspark import DSparkDrafter


__version__ = "0.1.0"

AutoConfig.register(DSparkConfig.model_type, DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkDrafter, exist_ok=True)
AutoModelForCausalLM.register(DSparkConfig, DSparkDrafter, exist_ok=True)
_transformers_compat.install()

__all__ = [
    "DSparkConfig",
    "DSparkDrafter",
    "DSparkCandidateGenerator",
    "DSparkGenerationStats",
    "VerificationPolicy",
    "FullBlockPolicy",
    "ThresholdPolicy",
    "HardwareAwarePolicy",
]
