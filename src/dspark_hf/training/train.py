"""`dspark-hf train`: train a DSpark drafter for a target, or LoRA-fine-tune a trained one.

Built on the transformers `Trainer`, so the same command runs on one CPU, one GPU, or many GPUs through
`accelerate launch` / `torchrun` (DDP). The frozen target runs inside every training step (online training) unless
its signals are already in the `--feature_cache`. Checkpoints are written by `save_pretrained` in the official DSpark
layout (LoRA runs save PEFT adapters; `--merge` adds a merged drafter in the official layout).

    dspark-hf train --target smollm2-135m-instruct --train_data data/gsm8k-smollm2 --output_dir runs/smollm2 \\
        --block_size 7 --num_hidden_layers 1 --num_anchors 32 --num_train_epochs 3

    dspark-hf train --drafter runs/smollm2 --lora_r 16 --train_data data/my-domain --output_dir runs/lora --merge
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback
from collections import defaultdict
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import datasets
import torch
from tqdm.auto import tqdm
from transformers import HfArgumentParser, IntervalStrategy, PreTrainedModel, Trainer, TrainingArguments, set_seed
from transformers.utils import logging

from .._transformers_compat import unwrap_drafter
from ..models import DEFAULT_TARGET, load_target, target_dtype
from ..modeling_dspark import DSparkDrafter
from .blocks import DSparkBlocks, eligible_anchors
from .collator import DSparkDataCollator
from ..cli import HelpFormatter
from .data import exit_with_error, load_training_dataset
from .features import FeatureCache, TargetSignalProvider
from .lora import DEFAULT_LORA_MODULES_TO_SAVE, DEFAULT_LORA_TARGET_MODULES, add_lora, merge_lora
from ..vocabulary import count_response_tokens, coverage, select_draft_vocabulary, special_token_ids
from .losses import DEFAULT_LOSS_DECAY, slot_weights
from .objective import DSparkLossConfig, compute_dspark_loss


logger = logging.get_logger(__name__)


@dataclass
class DSparkModelArguments:
    _argument_group_name = "target and drafter"

    target: str = field(default=DEFAULT_TARGET, metadata={"help": "Target: Hub id, local folder or embedded name."})
    target_dtype: str = field(
        default="float32",
        metadata={"help": "Target dtype: float32, bfloat16, float16, or auto (bf16 where computed natively)."},
    )
    drafter: str | None = field(
        default=None, metadata={"help": "Drafter folder to resume or fine-tune; a new one is built when omitted."}
    )
    block_size: int | None = field(default=None, metadata={"help": "New drafter: block size B (default 7)."})
    num_hidden_layers: int | None = field(default=None, metadata={"help": "New drafter: draft layers (default 1)."})
    markov_rank: int | None = field(
        default=None, metadata={"help": "New drafter: Markov head rank (default 64; 0 disables it: DFlash)."}
    )
    markov_head_type: str | None = field(
        default=None, metadata={"help": "New drafter: vanilla (default), gated or rnn."}
    )
    target_layer_ids: list[int] | None = field(
        default=None, metadata={"help": "New drafter: target layers read as context (default: up to 5, spread)."}
    )
    mask_token_id: int | None = field(
        default=None, metadata={"help": "New drafter: id of the block's mask slots (default: pad, else last id)."}
    )
    enable_confidence_head: bool | None = field(
        default=None, metadata={"help": "New drafter: with a confidence head (default true)."}
    )
    init_from_target_layers: list[int] | None = field(
        default=None,
        metadata={"help": "New drafter: start draft layer j as a copy of target layer ID_j (one id per draft layer)."},
    )
    grow_layers: int | None = field(
        default=None,
        metadata={"help": "Loaded drafter: append N draft layers that start as the identity (their output projections "
                          "zeroed), so training starts from the drafter's own drafts with more capacity."},
    )
    grow_markov_rank: int | None = field(
        default=None,
        metadata={"help": "Loaded drafter: widen its Markov head to rank N (the new directions' output weights start "
                          "at zero), so training starts from the drafter's own drafts with a richer transition bias."},
    )
    drop_markov_head: bool = field(
        default=False,
        metadata={"help": "Loaded drafter: remove its Markov head (its DFlash ablation), to train it on beside the "
                          "same drafter trained on with the head."},
    )
    draft_vocab_size: int | None = field(
        default=None,
        metadata={"help": "New drafter: draft (and train) over only the N ids most frequent in the training responses "
                          "(e.g. 8192; several times faster on a CPU). Default: the whole vocabulary."},
    )
    save_dtype: str | None = field(
        default=None, metadata={"help": "Dtype of the final save, e.g. bfloat16 as released (default: float32)."}
    )


@dataclass
class DSparkDataArguments:
    _argument_group_name = "data"

    train_data: list[str] = field(
        default_factory=list, metadata={"help": "Prepared data: `prepare-data` folders, datasets, parquet or jsonl."}
    )
    eval_data: list[str] | None = field(default=None, metadata={"help": "Held-out prepared data (default: a split)."})
    eval_split_size: float = field(
        default=0.02, metadata={"help": "Held-out part of --train_data without --eval_data (fraction, or count >= 1)."}
    )
    max_length: int = field(default=2048, metadata={"help": "Training sequences are truncated to this many tokens."})
    num_anchors: int | None = field(
        default=None, metadata={"help": "Blocks per sequence (default: the drafter config's, 512). Fewer = faster."}
    )
    feature_cache: str | None = field(
        default=None, metadata={"help": "Folder caching the target's signals, so later epochs skip the target."}
    )
    feature_cache_dtype: str = field(default="float32", metadata={"help": "Feature cache dtype (bfloat16 halves it)."})
    tau_eval_prompts: int = field(default=8, metadata={"help": "Held-out prompts generated per eval to measure tau."})
    tau_max_new_tokens: int = field(default=64, metadata={"help": "Tokens generated per prompt when measuring tau."})


@dataclass
class DSparkLoraArguments:
    _argument_group_name = "LoRA fine-tuning"

    lora_r: int = field(default=0, metadata={"help": "LoRA rank; > 0 fine-tunes --drafter with LoRA adapters."})
    lora_alpha: int | None = field(default=None, metadata={"help": "LoRA alpha (default 2 * r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(DEFAULT_LORA_TARGET_MODULES), metadata={"help": "Modules that get adapters."}
    )
    lora_modules_to_save: list[str] = field(
        default_factory=lambda: list(DEFAULT_LORA_MODULES_TO_SAVE),
        metadata={"help": "Modules trained in full with LoRA (saved in the adapter)."},
    )
    merge: bool = field(default=False, metadata={"help": "After LoRA training, also save the merged drafter."})
    merged_output_dir: str | None = field(
        default=None, metadata={"help": "Where --merge saves the merged drafter (default: OUTPUT_DIR/merged)."}
    )


@dataclass
class DSparkTrainingArguments(TrainingArguments):
    """`TrainingArguments` with DeepSpec's defaults (AdamW 6e-4, cosine, 4% warmup, clip 1.0) and the loss weights."""

    _argument_group_name = "training (transformers.TrainingArguments with DeepSpec's defaults, and the loss weights)"

    per_device_train_batch_size: int = field(default=1, metadata={"help": "Sequences per device and step."})
    per_device_eval_batch_size: int = field(default=1, metadata={"help": "Sequences per device at evaluation."})
    learning_rate: float = field(default=6e-4, metadata={"help": "Peak learning rate (DeepSpec: 6e-4)."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule (DeepSpec: cosine)."})
    warmup_steps: float = field(default=0.04, metadata={"help": "Warmup steps, or a fraction of all steps if < 1."})
    logging_steps: float = field(default=10, metadata={"help": "Log every N steps (loss and its terms)."})
    eval_strategy: str = field(default="epoch", metadata={"help": "When to evaluate loss and tau: no, steps, epoch."})
    save_strategy: str = field(default="epoch", metadata={"help": "When to save checkpoints: no, steps, epoch."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep False: the collator reads the columns."})
    ddp_find_unused_parameters: bool | None = field(
        default=False, metadata={"help": "Keep False: the heads run after the drafter's forward."}
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={"help": "A checkpoint-N folder to resume from (weights, optimizer, schedule, RNG, data position)."},
    )
    ce_weight: float = field(default=0.1, metadata={"help": "Weight of the cross-entropy term."})
    tv_weight: float = field(default=0.9, metadata={"help": "Weight of the total-variation (full L1) term."})
    confidence_weight: float = field(default=1.0, metadata={"help": "Weight of the confidence-head BCE term."})
    loss_decay: float = field(default=DEFAULT_LOSS_DECAY, metadata={"help": "Slot weights exp(-k / loss_decay)."})

    def __post_init__(self):
        # Without a GPU, --bf16 means CPU autocast; transformers asks for --use_cpu as well, which says nothing new.
        if self.bf16 and not torch.cuda.is_available():
            self.use_cpu = True
        super().__post_init__()


class DSparkTrainer(Trainer):
    """A `Trainer` whose loss is the DSpark objective, with the frozen target inside the step.

    Args:
        model ([`DSparkDrafter`] or `peft.PeftModel`): the drafter being trained.
        target ([`PreTrainedModel`]): the frozen target (moved to the training device).
        feature_cache ([`FeatureCache`], *optional*): on-disk target signals.
        tau_prompts (`list[list[int]]`, *optional*): held-out prompt ids; each evaluation generates from them with
            the drafter as `assistant_model` and reports `eval_tau` and `eval_acceptance_rate`.
        tau_max_new_tokens (`int`): tokens generated per tau prompt.
        pad_token_id (`int`, *optional*): for `generate`.
        kwargs: passed to `Trainer` (`args`, `train_dataset`, `eval_dataset`, `data_collator`, ...).
    """

    # compute_loss normalizes per micro-batch; Trainer divides by the gradient-accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        model: PreTrainedModel,
        target: PreTrainedModel,
        feature_cache: FeatureCache | None = None,
        tau_prompts: list[list[int]] | None = None,
        tau_max_new_tokens: int = 64,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        super().__init__(model=model, **kwargs)
        self.model_accepts_loss_kwargs = False
        self.drafter = unwrap_drafter(model)
        if self.drafter is None:
            raise TypeError(f"DSparkTrainer trains a DSparkDrafter (or a PEFT wrapper of one), got {type(model)}.")
        self.target = target.to(self.args.device).eval().requires_grad_(False)
        self.signals = TargetSignalProvider(self.target, self.drafter.config.target_layer_ids, feature_cache)
        args = self.args
        self.loss_config = DSparkLossConfig(
            ce_weight=getattr(args, "ce_weight", 0.1),
            tv_weight=getattr(args, "tv_weight", 0.9),
            confidence_weight=getattr(args, "confidence_weight", 1.0),
            loss_decay=getattr(args, "loss_decay", DEFAULT_LOSS_DECAY),
        )
        self.tau_prompts = list(tau_prompts or [])
        self.tau_max_new_tokens = tau_max_new_tokens
        self.pad_token_id = pad_token_id
        self._terms = {"train": defaultdict(float), "eval": defaultdict(float)}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        signals = self.signals(inputs["input_ids"], inputs["attention_mask"])
        blocks = DSparkBlocks.from_dict(inputs)
        denominator, scale = self._global_denominator(blocks, model.training)
        output = compute_dspark_loss(self.drafter, blocks, signals, self.loss_config, model, denominator,
                                     target_lm_head=self.target.get_output_embeddings().weight)
        self._record_terms(output, "train" if model.training else "eval", scale)
        loss = output.loss * scale
        return (loss, output) if return_outputs else loss

    def _global_denominator(self, blocks: DSparkBlocks, training: bool) -> tuple[torch.Tensor | None, int]:
        """DeepSpec normalizes by the slot weights summed over all data-parallel ranks (and multiplies the loss by
        the world size, which DDP's gradient averaging divides back out)."""
        world_size = self.args.world_size
        if not training or world_size == 1:
            return None, 1
        total = slot_weights(blocks.supervised, self.loss_config.loss_decay).sum()
        return self.accelerator.reduce(total, reduction="sum") + 1e-6, world_size

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def _record_terms(self, output, split: str, scale: int) -> None:
        """Accumulates the loss terms for logging; `scale` makes globally normalized terms average across ranks."""
        terms = self._terms[split]
        for name in ("ce", "tv", "confidence"):
            terms[name] = terms[name] + getattr(output, name).detach() * scale
        terms["count"] += 1

    def _pop_terms(self, split: str, prefix: str) -> dict[str, float]:
        terms = self._terms[split]
        count = terms.pop("count", 0)
        if not count:
            return {}
        values = torch.stack([terms[name] for name in ("ce", "tv", "confidence")]) / count
        if self.args.world_size > 1:
            values = self.accelerator.reduce(values.to(self.args.device), reduction="mean")
        terms.clear()
        return {f"{prefix}loss_{name}": round(v, 4) for name, v in zip(("ce", "tv", "confidence"), values.tolist())}

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            logs.update(self._pop_terms("train", ""))
        super().log(logs, start_time)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        output.metrics.update(self._pop_terms("eval", f"{metric_key_prefix}_"))
        if self.tau_prompts:
            output.metrics.update(self.measure_tau(metric_key_prefix))
        return output

    @torch.no_grad()
    def measure_tau(self, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Greedy generation from the held-out prompts with the drafter as `assistant_model`: tau (tokens per target
        forward, bonus included) and the draft acceptance rate, summed over prompts (and ranks).

        Every round verifies the full block, so tau measures the drafter alone: the default hardware-aware policy would
        make it depend on this machine's timings (and measure a speed profile on a machine busy training)."""
        assistant = self.accelerator.unwrap_model(self.model)  # the drafter or its PEFT wrapper, as users pass it
        was_training = assistant.training
        assistant.eval()
        policy = self.drafter.__dict__.get("_verification_policy")
        self.drafter.verification_policy = "full"
        try:
            totals = self._greedy_round_totals(assistant)
        finally:
            assistant.train(was_training)
            self.drafter.verification_policy = policy
        if self.args.world_size > 1:
            totals = self.accelerator.reduce(totals.to(self.args.device), reduction="sum").cpu()
        accepted, rounds, verified = totals.tolist()
        return {
            f"{metric_key_prefix}_tau": round((accepted + rounds) / max(rounds, 1.0), 4),
            f"{metric_key_prefix}_acceptance_rate": round(accepted / max(verified, 1.0), 4),
        }

    def _greedy_round_totals(self, assistant) -> torch.Tensor:
        """Accepted drafts, rounds and verified drafts over this rank's tau prompts."""
        totals = torch.zeros(3, dtype=torch.float64)
        prompts = self.tau_prompts[self.args.process_index:: self.args.world_size]
        disable = self.args.disable_tqdm or not self.is_local_process_zero()
        for prompt in tqdm(prompts, desc="tau", leave=False, disable=disable):
            input_ids = torch.tensor([prompt], device=self.target.device)
            self.target.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                assistant_model=assistant,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                max_new_tokens=self.tau_max_new_tokens,
                pad_token_id=self.pad_token_id,
            )
            stats = self.drafter.generation_stats
            totals += torch.tensor([stats.accepted, stats.num_rounds, stats.verified], dtype=torch.float64)
        return totals


# --- assembling a run ------------------------------------------------------------------------------------------------


# Architecture options of a new drafter, with their defaults; a drafter loaded with --drafter keeps its own.
NEW_DRAFTER_DEFAULTS = {"block_size": 7, "num_hidden_layers": 1, "markov_rank": 64, "markov_head_type": "vanilla",
                        "target_layer_ids": None, "mask_token_id": None, "enable_confidence_head": True}


def build_drafter(model_args: DSparkModelArguments, target: PreTrainedModel) -> DSparkDrafter:
    """A new drafter for `target` (fp32 trainable weights), or the one at `--drafter`.

    An architecture option given together with `--drafter` must agree with that drafter's config: training cannot
    change the architecture, and ignoring the option would silently train something else than was asked for.
    """
    given = {name: getattr(model_args, name) for name in NEW_DRAFTER_DEFAULTS if getattr(model_args, name) is not None}
    if model_args.drafter and model_args.init_from_target_layers:
        raise ValueError(
            f"--init_from_target_layers starts a new drafter; the drafter loaded from {model_args.drafter} is already "
            "trained. Drop one of the two."
        )
    for option, instead in (("grow_layers", "--num_hidden_layers N"), ("grow_markov_rank", "--markov_rank N")):
        if getattr(model_args, option) is not None and not model_args.drafter:
            raise ValueError(
                f"--{option} {getattr(model_args, option)} widens a trained drafter: give it with --drafter DIR, or "
                f"build a new drafter with {instead} instead."
            )
    if model_args.drop_markov_head and not model_args.drafter:
        raise ValueError("--drop_markov_head changes a trained drafter: give it with --drafter DIR, or build a new "
                         "drafter without a Markov head with --markov_rank 0 instead.")
    if model_args.drop_markov_head and model_args.grow_markov_rank is not None:
        raise ValueError("--drop_markov_head and --grow_markov_rank contradict each other: give one of the two.")
    if model_args.drafter:
        drafter = DSparkDrafter.from_pretrained(model_args.drafter, target=target, dtype=torch.float32)
        config = drafter.config
        current = {name: getattr(config, name, None) for name in given}
        if config.markov_rank == 0 and "markov_head_type" in given:
            current["markov_head_type"] = given["markov_head_type"]  # no Markov head: its type does not apply
        conflicts = [f"--{name} {value} (the drafter has {current[name]})" for name, value in given.items()
                     if (list(value) if isinstance(value, (list, tuple)) else value) != current[name]]
        if conflicts:
            raise ValueError(
                f"{', '.join(conflicts)}: the architecture of the drafter loaded from {model_args.drafter} cannot "
                "change while training it. Drop these options to continue training it as it is, or drop --drafter "
                "to build a new drafter with them."
            )
        if model_args.grow_layers is not None:
            before = config.num_hidden_layers
            drafter.grow_layers(model_args.grow_layers)
            logger.info(f"Grew the drafter from {before} to {config.num_hidden_layers} draft layers (new ones start as "
                        "the identity).")
        if model_args.grow_markov_rank is not None:
            before = config.markov_rank
            drafter.grow_markov_rank(model_args.grow_markov_rank)
            logger.info(f"Grew the Markov head from rank {before} to {config.markov_rank} (the new directions start "
                        "without effect).")
        if model_args.drop_markov_head:
            before = config.markov_rank
            drafter.drop_markov_head()
            logger.info(f"Dropped the rank-{before} Markov head: training its DFlash ablation.")
    else:
        options = {**NEW_DRAFTER_DEFAULTS, **given}
        drafter = DSparkDrafter.from_target(target, **options)
        if model_args.init_from_target_layers:
            kept = drafter.init_layers_from_target(target, model_args.init_from_target_layers)
            logger.info(f"Draft layers start from target layers {model_args.init_from_target_layers} (kept as "
                        f"initialised: {', '.join(kept) or 'nothing'}).")
    drafter.check_target(target)
    drafter.to(torch.float32)
    drafter.freeze_vocabulary()
    return drafter


def reduce_to_training_vocabulary(
    drafter: DSparkDrafter, model_args: DSparkModelArguments, train_dataset: datasets.Dataset
) -> None:
    """`--draft_vocab_size N`: a new drafter drafts over the N ids most frequent in the training responses (plus the
    special ids), and trains over them; a loaded drafter must already have that draft vocabulary size."""
    size = model_args.draft_vocab_size
    config = drafter.config
    if model_args.drafter:
        if config.draft_vocab_size != size:
            raise ValueError(
                f"--draft_vocab_size {size} (the drafter has {config.draft_vocab_size}): the draft vocabulary of the "
                f"drafter loaded from {model_args.drafter} cannot change while training it. Drop --draft_vocab_size, "
                "or reduce the trained drafter afterwards with `dspark-hf reduce-vocab`."
            )
        return
    counts = count_response_tokens(train_dataset)
    drafter.reduce_vocabulary(select_draft_vocabulary(counts, size, config.vocab_size, special_token_ids(config)))
    logger.info(f"Draft vocabulary: {size} of {config.vocab_size} ids, covering "
                f"{coverage(counts, drafter.draft_token_ids.tolist()):.4f} of the training response tokens.")


def _has_anchor(example: dict[str, Any]) -> bool:
    return eligible_anchors(torch.as_tensor(example["loss_mask"])).numel() > 0


def prepare_datasets(data_args: DSparkDataArguments, seed: int) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """The training set and the held-out set (`--eval_data`, else a split of `--train_data`, else `None`)."""
    if not data_args.train_data:
        raise ValueError("No --train_data given; make some with `dspark-hf prepare-data`.")
    train = load_training_dataset(data_args.train_data).filter(_has_anchor)
    if len(train) == 0:
        raise ValueError(f"No example of {data_args.train_data} has two consecutive loss_mask tokens to train on.")
    if data_args.eval_data:
        return train, load_training_dataset(data_args.eval_data).filter(_has_anchor)
    size = data_args.eval_split_size
    num_eval = int(size) if size >= 1 else int(round(size * len(train)))
    if num_eval < 1 or len(train) - num_eval < 1:
        return train, None
    split = train.train_test_split(test_size=num_eval, seed=seed)
    return split["train"], split["test"]


def prompt_ids(example: dict[str, Any]) -> list[int]:
    """The first prompt of a prepared conversation: `prompt_length` tokens, else up to the first response token."""
    length = example.get("prompt_length")
    if length is None:
        length = next((i for i, m in enumerate(example["loss_mask"]) if m), len(example["loss_mask"]))
    return list(example["input_ids"][:length])


def _pad_token_id(tokenizer, target: PreTrainedModel) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = target.generation_config.pad_token_id
    if pad is None:
        pad = target.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    return 0 if pad is None else pad


def _feature_cache(
    model_args: DSparkModelArguments, data_args: DSparkDataArguments, target_layer_ids: list[int]
) -> FeatureCache | None:
    if not data_args.feature_cache:
        return None
    fingerprint = {"target": model_args.target, "target_dtype": model_args.target_dtype,
                   "target_layer_ids": list(target_layer_ids)}
    return FeatureCache(data_args.feature_cache, fingerprint, getattr(torch, data_args.feature_cache_dtype))


def _with_lora(drafter: DSparkDrafter, model_args: DSparkModelArguments, lora_args: DSparkLoraArguments):
    if lora_args.lora_r <= 0:
        return drafter
    if not model_args.drafter:
        logger.warning("LoRA on a new, untrained drafter: pass --drafter to fine-tune a trained one.")
    return add_lora(drafter, lora_args.lora_r, lora_args.lora_alpha, lora_args.lora_dropout,
                    lora_args.lora_target_modules, lora_args.lora_modules_to_save)


def build_trainer(
    model_args: DSparkModelArguments,
    data_args: DSparkDataArguments,
    lora_args: DSparkLoraArguments,
    training_args: DSparkTrainingArguments,
    target: PreTrainedModel | None = None,
    tokenizer=None,
) -> DSparkTrainer:
    """Loads the target (unless given), builds or loads the drafter (LoRA-wrapped if asked), data and trainer."""
    set_seed(training_args.seed)
    # resolved first: a bad name fails before any work, and the feature cache records the dtype actually used
    model_args.target_dtype = str(target_dtype(model_args.target_dtype, training_args.device)).removeprefix("torch.")
    train_dataset, eval_dataset = prepare_datasets(data_args, training_args.seed)  # bad data fails before the target
    if target is None:
        # unpacked linear weights: packing is chosen by timing ("auto"), and every process of a distributed run (and
        # the feature cache) must compute the same features to the last bit
        target, tokenizer = load_target(model_args.target, dtype=getattr(torch, model_args.target_dtype),
                                        packed_linear="off")
    drafter = build_drafter(model_args, target)
    if model_args.draft_vocab_size is not None:
        reduce_to_training_vocabulary(drafter, model_args, train_dataset)
    if data_args.num_anchors is not None:
        drafter.config.num_anchors = data_args.num_anchors
    if eval_dataset is None and training_args.eval_strategy != IntervalStrategy.NO:
        logger.warning("No held-out data (--eval_data / --eval_split_size): evaluation is off.")
        training_args.eval_strategy = IntervalStrategy.NO
    config = drafter.config
    pad_token_id = _pad_token_id(tokenizer, target)
    num_tau_prompts = 0 if eval_dataset is None else min(data_args.tau_eval_prompts, len(eval_dataset))
    return DSparkTrainer(
        model=_with_lora(drafter, model_args, lora_args),
        target=target,
        feature_cache=_feature_cache(model_args, data_args, config.target_layer_ids),
        tau_prompts=[prompt_ids(eval_dataset[i]) for i in range(num_tau_prompts)],
        tau_max_new_tokens=data_args.tau_max_new_tokens,
        pad_token_id=pad_token_id,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=DSparkDataCollator(
            block_size=config.block_size,
            mask_token_id=config.mask_token_id,
            num_anchors=config.num_anchors,
            pad_token_id=pad_token_id,
            max_length=data_args.max_length,
        ),
    )


def save_final(trainer: DSparkTrainer, model_args: DSparkModelArguments, lora_args: DSparkLoraArguments) -> list[str]:
    """Saves the trained drafter (official layout) or LoRA adapter to `output_dir`, in `--save_dtype` if given, and
    with `--merge` the merged drafter too."""
    output_dir = trainer.args.output_dir
    model = trainer.accelerator.unwrap_model(trainer.model)
    if model_args.save_dtype:
        model.to(getattr(torch, model_args.save_dtype))
    trainer.save_model(output_dir)
    saved = [output_dir]
    if lora_args.lora_r > 0 and lora_args.merge and trainer.args.should_save:
        merged_dir = lora_args.merged_output_dir or str(Path(output_dir) / "merged")
        merge_lora(model).save_pretrained(merged_dir)
        saved.append(merged_dir)
    return saved


# The `TrainingArguments` options `--help` lists (besides DSpark's own); `--help-all` lists every one, and all parse.
COMMON_TRAINING_OPTIONS = (
    "output_dir", "num_train_epochs", "max_steps", "per_device_train_batch_size", "per_device_eval_batch_size",
    "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay",
    "max_grad_norm", "logging_steps", "eval_strategy", "eval_steps", "save_strategy", "save_steps",
    "save_total_limit", "load_best_model_at_end", "metric_for_best_model", "greater_is_better", "seed",
    "resume_from_checkpoint", "bf16", "use_cpu", "report_to", "run_name",
)
HELP_EPILOG = (
    "Every other transformers.TrainingArguments option works too: --help-all lists them. Options are spelled in "
    "snake_case; the kebab-case spelling of each is accepted as well. See docs/training.md."
)


class _FullHelp(argparse.Action):
    """`--help-all`: the help with every `TrainingArguments` option."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        build_parser(full_help=True).print_help()
        parser.exit()


def build_parser(full_help: bool = False) -> HfArgumentParser:
    """The `dspark-hf train` parser; its `--help` lists DSpark's options and the common `TrainingArguments` ones."""
    parser = HfArgumentParser(
        (DSparkModelArguments, DSparkDataArguments, DSparkLoraArguments, DSparkTrainingArguments),
        prog="dspark-hf train",
        usage="dspark-hf train --train_data DATA --output_dir DIR [options]",
        description="Train a DSpark drafter for a target, or LoRA-fine-tune a trained one (see docs/training.md).",
        epilog=HELP_EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--help-all", "--help_all", action=_FullHelp, help="show every option and exit")
    if not full_help:
        inherited = {f.name for f in fields(TrainingArguments)} - set(COMMON_TRAINING_OPTIONS)
        for action in parser._actions:
            if action.dest in inherited:
                action.help = argparse.SUPPRESS
    return parser


def parse_args(argv: list[str] | None = None):
    return build_parser().parse_args_into_dataclasses(args=argv)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        model_args, data_args, lora_args, training_args = parser.parse_args_into_dataclasses(args=argv)
        trainer = build_trainer(model_args, data_args, lora_args, training_args)
    except (FileNotFoundError, ValueError) as error:
        exit_with_error(parser, error)
    try:
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        saved = save_final(trainer, model_args, lora_args)
    except BaseException as error:
        # Also when training raised: left to the interpreter's exit, the DDP wrapper (held by the traceback's frames)
        # would free the process group in the order that can hang. The traceback keeps its lines, not its locals.
        traceback.clear_frames(error.__traceback__)
        end_distributed(trainer)
        raise
    if trainer.is_world_process_zero():
        print(f"Saved: {', '.join(saved)}")
    end_distributed(trainer)
    return 0


def end_distributed(trainer: Trainer) -> None:
    """Tears a multi-process run down in an order that cannot hang or abort a rank.

    A gloo group left to exit handlers can abort a rank ("terminate called without an active exception") after all
    its work is done, so the group is destroyed here. But the group must not be freed by the DDP wrapper's `Reducer`
    either: its binding keeps the GIL while the group's destructor joins the gloo worker threads, and a worker still
    releasing a finished collective's tensors needs the GIL, a deadlock (torch 2.13: the two-process tests hung in 2 of
    9 runs of their module before this order, 0 of 20 after). So the wrapper goes first, while the group is still
    registered, and `destroy_process_group`, whose binding releases the GIL, frees the group last.
    """
    trainer.model_wrapped = trainer.model = trainer.accelerator.unwrap_model(trainer.model)
    trainer.accelerator.free_memory()  # accelerate's own references to the wrapper
    gc.collect()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    sys.exit(main())
