"""Where a bench-load run's time at full load went, per level and method: plain steps, drafted rounds, drafting
passes, admissions, and what the engine's medians leave unexplained (slow outliers: context syncs, compactions).

Reads the engine timings `dspark-hf bench-load` records (step medians by width with counts, drafting passes,
admissions), so nothing is re-timed:

    python scripts/load_breakdown.py benchmarks/results/load-interleaved/lockstep-256/bench_load.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def breakdown(row: dict, plain_reference: float | None) -> dict:
    """One method at one level: seconds by kind and the costs of a drafted round in plain steps of `plain_reference`
    (target-only's median plain step at that level)."""
    steps = row["full_load_step_seconds_by_width"]
    plain = steps.get("1", {"median": 0.0, "count": 0})
    wide = {int(w): v for w, v in steps.items() if w != "1"}
    drafting = row.get("full_load_draft_seconds") or {"median": 0.0, "count": 0}
    wide_seconds = sum(v["median"] * v["count"] for v in wide.values())
    wide_count = sum(v["count"] for v in wide.values())
    admissions = sum(seconds for _, _, seconds in row["admissions"])
    explained = plain["median"] * plain["count"] + wide_seconds + drafting["median"] * drafting["count"] + admissions
    skipped = row["skipped_rounds"] / row["rounds"] if row["rounds"] else 1.0
    reference = plain_reference or plain["median"]
    return {
        "full_load_seconds": row["full_load_seconds"],
        "plain_steps": plain["count"],
        "plain_step_ms": 1e3 * plain["median"],
        "plain_step_vs_target": plain["median"] / reference if plain["count"] and reference else None,
        "drafted_steps": wide_count,
        "drafted_step_in_plain_steps": wide_seconds / wide_count / reference if wide_count else None,
        "drafting_passes": drafting["count"],
        "drafting_in_plain_steps": drafting["median"] / reference if drafting["count"] else None,
        # tokens per row in a round that drafted (rounds without the drafter count 1; not separable with lookup rows,
        # which count as rounds without the drafter and accept lookup drafts)
        "tau_drafted_rounds": (row["tau"] - skipped) / (1 - skipped) if skipped < 1 and not row.get("lookup_rounds")
        else None,
        "admissions": len(row["admissions"]),
        "admission_seconds": admissions,
        "unexplained_seconds": row["full_load_seconds"] - explained,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench_load", type=Path, help="a bench_load.json")
    args = parser.parse_args()
    results = json.loads(args.bench_load.read_text())["results"]
    plain = {r["concurrency"]: r["full_load_step_seconds_by_width"]["1"]["median"] for r in results
             if r["method"] == "target"}
    print("| requests | method | vs target | full-load s | plain steps (ms, vs target's) | drafted steps (cost in "
          "target plain steps) | drafting passes (cost) | tau of drafted rounds | admissions (s) | unexplained s |")
    print("|---:|---|---:|---:|---|---|---|---:|---|---:|")
    fmt = lambda value, spec: "-" if value is None else format(value, spec)  # noqa: E731
    for row in results:
        b = breakdown(row, plain.get(row["concurrency"]))
        print(f"| {row['concurrency']} | {row['method']} | {row.get('full_load_vs_target', 1.0):.3f}x | "
              f"{b['full_load_seconds']:.1f} | {b['plain_steps']} ({b['plain_step_ms']:.0f} ms, "
              f"{fmt(b['plain_step_vs_target'], '.3f')}x) | {b['drafted_steps']} "
              f"({fmt(b['drafted_step_in_plain_steps'], '.2f')}) | {b['drafting_passes']} "
              f"({fmt(b['drafting_in_plain_steps'], '.2f')}) | {fmt(b['tau_drafted_rounds'], '.2f')} | "
              f"{b['admissions']} ({b['admission_seconds']:.1f}) | {b['unexplained_seconds']:.1f} |")


if __name__ == "__main__":
    main()
