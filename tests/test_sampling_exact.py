"""Sampling with a DSpark drafter reproduces the target's distribution exactly.

On a 6-token vocabulary we enumerate the target's exact distribution over its 2nd and 3rd sampled tokens (the first
comes from the prefill; the next ones from the first draft-and-verify round), draw
thousands of DSpark generations, and run a chi-square test. The drafter's Markov head is made strong, so its drafts
come from a distribution far from both the target and its own base logits: if verification used anything other than
the Markov-corrected logits the drafts were drawn from, the output would follow the draft, and the test fails (the
negative control below shows it does).
"""

from __future__ import annotations

import torch

from conftest import make_drafter, make_target
from dspark_hf.generation import candidate_generator as candidate_module


VOCAB = 6
PROMPT = torch.tensor([[1, 4, 3]])
NUM_SAMPLES = 1000
GEN = dict(do_sample=True, temperature=1.0, top_k=None, top_p=None, max_new_tokens=4, eos_token_id=None, pad_token_id=0)


def _models():
    target = make_target("llama", seed=3, vocab_size=VOCAB, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    with torch.no_grad():
        target.lm_head.weight.mul_(15.0)  # a non-uniform target distribution
    drafter = make_drafter(target, seed=4, block_size=3, markov_rank=VOCAB)
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.copy_(torch.eye(VOCAB) * 6.0)
        # the drafted token strongly favours (previous + 1) % VOCAB
        drafter.markov_head.markov_w2.weight.copy_(torch.roll(torch.eye(VOCAB), 1, dims=0))
    return target, drafter


def _next_token_probs(target, prefix: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return target(torch.cat([PROMPT, torch.tensor([prefix], dtype=torch.long)], dim=1)).logits[0, -1].softmax(-1)


def _exact_distribution(target) -> torch.Tensor:
    """P(x2, x3) = sum over x1 of p(x1) p(x2 | x1) p(x3 | x1, x2), flattened to VOCAB * VOCAB cells."""
    first = _next_token_probs(target, [])
    probs = torch.zeros(VOCAB, VOCAB)
    for x1 in range(VOCAB):
        second = _next_token_probs(target, [x1])
        for x2 in range(VOCAB):
            probs[x2] += first[x1] * second[x2] * _next_token_probs(target, [x1, x2])
    return probs.flatten()


def _samples_from_generate(target, drafter):
    out = target.generate(PROMPT, assistant_model=drafter, **GEN)
    return [out[0, PROMPT.shape[1] + 1 : PROMPT.shape[1] + 3].tolist()]


def _samples_from_batch(target, drafter, rows: int = 3):
    """The batched path: `rows` copies of the prompt in one left-padded batch, verified together."""
    out = target.generate(PROMPT.repeat(rows, 1), assistant_model=drafter, **GEN)
    return out[:, PROMPT.shape[1] + 1 : PROMPT.shape[1] + 3].tolist()


def _chi_square(target, drafter, seed: int, sampler=_samples_from_generate) -> float:
    torch.manual_seed(seed)
    counts = torch.zeros(VOCAB * VOCAB)
    while counts.sum() < NUM_SAMPLES:
        for a, b in sampler(target, drafter):
            counts[a * VOCAB + b] += 1
    expected = _exact_distribution(target) * counts.sum()
    keep = expected > 5  # pool rare cells, as usual for chi-square
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expected = torch.cat([expected[keep], expected[~keep].sum()[None]])
    return float(((observed - expected) ** 2 / expected.clamp_min(1e-9)).sum()), int(keep.sum())


# 99.9th percentile of chi-square with df degrees of freedom (df <= 36), Wilson-Hilferty approximation.
def _critical_value(df: int, z: float = 3.09) -> float:
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_sampled_tokens_follow_the_target_distribution():
    target, drafter = _models()
    statistic, cells = _chi_square(target, drafter, seed=0)
    assert drafter.generation_stats.num_rounds > 0
    assert statistic < _critical_value(cells), (statistic, cells)


def test_batched_sampling_follows_the_target_distribution():
    target, drafter = _models()
    statistic, cells = _chi_square(target, drafter, seed=1, sampler=_samples_from_batch)
    assert statistic < _critical_value(cells), (statistic, cells)


def test_reduced_vocabulary_sampling_follows_the_target_distribution():
    """Drafts come only from 4 of the 6 tokens (the Markov head's favourite is often outside them): speculative
    sampling must still reproduce the target, which puts mass on all 6."""
    target, drafter = _models()
    drafter.reduce_vocabulary([0, 2, 3, 5])
    statistic, cells = _chi_square(target, drafter, seed=2)
    drafted = {t for r in drafter.generation_stats.rounds for t in (r.draft_ids or [])}
    assert drafted and drafted <= {0, 2, 3, 5}
    assert statistic < _critical_value(cells), (statistic, cells)


def test_negative_control_uncorrected_logits_are_detected(monkeypatch):
    """Verifying against the base logits instead of the Markov-corrected ones must break the distribution."""
    target, drafter = _models()
    original = candidate_module.DSparkCandidateGenerator._sample_drafts

    def broken(self, input_ids, hidden_states, logits, max_drafts):
        ids, _, confidences, raw = original(self, input_ids, hidden_states, logits, max_drafts)
        base = [logits[k][None].to(input_ids.device) for k in range(len(ids))]
        return ids, base, confidences, raw

    monkeypatch.setattr(candidate_module.DSparkCandidateGenerator, "_sample_drafts", broken)
    statistic, cells = _chi_square(target, drafter, seed=0)
    assert statistic > 10 * _critical_value(cells), (statistic, cells)


def test_exact_distribution_is_normalised():
    target, _ = _models()
    assert torch.isclose(_exact_distribution(target).sum(), torch.tensor(1.0), atol=1e-5)
