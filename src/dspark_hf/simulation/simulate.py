"""`dspark-hf simulate`: every verification policy replayed on a trace, timed by a cost model instead of a clock.

Batch 1 replays transformers' assisted loop (what `dspark-hf bench` measures); concurrency levels run the batched
engine's own scheduler in a closed loop as `dspark-hf bench-load` does (same warmup, same per-level loop and
metrics), or with Poisson arrivals. Greedy only: a trace holds one committed output per prompt. All numbers are a
simulation: exact in tokens and rounds, and exactly as right in seconds as the cost model is.

```bash
dspark-hf simulate --trace gsm8k.trace.json.gz --cost dspark_sps_profile.json --draft_seconds 0.007 \
    --policies target,full,fixed:1,threshold,hardware_aware --concurrency 1,2,4,8 --output_dir sim
```
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ..cli import ArgumentParser
from ..benchmarks.bench_load import pool_passes, run_level
from ..benchmarks.report import geometric_mean
from ..generation.batched import AUTO_ADMISSION, parse_admission_wait_rounds
from ..generation.lookup import PromptLookup
from ..generation.policies import HardwareAwarePolicy, ThresholdPolicy, VerificationPolicy, get_policy
from ..profiling import load_speed_tables
from .cost import CostModel, load_cost_model
from .replay import SimulatedBatchEngine, replay_generation, replay_prompt_lookup
from .trace import Trace


TARGET_ONLY = "target"
# prompt lookup decoding without a drafter: transformers' at batch 1, the batched engine's under load
PROMPT_LOOKUP = "prompt_lookup"
LOOKUP_SUFFIX = "+lookup"
WARMUP_MAX_NEW_TOKENS = 16  # `bench` warms every method up on the first prompt with this many tokens


def make_policy(spec: str, steps_per_second, threshold: float = 0.5) -> VerificationPolicy | None:
    """A fresh policy for a method name: `target` (None), `full`, `fixed:K`, `threshold`, `threshold_cumulative`,
    `hardware_aware` (planned), `hardware_aware:W` (plan smoothing W), `algorithm1` (hardware-aware, Algorithm 1);
    a `+lookup` suffix adds prompt lookup inside rounds (`make_lookup`)."""
    name, _, argument = spec.removesuffix(LOOKUP_SUFFIX).partition(":")
    if name in (TARGET_ONLY, PROMPT_LOOKUP) and not argument:
        return None
    if name == "fixed" and argument.isdigit():
        return get_policy("fixed", length=int(argument))
    if name in ("threshold", "threshold_cumulative") and not argument:
        return ThresholdPolicy(threshold, cumulative=name.endswith("cumulative"))
    if name in ("full",) and not argument:
        return get_policy("full")
    if name in ("hardware_aware", "algorithm1"):
        kwargs = {"mode": "algorithm1"} if name == "algorithm1" else {}
        if argument:
            try:
                kwargs["plan_smoothing"] = float(argument)
            except ValueError:
                raise ValueError(f"Policy {spec!r}: write hardware_aware:W with W in [0, 1).") from None
        return HardwareAwarePolicy(steps_per_second, **kwargs)
    raise ValueError(f"Unknown policy {spec!r}; use target, full, fixed:K, threshold, threshold_cumulative, "
                     "hardware_aware, hardware_aware:W or algorithm1.")


def make_lookup(spec: str, num_tokens: int, eos_token_ids: Sequence[int]) -> PromptLookup | None:
    """The prompt lookup of a `POLICY+lookup` method (as `bench --policies POLICY+lookup` runs it), else `None`."""
    if not spec.endswith(LOOKUP_SUFFIX):
        return None
    if spec in (TARGET_ONLY + LOOKUP_SUFFIX, PROMPT_LOOKUP + LOOKUP_SUFFIX):
        raise ValueError(f"Policy {spec!r}: prompt lookup runs inside DSpark rounds; add it to a policy, e.g. "
                         "hardware_aware+lookup.")
    return PromptLookup(num_tokens, eos_token_ids=list(eos_token_ids))


def cost_speed_tables(cost: CostModel, rows: Sequence[int], max_width: int) -> dict[int, dict[int, float]]:
    """``{rows: {width: steps/s}}`` of a cost model: the profile a policy gets of the simulated hardware."""
    return {r: {w: 1.0 / cost.verify_seconds(r, w) for w in range(1, max_width + 1)} for r in rows}


# ---------------------------------------------------------------------------------------------------------------------
# Batch 1 (`bench`)
# ---------------------------------------------------------------------------------------------------------------------


def simulate_batch1(trace: Trace, policy: VerificationPolicy | None, cost: CostModel, max_new_tokens: int,
                    warmup: bool = True, lookup: PromptLookup | None = None,
                    prompt_lookup_num_tokens: int | None = None) -> list[dict]:
    """One record per prompt (all its turns), in trace order, with one policy object for the whole run, as `bench`
    keeps one per method (after a warmup generation of `WARMUP_MAX_NEW_TOKENS` on the first prompt). With
    `prompt_lookup_num_tokens` (and no policy): transformers' prompt lookup decoding instead."""
    if prompt_lookup_num_tokens:
        replay = lambda sequence, budget: replay_prompt_lookup(  # noqa: E731
            sequence, cost, budget, trace.eos_token_ids, prompt_lookup_num_tokens)
    else:
        replay = lambda sequence, budget: replay_generation(  # noqa: E731
            sequence, policy, cost, trace.block_size, budget, trace.eos_token_ids, lookup)
    if warmup and trace.sequences:
        replay(trace.sequences[0], min(max_new_tokens, WARMUP_MAX_NEW_TOKENS))
    records: dict[str, dict] = {}
    for sequence in trace.sequences:
        run = replay(sequence, max_new_tokens)
        record = records.setdefault(sequence.prompt_id, {"prompt_id": sequence.prompt_id,
                                                         "category": sequence.category, "new_tokens": 0,
                                                         "seconds": 0.0, "rounds": []})
        record["new_tokens"] += run.new_tokens
        record["seconds"] += run.seconds
        record["rounds"] += [(r.verified, r.accepted, r.drafted) for r in run.rounds]
        record["lookup_rounds"] = record.get("lookup_rounds", 0) + sum(r.source == "lookup" for r in run.rounds)
    for record in records.values():
        rounds = record.pop("rounds")
        record["tokens_per_second"] = record["new_tokens"] / record["seconds"]
        record["tau"] = (sum(a for _, a, _ in rounds) + len(rounds)) / len(rounds) if rounds else 1.0
        record["tau_rounds"], record["tau_accepted"] = len(rounds), sum(a for _, a, _ in rounds)
        record["skipped_rounds"] = sum(not drafted for _, _, drafted in rounds) - record["lookup_rounds"]
        record["mean_verified"] = sum(v for v, _, _ in rounds) / len(rounds) if rounds else 0.0
    return list(records.values())


def summarize_batch1(records_by_method: dict[str, list[dict]]) -> list[dict]:
    """Pooled tok/s, tau and geometric-mean speed-up over target-only, per method and category (`all` too)."""
    baseline = {r["prompt_id"]: r["tokens_per_second"] for r in records_by_method.get(TARGET_ONLY, [])}
    rows = []
    for method, records in records_by_method.items():
        categories = list(dict.fromkeys(r["category"] for r in records)) + ["all"]
        for category in categories:
            group = [r for r in records if category in ("all", r["category"])]
            rounds = sum(r["tau_rounds"] for r in group)
            speedups = [r["tokens_per_second"] / baseline[r["prompt_id"]] for r in group if r["prompt_id"] in baseline]
            rows.append({
                "method": method, "category": category, "prompts": len(group),
                "tokens_per_second": sum(r["new_tokens"] for r in group) / sum(r["seconds"] for r in group),
                "speedup": geometric_mean(speedups),
                "tau": (sum(r["tau_accepted"] for r in group) + rounds) / rounds if rounds else 1.0,
                "skipped_rounds": sum(r["skipped_rounds"] for r in group), "rounds": rounds,
            })
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Many requests (`bench-load`)
# ---------------------------------------------------------------------------------------------------------------------


def _latency_stats(engine: SimulatedBatchEngine) -> dict:
    latencies = sorted(r.finish_time - r.arrival_time for r in engine.finished)
    pick = lambda q: latencies[min(len(latencies) - 1, int(math.ceil(q * len(latencies))) - 1)]  # noqa: E731
    return {"latency_p50_s": pick(0.5), "latency_p90_s": pick(0.9), "latency_p99_s": pick(0.99)}


def simulate_closed_loop(
    trace: Trace, make_engine: Callable[[], SimulatedBatchEngine], levels: Sequence[int], max_new_tokens: int,
    requests: int | None = None, repeats: int = 1,
) -> list[dict]:
    """`bench-load`'s closed loop for one method: a warmup level (2 requests of 8 tokens), then `repeats` passes per
    level, pooled; the engine factory shares one policy across levels and passes, as `bench-load` does."""
    prompts = [s.prompt_ids for s in trace.sequences if s.turn == 0]
    run_level(make_engine(), prompts, 2, 2, 8)
    rows = []
    for level in levels:
        passes, latencies = [], []
        for _ in range(repeats):
            engine = make_engine()
            passes.append(run_level(engine, prompts, level, requests or max(2 * level, 8), max_new_tokens))
            latencies.append(_latency_stats(engine))
        rows.append({**pool_passes(passes), **latencies[-1]})
    return rows


def run_poisson(engine: SimulatedBatchEngine, prompts: list[list[int]], rate: float, max_rows: int,
                num_requests: int, max_new_tokens: int, seed: int = 0) -> dict:
    """Open loop: `num_requests` arrivals at `rate` per simulated second; at most `max_rows` in flight, the others
    queue (their latency counts from arrival)."""
    generator = random.Random(seed)
    arrivals, now = [], 0.0
    for index in range(num_requests):
        now += generator.expovariate(rate)
        arrivals.append((now, prompts[index % len(prompts)]))
    while arrivals or engine.active or engine.waiting:
        in_flight = sum(not r.finished for r in engine.active) + len(engine.waiting)
        if not in_flight and arrivals and arrivals[0][0] > engine.clock():
            engine.clock.advance(arrivals[0][0] - engine.clock())
        while arrivals and arrivals[0][0] <= engine.clock() and in_flight < max_rows:
            arrival, prompt = arrivals.pop(0)
            engine.add_request(prompt, max_new_tokens).arrival_time = arrival
            in_flight += 1
        engine.step()
    finished = engine.finished
    tokens = sum(len(r.output_ids) for r in finished)
    rounds = [rnd for r in finished for rnd in r.stats.rounds]
    return {"concurrency": max_rows, "arrival_rate": rate, "requests": len(finished), "tokens": tokens,
            "seconds": engine.clock(), "throughput_tok_s": tokens / engine.clock(),
            "per_request_tok_s": sum(len(r.output_ids) / (r.finish_time - r.arrival_time) for r in finished)
            / len(finished),
            "tau": (sum(r.accepted for r in rounds) + len(rounds)) / len(rounds) if rounds else 1.0,
            "rounds": len(rounds), "skipped_rounds": sum(not r.drafted for r in rounds), **_latency_stats(engine)}


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = ArgumentParser(prog="dspark-hf simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, help="trace file from `dspark-hf trace`")
    parser.add_argument("--cost", required=True, help="cost model JSON, or a `dspark-hf profile` file")
    parser.add_argument("--sps", help="the profile the hardware-aware policy plans with (default: the cost model's "
                        "own speeds, a perfectly profiled machine)")
    parser.add_argument("--policies", default="target,full,fixed:1,threshold,hardware_aware",
                        help="comma-separated: target, full, fixed:K, threshold, threshold_cumulative, "
                        "hardware_aware, hardware_aware:W, algorithm1, each with an optional +lookup (prompt lookup inside rounds), "
                        "and prompt_lookup (no drafter: transformers' own at batch 1, the batched engine's under load) "
                        "(default: %(default)s)")
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--prompt_lookup_num_tokens", type=int, default=10,
                        help="the most lookup drafts per round of a POLICY+lookup method (default: %(default)s)")
    parser.add_argument("--admission_wait_rounds", default=AUTO_ADMISSION,
                        help="rounds a new request may wait while others decode, or 'auto' (the engine's knob; "
                        "default: %(default)s)")
    parser.add_argument("--concurrency", default="1", help="comma-separated levels; 0 or 'batch1' for the assisted "
                        "loop (bench); default: %(default)s")
    parser.add_argument("--arrivals", default="closed", help="closed, or poisson:RATE (requests per second)")
    parser.add_argument("--requests", type=int, help="requests per level (default: 2 x concurrency, >= 8)")
    parser.add_argument("--repeats", type=int, default=1, help="passes per level (policy state carries over)")
    parser.add_argument("--max_new_tokens", type=int, help="per turn (default: the trace's)")
    for name in ("draft_seconds", "draft_seconds_per_row", "draft_seconds_per_slot", "prefill_seconds_per_token"):
        parser.add_argument(f"--{name}", type=float, help="override the cost model's value")
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args(argv)
    try:
        args.admission_wait_rounds = parse_admission_wait_rounds(args.admission_wait_rounds)
    except ValueError:
        parser.error(f"--admission_wait_rounds must be an integer >= 0 (0 admits at every step) or "
                     f"'{AUTO_ADMISSION}', got {args.admission_wait_rounds!r}")
    if args.arrivals != "closed" and not args.arrivals.startswith("poisson:"):
        parser.error(f"--arrivals must be 'closed' or 'poisson:RATE', got {args.arrivals!r}")
    return args


def _levels(text: str) -> list[int]:
    try:
        levels = [0 if part.strip() == "batch1" else int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {text!r}: write comma-separated integers, e.g. 1,2,4,8 (0 = batch1).") from None
    if not levels or any(level < 0 for level in levels):
        raise ValueError(f"--concurrency {text!r}: need levels >= 0 (0 = batch 1 through the assisted loop).")
    return levels


def run_simulation(args: argparse.Namespace, argv: Sequence[str]) -> dict:
    trace = Trace.load(args.trace)
    overrides = {k: getattr(args, k) for k in ("draft_seconds", "draft_seconds_per_row", "draft_seconds_per_slot",
                                               "prefill_seconds_per_token") if getattr(args, k) is not None}
    cost = load_cost_model(args.cost, **overrides)
    levels, max_new = _levels(args.concurrency), args.max_new_tokens or trace.max_new_tokens
    specs = [s.strip() for s in args.policies.split(",") if s.strip()]
    width = trace.block_size + 1
    lookup_specs = [spec for spec in specs if spec.endswith(LOOKUP_SUFFIX) or spec == PROMPT_LOOKUP]
    if lookup_specs:
        width = max(width, args.prompt_lookup_num_tokens + 1)
    if args.sps:
        tables = load_speed_tables(args.sps)
    else:
        tables = cost_speed_tables(cost, sorted({1, *[lv for lv in levels if lv]}), width)
    policies = {spec: make_policy(spec, tables[min(tables)], args.threshold) for spec in specs}
    lookups = {spec: make_lookup(spec, args.prompt_lookup_num_tokens, trace.eos_token_ids) for spec in specs}
    document = {"simulation": True, "command": shlex.join(["dspark-hf", "simulate", *argv]),
                "trace": {"path": args.trace, **trace.metadata, "sequences": len(trace.sequences)},
                "cost_model": cost.describe(), "max_new_tokens": max_new, "arrivals": args.arrivals,
                "policies": {spec: repr(p) for spec, p in policies.items()}}
    if 0 in levels:
        records = {spec: simulate_batch1(trace, policy, cost, max_new, lookup=lookups[spec],
                                         prompt_lookup_num_tokens=args.prompt_lookup_num_tokens
                                         if spec == PROMPT_LOOKUP else None)
                   for spec, policy in policies.items()}
        document["batch1"] = {"summary": summarize_batch1(records), "records": records}
    load_levels = [level for level in levels if level]
    if load_levels:
        document["load"] = _simulate_load(args, trace, cost, policies, tables, load_levels, max_new)
    return document


def _simulate_load(args, trace, cost, policies, tables, levels, max_new) -> list[dict]:
    results = []
    for spec, policy in policies.items():
        tokens = args.prompt_lookup_num_tokens if spec.endswith(LOOKUP_SUFFIX) or spec == PROMPT_LOOKUP else None
        make_engine = lambda p=policy, t=tokens: SimulatedBatchEngine(  # noqa: E731
            trace.sequences, cost, trace.block_size, p, trace.eos_token_ids, steps_per_second_by_rows=tables,
            prompt_lookup_num_tokens=t, admission_wait_rounds=args.admission_wait_rounds)
        if args.arrivals == "closed":
            rows = simulate_closed_loop(trace, make_engine, levels, max_new, args.requests, args.repeats)
        else:
            rate = float(args.arrivals.partition(":")[2])
            prompts = [s.prompt_ids for s in trace.sequences if s.turn == 0]
            rows = [run_poisson(make_engine(), prompts, rate, level, args.requests or max(2 * level, 8), max_new)
                    for level in levels]
        results += [{"method": spec, **row} for row in rows]
    baseline = {r["concurrency"]: r for r in results if r["method"] == TARGET_ONLY}
    for row in results:
        if row["concurrency"] in baseline:
            for key in ("throughput_tok_s", "full_load_throughput_tok_s"):
                if row.get(key) and baseline[row["concurrency"]].get(key):
                    row[key.replace("_tok_s", "_vs_target")] = row[key] / baseline[row["concurrency"]][key]
    return results


def _fmt(value, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def markdown_report(document: dict) -> str:
    """The report's markdown: how it was simulated, then the batch-1 and load tables."""
    cost = document["cost_model"]
    lines = ["# dspark-hf simulate (a simulation, not a measurement)", "",
             f"- command: `{document['command']}`",
             f"- trace: `{document['trace']['path']}` ({document['trace']['sequences']} generations; "
             f"`{document['trace'].get('command', '?')}`)",
             f"- cost model: {cost['kind']}, {cost.get('source') or 'no source given'}; drafting "
             f"{cost['draft_seconds']} s + {cost['draft_seconds_per_row']} s/row + {cost['draft_seconds_per_slot']} "
             f"s/slot",
             f"- greedy, max {document['max_new_tokens']} new tokens per turn, arrivals: {document['arrivals']}"]
    if "batch1" in document:
        lines += ["", "## Batch 1 (assisted loop, as `bench`)", "",
                  "| category | method | prompts | tok/s | speed-up | tau | rounds without drafter |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for row in document["batch1"]["summary"]:
            lines.append(f"| {row['category']} | {row['method']} | {row['prompts']} | {row['tokens_per_second']:.2f} "
                         f"| {_fmt(row['speedup'], 3, 'x')} | {row['tau']:.3f} | {row['skipped_rounds']}"
                         f"/{row['rounds']} |")
    if "load" in document:
        lines += ["", "## Under load (batched engine, as `bench-load`)", "",
                  "| concurrency | method | tok/s at full load | vs target | whole-run tok/s | vs target | "
                  "per-request tok/s | latency p50 / p90 / p99 (s) | tau |", "|---|---|---:|---:|---:|---:|---:|---|---:|"]
        for row in document["load"]:
            latency = " / ".join(_fmt(row.get(f"latency_p{q}_s")) for q in (50, 90, 99))
            lines.append(f"| {row['concurrency']} | {row['method']} | {_fmt(row.get('full_load_throughput_tok_s'))} | "
                         f"{_fmt(row.get('full_load_throughput_vs_target'), 3, 'x')} | {row['throughput_tok_s']:.2f} | "
                         f"{_fmt(row.get('throughput_vs_target'), 3, 'x')} | {row['per_request_tok_s']:.2f} | "
                         f"{latency} | {row['tau']:.3f} |")
    return "\n".join(lines) + "\n"


def write_report(document: dict, output_dir: str | Path, plots: bool = True) -> list[Path]:
    from ..benchmarks.bench_load import _plot

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = [output_dir / "simulate.json", output_dir / "simulate.md"]
    paths[0].write_text(json.dumps(document, indent=1) + "\n")
    paths[1].write_text(markdown_report(document))
    if plots and document.get("load") and all("full_load_throughput_tok_s" in r for r in document["load"]):
        paths.append(output_dir / "simulate.png")
        _plot(document["load"], paths[-1])
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    """`dspark-hf simulate ...`; see `dspark-hf simulate --help`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv)
    try:
        document = run_simulation(args, argv)
    except (OSError, ValueError) as error:
        print(f"dspark-hf simulate: {error}", file=sys.stderr)
        return 2
    paths = write_report(document, args.output_dir)
    print(paths[1].read_text())
    print("wrote " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
