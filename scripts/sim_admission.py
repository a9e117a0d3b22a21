"""The engine's admission settings compared in simulation (no timing noise): admit at every step (0), wait up to 2
rounds, and "auto" (`generation/batched.py`, `admission_is_due`), for target-only and hardware-aware, with equal
budgets (lockstep) and with budgets drawn from 0.5-1.5x (spread, three seeds).

Costs: each level's verification steps and drafting passes as the validated bench-load run measured them
(`validate_simulator.py`'s `measured_cost`: target-only's steps for target-only, hardware-aware's for it), and one
prefill model for every method, fitted to all of that run's admissions at the level (`admission_costs.py`): a fixed
part plus seconds per padded prompt token. (The validation's per-method prefill rates are fitted with the profile's
forward as the fixed part; methods that admit one prompt at a time then get a higher rate per token, which would
charge a setting that merges admissions for the merging it removes.) A simulation: exact in rounds, as right in
seconds as the cost model.

    python scripts/sim_admission.py --output_dir benchmarks/results/admission/sim
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from admission_costs import fit_admissions
from dspark_hf.benchmarks.bench_load import request_budgets
from dspark_hf.generation.policies import HardwareAwarePolicy
from dspark_hf.profiling import load_speed_tables
from dspark_hf.simulation.cost import ProfileCost
from dspark_hf.simulation.replay import SimulatedBatchEngine
from dspark_hf.simulation.simulate import pool_passes, run_level
from dspark_hf.simulation.trace import Trace


RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
VALIDATION = RESULTS / "sim-validation-stage7-bf16"
LOAD_RESULTS = RESULTS / "smollm2-load-stage7-bf16" / "lockstep" / "bench_load.json"  # the run it validated
WAITS = (0, 2, "auto")
METHODS = ("target", "hardware_aware")


@dataclass
class FittedPrefillCost(ProfileCost):
    """A profile cost whose prefill is ``prefill_fixed_seconds + prefill_seconds_per_token · rows · tokens``."""

    prefill_fixed_seconds: float = 0.0

    def prefill_seconds(self, rows: int, prompt_tokens: int) -> float:
        return self.prefill_fixed_seconds + self.prefill_seconds_per_token * rows * prompt_tokens


def level_costs(validation: dict, measured_run: dict, tables: dict) -> dict:
    """level -> method -> cost."""
    admissions = {}
    for row in measured_run["results"]:
        admissions.setdefault(row["concurrency"], []).extend(row.get("admissions") or [])
    costs = {}
    for row in validation["load"]:
        if row["method"] not in METHODS or "measured_cost" not in row:
            continue
        level, own = row["concurrency"], row["measured_cost"]
        fixed, per_token = fit_admissions(admissions[level])
        costs.setdefault(level, {})[row["method"]] = FittedPrefillCost(
            tables={**tables, level: {int(w): 1.0 / s for w, s in own["step_seconds"].items()}},
            draft_seconds=own["draft_seconds"], prefill_seconds_per_token=per_token, prefill_fixed_seconds=fixed)
    return costs


def simulate(trace: Trace, tables: dict, cost, method: str, wait, level: int, spread: bool) -> dict:
    policy = HardwareAwarePolicy(tables[1]) if method == "hardware_aware" else None
    prompts = [s.prompt_ids for s in trace.sequences if s.turn == 0]
    passes = []
    for seed in range(3):
        engine = SimulatedBatchEngine(trace.sequences, cost, trace.block_size, policy, trace.eos_token_ids,
                                      steps_per_second_by_rows=tables, admission_wait_rounds=wait)
        admitted = []
        engine._admit = lambda e=engine, admit=engine._admit: admitted.append(len(e.waiting)) or admit()
        requests = max(2 * level, 8)
        # spread budgets stay within the trace's 48 traced tokens: 16-48
        budgets = request_budgets(32, 0.5, requests, seed) if spread else 48
        passes.append(run_level(engine, prompts, level, requests, budgets))
        passes[-1]["admissions_count"] = len(admitted)
    pooled = pool_passes(passes)
    return {"full_load_tok_s": pooled["full_load_throughput_tok_s"], "tau": pooled["tau"],
            "admissions": sum(p["admissions_count"] for p in passes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--validation", default=str(VALIDATION))
    parser.add_argument("--load_results", default=str(LOAD_RESULTS),
                        help="the bench-load run the validation replayed (its admissions give the prefill model)")
    parser.add_argument("--levels", default="1,2,4,8,16,32")
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    folder = Path(args.validation)
    validation = json.loads((folder / "validation.json").read_text())
    measured_run = json.loads(Path(args.load_results).read_text())
    tables = load_speed_tables(RESULTS.parent.parent / validation.get("load_profile", validation["profile"]))
    trace = Trace.load(folder / "load.trace.json.gz")
    costs = level_costs(validation, measured_run, tables)
    levels = [int(level) for level in args.levels.split(",")]
    rows = []
    for spread in (False, True):
        for level in levels:
            for method in METHODS:
                for wait in WAITS:
                    row = simulate(trace, tables, costs[level][method], method, wait, level, spread)
                    rows.append({"budgets": "spread" if spread else "lockstep", "concurrency": level, "method": method,
                                 "admission_wait_rounds": wait, **row})
    base = {(r["budgets"], r["concurrency"]): r["full_load_tok_s"] for r in rows
            if r["method"] == "target" and r["admission_wait_rounds"] == 0}
    lines = ["# Admission settings, simulated (costs a bench-load run measured; not a measurement)", "",
             f"Validation: `{folder}`. Full-load tokens/s over target-only admitting at every step (wait 0), and "
             "admissions (3 passes).", "",
             "| budgets | method | wait | " + " | ".join(map(str, levels)) + " |",
             "|---|---|---|" + "---:|" * len(levels)]
    for budgets in ("lockstep", "spread"):
        for method in METHODS:
            for wait in WAITS:
                cells = [r for r in rows if (r["budgets"], r["method"], r["admission_wait_rounds"]) ==
                         (budgets, method, wait)]
                lines.append(f"| {budgets} | {method} | {wait} | " + " | ".join(
                    f"{r['full_load_tok_s'] / base[(budgets, r['concurrency'])]:.3f}x ({r['admissions']})"
                    for r in cells) + " |")
    write_report(args.output_dir, "admission", {"validation": str(folder), "rows": rows}, lines)


def write_report(output_dir: str, stem: str, document: dict, lines: list[str]) -> None:
    """`STEM.json` (the document, marked as a simulation, with the command) and `STEM.md` (the lines) in
    `output_dir`; prints the lines."""
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    document = {"simulation": True, "command": "python " + " ".join(sys.argv), **document}
    (output / f"{stem}.json").write_text(json.dumps(document, indent=1))
    (output / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
