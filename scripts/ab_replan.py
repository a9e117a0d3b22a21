"""A planned round cut by its own confidences (`replan`, `scheduling.keeps_verifying`) against the plan verified as
it is, measured A/B.

Under load (the default): target-only and the hardware-aware engine with and without the cut, every closed loop
stepped in turn on its own clock (`run_level_interleaved`, as `dspark-hf bench-load` runs), bf16 where native,
lockstep budgets of 256 tokens. At batch 1 (`--batch1`): `dspark-hf bench`'s interleaved loop (`run_benchmark`) over
target-only and hardware-aware + prompt lookup with and without the cut, in the target dtype asked for.

    python scripts/ab_replan.py --levels 8 16 32 --output benchmarks/results/load-interleaved/replan/ab.json
    python scripts/ab_replan.py --batch1 --target_dtype float32 --limit 4 \
        --output benchmarks/results/load-interleaved/replan/batch1-float32.json
"""

from __future__ import annotations

import json
import sys

from ab_engine_min_gain import SHARED, parser, run_ab
from dspark_hf.benchmarks.bench import BenchSettings, machine_info, run_benchmark, version_info
from dspark_hf.benchmarks.methods import BenchMethod, _dspark_method
from dspark_hf.benchmarks.prompts import load_prompts
from dspark_hf.benchmarks.report import markdown_table, summarize_records
from dspark_hf.generation.policies import HardwareAwarePolicy
from dspark_hf.modeling_dspark import DSparkDrafter
from dspark_hf.models import DEFAULT_TARGET, EMBEDDED_DRAFTERS, drafter_dtype, load_target, target_dtype
from dspark_hf.profiling import steps_per_second_here

SETS = ("gsm8k", "humaneval", "mt-bench")


def batch1(args) -> None:
    target, tokenizer = load_target(DEFAULT_TARGET, dtype=target_dtype(args.target_dtype))
    drafter = DSparkDrafter.from_pretrained(EMBEDDED_DRAFTERS[DEFAULT_TARGET], target=target,
                                            dtype=drafter_dtype("auto")).eval()
    profile = steps_per_second_here(target, drafter)[0]  # this machine's, in this dtype (as `auto` plans)
    methods = [BenchMethod("target", "target", {})] + [
        _dspark_method(name, drafter, HardwareAwarePolicy(profile, replan=replan), args.prompt_lookup_num_tokens)
        for name, replan in (("dspark_replan_lookup", True), ("dspark_plan_as_is_lookup", False))]
    prompts = load_prompts([str(SHARED / "data/eval" / f"{name}.jsonl") for name in SETS], limit=args.limit)
    settings = BenchSettings(max_new_tokens=args.max_new_tokens)
    records = run_benchmark(target, tokenizer, methods, prompts, settings, progress=True)
    summary = summarize_records(records)
    table = markdown_table(summary, "greedy")
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    document = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(), "versions": version_info(),
                "target_dtype": str(target.dtype), "settings": {k: str(v) for k, v in vars(args).items()},
                "summary": summary, "records": records}
    args.output.write_text(json.dumps(document, indent=1) + "\n")
    args.output.with_suffix(".md").write_text(table + "\n")


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--batch1", action="store_true", help="batch 1 instead of the batched engine")
    arguments.add_argument("--target_dtype", default="auto", help="batch 1: the target's dtype (auto, float32, ...)")
    arguments.add_argument("--limit", type=int, default=4, help="batch 1: prompts per set")
    arguments.add_argument("--prompt_lookup_num_tokens", type=int, default=10, help="batch 1: prompt lookup tokens")
    args = arguments.parse_args()
    if args.batch1:
        return batch1(args)
    # one policy per variant for the whole run, as bench-load keeps one per method (its step timings carry over)
    run_ab({"hardware_aware (replan)": HardwareAwarePolicy(str(args.sps)),
            "hardware_aware (plan as is)": HardwareAwarePolicy(str(args.sps), replan=False)}, args)


if __name__ == "__main__":
    main()
