"""Anchor sampling, block inputs/labels/supervision and the block attention mask, checked by hand."""

import pytest
import torch

from dspark_hf.training.blocks import (
    IGNORE_INDEX,
    block_attention_mask,
    build_blocks,
    eligible_anchors,
    pad_anchors,
    sample_anchors,
)
from dspark_hf.training.collator import DSparkDataCollator


LOSS_MASK = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1])  # S = 8


def test_eligible_anchors_need_two_consecutive_loss_tokens():
    # (2,3) (3,4) (6,7) qualify; 4 is followed by a 0; 7 is the last position (p <= S - 2)
    assert eligible_anchors(LOSS_MASK).tolist() == [2, 3, 6]
    assert eligible_anchors(torch.tensor([1, 0, 1, 0])).tolist() == []
    assert eligible_anchors(torch.tensor([1, 1, 1, 1])).tolist() == [0, 1, 2]


def test_sample_anchors_keeps_all_when_few_and_draws_sorted_unique_subsets():
    assert sample_anchors(LOSS_MASK, 10).tolist() == [2, 3, 6]
    generator = torch.Generator().manual_seed(0)
    eligible = set(eligible_anchors(torch.ones(40)).tolist())
    for _ in range(20):
        drawn = sample_anchors(torch.ones(40), 5, generator).tolist()
        assert len(drawn) == 5 and drawn == sorted(set(drawn)) and set(drawn) <= eligible
    with pytest.raises(ValueError, match="num_anchors"):
        sample_anchors(LOSS_MASK, 0)


def test_sample_anchors_is_uniform():
    generator = torch.Generator().manual_seed(1)
    counts = torch.zeros(8)
    draws = 4000
    for _ in range(draws):
        counts[sample_anchors(torch.ones(9), 2, generator)] += 1
    # each of the 8 eligible positions is drawn with probability 2/8
    expected = draws * 2 / 8
    assert torch.all((counts - expected).abs() < 5 * (expected * 0.75) ** 0.5), counts


def test_build_blocks_by_hand():
    input_ids = torch.arange(10, 18)[None]  # x_j = 10 + j
    anchors, keep = pad_anchors([torch.tensor([3, 6])])
    blocks = build_blocks(input_ids, LOSS_MASK[None], anchors, keep, block_size=3, mask_token_id=99)
    assert blocks.input_ids.tolist() == [[13, 99, 99, 16, 99, 99]]
    assert blocks.position_ids.tolist() == [[3, 4, 5, 6, 7, 8]]
    # p=3: labels x4 x5 x6 but loss_mask[5] = 0 ends the prefix (x6 is not supervised though its mask is 1)
    # p=6: label x7, then position 8 is past the sequence
    assert blocks.supervised.tolist() == [[[True, False, False], [True, False, False]]]
    assert blocks.labels.tolist() == [[[14, IGNORE_INDEX, IGNORE_INDEX], [17, IGNORE_INDEX, IGNORE_INDEX]]]
    assert blocks.previous_ids[0, 0].tolist() == [13, 14, 15]
    assert blocks.previous_ids[0, 1, :2].tolist() == [16, 17]


def test_build_blocks_full_prefix_and_dropped_blocks():
    input_ids = torch.arange(20, 30)[None]
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1, 0]])
    anchors, keep = pad_anchors([torch.tensor([2])])
    anchors, keep = torch.cat([anchors, torch.zeros(1, 1, dtype=torch.long)], 1), torch.tensor([[True, False]])
    blocks = build_blocks(input_ids, loss_mask, anchors, keep, block_size=4, mask_token_id=0)
    assert blocks.supervised[0, 0].tolist() == [True] * 4
    assert blocks.labels[0, 0].tolist() == [23, 24, 25, 26]
    assert blocks.previous_ids[0, 0].tolist() == [22, 23, 24, 25]  # teacher forcing: x_p .. x_{p+B-1}
    assert not blocks.supervised[0, 1].any()


def test_pad_anchors_marks_spare_blocks():
    anchors, keep = pad_anchors([torch.tensor([1, 4, 5]), torch.tensor([2]), torch.tensor([], dtype=torch.long)])
    assert anchors.tolist() == [[1, 4, 5], [2, 0, 0], [0, 0, 0]]
    assert keep.tolist() == [[True, True, True], [True, False, False], [False, False, False]]


def test_block_attention_mask_by_hand():
    T, F = True, False
    mask = block_attention_mask(torch.tensor([[2, 4]]), torch.tensor([[True, True]]), seq_len=5, block_size=2)
    assert mask.shape == (1, 1, 4, 5 + 4)
    assert mask[0, 0].tolist() == [
        # context j < p          own block only
        [T, T, F, F, F, T, T, F, F],
        [T, T, F, F, F, T, T, F, F],
        [T, T, T, T, F, F, F, T, T],
        [T, T, T, T, F, F, F, T, T],
    ]


def test_block_attention_mask_anchor_zero_and_dropped_block_see_only_their_block():
    T, F = True, False
    mask = block_attention_mask(torch.tensor([[0, 3]]), torch.tensor([[True, False]]), seq_len=4, block_size=1)
    assert mask[0, 0].tolist() == [[F, F, F, F, T, F], [F, F, F, F, F, T]]


def test_collator_pads_truncates_and_builds_blocks():
    collator = DSparkDataCollator(block_size=3, mask_token_id=1, num_anchors=2, pad_token_id=0, max_length=7,
                                  generator=torch.Generator().manual_seed(0))
    examples = [
        {"input_ids": [5, 6, 7, 8, 9, 10, 11, 12], "loss_mask": [0, 0, 1, 1, 1, 1, 1, 1]},
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]},
    ]
    batch = collator(examples)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 7, [1, 1, 1, 1, 0, 0, 0]]
    assert batch["loss_mask"][1].tolist() == [0, 1, 1, 1, 0, 0, 0]
    assert batch["block_anchors"].shape == (2, 2) and batch["block_keep"].all()
    assert batch["block_input_ids"].shape == batch["block_position_ids"].shape == (2, 6)
    # padding never supervises: the second sequence ends at 4 tokens
    for row, anchor in enumerate(batch["block_anchors"][1].tolist()):
        supervised = batch["block_supervised"][1, row]
        assert all(anchor + k + 1 < 4 for k in range(3) if supervised[k])
    with pytest.raises(ValueError, match="loss_mask"):
        collator([{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}])
