"""Training DSpark drafters (docs/design.md, "Training"): data regeneration, the block objective, the Trainer, LoRA.

- `dspark-hf prepare-data` ([`data`]): prompts -> target-regenerated conversations with a `loss_mask`.
- `dspark-hf train` ([`train`]): a `Trainer` over the DSpark loss, online (the frozen target runs in the step) or
  from a feature cache; LoRA fine-tuning with `--lora_r`.
- Pure pieces: [`blocks`] (anchors, block inputs/labels, attention mask) and [`losses`] (CE + TV + confidence BCE).

The Trainer and PEFT parts import lazily, so the pure pieces stay light to import.
"""

import importlib

from .blocks import DSparkBlocks, block_attention_mask, build_blocks, eligible_anchors, sample_anchors
from .collator import DSparkDataCollator
from .features import FeatureCache, TargetSignalProvider, TargetSignals, compute_target_signals
from .losses import DSparkLossOutput, confidence_targets, dspark_loss, slot_weights, total_variation_l1
from .objective import DSparkLossConfig, compute_dspark_loss


_LAZY = {
    "DSparkDataArguments": "train",
    "DSparkLoraArguments": "train",
    "DSparkModelArguments": "train",
    "DSparkTrainer": "train",
    "DSparkTrainingArguments": "train",
    "build_trainer": "train",
    "add_lora": "lora",
    "load_lora_drafter": "lora",
    "merge_lora": "lora",
    "load_training_dataset": "data",
    "prepare_data": "data",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DSparkBlocks",
    "DSparkDataCollator",
    "DSparkLossConfig",
    "DSparkLossOutput",
    "FeatureCache",
    "TargetSignalProvider",
    "TargetSignals",
    "block_attention_mask",
    "build_blocks",
    "compute_dspark_loss",
    "compute_target_signals",
    "confidence_targets",
    "dspark_loss",
    "eligible_anchors",
    "sample_anchors",
    "slot_weights",
    "total_variation_l1",
    *_LAZY,
]
