"""The DSpark drafter: a parallel block drafter over target features, with a Markov head and a confidence head.

Module tree and tensor names follow the official checkpoint layout (docs/design.md, "Checkpoint layout") with no prefix:
``embed_tokens``,
``fc``, ``hidden_norm``, ``layers.{i}``, ``norm``, ``lm_head``, ``markov_head.markov_w{1,2}``,
``confidence_head.proj``. The draft layers reuse transformers' Qwen3 modules; only the attention's key/value source
(target context + block, bidirectional) is DSpark's own.
"""

from __future__ import annotations

import logging as stdlib_logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
from transformers import DynamicCache, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)
from transformers.utils import logging

from .configuration_dspark import DSparkConfig
from .generation.policies import AUTO, check_policy_name


logger = logging.get_logger(__name__)


def _apply_rope(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half) on `(batch, heads, seq, head_dim)` states with `(batch, seq, head_dim)` cos/sin."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return states * cos + rotate_half(states) * sin


class DSparkAttention(Qwen3Attention):
    """Qwen3 attention whose keys/values are the cached target context followed by the block itself.

    The context K/V (`k_norm(k_proj(C))`, `v_proj(C)`, RoPE at the context positions) are computed once per context
    token by [`DSparkAttention.context_key_values`] and kept in the drafter's cache; block queries attend to all of
    them and to every block key, with no causal mask (docs/design.md, "Forward pass").
    """

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_causal = False

    def context_key_values(
        self, context: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of projected target context `(batch, ctx, hidden)` -> two `(batch, kv_heads, ctx, head_dim)`."""
        shape = (*context.shape[:-1], -1, self.head_dim)
        keys = self.k_norm(self.k_proj(context).view(shape)).transpose(1, 2)
        values = self.v_proj(context).view(shape).transpose(1, 2)
        return _apply_rope(keys, *position_embeddings), values

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        context_key_values: tuple[torch.Tensor, torch.Tensor] | None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = _apply_rope(self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2), *position_embeddings)
        keys, values = self.context_key_values(hidden_states, position_embeddings)  # the block's own, not cached
        return attend_block(self, query, keys, values, context_key_values, attention_mask, **kwargs)


def attend_block(
    module: nn.Module,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    context_key_values: tuple[torch.Tensor, torch.Tensor] | None,
    attention_mask: torch.Tensor | None = None,
    eager_fallback=eager_attention_forward,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block queries `(batch, heads, block, head_dim)` attend to ``[cached context ; block]`` keys/values with
    the configured attention kernel (no causal mask), then `o_proj`. Shared by the Qwen3 and Gemma4 drafters."""
    if context_key_values is not None:
        keys = torch.cat([context_key_values[0], keys], dim=2)
        values = torch.cat([context_key_values[1], values], dim=2)
    attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager_fallback)
    attn_output, attn_weights = attention_interface(
        module,
        query,
        keys,
        values,
        attention_mask,
        dropout=module.attention_dropout if module.training else 0.0,
        scaling=module.scaling,
        **kwargs,
    )
    attn_output = attn_output.reshape(query.shape[0], query.shape[2], -1).contiguous()
    return module.o_proj(attn_output), attn_weights


class DSparkDecoderLayer(Qwen3DecoderLayer):
    """A Qwen3 decoder layer (pre-norm attention + SwiGLU MLP) with [`DSparkAttention`]."""

    def __init__(self, config: DSparkConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = DSparkAttention(config, layer_idx)

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
        hidden_states = hidden_states + attn_output
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DSparkMarkovHead(nn.Module):
    """Low-rank transition bias on the draft logits, conditioned on the previously drafted token (docs/design.md,
    "Markov head and drafting").

    - vanilla: ``bias = W2 · W1[prev]``
    - gated: ``bias = W2 · (σ(gate_proj([h ; W1[prev]])) ⊙ W1[prev])``
    - rnn: a GRU-like state over the block, ``bias = W2 · tanh(out)``
    """

    def __init__(self, config: DSparkConfig):
        super().__init__()
        rank, hidden = config.markov_rank, config.hidden_size
        self.head_type = config.markov_head_type
        self.markov_w1 = nn.Embedding(config.vocab_size, rank)  # indexed by target ids
        self.markov_w2 = nn.Linear(rank, config.draft_vocab_size or config.vocab_size, bias=False)
        if self.head_type == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif self.head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)
        self._w2_rows_major, self._w2_version = None, None  # the CPU inference copy of W2 (`_transition`)

    def forward(
        self, previous_ids: torch.LongTensor, hidden_states: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Args:
            previous_ids (`torch.LongTensor` of shape `(*batch)`): the token drafted just before (the anchor first).
            hidden_states (`torch.Tensor` of shape `(*batch, hidden)`): the slot's final-normed hidden state.
            state (`torch.Tensor` of shape `(*batch, rank)`, *optional*): rnn state; `None` at a block's start.

        Returns:
            `(bias, state)`: the `(*batch, draft_vocab)` logit bias (over the draft vocabulary: the whole vocabulary
            unless `draft_vocab_size` is set) and the new rnn state (`None` for other head types).
        """
        embedding = self.markov_w1(previous_ids).to(hidden_states.dtype)
        if self.head_type == "vanilla":
            return self._transition(embedding), None
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden_states, embedding], dim=-1)))
            return self._transition(gate * embedding), None
        if state is None:
            state = torch.zeros_like(embedding)
        gate, candidate, out = self.joint_proj(torch.cat([state, embedding, hidden_states], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return self._transition(torch.tanh(out)), state

    def _transition(self, embedding: torch.Tensor) -> torch.Tensor:
        """``W2 · e``. Drafting on a CPU (no autograd) multiplies by a float32 copy of W2 stored rank-major: there a
        bf16 matrix-vector product with rank-long rows is the slowest step of sampling a slot (~130-170 us for the
        embedded drafter's 8,192 x 64 W2 on a 2-core Xeon, 25-55 us this way; benchmarks/results/drafting-profile).
        The copy is rebuilt whenever the weight changes in place (optimizer steps) or is replaced; wrapped layers
        (PEFT adapters) run as they are. Above 32 rows the bf16 product is about as fast, and there it stays."""
        linear = self.markov_w2
        if (torch.is_grad_enabled() or type(linear) is not nn.Linear or linear.weight.device.type != "cpu"
                or embedding.numel() > 32 * embedding.shape[-1]):
            return linear(embedding)
        weight = linear.weight
        version = (weight.data_ptr(), weight._version, weight.dtype)
        if self._w2_version != version:
            self._w2_rows_major, self._w2_version = weight.detach().float().t().contiguous(), version
        return embedding.float() @ self._w2_rows_major

    def teacher_forced(self, previous_ids: torch.LongTensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """Biases for whole blocks at once, given the true previous tokens (training).

        Args:
            previous_ids (`torch.LongTensor` of shape `(*batch, block)`), hidden_states `(*batch, block, hidden)`.
        Returns:
            `torch.Tensor` of shape `(*batch, block, vocab)`.
        """
        if self.head_type != "rnn":
            return self(previous_ids, hidden_states)[0]
        state, biases = None, []
        for k in range(previous_ids.shape[-1]):
            bias, state = self(previous_ids[..., k], hidden_states[..., k, :], state)
            biases.append(bias)
        return torch.stack(biases, dim=-2)


class DSparkConfidenceHead(nn.Module):
    """``c_k = σ(proj([h_k ; W1[x_{k-1}]]))``: the probability that draft k is accepted given all before were."""

    def __init__(self, config: DSparkConfig):
        super().__init__()
        with_markov = config.confidence_head_with_markov and config.markov_rank > 0
        self.with_markov = with_markov
        self.proj = nn.Linear(config.hidden_size + (config.markov_rank if with_markov else 0), 1)

    def forward(self, hidden_states: torch.Tensor, markov_embedding: torch.Tensor | None) -> torch.Tensor:
        """Raw confidence logits `(*batch,)` in fp32 from `(*batch, hidden)` states and `(*batch, rank)` embeddings."""
        features = hidden_states
        if self.with_markov:
            features = torch.cat([hidden_states, markov_embedding.to(hidden_states.dtype)], dim=-1)
        return self.proj(features).squeeze(-1).float()


class _DropLoadReport(stdlib_logging.Filter):
    """Drops transformers' state-dict load report (our `from_pretrained` raises on every real mismatch itself)."""

    def filter(self, record: stdlib_logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)


@dataclass
class DSparkDrafterOutput(ModelOutput):
    """
    last_hidden_state (`torch.Tensor` of shape `(batch, block_len, hidden)`): final-normed block states `h_k`.
    logits (`torch.Tensor` of shape `(batch, block_len, vocab)`, *optional*): base logits `U_k = lm_head(h_k)`,
        before the Markov bias.
    cache ([`DynamicCache`], *optional*): per-layer context K/V, extended with this call's new context.
    """

    last_hidden_state: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: DynamicCache | None = None


class DSparkPreTrainedModel(PreTrainedModel):
    config_class = DSparkConfig
    config: DSparkConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DSparkDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = False
    _supports_attention_backend = True
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq"]


VOCABULARY_TENSORS = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class DSparkLayers:
    """What differs between drafter families: the modules [`DSparkDrafter`] builds its tree from. The tree, the
    tensor names, the heads and the forward pass are shared.

    decoder_layer (`type`): a draft layer, called `(config, layer_idx)`; it carries the family's attention variant.
    norm (`type`): the RMSNorm of `hidden_norm` and `norm`, called `(hidden_size, eps=rms_norm_eps)`.
    rotary_embedding (`type`): called `(config)`, then `(states, position_ids) -> (cos, sin)`.
    embedding (`Callable`): builds `embed_tokens` from the config (a family may scale the embedding at run time).
    """

    decoder_layer: type[nn.Module]
    norm: type[nn.Module]
    rotary_embedding: type[nn.Module]
    embedding: Callable[[PreTrainedConfig], nn.Module]


def _unscaled_embedding(config: PreTrainedConfig) -> nn.Embedding:
    return nn.Embedding(config.vocab_size, config.hidden_size)


QWEN3_LAYERS = DSparkLayers(
    decoder_layer=DSparkDecoderLayer, norm=Qwen3RMSNorm, rotary_embedding=Qwen3RotaryEmbedding,
    embedding=_unscaled_embedding,
)


class DSparkDrafter(DSparkPreTrainedModel):
    """The DSpark drafter (``Qwen3DSparkModel`` in the official layout).

    One forward drafts a whole block: the anchor (the last committed token) followed by ``block_size - 1`` mask tokens
    attends to the target's multi-layer features of every committed position, and gives ``block_size`` hidden states
    whose logits predict the next ``block_size`` tokens. The Markov head then conditions each draft on the one before
    it, left to right, and the confidence head says how likely each draft survives verification.

    Use it as `assistant_model` in `generate` (``import dspark_hf`` installs the integration):

    ```python
    >>> import dspark_hf
    >>> drafter = dspark_hf.DSparkDrafter.from_target(target, block_size=7, num_hidden_layers=1)  # doctest: +SKIP
    >>> out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=64)  # doctest: +SKIP
    ```
    """

    # The modules of this drafter family; a family's subclass sets its own (see `DSparkGemma4Drafter`).
    family_layers: ClassVar[DSparkLayers] = QWEN3_LAYERS

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        hidden, family = config.hidden_size, self.family_layers
        self.embed_tokens = family.embedding(config)
        self.fc = nn.Linear(config.num_context_features, hidden, bias=False)
        self.hidden_norm = family.norm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([family.decoder_layer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = family.norm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = family.rotary_embedding(config)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size or config.vocab_size, bias=False)
        self.markov_head = DSparkMarkovHead(config) if config.markov_rank > 0 else None
        self.confidence_head = DSparkConfidenceHead(config) if config.enable_confidence_head else None
        self._register_draft_vocabulary()
        # Filled by every `generate` call that uses this drafter (see `dspark_hf.generation.DSparkGenerationStats`).
        self.generation_stats = None
        self.post_init()
        self.freeze_vocabulary()

    def _register_draft_vocabulary(self) -> None:
        """With `draft_vocab_size`, the buffers of the EAGLE-3 / vLLM reduced-vocabulary convention: `d2t`, offsets
        from draft ids to target ids (``target = draft + d2t[draft]``), and `t2d`, the mask of kept target ids."""
        config = self.config
        if config.draft_vocab_size is not None:
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @property
    def draft_token_ids(self) -> torch.LongTensor | None:
        """Target ids of the draft vocabulary, in draft-id order; `None` when the drafter drafts over the whole
        vocabulary."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    @property
    def verification_policy(self):
        """How much of each drafted block the target verifies (`str` or [`VerificationPolicy`]).

        `"auto"` (the default) is the hardware-aware scheduler on this machine's measured speeds: the drafter folder's
        `dspark_sps_profile.json` when it was measured on this kind of machine in the target's dtype, else a profile
        measured on first use (a few seconds) and cached in the dspark-hf cache folder; a drafter without confidence
        head verifies the full block. Set a name (`"full"`, `"threshold"`, `"hardware_aware"`) or an instance
        (`FixedLengthPolicy(2)`, `ThresholdPolicy(0.5)`, `HardwareAwarePolicy(profile)`); `None` restores the default.
        The environment variable `DSPARK_HF_VERIFICATION_POLICY` changes the default (a policy name).
        """
        policy = self.__dict__.get("_verification_policy")
        return policy if policy is not None else os.environ.get("DSPARK_HF_VERIFICATION_POLICY", AUTO)

    @verification_policy.setter
    def verification_policy(self, policy) -> None:
        check_policy_name(policy)
        self.__dict__["_verification_policy"] = policy

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def freeze_vocabulary(self) -> None:
        """Freezes `embed_tokens` and `lm_head`: they are copies of the target's and are never trained."""
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    @torch.no_grad()
    def init_layers_from_target(self, target: PreTrainedModel, layer_ids: list[int]) -> list[str]:
        """Copies target decoder layer ``layer_ids[j]`` into draft layer ``j``, a warm start for a new drafter.

        Draft layers have the target's shapes, so every weight the two share by name is copied (attention and MLP
        projections, the two norms); the drafter's own (the q/k norms of a Qwen3-style layer over a Llama target)
        keep their initialisation. Returns the names left as initialised.

        Args:
            target ([`PreTrainedModel`]): the target the drafter was built for.
            layer_ids (`list[int]`): one target layer per draft layer, 0-based.
        """
        target_layers = target.get_decoder().layers
        if len(layer_ids) != len(self.layers) or not all(0 <= i < len(target_layers) for i in layer_ids):
            raise ValueError(
                f"init layers {list(layer_ids)}: give one target layer in [0, {len(target_layers)}) per draft layer "
                f"({len(self.layers)} here)."
            )
        kept = set()
        for layer, index in zip(self.layers, layer_ids):
            source = target_layers[index].state_dict()
            for name, tensor in layer.state_dict().items():
                if name in source and source[name].shape == tensor.shape:
                    tensor.copy_(source[name])
                else:
                    kept.add(name)
        return sorted(kept)

    @torch.no_grad()
    def grow_layers(self, num_new_layers: int) -> None:
        """Appends `num_new_layers` draft layers that start as the identity, so the drafter drafts exactly as before.

        Each new layer's two residual branches end in a zeroed projection (attention output and MLP down projection):
        its output is its input until training moves those weights, and the gradient reaches them at the first step.
        This widens a trained drafter without losing what it learned (the capacity lever of a training campaign); the
        new layers' other weights take the drafter's initialisation.

        Args:
            num_new_layers (`int`): how many layers to append, at least 1.
        """
        if num_new_layers < 1:
            raise ValueError(f"grow by {num_new_layers} layers: give at least 1.")
        config, first = self.config, len(self.layers)
        config.num_hidden_layers = first + num_new_layers
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        reference = next(self.layers.parameters())
        for index in range(first, config.num_hidden_layers):
            layer = self.family_layers.decoder_layer(config, index)
            for module in layer.modules():
                self._init_weights(module)
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            self.layers.append(layer.to(device=reference.device, dtype=reference.dtype))

    @torch.no_grad()
    def grow_markov_rank(self, rank: int) -> None:
        """Widens the (vanilla) Markov head to `rank`, keeping the drafter's drafts and confidences exactly.

        The bias ``W2 · W1[prev]`` gains ``rank - markov_rank`` directions: their `W1` columns take the drafter's
        initialisation and their `W2` columns (and the confidence head's weights on them) start at zero, so the bias
        is unchanged until training moves them; the gradient reaches the new `W2` columns at the first step. The
        Markov rank lever of a training campaign, as [`grow_layers`] is the depth lever.

        Args:
            rank (`int`): the new rank, above the current `markov_rank`.
        """
        config, head = self.config, self.markov_head
        if head is None or head.head_type != "vanilla":
            kind = "no Markov head" if head is None else f"a {head.head_type!r} Markov head"
            raise ValueError(f"grow the Markov rank: only a vanilla Markov head can grow, this drafter has {kind}.")
        old = config.markov_rank
        if rank <= old:
            raise ValueError(f"grow the Markov rank to {rank}: give a rank above the drafter's {old}.")
        config.markov_rank = rank
        grown = DSparkMarkovHead(config)
        self._init_weights(grown.markov_w1)
        grown.markov_w1.weight[:, :old] = head.markov_w1.weight
        grown.markov_w2.weight.zero_()[:, :old] = head.markov_w2.weight
        reference = head.markov_w1.weight
        self.markov_head = grown.to(device=reference.device, dtype=reference.dtype)
        self._refit_confidence_head()

    @torch.no_grad()
    def drop_markov_head(self) -> None:
        """Removes the Markov head, turning the drafter into its DFlash ablation (``markov_rank`` 0).

        The drafts then come from the block's logits alone, and the confidence head keeps its weights on the hidden
        state (the ones it had on the Markov embedding go with the head): the drafter scores as before for a
        previous token whose Markov embedding is zero. Training it on from here, beside the same drafter trained on
        with its head, measures what the head is worth at equal training from one starting point.
        """
        if self.markov_head is None:
            raise ValueError("drop the Markov head: this drafter has none (markov_rank is 0).")
        self.config.markov_rank = 0
        self.markov_head = None
        self._refit_confidence_head()

    @torch.no_grad()
    def _refit_confidence_head(self) -> None:
        """Rebuilds the confidence head for the config's current Markov rank after the head changed rank: the
        hidden-state weights, the first Markov-embedding weights that still fit and the bias are kept, new embedding
        weights start at zero (so a wider head scores as before)."""
        confidence = self.confidence_head
        if confidence is None:
            return
        weight = confidence.proj.weight
        refit = DSparkConfidenceHead(self.config).to(device=weight.device, dtype=weight.dtype)
        kept = min(weight.shape[-1], refit.proj.in_features)
        refit.proj.weight.zero_()[:, :kept] = weight[:, :kept]
        refit.proj.bias.copy_(confidence.proj.bias)
        self.confidence_head = refit

    @classmethod
    def from_target(cls, target: PreTrainedModel, **kwargs) -> "DSparkDrafter":
        """A fresh (untrained) drafter for `target`, with the target's embedding and LM head copied in and frozen.

        Args:
            target ([`PreTrainedModel`]): a decoder-only causal LM (Llama, Qwen2, Qwen3, ...).
            kwargs: [`DSparkConfig`] keys, e.g. `block_size=7`, `num_hidden_layers=1`, `markov_rank=64`,
                `target_layer_ids=[1, 9, 17]`.
        """
        _refuse_draft_vocab_size(kwargs)
        config = cls.config_class.from_target_config(target.config, **kwargs)
        drafter = cls(config)
        target_embedding = target.get_input_embeddings().weight
        target_head = target.get_output_embeddings()
        if target_head is None:
            raise ValueError(f"{type(target).__name__} has no output embeddings (LM head); pass a *ForCausalLM model.")
        drafter.to(device=target_embedding.device, dtype=target_embedding.dtype)
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(target_embedding)
            drafter.lm_head.weight.copy_(target_head.weight)
        return drafter

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path, *model_args, target: PreTrainedModel | None = None, **kwargs
    ) -> "DSparkDrafter":
        """Loads a drafter in the official layout; refuses checkpoints whose tensors do not match the config.

        Args:
            target ([`PreTrainedModel`], *optional*): binds the target's embedding and LM head into a compact
                checkpoint saved without them (see [`DSparkDrafter.save_compact`]).
        """
        output_loading_info = kwargs.pop("output_loading_info", False)
        # transformers' load report would call the vocabulary tensors of a compact checkpoint "newly initialized";
        # they are bound from the target below, and every real mismatch raises here, so the report stays quiet.
        report_logger = logging.get_logger("transformers.modeling_utils")
        quiet = _DropLoadReport()
        report_logger.addFilter(quiet)
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
            )
        finally:
            report_logger.removeFilter(quiet)
        missing = set(map(str, info.get("missing_keys") or ()))
        if missing and missing <= set(VOCABULARY_TENSORS):
            model.bind_vocabulary(target if target is not None else _load_named_target(model.config,
                                                                                        pretrained_model_name_or_path))
            info["missing_keys"] = set()
        problems = {name: info.get(name) for name in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        problems = {name: sorted(map(str, keys)) for name, keys in problems.items() if keys}
        if problems:
            details = "; ".join(f"{name}: {keys[:8]}{' ...' if len(keys) > 8 else ''}" for name, keys in problems.items())
            raise ValueError(
                f"The checkpoint at {pretrained_model_name_or_path!r} does not match its DSpark config ({details}). "
                "Check markov_rank / markov_head_type / enable_confidence_head / num_hidden_layers in config.json "
                "against the saved tensors; the checkpoint may be truncated or written for another layout."
            )
        model.freeze_vocabulary()
        return (model, info) if output_loading_info else model

    def bind_vocabulary(self, target: PreTrainedModel) -> None:
        """Copies the target's input embedding and LM head into the drafter (they are frozen copies anyway)."""
        embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
        if tuple(embedding.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"The target's embedding has shape {tuple(embedding.shape)} but this drafter expects "
                f"{tuple(self.embed_tokens.weight.shape)}; was it built for another model?"
            )
        ids = self.draft_token_ids
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embedding)
            self.lm_head.weight.copy_(head if ids is None else head[ids.to(head.device)])

    def reduce_vocabulary(self, token_ids) -> "DSparkDrafter":
        """Restricts drafting to `token_ids` (target ids), in place; returns the drafter.

        The LM head and the Markov head's ``W2`` keep only those rows, so each drafting pass reads a fraction of the
        vocabulary-sized weights: on a CPU, where these reads dominate a small drafter, drafting gets markedly cheaper.
        Tokens outside the set are never drafted (their draft logits are -inf), which costs acceptance only when
        the target would have produced them. Output is unchanged either way: verification is the target's.
        Saved with `draft_vocab_size` and the `d2t` / `t2d` buffers of the EAGLE-3 convention, which vLLM reads.
        Pick the set with [`dspark_hf.vocabulary.select_draft_vocabulary`] (or `dspark-hf reduce-vocab`).

        Args:
            token_ids (`Sequence[int]` or `torch.LongTensor`): distinct target ids to keep.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().cpu()
        vocab = self.config.vocab_size
        if ids.numel() == 0 or ids.unique().numel() != ids.numel() or ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(
                f"token_ids must be distinct target ids in [0, vocab_size={vocab}), got {ids.numel()} ids "
                f"({ids.unique().numel()} distinct, range [{int(ids.min()) if ids.numel() else '-'}, "
                f"{int(ids.max()) if ids.numel() else '-'}])."
            )
        ids = ids.sort().values
        previous = self.draft_token_ids
        if previous is not None:  # reducing a reduced drafter: keep only ids it can still draft
            kept = torch.isin(ids, previous.cpu())
            if not bool(kept.all()):
                raise ValueError(f"{int((~kept).sum())} of token_ids are not in this drafter's draft vocabulary.")
            rows = torch.searchsorted(previous.cpu(), ids)
        else:
            rows = ids
        device = self.lm_head.weight.device
        with torch.no_grad():
            self.lm_head = _select_output_rows(self.lm_head, rows.to(device))
            if self.markov_head is not None:
                self.markov_head.markov_w2 = _select_output_rows(self.markov_head.markov_w2, rows.to(device))
        self.config.draft_vocab_size = ids.numel()
        for name in ("d2t", "t2d"):
            self._buffers.pop(name, None)
        self._register_draft_vocabulary()
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d[ids] = True
        self.to(device)
        self.freeze_vocabulary()
        return self

    def save_compact(self, save_directory, **kwargs) -> None:
        """Saves without `embed_tokens` and `lm_head` (the target's own tensors, usually most of the bytes).

        Only dspark-hf loads such a folder (`from_pretrained(path, target=target)`); the official layout, which
        `save_pretrained` and `dspark-hf push` write, always includes them for DeepSpec, vLLM and SGLang.
        """
        state_dict = {k: v for k, v in self.state_dict().items() if k not in VOCABULARY_TENSORS}
        self.save_pretrained(save_directory, state_dict=state_dict, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        target_hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        context_position_ids: torch.LongTensor | None = None,
        cache: DynamicCache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        compute_logits: bool = True,
        **kwargs,
    ) -> DSparkDrafterOutput:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch, block_len)`):
            Block inputs: the anchor then mask tokens (several blocks may be concatenated, as in training).
        target_hidden_states (`torch.Tensor` of shape `(batch, ctx, len(target_layer_ids) * hidden)`, *optional*):
            Raw outputs of the target layers `target_layer_ids` for the context positions that are new to `cache`.
        position_ids (`torch.LongTensor` of shape `(batch, block_len)`):
            Absolute positions of the block slots (the anchor's position first).
        context_position_ids (`torch.LongTensor` of shape `(batch, ctx)`, *optional*):
            Absolute positions of `target_hidden_states`.
        cache ([`DynamicCache`], *optional*):
            Context K/V of earlier calls; the new context's K/V are appended to it. The block's K/V never are.
        attention_mask (`torch.Tensor` of shape `(batch, 1, block_len, cached_ctx + ctx + block_len)`, *optional*):
            Boolean mask (True = attend) over `[context ; block]` keys. `None` means every slot sees everything.
        """
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if attention_mask is not None and attention_mask.dtype == torch.bool and \
                self.config._attn_implementation not in ("sdpa", "flex_attention"):
            # eager-style kernels add the mask to the scores
            attention_mask = torch.zeros_like(attention_mask, dtype=inputs_embeds.dtype).masked_fill(
                ~attention_mask, torch.finfo(inputs_embeds.dtype).min)
        context_key_values = self.extend_context(target_hidden_states, context_position_ids, cache)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer, layer_context in zip(self.layers, context_key_values):
            hidden_states = layer(hidden_states, position_embeddings, layer_context, attention_mask, **kwargs)
        hidden_states = self.norm(hidden_states)
        logits = self.base_logits(hidden_states) if compute_logits else None
        return DSparkDrafterOutput(last_hidden_state=hidden_states, logits=logits, cache=cache)

    def base_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``U_k`` over the target vocabulary: the (frozen, target's) LM head on final-normed states, before the
        Markov bias (-inf outside a reduced draft vocabulary). Also the target's own logits when given the target's
        last hidden states (training reads them this way)."""
        return self.to_target_vocabulary(self.draft_logits(hidden_states))

    def draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``U_k`` over the draft vocabulary (the whole vocabulary unless `draft_vocab_size` is set)."""
        return self.lm_head(hidden_states)

    def to_target_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits `(..., draft_vocab)` -> target-vocabulary logits `(..., vocab)`, -inf for the ids
        the drafter never drafts (the identity without a reduced vocabulary)."""
        ids = self.draft_token_ids
        if ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, ids.to(logits.device), logits)

    def corrected_logits(
        self, draft_logits: torch.Tensor, previous_ids: torch.LongTensor, hidden_states: torch.Tensor,
        state: torch.Tensor | None = None, target_vocabulary: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One slot's Markov-corrected logits ``U_k + bias(x_{k-1})`` over the target vocabulary (or, with
        `target_vocabulary=False`, over the draft vocabulary), in float32.

        Args:
            draft_logits (`torch.Tensor` of shape `(*batch, draft_vocab)`): the slot's [`DSparkDrafter.draft_logits`].
            previous_ids (`torch.LongTensor` of shape `(*batch)`): the token drafted just before (the anchor first).
            hidden_states (`torch.Tensor` of shape `(*batch, hidden)`): the slot's final-normed hidden state.
            state (`torch.Tensor`, *optional*): the Markov head's rnn state (`None` at a block's start).

        Returns:
            `(logits, state)`.
        """
        logits = draft_logits.float()
        if self.markov_head is not None:
            bias, state = self.markov_head(previous_ids, hidden_states, state)
            logits = logits + bias.float()
        return (self.to_target_vocabulary(logits) if target_vocabulary else logits), state

    def extend_context(
        self,
        target_hidden_states: torch.Tensor | None,
        context_position_ids: torch.LongTensor | None,
        cache: DynamicCache | None,
    ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Projects new target features once (`fc`, `hidden_norm`, per-layer `k/v_proj`, RoPE) and returns each
        layer's full context K/V (cached + new). `forward` calls it; the batched engine calls it alone to ingest the
        context of rounds that do not draft.

        Args:
            target_hidden_states (`torch.Tensor` of shape `(batch, ctx, len(target_layer_ids) * hidden)`, *optional*):
                target features of context positions new to `cache` (`None` or `ctx == 0`: nothing new).
            context_position_ids (`torch.LongTensor` of shape `(batch, ctx)`, *optional*): their absolute positions.
            cache ([`DynamicCache`], *optional*): the drafter's context K/V, extended in place.

        Returns:
            `list` with one `(keys, values)` pair of shape `(batch, kv_heads, cached_ctx + ctx, head_dim)` per draft
            layer (`None` per layer when there is no context at all).
        """
        num_layers = len(self.layers)
        if target_hidden_states is None or target_hidden_states.shape[1] == 0:
            if cache is None or cache.get_seq_length() == 0:
                return [None] * num_layers
            return [(layer.keys, layer.values) for layer in cache.layers[:num_layers]]
        context = self.hidden_norm(self.fc(target_hidden_states.to(self.fc.weight.dtype)))
        position_embeddings = self.rotary_emb(context, context_position_ids)
        new = [layer.self_attn.context_key_values(context, position_embeddings) for layer in self.layers]
        if cache is None:
            return new
        return [cache.update(keys, values, i) for i, (keys, values) in enumerate(new)]

    def confidence_logits(self, hidden_states: torch.Tensor, previous_ids: torch.LongTensor) -> torch.Tensor | None:
        """Raw (uncalibrated) confidence logits for slots with hidden states `(*batch, hidden)` whose previous token
        is `previous_ids` `(*batch,)`; `None` when the drafter has no confidence head."""
        if self.confidence_head is None:
            return None
        embedding = self.markov_head.markov_w1(previous_ids) if self.confidence_head.with_markov else None
        return self.confidence_head(hidden_states, embedding)

    def calibrated_confidence(self, confidence_logits: torch.Tensor, slot: int | torch.Tensor) -> torch.Tensor:
        """``σ(z / T_slot)`` with the Sequential Temperature Scaling temperatures of the config (1 if uncalibrated)."""
        temperatures = self.config.confidence_temperatures
        if temperatures is None:
            return torch.sigmoid(confidence_logits)
        temperature = torch.as_tensor(temperatures, device=confidence_logits.device)[slot]
        return torch.sigmoid(confidence_logits / temperature)

    def check_target(self, target: PreTrainedModel) -> None:
        """Raises `ValueError` when this drafter cannot serve `target`; warns when it looks trained for another one.

        A drafter never changes the output, but one built for another model would either crash mid-generation
        (wrong shapes) or draft garbage (wrong embeddings), so both are caught up front.
        """
        config, target_config = self.config, target.config.get_text_config()
        checks = [
            ("hidden size", config.hidden_size, target_config.hidden_size, "hidden_size"),
            ("vocabulary size", config.vocab_size, target.get_output_embeddings().weight.shape[0], "vocab_size"),
        ]
        if config.num_target_layers is not None:
            checks.append(("number of layers", config.num_target_layers, target_config.num_hidden_layers,
                           "num_target_layers"))
        for what, ours, theirs, key in checks:
            if ours != theirs:
                raise ValueError(
                    f"This drafter expects a target {what} of {ours} (config.{key}) but the target "
                    f"({type(target).__name__}) has {theirs}. Was this drafter trained for another model? "
                    "Build one with DSparkDrafter.from_target(target) or load the drafter made for this target."
                )
        if config.target_layer_ids[-1] >= target_config.num_hidden_layers - 1:
            raise ValueError(
                f"target_layer_ids={config.target_layer_ids} needs target layer {config.target_layer_ids[-1]}, but the "
                f"target has {target_config.num_hidden_layers} layers and its last one is returned final-normed; "
                f"use ids <= {target_config.num_hidden_layers - 2}."
            )
        target_embedding = target.get_input_embeddings().weight
        rows = torch.linspace(0, config.vocab_size - 1, steps=min(64, config.vocab_size)).long()
        ours = self.embed_tokens.weight[rows.to(self.embed_tokens.weight.device)].float().cpu()
        theirs = target_embedding[rows.to(target_embedding.device)].float().cpu()
        if not torch.allclose(ours, theirs, rtol=1e-2, atol=1e-3):
            logger.warning_once(
                "The drafter's embedding table differs from the target's: it was probably trained for another model. "
                "Output stays identical to the target's, but few drafts will be accepted."
            )


def _load_named_target(config: DSparkConfig, checkpoint) -> PreTrainedModel:
    """The target a compact checkpoint names in `target_name_or_path` (embedded names resolve offline)."""
    name = config.target_name_or_path
    if not name:
        raise ValueError(
            f"{str(checkpoint)!r} is a compact drafter (saved without {list(VOCABULARY_TENSORS)}) that does not name "
            "its target; pass it: DSparkDrafter.from_pretrained(path, target=target) (on the command line: --target)."
        )
    from transformers import AutoModelForCausalLM

    from .models import resolve_target_path

    logger.info(f"Binding the vocabulary of {name} into the compact drafter {checkpoint}.")
    return AutoModelForCausalLM.from_pretrained(resolve_target_path(name), dtype=torch.float32)


def _refuse_draft_vocab_size(kwargs: dict) -> None:
    if kwargs.get("draft_vocab_size") is not None:
        raise ValueError(
            "from_target builds a drafter over the whole vocabulary (training needs it); reduce a trained drafter "
            "afterwards with drafter.reduce_vocabulary(token_ids) or `dspark-hf reduce-vocab`."
        )


def _select_output_rows(linear: nn.Linear, rows: torch.LongTensor) -> nn.Linear:
    """A bias-free `nn.Linear` with only output rows `rows` of `linear`."""
    selected = nn.Linear(linear.in_features, rows.numel(), bias=False, device=linear.weight.device,
                         dtype=linear.weight.dtype)
    selected.weight.copy_(linear.weight[rows])
    selected.weight.requires_grad_(linear.weight.requires_grad)
    return selected


__all__ = [
    "DSparkDrafter",
    "DSparkLayers",
    "DSparkPreTrainedModel",
    "DSparkDrafterOutput",
    "DSparkMarkovHead",
    "DSparkConfidenceHead",
]
