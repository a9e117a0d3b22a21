"""`dspark-hf` command line: one subcommand per module, imported only when used.

Each subcommand module exposes `main(argv: list[str]) -> int | None`.
"""

from __future__ import annotations

import argparse
import importlib
import os
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


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` with the project's option spelling: snake_case (`--max_new_tokens`), as
    `transformers.HfArgumentParser` writes it for the other commands, with kebab-case (`--max-new-tokens`) accepted."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # a misspelt option is an error, not a guess
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args([self._canonical(arg) for arg in args], namespace)

    def _canonical(self, arg: str) -> str:
        if not arg.startswith("--") or arg == "--":
            return arg
        option, equals, value = arg.partition("=")
        snake = "--" + option[2:].replace("-", "_")
        return snake + equals + value if snake in self._option_string_actions else arg


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default once: not for a required option, an unset default (None, False), or a help text
    that already states it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.required or action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def dataclass_parser(dataclass_types, command: str, description: str | None = None):
    """`transformers.HfArgumentParser` for a `dspark-hf COMMAND` (its usage line names the command)."""
    from transformers import HfArgumentParser

    return HfArgumentParser(dataclass_types, prog=f"dspark-hf {command}", description=description,
                            formatter_class=HelpFormatter)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        width = max(map(len, COMMANDS))
        print("usage: dspark-hf COMMAND [options]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<{width}}  {help_text}")
        print("\n`dspark-hf COMMAND --help` lists a command's options. Options are spelled in snake_case "
              "(--max_new_tokens); kebab-case (--max-new-tokens) works too.")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"dspark-hf: unknown command {name!r}; run `dspark-hf --help` for the list.", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except (ValueError, OSError) as error:  # bad input: one line that says what and how to fix, no traceback
        if os.environ.get("DSPARK_HF_TRACEBACK"):
            raise
        print(f"dspark-hf {name}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
