"""Ragged forwards in the batched engine (`dspark_hf.packed_linear.real_tokens_only`) measured: linear layers that
compute only the tokens a forward really carries, against the padded forwards the engine ran before.

The engine prefills left-padded prompts and verifies every row at one padded width, and the padding ran through every
linear layer like real tokens: a prefill of prompts of 100 and 300 tokens cost two of 300, a round where 8 of 32 rows
verify 4 drafts what one where all 32 do. Engines that batch ragged sequences (vLLM, SGLang) pay only for the tokens
they compute. With a packed target the engine now gathers the real tokens into the linear layers and scatters the
results back (attention still runs padded) where at least `RAGGED_MIN_PADDING` of a forward
is padding.

`--forwards` times single forwards (the engine's slot cache and grouped-query attention), padded and ragged,
interleaved: prefills of 4, 16 and 32 gsm8k / humaneval prompts, and rounds at 32 rows over a 256-token cache where 8
rows verify 2 or 5 tokens; it checks the real tokens' logits against the padded forward's. `--levels` runs closed
loops side by side as `dspark-hf bench-load` does (every loop stepped in turn on its own clock, lockstep budgets):
target-only and hardware-aware + prompt lookup, each with ragged forwards (the engine as it is) and padded ones.

    python scripts/ab_ragged_verification.py --target_dtype float32 --forwards --levels 16 32 \
        --output benchmarks/results/ragged-verification/ab-fp32.json
    python scripts/ab_ragged_verification.py --target_dtype bfloat16 --packed_linear on --forwards --levels 16 32 \
        --output benchmarks/results/ragged-verification/ab-bf16.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark_hf.benchmarks.bench import machine_info, version_info
from dspark_hf.benchmarks.bench_load import level_exactness, pooled_rows, run_passes
from dspark_hf.generation import cache_ops
from dspark_hf.generation.batched import DSparkBatchEngine
from dspark_hf.generation.gqa import native_gqa, packed_gqa
from dspark_hf.generation.policies import HardwareAwarePolicy
from dspark_hf.packed_linear import is_packed, real_tokens_only
from dspark_hf.profiling import load_speed_tables, steps_per_second_here

from ab_engine_min_gain import load_models


class PaddedEngine(DSparkBatchEngine):
    """The engine as it ran before ragged forwards: every forward computes its padding too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._packed_target = False


def _timed(target, ragged: bool, **inputs) -> tuple[float, torch.Tensor]:
    width = inputs["input_ids"].shape[1]
    mask = inputs["attention_mask"][:, -width:]
    start = time.perf_counter()
    with torch.inference_mode(), native_gqa(target.device, width), packed_gqa(target, width), \
            real_tokens_only(mask if ragged else None):
        out = target(**inputs, use_cache=True)
    return time.perf_counter() - start, out.logits


def time_forwards(target, prompts: list[list[int]], rounds: int = 5) -> list[dict]:
    """Medians of single forwards, padded and ragged in turn, and the largest logit difference at real tokens."""
    cases = []
    rng = random.Random(0)
    for count in (4, 16, 32):  # a prefill of `count` left-padded prompts, as the engine admits them
        batch = rng.sample(prompts, count)
        width = max(map(len, batch))
        ids = torch.zeros(count, width, dtype=torch.long)
        mask = torch.zeros(count, width, dtype=torch.bool)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = True
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        cases.append((f"prefill of {count} prompts ({int(mask.sum())} tokens, {mask.numel()} padded)", None,
                      dict(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1), mask[:, -1:]))
    rows, context = 32, 256
    torch.manual_seed(0)
    cache = cache_ops.slot_cache(target.config)
    with torch.inference_mode():
        target(input_ids=torch.randint(1000, 40000, (rows, context)), past_key_values=cache, use_cache=True,
               logits_to_keep=1)
    for width in (2, 5):  # a round at 32 rows where 8 rows verify `width` tokens and 24 one
        new = torch.zeros(rows, width, dtype=torch.bool)
        new[:, 0] = True
        new[:8] = True
        cases.append((f"round at 32 rows, {width} tokens in 8 rows, 1 in 24", cache,
                      dict(input_ids=torch.randint(1000, 40000, (rows, width)),
                           attention_mask=torch.cat([torch.ones(rows, context, dtype=torch.bool), new], dim=1),
                           position_ids=torch.arange(context, context + width)[None].expand(rows, -1)), new))
    times = {(name, ragged): [] for name, *_ in cases for ragged in (False, True)}
    logits = {}
    for round_index in range(rounds + 1):
        for name, shared_cache, inputs, real in cases:
            for ragged in (False, True):
                cache_here = shared_cache if shared_cache is not None else cache_ops.slot_cache(target.config)
                seconds, out = _timed(target, ragged, past_key_values=cache_here, **inputs)
                if shared_cache is not None:
                    shared_cache.crop(-inputs["input_ids"].shape[1])
                if round_index:
                    times[(name, ragged)].append(seconds)
                logits[(name, ragged)] = out[real]
    results = []
    for name, *_ in cases:
        padded, ragged = (statistics.median(times[(name, kind)]) for kind in (False, True))
        results.append({"forward": name, "padded_ms": 1e3 * padded, "ragged_ms": 1e3 * ragged,
                        "ragged_over_padded": ragged / padded,
                        "max_abs_logit_diff_at_real_tokens": (logits[(name, False)] - logits[(name, True)]).abs()
                        .max().item()})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target_dtype", default="auto")
    parser.add_argument("--packed_linear", default="auto", help="auto, on (ragged forwards need packed layers)")
    parser.add_argument("--levels", type=int, nargs="*", default=[16, 32])
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--lookup", type=int, default=10, help="prompt lookup tokens inside rounds")
    parser.add_argument("--forwards", action="store_true", help="time single forwards first")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()

    target, drafter, tokenizer, prompts = load_models(args.target_dtype, args.packed_linear)
    if not is_packed(target):
        raise SystemExit(f"The target's linear layers are not packed (--packed_linear {args.packed_linear}): ragged "
                         "forwards need packed layers; pass --packed_linear on.")
    document = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(), "versions": version_info(),
                "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "target_dtype": str(target.dtype).removeprefix("torch.")}
    if args.forwards:
        document["forwards"] = time_forwards(target, prompts)
        for row in document["forwards"]:
            print(json.dumps(row), flush=True)
    if args.levels:
        sps = steps_per_second_here(target, drafter, batch_sizes=args.levels)[1]
        by_rows = load_speed_tables(sps)
        common = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id or 0}
        # one policy per method for the whole run, as bench-load keeps one per method (its step timings carry over)
        policies = {kind: HardwareAwarePolicy(str(sps)) for kind in ("ragged", "padded")}

        def speculative(kind: str, engine: type) -> DSparkBatchEngine:
            return engine(target, drafter, policy=policies[kind], steps_per_second_by_rows=by_rows,
                          prompt_lookup_num_tokens=args.lookup, **common)

        engines = [("target", lambda: DSparkBatchEngine(target, None, **common)),
                   ("target (padded)", lambda: PaddedEngine(target, None, **common)),
                   ("hardware_aware+lookup", lambda: speculative("ragged", DSparkBatchEngine)),
                   ("hardware_aware+lookup (padded)", lambda: speculative("padded", PaddedEngine))]
        document["speed_profile"], document["levels"] = str(sps), []
        for level in args.levels:
            passes = run_passes(engines, prompts, level, max(2 * level, 8), args.max_new_tokens, args.repeats)
            rows = pooled_rows(passes)
            for row in rows:
                row["identical_to_target"] = level_exactness(target, passes["target"], passes[row["method"]])
                print(f"c={level:>3} {row['method']:>32}: {row['full_load_throughput_tok_s']:.1f} tokens/s at full "
                      f"load ({row['full_load_vs_target']:.3f}x), {row['throughput_vs_target']:.3f}x whole run, "
                      f"identical {row['identical_to_target']['identical']}/"
                      f"{row['identical_to_target']['identical_of']}", flush=True)
            document["levels"].append({"concurrency": level, "results": rows})
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
