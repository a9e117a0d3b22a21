"""How a method's greedy output compares with target-only decoding in the same dtype.

In float32, speculative greedy output equals target-only output token for token, and any difference is a bug. In
bf16 each committed token is still the argmax of the target's own verification forward, but a forward over k tokens
rounds differently from k one-token forwards, so outputs may part where the target's top two logits (nearly) tie. To
tell such rounding-level near-ties from real errors, the benchmarks record, at the first divergence of each output,
the target's top-1 minus top-2 logit there (`margin`) and the top-1 logit itself (`top1_logit`: bf16 logits near 20
are spaced 0.125 apart, so a margin of one spacing is a tie).

```python
>>> first_divergence([5, 6, 7], [5, 6, 9])
2
>>> first_divergence([5, 6], [5, 6]) is None
True
```
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import torch


# Where speculative greedy output must equal one-token-at-a-time output; elsewhere divergences at near-ties are
# expected and reported, not errors.
TOKEN_EXACT_DTYPES = (torch.float32,)


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first token where `tokens` and `reference` differ (the shorter length when one is a prefix of
    the other), or `None` when they are equal."""
    for index, (token, expected) in enumerate(zip(tokens, reference)):
        if token != expected:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


@torch.no_grad()
def next_token_margin(model: torch.nn.Module, input_ids: Sequence[int]) -> tuple[float, float]:
    """`(top-1 minus top-2 logit, top-1 logit)` of `model`'s next-token logits after `input_ids`, from one forward
    over the whole sequence (teacher-forced, in the model's own dtype).

    Args:
        model (`PreTrainedModel`): a causal LM.
        input_ids (`Sequence[int]`): one sequence (prompt and the tokens generated before the position of interest).
    """
    ids = torch.tensor([list(input_ids)], device=model.device)
    logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()  # bf16 values are exact in float32
    top = torch.topk(logits, 2).values
    return (top[0] - top[1]).item(), top[0].item()


def conversation_divergence(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    reference_turns: Sequence[Sequence[int]],
    turns: Sequence[Sequence[int]],
) -> dict[str, Any] | None:
    """Where `turns` first parts from target-only's `reference_turns`, and the target's margin there.

    Args:
        model (`PreTrainedModel`): the target, in the run's dtype.
        prompts (`Sequence[Sequence[int]]`): the reference's prompt ids per turn (the turns before the divergent one
            are equal, so the divergent turn's prompt is the same for both).
        reference_turns, turns (`Sequence[Sequence[int]]`): generated ids per turn, target-only's and the method's.

    Returns:
        `None` when the outputs are equal, else `{"position", "turn", "margin", "top1_logit", "target_token",
        "token"}`: `position` counts generated tokens over all turns (0-based); `margin` and `top1_logit` are the
        target's logits predicting that position from target-only's output before it; the two tokens are
        target-only's and the method's there (`None` past the end of an output).
    """
    offset = 0
    for turn, (prompt, reference, generated) in enumerate(zip(prompts, reference_turns, turns)):
        index = first_divergence(generated, reference)
        if index is None:
            offset += len(reference)
            continue
        margin, top1_logit = next_token_margin(model, [*prompt, *reference[:index]])
        return {
            "position": offset + index, "turn": turn, "margin": margin, "top1_logit": top1_logit,
            "target_token": reference[index] if index < len(reference) else None,
            "token": generated[index] if index < len(generated) else None,
        }
    return None


def summarize_divergences(divergences: Iterable[dict[str, Any] | None]) -> dict[str, Any]:
    """How many outputs of a group diverged, and the target's margins at their first divergences:
    `{"divergences", "divergence_margin_max", "divergence_margin_median", "divergence_top1_logit_max"}` (`None`
    entries, identical outputs, are skipped; the statistics are `None` without divergences)."""
    found = [d for d in divergences if d is not None]
    margins = [d["margin"] for d in found]
    return {
        "divergences": len(found),
        "divergence_margin_max": max(margins, default=None),
        "divergence_margin_median": statistics.median(margins) if margins else None,
        "divergence_top1_logit_max": max((d["top1_logit"] for d in found), default=None),
    }
