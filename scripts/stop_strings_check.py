"""Where generation stops with stop strings: target-only, DSpark and transformers' prompt lookup, embedded default.

A speculative round commits several tokens at once. transformers' assisted loop asks its stopping criteria once per
round, so a stop string completed inside a round is missed and generation runs on; dspark-hf asks every prefix the
round committed (`dspark_hf.generation.stopping`). For each prompt (gsm8k and humaneval, first turn in the chat
template) and stop string, greedy, float32: the new tokens each method returns and whether they equal target-only's.

    python scripts/stop_strings_check.py --output benchmarks/results/stopping/stop-strings.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dspark_hf.benchmarks.bench import write_record
from dspark_hf.benchmarks.prompts import first_turn_ids
from dspark_hf.modeling_dspark import DSparkDrafter
from dspark_hf.models import DEFAULT_TARGET, EMBEDDED_DRAFTERS, load_target

SHARED = Path(__file__).resolve().parents[2] / "shared"
STOPS = ("\n\n", ".", "```", "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts_per_set", type=int, default=3)
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--output", type=Path, default=None, help="JSON results")
    args = parser.parse_args(argv)
    if args.prompts_per_set < 1 or args.max_new_tokens < 1:
        parser.error("--prompts_per_set and --max_new_tokens must be >= 1")

    target, tokenizer = load_target(DEFAULT_TARGET, dtype=torch.float32)
    drafter = DSparkDrafter.from_pretrained(EMBEDDED_DRAFTERS[DEFAULT_TARGET], target=target).eval()
    prompts = []
    for name in ("gsm8k", "humaneval"):
        prompts += first_turn_ids(tokenizer, [SHARED / "data" / "eval" / f"{name}.jsonl"])[: args.prompts_per_set]
    methods = {"dspark": dict(assistant_model=drafter), "prompt_lookup": dict(prompt_lookup_num_tokens=10)}
    cases = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        for stop in STOPS:
            common = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.max_new_tokens,
                          stop_strings=[stop], tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id)
            expected = target.generate(ids, **common)[0, len(prompt):].tolist()
            case = {"prompt_tokens": len(prompt), "stop": stop, "target_new_tokens": len(expected)}
            for method, kwargs in methods.items():
                out = target.generate(ids, **common, **kwargs)[0, len(prompt):].tolist()
                case[method] = {"new_tokens": len(out), "identical": out == expected,
                                "prefix_of_it": out[: len(expected)] == expected}
            cases.append(case)
            print(json.dumps(case), flush=True)
    summary = {method: {"identical": sum(c[method]["identical"] for c in cases), "cases": len(cases),
                        "ran_past_the_stop": sum(c[method]["new_tokens"] > c["target_new_tokens"] for c in cases)}
               for method in methods}
    print(json.dumps(summary, indent=1))
    if args.output is not None:
        write_record(args.output, "python scripts/stop_strings_check.py " + " ".join(argv or sys.argv[1:]),
                     target_dtype="float32", max_new_tokens=args.max_new_tokens, summary=summary, cases=cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
