"""The DSpark loss terms against values computed by hand (spec section 4)."""

import math

import pytest
import torch

from dspark_hf.training.losses import (
    confidence_targets,
    dspark_loss,
    slot_weights,
    total_variation_l1,
)


LN3 = math.log(3.0)


def test_slot_weights_decay_by_a_fixed_four_with_zero_based_slots():
    weights = slot_weights(torch.tensor([[True, True, True, False], [True, False, False, False]]))
    expected = torch.tensor([[1.0, math.exp(-0.25), math.exp(-0.5), 0.0], [1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(weights, expected)
    assert slot_weights(torch.ones(1, 3), decay=2.0)[0, 2].item() == pytest.approx(math.exp(-1.0))


def test_total_variation_is_the_full_l1_norm():
    # softmax([0, 0]) = (.5, .5); softmax([ln 3, 0]) = (.75, .25): |.5-.75| + |.5-.25| = 0.5
    tv = total_variation_l1(torch.tensor([[0.0, 0.0]]), torch.tensor([[LN3, 0.0]]))
    assert tv.item() == pytest.approx(0.5, abs=1e-6)
    # disjoint one-hots: 2, not 1 (not halved)
    disjoint = total_variation_l1(torch.tensor([[100.0, 0.0]]), torch.tensor([[0.0, 100.0]]))
    assert disjoint.item() == pytest.approx(2.0, abs=1e-6)


def test_confidence_target_is_the_acceptance_probability_clamped_and_detached():
    tv = torch.tensor([0.0, 0.5, 2.0, 2.5], requires_grad=True)
    targets = confidence_targets(tv)
    torch.testing.assert_close(targets, torch.tensor([1.0, 0.75, 0.0, 0.0]))
    assert not targets.requires_grad


def _two_rows():
    """Row A: pd = (.5, .5), pt = (.75, .25), label 0, slot 0, confidence logit 0.
    Row B: pd = pt = (.75, .25), label 1, slot 1, confidence logit ln 3 (σ = .75)."""
    draft = torch.tensor([[0.0, 0.0], [LN3, 0.0]], requires_grad=True)
    target = torch.tensor([[LN3, 0.0], [LN3, 0.0]])
    labels = torch.tensor([0, 1])
    weights = torch.tensor([1.0, math.exp(-0.25)])
    confidence = torch.tensor([0.0, LN3], requires_grad=True)
    return draft, target, labels, weights, confidence


def test_dspark_loss_matches_hand_computation():
    draft, target, labels, weights, confidence = _two_rows()
    out = dspark_loss(draft, target, labels, weights, confidence)

    w_b = math.exp(-0.25)
    total = 1.0 + w_b + 1e-6
    ce = (math.log(2.0) + w_b * -math.log(0.25)) / total
    tv = (0.5 + w_b * 0.0) / total
    # BCE(logit 0, target .75) = ln 2; BCE(logit ln 3, target 1) = -ln .75
    conf = (math.log(2.0) + w_b * -math.log(0.75)) / total
    assert out.ce.item() == pytest.approx(ce, rel=1e-5)
    assert out.tv.item() == pytest.approx(tv, rel=1e-5)
    assert out.confidence.item() == pytest.approx(conf, rel=1e-5)
    assert out.loss.item() == pytest.approx(0.1 * ce + 0.9 * tv + 1.0 * conf, rel=1e-5)
    assert out.weight_sum.item() == pytest.approx(1.0 + w_b)
    assert out.num_supervised == 2


def test_loss_weights_and_denominator_are_configurable():
    draft, target, labels, weights, confidence = _two_rows()
    out = dspark_loss(draft, target, labels, weights, confidence, ce_weight=1.0, tv_weight=0.0,
                      confidence_weight=0.0, denominator=10.0)
    w_b = math.exp(-0.25)
    assert out.loss.item() == pytest.approx((math.log(2.0) + w_b * -math.log(0.25)) / 10.0, rel=1e-5)


def test_without_confidence_head_the_term_is_zero():
    draft, target, labels, weights, _ = _two_rows()
    out = dspark_loss(draft, target, labels, weights, None)
    assert out.confidence.item() == 0.0
    assert out.loss.item() == pytest.approx(0.1 * out.ce.item() + 0.9 * out.tv.item(), rel=1e-6)


def test_confidence_term_does_not_push_on_the_draft_distribution():
    draft, target, labels, weights, confidence = _two_rows()
    out = dspark_loss(draft, target, labels, weights, confidence, ce_weight=0.0, tv_weight=0.0)
    out.loss.backward()
    assert draft.grad is None or torch.count_nonzero(draft.grad) == 0
    assert torch.count_nonzero(confidence.grad) == 2


def test_empty_batch_gives_a_zero_loss_with_a_graph():
    draft = torch.zeros(0, 5, requires_grad=True)
    out = dspark_loss(draft, torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0))
    assert out.loss.item() == 0.0 and out.loss.requires_grad
