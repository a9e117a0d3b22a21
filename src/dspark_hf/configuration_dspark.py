"""Configuration of the DSpark drafter, in the official DeepSpec checkpoint layout.

The official checkpoints (``deepseek-ai/dspark_qwen3_*_block7``) store a copy of the target's Qwen3 config with the
draft keys added, ``model_type: "qwen3"`` and ``architectures: ["Qwen3DSparkModel"]`` (docs/design.md, "Checkpoint
layout"). This class parses exactly that JSON and writes it back, so DeepSpec, vLLM and SGLang load what we save.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.utils import logging

from .registry import DRAFTER_ARCHITECTURES, architectures_of


logger = logging.get_logger(__name__)

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
# `architectures[0]` of official and our Qwen3-layout checkpoints (the first is written on save).
DSPARK_ARCHITECTURES = architectures_of("qwen3")
# Keys of the target config that describe the target, not the drafter: dropped when the drafter config is derived.
_TARGET_ONLY_KEYS = ("architectures", "auto_map", "quantization_config", "_name_or_path", "torch_dtype", "dtype")
# Keys of the target config the drafter rebuilds itself (every draft layer is full attention).
_REBUILT_KEYS = ("model_type", "layer_types", "per_layer_config")
# Optional DSpark keys written only when set (DeepSpec's files have none of them).
_OPTIONAL_KEYS = ("confidence_temperatures", "target_model_type", "target_text_model_type", "draft_vocab_size",
                  "target_name_or_path")


def hidden_state_indices(target_layer_ids) -> list[int]:
    """Where the layers of `target_layer_ids` sit in a target's `hidden_states` output: ``i + 1`` for layer ``i``
    (index 0 is the embedding output, layer -1). A verification forward asks for exactly these
    (``output_hidden_states=[...]``)."""
    return [int(i) + 1 for i in target_layer_ids]


@dataclass(kw_only=True)
class DSparkKeys:
    """The DSpark keys of every drafter config (docs/design.md, "Checkpoint layout"), shared by [`DSparkConfig`] and the
    Gemma4 variant; documented in [`DSparkConfig`]. A dataclass mixin, so each config stays one strict, flat dataclass.
    """

    # A drafter config is not valid without arguments (its mask token is the target's), so transformers < 5.20 must not
    # build one to diff against when saving.
    has_no_defaults_at_init = True

    block_size: int = 7
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = None
    num_anchors: int = 512
    markov_rank: int = 64
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    confidence_temperatures: list[float] | None = None
    target_model_type: str | None = None
    draft_vocab_size: int | None = None
    target_name_or_path: str | None = None

    def validate_dspark(self) -> None:
        """Raises `ValueError` naming the offending value when the DSpark keys are inconsistent."""
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}.")
        if self.mask_token_id is None or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id must be an id in [0, vocab_size={self.vocab_size}), got {self.mask_token_id}. "
                "Use an unused (reserved or special) token of the target's vocabulary."
            )
        ids = self.target_layer_ids
        if len(ids) == 0 or any(b <= a for a, b in zip(ids, ids[1:])):
            raise ValueError(f"target_layer_ids must be a non-empty, strictly increasing list, got {ids}.")
        if ids[0] < -1:
            raise ValueError(f"target_layer_ids must be >= -1 (-1 is the embedding output), got {ids}.")
        if self.num_target_layers is not None and ids[-1] >= self.num_target_layers - 1:
            raise ValueError(
                f"target_layer_ids={ids} includes layer {ids[-1]}, but the target has {self.num_target_layers} layers "
                f"and its last layer ({self.num_target_layers - 1}) cannot be used: transformers returns it after the "
                f"final norm. Pick ids <= {self.num_target_layers - 2}."
            )
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank must be >= 0 (0 disables the Markov head), got {self.markov_rank}.")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}.")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}] (or None for the full vocabulary), got "
                f"{self.draft_vocab_size}."
            )
        temps = self.confidence_temperatures
        if temps is not None and (len(temps) != self.block_size or any(t <= 0 for t in temps)):
            raise ValueError(
                f"confidence_temperatures must hold block_size={self.block_size} positive values, got {temps}."
            )

    @property
    def num_context_features(self) -> int:
        """Width of the concatenated target features, ``len(target_layer_ids) * hidden_size``."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def hidden_state_indices(self) -> list[int]:
        """The indices of the target's `hidden_states` the drafter reads ([`hidden_state_indices`])."""
        return hidden_state_indices(self.target_layer_ids)

    # --- what every drafter family shares; each config class sets `drafter_family` ------------------------------

    @classmethod
    def from_target_config(cls, target_config: PreTrainedConfig, **kwargs):
        """Derives a drafter config from a target's config, as DeepSpec does: copy the target's keys, then override.

        Args:
            target_config ([`PreTrainedConfig`]): the target's config (the text config is used for multimodal ones).
            kwargs: DSpark keys (`block_size`, `markov_rank`, ...) and overrides (`num_hidden_layers`, ...).
                `target_layer_ids` defaults to up to 5 layers spread from layer 1 to the second-to-last layer, and
                `mask_token_id` to the target's pad token, else its last vocabulary id.
        """
        text_config = target_config.get_text_config()
        num_target_layers = text_config.num_hidden_layers
        values: dict[str, Any] = {
            k: v for k, v in copy.deepcopy(text_config.to_dict()).items()
            if k not in _TARGET_ONLY_KEYS and k not in _REBUILT_KEYS
        }
        values.update(cls.target_derived_values(target_config, text_config))
        values.update(
            num_hidden_layers=kwargs.pop("num_hidden_layers", 1),
            num_target_layers=num_target_layers,
            tie_word_embeddings=False,
            target_layer_ids=kwargs.pop("target_layer_ids", None) or default_target_layer_ids(num_target_layers),
        )
        if kwargs.get("mask_token_id") is None:
            pad = getattr(text_config, "pad_token_id", None)
            kwargs["mask_token_id"] = pad if pad is not None else text_config.vocab_size - 1
        values.update(kwargs)
        known = set(cls.__dataclass_fields__) | set(PreTrainedConfig.__dataclass_fields__)
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def target_derived_values(cls, target_config: PreTrainedConfig, text_config: PreTrainedConfig) -> dict[str, Any]:
        """The family's own keys derived from the target (and its checks of the target); see `from_target_config`."""
        return {}

    def to_dict(self) -> dict[str, Any]:
        return self.official_layout(super().to_dict())

    def official_layout(self, output: dict[str, Any]) -> dict[str, Any]:
        """A config dict in the official layout, in place: the target family's ``model_type`` (DeepSpec's eval.py reads
        it with AutoConfig), the drafter's ``architectures``, and the conditional and optional keys only where
        DeepSpec writes them (``docs/design.md``, "Checkpoint layout")."""
        output.pop("per_layer_config", None)
        architecture = architectures_of(self.drafter_family)[0]
        output["model_type"] = DRAFTER_ARCHITECTURES[architecture].model_type
        output["architectures"] = [architecture]
        if not self.markov_rank:
            output.pop("markov_head_type", None)
        if not self.enable_confidence_head:
            output.pop("confidence_head_with_markov", None)
        for key in _OPTIONAL_KEYS:
            if output.get(key) is None:
                output.pop(key, None)
        return output

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        # Reads the file ourselves: the stock path warns that model_type "qwen3" is not "dspark", which is expected.
        config_dict, kwargs = cls.get_config_dict(pretrained_model_name_or_path, **kwargs)
        return cls.from_dict(config_dict, **kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs):
        config_dict = dict(config_dict)
        architectures_read = architectures_of(cls.drafter_family)
        written_model_type = DRAFTER_ARCHITECTURES[architectures_read[0]].model_type
        model_type = config_dict.pop("model_type", None)
        if model_type not in (None, cls.model_type, written_model_type):
            raise ValueError(
                f"This checkpoint has model_type={model_type!r}; {cls.__name__} reads drafters written with "
                f"model_type {written_model_type!r} (the official DSpark layout). Is this a DSpark drafter checkpoint "
                "of this family?"
            )
        architectures = config_dict.get("architectures") or []
        if architectures and architectures[0] == "DFlashDraftModel":
            raise ValueError(
                "This checkpoint is a z-lab DFlash drafter (architectures=['DFlashDraftModel']): its block drops the "
                "anchor's output, so its drafts would land one position off here (docs/design.md, \"Forward pass\"). "
                "Run it with code of its own convention (z-lab's, or transformers' speculation_type=\"dflash\" "
                "loop), not as a DSpark drafter."
            )
        if architectures and architectures[0] not in architectures_read:
            raise ValueError(
                f"This checkpoint declares architectures={architectures}, not a drafter {cls.__name__} reads "
                f"(expected one of {list(architectures_read)}). Load other drafters with AutoModel (after "
                "`import dspark_hf`) and targets with AutoModelForCausalLM."
            )
        missing = [k for k in ("target_layer_ids", "mask_token_id", "block_size") if k not in config_dict]
        if missing:
            raise ValueError(f"Drafter config is missing the DSpark keys {missing}; is this a DSpark checkpoint?")
        # DFlash siblings and SGLang-style configs omit the conditional keys; their absence means "off".
        config_dict.setdefault("markov_rank", 0)
        config_dict.setdefault("enable_confidence_head", False)
        config_dict.setdefault("markov_head_type", "vanilla")
        if "torch_dtype" in config_dict and "dtype" not in config_dict:
            config_dict["dtype"] = config_dict.pop("torch_dtype")
        return super().from_dict(config_dict, **kwargs)


@strict
class DSparkConfig(DSparkKeys, Qwen3Config):
    r"""
    Configuration of a [`DSparkDrafter`]. It is a Qwen3 configuration (the draft layers are Qwen3 layers) plus the
    DSpark keys of the official checkpoint layout. On disk it is written with ``model_type: "qwen3"`` and
    ``architectures: ["Qwen3DSparkModel"]``, exactly like DeepSpec's releases.

    block_size (`int`, defaults to 7):
        Number of block slots (γ): the anchor plus ``block_size - 1`` mask tokens, giving ``block_size`` drafts.
    mask_token_id (`int`, *optional*):
        Token id fed to the non-anchor block slots. Must be ``< vocab_size``.
    target_layer_ids (`list[int]`):
        0-based target decoder layers whose raw outputs (HF ``hidden_states[i + 1]``) are concatenated as context.
        Strictly increasing, in ``[-1, num_target_layers - 2]`` (the last layer is final-normed by HF, so excluded).
    num_target_layers (`int`, *optional*):
        Depth of the target the drafter was built for; used to validate the target at generation time.
    num_anchors (`int`, defaults to 512):
        Training only: anchors (blocks) sampled per sequence.
    markov_rank (`int`, defaults to 64):
        Rank r of the Markov transition bias ``W2 · W1[x_{k-1}]``; 0 disables the head (the DFlash ablation).
    markov_head_type (`str`, defaults to `"vanilla"`):
        One of ``"vanilla"``, ``"gated"``, ``"rnn"`` (docs/design.md, "Markov head and drafting"). vLLM/SGLang serve
        ``"vanilla"`` only.
    enable_confidence_head (`bool`, defaults to `True`):
        Whether the drafter has the confidence head ``c_k = σ(proj([h_k ; W1[x_{k-1}]]))``.
    confidence_head_with_markov (`bool`, defaults to `True`):
        Whether the confidence head also reads the Markov embedding of the previous token.
    confidence_temperatures (`list[float]`, *optional*):
        Per-position temperatures fitted by Sequential Temperature Scaling; ``None`` means uncalibrated (all 1).
    target_model_type (`str`, *optional*):
        ``model_type`` of the target (e.g. ``"llama"``); informational.
    draft_vocab_size (`int`, *optional*):
        Size of a reduced draft vocabulary (the EAGLE-3 / vLLM convention): the LM head and the Markov head's ``W2``
        score only these tokens, whose target ids the ``d2t`` buffer holds as offsets (``target = draft + d2t``).
        ``None`` drafts over the whole vocabulary. See [`DSparkDrafter.reduce_vocabulary`].
    target_name_or_path (`str`, *optional*):
        The target the drafter was built for (Hub id, local folder or embedded name, as given to `from_target`).
        A compact checkpoint (saved without the vocabulary tensors) that names its target binds that target's
        embedding and LM head on load without being passed the target.

    Example:

    ```python
    >>> from dspark_hf import DSparkConfig
    >>> config = DSparkConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                       num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    ...                       target_layer_ids=[0, 1], num_target_layers=4, mask_token_id=0, markov_rank=8)
    >>> config.block_size
    7
    ```
    """

    model_type = "dspark"
    drafter_family = "qwen3"

    def __post_init__(self, **kwargs):
        # Draft layers see context and block bidirectionally: a sliding-window layer would make vLLM build a causal
        # SWA layer (docs/design.md, "Checkpoint layout"), so every layer is full attention whatever the target uses.
        self.use_sliding_window = False
        self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.target_layer_ids is None:
            self.target_layer_ids = [0]
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        super().__post_init__(**kwargs)
        self.validate_dspark()

    @classmethod
    def target_derived_values(cls, target_config: PreTrainedConfig, text_config: PreTrainedConfig) -> dict[str, Any]:
        values = dict(
            target_model_type=text_config.model_type,
            target_name_or_path=getattr(target_config, "_name_or_path", None) or None,
        )
        if getattr(text_config, "head_dim", None) is None:
            values["head_dim"] = text_config.hidden_size // text_config.num_attention_heads
        # every draft layer is full attention: a target whose RoPE is given per layer type (Gemma3) lends its
        # full-attention parameters
        rope = getattr(text_config, "rope_parameters", None)
        if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
            values["rope_parameters"] = copy.deepcopy(rope["full_attention"])
        return values

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> "DSparkConfig":
        config_dict = dict(config_dict)
        _convert_v4_rope(config_dict)
        return super().from_dict(config_dict, **kwargs)


def _convert_v4_rope(config_dict: dict[str, Any]) -> None:
    """Merges the v4 spelling (``rope_theta`` beside ``rope_scaling``) into v5 ``rope_parameters``, in place.

    transformers' own conversion keeps the scaling but, given both keys in a config dict, drops ``rope_theta`` for its
    default (10000): a YaRN drafter of a 1e6-theta target would rotate at the wrong frequencies without any error.
    """
    if "rope_parameters" in config_dict or not ({"rope_theta", "rope_scaling"} & config_dict.keys()):
        return
    rope_parameters = dict(config_dict.pop("rope_scaling", None) or {})
    if "type" in rope_parameters:  # the oldest spelling of rope_type
        rope_parameters.setdefault("rope_type", rope_parameters.pop("type"))
    rope_parameters.setdefault("rope_type", "default")
    if "rope_theta" in config_dict:
        rope_parameters["rope_theta"] = config_dict.pop("rope_theta")
    config_dict["rope_parameters"] = rope_parameters


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """Up to `num_features` layers spread evenly from layer 1 to the second-to-last (DeepSpec's 4B choice is
    ``[1, 9, 17, 25, 33]`` of 36)."""
    last = num_target_layers - 2
    if last < 1:
        return [max(last, -1)]
    first = 1
    count = min(num_features, last - first + 1)
    if count == 1:
        return [first]
    step = (last - first) / (count - 1)
    return sorted({round(first + i * step) for i in range(count)})


__all__ = ["DSparkConfig", "DSparkKeys", "DSPARK_ARCHITECTURES", "default_target_layer_ids"]
