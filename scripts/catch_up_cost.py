"""What the drafter's catch-up ingest of pending context costs against a drafting pass and a plain step.

Rounds that decode plainly leave their target features pending (`DSparkBatchEngine._sync_context`); the drafter ingests
them before it next drafts. The engine times that catch-up apart from the drafting pass it precedes, since it is owed
whether or not the round drafts. This measures both at 32 rows of bench-load's prompts (bf16 where native), after 1, 5
and 20 plain rounds, medians of `--repeats` interleaved repetitions:

    python scripts/catch_up_cost.py --output benchmarks/results/catch-up-ingest/catch_up.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ab_engine_min_gain import PROFILE, load_models
from dspark_hf.benchmarks.bench import machine_info, version_info
from dspark_hf.generation.batched import DSparkBatchEngine
from dspark_hf.generation.policies import HardwareAwarePolicy
from dspark_hf.profiling import load_speed_tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--pending", type=int, nargs="+", default=[1, 5, 20])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    target, drafter, tokenizer, prompts = load_models()
    engine = DSparkBatchEngine(target, drafter, policy=HardwareAwarePolicy(str(PROFILE)),
                               steps_per_second_by_rows=load_speed_tables(PROFILE), eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id or 0)
    for prompt in prompts[: args.rows]:
        engine.add_request(prompt, 1000)
    policy = engine.policy
    plan = policy.begin_round
    timings = {k: [] for k in args.pending}
    with torch.inference_mode():
        engine._admit()
        for _ in range(args.repeats):
            for pending in args.pending:
                policy.begin_round = lambda *a, **k: False  # plain rounds: their features stay pending
                plain = []
                for _ in range(pending):
                    start = time.perf_counter()
                    engine._round()
                    plain.append(time.perf_counter() - start)
                start = time.perf_counter()
                engine._sync_context()
                catch_up = time.perf_counter() - start
                policy.begin_round = plan
                policy._block_size, policy._width, policy._basis = 7, 4, [[0.5] * 7] * args.rows  # a width-4 plan
                budgets = [r.max_new_tokens - len(r.output_ids) - 1 for r in engine.active]
                start = time.perf_counter()
                engine._draft(budgets)  # the pass only: nothing is verified, the caches keep their slots
                timings[pending].append((statistics.median(plain), catch_up, time.perf_counter() - start))
    rows = []
    for pending, values in timings.items():
        plain, catch_up, draft = (statistics.median(v) for v in zip(*values))
        rows.append({"pending_slots": pending, "plain_step_s": plain, "catch_up_s": catch_up, "drafting_pass_s": draft})
        print(f"{pending:>3} pending slots at {args.rows} rows: plain step {plain * 1e3:.1f} ms, catch-up ingest "
              f"{catch_up * 1e3:.1f} ms ({catch_up / plain:.2f} plain steps), drafting pass {draft * 1e3:.1f} ms "
              f"({draft / plain:.2f})")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    document = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(), "versions": version_info(),
                "target_dtype": str(target.dtype), "rows": args.rows, "results": rows}
    args.output.write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
