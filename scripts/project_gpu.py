"""Projection (a simulation, not a measurement): verification policies under a GPU-like cost curve, 1-64 requests.

Two traces: the embedded drafter's own (greedy SmolLM2 outputs, `dspark-hf trace`), and a labelled synthetic drafter
at the paper's acceptance level (per-token acceptance ~0.88, perfectly calibrated confidences;
`dspark_hf.simulation.synthetic`). Both run through the batched engine's scheduler in a closed loop (as
`dspark-hf bench-load`) with a `KneeCost` whose numbers are back-of-envelope assumptions for an H100-class GPU serving
an ~8B bf16 target (see `dspark_hf.simulation.cost`); the hardware-aware policy plans with that curve as its profile.

    python scripts/project_gpu.py --trace bench.trace.json.gz --output_dir benchmarks/results/sim-projection
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark_hf.benchmarks.bench_load import _plot
from dspark_hf.simulation.cost import KneeCost
from dspark_hf.simulation.replay import SimulatedBatchEngine
from dspark_hf.simulation.simulate import cost_speed_tables, make_policy, simulate_closed_loop
from dspark_hf.simulation.synthetic import synthetic_trace
from dspark_hf.simulation.trace import Trace


LEVELS = [1, 2, 4, 8, 16, 32, 64]
POLICIES = ["target", "full", "fixed:1", "fixed:3", "threshold", "hardware_aware"]  # the engine plans every
# hardware-aware policy by width (its `mode` only matters at batch 1), so algorithm1 is not a separate row here
# Prompt lookup (inside DSpark rounds, and alone) for the embedded drafter's traces only: real text repeats itself,
# the synthetic drafter's ids do not.
LOOKUP_POLICIES = ["hardware_aware+lookup", "prompt_lookup"]
LOOKUP_TOKENS = 10  # as `dspark-hf simulate` and `bench-load`
GPU_COST = KneeCost(
    forward_seconds=0.006, knee_tokens=224, row_seconds=0.00004, draft_seconds=0.001, draft_seconds_per_row=0.00001,
    draft_seconds_per_slot=0.0001, prefill_seconds_per_token=0.00003,
    source="ASSUMED H100-class GPU, ~8B bf16 target: 6 ms memory-bound forward up to 224 tokens then linear, 40 us "
    "per request of KV reads, drafting 1 ms + 10 us/request + 0.1 ms/slot, prefill 30 us/token (back-of-envelope, "
    "not measured)")


def project(trace: Trace, cost: KneeCost, max_new_tokens: int, policies: list[str]) -> list[dict]:
    lookup = [spec for spec in policies if spec in LOOKUP_POLICIES]
    tables = cost_speed_tables(cost, sorted({1, *LEVELS}), max(trace.block_size, LOOKUP_TOKENS if lookup else 0) + 1)
    rows = []
    for spec in policies:
        policy = make_policy(spec, tables[1])
        make_engine = lambda p=policy, t=LOOKUP_TOKENS if spec in lookup else None: SimulatedBatchEngine(  # noqa: E731
            trace.sequences, cost, trace.block_size, p, trace.eos_token_ids, steps_per_second_by_rows=tables,
            prompt_lookup_num_tokens=t)
        rows += [{"method": spec, **row} for row in simulate_closed_loop(trace, make_engine, LEVELS, max_new_tokens)]
    by_key = {(r["concurrency"], r["method"]): r for r in rows}
    for row in rows:
        for reference in ("target", "full"):
            base = by_key[(row["concurrency"], reference)]["full_load_throughput_tok_s"]
            row[f"vs_{reference}"] = row["full_load_throughput_tok_s"] / base
    return rows


def markdown(name: str, description: str, rows: list[dict]) -> list[str]:
    lines = [f"## {name}", "", description, "",
             "| concurrency | method | total tok/s at full load | vs target-only | vs full block | per-user tok/s | "
             "latency p50 (s) | tau | rounds without drafter |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        skipped = r["skipped_rounds"] / r["rounds"] if r["rounds"] else 0.0
        lines.append(f"| {r['concurrency']} | {r['method']} | {r['full_load_throughput_tok_s']:.0f} | "
                     f"{r['vs_target']:.2f}x | {r['vs_full']:.2f}x | {r['per_request_tok_s']:.1f} | "
                     f"{r['latency_p50_s']:.2f} | {r['tau']:.2f} | {skipped:.0%} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True, help="the embedded drafter's trace (`dspark-hf trace`)")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    embedded = Trace.load(args.trace)
    synthetic = synthetic_trace(64, args.max_new_tokens, embedded.block_size, mean_acceptance=0.88)
    sets = {
        "embedded drafter (SmolLM2 traces)": (embedded, embedded.metadata.get("command"), POLICIES + LOOKUP_POLICIES),
        "SYNTHETIC drafter at the paper's acceptance level (0.88 per token)": (synthetic, synthetic.metadata["command"],
                                                                               POLICIES),
    }
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    document = {"simulation": True, "cost_model": GPU_COST.describe(), "levels": LEVELS, "sets": {}}
    lines = ["# Projection to a GPU-like cost curve (SIMULATION: assumed costs, not measurements)", "",
             f"Cost model: {GPU_COST.source}. Closed loop as `bench-load` (2 x c requests per level, >= 8), greedy, "
             f"{args.max_new_tokens} new tokens; the hardware-aware policy plans with the cost curve as its profile.",
             ""]
    for index, (name, (trace, command, policies)) in enumerate(sets.items()):
        rows = project(trace, GPU_COST, args.max_new_tokens, policies)
        document["sets"][name] = {"trace": command, "rows": rows}
        lines += markdown(name, f"Trace: `{command}`.", rows) + [""]
        _plot(rows, output / f"projection_{index}.png")
    (output / "projection.json").write_text(json.dumps(document, indent=1) + "\n")
    (output / "projection.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
