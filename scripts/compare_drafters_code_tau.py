"""Held-out tau of drafters on code stubs, full-block verification, greedy (model selection for the code shapes).

Prompts: 8 stub-completion requests built like `smollm2_prompts.py --code-shapes` from the standard-library
functions just past the 900 that training used (positions 900-907 of the same seed-0 order); 64 new tokens each.
Not a speed benchmark (use `dspark-hf bench`).

    python scripts/compare_drafters_code_tau.py --prompt-files WORK/prompts.jsonl WORK/extra.jsonl -- DRAFTER_DIR ...
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

import torch

from dspark_hf import DSparkDrafter
from dspark_hf.models import load_target

sys.path.insert(0, str(Path(__file__).parent))
from smollm2_prompts import STUB_ASK, stdlib_functions  # noqa: E402


def held_out_stubs(prompt_files: list[Path], first: int = 900, count: int = 8) -> list[str]:
    used = set()
    for path in prompt_files:
        for line in path.read_text().splitlines():
            match = re.match(r"Write a Python function `(\w+)\(", json.loads(line)["turns"][0]) if line.strip() else None
            if match:
                used.add(match.group(1))
    functions = stdlib_functions(used)
    random.Random(0).shuffle(functions)
    prompts = []
    for _, signature, doc in functions[first:first + count]:
        body = "\n".join(("    " + line) if line else "" for line in doc.splitlines())
        prompts.append(f'{STUB_ASK}\n```python\n{signature}\n    """ {body.lstrip()}\n    """\n\n```')
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-files", type=Path, nargs="+", required=True,
                        help="the first two prompt files (their functions are excluded, as in --code-shapes)")
    parser.add_argument("drafters", nargs="+")
    args = parser.parse_args()
    prompts = held_out_stubs(args.prompt_files)
    target, tokenizer = load_target()
    for path in args.drafters:
        drafter = DSparkDrafter.from_pretrained(path, target=target, dtype=target.dtype).eval()
        drafter.verification_policy = "full"
        accepted = rounds = 0
        hits, reached = [0] * drafter.config.block_size, [0] * drafter.config.block_size
        for prompt in prompts:
            inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                   return_tensors="pt", return_dict=True)
            with torch.no_grad():
                target.generate(**inputs, assistant_model=drafter, max_new_tokens=64, do_sample=False)
            stats = drafter.generation_stats
            accepted, rounds = accepted + stats.accepted, rounds + stats.num_rounds
            for r in stats.rounds:
                for k in range(min(r.accepted + 1, r.verified)):
                    reached[k] += 1
                    hits[k] += r.accepted > k
        by_position = [round(h / n, 2) if n else None for h, n in zip(hits, reached)]
        print(path, "code tau", round((accepted + rounds) / rounds, 3), "acceptance by position", by_position,
              flush=True)


if __name__ == "__main__":
    main()
