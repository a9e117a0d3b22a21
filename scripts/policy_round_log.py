"""Why the hardware-aware engine drafts where it does: a per-round log of its policy at full load.

One closed loop of the hardware-aware engine alone (`ClosedLoop`, as `dspark-hf bench-load`: the first 2c prompts of
gsm8k then humaneval, lockstep budgets), bf16 where native. For every round with c rows it logs what
`PlannedWidthPolicy` decided (drafted or not, the width it planned: 1 with a drafting pass is a probe, above 1 a plan
or a test of the guard), the guard's realized payoff before the round, and what the round verified and accepted.
Each drafted round is then priced with the profile's costs at c rows (verification width, plus the drafting pass in
plain steps as `--draft_steps`), as tokens per row over plain steps. Timings are read by the policy, not reported, so
the log describes decisions, not speed.

    python scripts/policy_round_log.py --level 32 \
        --sps benchmarks/results/load-interleaved/lockstep-256-epyc-32x3/bf16-profile.json \
        --output benchmarks/results/load-interleaved/policy-log/round_log_32.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ab_engine_min_gain import load_models
from dspark_hf.benchmarks.bench import machine_info, version_info
from dspark_hf.benchmarks.bench_load import ClosedLoop
from dspark_hf.generation.batched import DSparkBatchEngine
from dspark_hf.generation.policies import HardwareAwarePolicy
from dspark_hf.profiling import load_speed_tables


def log_rounds(policy) -> list[dict]:
    """Wraps `policy.begin_round` / `end_round` (an engine's `PlannedWidthPolicy`) to log each round's decision and
    outcome; returns the log."""
    log, begin_round, end_round = [], policy.begin_round, policy.end_round

    def logged_begin(stale_confidences, block_size):
        payoff = policy.realized_payoff(len(stale_confidences))
        drafts = begin_round(stale_confidences, block_size)
        log.append({"rows": len(stale_confidences), "drafted": bool(drafts), "width": policy._width,
                    "payoff_before": payoff})
        return drafts

    def logged_end(outcome):
        end_round(outcome)
        log[-1].update(verified=max(outcome.verified, default=0), accepted=sum(outcome.accepted),
                       decoding=outcome.decoding)

    policy.begin_round, policy.end_round = logged_begin, logged_end
    return log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", type=int, default=32)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--draft_steps", type=float, default=0.27, help="a drafting pass, in plain steps at --level")
    parser.add_argument("--sps", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    target, drafter, tokenizer, prompts = load_models()
    by_rows = load_speed_tables(args.sps)
    if args.level not in by_rows:
        raise SystemExit(f"--sps {args.sps} has no table for {args.level} rows; pass a profile of that batch size.")
    # the engine and policy bench-load's hardware-aware method runs, its policy's rounds logged
    engine = DSparkBatchEngine(target, drafter, policy=HardwareAwarePolicy(str(args.sps)),
                               steps_per_second_by_rows=by_rows, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id or 0)
    log = log_rounds(engine.policy)
    loop = ClosedLoop(engine, prompts, args.level, 2 * args.level, args.max_new_tokens)
    while not loop.done:
        loop.step()
    table = by_rows[args.level]
    cost = {width: table[1] / speed for width, speed in table.items()}
    rounds = [entry for entry in log if entry["rows"] == args.level]
    summary = {"rounds": len(rounds), "drafted": 0}
    for kind, chosen in (("probes", lambda e: e["width"] == 1), ("plans", lambda e: e["width"] > 1)):
        picked = [e for e in rounds if e["drafted"] and chosen(e)]
        tokens = sum(e["decoding"] + e["accepted"] for e in picked)
        steps = sum((cost[1 + e["verified"]] + args.draft_steps) * e["decoding"] for e in picked)
        summary[kind] = {"rounds": len(picked), "tokens_per_row": tokens / max(1, sum(e["decoding"] for e in picked)),
                         "payoff_by_profile": tokens / steps if steps else None}
        summary["drafted"] += len(picked)
    payoffs = [e["payoff_before"] for e in rounds]
    summary["guard_payoff_min_max"] = [min(payoffs), max(payoffs)] if payoffs else None
    summary["guard_blocked_rounds"] = sum(1 for e in rounds if not e["drafted"] and e["payoff_before"] < 1.0)
    print(json.dumps(summary, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    document = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(), "versions": version_info(),
                "settings": {**vars(args), "sps": str(args.sps), "output": str(args.output)},
                "summary": summary, "rounds": rounds}
    args.output.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
