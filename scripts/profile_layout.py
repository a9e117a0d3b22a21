"""What a verification forward of k tokens per row costs timed two ways, at several row counts: as `generate` runs one
sequence (transformers' cache, no attention mask: the way `dspark-hf profile` timed every batch size before
2026-12-07) and as the batched engine runs its forwards (`time_verification_forwards(engine_layout=True)`: its
appending cache, a mask over the slots with a padding slot per row, packed or native grouped-query attention). The two
are timed in turn, round by round (medians), so that host drift meets both alike.

    python scripts/profile_layout.py --rows 8 16 32 --output benchmarks/results/profile-layout/layout.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from dspark_hf.benchmarks.bench import machine_info, version_info
from dspark_hf.models import DEFAULT_TARGET, DTYPES, EMBEDDED_DRAFTERS, load_target, target_dtype
from dspark_hf.profiling import _drafter_forward_kwargs, time_verification_forwards

LAYOUTS = {"as one sequence (before)": False, "as the engine runs it (now)": True}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both layouts in turn")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per size, layout and round")
    parser.add_argument("--target_dtype", default="auto", choices=DTYPES)
    parser.add_argument("--output", required=True)
    args = parser.parse_args(argv)
    target, _ = load_target(DEFAULT_TARGET, dtype=target_dtype(args.target_dtype))
    # the hidden states DSpark's verification forwards ask for, as `dspark-hf profile --drafter` reads them
    forward_kwargs = _drafter_forward_kwargs(str(EMBEDDED_DRAFTERS[DEFAULT_TARGET]))
    results = {}
    with torch.no_grad():
        for rows in args.rows:
            seconds = {name: {k: [] for k in args.tokens} for name in LAYOUTS}
            for round_index in range(args.rounds):
                order = list(LAYOUTS) if round_index % 2 == 0 else list(reversed(LAYOUTS))
                for name in order:
                    timings = time_verification_forwards(target, args.tokens, rows, 256, warmup=1,
                                                         repeats=args.repeats, forward_kwargs=forward_kwargs,
                                                         engine_layout=LAYOUTS[name])
                    for k, values in timings.items():
                        seconds[name][k] += values
            results[rows] = {name: {"median_ms": {k: 1000 * statistics.median(v) for k, v in by_k.items()}}
                             for name, by_k in seconds.items()}
            for name, row in results[rows].items():
                base = row["median_ms"][args.tokens[0]]
                row["vs_first"] = {k: ms / base for k, ms in row["median_ms"].items()}
                print(f"{rows} rows, {name}: " + ", ".join(f"{k} tokens {ms:.0f} ms ({row['vs_first'][k]:.2f})"
                                                           for k, ms in row["median_ms"].items()))
    document = {"command": " ".join(["python", "scripts/profile_layout.py", *(argv or sys.argv[1:])]),
                "machine": machine_info(), "versions": version_info(),
                "target_dtype": str(target.dtype).removeprefix("torch."), "context_length": 256,
                "rounds": args.rounds, "repeats": args.repeats, "results": results}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
