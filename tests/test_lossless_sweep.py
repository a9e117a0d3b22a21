"""Greedy DSpark output is the target's own greedy output on every path, over ~1,000 cases whose drafts are partly right.

A case is one prompt decoded by one drafter: through `generate` at batch 1 (also continuing a cache that holds part
of the prompt), as a row of a batched `generate` (the batched engine), or through the standalone `custom_generate`
recipe. Its reference is the target's greedy
`generate` of that prompt. Each drafter's Markov head drafts the transitions the target itself makes in its greedy
continuations, after a random subset of tokens, and its own random guess after the others: verification accepts some
drafts and rejects others, and every case asserts that drafts were verified and at least one accepted.

The sweep sizes come from `DSPARK_HF_LOSSLESS_CASES` (1,000 by default; `make test-long` runs 10,000).
"""

from __future__ import annotations

import copy
import functools
import math
import random
import sys
from dataclasses import dataclass

import pytest
import torch

from conftest import LOSSLESS_CASES, cache_of, imitate_transitions, left_pad, make_drafter, make_target, with_cache
from dspark_hf import hub
from dspark_hf.generation.policies import FixedLengthPolicy, FullBlockPolicy


VOCAB = 64  # the Markov head's transition table is one-hot: markov_rank == VOCAB
MAX_NEW_TOKENS = 16
ROWS = 8  # prompts per group: one batched case of ROWS rows per drafter
BATCHED_DRAFTERS = 2  # batched generate calls per group
TEMPLATE_CASES = 2  # custom_generate cases per group
# Cases per group: one batch-1 case per prompt, every prompt as a row of each batched call, and the template's.
CASES_PER_GROUP = ROWS * (1 + BATCHED_DRAFTERS) + TEMPLATE_CASES
NUM_GROUPS = math.ceil(LOSSLESS_CASES / CASES_PER_GROUP)


@dataclass
class Group:
    """A tiny random target, prompts whose first greedy tokens differ, and each prompt's greedy continuation."""

    seed: int
    target: torch.nn.Module
    prompts: list[list[int]]
    continuations: list[list[int]]  # target.generate(prompt, do_sample=False, max_new_tokens=MAX_NEW_TOKENS)

    def transitions(self, rng: random.Random) -> dict[int, int]:
        """What the target emits after each token of its continuations (the first time it follows it), kept for a
        random 60-100 % of the tokens; each prompt's first transition is always kept, so round one accepts a draft."""
        keep = rng.uniform(0.6, 1.0)
        table = {}
        for prompt, continuation in zip(self.prompts, self.continuations):
            sequence = prompt[-1:] + continuation
            for previous, token in zip(sequence[1:], sequence[2:]):
                table.setdefault(previous, token)
        table = {previous: token for previous, token in table.items() if rng.random() < keep}
        table.update({continuation[0]: continuation[1] for continuation in self.continuations})
        return table

    def expected(self, row: int, max_new_tokens: int, eos: int | None) -> list[int]:
        """The reference for a shorter budget or an EOS: greedy decoding stops there, the tokens before are the same."""
        tokens = self.continuations[row][:max_new_tokens]
        return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@functools.cache
def group(index: int) -> Group:
    """Built once per test session and shared by the three paths' sweeps."""
    rng = random.Random(index)
    target = make_target(["llama", "qwen2", "qwen3"][index % 3], seed=index, vocab_size=VOCAB, num_hidden_layers=2,
                         eos_token_id=None, bos_token_id=None)  # fmt: skip
    prompts, continuations, first_tokens = [], [], set()
    while len(prompts) < ROWS:
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 8))]
        out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0)
        continuation = out[0, len(prompt):].tolist()
        if continuation[0] not in first_tokens:  # one drafter serves every row: their first transitions must agree
            first_tokens.add(continuation[0])
            prompts.append(prompt)
            continuations.append(continuation)
    return Group(index, target, prompts, continuations)


def partly_right_drafter(data: Group, rng: random.Random):
    """A random drafter configuration whose Markov head knows some of the target's transitions."""
    drafter = make_drafter(
        data.target,
        seed=rng.randrange(10_000),
        block_size=rng.randint(1, 6),
        num_hidden_layers=rng.randint(1, 2),
        markov_rank=VOCAB,
        markov_head_type=rng.choice(["vanilla", "gated", "rnn"]),
        enable_confidence_head=rng.random() < 0.5,
        target_layer_ids=rng.choice([[0], [-1, 0]]),
    )
    return imitate_transitions(drafter, data.transitions(rng))


def random_policy(drafter, rng: random.Random):
    block_size = drafter.config.block_size
    return FullBlockPolicy() if rng.random() < 0.5 else FixedLengthPolicy(rng.randint(1, block_size))


def random_eos(data: Group, rows: list[int], rng: random.Random) -> int | None:
    """In a third of the cases, an EOS the target emits in one of these rows' continuations, but never as the first
    two tokens of any row (so every row has a round with drafts to verify)."""
    early = {token for continuation in data.continuations for token in continuation[:2]}
    candidates = [token for row in rows for token in data.continuations[row][2:] if token not in early]
    return rng.choice(candidates) if candidates and rng.random() < 1 / 3 else None


class Outcomes:
    """Verified and accepted drafts per case; every case must have verified drafts and accepted one."""

    def __init__(self):
        self.cases, self.rejections = 0, 0

    def add(self, verified_accepted: list[tuple[int, int]], case: str) -> None:
        assert sum(v for v, _ in verified_accepted) > 0, f"{case}: no draft was verified"
        assert sum(a for _, a in verified_accepted) > 0, f"{case}: no draft was accepted {verified_accepted}"
        self.cases += 1
        self.rejections += sum(a < v for v, a in verified_accepted)


def test_batch_one_greedy_sweep(lossless_cases):
    outcomes = Outcomes()
    for index in range(NUM_GROUPS):
        data, rng = group(index), random.Random(f"batch 1 {index}")
        for row, prompt in enumerate(data.prompts):
            drafter = partly_right_drafter(data, rng)
            drafter.verification_policy = random_policy(drafter, rng)
            max_new_tokens, eos = rng.randint(6, MAX_NEW_TOKENS), random_eos(data, [row], rng)
            out = data.target.generate(torch.tensor([prompt]), assistant_model=drafter, do_sample=False,
                                       max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)  # fmt: skip
            case = f"group {index} row {row} ({drafter.config.block_size=}, {eos=})"
            assert out[0, len(prompt):].tolist() == data.expected(row, max_new_tokens, eos), case
            outcomes.add([(r.verified, r.accepted) for r in drafter.generation_stats.rounds], case)
    assert outcomes.rejections > outcomes.cases // 4  # the rejection path ran in many cases
    lossless_cases["greedy batch 1"] += outcomes.cases


def test_batch_one_prefilled_cache_greedy_sweep(lossless_cases):
    """Batch 1 continuing a target cache of an earlier call that holds a random part of the prompt (a chat's next
    turn), with prompt lookup inside the rounds in a third of the cases: the reference is target-only decoding from
    a copy of the same cache (tests/test_prefilled_cache.py)."""
    outcomes = Outcomes()
    for index in range(NUM_GROUPS):
        data, rng = group(index), random.Random(f"pre-filled cache {index}")
        for row, prompt in enumerate(data.prompts):
            if len(prompt) < 2 or row % 2:
                continue
            drafter = partly_right_drafter(data, rng)
            drafter.verification_policy = random_policy(drafter, rng)
            ids = torch.tensor([prompt])
            cached = rng.randint(1, len(prompt) - 1)
            with torch.no_grad():
                cache = cache_of(data.target(ids[:, :cached], use_cache=True))
            settings = dict(do_sample=False, max_new_tokens=rng.randint(6, MAX_NEW_TOKENS), pad_token_id=0)
            expected = data.target.generate(ids, **with_cache(copy.deepcopy(cache)), **settings)
            lookup = {"prompt_lookup_num_tokens": 3} if rng.random() < 1 / 3 else {}
            out = data.target.generate(ids, **with_cache(cache), assistant_model=drafter, **settings, **lookup)
            case = f"group {index} row {row} ({drafter.config.block_size=}, {cached=}, {lookup})"
            assert out.tolist() == expected.tolist(), case
            outcomes.add([(r.verified, r.accepted) for r in drafter.generation_stats.rounds], case)
    assert outcomes.rejections > outcomes.cases // 4
    lossless_cases["greedy batch 1, pre-filled cache"] += outcomes.cases


def test_batched_greedy_sweep(lossless_cases):
    outcomes = Outcomes()
    for index in range(NUM_GROUPS):
        data, rng = group(index), random.Random(f"batched {index}")
        for _ in range(BATCHED_DRAFTERS):
            drafter = partly_right_drafter(data, rng)
            drafter.verification_policy = random_policy(drafter, rng)
            max_new_tokens, eos = rng.randint(6, MAX_NEW_TOKENS), random_eos(data, [rng.randrange(ROWS)], rng)
            ids, mask = left_pad(data.prompts)
            out = data.target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                                       max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)  # fmt: skip
            for row, stats in enumerate(drafter.batch_generation_stats):
                case = f"group {index} row {row} ({drafter.config.block_size=}, {eos=})"
                expected = data.expected(row, max_new_tokens, eos)
                generated = out[row, ids.shape[1]:].tolist()
                assert generated[: len(expected)] == expected and set(generated[len(expected):]) <= {0}, case
                outcomes.add([(r.verified, r.accepted) for r in stats.rounds], case)
    assert outcomes.rejections > outcomes.cases // 4
    lossless_cases["greedy batched"] += outcomes.cases


@pytest.fixture
def template_verdicts(tmp_path, monkeypatch):
    """A custom_generate folder, and the (drafts verified, accepted) of every round the recipe runs from it."""
    import transformers.dynamic_module_utils as dynamic_module_utils

    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    folder = tmp_path / "recipe"
    hub.write_custom_generate(folder, "unused: every call passes dspark_drafter")
    module = sys.modules[group(0).target.load_custom_generate(str(folder), trust_remote_code=True).__module__]
    verdicts, verify = [], module.verify

    def recording_verify(draft_ids, *args, **kwargs):
        accepted, token = verify(draft_ids, *args, **kwargs)
        verdicts.append((len(draft_ids), accepted))
        return accepted, token

    monkeypatch.setattr(module, "verify", recording_verify)
    return folder, verdicts


def test_template_greedy_sweep(tmp_path, template_verdicts, lossless_cases):
    folder, verdicts = template_verdicts
    outcomes = Outcomes()
    for index in range(NUM_GROUPS):
        data, rng = group(index), random.Random(f"template {index}")
        for row in rng.sample(range(ROWS), TEMPLATE_CASES):
            drafter = partly_right_drafter(data, rng)
            drafter.save_pretrained(tmp_path / f"drafter-{index}-{row}")  # the official layout the recipe loads
            max_new_tokens, eos = rng.randint(6, MAX_NEW_TOKENS), random_eos(data, [row], rng)
            verdicts.clear()
            out = data.target.generate(torch.tensor([data.prompts[row]]), do_sample=False, max_new_tokens=max_new_tokens,
                                       eos_token_id=eos, pad_token_id=0, custom_generate=str(folder),
                                       trust_remote_code=True, dspark_drafter=str(tmp_path / f"drafter-{index}-{row}"))
            case = f"group {index} row {row} ({drafter.config.block_size=}, {eos=})"
            assert out[0, len(data.prompts[row]):].tolist() == data.expected(row, max_new_tokens, eos), case
            outcomes.add(list(verdicts), case)
    assert outcomes.rejections > outcomes.cases // 4
    lossless_cases["greedy template"] += outcomes.cases
