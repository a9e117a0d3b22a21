"""What squeezing the holes out of the batched engine's caches costs (`cache_ops.compact_slots`): the slots picked by
advanced indexing (`cache_ops.select_slots`, whole head-dim vectors) against `gather` along the slot axis (the
implementation before 2026-12-06), on caches shaped like the embedded target's (30 layers, 3 K/V heads of 64, bf16) at
8-32 rows and 300 slots with ~15 holes per row, the two methods timed in turn.

    python scripts/compaction_cost.py --output benchmarks/results/compaction/cost.json
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
from dspark_hf.generation.cache_ops import select_slots


def gather_slots(states: torch.Tensor, order: torch.LongTensor) -> torch.Tensor:
    index = order[:, None, :, None].expand(*states.shape[:2], order.shape[1], states.shape[-1])
    return states.gather(2, index)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--slots", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    layers, heads, dim = 30, 3, 64
    results = []
    for rows in args.rows:
        # the engine's caches: views of the first slots of buffers with headroom, K and V per layer
        caches = [torch.randn(rows, heads, args.slots + 64, dim, dtype=torch.bfloat16)[:, :, :args.slots]
                  for _ in range(2 * layers)]
        mask = torch.ones(rows, args.slots, dtype=torch.bool)
        for row in range(rows):
            mask[row, torch.randperm(args.slots - 20)[:12 + row % 7] + 10] = False
        width = int(mask.sum(dim=1).max())
        order = torch.sort(mask.to(torch.int8), dim=1, stable=True).indices[:, args.slots - width:]
        assert all(torch.equal(select_slots(c, order), gather_slots(c, order)) for c in caches[:2])
        timings = {"select_slots": [], "gather": []}
        for _ in range(args.repeats):
            for name, pick in (("select_slots", select_slots), ("gather", gather_slots)):
                start = time.perf_counter()
                for states in caches:
                    pick(states, order)
                timings[name].append(time.perf_counter() - start)
        row = {"rows": rows, "slots": args.slots, "kept_slots": width,
               **{f"{name}_ms_median": 1000 * statistics.median(values) for name, values in timings.items()}}
        row["speedup"] = row["gather_ms_median"] / row["select_slots_ms_median"]
        results.append(row)
        print(f"{rows} rows: select_slots {row['select_slots_ms_median']:.1f} ms, gather {row['gather_ms_median']:.1f} "
              f"ms per compaction of the target cache ({row['speedup']:.2f}x)", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "machine": machine_info(),
                                       "versions": version_info(), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
