"""The DSpark training loss (docs/design.md, "Training") as pure functions on tensors.

For each supervised slot ``k`` (0-based) with weight ``w_k = exp(-k / 4.0)``, corrected draft logits ``z`` (base
logits plus the teacher-forced Markov bias), target logits ``t`` and raw confidence logit ``c``:

- ``pd = softmax(z)``, ``pt = softmax(t)``, both fp32 at temperature 1;
- ``L_ce   = Σ w · CE(z, label) / Σ w``
- ``L_tv   = Σ w · ‖pd - pt‖₁ / Σ w``  (the full L1 norm, not halved)
- ``L_conf = Σ w · BCEWithLogits(c, clamp(1 - ½‖pd - pt‖₁, 0, 1)) / Σ w``  (the target is detached)
- ``L = 0.1 · L_ce + 0.9 · L_tv + 1.0 · L_conf``

A drafter with a reduced draft vocabulary ``D`` trains over ``D`` alone: ``pd`` is its softmax over ``D`` (it never
drafts anything else), ``pt`` is the target's distribution over the whole vocabulary restricted to ``D`` (not
renormalized) plus one bucket holding the target's mass outside ``D``, so ``‖pd - pt‖₁ = Σ_D |pd - pt| + pt(outside)``
is still the full-vocabulary L1 distance and ``1 - ½‖pd - pt‖₁`` still the acceptance probability. Labels outside
``D`` carry no cross-entropy (the drafter cannot draft them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


DEFAULT_LOSS_DECAY = 4.0
DEFAULT_CE_WEIGHT = 0.1
DEFAULT_TV_WEIGHT = 0.9
DEFAULT_CONFIDENCE_WEIGHT = 1.0


def slot_weights(supervised: torch.Tensor, decay: float = DEFAULT_LOSS_DECAY) -> torch.Tensor:
    """``w_k = supervised_k · exp(-k / decay)`` for slots ``k = 0..B-1`` on the last dimension.

    Args:
        supervised (`torch.Tensor` of shape `(*batch, B)`): 1/True where the slot enters the loss.
        decay (`float`): DeepSpec's `loss_decay_gamma` (4.0 for every release; not the block size).

    Returns:
        `torch.Tensor` of shape `(*batch, B)`, fp32.
    """
    slots = torch.arange(supervised.shape[-1], device=supervised.device, dtype=torch.float32)
    return supervised.float() * torch.exp(-slots / decay)


def total_variation_l1(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, target_outside_mass: torch.Tensor | None = None
) -> torch.Tensor:
    """``‖softmax(draft_logits) - pt‖₁`` per row, in fp32 (in [0, 2]).

    Args:
        draft_logits (`torch.Tensor` of shape `(*batch, vocab)`).
        target_logits (`torch.Tensor` of shape `(*batch, vocab)`): ``pt = softmax(target_logits)``; with
            `target_outside_mass`, the target's log-probabilities over the draft vocabulary instead (``pt = exp``).
        target_outside_mass (`torch.Tensor` of shape `(*batch,)`, *optional*): the target's probability of the ids
            outside the draft vocabulary, where the drafter puts none.

    Returns:
        `torch.Tensor` of shape `(*batch,)`.
    """
    draft_probs = draft_logits.float().softmax(dim=-1)
    if target_outside_mass is None:
        return (draft_probs - target_logits.float().softmax(dim=-1)).abs().sum(dim=-1)
    return (draft_probs - target_logits.float().exp()).abs().sum(dim=-1) + target_outside_mass.float()


def confidence_targets(total_variation: torch.Tensor) -> torch.Tensor:
    """The soft label of the confidence head, ``clamp(1 - ½‖pd - pt‖₁, 0, 1)``, detached.

    It is the probability that a draft sampled from ``pd`` is accepted by speculative sampling against ``pt``.
    """
    return (1.0 - 0.5 * total_variation.detach()).clamp(0.0, 1.0)


def weighted_mean(values: torch.Tensor, weights: torch.Tensor, denominator: torch.Tensor | float) -> torch.Tensor:
    """``Σ w · values / denominator`` (fp32)."""
    return (weights * values.float()).sum() / denominator


@dataclass
class DSparkLossOutput:
    """The DSpark loss and its terms (scalars; `loss` carries the gradient, the terms are for logging).

    Attributes:
        loss: ``ce_weight · ce + tv_weight · tv + confidence_weight · confidence``.
        ce, tv, confidence: the weighted-mean terms (`confidence` is 0 without a confidence head).
        weight_sum: ``Σ w`` of this batch (the denominator before the +1e-6 and any cross-rank sum).
        num_supervised: number of supervised slots.
    """

    loss: torch.Tensor
    ce: torch.Tensor
    tv: torch.Tensor
    confidence: torch.Tensor
    weight_sum: torch.Tensor
    num_supervised: int


def dspark_loss(
    draft_logits: torch.Tensor,
    target_logits: torch.Tensor,
    labels: torch.LongTensor,
    weights: torch.Tensor,
    confidence_logits: torch.Tensor | None = None,
    ce_weight: float = DEFAULT_CE_WEIGHT,
    tv_weight: float = DEFAULT_TV_WEIGHT,
    confidence_weight: float = DEFAULT_CONFIDENCE_WEIGHT,
    denominator: torch.Tensor | float | None = None,
    target_outside_mass: torch.Tensor | None = None,
) -> DSparkLossOutput:
    """The DSpark loss over the supervised slots of a batch, flattened.

    Args:
        draft_logits (`torch.Tensor` of shape `(N, vocab)`): Markov-corrected draft logits ``z = U + bias``.
        target_logits (`torch.Tensor` of shape `(N, vocab)`): the target's logits for the same positions.
        labels (`torch.LongTensor` of shape `(N,)`): the next tokens ``x_{p+k+1}`` (as ids of the draft vocabulary,
            -100 for none, when training over a reduced one).
        weights (`torch.Tensor` of shape `(N,)`): slot weights ``exp(-k / 4.0)``.
        confidence_logits (`torch.Tensor` of shape `(N,)`, *optional*): raw confidence logits; `None` without a
            confidence head.
        ce_weight, tv_weight, confidence_weight (`float`): the mixture (0.1, 0.9, 1.0 in DeepSpec).
        denominator (`torch.Tensor` or `float`, *optional*): defaults to ``Σ w + 1e-6``; pass the sum over all
            data-parallel ranks to normalize globally as DeepSpec does.
        target_outside_mass (`torch.Tensor` of shape `(N,)`, *optional*): training over a reduced draft vocabulary,
            the target's mass outside it; `target_logits` are then log-probabilities (see [`total_variation_l1`]).

    Returns:
        [`DSparkLossOutput`].
    """
    weight_sum = weights.float().sum()
    if denominator is None:
        denominator = weight_sum + 1e-6
    weights = weights.float()
    ce = weighted_mean(F.cross_entropy(draft_logits.float(), labels, reduction="none"), weights, denominator)
    total_variation = total_variation_l1(draft_logits, target_logits, target_outside_mass)
    tv = weighted_mean(total_variation, weights, denominator)
    if confidence_logits is None:
        confidence = tv.new_zeros(())
    else:
        bce = F.binary_cross_entropy_with_logits(
            confidence_logits.float(), confidence_targets(total_variation), reduction="none"
        )
        confidence = weighted_mean(bce, weights, denominator)
    loss = ce_weight * ce + tv_weight * tv + confidence_weight * confidence
    return DSparkLossOutput(
        loss=loss, ce=ce, tv=tv, confidence=confidence, weight_sum=weight_sum, num_supervised=int(labels.numel())
    )
