"""The shared drafting loop (`dspark_hf.generation.drafting`) on a stand-in drafter: no model, no target."""

from __future__ import annotations

import torch

from conftest import CHAIN_VOCAB, drafts_for
from dspark_hf.generation.drafting import SlotSchedule, block_inputs, verify
from dspark_hf.generation.verification_policy import FixedLengthPolicy, ThresholdPolicy, VerificationPolicy


VOCAB = CHAIN_VOCAB


def test_rows_stop_at_their_budget_or_first_no_and_the_block_at_the_last_row():
    block = drafts_for([[0.75, 0.25, 0.75, 0.75], [0.75] * 4], [4, 2], ThresholdPolicy(0.5))
    # row 0 stops at c_2 < 0.5 and does not resume at c_3; row 1 at its budget of 2
    assert block.lengths == [1, 2]
    assert block.ids.tolist() == [[4, 5], [8, 9]]  # sampled while a row still verifies, along each row's chain
    assert block.logits.shape == (2, 2, VOCAB)
    assert block.confidences == [[0.75, 0.25, 0.75], [0.75] * 3]  # c_3 is read to decide slot 2, then it ends
    assert block.observed  # a policy that does not plan from whole rounds is always settled


def test_an_unsettled_rule_samples_unverified_slots_and_num_slots_bounds_them():
    class Observing(VerificationPolicy):
        def settled(self, confidences):
            return len(confidences[0]) == 3

    assert drafts_for([[0.5] * 4], [4], FixedLengthPolicy(1)).ids.shape == (1, 1)
    block = drafts_for([[0.5] * 4], [1], Observing())
    assert block.lengths == [1] and block.ids.tolist() == [[4, 5]]  # slot 1 sampled to read c_3, not verified
    assert drafts_for([[0.5] * 4], [4], num_slots=2).lengths == [2]


def test_no_budget_samples_nothing():
    block = drafts_for([[0.5] * 3], [0])
    assert block.ids.shape == (1, 0) and block.lengths == [0] and block.logits.shape[:2] == (1, 0)


def test_the_processor_sees_the_drafts_so_far():
    seen = []

    def process(drafts, logits):
        seen.append(drafts.tolist())
        return logits

    drafts_for([[0.5] * 3], [3], process=process)
    assert seen == [[[]], [[4]], [[4, 5]]]


def test_slot_schedule_asks_the_rule_only_for_rows_still_verifying():
    asked = []

    class Recording(VerificationPolicy):
        def verified(self, slot, confidences, candidates):
            asked.append(candidates)
            return [candidate and slot == 0 for candidate in candidates]

    schedule = SlotSchedule(Recording(), [3, 0])
    assert schedule.admit(0, [[], []]) and not schedule.admit(1, [[], []]) and not schedule.admit(2, [[], []])
    assert asked == [[True, False]] * 2  # never row 1 (no budget), nor row 0 once it said no
    assert schedule.lengths == [1, 0] and schedule.num_sampled == 1


def test_block_inputs():
    ids, positions = block_inputs(torch.tensor([5, 6]), torch.tensor([10, 3]), 3, 99)
    assert ids.tolist() == [[5, 99, 99], [6, 99, 99]] and positions.tolist() == [[10, 11, 12], [3, 4, 5]]


def test_greedy_verify_accepts_the_matching_prefix_and_adds_the_targets_next_token():
    target_logits = torch.nn.functional.one_hot(torch.tensor([4, 5, 1]), VOCAB).float()
    assert verify([4, 5], None, target_logits, None, False) == (2, 1)
    assert verify([4, 6], None, target_logits, None, False) == (1, 5)
    assert verify([], None, target_logits[:1], None, False) == (0, 4)
