"""dspark-hf: DeepSeek's DSpark speculative decoding as a first-class `transformers` assistant model.

``import dspark_hf`` registers `DSparkConfig`/`DSparkDrafter` with the Auto classes and makes
``target.generate(..., assistant_model=drafter)`` use DSpark drafting.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from . import _transformers_compat, models
from .configuration_dspark import DSparkConfig
from .generation import (
    DSparkCandidateGenerator,
    DSparkGenerationStats,
    FixedLengthPolicy,
    FullBlockPolicy,
    HardwareAwarePolicy,
    ThresholdPolicy,
    VerificationPolicy,
    get_policy,
)
from .generation.batched import DSparkBatchEngine, DSparkRequest
from .modeling_dspark import DSparkDrafter
from .configuration_dspark_gemma4 import DSparkGemma4Config
from .modeling_dspark_gemma4 import DSparkGemma4Drafter
from .packed_linear import pack_linear_weights
from .scheduling import (
    StepsPerSecondCurve,
    schedule_verification_lengths,
    schedule_verification_lengths_async,
    top_k_verification_lengths,
    verification_capacity,
)


__version__ = "0.1.0"

AutoConfig.register(DSparkConfig.model_type, DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkDrafter, exist_ok=True)
AutoModelForCausalLM.register(DSparkConfig, DSparkDrafter, exist_ok=True)
AutoConfig.register(DSparkGemma4Config.model_type, DSparkGemma4Config, exist_ok=True)
AutoModel.register(DSparkGemma4Config, DSparkGemma4Drafter, exist_ok=True)
AutoModelForCausalLM.register(DSparkGemma4Config, DSparkGemma4Drafter, exist_ok=True)
_transformers_compat.install()

__all__ = [
    "DSparkConfig",
    "DSparkDrafter",
    "DSparkGemma4Config",
    "DSparkGemma4Drafter",
    "DSparkCandidateGenerator",
    "DSparkGenerationStats",
    "VerificationPolicy",
    "FullBlockPolicy",
    "FixedLengthPolicy",
    "ThresholdPolicy",
    "HardwareAwarePolicy",
    "get_policy",
    "DSparkBatchEngine",
    "DSparkRequest",
    "pack_linear_weights",
    "StepsPerSecondCurve",
    "schedule_verification_lengths",
    "schedule_verification_lengths_async",
    "top_k_verification_lengths",
    "verification_capacity",
]


def __getattr__(name):
    # Heavier, optional parts load on first use so `import dspark_hf` stays fast.
    lazy = {
        "fit_sequential_temperatures": "calibration",
        "expected_calibration_error": "calibration",
        "auroc": "calibration",
        "brier": "calibration",
        "load_steps_per_second": "profiling",
        "DSparkTrainer": "training",
        "DSparkTrainingArguments": "training",
        "DSparkDataCollator": "training",
        "push_drafter": "hub",
        "save_drafter": "hub",
        "render_model_card": "hub",
    }
    if name in lazy:
        import importlib

        return getattr(importlib.import_module(f".{lazy[name]}", __name__), name)
    raise AttributeError(f"module 'dspark_hf' has no attribute {name!r}")
