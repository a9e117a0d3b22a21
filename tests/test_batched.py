"""Batched DSpark generation: every row identical to its solo generation, rows finishing and joining freely."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import left_pad, make_drafter, make_target, solo
from dspark_hf.generation import batched
from dspark_hf.generation.batched import DSparkBatchEngine, DSparkRequest


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_generate_batch_rows_equal_solo_rows(arch):
    target = make_target(arch, seed=5)
    drafter = make_drafter(target, block_size=5)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12], [40, 41, 42], [7, 7]]
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=17,
                          pad_token_id=0, eos_token_id=None)
    assert out.shape == (4, ids.shape[1] + 17)
    for row, prompt in enumerate(prompts):
        assert out[row, ids.shape[1]:].tolist() == solo(target, prompt, 17, eos_token_id=None)
    assert len(drafter.batch_generation_stats) == 4 and drafter.generation_stats.num_rounds > 0


def test_copies_of_a_prompt_are_prefilled_once(monkeypatch):
    """Rows that repeat a prompt (generate's `num_return_sequences`) share one prefill row; each still decodes as its
    solo generation, and sampled copies still draw their own tokens."""
    target = make_target("llama", seed=3)
    drafter = make_drafter(target, block_size=4)
    prefill_rows = []
    original = batched.engine_forward

    def spy(target, input_ids, *args, **kwargs):
        if input_ids.shape[1] > 1 and not prefill_rows:
            prefill_rows.append(input_ids[:, -1].tolist())  # the first forward of the call is the prefill
        return original(target, input_ids, *args, **kwargs)

    monkeypatch.setattr(batched, "engine_forward", spy)
    prompts = [[5, 6, 7, 8], [12, 13], [5, 6, 7, 8], [5, 6, 7, 8], [12, 13]]
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=12,
                          pad_token_id=0, eos_token_id=None)
    assert prefill_rows == [[8, 13]]
    for row, prompt in enumerate(prompts):
        assert out[row, ids.shape[1]:].tolist() == solo(target, prompt, 12, eos_token_id=None)
    prefill_rows.clear()
    torch.manual_seed(0)
    sampled = target.generate(torch.tensor([[5, 6, 7, 8]]), assistant_model=drafter, do_sample=True,
                              num_return_sequences=4, max_new_tokens=12, pad_token_id=0, eos_token_id=None)
    assert prefill_rows == [[8]] and len({tuple(row) for row in sampled[:, 4:].tolist()}) > 1


def test_rows_finish_at_different_times_on_eos():
    target = make_target("llama", seed=2)
    drafter = make_drafter(target, block_size=4)
    prompts = [[3, 4, 5], [50, 51], [9, 8, 7, 6]]
    # An EOS the first row emits early: the other rows keep going (or stop at their own EOS).
    eos = solo(target, prompts[0], 5, eos_token_id=None)[2]
    expected = [solo(target, p, 20, eos_token_id=eos) for p in prompts]
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=20,
                          pad_token_id=0, eos_token_id=eos)
    for row, tokens in enumerate(expected):
        generated = out[row, ids.shape[1]:].tolist()
        assert generated[: len(tokens)] == tokens
        assert all(t == 0 for t in generated[len(tokens):])  # padded after its EOS, like transformers
    assert len({len(t) for t in expected}) > 1


def test_a_request_joining_mid_run_is_unaffected():
    target = make_target("qwen3", seed=8)
    drafter = make_drafter(target, block_size=3)
    engine = DSparkBatchEngine(target, drafter, pad_token_id=0)
    first = [engine.add_request([4, 5, 6, 7, 8, 9], 14), engine.add_request([33], 9)]
    engine.step()
    engine.step()
    late = engine.add_request([21, 22, 23, 24, 25, 26, 27, 28, 29], 12)  # longer than every cached row
    engine.step()
    late_short = engine.add_request([2, 3], 6)
    engine.run()
    for request in first + [late, late_short]:
        assert request.finished
        assert request.output_ids == solo(target, request.prompt_ids, request.max_new_tokens, eos_token_id=None)


def test_target_only_engine_matches_plain_decoding():
    target = make_target("llama", seed=4)
    engine = DSparkBatchEngine(target, None, pad_token_id=0)
    prompts = [[5, 9], [1, 2, 3, 4, 5, 6], [60]]
    requests = [engine.add_request(p, 11) for p in prompts]
    engine.run()
    assert [r.output_ids for r in requests] == [solo(target, p, 11, eos_token_id=None) for p in prompts]


def test_batched_drafts_are_the_solo_drafts():
    """Same accept lengths as the batch-1 generate path: the drafter sees the same context and positions."""
    target = make_target("llama", seed=1)
    drafter = make_drafter(target, block_size=4)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20]]
    engine = DSparkBatchEngine(target, drafter, pad_token_id=0)
    requests = [engine.add_request(p, 15) for p in prompts]
    engine.run()
    for prompt, request in zip(prompts, requests):
        target.generate(torch.tensor([prompt]), assistant_model=drafter, do_sample=False, max_new_tokens=15,
                        eos_token_id=None, pad_token_id=0)
        assert request.stats.accept_lengths == drafter.generation_stats.accept_lengths


def test_a_drafter_that_sat_out_plain_rounds_drafts_as_if_it_had_seen_them():
    """Plain rounds leave their target features pending (`_sync_context` ingests them before the next drafting pass,
    admission, row removal or compaction): the drafts equal those of an engine that ingests every round, and rows
    that join, leave and compact in between keep their context aligned."""
    target = make_target("llama", seed=4)
    drafter = make_drafter(target, block_size=3)

    def run(ingest_every_round: bool):
        engine = DSparkBatchEngine(target, drafter, policy="full", pad_token_id=0)
        rounds, begin, pending = itertools.count(), engine.policy.begin_round, []
        engine.policy.begin_round = lambda *args: begin(*args) and next(rounds) % 3 == 2  # draft every third round
        sync, advance = engine._sync_context, engine._advance
        engine._sync_context = lambda: pending.append(len(engine._pending_context)) or sync()
        if ingest_every_round:
            engine._advance = lambda *args: advance(*args) or sync()
        prompts, lengths = [[5, 6, 7], [9, 10, 11, 12], [20], [3] * 9, [7, 8]], [14, 6, 11, 9, 12]
        requests = [engine.add_request(p, n) for p, n in zip(prompts[:3], lengths[:3])]
        while engine.active or engine.waiting:
            for _ in engine.step():
                if len(requests) < len(prompts):
                    requests.append(engine.add_request(prompts[len(requests)], lengths[len(requests)]))
        return requests, max(pending)

    requests, most_pending = run(ingest_every_round=False)
    reference, _ = run(ingest_every_round=True)
    assert most_pending >= 2  # rounds' features did wait for a drafting pass
    for request, expected in zip(requests, reference):
        assert [r.draft_ids for r in request.stats.rounds] == [r.draft_ids for r in expected.stats.rounds]
        assert any(r.draft_ids for r in request.stats.rounds)
        assert request.output_ids == solo(target, request.prompt_ids, request.max_new_tokens, eos_token_id=None)


def test_pending_drafter_context_is_bounded():
    """A drafter that never drafts (plain decoding all along) still ingests its context every `MAX_PENDING_SLOTS`
    slots, so the features kept for it stay bounded."""
    target = make_target("llama", seed=5)
    engine = DSparkBatchEngine(target, make_drafter(target, block_size=3), policy="full", pad_token_id=0)
    begin = engine.policy.begin_round
    engine.policy.begin_round = lambda *args: begin(*args) and False
    request = engine.add_request([5, 6, 7], batched.MAX_PENDING_SLOTS * 2 + 10)
    most = 0
    while not request.finished:
        engine.step()
        most = max(most, sum(part.shape[1] for part, _ in engine._pending_context))
    assert most == batched.MAX_PENDING_SLOTS - 1
    pending = sum(part.shape[1] for part, _ in engine._pending_context)
    assert engine.draft_cache.get_seq_length() + pending == engine.cache.get_seq_length()  # level once synced
    assert request.output_ids == solo(target, [5, 6, 7], request.max_new_tokens, eos_token_id=None)


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 1000),
    prompts=st.lists(st.lists(st.integers(3, 96), min_size=1, max_size=9), min_size=2, max_size=5),
    max_new_tokens=st.integers(1, 16),
    block_size=st.integers(1, 6),
)
def test_batched_greedy_property(seed, prompts, max_new_tokens, block_size):
    target = make_target("llama", seed=seed)
    drafter = make_drafter(target, seed=seed + 1, block_size=block_size)
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                          max_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=None)
    for row, prompt in enumerate(prompts):
        assert out[row, ids.shape[1]:].tolist() == solo(target, prompt, max_new_tokens, eos_token_id=None)


def test_batched_sampling_stops_at_eos_or_budget_and_repeats_with_the_seed():
    """Sampled rows of different prompt lengths keep their prompt, stop at their first EOS (padding after it) or at the
    length budget, draft and accept, and come out the same again under the same seed."""
    target = make_target("llama", seed=3, vocab_size=8)  # 8 tokens: the EOS is sampled often, drafts accepted
    drafter = make_drafter(target, block_size=4)
    ids, mask = left_pad([[5, 6], [7, 3, 4, 6], [3], [4, 4, 5], [6, 7], [5]])
    kwargs = dict(attention_mask=mask, assistant_model=drafter, do_sample=True, max_new_tokens=10, pad_token_id=0,
                  eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    out = target.generate(ids, **kwargs)
    assert torch.equal(out[:, : ids.shape[1]], ids)
    ends = []
    for row, stats in zip(out[:, ids.shape[1]:].tolist(), drafter.batch_generation_stats):
        end = row.index(2) + 1 if 2 in row[:10] else 10
        assert set(row[end:]) <= {0} and len(row) <= 10
        assert end == 1 or sum(len(r.draft_ids) for r in stats.rounds) > 0  # a row whose first token is EOS drafts none
        ends.append(end)
    assert 10 in ends and min(ends) < 10, ends  # rows stopped by the budget and by the EOS
    assert sum(r.accepted for r in drafter.generation_stats.rounds) > 0
    torch.manual_seed(0)
    assert torch.equal(target.generate(ids, **kwargs), out)


def _run_and_compare_with_solo(engine, max_new_tokens):
    """Runs four mixed-length prompts together; each row must equal the target's solo greedy output."""
    prompts = [[5, 6, 7], [9, 10, 11, 12], [20], [30, 31]]
    requests = [engine.add_request(p, max_new_tokens) for p in prompts]
    engine.run()
    for prompt, request in zip(prompts, requests):
        assert request.output_ids == solo(engine.target, prompt, max_new_tokens, eos_token_id=None)
    return requests


@pytest.mark.parametrize("policy", ["threshold", "hardware_aware"])
def test_batched_policies_stay_lossless(policy):
    from dspark_hf.generation.policies import HardwareAwarePolicy, ThresholdPolicy

    target = make_target("llama", seed=6)
    drafter = make_drafter(target, block_size=4)
    chosen = (ThresholdPolicy(0.5) if policy == "threshold"
              else HardwareAwarePolicy({1: 10.0, 2: 9.0, 3: 8.5, 5: 8.0}, draft_seconds=0.0))
    requests = _run_and_compare_with_solo(DSparkBatchEngine(target, drafter, policy=chosen, pad_token_id=0), 13)
    verified = {r.verified for request in requests for r in request.stats.rounds}
    assert len(verified) > 1 or verified != {drafter.config.block_size}  # the policy really cut drafts


def test_batched_fixed_length_policy_verifies_that_many_drafts():
    from dspark_hf.generation.policies import FixedLengthPolicy

    target = make_target("llama", seed=6)
    drafter = make_drafter(target, block_size=4)
    requests = _run_and_compare_with_solo(DSparkBatchEngine(target, drafter, policy=FixedLengthPolicy(2),
                                                            pad_token_id=0), 13)  # fmt: skip
    # 2 drafts a round, fewer only where the length budget is shorter
    assert {r.verified for request in requests for r in request.stats.rounds[:-1]} == {2}


def test_batched_hardware_aware_skips_a_costly_drafter_and_stays_lossless():
    from dspark_hf.generation.policies import HardwareAwarePolicy

    target = make_target("llama", seed=6)
    drafter = make_drafter(target, block_size=4)
    drafter.config.confidence_temperatures = [0.03] * 4  # spread the random head's confidences over (0, 1)
    calls = []
    drafter.register_forward_pre_hook(lambda module, args: calls.append(1))
    # drafting costs 0.1 decode step per row: only confident rows are worth it
    policy = HardwareAwarePolicy({1: 10.0, 2: 9.0, 3: 8.5, 5: 8.0}, draft_seconds=0.01, max_idle_rounds=2)
    requests = _run_and_compare_with_solo(DSparkBatchEngine(target, drafter, policy=policy, pad_token_id=0), 20)
    rounds = requests[0].stats.rounds
    skipped = sum(not r.drafted for r in rounds)
    assert 0 < skipped < len(rounds)
    assert len(calls) == len(rounds) - skipped  # a skipped round never runs the drafter's block forward
    steps = policy.speed_model.step_seconds  # the engine's planner shares the policy's speed model
    assert steps and all(seconds > 0 for seconds in steps.values())  # steps timed


def test_plan_verification_width_weighs_the_drafting_cost():
    from dspark_hf.scheduling import plan_verification_width

    speeds = {1: 10.0, 2: 9.0, 3: 8.5}.get
    assert plan_verification_width([[0.5, 0.5]] * 2, speeds, 3) == 3
    assert plan_verification_width([[0.5, 0.5]] * 2, speeds, 3, draft_seconds=0.06) == 1


def test_plan_verification_width_reads_the_whole_curve():
    from dspark_hf.scheduling import plan_verification_width

    cliff = {1: 10.0, 2: 4.0, 3: 3.8, 4: 3.6, 5: 3.5, 6: 3.4, 7: 3.3, 8: 3.2}.get
    # A cliff after 1 token: Algorithm 1's early stop would never verify; the global search sees the gain at 8.
    assert plan_verification_width([[0.99] * 7], cliff, 8) == 8
    assert plan_verification_width([[0.99] * 7], cliff, 8, early_stop=True) == 1  # Algorithm 1 stops at the cliff
    gentle = {1: 10.0, 2: 9.5, 3: 9.0, 4: 5.0}.get
    assert plan_verification_width([[0.9, 0.9, 0.9]], gentle, 4, early_stop=True) == 3
    assert plan_verification_width([[0.5, 0.2] + [0.0] * 5], cliff, 8) == 1
    # More rows amortize the cliff differently: a table for 4 rows.
    flat = {1: 5.0, 2: 3.9, 3: 3.8, 4: 3.6}.get
    assert plan_verification_width([[0.5, 0.2, 0.1]] * 4, flat, 4) == 3
    assert plan_verification_width([[0.9] * 3], lambda w: None if w > 2 else 1.0, 4) == 2


def test_bench_load_closed_loop_counts_every_request():
    from dspark_hf.benchmarks.bench_load import run_level

    target = make_target("llama", seed=2)
    drafter = make_drafter(target, block_size=3)
    for engine in (DSparkBatchEngine(target, None, pad_token_id=0), DSparkBatchEngine(target, drafter, pad_token_id=0)):
        row = run_level(engine, [[5, 6, 7], [8, 9]], concurrency=3, num_requests=7, max_new_tokens=6)
        assert row["requests"] == 7 and row["tokens"] == 7 * 6
        assert row["throughput_tok_s"] > 0 and row["tau"] >= 1.0
        # Full load = the steps with 3 rows; the drain once the queue is empty is not counted.
        assert 0 < row["full_load_tokens"] < 7 * 6 and row["full_load_steps"] < row["steps"]
        assert row["full_load_throughput_tok_s"] > 0
        # the engine's own timings at full load, for cost models: steps by width, drafting passes, admissions
        assert row["full_load_step_seconds"] and all(w >= 1 and t > 0 for w, t in row["full_load_step_seconds"])
        assert bool(row["full_load_draft_seconds"]) == (engine.drafter is not None)
        assert sum(requests for requests, _, _ in row["admissions"]) == 7
        if engine.drafter is None:  # equal-length requests finish together: two full waves, then the drain
            # 5 steps per wave: the first commits the prefill's token and one decoded token
            assert row["full_load_tokens"] == 6 * 6 and row["full_load_steps"] == 2 * 5


def test_bench_load_step_clock_counts_only_running_time():
    from dspark_hf.benchmarks.bench_load import StepClock

    now = [10.0]
    clock = StepClock(timer=lambda: now[0])
    now[0] = 12.0  # paused: the time before the first step does not count
    assert clock() == 10.0
    with clock.running():
        now[0] = 13.5
        assert clock() == 11.5  # runs while stepping
    now[0] = 20.0  # another engine's step
    assert clock() == 11.5
    with clock.running():
        now[0] = 21.0
    assert clock() == 12.5


def test_bench_load_interleaved_loops_match_separate_runs():
    from dspark_hf.benchmarks.bench_load import StepClock, run_level, run_level_interleaved

    target = make_target("llama", seed=2)
    drafter = make_drafter(target, block_size=3)
    prompts, budgets = [[5, 6, 7], [8, 9], [3, 4, 5, 6]], [6, 4, 7, 5, 6]

    def engines():
        return [DSparkBatchEngine(target, None, pad_token_id=0), DSparkBatchEngine(target, drafter, pad_token_id=0),
                DSparkBatchEngine(target, drafter, pad_token_id=0, prompt_lookup_num_tokens=3)]

    alone = [run_level(engine, prompts, 2, 5, budgets) for engine in engines()]
    stepped = engines()
    began = time.perf_counter()
    together = run_level_interleaved(stepped, prompts, 2, 5, budgets, rotation=1)
    wall = time.perf_counter() - began
    for row, expected, engine in zip(together, alone, stepped):
        assert isinstance(engine.clock, StepClock)
        assert row["outputs"] == expected["outputs"] and row["prompt_ids"] == expected["prompt_ids"]
        assert row["requests"] == 5 and row["steps"] == expected["steps"] and row["tau"] == expected["tau"]
        # each loop's time is its own steps' (plus their bookkeeping), never the whole interleaved run's
        assert 0 < row["full_load_seconds"] <= row["seconds"]
    # the clocks count disjoint stretches of the interleaved run: together no more than its wall time
    assert sum(row["seconds"] for row in together) <= wall


def test_bench_load_budgets_spread_and_apply_per_request():
    from dspark_hf.benchmarks.bench_load import request_budgets, run_level

    assert request_budgets(48, 0.0, 3, seed=0) == [48, 48, 48]
    budgets = request_budgets(48, 0.5, 200, seed=1)
    assert min(budgets) >= 24 and max(budgets) <= 72 and len(set(budgets)) > 20  # spread over the range
    assert budgets == request_budgets(48, 0.5, 200, seed=1)  # seeded: every method serves the same requests
    target = make_target("llama", seed=2)
    row = run_level(DSparkBatchEngine(target, None, pad_token_id=0), [[5, 6, 7], [8, 9]], concurrency=2,
                    num_requests=4, max_new_tokens=[3, 6, 2, 5])
    assert sorted(map(len, row["outputs"])) == [2, 3, 5, 6] and row["tokens"] == 16


def test_bench_load_pools_passes_by_totals():
    from dspark_hf.benchmarks.bench_load import pool_passes

    a = {"concurrency": 4, "requests": 8, "tokens": 400, "seconds": 10.0, "throughput_tok_s": 40.0,
         "per_request_tok_s": 10.0, "tau": 2.0, "mean_verified": 3.0, "rounds": 100, "skipped_rounds": 10,
         "full_load_tokens": 300, "full_load_seconds": 5.0, "full_load_throughput_tok_s": 60.0, "full_load_steps": 40,
         "steps": 60}
    b = {**a, "tokens": 400, "seconds": 30.0, "throughput_tok_s": 400 / 30.0, "per_request_tok_s": 4.0, "tau": 1.0,
         "rounds": 300, "skipped_rounds": 0, "mean_verified": 1.0, "full_load_tokens": 100, "full_load_seconds": 15.0,
         "full_load_throughput_tok_s": 100 / 15.0}
    row = pool_passes([a, b])
    assert row["throughput_tok_s"] == 20.0  # 800 tokens in 40 s, not the mean of the two rates
    assert row["full_load_throughput_tok_s"] == 20.0 and row["pass_full_load_throughputs_tok_s"][0] == 60.0
    assert row["full_load_steps"] == 80 and row["steps"] == 120
    assert row["per_request_tok_s"] == 7.0 and row["tau"] == 1.25 and row["mean_verified"] == 1.5
    assert row["passes"] == 2 and row["skipped_rounds"] == 10 and row["pass_throughputs_tok_s"][0] == 40.0
    timings = {"full_load_step_seconds": [(1, 0.1), (1, 0.3), (3, 0.2)], "full_load_draft_seconds": [0.05],
               "admissions": [[4, 20, 0.5]]}
    row = pool_passes([{**a, **timings}, {**b, **timings, "full_load_step_seconds": [(1, 0.2)]}])
    assert row["full_load_step_seconds_by_width"] == {"1": {"median": 0.2, "count": 3},
                                                      "3": {"median": 0.2, "count": 1}}
    assert row["full_load_draft_seconds"] == {"median": 0.05, "count": 2} and len(row["admissions"]) == 2


def test_compact_slots_right_aligns_each_rows_valid_slots():
    from transformers import DynamicCache

    from dspark_hf.generation.cache_ops import compact_slots

    mask = torch.tensor([[0, 1, 0, 1, 1, 0], [1, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    keys = torch.arange(3 * 6, dtype=torch.float32).reshape(3, 1, 6, 1).expand(3, 2, 6, 4).clone()
    cache = DynamicCache()
    cache.update(keys, -keys, 0)
    new_mask = compact_slots([cache, None], mask)
    assert new_mask.tolist() == [[True] * 3, [False, True, True], [False, False, True]]
    kept = cache.layers[0].keys[:, 0, :, 0]
    assert kept[0].tolist() == [1.0, 3.0, 4.0]  # order kept
    assert kept[1, 1:].tolist() == [6.0, 10.0] and kept[2, 2:].tolist() == [17.0]
    assert torch.equal(cache.layers[0].values, -cache.layers[0].keys)


def test_select_slots_picks_each_rows_slots_from_a_view_of_a_larger_buffer():
    from dspark_hf.generation.cache_ops import select_slots

    buffer = torch.randn(3, 2, 9, 4)  # the engine's caches are views of the first slots of a larger buffer
    states = buffer[:, :, :6]
    order = torch.tensor([[1, 3, 4], [0, 0, 5], [2, 4, 5]])
    expected = states.gather(2, order[:, None, :, None].expand(3, 2, 3, 4))
    picked = select_slots(states, order)
    assert picked.is_contiguous() and torch.equal(picked, expected)


def test_engine_compacts_holes_and_stays_identical(monkeypatch):
    from dspark_hf.generation import cache_ops

    calls = []
    original = cache_ops.compact_slots
    monkeypatch.setattr(cache_ops, "compact_slots", lambda *args: calls.append(1) or original(*args))
    target = make_target("qwen3", seed=21, vocab_size=8)  # 8 tokens: random drafts are sometimes accepted
    drafter = make_drafter(target, block_size=6)  # rows accept different numbers of drafts: holes
    prompts = [[5, 6, 7], [3, 4, 5, 6, 7, 3, 4, 5], [6], [3, 7]]
    engine = DSparkBatchEngine(target, drafter, policy="full", pad_token_id=0)
    requests = [engine.add_request(p, 30) for p in prompts]
    engine.run()
    assert calls  # the holes were squeezed out at least once
    for prompt, request in zip(prompts, requests):
        assert request.output_ids == solo(target, prompt, 30, eos_token_id=None)


@pytest.mark.parametrize("with_drafter", [True, False])
def test_more_arrivals_than_free_rows_with_short_prompts(with_drafter):
    """One admission where some new requests take over finished rows and the others are appended, with prompts
    shorter than the slot axis (their prefilled cache was left-padded twice, and the append failed)."""
    target = make_target("llama", seed=9)
    engine = DSparkBatchEngine(target, make_drafter(target, block_size=3) if with_drafter else None,
                               policy="full" if with_drafter else None, pad_token_id=0)
    early = [engine.add_request(list(range(40, 60)), 2), engine.add_request(list(range(60, 80)), 12)]
    while not early[0].finished:
        engine.step()
    late = [engine.add_request(p, 6) for p in ([5, 6, 7], [8, 9], [10, 11, 12, 13])]  # 3 requests, 1 free row
    engine.run()
    for request in early + late:
        assert request.output_ids == solo(target, request.prompt_ids, request.max_new_tokens, eos_token_id=None)


def test_new_requests_take_over_finished_rows_in_place(monkeypatch):
    """Closed loop: whenever a request finishes, a new one arrives; it takes over the freed row (no row removal and
    append), including prompts longer than the current slot axis, and every output equals solo generation."""
    taken, removed = [], []
    original_take_over, original_select = DSparkBatchEngine._take_over, DSparkBatchEngine._select_rows
    monkeypatch.setattr(DSparkBatchEngine, "_take_over",
                        lambda self, rows, *args: taken.append(len(rows)) or original_take_over(self, rows, *args))
    monkeypatch.setattr(DSparkBatchEngine, "_select_rows",
                        lambda self, keep: removed.append(len(keep)) or original_select(self, keep))
    target = make_target("llama", seed=31, vocab_size=8)
    drafter = make_drafter(target, block_size=4)
    prompts = [[5, 6, 7], [3, 4], [6, 6, 6, 6, 6], [7], [3] * 40, [4, 5], [6, 7, 3], [5] * 12]
    lengths = [9, 5, 12, 7, 6, 10, 4, 8]
    engine = DSparkBatchEngine(target, drafter, pad_token_id=0)
    queue = list(zip(prompts, lengths))
    requests = [engine.add_request(*queue.pop(0)) for _ in range(3)]
    while engine.active or engine.waiting:
        for _ in engine.step():
            if queue:
                requests.append(engine.add_request(*queue.pop(0)))
    assert sum(taken) >= 4  # most arrivals reused a row
    for (prompt, length), request in zip(zip(prompts, lengths), requests):
        assert request.output_ids == solo(target, prompt, length, eos_token_id=None), request.request_id


@pytest.mark.parametrize("wait", [2, "auto"])
@pytest.mark.parametrize("with_drafter", [True, False])
def test_held_back_arrivals_are_admitted_together_and_stay_identical(with_drafter, wait, monkeypatch):
    """`admission_wait_rounds=2` (and "auto": the next rows finish within a few rounds): requests arriving in
    successive rounds while others decode wait (their predecessors' finished rows kept, computed and dropped) and are
    prefilled in one admission, at most 2 rounds late, taking the kept rows over; every output still equals solo
    generation."""
    appended = []
    original_merge = DSparkBatchEngine._merge
    monkeypatch.setattr(DSparkBatchEngine, "_merge",
                        lambda self, requests, *args: appended.append(len(requests)) or original_merge(
                            self, requests, *args))
    target = make_target("llama", seed=12)
    drafter = make_drafter(target, block_size=3) if with_drafter else None
    engine = DSparkBatchEngine(target, drafter, policy="full" if with_drafter else None, pad_token_id=0,
                               admission_wait_rounds=wait)
    outcomes = []
    if with_drafter:
        end_round = engine.policy.end_round
        engine.policy.end_round = lambda outcome: outcomes.append(outcome) or end_round(outcome)
    long = engine.add_request(list(range(30, 50)), 40)
    short = [engine.add_request([5 + i, 6, 7], 2 + i) for i in range(3)]  # finish in successive early rounds
    done = engine.step()
    assert [r.request_id for r in engine.active] == [0, 1, 2, 3]  # nothing decoded yet: admitted at once
    late, waits = [], []
    while engine.active or engine.waiting:
        for request in done:
            if request in short:
                late.append(engine.add_request([9, 8, 7, 6][: 2 + len(late)], 5))
        if engine.waiting:
            waits.append(engine._waited_rounds)
        done = engine.step()
    assert max(waits) <= 2
    assert appended == [4]  # only the first admission appended rows: the late arrivals took the kept rows over
    joined = [requests for requests, _, _ in engine.admit_timings]
    assert joined[0] == 4 and sum(joined[1:]) == 3 and len(joined) < 4  # late arrivals shared a prefill
    # the policy hears which rows were kept: they commit nothing and show no confidences
    kept = [(outcome, row) for outcome in outcomes for row, idle in enumerate(outcome.held or []) if idle]
    assert bool(kept) == with_drafter  # (target-only decoding has no policy)
    assert all(outcome.accepted[row] == 0 and outcome.confidences[row] == [] for outcome, row in kept)
    for request in [long, *short, *late]:
        assert request.output_ids == solo(target, request.prompt_ids, request.max_new_tokens, eos_token_id=None)


@pytest.mark.parametrize("lookup", [None, 4])
def test_held_back_arrivals_with_sampling_and_lookup(lookup):
    """Kept rows in sampling rounds (their drafts sampled along, never verified) and with prompt lookup: every request
    still gets exactly its budget (no EOS), in a closed loop that keeps arrivals waiting."""
    torch.manual_seed(0)
    target = make_target("llama", seed=13)
    engine = DSparkBatchEngine(target, make_drafter(target, block_size=3), policy="full", do_sample=True,
                               pad_token_id=0, admission_wait_rounds=2, prompt_lookup_num_tokens=lookup)
    budgets = [3, 9, 4, 7, 5, 6, 8, 2]
    requests = [engine.add_request([5, 6, 7, 5, 6], n) for n in budgets[:3]]
    held = 0
    while engine.active or engine.waiting:
        held += bool(engine.waiting) and not engine._admission_due()  # this step keeps rows for waiting requests
        for _ in engine.step():
            if len(requests) < len(budgets):
                requests.append(engine.add_request([8, 9, 8, 9], budgets[len(requests)]))
    assert held > 0
    assert [len(r.output_ids) for r in requests] == budgets


def test_admission_wait_never_holds_a_request_while_nothing_decodes():
    target = make_target("llama", seed=12)
    engine = DSparkBatchEngine(target, None, pad_token_id=0, admission_wait_rounds=5)
    first = engine.add_request([5, 6, 7], 2)
    engine.run()
    second = engine.add_request([8, 9], 3)
    engine.step()  # the engine is empty: admitted at once, not after 5 rounds
    assert engine.active == [second] and len(engine.admit_timings) == 2
    engine.run()
    assert first.output_ids == solo(target, [5, 6, 7], 2, eos_token_id=None)
    assert second.output_ids == solo(target, [8, 9], 3, eos_token_id=None)
    for bad in (-1, "soon", 1.5, True):
        with pytest.raises(ValueError, match="admission_wait_rounds must be an int >= 0 .* or 'auto', got"):
            DSparkBatchEngine(target, None, admission_wait_rounds=bad)


def _requests(remaining: list[int | None]) -> list[DSparkRequest]:
    """Rows with these new-token budgets left (`None`: finished, its row kept for a waiting request)."""
    requests = []
    for index, left in enumerate(remaining):
        request = DSparkRequest(index, [1, 2], 10, output_ids=[3] * (10 - (left or 0)), finished=left is None)
        requests.append(request)
    return requests


def test_auto_admission_waits_only_while_idle_rows_cost_less_than_a_prefill():
    """"auto" holds waiting requests while each has a finished row to take over and (rounds waited + fewest tokens any
    decoding row has left) x (finished rows) <= rows, never past `AUTO_MAX_WAIT_ROUNDS`; an int keeps its meaning."""
    from dspark_hf.generation.batched import AUTO_MAX_WAIT_ROUNDS, admission_is_due

    rows = _requests([None, 3, 9, 9])  # 1 finished row of 4; the next finishes within 3 rounds
    assert not admission_is_due(rows, 1, 0, "auto")  # 3 idle row-rounds <= 4 rows: wait for it
    assert not admission_is_due(rows, 1, 1, "auto")  # 4 <= 4
    assert admission_is_due(rows, 1, 2, "auto")  # 5 > 4: a prefill of its own is cheaper now
    assert admission_is_due(rows, 2, 0, "auto")  # two waiting, one free row: the batch grows, no wait
    assert admission_is_due(_requests([None, None, 3, 9]), 2, 0, "auto")  # 2 rows idle x 3 rounds > 4
    assert not admission_is_due(_requests([None, None, 1, 9]), 2, 0, "auto")
    assert admission_is_due(_requests([None, None, None, None]), 1, 0, "auto")  # nothing decodes: at once
    assert not admission_is_due(rows, 0, 0, "auto")  # nobody waits
    wide = _requests([None] + [AUTO_MAX_WAIT_ROUNDS + 1] * 63)
    assert admission_is_due(wide, 1, 0, "auto")  # cheap to hold, but not past the cap on time to first token
    assert not admission_is_due(_requests([None] + [AUTO_MAX_WAIT_ROUNDS] * 63), 1, 0, "auto")
    assert not admission_is_due(rows, 1, 1, 2) and admission_is_due(rows, 1, 2, 2)  # an int: that many rounds
    assert admission_is_due(rows, 1, 0, 0)


def test_appending_layer_behaves_like_concatenation():
    from dspark_hf.generation.cache_ops import AppendingLayer

    layer, reference = AppendingLayer(), []
    chunks = [torch.randn(2, 3, n, 4) for n in (5, 1, 3, 1, 70, 2)]
    for i, chunk in enumerate(chunks):
        keys, values = layer.update(chunk, -chunk)
        reference.append(chunk)
        assert torch.equal(keys, torch.cat(reference, dim=2)) and torch.equal(values, -keys)
        if i == 1:
            buffer = layer._keys_buffer
        if i == 2:
            assert layer._keys_buffer is buffer  # appended in place, no new tensor
    layer.crop(-3)  # a crop keeps the view; the next append overwrites the cropped slots
    reference[-1] = reference[-1][:, :, :0]
    reference[-2] = reference[-2][:, :, :-1]
    new = torch.randn(2, 3, 2, 4)
    keys, _ = layer.update(new, -new)
    assert torch.equal(keys, torch.cat(reference + [new], dim=2))
    layer.keys, layer.values = layer.keys[[1, 0]], layer.values[[1, 0]]  # replaced by a row selection: reallocates
    more = torch.randn(2, 3, 1, 4)
    keys, _ = layer.update(more, -more)
    assert torch.equal(keys, torch.cat([torch.cat(reference + [new], dim=2)[[1, 0]], more], dim=2))


def test_requests_are_checked_when_they_are_added(target, drafter):
    """Bad prompts get a one-line error at `add_request`, not an IndexError inside a later step that takes the other
    requests down with it; a tokenizer's `(1, seq)` row is one prompt."""
    engine = DSparkBatchEngine(target, drafter, pad_token_id=0)
    bad = {
        "Empty prompt": ([], 4),
        "max_new_tokens must be >= 1": ([5, 6], 0),
        r"outside the target's vocabulary \[0, 97\) or not integers: \[300\]": (torch.tensor([5, 300]), 4),
        r"a torch.float32 tensor of shape \(2,\)": (torch.tensor([5.0, 6.0]), 4),
        r"shape \(2, 2\). Add each row of a batch as a request of its own": (torch.tensor([[5, 6], [7, 8]]), 4),
    }
    for message, (prompt, max_new_tokens) in bad.items():
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, max_new_tokens)
    request = engine.add_request(torch.tensor([[5, 9, 14]]), 6)
    engine.run()
    assert request.prompt_ids == [5, 9, 14] and request.output_ids == solo(target, [5, 9, 14], 6)
