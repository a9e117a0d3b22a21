"""n samples of each prompt in one call (`num_return_sequences=n`, as pass@k evaluation asks): target-only vs DSpark.

transformers' assisted loop refuses num_return_sequences > 1; with a DSpark assistant generate expands each prompt to n
rows and the batched engine samples them (the drafter's default policy: hardware-aware on this machine's speeds, at n
rows). For each prompt (chat template, pure sampling at temperature 1.0, the same seed for both methods) the two methods
run one after the other, their order alternating from prompt to prompt, after one untimed call each; new tokens count
up to each row's EOS. Reported: tokens per second of each method and their ratio, pooled over the prompts (total tokens
over total seconds), and the drafter's tau over its drafted rounds.

    python scripts/n_samples_speed.py --output benchmarks/results/n-samples/humaneval-n4.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dspark_hf.benchmarks.bench import write_record
from dspark_hf.benchmarks.methods import generation_kwargs
from dspark_hf.benchmarks.prompts import load_prompts
from dspark_hf.modeling_dspark import DSparkDrafter
from dspark_hf.models import DEFAULT_TARGET, DTYPES, EMBEDDED_DRAFTERS, drafter_dtype, load_target, target_dtype
from dspark_hf.packed_linear import PACKED_LINEAR_MODES, pack_linear_weights

SHARED = Path(__file__).resolve().parents[2] / "shared"


def new_tokens(sequences: torch.Tensor, prompt_length: int, eos_token_id: int) -> int:
    """Tokens the rows generated, each up to and including its first EOS (the rest is padding)."""
    total = 0
    for row in sequences[:, prompt_length:].tolist():
        total += row.index(eos_token_id) + 1 if eos_token_id in row else len(row)
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, default=SHARED / "data" / "eval" / "humaneval.jsonl")
    parser.add_argument("--limit", type=int, default=6, help="prompts")
    parser.add_argument("--num_return_sequences", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--target_dtype", default="auto", choices=DTYPES)
    parser.add_argument("--packed_linear", default="auto", choices=PACKED_LINEAR_MODES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="JSON results")
    args = parser.parse_args(argv)
    if args.limit < 1 or args.num_return_sequences < 1 or args.max_new_tokens < 1:
        parser.error("--limit, --num_return_sequences and --max_new_tokens must be >= 1")

    target, tokenizer = load_target(DEFAULT_TARGET, dtype=target_dtype(args.target_dtype),
                                    packed_linear=args.packed_linear)
    drafter = DSparkDrafter.from_pretrained(EMBEDDED_DRAFTERS[DEFAULT_TARGET], target=target,
                                            dtype=drafter_dtype("auto")).eval()
    pack_linear_weights(drafter, args.packed_linear)
    prompts = load_prompts([args.prompts], limit=args.limit)
    kwargs = {**generation_kwargs("sample", args.max_new_tokens, tokenizer.pad_token_id),
              "num_return_sequences": args.num_return_sequences}
    methods = {"target": {}, "dspark": {"assistant_model": drafter}}

    def run(method: str, input_ids: torch.Tensor, seed: int) -> tuple[float, int, list]:
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs, **methods[method])
        seconds = time.perf_counter() - start
        stats = [s.rounds for s in drafter.batch_generation_stats] if method == "dspark" else []
        return seconds, new_tokens(out, input_ids.shape[1], tokenizer.eos_token_id), stats

    def encode(prompt) -> torch.Tensor:
        messages = [{"role": "user", "content": prompt.turns[0]}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]

    for method in methods:  # untimed: first calls, and the policy's speed profile at this many rows
        run(method, encode(prompts[0]), args.seed)
    cases, totals = [], {method: [0.0, 0] for method in methods}
    drafted = []
    for index, prompt in enumerate(prompts):
        input_ids = encode(prompt)
        order = list(methods) if index % 2 == 0 else list(reversed(methods))
        case = {"prompt_id": prompt.prompt_id, "prompt_tokens": input_ids.shape[1]}
        for method in order:
            seconds, tokens, rounds = run(method, input_ids, args.seed + index)
            totals[method][0] += seconds
            totals[method][1] += tokens
            case[method] = {"seconds": seconds, "new_tokens": tokens, "tokens_per_second": tokens / seconds}
            drafted += [r for row in rounds for r in row if r.drafted]
        case["speedup"] = case["dspark"]["tokens_per_second"] / case["target"]["tokens_per_second"]
        cases.append(case)
        print(json.dumps(case), flush=True)
    speed = {method: tokens / seconds for method, (seconds, tokens) in totals.items()}
    summary = {"tokens_per_second": speed, "speedup": speed["dspark"] / speed["target"],
               "drafted_rounds": len(drafted),
               "tau_drafted_rounds": (sum(r.accepted + 1 for r in drafted) / len(drafted)) if drafted else None,
               "target_dtype": str(target.dtype).removeprefix("torch."),
               "drafter_dtype": str(drafter.dtype).removeprefix("torch.")}
    print(json.dumps(summary, indent=1))
    if args.output is not None:
        write_record(args.output, "python scripts/n_samples_speed.py " + " ".join(argv or sys.argv[1:]),
                     settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     summary=summary, cases=cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
