"""Would native grouped-query attention pay in the batched engine? Replayed without timing noise.

The open question of `benchmarks/results/gqa/README.md`: with verification forwards of 2+ tokens per row cheaper, does
the engine's hardware-aware policy draft where drafting does not pay? Here the stage-7 bench-load run's measured costs
(as `scripts/sim_admission.py` builds them: its steps and drafting passes, one prefill model) are replayed twice for
hardware-aware: as measured, and with every step of width >= 2 scaled by the native / copied-K/V ratio that
`scripts/profile_gqa.py --rows 8 16 32 --widths 2 3 4 5 6 7 8 --skip_generation` measured for that row count and width
(interleaved in one process; plain steps are one-token forwards, unchanged). Target-only is the reference for both.
The policy plans on the same profile either way and learns the cheaper steps as it times them, as the engine would.

    python scripts/sim_engine_gqa.py --forwards benchmarks/results/gqa/gqa-engine-widths.json \\
        --output_dir benchmarks/results/gqa/sim-engine
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from sim_admission import LOAD_RESULTS, RESULTS, VALIDATION, level_costs, simulate, write_report
from dspark_hf.profiling import load_speed_tables
from dspark_hf.simulation.trace import Trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forwards", required=True, help="profile_gqa.py output with the engine's rows and widths")
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args()
    validation = json.loads((VALIDATION / "validation.json").read_text())
    tables = load_speed_tables(RESULTS.parent.parent / validation["load_profile"])
    trace = Trace.load(VALIDATION / "load.trace.json.gz")
    costs = level_costs(validation, json.loads(Path(LOAD_RESULTS).read_text()), tables)
    ratios = {}
    for case in json.loads(Path(args.forwards).read_text())["forwards"]:
        ratios.setdefault(case["rows"], {})[case["width"]] = case["native_ms"] / case["copied_ms"]
    rows = []
    for spread in (False, True):
        for level, by_width in sorted(ratios.items()):
            measured = costs[level]["hardware_aware"]
            table = measured.tables[level]  # width -> steps per second
            native = replace(measured, tables={**measured.tables, level: {
                width: speed / by_width.get(width, 1.0) for width, speed in table.items()}})
            target = simulate(trace, tables, costs[level]["target"], "target", "auto", level, spread)
            for name, cost in (("copied K/V (as measured)", measured), ("native GQA", native)):
                row = simulate(trace, tables, cost, "hardware_aware", "auto", level, spread)
                rows.append({"budgets": "spread" if spread else "lockstep", "concurrency": level, "engine": name,
                             "vs_target": row["full_load_tok_s"] / target["full_load_tok_s"], **row})
    lines = ["# Native GQA in the batched engine, simulated (measured costs, forward ratios measured; not a "
             "measurement)", "", "Hardware-aware over target-only at full load (`admission_wait_rounds='auto'`), tau "
             "in brackets.", "", "| budgets | engine | " + " | ".join(str(level) for level in sorted(ratios)) + " |",
             "|---|---|" + "---:|" * len(ratios)]
    for budgets in ("lockstep", "spread"):
        for name in ("copied K/V (as measured)", "native GQA"):
            cells = [r for r in rows if r["budgets"] == budgets and r["engine"] == name]
            lines.append(f"| {budgets} | {name} | " + " | ".join(f"{r['vs_target']:.3f}x ({r['tau']:.2f})"
                                                               for r in cells) + " |")
    write_report(args.output_dir, "sim_engine_gqa", {"forwards": args.forwards, "ratios": ratios, "rows": rows}, lines)


if __name__ == "__main__":
    main()
