"""`dspark-hf` command line: one subcommand per module, imported only when used.

Each subcommand module exposes `main(argv: list[str]) -> int | None`.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("dspark_hf.demo", "run the embedded default target with and without DSpark, side by side"),
    "prepare-data": ("dspark_hf.training.data", "regenerate training responses with the target"),
    "train": ("dspark_hf.training.train", "train or LoRA-fine-tune a DSpark drafter"),
    "calibrate": ("dspark_hf.calibration", "fit Sequential Temperature Scaling of the confidence head"),
    "reduce-vocab": ("dspark_hf.vocabulary", "keep only the tokens the target writes in a drafter (faster drafting)"),
    "profile": ("dspark_hf.profiling", "profile the target's steps/s by verification length"),
    "bench": ("dspark_hf.benchmarks.bench", "side-by-side benchmark of speculative methods"),
    "bench-load": ("dspark_hf.benchmarks.bench_load", "throughput under concurrent load"),
    "bench-merge": ("dspark_hf.benchmarks.merge", "merge the results of one benchmark run in parts (--start/--limit)"),
    "trace": ("dspark_hf.simulation.trace", "trace a drafter over the target's greedy outputs (for simulate)"),
    "simulate": ("dspark_hf.simulation.simulate", "replay verification policies on a trace with a cost model"),
    "push": ("dspark_hf.hub", "push a drafter with its model card to the Hub"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, COMMANDS))
        print("usage: dspark-hf COMMAND [options]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<{width}}  {help_text}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dspark-hf: unknown command {name!r}; run `dspark-hf --help` for the list.", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
