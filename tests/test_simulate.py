"""`dspark-hf trace` and `dspark-hf simulate`: teacher-forced traces equal what the live generator computes, replayed
policies take exactly the live rounds (batch 1 and batched engine), and simulated seconds follow the cost model."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf.benchmarks.bench_load import run_level
from dspark_hf.generation import candidate_generator
from dspark_hf.generation.batched import DSparkBatchEngine
from dspark_hf.generation.policies import FixedLengthPolicy
from dspark_hf.simulation.cost import KneeCost, ProfileCost, load_cost_model
from dspark_hf.simulation.replay import SimulatedBatchEngine, replay_generation, replay_prompt_lookup
from dspark_hf.simulation.simulate import main as simulate_main
from dspark_hf.simulation.simulate import make_lookup, make_policy, simulate_closed_loop
from dspark_hf.simulation.trace import Trace, TraceSequence, retrace, trace_sequence


PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 40, 41, 42], [1, 17, 3, 3, 60, 61, 62, 63]]
MAX_NEW_TOKENS = 40
TICK = 0.004  # seconds per clock reading: a drafting pass and a verification step each take one tick
SPS = {1: 100.0, 2: 95.0, 3: 92.0, 4: 90.0, 5: 60.0}
POLICIES = ["full", "fixed:1", "fixed:3", "threshold", "threshold_cumulative", "hardware_aware", "hardware_aware:0",
            "algorithm1"]


class TickClock:
    """Advances by `TICK` at every reading, so every measured duration between two readings is one tick."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += TICK
        return self.now


@pytest.fixture(scope="module")
def models():
    """A tiny target whose EOS is a token its greedy output of the second prompt writes mid-way, so that outputs end
    early and the engine sees drafts accepted past an EOS."""
    target = make_target()
    ids = torch.tensor([PROMPTS[1]])
    eos = int(target.generate(ids, do_sample=False, max_new_tokens=20, pad_token_id=0)[0, -1])
    target.generation_config.eos_token_id = eos
    return target, make_drafter(target), eos


def _live_generate(target, drafter, prompt, policy, **kwargs):
    drafter.verification_policy = policy
    ids = torch.tensor([prompt])
    output = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=False,
                             max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0, **kwargs)
    return output[0, len(prompt):].tolist(), drafter.generation_stats


@pytest.fixture(scope="module")
def trace(models):
    target, drafter, eos = models
    sequences = []
    for index, prompt in enumerate(PROMPTS):
        ids = torch.tensor([prompt])
        output = target.generate(ids, do_sample=False, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0)
        sequences.append(trace_sequence(target, drafter, prompt, output[0, len(prompt):].tolist(), [eos],
                                        MAX_NEW_TOKENS, prompt_id=f"p{index}", category="tiny", turn=0))
    assert any(len(s.output_ids) < MAX_NEW_TOKENS for s in sequences)  # an output ended at the EOS
    return Trace(drafter.config.block_size, MAX_NEW_TOKENS, [eos], sequences)


def test_trace_matches_live_generator(models, trace):
    target, drafter, _ = models
    for prompt, sequence in zip(PROMPTS, trace.sequences):
        output, stats = _live_generate(target, drafter, prompt, "full")
        assert output == sequence.output_ids
        committed = 1
        for round_stats in stats.rounds:
            assert sequence.draft_ids[committed - 1][: round_stats.verified] == round_stats.draft_ids
            # The trace's one-forward features and masked blocks round differently from the live forwards.
            computed = round_stats.confidences  # the whole block, or fewer slots near the length budget
            assert sequence.confidences[committed - 1][: len(computed)] == pytest.approx(computed, abs=1e-5)
            assert sequence.accepted(committed, round_stats.verified) >= round_stats.accepted
            committed += round_stats.accepted + 1


def test_retrace_drafts_the_same_outputs_again(models, trace):
    target, drafter, _ = models
    again = retrace(target, drafter, trace)
    assert [s.output_ids for s in again.sequences] == [s.output_ids for s in trace.sequences]
    assert [s.draft_ids for s in again.sequences] == [s.draft_ids for s in trace.sequences]
    assert [s.accept_lengths for s in again.sequences] == [s.accept_lengths for s in trace.sequences]
    other = retrace(target, make_drafter(target, seed=2), trace)  # another drafter, judged on the same outputs
    assert [s.prompt_id for s in other.sequences] == [s.prompt_id for s in trace.sequences]
    assert [s.draft_ids for s in other.sequences] != [s.draft_ids for s in trace.sequences]
    for sequence in other.sequences:  # A(c) is the drafts' agreement with the (unchanged) output
        reference = sequence.output_ids + sequence.continuation_ids
        for c, (block, accepted) in enumerate(zip(sequence.draft_ids, sequence.accept_lengths), start=1):
            assert block[:accepted] == reference[c:c + accepted]
            stopped = accepted == len(block) or c + accepted >= len(reference)
            assert stopped or block[accepted] != reference[c + accepted]


@pytest.mark.parametrize("spec", POLICIES)
def test_batch1_replay_takes_the_live_rounds(models, trace, spec, monkeypatch):
    """Every policy, one policy object over all prompts as `bench` keeps it, drafting timed by a tick clock."""
    target, drafter, eos = models
    monkeypatch.setattr(candidate_generator, "time", types.SimpleNamespace(perf_counter=TickClock().perf_counter))
    live_policy, simulated_policy = make_policy(spec, SPS, 0.5), make_policy(spec, SPS, 0.5)
    cost = KneeCost(forward_seconds=0.01, knee_tokens=10**6, draft_seconds=TICK)
    for prompt, sequence in zip(PROMPTS, trace.sequences):
        _, stats = _live_generate(target, drafter, prompt, live_policy)
        run = replay_generation(sequence, simulated_policy, cost, trace.block_size, MAX_NEW_TOKENS, [eos])
        assert [(r.verified, r.accepted, r.drafted) for r in run.rounds] == \
            [(r.verified, r.accepted, r.drafted) for r in stats.rounds]
        assert run.tau == (stats.accepted + stats.num_rounds) / stats.num_rounds


def test_prompt_lookup_replay_takes_transformers_rounds(models, trace, monkeypatch):
    """The simulator's `prompt_lookup` method is transformers' prompt lookup decoding: as many target forwards, each
    as wide."""
    target, _, eos = models
    widths, forward = [], target.forward
    monkeypatch.setattr(target, "forward", lambda *a, **k: widths.append(k["input_ids"].shape[1]) or forward(*a, **k))
    cost, accepted = KneeCost(forward_seconds=0.01, knee_tokens=10**6), 0
    for prompt, sequence in zip(PROMPTS, trace.sequences):
        widths.clear()
        ids = torch.tensor([prompt])
        output = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                                 max_new_tokens=MAX_NEW_TOKENS, prompt_lookup_num_tokens=4)
        assert output[0, len(prompt):].tolist() == sequence.output_ids
        run = replay_prompt_lookup(sequence, cost, MAX_NEW_TOKENS, [eos], num_tokens=4)
        assert [1 + r.verified for r in run.rounds] == widths[1:]  # after the prefill
        accepted += sum(r.accepted for r in run.rounds)
    assert accepted > 0


@pytest.mark.parametrize("spec", ["full+lookup", "hardware_aware+lookup"])
def test_batch1_replay_with_prompt_lookup_takes_the_live_rounds(models, trace, spec, monkeypatch):
    """Prompt lookup inside rounds: the replay chooses lookup drafts or the drafter round by round as the live
    generator does, and its lookup drafts are accepted as the trace's output says."""
    target, drafter, eos = models
    monkeypatch.setattr(candidate_generator, "time", types.SimpleNamespace(perf_counter=TickClock().perf_counter))
    sps = {**SPS, 6: 58.0, 7: 56.0}
    live_policy, simulated_policy = make_policy(spec, sps, 0.5), make_policy(spec, sps, 0.5)
    lookup = make_lookup(spec, 6, [eos])
    cost = KneeCost(forward_seconds=0.01, knee_tokens=10**6, draft_seconds=TICK)
    sources = set()
    for prompt, sequence in zip(PROMPTS, trace.sequences):
        _, stats = _live_generate(target, drafter, prompt, live_policy, prompt_lookup_num_tokens=6)
        run = replay_generation(sequence, simulated_policy, cost, trace.block_size, MAX_NEW_TOKENS, [eos], lookup)
        assert [(r.verified, r.accepted, r.drafted, r.source) for r in run.rounds] == \
            [(r.verified, r.accepted, r.drafted, r.source) for r in stats.rounds]
        sources.update(r.source for r in run.rounds)
    assert sources == {"lookup", "drafter"}


@pytest.mark.parametrize("spec", ["target", "full", "fixed:2", "threshold", "hardware_aware", "full+lookup",
                                  "hardware_aware+lookup", "prompt_lookup"])
def test_engine_replay_takes_the_live_rounds(models, trace, spec):
    """The batched engine under a closed loop of 2, live (tick clock) and simulated (one tick per pass and step);
    with prompt lookup, rows choose lookup drafts or the drafter's alike, and lookup drafts are accepted as the trace's
    output says."""
    target, drafter, eos = models
    tables = {1: SPS, 2: {w: s / 1.5 for w, s in SPS.items()}}
    live_policy, simulated_policy = make_policy(spec, SPS), make_policy(spec, SPS)
    lookup = 6 if spec.endswith("+lookup") or spec == "prompt_lookup" else None
    live = DSparkBatchEngine(target, drafter if live_policy else None, policy=live_policy, eos_token_id=eos,
                             steps_per_second_by_rows=tables, prompt_lookup_num_tokens=lookup)
    live.clock = TickClock().perf_counter
    cost = KneeCost(forward_seconds=TICK, knee_tokens=10**6, draft_seconds=TICK)
    simulated = SimulatedBatchEngine(trace.sequences, cost, trace.block_size, simulated_policy, [eos],
                                     steps_per_second_by_rows=tables, prompt_lookup_num_tokens=lookup)
    for engine in (live, simulated):
        run_level(engine, PROMPTS, 2, 5, MAX_NEW_TOKENS)
    assert [r.output_ids for r in live.finished] == [r.output_ids for r in simulated.finished]
    rounds = lambda engine: [[(x.verified, x.accepted, x.drafted, x.source) for x in r.stats.rounds]  # noqa: E731
                             for r in engine.finished]
    assert rounds(live) == rounds(simulated)
    if spec == "fixed:2":  # the engine verifies K drafts per round for fixed:K (not the whole block)
        assert {x[0] for r in rounds(live) for x in r} <= {0, 1, 2}
    if lookup:
        assert any(x[3] == "lookup" and x[1] > 0 for r in rounds(live) for x in r)


@pytest.mark.parametrize("spec", ["target", "full", "hardware_aware"])
def test_engine_replay_holds_arrivals_back_as_the_engine_does(models, trace, spec):
    """`admission_wait_rounds=2` in a closed loop of 3: the simulated engine admits (and keeps finished rows for the
    waiting requests) in the same rounds as the live one."""
    target, drafter, eos = models
    tables = {r: {w: s / r for w, s in SPS.items()} for r in (1, 2, 3)}
    live_policy, simulated_policy = make_policy(spec, SPS), make_policy(spec, SPS)
    live = DSparkBatchEngine(target, drafter if live_policy else None, policy=live_policy, eos_token_id=eos,
                             steps_per_second_by_rows=tables, admission_wait_rounds=2)
    live.clock = TickClock().perf_counter
    cost = KneeCost(forward_seconds=TICK, knee_tokens=10**6, draft_seconds=TICK)
    simulated = SimulatedBatchEngine(trace.sequences, cost, trace.block_size, simulated_policy, [eos],
                                     steps_per_second_by_rows=tables, admission_wait_rounds=2)
    admitted = {live: [], simulated: []}
    for engine in (live, simulated):
        admit = engine._admit
        engine._admit = lambda e=engine, admit=admit: admitted[e].append(len(e.waiting)) or admit()
        run_level(engine, PROMPTS, 3, 7, MAX_NEW_TOKENS)
    assert [r.output_ids for r in live.finished] == [r.output_ids for r in simulated.finished]
    assert [len(r.stats.rounds) for r in live.finished] == [len(r.stats.rounds) for r in simulated.finished]
    assert admitted[live] == admitted[simulated] and sum(admitted[live]) == 7


def _hand_made_sequence() -> TraceSequence:
    """10 output tokens; the drafter at every anchor proposes 3 drafts of which A(c) = 2 are right."""
    output = list(range(10, 20))
    drafts = [[*(output + [0])[c:c + 2], 99] for c in range(1, 10)]
    return TraceSequence("hand", "made", 0, [1, 2, 3], output, [], drafts, [[0.9, 0.9, 0.9]] * 9, [[2.0] * 3] * 9,
                         [2] * 9)


def test_cost_arithmetic_batch1():
    """fixed:2 on A = 2: rounds commit 3 tokens from committed 1, 4, 7, then 1 budget-cut round (c = 10 is the end)."""
    cost = KneeCost(forward_seconds=0.02, knee_tokens=2, draft_seconds=0.001, draft_seconds_per_slot=0.0005,
                    prefill_seconds_per_token=0.01)
    run = replay_generation(_hand_made_sequence(), FixedLengthPolicy(2), cost, 3, 10)
    assert [(r.verified, r.accepted) for r in run.rounds] == [(2, 2), (2, 2), (2, 2)]
    verify_3 = 0.02 * 3 / 2  # 3 tokens, past the 2-token knee
    expected = (0.02 + 0.03) + 3 * (0.001 + 2 * 0.0005 + verify_3)
    assert run.seconds == pytest.approx(expected)
    assert run.new_tokens == 10 and run.tau == 3.0
    target_only = replay_generation(_hand_made_sequence(), None, cost, 3, 10)
    assert target_only.seconds == pytest.approx(0.05 + 9 * 0.02)


def test_cost_arithmetic_under_load():
    """Target-only, 2 requests of 10 tokens in one closed loop of 2: one prefill and 9 two-row steps."""
    cost = ProfileCost(tables={1: {1: 50.0}, 2: {1: 40.0}}, scale=2.0)
    assert cost.verify_seconds(2, 1) == pytest.approx(2.0 / 40.0)
    assert cost.verify_seconds(4, 1) == pytest.approx(2.0 / 40.0 * 2)  # past the profile: proportional to rows
    sequence = _hand_made_sequence()
    trace = Trace(3, 10, [], [sequence])
    engine = SimulatedBatchEngine([sequence], cost, 3)
    result = run_level(engine, [sequence.prompt_ids], 2, 2, 10)
    assert result["seconds"] == pytest.approx(10 * 0.05)
    assert result["throughput_tok_s"] == pytest.approx(20 / 0.5)
    rows = simulate_closed_loop(trace, lambda: SimulatedBatchEngine([sequence], cost, 3), [2], 10, requests=2)
    assert rows[0]["throughput_tok_s"] == pytest.approx(40.0)


def test_simulate_command(tmp_path, capsys):
    sequence = _hand_made_sequence()
    Trace(3, 10, [], [sequence], {"command": "hand made"}).save(tmp_path / "t.json.gz")
    (tmp_path / "cost.json").write_text(json.dumps({"format": "dspark-hf-cost-model", "draft_seconds": 0.001,
                                                    "verify": {"kind": "knee", "forward_seconds": 0.01,
                                                               "knee_tokens": 4}}))
    assert isinstance(load_cost_model(tmp_path / "cost.json"), KneeCost)
    argv = ["--trace", str(tmp_path / "t.json.gz"), "--cost", str(tmp_path / "cost.json"), "--concurrency",
            "batch1,1,2", "--policies", "target,full,fixed:1,threshold,hardware_aware,algorithm1",
            "--output_dir", str(tmp_path / "out")]
    assert simulate_main(argv) == 0
    document = json.loads((tmp_path / "out" / "simulate.json").read_text())
    assert document["simulation"] is True and len(document["load"]) == 12
    open_loop = argv[:5] + ["2,4", "--arrivals", "poisson:20"] + argv[6:-1] + [str(tmp_path / "open")]
    assert simulate_main(open_loop) == 0
    rows = json.loads((tmp_path / "open" / "simulate.json").read_text())["load"]
    assert {r["concurrency"] for r in rows} == {2, 4} and all(r["requests"] == 8 for r in rows)
    assert all(r["latency_p50_s"] <= r["latency_p99_s"] for r in rows)
    assert simulate_main(argv[:3] + [str(tmp_path / "missing.json")] + argv[4:]) == 2
    assert "missing.json" in capsys.readouterr().err
    with_lookup = argv[:5] + ["batch1", "--policies", "target,prompt_lookup,hardware_aware,hardware_aware+lookup",
                              "--output_dir", str(tmp_path / "lookup")]
    assert simulate_main(with_lookup) == 0
    summary = json.loads((tmp_path / "lookup" / "simulate.json").read_text())["batch1"]["summary"]
    assert {row["method"] for row in summary} >= {"prompt_lookup", "hardware_aware", "hardware_aware+lookup"}
    assert simulate_main(argv[:5] + ["batch1,2"] + with_lookup[6:-1] + [str(tmp_path / "lookup-load")]) == 0
    load = json.loads((tmp_path / "lookup-load" / "simulate.json").read_text())["load"]
    assert {row["method"] for row in load} == {"target", "prompt_lookup", "hardware_aware", "hardware_aware+lookup"}


def test_probe_samples_while_its_width_reaches_past_the_slot():
    """A probe's Algorithm-1 width may jump past the next slot (equal speeds, float noise): the slot is verified, so
    it must be sampled (the engine used to stop there and verify drafts it had not sampled)."""
    engine = SimulatedBatchEngine([], KneeCost(), 4, make_policy("hardware_aware", SPS))
    policy = engine.policy  # the engine's form of the hardware-aware policy
    policy.begin_round([[0.0] * 4], 4)  # confidences of 0 plan width 1: this round is a probe
    policy._probe_width = lambda confidences: 5
    assert policy.verified(1, [[0.9, 0.9]], [True]) == [True]


def test_trace_command_takes_prompts_or_a_trace(capsys):
    from dspark_hf.simulation.trace import _parse_args

    for argv in (["--output", "t.json.gz"], ["--prompts", "p.jsonl", "--outputs_from", "t0.json.gz", "--output", "t"]):
        with pytest.raises(SystemExit):
            _parse_args(argv)
        assert "--outputs_from" in capsys.readouterr().err
    assert _parse_args(["--outputs_from", "t0.json.gz", "--output", "t.json.gz"]).prompts is None


def test_campaign_eval_reports_full_block_tau(models, trace, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import campaign_eval

    target, _, _ = models
    trace.save(tmp_path / "a.json.gz")
    retrace(target, make_drafter(target, seed=2), trace).save(tmp_path / "b.json.gz")
    document = campaign_eval.main([f"a={tmp_path / 'a.json.gz'}", f"b={tmp_path / 'b.json.gz'}",
                                   "--output", str(tmp_path / "out"), "--save_outputs", str(tmp_path / "o.json.gz")])
    assert retrace(target, models[1], Trace.load(tmp_path / "o.json.gz")).sequences == trace.sequences
    live = []
    for prompt in PROMPTS:  # the live full-block rounds of the first drafter
        live += _live_generate(target, models[1], prompt, "full")[1].rounds
    tau = (sum(r.accepted for r in live) + len(live)) / len(live)
    assert document["a"]["categories"]["tiny"]["tau"] == pytest.approx(tau, abs=1e-4)
    first = [r for r in live if r.verified]
    assert document["a"]["categories"]["all"]["first_draft_acceptance"] == pytest.approx(
        sum(r.accepted > 0 for r in first) / len(first), abs=1e-4)
    assert (tmp_path / "out" / "heldout-tau.md").read_text().count("| tiny |") == 1
    other = Trace(trace.block_size, trace.max_new_tokens, trace.eos_token_ids, trace.sequences[:1])
    other.save(tmp_path / "c.json.gz")
    with pytest.raises(SystemExit, match="--outputs_from"):
        campaign_eval.main([f"a={tmp_path / 'a.json.gz'}", f"c={tmp_path / 'c.json.gz'}", "--output", str(tmp_path)])


def test_trace_command_outputs_from(tmp_path):
    from test_calibration import WORDS, _save_tiny_chat_target

    from dspark_hf.simulation.trace import main as trace_main

    target = _save_tiny_chat_target(tmp_path / "target")
    make_drafter(target, block_size=3).save_pretrained(tmp_path / "drafter")
    (tmp_path / "tiny.jsonl").write_text("".join(json.dumps({"turns": [" ".join(WORDS[i:i + 5])]}) + "\n"
                                                 for i in range(0, 12, 4)))
    common = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"), "--max_new_tokens", "10"]
    first_run = ["--prompts", str(tmp_path / "tiny.jsonl"), "--output", str(tmp_path / "a.json.gz")]
    assert trace_main(common + first_run) == 0
    second_run = ["--outputs_from", str(tmp_path / "a.json.gz"), "--output", str(tmp_path / "b.json.gz")]
    assert trace_main(common + second_run) == 0
    first, again = Trace.load(tmp_path / "a.json.gz"), Trace.load(tmp_path / "b.json.gz")
    assert again.sequences == first.sequences and len(again.sequences) == 3
    assert again.metadata["outputs_from"]["path"] == str(tmp_path / "a.json.gz")
