"""Training blocks (docs/design.md, "Training"): anchor sampling, block inputs and labels, and the block attention mask.

A training sequence ``x_0..x_{S-1}`` with a `loss_mask` becomes up to `num_anchors` blocks. The block at anchor ``p``
feeds ``[x_p, M, ..., M]`` (``M`` = `mask_token_id`) at positions ``p..p+B-1`` and predicts ``x_{p+1}..x_{p+B}``,
seeing the target's features of the positions strictly before ``p``: exactly what the drafter sees at inference
when ``x_p`` is the freshly committed anchor. All blocks of a sequence run in one drafter forward, concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


IGNORE_INDEX = -100


def eligible_anchors(loss_mask: torch.Tensor) -> torch.LongTensor:
    """Positions that may anchor a block: ``p <= S - 2`` with ``loss_mask[p] = loss_mask[p + 1] = 1``.

    Args:
        loss_mask (`torch.Tensor` of shape `(seq,)`): 1 on assistant-response tokens.

    Returns:
        `torch.LongTensor` of shape `(num_eligible,)`, increasing.
    """
    mask = loss_mask.bool()
    return torch.nonzero(mask[:-1] & mask[1:], as_tuple=False).flatten()


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> torch.LongTensor:
    """Up to `num_anchors` eligible positions drawn uniformly without replacement, then sorted.

    Args:
        loss_mask (`torch.Tensor` of shape `(seq,)`): 1 on assistant-response tokens.
        num_anchors (`int`): the most anchors to draw; all eligible positions are kept when there are fewer.
        generator (`torch.Generator`, *optional*): the random source (CPU).

    Returns:
        `torch.LongTensor` of shape `(min(num_anchors, num_eligible),)`, increasing.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}.")
    candidates = eligible_anchors(loss_mask.cpu())
    if candidates.numel() > num_anchors:
        chosen = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
        candidates = candidates[chosen].sort().values
    return candidates


@dataclass
class DSparkBlocks:
    """The blocks of a batch of sequences, `n` blocks of `B` slots per sequence.

    Attributes:
        input_ids (`torch.LongTensor` of shape `(batch, n * B)`): ``[x_p, M × (B-1)]`` per block, blocks concatenated.
        position_ids (`torch.LongTensor` of shape `(batch, n * B)`): ``p..p+B-1`` per block.
        labels (`torch.LongTensor` of shape `(batch, n, B)`): ``x_{p+1+k}``, `IGNORE_INDEX` where not supervised.
        previous_ids (`torch.LongTensor` of shape `(batch, n, B)`): teacher-forced previous tokens ``x_{p+k}`` for the
            Markov and confidence heads.
        supervised (`torch.BoolTensor` of shape `(batch, n, B)`): slots that enter the loss (a contiguous prefix).
        anchors (`torch.LongTensor` of shape `(batch, n)`): anchor positions ``p`` (0 for dropped blocks).
        keep (`torch.BoolTensor` of shape `(batch, n)`): False for the spare blocks of sequences with fewer anchors.
    """

    input_ids: torch.LongTensor
    position_ids: torch.LongTensor
    labels: torch.LongTensor
    previous_ids: torch.LongTensor
    supervised: torch.BoolTensor
    anchors: torch.LongTensor
    keep: torch.BoolTensor

    def to_dict(self, prefix: str = "block_") -> dict[str, torch.Tensor]:
        return {prefix + name: value for name, value in vars(self).items()}

    @classmethod
    def from_dict(cls, batch: dict[str, torch.Tensor], prefix: str = "block_") -> "DSparkBlocks":
        return cls(**{name: batch[prefix + name] for name in cls.__dataclass_fields__})


def pad_anchors(anchor_lists: list[torch.LongTensor]) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Stacks per-sequence anchors into `(batch, n)` anchors and a `keep` mask, `n` = the longest list (>= 1)."""
    num_blocks = max([1] + [len(a) for a in anchor_lists])
    anchors = torch.zeros(len(anchor_lists), num_blocks, dtype=torch.long)
    keep = torch.zeros(len(anchor_lists), num_blocks, dtype=torch.bool)
    for row, positions in enumerate(anchor_lists):
        anchors[row, : len(positions)] = positions
        keep[row, : len(positions)] = True
    return anchors, keep


def build_blocks(
    input_ids: torch.LongTensor,
    loss_mask: torch.Tensor,
    anchors: torch.LongTensor,
    keep: torch.BoolTensor,
    block_size: int,
    mask_token_id: int,
) -> DSparkBlocks:
    """Block inputs, positions, labels and supervision for anchors of a (right-padded) batch.

    Slot ``k`` of the block at anchor ``p`` is supervised while ``p + k + 1 < S``, ``loss_mask[p + k + 1] = 1`` and
    every earlier slot of the block is supervised, and only if the block is kept.

    Args:
        input_ids (`torch.LongTensor` of shape `(batch, seq)`): the sequences.
        loss_mask (`torch.Tensor` of shape `(batch, seq)`): 1 on assistant-response tokens (0 on padding).
        anchors (`torch.LongTensor` of shape `(batch, n)`), keep (`torch.BoolTensor` of shape `(batch, n)`): from
            [`pad_anchors`].
        block_size (`int`): `B`.
        mask_token_id (`int`): the id fed to slots 1..B-1.
    """
    batch, seq_len = input_ids.shape
    offsets = torch.arange(block_size, device=input_ids.device)
    positions = anchors[..., None] + offsets  # (batch, n, B): position of slot k = index of its previous token
    label_index = positions + 1
    in_range = label_index < seq_len
    gather_rows = torch.arange(batch, device=input_ids.device)[:, None, None]
    labels = input_ids[gather_rows, label_index.clamp(max=seq_len - 1)]
    supervised = in_range & loss_mask.bool()[gather_rows, label_index.clamp(max=seq_len - 1)] & keep[..., None]
    supervised = supervised.long().cumprod(dim=-1).bool()  # contiguous prefix
    previous_ids = input_ids[gather_rows, positions.clamp(max=seq_len - 1)]

    block_inputs = torch.full_like(positions, mask_token_id)
    block_inputs[..., 0] = input_ids.gather(1, anchors)
    return DSparkBlocks(
        input_ids=block_inputs.flatten(1),
        position_ids=positions.flatten(1),
        labels=labels.masked_fill(~supervised, IGNORE_INDEX),
        previous_ids=previous_ids,
        supervised=supervised,
        anchors=anchors,
        keep=keep,
    )


def block_attention_mask(
    anchors: torch.LongTensor, keep: torch.BoolTensor, seq_len: int, block_size: int
) -> torch.Tensor:
    """Boolean attention mask (True = attend) of the block queries over ``[context (S) ; blocks (n * B)]`` keys.

    A query of the block at anchor ``p`` sees context key ``j`` iff ``j < p`` (the target has not processed the
    anchor yet at inference), and every key of its own block (bidirectional, as at inference). Dropped blocks see
    only their own block: they carry no loss, and a fully masked row would turn into NaNs in SDPA.

    Args:
        anchors (`torch.LongTensor` of shape `(batch, n)`), keep (`torch.BoolTensor` of shape `(batch, n)`).
        seq_len (`int`): `S`, the number of context positions.
        block_size (`int`): `B`.

    Returns:
        `torch.BoolTensor` of shape `(batch, 1, n * B, S + n * B)`.
    """
    batch, num_blocks = anchors.shape
    device = anchors.device
    context = torch.arange(seq_len, device=device) < anchors[..., None]  # (batch, n, S)
    context = (context & keep[..., None]).repeat_interleave(block_size, dim=1)  # (batch, n*B, S)
    block_of = torch.arange(num_blocks * block_size, device=device) // block_size
    own_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)  # (batch, n*B, n*B)
    return torch.cat([context, own_block], dim=-1)[:, None]
