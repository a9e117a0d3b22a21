"""The hardware-aware scheduler's knobs compared in simulation (no timing noise): one knob at a time from the defaults.

Batch 1 on the `bench` trace with batch 1's fitted cost, and under load on the `bench-load` trace with each level's
fitted cost (both from `benchmarks/results/sim-validation/validation.json`). A simulation: exact in rounds, as right
in seconds as the fitted cost model.

    python scripts/sweep_knobs.py --output_dir benchmarks/results/sim-knobs
    # under load on more prompts than the validated trace (same fitted costs)
    python scripts/sweep_knobs.py --load_trace more.trace.json.gz --output_dir benchmarks/results/sim-knobs-more
    # another validation (its load trace, fitted costs and profile; batch 1 as validated there)
    python scripts/sweep_knobs.py --validation benchmarks/results/sim-validation-stage7-bf16 --output_dir ...
    # some variants only (names as in VARIANTS and WAITS)
    python scripts/sweep_knobs.py --variants defaults,replan=False --output_dir ...

Under load also the engine's `admission_wait_rounds` (target-only and hardware-aware at 1, 2, 4 and "auto"; every
other row admits at every step, 0), where a prefill costs one forward of its rows (the profile's) plus the measured
seconds per prompt token.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark_hf.generation.policies import HardwareAwarePolicy
from dspark_hf.models import EMBEDDED_DRAFTERS
from dspark_hf.profiling import load_speed_tables
from dspark_hf.simulation.cost import ProfileCost
from dspark_hf.simulation.replay import SimulatedBatchEngine
from dspark_hf.simulation.simulate import make_policy, simulate_batch1, simulate_closed_loop, summarize_batch1
from dspark_hf.simulation.trace import Trace


VALIDATION = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "sim-validation"
VARIANTS = {"defaults": {}, "plan_smoothing=0": {"plan_smoothing": 0.0},
            "plan_smoothing=0.25": {"plan_smoothing": 0.25}, "plan_smoothing=0.75": {"plan_smoothing": 0.75},
            "outcome_decay=None": {"outcome_decay": None}, "outcome_decay=0.9": {"outcome_decay": 0.9},
            "outcome_decay=0.99": {"outcome_decay": 0.99}, "max_idle_rounds=16": {"max_idle_rounds": 16},
            "max_idle_rounds=256": {"max_idle_rounds": 256}, "engine_min_gain=0.05": {"engine_min_gain": 0.05},
            "engine_min_gain=0.1": {"engine_min_gain": 0.1}, "engine_min_gain=0.2": {"engine_min_gain": 0.2},
            "replan=False": {"replan": False}, "payoff_guard=False": {"payoff_guard": False}}
REFERENCES = ["target", "fixed:1", "fixed:2", "threshold"]
# the engine's knob, under load only: (method, admission_wait_rounds)
WAITS = {f"{method} admission_wait_rounds={n}": (method, n)
         for method in ("target", "hardware_aware") for n in (1, 2, 4, "auto")}


def _policy(name: str, tables: dict):
    if name in VARIANTS:
        return HardwareAwarePolicy(tables[1], **VARIANTS[name])
    return make_policy(name, tables[1])


def batch1_rows(trace: Trace, tables: dict, fit: dict, variants=VARIANTS) -> list[dict]:
    cost = ProfileCost(tables=tables, **fit)
    records = {name: simulate_batch1(trace, _policy(name, tables), cost, trace.max_new_tokens)
               for name in [*REFERENCES, *variants]}
    return [row for row in summarize_batch1(records)]


def load_rows(trace: Trace, tables: dict, fits: dict, levels: list[int], measured: dict | None = None,
              variants=(*VARIANTS, *WAITS)) -> list[dict]:
    """Each variant in a closed loop per level, on the level's fitted cost, or where the validation has them on the
    costs the run measured (`measured`: level -> method -> cost; target-only on its own, the rest on
    hardware-aware's)."""
    rows = []
    for level in levels:
        for name in [*REFERENCES, *variants]:
            method, wait = WAITS.get(name, (name, 0))
            own = (measured or {}).get(level, {})
            own = own.get("target" if method == "target" else "hardware_aware")
            cost = ProfileCost(tables=tables, **fits[level]) if own is None else ProfileCost(
                tables={**tables, level: {int(w): 1.0 / s for w, s in own["step_seconds"].items()}},
                draft_seconds=own["draft_seconds"], prefill_seconds_per_token=own["prefill_seconds_per_token"])
            policy = _policy(method, tables)
            make_engine = lambda p=policy, w=wait: SimulatedBatchEngine(  # noqa: E731
                trace.sequences, cost, trace.block_size, p, trace.eos_token_ids, steps_per_second_by_rows=tables,
                admission_wait_rounds=w)
            row = simulate_closed_loop(trace, make_engine, [level], 48, repeats=3)[0]
            rows.append({"method": name, **row})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,2,4,8,16,32")
    parser.add_argument("--validation", default=str(VALIDATION),
                        help="a `validate_simulator.py` output folder: fitted costs, profiles and traces")
    parser.add_argument("--load_trace", default=None,
                        help="trace replayed under load (default: the validated `bench-load` trace)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated names of VARIANTS and WAITS to run (default: all of them)")
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    chosen = [*VARIANTS, *WAITS] if args.variants is None else args.variants.split(",")
    unknown = [name for name in chosen if name not in VARIANTS and name not in WAITS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {[*VARIANTS, *WAITS]}")
    variants = [name for name in chosen if name in VARIANTS]
    folder = Path(args.validation)
    validation = json.loads((folder / "validation.json").read_text())
    embedded = next(iter(EMBEDDED_DRAFTERS.values())) / "dspark_sps_profile.json"  # where older validations' came from
    paths = [Path(p) if Path(p).is_file() else embedded
             for p in (validation["profile"], validation.get("load_profile", validation["profile"]))]
    tables, load_tables = (load_speed_tables(path) for path in paths)
    fits = {row["concurrency"]: row["fit"] for row in validation["load"]}
    measured = {}
    for row in validation["load"]:
        if "measured_cost" in row:
            measured.setdefault(row["concurrency"], {})[row["method"]] = row["measured_cost"]
    levels = [int(level) for level in args.levels.split(",")]
    bench_trace = folder / "bench.trace.json.gz"
    batch1 = batch1_rows(Trace.load(bench_trace if bench_trace.is_file() else VALIDATION / "bench.trace.json.gz"),
                         tables, validation["batch1"]["fit"], variants)
    args.load_trace = args.load_trace or str(folder / "load.trace.json.gz")
    load_trace = Trace.load(args.load_trace)
    load = load_rows(load_trace, load_tables, fits, levels, measured, chosen)
    lines = ["# Hardware-aware knobs, simulated (fitted CPU cost of this machine; not a measurement)", "",
             "## Batch 1 (`bench` trace, 18 prompts, 128 tokens)", "",
             "| variant | all tok/s | speed-up | gsm8k | humaneval | mt-bench | tau |", "|---|---:|---:|---:|---:|---:|---:|"]
    by = {(r["method"], r["category"]): r for r in batch1}
    for name in [*REFERENCES, *variants]:
        cells = [f"{by[(name, c)]['speedup']:.3f}x" for c in ("gsm8k", "humaneval", "mt-bench")]
        lines.append(f"| {name} | {by[(name, 'all')]['tokens_per_second']:.2f} | {by[(name, 'all')]['speedup']:.3f}x | "
                     + " | ".join(cells) + f" | {by[(name, 'all')]['tau']:.3f} |")
    cost_note = "costs the run measured at each level" if measured else "each level's fitted cost"
    lines += ["", f"## Under load ({len(load_trace.sequences)} traced requests, full-load tok/s vs target-only, "
              f"{cost_note})", "",
              "| variant | " + " | ".join(map(str, levels)) + " |", "|---|" + "---:|" * len(levels)]
    target = {r["concurrency"]: r["full_load_throughput_tok_s"] for r in load if r["method"] == "target"}
    for name in [*REFERENCES, *chosen]:
        values = {r["concurrency"]: r["full_load_throughput_tok_s"] / target[r["concurrency"]]
                  for r in load if r["method"] == name}
        lines.append(f"| {name} | " + " | ".join(f"{values[level]:.3f}x" for level in levels) + " |")
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    (output / "knobs.json").write_text(json.dumps({"simulation": True, "load_trace": args.load_trace,
                                                    "batch1": batch1, "load": load}, indent=1))
    (output / "knobs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
