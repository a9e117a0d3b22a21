"""Synthetic traces: a drafter of a chosen acceptance level, for projections where no such drafter exists here.

Each anchor draws a per-token acceptance probability ``q ~ Beta(k · mean, k · (1 - mean))`` (k = `concentration`;
easy and hard stretches of text), the calibrated confidences are ``c_1 = ... = c_B = q`` (a perfectly calibrated
confidence head), and the number of accepted drafts is geometric: draft j survives with probability q given that
draft j - 1 did. Token ids are placeholders (the output counts up; a rejected draft is id 0). Every such trace is
labelled `synthetic` in its metadata.

```python
>>> from dspark_hf.simulation.synthetic import synthetic_trace
>>> trace = synthetic_trace(num_sequences=2, max_new_tokens=32, block_size=7, mean_acceptance=0.88)
>>> trace.metadata["synthetic"], len(trace.sequences[0].draft_ids)
(True, 31)

```
"""

from __future__ import annotations

import random

from .trace import Trace, TraceSequence


def _anchor(generator: random.Random, output: list[int], committed: int, block_size: int, mean: float,
            concentration: float) -> tuple[list[int], list[float], int]:
    q = generator.betavariate(concentration * mean, concentration * (1.0 - mean))
    accepted = 0
    while accepted < block_size and generator.random() < q:
        accepted += 1
    reference = output[committed:committed + block_size]
    accepted = min(accepted, len(reference))
    drafts = reference[:accepted] + [0] * (block_size - accepted)
    return drafts, [q] * block_size, accepted


def synthetic_trace(num_sequences: int, max_new_tokens: int, block_size: int = 7, mean_acceptance: float = 0.88,
                    concentration: float = 10.0, prompt_tokens: int = 128, seed: int = 0) -> Trace:
    """A labelled synthetic [`Trace`] of `num_sequences` outputs of `max_new_tokens` tokens (no EOS)."""
    if not 0.0 < mean_acceptance < 1.0 or concentration <= 0:
        raise ValueError(f"mean_acceptance must be in (0, 1) and concentration > 0, got {mean_acceptance} and "
                         f"{concentration}.")
    generator = random.Random(seed)
    sequences = []
    for index in range(num_sequences):
        output = list(range(1, max_new_tokens + 1))
        anchors = [_anchor(generator, output, c, block_size, mean_acceptance, concentration)
                   for c in range(1, max_new_tokens)]
        sequences.append(TraceSequence(
            prompt_id=f"synthetic-{index}", category="synthetic", turn=0,
            prompt_ids=[index + 1] * prompt_tokens,  # distinct prompts, so requests map to their own sequence
            output_ids=output, draft_ids=[a[0] for a in anchors], confidences=[a[1] for a in anchors],
            confidence_logits=[[] for _ in anchors], accept_lengths=[a[2] for a in anchors]))
    metadata = {"synthetic": True, "command": f"synthetic_trace(mean_acceptance={mean_acceptance}, "
                f"concentration={concentration}, seed={seed})",
                "description": "per-anchor acceptance q ~ Beta, confidences = q (perfectly calibrated), geometric "
                "acceptance lengths; placeholder token ids"}
    return Trace(block_size, max_new_tokens, [], sequences, metadata)
