"""One training step's DSpark objective: the drafter on all blocks of a batch at once, then the loss of section 4.

Logits over the full vocabulary are the expensive part on small machines, so every vocabulary-sized tensor (draft
logits, Markov bias, target logits) is computed for the supervised slots only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..modeling_dspark import DSparkDrafter
from .blocks import DSparkBlocks, block_attention_mask
from .features import TargetSignals
from .losses import (
    DEFAULT_CE_WEIGHT,
    DEFAULT_CONFIDENCE_WEIGHT,
    DEFAULT_LOSS_DECAY,
    DEFAULT_TV_WEIGHT,
    DSparkLossOutput,
    dspark_loss,
    slot_weights,
)


@dataclass
class DSparkLossConfig:
    """Weights of the loss terms and the slot decay (DeepSpec's values by default)."""

    ce_weight: float = DEFAULT_CE_WEIGHT
    tv_weight: float = DEFAULT_TV_WEIGHT
    confidence_weight: float = DEFAULT_CONFIDENCE_WEIGHT
    loss_decay: float = DEFAULT_LOSS_DECAY


def drafter_block_states(
    forward: Callable, blocks: DSparkBlocks, context_features: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Final-normed drafter states of every block slot, `(batch, n, B, hidden)`.

    Args:
        forward (`Callable`): the drafter's forward (the drafter itself, or its DDP / PEFT wrapper).
        blocks ([`DSparkBlocks`]): the batch's blocks.
        context_features (`torch.Tensor` of shape `(batch, seq, m * hidden)`): the target features of every position.
        block_size (`int`): `B`.
    """
    batch, seq_len = context_features.shape[:2]
    num_blocks = blocks.anchors.shape[1]
    context_positions = torch.arange(seq_len, device=context_features.device).expand(batch, -1)
    output = forward(
        input_ids=blocks.input_ids,
        target_hidden_states=context_features,
        position_ids=blocks.position_ids,
        context_position_ids=context_positions,
        attention_mask=block_attention_mask(blocks.anchors, blocks.keep, seq_len, block_size),
        compute_logits=False,
    )
    return output.last_hidden_state.view(batch, num_blocks, block_size, -1)


def corrected_draft_logits(
    drafter: DSparkDrafter, states: torch.Tensor, previous_ids: torch.LongTensor, supervised: torch.BoolTensor
) -> torch.Tensor:
    """``z = U(h) + bias(previous token)`` (``U = lm_head``, soft-capped for Gemma) at the supervised slots,
    `(N, vocab)` fp32 (teacher forced).

    Args:
        states (`torch.Tensor` of shape `(batch, n, B, hidden)`), previous_ids (`torch.LongTensor` of shape
            `(batch, n, B)`), supervised (`torch.BoolTensor` of shape `(batch, n, B)`).
    """
    head = drafter.markov_head
    if head is not None and head.head_type == "rnn":  # the state runs through every slot of a block
        bias = head.teacher_forced(previous_ids, states)[supervised]
        return drafter.base_logits(states[supervised]).float() + bias.float()
    hidden = states[supervised]
    return drafter.corrected_logits(drafter.draft_logits(hidden), previous_ids[supervised], hidden)[0]


def supervised_target_logits(
    drafter: DSparkDrafter, last_hidden_state: torch.Tensor, blocks: DSparkBlocks, block_size: int
) -> torch.Tensor:
    """The target's logits for the supervised slots, ``lm_head(last_hidden_state[p + k])``, `(N, vocab)` fp32.

    Slot ``k`` of the block at anchor ``p`` predicts ``x_{p+k+1}``, which the target predicts from position ``p + k``.
    The drafter's frozen `lm_head` is the target's own head (soft-capped as the target caps it, for Gemma).
    """
    positions = blocks.anchors[..., None] + torch.arange(block_size, device=blocks.anchors.device)
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None, None]
    states = last_hidden_state[rows.expand_as(positions)[blocks.supervised], positions[blocks.supervised]]
    with torch.no_grad():
        return drafter.base_logits(states.to(drafter.lm_head.weight.dtype)).float()


def compute_dspark_loss(
    drafter: DSparkDrafter,
    blocks: DSparkBlocks,
    signals: TargetSignals,
    loss_config: DSparkLossConfig | None = None,
    forward: Callable | None = None,
    denominator: torch.Tensor | float | None = None,
) -> DSparkLossOutput:
    """The DSpark loss of a batch (docs/design.md, "Training").

    Args:
        drafter ([`DSparkDrafter`]): the drafter (its heads are called directly).
        blocks ([`DSparkBlocks`]): from [`build_blocks`] (e.g. via [`DSparkDataCollator`]).
        signals ([`TargetSignals`]): the target's features and last hidden state for the batch.
        loss_config ([`DSparkLossConfig`], *optional*).
        forward (`Callable`, *optional*): what runs the drafter's forward; pass the DDP/PEFT wrapper when training.
        denominator (*optional*): see [`dspark_loss`].
    """
    if drafter.config.draft_vocab_size is not None:
        raise ValueError(
            f"This drafter drafts over a reduced vocabulary (draft_vocab_size={drafter.config.draft_vocab_size}); the "
            "DSpark loss compares it with the target over the whole vocabulary. Train (or fine-tune) the "
            "full-vocabulary drafter, then reduce it with drafter.reduce_vocabulary(...) or `dspark-hf reduce-vocab`."
        )
    loss_config = loss_config or DSparkLossConfig()
    block_size = drafter.config.block_size
    states = drafter_block_states(forward or drafter, blocks, signals.context_features, block_size)
    supervised = blocks.supervised
    draft_logits = corrected_draft_logits(drafter, states, blocks.previous_ids, supervised)
    target_logits = supervised_target_logits(drafter, signals.last_hidden_state, blocks, block_size)
    confidence = drafter.confidence_logits(states[supervised], blocks.previous_ids[supervised])
    return dspark_loss(
        draft_logits,
        target_logits,
        blocks.labels[supervised],
        slot_weights(supervised, loss_config.loss_decay)[supervised],
        confidence,
        ce_weight=loss_config.ce_weight,
        tv_weight=loss_config.tv_weight,
        confidence_weight=loss_config.confidence_weight,
        denominator=denominator,
    )
