"""How far the training campaign's held-out tau is from issue 19's targets, in training sequences and CPU hours.

Reads the committed held-out evaluations of stages 4-9 (`benchmarks/results/smollm2-training/heldout-tau/<stage>/
heldout-tau.json`, teacher-forced over one committed set of target outputs) and fits, per prompt set, held-out tau
(and first-draft acceptance) against the logarithm of the training sequences the drafter had seen by then,
``tau = a + b ln N``, by least squares. Each stage resumed from the one before, so N accumulates (stages 1-3, the
drafter stage 4 resumed from, saw 5,700). The fit then says how many sequences the targets would take if the
trend held, and how long that is at the seconds per sequence the stages measured on these 2 cores. The stages also
changed other things (a second draft layer at stage 7, more conversations to draw from at 8-9), so this is a trend
line through what the campaign did, not a scaling law.

    python scripts/campaign_scaling.py --output benchmarks/results/smollm2-training/scaling
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "smollm2-training"
# Per stage: its held-out folder, the drafter's name in it, and from campaign.md's table the sequences it trained on
# (steps x batch) and its training wall time in seconds.
STAGES = (
    ("stage4", "stage4", 700 * 4, 4210),
    ("stage5", "stage 5", 900 * 4, 4053),
    ("stage6", "stage6", 900 * 4, 5072),
    ("stage7-2layer", "stage7-2layer", 900 * 4, 5255),
    ("stage8-2layer", "stage8-2layer", 700 * 4, 5180),
    ("stage9-2layer-r64", "stage9-2layer-r64", 700 * 4, 3070),
)
BEFORE_STAGE4 = 1000 * 2 + 800 * 2 + 1050 * 2  # stages 1-3 (campaign.md)
TARGETS = {"gsm8k": 3.0, "humaneval": 3.0, "summarization": 2.0, "translation": 2.0, "passage_qa": 2.0}
FIRST_DRAFT_TARGET = 0.70


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares `y = a + b x`."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - b * mean_x, b


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=None, help="folder for scaling.json and scaling.md")
    args = parser.parse_args(argv)

    seen, points = BEFORE_STAGE4, []
    for folder, name, sequences, seconds in STAGES:
        categories = json.loads((RESULTS / "heldout-tau" / folder / "heldout-tau.json").read_text())["drafters"][name][
            "categories"]
        seen += sequences
        tau = {category: values["tau"] for category, values in categories.items()}  # "all" pools every set
        points.append({"stage": folder, "sequences_seen": seen, "seconds_per_sequence": seconds / sequences,
                       "tau": tau, "first_draft_all": categories["all"]["first_draft_acceptance"]})
    seconds_per_sequence = statistics.median(p["seconds_per_sequence"] for p in points)
    log_n = [math.log(p["sequences_seen"]) for p in points]

    def needed(ys: list[float], target: float) -> dict:
        a, b = _fit(log_n, ys)
        sequences = math.exp((target - a) / b) if b > 0 else math.inf
        return {"now": ys[-1], "target": target, "gain_per_doubling": b * math.log(2), "sequences_needed": sequences,
                "times_seen_so_far": sequences / points[-1]["sequences_seen"],
                "cpu_hours_at_measured_rate": sequences * seconds_per_sequence / 3600}

    fits = {category: needed([p["tau"][category] for p in points], target) for category, target in TARGETS.items()}
    fits["all (no target; the trend)"] = needed([p["tau"]["all"] for p in points], 3.0)
    fits["first_draft_all"] = needed([p["first_draft_all"] for p in points], FIRST_DRAFT_TARGET)
    record = {"command": "python scripts/campaign_scaling.py " + " ".join(argv or sys.argv[1:]),
              "fit": "value = a + b ln(sequences seen), least squares over stages 4-9",
              "seconds_per_sequence_median": seconds_per_sequence, "stages": points, "fits": fits}
    lines = ["| prompt set | now | target | gain per doubling of sequences | sequences needed | x seen so far | "
             "CPU hours on these 2 cores |", "|---|---|---|---|---|---|---|"]
    for category, fit in fits.items():
        lines.append(f"| {category} | {fit['now']:.3f} | {fit['target']} | {fit['gain_per_doubling']:+.3f} | "
                     f"{fit['sequences_needed']:,.0f} | {fit['times_seen_so_far']:,.0f} | "
                     f"{fit['cpu_hours_at_measured_rate']:,.0f} |")
    print("\n".join(lines))
    if args.output is not None:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "scaling.json").write_text(json.dumps(record, indent=1) + "\n")
        (args.output / "scaling.md").write_text(
            f"`{record['command']}`: {record['fit']}; {len(points)} stages, {points[-1]['sequences_seen']:,} "
            f"sequences seen by stage 9, {seconds_per_sequence:.2f} s per sequence (median of the stages' training "
            "wall time).\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
