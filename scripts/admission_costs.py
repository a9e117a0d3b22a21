"""What an admission costs against a decode step, from the engine timings a `dspark-hf bench-load` run recorded.

Per level and method: a least-squares fit of each admission's seconds to ``fixed + per_token · requests · padded
prompt tokens`` (the prefill forward's fixed part and its cost per prompt token), and the median plain decode step at
full load. `admission_wait_rounds="auto"` (`generation/batched.py`, `admission_is_due`) takes one decode step of the
whole batch as the price of a prefill's fixed part; this prints both, to check that stand-in on a machine.

    python scripts/admission_costs.py benchmarks/results/smollm2-load-stage7-bf16/lockstep/bench_load.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


MIN_ADMISSIONS = 6


def fit_admissions(admissions: list[list[float]]) -> tuple[float, float] | None:
    """(fixed seconds, seconds per prompt token) over `(requests, padded tokens, seconds)` rows; `None` for fewer than
    `MIN_ADMISSIONS` rows or sizes that do not vary (target-only in lockstep admits each wave whole: 2 sizes)."""
    sizes = torch.tensor([requests * tokens for requests, tokens, _ in admissions], dtype=torch.float64)
    if len(admissions) < MIN_ADMISSIONS or bool((sizes == sizes[0]).all()):
        return None
    design = torch.stack([torch.ones_like(sizes), sizes], dim=1)
    seconds = torch.tensor([row[2] for row in admissions], dtype=torch.float64)[:, None]
    fixed, per_token = torch.linalg.lstsq(design, seconds).solution[:, 0].tolist()
    return fixed, per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="bench_load.json files")
    args = parser.parse_args()
    print("| run | requests | method | admissions | fixed part (ms) | per prompt token (ms) | plain step (ms) |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for path in args.results:
        for row in json.loads(Path(path).read_text())["results"]:
            admissions = row.get("admissions") or []
            fit = fit_admissions(admissions)
            plain = row.get("full_load_step_seconds_by_width", {}).get("1")
            cells = ("-", "-") if fit is None else (f"{fit[0] * 1e3:.1f}", f"{fit[1] * 1e3:.3f}")
            step = "-" if plain is None else f"{plain['median'] * 1e3:.1f}"
            print(f"| {Path(path).parent.name} | {row['concurrency']} | {row['method']} | {len(admissions)} | "
                  f"{cells[0]} | {cells[1]} | {step} |")


if __name__ == "__main__":
    main()
