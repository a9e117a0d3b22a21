"""Held-out tau of several drafters for the embedded target, full-block verification, greedy (model selection).

Prompts: gsm8k lines 1250-1259 (free for training, used by neither training nor calibration here) and three short
code/chat requests; 64 new tokens each. Not a speed benchmark (use `dspark-hf bench`).

    python scripts/compare_drafters_tau.py DRAFTER_DIR [DRAFTER_DIR ...] [--gsm8k ../shared/data/eval/gsm8k.jsonl]
"""

from __future__ import annotations

import argparse
import json

import torch

from dspark_hf import DSparkDrafter
from dspark_hf.models import load_target

EXTRA = [
    "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals.",
    "Write a Python function `word_count(text)` returning a dict of word frequencies.",
    "Explain what a Makefile is in simple terms.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafters", nargs="+")
    parser.add_argument("--gsm8k", default="../shared/data/eval/gsm8k.jsonl")
    args = parser.parse_args()
    target, tokenizer = load_target()
    lines = open(args.gsm8k).read().splitlines()[1249:1259]
    prompts = [json.loads(line)["turns"][0] for line in lines] + EXTRA
    for path in args.drafters:
        tau, by_position = full_block_tau(target, tokenizer, path, prompts)
        print(path, "tau", tau, "acceptance by position", by_position, flush=True)


def full_block_tau(target, tokenizer, path: str, prompts: list[str]) -> tuple[float, list[float | None]]:
    """Tau and acceptance by block position of the drafter at `path`, full-block greedy, 64 new tokens a prompt."""
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
    return round((accepted + rounds) / rounds, 3), [round(h / n, 2) if n else None for h, n in zip(hits, reached)]


if __name__ == "__main__":
    main()
