"""The batched engine's margin (`engine_min_gain`) measured A/B under load: target-only and the hardware-aware policy
at several margins, every closed loop stepped in turn on its own clock (`run_level_interleaved`, as `dspark-hf
bench-load` runs), bf16 where native, lockstep budgets.

The replay (`dspark-hf simulate`) cannot judge a margin: its costs carry no timing noise, and what a margin buys is
protection from plans that read noisy step times and stale confidences (planned rounds at 8-32 rows accepted 13-18%
fewer drafts than their plans expected in the replay).

    python scripts/ab_engine_min_gain.py --levels 8 16 32 --min_gains 0 0.1 0.2 \
        --output benchmarks/results/load-interleaved/min-gain/ab.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dspark_hf.benchmarks.bench import machine_info, version_info
from dspark_hf.benchmarks.bench_load import pooled_rows, run_passes
from dspark_hf.benchmarks.prompts import first_turn_ids
from dspark_hf.generation.batched import DSparkBatchEngine
from dspark_hf.generation.policies import HardwareAwarePolicy
from dspark_hf.modeling_dspark import DSparkDrafter
from dspark_hf.models import DEFAULT_TARGET, EMBEDDED_DRAFTERS, drafter_dtype, load_target, target_dtype
from dspark_hf.profiling import load_speed_tables

SHARED = Path(__file__).resolve().parents[2] / "shared"
PROFILE = Path(__file__).resolve().parents[1] / "benchmarks/results/smollm2-load-stage7-bf16/bf16-profile.json"


def load_models(dtype: str = "auto", packed_linear: str = "auto"):
    """The embedded default (in bf16 where native by default), with bench-load's prompts (gsm8k, then humaneval)
    tokenized."""
    torch.manual_seed(0)
    target, tokenizer = load_target(DEFAULT_TARGET, dtype=target_dtype(dtype), packed_linear=packed_linear)
    drafter = DSparkDrafter.from_pretrained(EMBEDDED_DRAFTERS[DEFAULT_TARGET], target=target,
                                            dtype=drafter_dtype("auto")).eval()
    prompts = first_turn_ids(tokenizer, [SHARED / "data/eval/gsm8k.jsonl", SHARED / "data/eval/humaneval.jsonl"])
    return target, drafter, tokenizer, prompts


def run_ab(variants: dict[str, HardwareAwarePolicy | tuple[HardwareAwarePolicy, type]], args) -> None:
    """Target-only and the hardware-aware engine with each policy of `variants` (or `(policy, engine class)`),
    stepped in turn at `args.levels` (`args.repeats` passes, rotated), pooled like bench-load; prints and writes
    `args.output` (JSON)."""
    target, drafter, tokenizer, prompts = load_models()
    common = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id or 0}
    by_rows = load_speed_tables(args.sps)
    variants = {name: value if isinstance(value, tuple) else (value, DSparkBatchEngine)
                for name, value in variants.items()}
    engines = [("target", lambda: DSparkBatchEngine(target, None, **common))] + [
        (name, lambda policy=policy, engine=engine: engine(target, drafter, policy=policy,
                                                           steps_per_second_by_rows=by_rows, **common))
        for name, (policy, engine) in variants.items()]
    results = []
    for level in args.levels:
        passes = run_passes(engines, prompts, level, max(2 * level, 8), args.max_new_tokens, args.repeats)
        for row in pooled_rows(passes):
            results.append(row)
            print(f"c={level:>3} {row['method']:>28}: {row['full_load_vs_target']:.3f}x at full load, "
                  f"{row['throughput_vs_target']:.3f}x whole run, tau {row['tau']:.2f}, "
                  f"{row['skipped_rounds']}/{row['rounds']} rounds without drafter", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    document = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(), "versions": version_info(),
                "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "results": results}
    args.output.write_text(json.dumps(document, indent=2) + "\n")


def parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--sps", type=Path, default=PROFILE)
    parser.add_argument("--output", type=Path, required=True)
    return parser


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--min_gains", type=float, nargs="+", default=[0.0, 0.1, 0.2])
    args = arguments.parse_args()
    # one policy per margin for the whole run, as bench-load keeps one per method (its step timings carry over)
    run_ab({f"hardware_aware min_gain={gain}": HardwareAwarePolicy(str(args.sps), engine_min_gain=gain)
            for gain in args.min_gains}, args)


if __name__ == "__main__":
    main()
