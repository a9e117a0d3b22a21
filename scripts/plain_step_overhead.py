"""What a drafter costs the batched engine in rounds it does not draft (plain decoding at R rows).

Under load the hardware-aware policy decodes plainly for long stretches; a drafter engine's plain step should then
cost what target-only's does. Steps of four engines holding the same R prompts, interleaved step by step in rotated
order (medians, so drift and one slow step move nothing):

- `target`: target-only batched decoding;
- `drafter`: the engine with the drafter, never drafting (as shipped: the round's target features wait for the next
  drafting pass, `DSparkBatchEngine._sync_context`);
- `drafter, ingest every round`: the same, ingesting each round's features at once (the engine before that change);
- `drafter, no context`: neither features nor ingest (the floor: what the target's hidden-state output itself costs).

    python scripts/plain_step_overhead.py --rows 16 32 --output benchmarks/results/plain-step-overhead/overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark_hf.benchmarks.bench import machine_info, version_info
from dspark_hf.benchmarks.prompts import first_turn_ids
from dspark_hf.generation.batched import DSparkBatchEngine
from dspark_hf.modeling_dspark import DSparkDrafter
from dspark_hf.models import DEFAULT_TARGET, DTYPES, EMBEDDED_DRAFTERS, drafter_dtype, load_target, target_dtype

KINDS = ("target", "drafter", "drafter, ingest every round", "drafter, no context")


def make_engine(kind: str, target, drafter, prompts: list[list[int]]) -> DSparkBatchEngine:
    if kind == "target":
        engine = DSparkBatchEngine(target, None, pad_token_id=0)
    else:
        engine = DSparkBatchEngine(target, drafter, policy="full", pad_token_id=0)
        engine.policy.begin_round = lambda *args, **kwargs: False  # never draft
        engine.policy.end_round = lambda *args, **kwargs: None
        if kind == "drafter, ingest every round":
            advance = engine._advance
            engine._advance = lambda *args: advance(*args) or engine._sync_context()
        elif kind == "drafter, no context":
            forward = engine._target_forward
            engine._hidden_state_indices = lambda: None

            def no_features(input_ids, *args, **kwargs):
                return forward(input_ids, *args, **kwargs)[0], input_ids.new_zeros(*input_ids.shape, 0)

            engine._target_forward = no_features
            engine._ingest = lambda *args, **kwargs: None
    for prompt in prompts:
        engine.add_request(prompt, 1 << 20)
    engine.step()  # admission, untimed
    return engine


def measure(rows: int, steps: int, target, drafter, prompts: list[list[int]]) -> dict:
    engines = {kind: make_engine(kind, target, drafter, prompts[:rows]) for kind in KINDS}
    seconds = {kind: [] for kind in KINDS}
    for step in range(steps):
        rotation = step % len(KINDS)
        for kind in KINDS[rotation:] + KINDS[:rotation]:
            start = time.perf_counter()
            engines[kind].step()
            seconds[kind].append(time.perf_counter() - start)
    base = statistics.median(seconds["target"])
    return {kind: {"median_ms": 1000 * statistics.median(values), "vs_target": statistics.median(values) / base}
            for kind, values in seconds.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per engine and row count")
    parser.add_argument("--prompts", default="/work/shared/data/eval/gsm8k.jsonl")
    parser.add_argument("--target_dtype", default="auto", choices=DTYPES)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    target, tokenizer = load_target(DEFAULT_TARGET, dtype=target_dtype(args.target_dtype))
    drafter = DSparkDrafter.from_pretrained(EMBEDDED_DRAFTERS[DEFAULT_TARGET], target=target,
                                            dtype=drafter_dtype("auto")).eval()
    prompts = first_turn_ids(tokenizer, [args.prompts])
    if len(prompts) < max(args.rows):
        parser.error(f"--rows {max(args.rows)} needs as many prompts; {args.prompts} has {len(prompts)}")
    with torch.no_grad():
        results = {rows: measure(rows, args.steps, target, drafter, prompts) for rows in args.rows}
    document = {"command": " ".join(["python", "scripts/plain_step_overhead.py", *(argv or sys.argv[1:])]),
                "machine": machine_info(), "versions": version_info(),
                "target_dtype": str(target.dtype).removeprefix("torch."), "steps": args.steps, "results": results}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(document, indent=2) + "\n")
    for rows, row in results.items():
        print(f"{rows} rows: " + ", ".join(f"{kind} {v['median_ms']:.1f} ms ({v['vs_target']:.3f}x)"
                                           for kind, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
