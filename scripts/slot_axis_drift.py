"""How long the batched engine's shared slot axis is, target-only against hardware-aware, at full load.

Each engine runs one closed loop alone (`ClosedLoop`, as `dspark-hf bench-load`: the first 2c prompts of gsm8k then
humaneval, c in flight, lockstep budgets), bf16 where native; after every step with all c rows in flight it records
the axis width, the longest row's committed slots and the rows' mean. Nothing is timed, so it can run beside other
work. Width minus the longest row = holes of rejected drafts awaiting compaction; the longest row against
target-only's = drift (rows that accepted different numbers of drafts age apart).

    python scripts/slot_axis_drift.py --levels 16 32 --output benchmarks/results/load-interleaved/slot-axis/slot_axis.json \
        --sps benchmarks/results/load-interleaved/lockstep-256-epyc-32x3/bf16-profile.json \
              benchmarks/results/load-interleaved/lockstep-256-epyc-8-16x2/bf16-profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ab_engine_min_gain import load_models
from dspark_hf.benchmarks.bench import machine_info, version_info
from dspark_hf.benchmarks.bench_load import ClosedLoop
from dspark_hf.generation.batched import DSparkBatchEngine
from dspark_hf.generation.policies import HardwareAwarePolicy
from dspark_hf.profiling import load_speed_tables


def axis_at_full_load(engine: DSparkBatchEngine, prompts, level: int, max_new_tokens: int) -> dict:
    loop = ClosedLoop(engine, prompts, level, 2 * level, max_new_tokens)
    widths, longest, mean = [], [], []
    while not loop.done:
        loop.step()
        if len(engine.active) == level and engine.slot_mask.numel():
            committed = engine.slot_mask.sum(dim=1).float()
            widths.append(engine.slot_mask.shape[1])
            longest.append(float(committed.max()))
            mean.append(float(committed.mean()))
    return {"steps": len(widths), "width": statistics.mean(widths), "longest_row": statistics.mean(longest),
            "mean_row": statistics.mean(mean), "holes": statistics.mean(widths) - statistics.mean(longest)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--sps", type=Path, nargs="+", required=True,
                        help="profiles whose tables cover the levels' row counts (merged; the first plans one row)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    target, drafter, tokenizer, prompts = load_models()
    common = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id or 0}
    by_rows = {}
    for path in args.sps:
        for rows, table in load_speed_tables(path).items():
            by_rows.setdefault(rows, table)
    results = []
    for level in args.levels:
        engines = {"target": DSparkBatchEngine(target, None, **common),
                   "hardware_aware": DSparkBatchEngine(target, drafter, policy=HardwareAwarePolicy(str(args.sps[0])),
                                                       steps_per_second_by_rows=by_rows, **common)}
        for method, engine in engines.items():
            row = {"concurrency": level, "method": method, **axis_at_full_load(engine, prompts, level,
                                                                                 args.max_new_tokens)}
            results.append(row)
            print(f"c={level:>3} {method:>15}: axis {row['width']:.1f} slots, longest row {row['longest_row']:.1f}, "
                  f"holes {row['holes']:.1f}, mean row {row['mean_row']:.1f} ({row['steps']} steps)", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    document = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(), "versions": version_info(),
                "settings": {**vars(args), "sps": [str(path) for path in args.sps], "output": str(args.output)},
                "results": results}
    args.output.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
