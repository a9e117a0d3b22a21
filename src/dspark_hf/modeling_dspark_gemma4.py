"""The Gemma4 DSpark drafter: ``Gemma4DSparkModel`` in the official layout (``deepseek-ai/dspark_gemma4_12b_block7``).

Same drafting scheme as [`DSparkDrafter`] (context projection, anchor-first block, bidirectional block attention over
cached context K/V, Markov and confidence heads), with Gemma4's layers (docs/design.md, "Checkpoint layout" and "Forward
pass"):

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

import torch
import torch.nn as nn
from transformers import initialization as init
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4RMSNorm,
    Gemma4TextAttention,
    Gemma4TextDecoderLayer,
    Gemma4TextRotaryEmbedding,
    Gemma4TextScaledWordEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from .configuration_dspark_gemma4 import DSparkGemma4Config
from .modeling_dspark import DSparkDrafter, DSparkLayers, attend_block


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
        # `num_kv_shared_layers` describes the target; no draft layer shares K/V. transformers < 5.23 reads it here
        # (5.23 on reads `config.kv_sharing_modes`, which the drafter config sets to none).
        shared, config.num_kv_shared_layers = config.num_kv_shared_layers, 0
        try:
            super().__init__(config, layer_idx)
            self.self_attn = DSparkGemma4Attention(config, layer_idx)
        finally:
            config.num_kv_shared_layers = shared

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


def _scaled_embedding(config: DSparkGemma4Config) -> Gemma4TextScaledWordEmbedding:
    # The stored weight is raw; Gemma scales the embedding by √hidden_size at run time.
    return Gemma4TextScaledWordEmbedding(
        config.vocab_size, config.hidden_size, config.pad_token_id, embed_scale=config.hidden_size**0.5
    )


GEMMA4_LAYERS = DSparkLayers(
    decoder_layer=DSparkGemma4DecoderLayer, norm=Gemma4RMSNorm, rotary_embedding=DSparkGemma4RotaryEmbedding,
    embedding=_scaled_embedding,
)


class DSparkGemma4Drafter(DSparkDrafter):
    """The Gemma4 DSpark drafter (``Gemma4DSparkModel``): [`DSparkDrafter`] with Gemma4 layers.

    The tensor names follow the official layout (docs/design.md, "Checkpoint layout"): ``embed_tokens``, ``fc``,
    ``hidden_norm``,
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
    family_layers = GEMMA4_LAYERS

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

    def draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Soft-capped like the target's (``final_logit_softcapping``); the Markov bias is added after the cap
        (docs/design.md, "Markov head and drafting")."""
        return softcap_logits(self.lm_head(hidden_states), self.config.final_logit_softcapping)


__all__ = [
    "DSparkGemma4Config",
    "DSparkGemma4Drafter",
    "DSparkGemma4Attention",
    "DSparkGemma4DecoderLayer",
    "GEMMA4_LAYERS",
    "softcap_logits",
]
