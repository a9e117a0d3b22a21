"""One training step's DSpark objective: the drafter on all blocks of a batch at once, then the loss of section 4.

Vocabulary-sized heads are the expensive part on small machines, so each is computed only where the loss reads it:
the draft logits and Markov bias at the supervised slots, over the draft vocabulary; the target's head once per
supervised position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..modeling_dspark import DSparkDrafter
from ..modeling_dspark_gemma4 import softcap_logits
from .blocks import IGNORE_INDEX, DSparkBlocks, block_attention_mask
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
    """``z = U(h) + bias(previous token)`` (``U = lm_head``, soft-capped for Gemma) at the supervised slots, over the
    draft vocabulary (the whole vocabulary unless the drafter has a reduced one), `(N, draft_vocab)` fp32 (teacher
    forced).

    Args:
        states (`torch.Tensor` of shape `(batch, n, B, hidden)`), previous_ids (`torch.LongTensor` of shape
            `(batch, n, B)`), supervised (`torch.BoolTensor` of shape `(batch, n, B)`).
    """
    hidden = states[supervised]
    logits = drafter.draft_logits(hidden).float()
    head = drafter.markov_head
    if head is None:
        return logits
    if head.head_type == "rnn":  # the state runs through every slot of a block
        bias = head.teacher_forced(previous_ids, states)[supervised]
    else:
        bias = head(previous_ids[supervised], hidden)[0]
    return logits + bias.float()


@dataclass
class SupervisedTargets:
    """What the target says at the supervised slots, `N` of them.

    Attributes:
        logits (`torch.Tensor` of shape `(N, vocab)`): the target's logits, fp32; over a reduced draft vocabulary,
            its log-probabilities (normalized over the whole vocabulary) at the draft ids, `(N, draft_vocab)`.
        outside_mass (`torch.Tensor` of shape `(N,)`, *optional*): over a reduced draft vocabulary, the target's
            probability of the ids outside it.
        labels (`torch.LongTensor` of shape `(N,)`): the next tokens, as draft ids (-100 outside the draft vocabulary).
    """

    logits: torch.Tensor
    outside_mass: torch.Tensor | None
    labels: torch.LongTensor


@torch.no_grad()
def supervised_targets(
    drafter: DSparkDrafter,
    last_hidden_state: torch.Tensor,
    blocks: DSparkBlocks,
    target_lm_head: torch.Tensor | None = None,
) -> SupervisedTargets:
    """The target's distribution at every supervised slot, from its final hidden states.

    Slot ``k`` of the block at anchor ``p`` predicts ``x_{p+k+1}``, which the target predicts from position ``p + k``.
    Neighbouring blocks overlap (slot ``k`` at ``p`` and slot ``k - 1`` at ``p + 1`` read the same position), so each
    position's vocabulary-sized head runs once and slots gather from it. A full-vocabulary drafter's frozen `lm_head`
    is the target's own; a reduced one keeps only the draft rows, so `target_lm_head` (the target's output weight,
    `(vocab, hidden)`) is needed for the mass outside the draft vocabulary.
    """
    draft_ids = drafter.draft_token_ids
    if draft_ids is not None and target_lm_head is None:
        raise ValueError(
            "This drafter drafts over a reduced vocabulary and keeps only those rows of the LM head; pass the "
            "target's output weight as target_lm_head (target.get_output_embeddings().weight)."
        )
    block_size = drafter.config.block_size
    batch, seq_len = last_hidden_state.shape[:2]
    positions = blocks.anchors[..., None] + torch.arange(block_size, device=blocks.anchors.device)
    rows = torch.arange(batch, device=positions.device)[:, None, None].expand_as(positions)
    flat = (rows * seq_len + positions)[blocks.supervised]
    unique, slot_index = torch.unique(flat, return_inverse=True)
    states = last_hidden_state.flatten(0, 1)[unique]
    labels = blocks.labels[blocks.supervised]
    if draft_ids is None:
        logits = drafter.base_logits(states.to(drafter.lm_head.weight.dtype)).float()
        return SupervisedTargets(logits[slot_index], None, labels)
    logits = torch.nn.functional.linear(states.to(target_lm_head.dtype), target_lm_head).float()
    # Gemma caps its logits; the drafter's frozen head does the same
    logits = softcap_logits(logits, getattr(drafter.config, "final_logit_softcapping", None))
    log_probs = logits.log_softmax(dim=-1)
    outside = log_probs.masked_fill(drafter.t2d, float("-inf")).logsumexp(dim=-1).exp()
    to_draft = torch.full((drafter.config.vocab_size,), IGNORE_INDEX, dtype=torch.long, device=labels.device)
    to_draft[draft_ids] = torch.arange(draft_ids.numel(), device=labels.device)
    return SupervisedTargets(log_probs[:, draft_ids][slot_index], outside[slot_index], to_draft[labels])


def compute_dspark_loss(
    drafter: DSparkDrafter,
    blocks: DSparkBlocks,
    signals: TargetSignals,
    loss_config: DSparkLossConfig | None = None,
    forward: Callable | None = None,
    denominator: torch.Tensor | float | None = None,
    target_lm_head: torch.Tensor | None = None,
) -> DSparkLossOutput:
    """The DSpark loss of a batch (docs/design.md, "Training"), over the drafter's draft vocabulary.

    Args:
        drafter ([`DSparkDrafter`]): the drafter (its heads are called directly).
        blocks ([`DSparkBlocks`]): from [`build_blocks`] (e.g. via [`DSparkDataCollator`]).
        signals ([`TargetSignals`]): the target's features and last hidden state for the batch.
        loss_config ([`DSparkLossConfig`], *optional*).
        forward (`Callable`, *optional*): what runs the drafter's forward; pass the DDP/PEFT wrapper when training.
        denominator (*optional*): see [`dspark_loss`].
        target_lm_head (`torch.Tensor` of shape `(vocab, hidden)`, *optional*): the target's output weight; needed
            when the drafter has a reduced draft vocabulary (see [`supervised_targets`]).
    """
    loss_config = loss_config or DSparkLossConfig()
    block_size = drafter.config.block_size
    states = drafter_block_states(forward or drafter, blocks, signals.context_features, block_size)
    supervised = blocks.supervised
    draft_logits = corrected_draft_logits(drafter, states, blocks.previous_ids, supervised)
    targets = supervised_targets(drafter, signals.last_hidden_state, blocks, target_lm_head)
    confidence = drafter.confidence_logits(states[supervised], blocks.previous_ids[supervised])
    return dspark_loss(
        draft_logits,
        targets.logits,
        targets.labels,
        slot_weights(supervised, loss_config.loss_decay)[supervised],
        confidence,
        ce_weight=loss_config.ce_weight,
        tv_weight=loss_config.tv_weight,
        confidence_weight=loss_config.confidence_weight,
        denominator=denominator,
        target_outside_mass=targets.outside_mass,
    )
