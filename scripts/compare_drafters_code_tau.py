"""Held-out tau of drafters on code stubs, full-block verification, greedy (model selection for the code shapes).

Prompts: 8 stub-completion requests built like `smollm2_prompts.py --code-shapes` from the standard-library
functions just past the 900 that training used (positions 900-907 of the same seed-0 order); 64 new tokens each.
Not a speed benchmark (use `dspark-hf bench`).

    python scripts/compare_drafters_code_tau.py --prompt-files WORK/prompts.jsonl WORK/extra.jsonl -- DRAFTER_DIR ...
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from dspark_hf.models import load_target

sys.path.insert(0, str(Path(__file__).parent))
from compare_drafters_tau import full_block_tau  # noqa: E402
from smollm2_prompts import stdlib_functions, stub_prompt, used_function_names  # noqa: E402


def held_out_stubs(prompt_files: list[Path], first: int = 900, count: int = 8) -> list[str]:
    functions = stdlib_functions(used_function_names(prompt_files))
    random.Random(0).shuffle(functions)
    return [stub_prompt(signature, doc) for _, signature, doc in functions[first:first + count]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-files", type=Path, nargs="+", required=True,
                        help="the first two prompt files (their functions are excluded, as in --code-shapes)")
    parser.add_argument("drafters", nargs="+")
    args = parser.parse_args()
    prompts = held_out_stubs(args.prompt_files)
    target, tokenizer = load_target()
    for path in args.drafters:
        tau, by_position = full_block_tau(target, tokenizer, path, prompts)
        print(path, "code tau", tau, "acceptance by position", by_position, flush=True)


if __name__ == "__main__":
    main()
