"""The Gemma4 DSpark drafter: ``Gemma4DSparkModel`` in the official layout (``deepseek-ai/dspark_gemma4_12b_block7``).

Same drafting scheme as [`DSparkDrafter`] (context projection, anchor-first block, bidirectional block attention over
cached context K/V, Markov and confidence heads), with Gemma4's layers (spec sections 1-3):

- the config is the target's ``Gemma4TextConfig`` plus the DSpark keys, written with ``model_type: "gemma4_text"``;
- the embedding is scaled by ``√hidden_size`` at run time (the stored weight is raw);
- attention has scale 1.0, per-head ``q_norm``/``k_norm``, a weightless ``v_norm`` and, with ``attention_k_eq_v``, no
  ``v_proj`` (values are the un-normed keys); every draft layer uses the *global* (full-attention) head shape
  ``global_head_dim`` x ``num_global_key_value_heads`` and the full-attention RoPE;
- layers are sandwich-normed and multiplied by a stored ``layer_scalar``; the MLP uses ``hidden_activation``;
- base logits are soft-capped, ``tanh(U / cap) * cap``, before the Markov bias is added.

The layers subclass transformers' Gemma4 modules; only the attention's key/value source is DSpark's own.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn
from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4RMSNorm,
    Gemma4TextAttention,
    Gemma4TextDecoderLayer,
    Gemma4TextRotaryEmbedding,
    Gemma4TextScaledWordEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.utils import logging

from .configuration_dspark import _TARGET_ONLY_KEYS, DSparkKeys, default_target_layer_ids
from .modeling_dspark import (
    DSparkConfidenceHead,
    DSparkDrafter,
    DSparkMarkovHead,
    DSparkPreTrainedModel,
    _refuse_draft_vocab_size,
    attend_block,
)


logger = logging.get_logger(__name__)

GEMMA4_ARCHITECTURE = "Gemma4DSparkModel"
GEMMA4_MODEL_TYPE = "gemma4_text"


@strict
class DSparkGemma4Config(DSparkKeys, Gemma4TextConfig):
    r"""
    Configuration of a [`DSparkGemma4Drafter`]: the target's Gemma4 text configuration plus the DSpark keys (same
    meaning and validation as in [`DSparkConfig`]). On disk it is written exactly like DeepSpec's release:
    ``model_type: "gemma4_text"``, ``architectures: ["Gemma4DSparkModel"]``, ``global_head_dim`` and
    ``num_global_key_value_heads`` spelled out (transformers >= 5.2x folds them into ``per_layer_config``, which the
    official loaders do not read), conditional keys omitted as DeepSpec omits them.

    global_head_dim (`int`, defaults to 512):
        Head dim of the full-attention layers; every draft layer uses it.
    num_global_key_value_heads (`int`, *optional*):
        KV heads of the full-attention layers when ``attention_k_eq_v`` (otherwise ``num_key_value_heads`` is used).
    target_text_model_type (`str`, *optional*):
        ``model_type`` of the target's text config (e.g. ``"gemma4_text"``); informational.

    Example:

    ```python
    >>> from dspark_hf.modeling_dspark_gemma4 import DSparkGemma4Config
    >>> config = DSparkGemma4Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...     num_attention_heads=2, num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
    ...     attention_k_eq_v=True, hidden_size_per_layer_input=0, target_layer_ids=[0, 1], num_target_layers=4,
    ...     mask_token_id=4, markov_rank=8)
    >>> config.to_dict()["model_type"]
    'gemma4_text'
    ```
    """

    model_type = "dspark_gemma4"

    target_text_model_type: str | None = None
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None

    def __post_init__(self, **kwargs):
        # Every draft layer is a full-attention layer (a sliding layer would make vLLM build a causal SWA layer).
        self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.target_layer_ids = [int(i) for i in (self.target_layer_ids if self.target_layer_ids is not None else [0])]
        # Rebuilt from the two official keys, so a file written by plain transformers >= 5.2x reads the same.
        kwargs.pop("per_layer_config", None)
        super().__post_init__(
            global_head_dim=self.global_head_dim, num_global_key_value_heads=self.num_global_key_value_heads, **kwargs
        )
        self.validate_dspark()
        self.validate_gemma4()

    @property
    def kv_sharing_modes(self) -> list[str | None]:
        # `num_kv_shared_layers` describes the target; the draft layers never share K/V with each other.
        return [None] * self.num_hidden_layers

    def validate_gemma4(self) -> None:
        """Raises `ValueError` naming the offending value for Gemma4 features the drafter does not implement."""
        if self.enable_moe_block:
            raise ValueError("enable_moe_block=True: the Gemma4 DSpark draft layers are dense; set it to false.")
        if self.hidden_size_per_layer_input:
            raise ValueError(
                f"hidden_size_per_layer_input={self.hidden_size_per_layer_input}: the Gemma4 DSpark drafter has no "
                "per-layer input embeddings; set it to 0 (DeepSpec does)."
            )
        if self.attention_k_eq_v and self.num_global_key_value_heads is None:
            raise ValueError("attention_k_eq_v=True needs num_global_key_value_heads (the global KV head count).")
        kv_heads = self.num_global_key_value_heads if self.attention_k_eq_v else self.num_key_value_heads
        if self.num_attention_heads % kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of the {kv_heads} key/value heads "
                "of the full-attention layers."
            )
        cap = self.final_logit_softcapping
        if cap is not None and cap <= 0:
            raise ValueError(f"final_logit_softcapping must be positive or null, got {cap}.")

    @classmethod
    def from_target_config(cls, target_config: PreTrainedConfig, **kwargs) -> DSparkGemma4Config:
        """Derives a drafter config from a Gemma4 target's config, as DeepSpec does: copy the text config, override.

        Args:
            target_config ([`PreTrainedConfig`]): a `Gemma4Config` (multimodal) or `Gemma4TextConfig`.
            kwargs: DSpark keys and overrides, e.g. `num_hidden_layers=5, mask_token_id=4, markov_rank=256`.
                `target_layer_ids` defaults to 5 layers spread up to the second-to-last; `mask_token_id` to the pad id.
        """
        text_config = target_config.get_text_config()
        if not isinstance(text_config, Gemma4TextConfig):
            raise ValueError(
                f"DSparkGemma4Config needs a Gemma4 target, got a {type(text_config).__name__}; use "
                "DSparkConfig.from_target_config (DSparkDrafter.from_target) for other targets."
            )
        values: dict[str, Any] = {
            k: v for k, v in copy.deepcopy(text_config.to_dict()).items() if k not in _TARGET_ONLY_KEYS
        }
        for key in ("model_type", "layer_types", "per_layer_config"):
            values.pop(key, None)
        values.update(_global_attention_shape(text_config))
        num_target_layers = text_config.num_hidden_layers
        values.update(
            num_hidden_layers=kwargs.pop("num_hidden_layers", 1),
            num_target_layers=num_target_layers,
            target_model_type=target_config.model_type,
            target_text_model_type=text_config.model_type,
            tie_word_embeddings=False,
            enable_moe_block=False,
            hidden_size_per_layer_input=0,
            target_layer_ids=kwargs.pop("target_layer_ids", None) or default_target_layer_ids(num_target_layers),
        )
        if kwargs.get("mask_token_id") is None:
            pad = text_config.pad_token_id
            kwargs["mask_token_id"] = pad if pad is not None else text_config.vocab_size - 1
        values.update(kwargs)
        known = set(cls.__dataclass_fields__) | set(PreTrainedConfig.__dataclass_fields__)
        return cls(**{k: v for k, v in values.items() if k in known})

    # --- serialization in the official layout -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return self._official_layout(super().to_dict())

    def to_diff_dict(self) -> dict[str, Any]:
        # The diff path re-adds `per_layer_config` after `to_dict`; drop it again.
        return self._official_layout(super().to_diff_dict())

    def _official_layout(self, output: dict[str, Any]) -> dict[str, Any]:
        output.pop("per_layer_config", None)
        output["model_type"] = GEMMA4_MODEL_TYPE
        output["architectures"] = [GEMMA4_ARCHITECTURE]
        if not self.markov_rank:
            output.pop("markov_head_type", None)
        if not self.enable_confidence_head:
            output.pop("confidence_head_with_markov", None)
        for key in ("confidence_temperatures", "target_model_type", "target_text_model_type", "draft_vocab_size",
                    "target_name_or_path"):
            if output.get(key) is None:
                output.pop(key, None)
        return output

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs) -> DSparkGemma4Config:
        config_dict, kwargs = cls.get_config_dict(pretrained_model_name_or_path, **kwargs)
        return cls.from_dict(config_dict, **kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> DSparkGemma4Config:
        config_dict = dict(config_dict)
        model_type = config_dict.pop("model_type", None)
        if model_type not in (None, cls.model_type, GEMMA4_MODEL_TYPE):
            raise ValueError(
                f"This checkpoint has model_type={model_type!r}; DSparkGemma4Config reads Gemma4 drafters written with "
                f"model_type {GEMMA4_MODEL_TYPE!r}. For Qwen3-layout drafters use DSparkConfig."
            )
        architectures = config_dict.get("architectures") or []
        if architectures and architectures[0] != GEMMA4_ARCHITECTURE:
            raise ValueError(
                f"This checkpoint declares architectures={architectures}, not {GEMMA4_ARCHITECTURE!r}. Load "
                "Qwen3DSparkModel checkpoints with DSparkDrafter and targets with AutoModelForCausalLM."
            )
        missing = [k for k in ("target_layer_ids", "mask_token_id", "block_size") if k not in config_dict]
        if missing:
            raise ValueError(f"Drafter config is missing the DSpark keys {missing}; is this a DSpark checkpoint?")
        # DFlash siblings omit the conditional keys; their absence means "off".
        config_dict.setdefault("markov_rank", 0)
        config_dict.setdefault("enable_confidence_head", False)
        config_dict.setdefault("markov_head_type", "vanilla")
        if "torch_dtype" in config_dict and "dtype" not in config_dict:
            config_dict["dtype"] = config_dict.pop("torch_dtype")
        return super().from_dict(config_dict, **kwargs)


def _global_attention_shape(text_config: Gemma4TextConfig) -> dict[str, Any]:
    """``global_head_dim`` / ``num_global_key_value_heads`` of a target text config, whichever way it stores them."""
    if isinstance(text_config, DSparkGemma4Config):
        return {
            "global_head_dim": text_config.global_head_dim,
            "num_global_key_value_heads": text_config.num_global_key_value_heads,
        }
    if "full_attention" not in text_config.layer_types:
        raise ValueError("The Gemma4 target has no full-attention layer to take the draft attention shape from.")
    layer_config = text_config.per_layer_config[text_config.layer_types.index("full_attention")]
    return {
        "global_head_dim": layer_config.head_dim,
        "num_global_key_value_heads": layer_config.num_key_value_heads if text_config.attention_k_eq_v else None,
    }


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma's final logit soft-capping ``tanh(logits / cap) * cap`` (identity when `cap` is None)."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


class DSparkGemma4Attention(Gemma4TextAttention):
    """Gemma4 full attention whose keys/values are the cached target context followed by the block itself.

    Keys are ``RoPE(k_norm(k_proj(x)))``, values ``v_norm(v_proj(x))`` (``v_norm(k_proj(x))`` with
    ``attention_k_eq_v``), for context and block alike; block queries see all of them, unmasked, with scale 1.0.
    """

    def __init__(self, config: DSparkGemma4Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_causal = False

    def context_key_values(
        self, states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `(batch, seq, hidden)` states -> two `(batch, kv_heads, seq, head_dim)` (keys rotated)."""
        shape = (*states.shape[:-1], -1, self.head_dim)
        raw_keys = self.k_proj(states).view(shape)
        raw_values = self.v_proj(states).view(shape) if self.v_proj is not None else raw_keys
        keys = self.k_norm(raw_keys).transpose(1, 2)
        values = self.v_norm(raw_values).transpose(1, 2)
        cos, sin = position_embeddings
        return apply_rotary_pos_emb(keys, cos, sin, unsqueeze_dim=1), values

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        context_key_values: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        cos, sin = position_embeddings
        query = self.q_norm(self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim)).transpose(1, 2)
        query = apply_rotary_pos_emb(query, cos, sin, unsqueeze_dim=1)
        keys, values = self.context_key_values(hidden_states, position_embeddings)
        return attend_block(self, query, keys, values, context_key_values, attention_mask,
                            eager_fallback=eager_attention_forward, **kwargs)


class DSparkGemma4DecoderLayer(Gemma4TextDecoderLayer):
    """A Gemma4 decoder layer (sandwich norms, gated-GELU MLP, ``layer_scalar``) with [`DSparkGemma4Attention`]."""

    def __init__(self, config: DSparkGemma4Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = DSparkGemma4Attention(config, layer_idx)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        context_key_values: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        attn_output, _ = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, context_key_values, attention_mask, **kwargs
        )
        hidden_states = hidden_states + self.post_attention_layernorm(attn_output)
        mlp_output = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        hidden_states = hidden_states + self.post_feedforward_layernorm(mlp_output)
        return hidden_states * self.layer_scalar


class DSparkGemma4RotaryEmbedding(Gemma4TextRotaryEmbedding):
    """Gemma4 RoPE restricted to the full-attention parameters, called like the Qwen3 one: `(x, position_ids)`."""

    def forward(self, x: torch.Tensor, position_ids: torch.LongTensor, layer_type: str = "full_attention"):
        return super().forward(x, position_ids, layer_type)


class DSparkGemma4Drafter(DSparkDrafter):
    """The Gemma4 DSpark drafter (``Gemma4DSparkModel``): [`DSparkDrafter`] with Gemma4 layers.

    The tensor names follow the official layout (spec section 2): ``embed_tokens``, ``fc``, ``hidden_norm``,
    ``layers.{i}`` (with ``pre/post_feedforward_layernorm`` and the ``layer_scalar`` buffer, no ``v_proj`` under
    ``attention_k_eq_v``), ``norm``, ``lm_head``, ``markov_head.*``, ``confidence_head.proj``.

    ```python
    >>> from dspark_hf.modeling_dspark_gemma4 import DSparkGemma4Drafter
    >>> drafter = DSparkGemma4Drafter.from_pretrained("deepseek-ai/dspark_gemma4_12b_block7")  # doctest: +SKIP
    >>> out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=64)  # doctest: +SKIP
    ```
    """

    config_class = DSparkGemma4Config
    config: DSparkGemma4Config
    _no_split_modules = ["DSparkGemma4DecoderLayer"]

    def __init__(self, config: DSparkGemma4Config):
        # Skips DSparkDrafter.__init__ (which builds Qwen3 modules) and builds the same tree from Gemma4 modules.
        DSparkPreTrainedModel.__init__(self, config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = Gemma4TextScaledWordEmbedding(
            config.vocab_size, hidden, config.pad_token_id, embed_scale=hidden**0.5
        )
        self.fc = nn.Linear(config.num_context_features, hidden, bias=False)
        self.hidden_norm = Gemma4RMSNorm(hidden, eps=eps)
        self.layers = nn.ModuleList([DSparkGemma4DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Gemma4RMSNorm(hidden, eps=eps)
        self.rotary_emb = DSparkGemma4RotaryEmbedding(config)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size or config.vocab_size, bias=False)
        self.markov_head = DSparkMarkovHead(config) if config.markov_rank > 0 else None
        self.confidence_head = DSparkConfidenceHead(config) if config.enable_confidence_head else None
        self._register_draft_vocabulary()
        self.generation_stats = None
        self.post_init()
        self.freeze_vocabulary()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # Buffers the generic initializer does not know (they are not in the checkpoint, or must start at 1).
        if isinstance(module, Gemma4TextScaledWordEmbedding):
            init.constant_(module.embed_scale, module.scalar_embed_scale)
        elif isinstance(module, Gemma4TextRotaryEmbedding):
            for layer_type, rope_init_fn in module.rope_init_fns.items():
                inv_freq, _ = rope_init_fn(module.config.per_layer_config[layer_type], layer_type=layer_type)
                init.copy_(getattr(module, f"{layer_type}_inv_freq"), inv_freq)
                init.copy_(getattr(module, f"{layer_type}_original_inv_freq"), inv_freq)
        elif isinstance(module, Gemma4TextDecoderLayer):
            init.ones_(module.layer_scalar)

    @classmethod
    def from_target(cls, target: PreTrainedModel, **kwargs) -> DSparkGemma4Drafter:
        """A fresh (untrained) drafter for a Gemma4 `target`, with its embedding and LM head copied in and frozen.

        Args:
            target ([`PreTrainedModel`]): `Gemma4ForCausalLM` or `Gemma4ForConditionalGeneration`.
            kwargs: [`DSparkGemma4Config`] keys, e.g. `block_size=7, num_hidden_layers=5, mask_token_id=4`.
        """
        _refuse_draft_vocab_size(kwargs)
        config = DSparkGemma4Config.from_target_config(target.config, **kwargs)
        drafter = cls(config)
        target_embedding = target.get_input_embeddings().weight
        drafter.to(device=target_embedding.device, dtype=target_embedding.dtype)
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(target_embedding)
            drafter.lm_head.weight.copy_(target.get_output_embeddings().weight)
        return drafter

    def draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Soft-capped like the target's (``final_logit_softcapping``); the Markov bias is added after the cap
        (spec 3.7)."""
        return softcap_logits(self.lm_head(hidden_states), self.config.final_logit_softcapping)


__all__ = [
    "DSparkGemma4Config",
    "DSparkGemma4Drafter",
    "DSparkGemma4Attention",
    "DSparkGemma4DecoderLayer",
    "GEMMA4_ARCHITECTURE",
    "softcap_logits",
]
