"""Full vs reduced draft vocabularies of the embedded drafter, in one run: tau, coverage and drafting speed.

For each vocabulary size (the full 49,152 ids, then each `--sizes` value ranked on the training responses in
`--data`), on the first `--limit` prompts of gsm8k, humaneval and mt-bench (first turns, chat template, greedy):

- full-block tau per category (every draft verified, so tau measures the drafts alone), and the share of the
  target's own output tokens inside the draft vocabulary;
- wall time with one draft verified per round (`fixed:1`: every round drafts, so drafting cost shows), variants
  interleaved per prompt, `--repeats` times, as a ratio to the full vocabulary.

Outputs are checked identical to target-only greedy. Not a substitute for `dspark-hf bench`; it isolates the
vocabulary. Run on an otherwise idle machine:

    python scripts/compare_draft_vocab.py --drafter WORK/dspark_cal --data WORK/conv WORK/conv2a ... \
        --output benchmarks/results/smollm2-training/draft_vocab.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
import transformers

import dspark_hf
from dspark_hf import DSparkDrafter, FixedLengthPolicy
from dspark_hf.benchmarks.prompts import load_prompts
from dspark_hf.models import load_target
from dspark_hf.vocabulary import count_response_tokens, coverage, select_draft_vocabulary, special_token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", required=True, help="prepared training data (ranks the vocabulary)")
    parser.add_argument("--sizes", nargs="+", type=int, default=[16384, 8192])
    parser.add_argument("--drafter", required=True,
                        help="the full-vocabulary drafter (e.g. WORK/dspark_cal from scripts/train_smollm2_drafter.sh)")
    parser.add_argument("--eval-dir", default="../shared/data/eval")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    target, tokenizer = load_target()
    path = args.drafter
    counts = count_response_tokens(args.data)
    drafters = {}
    for size in [None, *args.sizes]:
        drafter = DSparkDrafter.from_pretrained(path, target=target, dtype=torch.bfloat16).eval()
        if drafter.config.draft_vocab_size is not None:
            raise SystemExit(f"{path} already has a reduced vocabulary; pass the full-vocabulary drafter.")
        if size is not None:
            drafter.reduce_vocabulary(select_draft_vocabulary(counts, size, drafter.config.vocab_size,
                                                              special_token_ids(drafter.config)))
        drafters[size or drafter.config.vocab_size] = drafter
    prompts = []
    for name in ("gsm8k", "humaneval", "mt-bench"):
        prompts += [(name, p.turns[0]) for p in load_prompts([f"{args.eval_dir}/{name}.jsonl"])[: args.limit]]

    accepted, rounds, seconds = defaultdict(int), defaultdict(int), defaultdict(float)
    outputs, identical = Counter(), True
    for i, (category, prompt) in enumerate(prompts):
        inputs = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
        with torch.no_grad():
            expected = target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
            outputs.update(expected[0, inputs["input_ids"].shape[1]:].tolist())
            for size, drafter in drafters.items():
                drafter.verification_policy = "full"
                out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=args.max_new_tokens,
                                      do_sample=False)
                identical &= torch.equal(out, expected)
                stats = drafter.generation_stats
                accepted[(category, size)] += stats.accepted + stats.num_rounds
                rounds[(category, size)] += stats.num_rounds
            order = list(drafters)
            for repeat in range(args.repeats):
                for size in order[(i + repeat) % len(order):] + order[: (i + repeat) % len(order)]:
                    drafter = drafters[size]
                    drafter.verification_policy = FixedLengthPolicy(1)
                    start = time.perf_counter()
                    out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=args.max_new_tokens,
                                          do_sample=False)
                    seconds[size] += time.perf_counter() - start
                    identical &= torch.equal(out, expected)
        print(f"[{i + 1}/{len(prompts)}] {category}", file=sys.stderr, flush=True)

    full = max(drafters)
    result = {
        "command": " ".join(["python", *sys.argv]),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "versions": {"dspark_hf": dspark_hf.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "prompts": len(prompts),
        "identical": identical,
        "training_response_tokens": sum(counts.values()),
        "distinct_training_response_tokens": len(counts),
        "variants": {
            str(size): {
                "coverage_of_target_outputs": None if size == full else round(
                    coverage(outputs, drafters[size].draft_token_ids.tolist()), 4),
                "full_block_tau": {c: round(accepted[(c, size)] / rounds[(c, size)], 3)
                                   for c in ("gsm8k", "humaneval", "mt-bench")},
                "fixed1_seconds": round(seconds[size], 2),
                "fixed1_speedup_vs_full_vocabulary": round(seconds[full] / seconds[size], 3),
            }
            for size in drafters
        },
    }
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
