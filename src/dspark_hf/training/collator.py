"""Batches of training sequences: truncation, right padding, anchor sampling and block construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .blocks import build_blocks, pad_anchors, sample_anchors


@dataclass
class DSparkDataCollator:
    """Turns examples ``{"input_ids": [...], "loss_mask": [...]}`` into a training batch.

    The batch holds the right-padded `input_ids`, `attention_mask` and `loss_mask` `(batch, seq)`, and the blocks of
    [`DSparkBlocks`] under `block_*` keys, with up to `num_anchors` anchors per sequence drawn afresh each time.

    Args:
        block_size (`int`): the drafter's `block_size`.
        mask_token_id (`int`): the drafter's `mask_token_id`.
        num_anchors (`int`): the most blocks per sequence (DeepSpec: 512; a few dozen keep CPU steps short).
        pad_token_id (`int`): filler for padded positions (never attended to, never supervised).
        max_length (`int`, *optional*): sequences are truncated to this many tokens.
        generator (`torch.Generator`, *optional*): random source of the anchors (default: torch's global RNG, which
            the Trainer seeds).
    """

    block_size: int
    mask_token_id: int
    num_anchors: int = 512
    pad_token_id: int = 0
    max_length: int | None = None
    generator: torch.Generator | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        sequences = [self._as_tensor(example["input_ids"]) for example in examples]
        masks = [self._as_tensor(example["loss_mask"]) for example in examples]
        for sequence, mask in zip(sequences, masks):
            if sequence.shape != mask.shape:
                raise ValueError(
                    f"An example has {sequence.numel()} input_ids but {mask.numel()} loss_mask values; "
                    "they must align token for token."
                )
        seq_len = max(len(sequence) for sequence in sequences)
        input_ids = torch.full((len(examples), seq_len), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        loss_mask = torch.zeros_like(input_ids)
        for row, (sequence, mask) in enumerate(zip(sequences, masks)):
            input_ids[row, : len(sequence)] = sequence
            attention_mask[row, : len(sequence)] = 1
            loss_mask[row, : len(sequence)] = mask
        anchors, keep = pad_anchors([sample_anchors(mask, self.num_anchors, self.generator) for mask in loss_mask])
        blocks = build_blocks(input_ids, loss_mask, anchors, keep, self.block_size, self.mask_token_id)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask, **blocks.to_dict()}

    def _as_tensor(self, values) -> torch.Tensor:
        tensor = torch.as_tensor(values, dtype=torch.long)
        return tensor[: self.max_length] if self.max_length else tensor
