"""`W2 · e` by row count: the bf16 `nn.Linear` drafting used to run (then upcast, as drafting does) against the float32
rank-major copy `DSparkMarkovHead._transition` multiplies by (benchmarks/results/drafting-profile/README.md).

    python scripts/markov_product_rows.py --output benchmarks/results/drafting-profile/markov_rows.json
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


def microseconds(function, calls: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        function()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    linear = torch.nn.Linear(args.rank, args.vocab, bias=False).to(torch.bfloat16)
    rows_major = linear.weight.float().t().contiguous()
    results = {}
    for rows in args.rows:
        embedding = torch.randn(rows, args.rank).to(torch.bfloat16)
        results[rows] = {"bf16_linear_us": microseconds(lambda: linear(embedding).float(), args.calls),
                         "float32_rows_major_us": microseconds(lambda: embedding.float() @ rows_major, args.calls)}
        print(rows, *(f"{value:.1f}" for value in results[rows].values()))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "machine": machine_info(),
                                           "versions": version_info(), "rank": args.rank, "vocab": args.vocab,
                                           "medians": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
