"""Sampling with a DSpark drafter reproduces the target's distribution exactly.

On a 6-token vocabulary we enumerate the target's exact distribution over its 2nd and 3rd sampled tokens (the first
comes from the prefill; the next ones from the first draft-and-verify round), draw
a thousand DSpark generations per path and policy (batch 1, the batched engine, the custom_generate recipe), and run a
chi-square test. The drafter's Markov head is made strong, so its drafts
come from a distribution far from both the target and its own base logits: if verification used anything other than
the Markov-corrected logits the drafts were drawn from, the output would follow the draft, and the test fails (the
negative control below shows it does).
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from conftest import cache_of, load_generate_module, make_drafter, make_target, with_cache
from dspark_hf.generation.batched import DSparkBatchEngine
from dspark_hf.generation.policies import FixedLengthPolicy, FullBlockPolicy, HardwareAwarePolicy, ThresholdPolicy


VOCAB = 6
PROMPT = torch.tensor([[1, 4, 3]])
NUM_SAMPLES = 1000
BATCH_ROWS = NUM_SAMPLES // 4  # the batched engine draws its samples as rows of a few large batches
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
    # Sharp temperatures spread the random confidence head's c_k over (0, 1): the threshold policy cuts blocks anywhere.
    drafter.config.confidence_temperatures = [0.03] * 3
    return target, drafter


# Every policy, as the batched engine and the recipe run them; the hardware-aware one on a fixed speed table.
POLICIES = {
    "full": FullBlockPolicy,
    "fixed": lambda: FixedLengthPolicy(1),  # the full block is 2 drafts here: the budget leaves 3 tokens after prefill
    "threshold": lambda: ThresholdPolicy(0.5),
    # speeds by tokens per verification forward: BATCH_ROWS rows verifying 1, 2, 3 or 4 tokens each
    "hardware_aware": lambda: HardwareAwarePolicy({BATCH_ROWS * width: speed for width, speed in
                                                   enumerate([1.0, 0.9, 0.85, 0.8], start=1)}, draft_seconds=0.0),
}


def _next_token_probs(target, prefix: list[int], prompt: torch.Tensor = PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return target(torch.cat([prompt, torch.tensor([prefix], dtype=torch.long)], dim=1)).logits[0, -1].softmax(-1)


def _exact_distribution(target, prompt: torch.Tensor = PROMPT) -> torch.Tensor:
    """P(x2, x3) = sum over x1 of p(x1) p(x2 | x1) p(x3 | x1, x2), flattened to VOCAB * VOCAB cells."""
    first = _next_token_probs(target, [], prompt)
    probs = torch.zeros(VOCAB, VOCAB)
    for x1 in range(VOCAB):
        second = _next_token_probs(target, [x1], prompt)
        for x2 in range(VOCAB):
            probs[x2] += first[x1] * second[x2] * _next_token_probs(target, [x1, x2], prompt)
    return probs.flatten()


def _samples_from_generate(target, drafter, prompt: torch.Tensor = PROMPT, **kwargs):
    out = target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=drafter, **GEN, **kwargs)
    return [out[0, prompt.shape[1] + 1 : prompt.shape[1] + 3].tolist()]


def _samples_from_batch(target, drafter, rows: int = BATCH_ROWS):
    """The batched engine: `rows` copies of the prompt in one batch, drafted and verified together."""
    out = target.generate(PROMPT.repeat(rows, 1), assistant_model=drafter, **GEN)
    return out[:, PROMPT.shape[1] + 1 : PROMPT.shape[1] + 3].tolist()


def _recipe_sampler(recipe, folder, threshold: float):
    """The custom_generate recipe's decoding loop on the drafter saved in `folder` (what `target.generate(...,
    custom_generate=...)` runs once it has resolved its arguments; tests/test_lossless_sweep.py goes through generate)."""
    config = GenerationConfig(**{k: v for k, v in GEN.items() if k != "pad_token_id"})

    def sampler(target, _):
        drafter = recipe.load_drafter(str(folder), target)
        out = recipe.speculative_generate(target, drafter, PROMPT, config, threshold)
        return [out[0, PROMPT.shape[1] + 1 : PROMPT.shape[1] + 3].tolist()]

    return sampler


def _chi_square(target, drafter, seed: int, sampler=_samples_from_generate, prompt: torch.Tensor = PROMPT) -> float:
    torch.manual_seed(seed)
    counts = torch.zeros(VOCAB * VOCAB)
    while counts.sum() < NUM_SAMPLES:
        for a, b in sampler(target, drafter):
            counts[a * VOCAB + b] += 1
    expected = _exact_distribution(target, prompt) * counts.sum()
    keep = expected > 5  # pool rare cells, as usual for chi-square
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expected = torch.cat([expected[keep], expected[~keep].sum()[None]])
    return float(((observed - expected) ** 2 / expected.clamp_min(1e-9)).sum()), int(keep.sum())


# 99.9th percentile of chi-square with df degrees of freedom (df <= 36), Wilson-Hilferty approximation.
def _critical_value(df: int, z: float = 3.09) -> float:
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_sampled_tokens_follow_the_target_distribution(lossless_cases):
    target, drafter = _models()
    statistic, cells = _chi_square(target, drafter, seed=0)
    assert drafter.generation_stats.num_rounds > 0
    assert statistic < _critical_value(cells), (statistic, cells)
    lossless_cases["sampling"] += NUM_SAMPLES


def test_sampling_from_a_prefilled_cache_follows_the_target_distribution(lossless_cases):
    """A target cache filled by an earlier call holds the prompt's first two positions: the first forward starts after
    them, and the drafter drafts from the third position's features on (tests/test_prefilled_cache.py)."""
    target, drafter = _models()
    drafter.verification_policy = FullBlockPolicy()

    def sampler(target, drafter):
        with torch.no_grad():
            cache = cache_of(target(PROMPT[:, :2], use_cache=True))
        return _samples_from_generate(target, drafter, **with_cache(cache))

    statistic, cells = _chi_square(target, drafter, seed=6, sampler=sampler)
    assert drafter.generation_stats.rounds[0].verified == 2
    assert statistic < _critical_value(cells), (statistic, cells)
    lossless_cases["sampling"] += NUM_SAMPLES


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_batched_engine_sampling_follows_the_target_distribution(policy, lossless_cases):
    target, drafter = _models()
    drafter.verification_policy = POLICIES[policy]()
    statistic, cells = _chi_square(target, drafter, seed=1, sampler=_samples_from_batch)
    rounds = [r for stats in drafter.batch_generation_stats for r in stats.rounds]
    assert sum(r.accepted for r in rounds) > 0  # drafts were verified and accepted
    # the first round makes y_2 and y_3; the hardware-aware plan depends on the speeds it measures
    verified = {stats.rounds[0].verified for stats in drafter.batch_generation_stats}
    assert verified == {"full": {2}, "fixed": {1}, "threshold": {0, 1, 2}}.get(policy, verified), verified
    assert statistic < _critical_value(cells), (statistic, cells)
    lossless_cases["sampling"] += NUM_SAMPLES


def test_custom_generate_recipe_sampling_follows_the_target_distribution(tmp_path, lossless_cases):
    """The recipe's policy, `dspark_confidence_threshold`: blocks cut at the first confidence below 0.5, which the
    sharp confidences place anywhere (full blocks, the other setting, included)."""
    target, drafter = _models()
    drafter.save_pretrained(tmp_path)
    verdicts, recipe = [], load_generate_module()
    verify = recipe.verify

    def recording_verify(draft_ids, *args):
        verdicts.append(len(draft_ids))
        return verify(draft_ids, *args)

    recipe.verify = recording_verify
    statistic, cells = _chi_square(target, drafter, seed=3, sampler=_recipe_sampler(recipe, tmp_path, threshold=0.5))
    assert {0, 1, 2} <= set(verdicts), set(verdicts)
    assert statistic < _critical_value(cells), (statistic, cells)
    lossless_cases["sampling"] += NUM_SAMPLES


def test_reduced_vocabulary_fixed_length_sampling_follows_the_target_distribution(lossless_cases):
    """Drafts come only from 4 of the 6 tokens (the Markov head's favourite is often outside them), and the fixed-length
    policy verifies one of them a round: speculative sampling must still reproduce the target, which puts mass on all
    6 (one set of generations for two settings of batch 1)."""
    target, drafter = _models()
    drafter.reduce_vocabulary([0, 2, 3, 5])
    drafter.verification_policy = FixedLengthPolicy(1)
    statistic, cells = _chi_square(target, drafter, seed=2)
    drafted = {t for r in drafter.generation_stats.rounds for t in (r.draft_ids or [])}
    assert drafted and drafted <= {0, 2, 3, 5}
    assert drafter.generation_stats.rounds[0].verified == 1
    assert statistic < _critical_value(cells), (statistic, cells)
    lossless_cases["sampling"] += NUM_SAMPLES


# Every bigram "3 x" occurs in the prompt, followed by 5: after the prefill samples x1, the first round always finds a
# lookup continuation ("5 3 x1 5 ..."), which the target verifies by sampling its own tokens.
LOOKUP_PROMPT = torch.tensor([[3, 0, 5, 3, 1, 5, 3, 2, 5, 3, 3, 5, 3, 4, 5, 3, 5, 5, 3]])


@pytest.mark.parametrize("policy", ["full", "hardware_aware"])
def test_prompt_lookup_rounds_sampling_follows_the_target_distribution(policy, lossless_cases):
    """`prompt_lookup_num_tokens` with a DSpark drafter: lookup drafts (a deterministic proposal) are verified by
    transformers' sampling match, drafter blocks by speculative sampling, in one generation."""
    target, drafter = _models()
    drafter.verification_policy = {"full": FullBlockPolicy, "hardware_aware": lambda: HardwareAwarePolicy(
        {1: 1.0, 2: 0.95, 3: 0.9, 4: 0.85}, draft_seconds=0.0)}[policy]()
    accepted = {"lookup": 0, "drafter": 0}

    def sampler(target, drafter):
        samples = _samples_from_generate(target, drafter, LOOKUP_PROMPT, prompt_lookup_num_tokens=2)
        for r in drafter.generation_stats.rounds:
            accepted[r.source] += r.accepted
        return samples

    statistic, cells = _chi_square(target, drafter, seed=5, sampler=sampler, prompt=LOOKUP_PROMPT)
    assert accepted["lookup"] > 0, accepted  # lookup drafts were verified and accepted, and so were the drafter's
    assert policy == "hardware_aware" or accepted["drafter"] > 0, accepted
    assert statistic < _critical_value(cells), (statistic, cells)
    lossless_cases["sampling"] += NUM_SAMPLES


@pytest.mark.parametrize("policy", ["full", "hardware_aware"])
def test_batched_prompt_lookup_sampling_follows_the_target_distribution(policy, lossless_cases):
    """The batched engine with `prompt_lookup_num_tokens`: rows verify lookup drafts (a one-hot proposal) beside rows
    verifying drafted blocks (speculative sampling), in one forward."""
    target, drafter = _models()
    drafter.verification_policy = {"full": FullBlockPolicy, "hardware_aware": lambda: HardwareAwarePolicy(
        {BATCH_ROWS * width: speed for width, speed in enumerate([1.0, 0.95, 0.9, 0.85], start=1)},
        draft_seconds=0.0)}[policy]()
    accepted = {"lookup": 0, "drafter": 0}

    def sampler(target, drafter):
        prompts = LOOKUP_PROMPT.repeat(BATCH_ROWS, 1)
        out = target.generate(prompts, attention_mask=torch.ones_like(prompts), assistant_model=drafter,
                              prompt_lookup_num_tokens=2, **GEN)
        for stats in drafter.batch_generation_stats:
            for r in stats.rounds:
                accepted[r.source] += r.accepted
        return out[:, LOOKUP_PROMPT.shape[1] + 1: LOOKUP_PROMPT.shape[1] + 3].tolist()

    statistic, cells = _chi_square(target, drafter, seed=6, sampler=sampler, prompt=LOOKUP_PROMPT)
    assert accepted["lookup"] > 0, accepted
    assert statistic < _critical_value(cells), (statistic, cells)
    lossless_cases["sampling"] += NUM_SAMPLES


def test_negative_control_a_wrong_draft_distribution_is_detected(monkeypatch):
    """Verifying slot 2's draft against slot 1's distribution (the Markov correction for the drafted token dropped) must
    break the distribution, at the sample size of the tests above (cheap on the batched engine: the statistic's power
    does not depend on the path that produced the samples)."""
    draft = DSparkBatchEngine._draft

    def wrong_logits(self, *args, **kwargs):
        result = draft(self, *args, **kwargs)
        result.logits = result.logits[:, :1].expand_as(result.logits).contiguous()
        return result

    monkeypatch.setattr(DSparkBatchEngine, "_draft", wrong_logits)
    target, drafter = _models()
    statistic, cells = _chi_square(target, drafter, seed=0, sampler=_samples_from_batch)
    # 317 against a critical value of 51 (230 under torch 2.6, whose random streams differ): far past it either way
    assert statistic > 3 * _critical_value(cells), (statistic, cells)


def test_exact_distribution_is_normalised():
    target, _ = _models()
    assert torch.isclose(_exact_distribution(target).sum(), torch.tensor(1.0), atol=1e-5)


def test_bfloat16_drafter_sampling_follows_the_target_distribution():
    """Drafts are drawn from bf16-computed logits; verification must use exactly those (upcast), not a re-rounding."""
    target, drafter = _models()
    drafter.to(torch.bfloat16)
    statistic, cells = _chi_square(target, drafter, seed=2)
    assert drafter.generation_stats.num_rounds > 0
    assert statistic < _critical_value(cells), (statistic, cells)
