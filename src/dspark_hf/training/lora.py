"""LoRA fine-tuning of a trained drafter with PEFT: wrap, load an adapter, merge back into the official layout.

A LoRA-wrapped drafter (`peft.PeftModel`) works as `assistant_model` directly: the generate integration drafts with
the base drafter and its active adapter. Merging gives a plain [`DSparkDrafter`] whose `save_pretrained` writes the
official layout, loadable by DeepSpec and vLLM.

Merge an adapter saved by `dspark-hf train --lora_r ...` from the command line:

    python -m dspark_hf.training.lora --adapter runs/lora --output_dir runs/merged [--drafter BASE_DRAFTER]
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import HfArgumentParser

from .._transformers_compat import unwrap_drafter
from ..modeling_dspark import DSparkDrafter


# The drafter's own projections: context `fc`, attention and MLP of every draft layer. The vocabulary-sized tensors
# (frozen embedding and LM head, the Markov factors) stay as they are.
DEFAULT_LORA_TARGET_MODULES = ("fc", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Small and data-dependent: retrained in full (saved inside the adapter).
DEFAULT_LORA_MODULES_TO_SAVE = ("confidence_head",)


def add_lora(
    drafter: DSparkDrafter,
    r: int = 16,
    alpha: int | None = None,
    dropout: float = 0.0,
    target_modules: list[str] | tuple[str, ...] = DEFAULT_LORA_TARGET_MODULES,
    modules_to_save: list[str] | tuple[str, ...] | None = DEFAULT_LORA_MODULES_TO_SAVE,
) -> PeftModel:
    """Wraps `drafter` with fresh LoRA adapters (only they, and `modules_to_save`, are trainable).

    Args:
        drafter ([`DSparkDrafter`]): a trained drafter.
        r (`int`): LoRA rank.
        alpha (`int`, *optional*): LoRA alpha; defaults to `2 * r`.
        dropout (`float`): LoRA dropout.
        target_modules: module-name suffixes that get adapters.
        modules_to_save: modules trained in full and saved with the adapter.
    """
    if r < 1:
        raise ValueError(f"LoRA rank must be >= 1, got r={r}.")
    modules_to_save = [m for m in (modules_to_save or ()) if getattr(drafter, m, None) is not None]
    config = LoraConfig(
        r=r,
        lora_alpha=alpha if alpha is not None else 2 * r,
        lora_dropout=dropout,
        target_modules=list(target_modules),
        modules_to_save=modules_to_save or None,
    )
    model = get_peft_model(drafter, config)
    # PEFT records the base as the caller spelled it; a relative folder would only resolve from the same directory.
    base = model.peft_config[model.active_adapter].base_model_name_or_path
    if base and Path(base).is_dir():
        model.peft_config[model.active_adapter].base_model_name_or_path = str(Path(base).resolve())
    return model


def load_lora_drafter(
    adapter_path: str | Path, drafter: DSparkDrafter | str | None = None, is_trainable: bool = False, **kwargs
) -> PeftModel:
    """A drafter with a saved LoRA adapter applied.

    Args:
        adapter_path (`str`): folder with `adapter_config.json` and `adapter_model.safetensors`.
        drafter ([`DSparkDrafter`] or `str`, *optional*): the base drafter or its folder; defaults to the
            `base_model_name_or_path` the adapter was saved with.
        is_trainable (`bool`): keep the adapter trainable (to continue fine-tuning).
        kwargs: passed to [`DSparkDrafter.from_pretrained`] when the base is loaded here (e.g. `dtype`).
    """
    if drafter is None:
        config_file = Path(adapter_path) / "adapter_config.json"
        if not config_file.exists():
            raise FileNotFoundError(f"{config_file} is missing: is {adapter_path} a LoRA adapter folder?")
        drafter = json.loads(config_file.read_text()).get("base_model_name_or_path")
        if not drafter or not Path(drafter).exists():
            raise ValueError(
                f"The adapter at {adapter_path} names the base drafter {drafter!r}, which is not a local folder; "
                "pass the base drafter explicitly (drafter=... or --drafter)."
            )
    if isinstance(drafter, (str, Path)):
        drafter = DSparkDrafter.from_pretrained(drafter, **kwargs)
    return PeftModel.from_pretrained(drafter, str(adapter_path), is_trainable=is_trainable)


def merge_lora(model: PeftModel) -> DSparkDrafter:
    """Folds the adapter into the weights and returns the plain drafter (modifies `model`'s base in place)."""
    merged = model.merge_and_unload()
    drafter = unwrap_drafter(merged)
    if drafter is None:
        raise TypeError(f"Merging gave a {type(merged).__name__}, not a DSparkDrafter; was the adapter for a drafter?")
    drafter.freeze_vocabulary()
    return drafter


@dataclass
class MergeArguments:
    adapter: str = field(metadata={"help": "LoRA adapter folder (written by `dspark-hf train --lora_r ...`)."})
    output_dir: str = field(metadata={"help": "Where the merged drafter is saved (official layout)."})
    drafter: str | None = field(default=None, metadata={"help": "Base drafter folder (default: the adapter's base)."})
    dtype: str | None = field(default=None, metadata={"help": "Save dtype, e.g. bfloat16 (default: as loaded)."})


def main(argv: list[str] | None = None) -> int:
    (args,) = HfArgumentParser(MergeArguments).parse_args_into_dataclasses(args=argv)
    drafter = merge_lora(load_lora_drafter(args.adapter, args.drafter))
    if args.dtype:
        drafter.to(getattr(torch, args.dtype))
    drafter.save_pretrained(args.output_dir)
    print(f"Merged drafter saved to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
