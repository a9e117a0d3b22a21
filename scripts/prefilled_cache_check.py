"""A chat's second turn continued from the first turn's cache: target-only, DSpark and prompt lookup, embedded default.

generate continues a cache filled by an earlier call (`cache=` the previous output's `.cache`, the prompt being the
whole conversation so far). transformers' assisted loop forwards the whole prompt in its first round, on top of the
cached positions; dspark-hf starts that forward after them (`dspark_hf._transformers_compat._forward_uncached_only`),
and its drafter continues the context it left beside that cache (else it drafts from the new positions only). For
each mt-bench conversation (float32, greedy): turn 1, then turn 2 from each method's own turn-1 cache, against
target-only's turn 2 from its cache (itself checked against target-only without a cache), and the drafter's full-block
tau on turn 2 with the cache (the drafter's context of turn 1 carried over beside it), from a cache turn 1 filled
without the drafter (its context then holds the new positions alone), and without a cache.

    python scripts/prefilled_cache_check.py --output benchmarks/results/prefilled-cache/second-turns.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dspark_hf.benchmarks.bench import write_record
from dspark_hf.benchmarks.prompts import load_prompts
from dspark_hf.modeling_dspark import DSparkDrafter
from dspark_hf.models import DEFAULT_TARGET, EMBEDDED_DRAFTERS, load_target

SHARED = Path(__file__).resolve().parents[2] / "shared"
# Turn 2's full-block tau: from turn 1's cache with the drafter's context of turn 1 carried over (turn 1 drafted too),
# from a cache that turn 1 filled without the drafter (the drafter reads turn 2's new positions only), without a cache.
TAU_VARIANTS = (("with_cache", True, None), ("with_cache_new_positions_only", True, {}), ("without_cache", False, None))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, default=None, help="JSON results")
    args = parser.parse_args(argv)
    if args.conversations < 1 or args.max_new_tokens < 1:
        parser.error("--conversations and --max_new_tokens must be >= 1")

    target, tokenizer = load_target(DEFAULT_TARGET, dtype=torch.float32)
    drafter = DSparkDrafter.from_pretrained(EMBEDDED_DRAFTERS[DEFAULT_TARGET], target=target).eval()
    methods = {"dspark": dict(assistant_model=drafter),
               "dspark+lookup": dict(assistant_model=drafter, prompt_lookup_num_tokens=8),
               "prompt_lookup": dict(prompt_lookup_num_tokens=8)}
    conversations = [p for p in load_prompts([SHARED / "data" / "eval" / "mt-bench.jsonl"]) if len(p.turns) > 1]
    cases = []
    for prompt in conversations[: args.conversations]:
        messages = [{"role": "user", "content": prompt.turns[0]}]
        first = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
        common = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                      return_dict_in_generate=True)
        own = target.generate(first, attention_mask=torch.ones_like(first), **common)
        reply = tokenizer.decode(own.sequences[0, first.shape[1]:], skip_special_tokens=True)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": prompt.turns[1]}]
        second = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
        # the turn-1 positions the turn-2 prompt repeats token for token (the template may re-tokenize the reply)
        shared = int((own.sequences[0, : second.shape[1]] == second[0, : own.sequences.shape[1]]).cumprod(0).sum())
        mask = torch.ones_like(second)

        def turn_two(kwargs, cache=True, first_kwargs=None):
            """Turn 1 then turn 2 from its cache (cropped to the positions turn 2 repeats), for one method (turn 1
            with `first_kwargs` where given)."""
            kwargs_one = kwargs if first_kwargs is None else first_kwargs
            cache = target.generate(first, attention_mask=torch.ones_like(first), **common, **kwargs_one).cache if (
                cache) else None
            if cache is not None and cache.get_seq_length() > shared:
                cache.crop(shared - cache.get_seq_length())
            out = target.generate(second, attention_mask=mask, cache=cache, **common, **kwargs)
            return out.sequences[0, second.shape[1]:].tolist()

        expected = turn_two({})
        without_cache = turn_two({}, cache=False)
        case = {"turn_two_prompt_tokens": second.shape[1], "cached_positions": min(shared, own.sequences.shape[1] - 1),
                "target_cache_equals_no_cache": expected == without_cache}
        for method, kwargs in methods.items():
            out = turn_two(kwargs)
            diverges = [i for i, (a, b) in enumerate(zip(out, expected)) if a != b]
            case[method] = {"identical": out == expected, "first_divergence": diverges[0] if diverges else None}
            if method == "dspark":
                case[method]["tau"] = drafter.generation_stats.tau
        full_block = dict(assistant_model=drafter, num_assistant_tokens=drafter.config.block_size)
        for name, cache, first_kwargs in TAU_VARIANTS:
            turn_two(full_block, cache=cache, first_kwargs=first_kwargs)
            case[f"full_block_tau_{name}"] = drafter.generation_stats.tau
        cases.append(case)
        print(json.dumps(case), flush=True)
    summary = {method: {"identical": sum(c[method]["identical"] for c in cases), "cases": len(cases)}
               for method in methods}
    summary["target_cache_equals_no_cache"] = sum(c["target_cache_equals_no_cache"] for c in cases)
    for name, _, _ in TAU_VARIANTS:
        summary[f"full_block_tau_{name}"] = sum(c[f"full_block_tau_{name}"] for c in cases) / len(cases)
    print(json.dumps(summary, indent=1))
    if args.output is not None:
        write_record(args.output, "python scripts/prefilled_cache_check.py " + " ".join(argv or sys.argv[1:]),
                     target_dtype="float32", max_new_tokens=args.max_new_tokens, summary=summary, cases=cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
