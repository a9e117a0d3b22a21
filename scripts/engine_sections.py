"""Where a batched engine's time goes in a closed loop, by section: the target's forwards, the drafting passes, the
drafter's context catch-ups, admissions (prefill of both models), row removals, and each drafted round.

`bench-load` times steps and drafting passes; this wraps the engine's own methods with timers instead, so that what a
drafter costs around the steps (its share of every admission, its catch-ups, the rounds it drafts while draining) shows
up next to target-only's. Methods run one after the other, not interleaved: compare sections, not totals, across
runs on a noisy machine.

    python scripts/engine_sections.py --target_dtype float32 --rows 32 --requests 64 \
        --output benchmarks/results/packed-linear/engine-sections-fp32-32.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time
from pathlib import Path

from dspark_hf.benchmarks.bench import machine_info, version_info
from dspark_hf.benchmarks.bench_load import ClosedLoop
from dspark_hf.benchmarks.prompts import first_turn_ids
from dspark_hf.generation import batched
from dspark_hf.generation.batched import DSparkBatchEngine
from dspark_hf.generation.policies import get_policy
from dspark_hf.modeling_dspark import DSparkDrafter
from dspark_hf.models import DEFAULT_TARGET, DTYPES, EMBEDDED_DRAFTERS, drafter_dtype, load_target, target_dtype
from dspark_hf.profiling import load_speed_tables, steps_per_second_here

SECTIONS = ("_admit", "_drop_finished", "_sync_context", "_draft", "_target_forward", "_advance", "_commit_and_retire")
EVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"


def timed(function, totals: dict, name: str):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            totals[name][0] += time.perf_counter() - start
            totals[name][1] += 1
    return wrapper


def run(method: str, target, drafter, profile: Path, prompts, rows: int, requests: int, max_new_tokens: int,
        eos_token_id: int) -> dict:
    if method == "target":
        engine = DSparkBatchEngine(target, None, eos_token_id=eos_token_id, pad_token_id=0)
    else:
        engine = DSparkBatchEngine(target, drafter, policy=get_policy("hardware_aware", steps_per_second=str(profile)),
                                   steps_per_second_by_rows=load_speed_tables(profile), eos_token_id=eos_token_id,
                                   pad_token_id=0)
    totals = collections.defaultdict(lambda: [0.0, 0])
    for name in SECTIONS:
        setattr(engine, name, timed(getattr(engine, name), totals, name))
    compact = batched.cache_ops.compact_slots
    batched.cache_ops.compact_slots = timed(compact, totals, "compact_slots")
    drafted = []
    if engine.policy is not None:
        end_round = engine.policy.end_round

        def record(outcome):
            if outcome.drafted:
                drafted.append({"rows": len(outcome.verified), "width": outcome.width,
                                "tokens": sum(a + 1 for a in outcome.accepted), "draft_seconds": outcome.draft_seconds,
                                "step_seconds": outcome.step_seconds})
            return end_round(outcome)
        engine.policy.end_round = record
    try:
        loop = ClosedLoop(engine, prompts, rows, requests, max_new_tokens)
        start = time.perf_counter()
        while not loop.done:
            loop.step()
        seconds = time.perf_counter() - start
    finally:
        batched.cache_ops.compact_slots = compact
    tokens = sum(len(r.output_ids) for r in loop.requests)
    plain = {rows_: round(s, 5) for (rows_, width), s in sorted(engine.policy.speed_model.step_seconds.items())
             if width == 1} if engine.policy is not None else None
    return {"method": method, "seconds": seconds, "tokens": tokens, "tokens_per_second": tokens / seconds,
            "steps": loop.steps, "sections": {k: {"seconds": v[0], "calls": v[1]} for k, v in sorted(totals.items())},
            "drafted_rounds": drafted, "measured_plain_step_seconds_by_rows": plain}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target_dtype", default="float32", choices=DTYPES)
    parser.add_argument("--rows", type=int, default=32, help="requests in flight")
    parser.add_argument("--requests", type=int, default=64, help="requests to finish")
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--prompts", nargs="+", default=[str(EVAL / "gsm8k.jsonl"), str(EVAL / "humaneval.jsonl")])
    parser.add_argument("--methods", default="target,hardware_aware")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    target, tokenizer = load_target(dtype=target_dtype(args.target_dtype))
    drafter = DSparkDrafter.from_pretrained(str(EMBEDDED_DRAFTERS[DEFAULT_TARGET]), target=target,
                                            dtype=drafter_dtype("auto")).eval()
    prompts = first_turn_ids(tokenizer, args.prompts)
    profile = steps_per_second_here(target, drafter, batch_sizes=sorted({1, 2, 4, 8, 16, 32, args.rows}))[1]
    results = [run(method, target, drafter, profile, prompts, args.rows, args.requests, args.max_new_tokens,
                   tokenizer.eos_token_id) for method in args.methods.split(",")]
    for result in results:
        print(f"{result['method']}: {result['tokens_per_second']:.1f} tokens/s, {result['seconds']:.1f} s, "
              f"{len(result['drafted_rounds'])} drafted rounds")
        for name, section in result["sections"].items():
            print(f"  {name:20s} {section['seconds']:7.2f} s  {section['calls']:5d} calls")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"command": "python scripts/engine_sections.py " + " ".join(
        f"--{k} {' '.join(v) if isinstance(v, list) else v}" for k, v in vars(args).items()),
        "machine": machine_info(), "versions": version_info(), "target_dtype": str(target.dtype),
        "results": results}, indent=1))
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
