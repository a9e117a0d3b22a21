"""What packing the linear weights for oneDNN (`dspark_hf.packed_linear`) does to the forwards DSpark runs on a CPU.

Times, with the packed layers and without, interleaved round by round (this host's speed drifts within seconds):
the target's forward of k new tokens over a 256-token cache as `generate` runs it (`profiling.time_verification_forwards`,
DSpark's hidden-state request included), and in `--rows` rows as the batched engine runs it; and the drafter's block
forward (the embedded drafter, bf16 where native). Reports medians, each k's cost relative to one token in the same
variant, and packed over unpacked.

    python scripts/packed_linear_speed.py --dtypes float32 bfloat16 --output benchmarks/results/packed-linear/speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from dspark_hf.benchmarks.bench import machine_info, version_info
from dspark_hf.modeling_dspark import DSparkDrafter
from dspark_hf.models import DEFAULT_TARGET, EMBEDDED_DRAFTERS, drafter_dtype, load_target
from dspark_hf.packed_linear import pack_linear_weights
from dspark_hf.profiling import time_verification_forwards

VARIANTS = {"unpacked": "off", "packed": "on"}


def time_drafting(drafter: DSparkDrafter, repeats: int) -> list[float]:
    """Seconds of a drafting pass as a round runs it: ingest 4 new context positions into a 256-position context
    cache, the block forward and the draft-vocabulary LM head (`repeats` times; the context is cropped back after
    each)."""
    config = drafter.config
    width = config.hidden_size * len(config.target_layer_ids)
    block = config.block_size + 1
    cache = DynamicCache(config=config)
    times = []
    with torch.inference_mode():
        drafter(input_ids=torch.randint(config.vocab_size, (1, block)),
                target_hidden_states=torch.randn(1, 256, width, dtype=drafter.dtype),
                position_ids=torch.arange(256, 256 + block)[None], context_position_ids=torch.arange(256)[None],
                cache=cache, compute_logits=False)
        for _ in range(repeats + 1):
            ids = torch.randint(config.vocab_size, (1, block))
            start = time.perf_counter()
            hidden = drafter(input_ids=ids, target_hidden_states=torch.randn(1, 4, width, dtype=drafter.dtype),
                             position_ids=torch.arange(260, 260 + block)[None],
                             context_position_ids=torch.arange(256, 260)[None], cache=cache,
                             compute_logits=False).last_hidden_state
            drafter.draft_logits(hidden)
            times.append(time.perf_counter() - start)
            cache.crop(-4)
    return times[1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16])
    parser.add_argument("--rows", type=int, nargs="*", default=[16], help="also time the engine's layout at these rows")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (one timing per size per round)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()

    results = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        target, _ = load_target(DEFAULT_TARGET, dtype=dtype, packed_linear="off")
        drafter = DSparkDrafter.from_pretrained(EMBEDDED_DRAFTERS[DEFAULT_TARGET], target=target,
                                                dtype=drafter_dtype("auto")).eval()
        kwargs = {"output_hidden_states": drafter.config.hidden_state_indices}
        layouts = [(1, False)] + [(rows, True) for rows in args.rows]
        timings = {(v, rows): {k: [] for k in args.sizes} for v in VARIANTS for rows, _ in layouts}
        drafting = {v: [] for v in VARIANTS}
        for round_index in range(args.rounds):
            for variant, mode in VARIANTS.items():
                pack_linear_weights(target, mode)
                pack_linear_weights(drafter, mode)
                for rows, engine_layout in layouts:
                    measured = time_verification_forwards(target, args.sizes, rows, 256, warmup=1, repeats=1,
                                                          forward_kwargs=kwargs, engine_layout=engine_layout,
                                                          seed=round_index)
                    for k, seconds in measured.items():
                        timings[(variant, rows)][k] += seconds
                drafting[variant] += time_drafting(drafter, 3)
            print(f"{dtype_name}: round {round_index + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for rows, _ in layouts:
            medians = {v: {k: statistics.median(timings[(v, rows)][k]) for k in args.sizes} for v in VARIANTS}
            for k in args.sizes:
                results.append({
                    "dtype": dtype_name, "rows": rows, "tokens_per_row": k,
                    **{f"{v}_ms": 1e3 * medians[v][k] for v in VARIANTS},
                    **{f"{v}_vs_one_token": medians[v][k] / medians[v][1] for v in VARIANTS},
                    "packed_over_unpacked": medians["packed"][k] / medians["unpacked"][k],
                })
        results.append({"dtype": dtype_name, "drafter_dtype": str(drafter.dtype).removeprefix("torch."),
                        "part": "drafter block forward",
                        **{f"{v}_ms": 1e3 * statistics.median(drafting[v]) for v in VARIANTS},
                        "packed_over_unpacked": statistics.median(drafting["packed"])
                        / statistics.median(drafting["unpacked"])})
    for row in results:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    document = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(), "versions": version_info(),
                "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "results": results}
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
