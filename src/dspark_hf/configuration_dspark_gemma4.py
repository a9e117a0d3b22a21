"""Configuration of the Gemma4 DSpark drafter (``Gemma4DSparkModel``, ``deepseek-ai/dspark_gemma4_12b_block7``).

The target's ``Gemma4TextConfig`` plus the DSpark keys, written with ``model_type: "gemma4_text"``
(``docs/design.md``, "Checkpoint layout"). Reading, writing and deriving from a target are [`DSparkKeys`]'; this
module adds only what Gemma4 has of its own: the global attention shape every draft layer uses and the Gemma4 features
the drafter does not implement.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

from .configuration_dspark import DSparkKeys


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
    >>> from dspark_hf.configuration_dspark_gemma4 import DSparkGemma4Config
    >>> config = DSparkGemma4Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...     num_attention_heads=2, num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
    ...     attention_k_eq_v=True, hidden_size_per_layer_input=0, target_layer_ids=[0, 1], num_target_layers=4,
    ...     mask_token_id=4, markov_rank=8)
    >>> config.to_dict()["model_type"]
    'gemma4_text'
    ```
    """

    model_type = "dspark_gemma4"
    drafter_family = "gemma4"

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
    def target_derived_values(cls, target_config: PreTrainedConfig, text_config: PreTrainedConfig) -> dict[str, Any]:
        """Gemma4's keys: the global attention shape, the target's two model types, and the dense, per-layer-input-free
        draft layers DeepSpec builds. Raises `ValueError` for a target that is not Gemma4."""
        if not isinstance(text_config, Gemma4TextConfig):
            raise ValueError(
                f"DSparkGemma4Config needs a Gemma4 target, got a {type(text_config).__name__}; use "
                "DSparkConfig.from_target_config (DSparkDrafter.from_target) for other targets."
            )
        return dict(
            _global_attention_shape(text_config),
            target_model_type=target_config.model_type,
            target_text_model_type=text_config.model_type,
            enable_moe_block=False,
            hidden_size_per_layer_input=0,
        )

    def to_diff_dict(self) -> dict[str, Any]:
        # The diff path re-adds `per_layer_config` after `to_dict`; drop it again.
        return self.official_layout(super().to_diff_dict())


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


__all__ = ["DSparkGemma4Config"]
