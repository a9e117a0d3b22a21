"""Where a batch-1 DSpark round's time goes: drafting (context ingest, block forward, heads, left-to-right sampling),
the target's verification forward, and the rest of transformers' assisted loop.

Runs `target.generate(..., assistant_model=drafter)` on a few prompts with the given policy and times, by wrapping
the methods involved (no change to the library), every call of:

- `ingest`: `DSparkDrafter.extend_context` with new target features (fc, hidden norm, per-layer K/V, RoPE);
- `block`: the rest of the drafter's block forward (embeddings, draft layers, final norm);
- `lm_head`: `DSparkDrafter.draft_logits` (the draft-vocabulary LM head over the block);
- `sample`: `drafting.sample_drafts` (per slot: confidence head, Markov bias, processors, argmax);
- `target`: the target's forwards, the prefill included;
- `loop`: everything else inside `generate` (transformers' assisted loop, candidate handling, cache crops, stats).

The parts are totals over whole generations (after one warm-up prompt), in milliseconds per round: run it on an idle
machine, and compare code versions by alternating runs.

    python scripts/profile_drafting.py --output benchmarks/results/drafting-profile/profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from dspark_hf.benchmarks.bench import machine_info, version_info
from dspark_hf.benchmarks.prompts import load_prompts, render_conversation
from dspark_hf.generation import candidate_generator
from dspark_hf.modeling_dspark import DSparkDrafter
from dspark_hf.models import DEFAULT_TARGET, DTYPES, EMBEDDED_DRAFTERS, drafter_dtype, load_target, target_dtype


class Timers:
    def __init__(self):
        self.seconds, self.calls = defaultdict(float), defaultdict(int)

    def wrap(self, owner, name: str, part: str, condition=None):
        original = getattr(owner, name)
        timers = self

        def timed(*args, **kwargs):
            if condition is not None and not condition(*args, **kwargs):
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timers.seconds[part] += time.perf_counter() - start
                timers.calls[part] += 1

        setattr(owner, name, timed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", nargs="+", default=["../shared/data/eval/gsm8k.jsonl",
                                                         "../shared/data/eval/humaneval.jsonl"])
    parser.add_argument("--limit", type=int, default=3, help="prompts per file")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--policy", default="full")
    parser.add_argument("--target_dtype", default="auto", choices=DTYPES)
    parser.add_argument("--drafter_dtype", default="auto", choices=DTYPES)
    parser.add_argument("--drafter", default=str(EMBEDDED_DRAFTERS[DEFAULT_TARGET]))
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)

    target, tokenizer = load_target(DEFAULT_TARGET, dtype=target_dtype(args.target_dtype))
    drafter = DSparkDrafter.from_pretrained(args.drafter, target=target, dtype=drafter_dtype(args.drafter_dtype))
    drafter.verification_policy = args.policy
    selected = load_prompts(args.prompts, limit=args.limit)
    texts = [render_conversation(tokenizer, prompt.turns[:1], []) for prompt in selected]
    # The first prompt is a warm-up, repeated so that every listed prompt is measured.
    prompts = [tokenizer(text, add_special_tokens=False).input_ids for text in [texts[0], *texts]]

    timers = Timers()
    # `forward` of the drafter minus its `extend_context` is the block; the ingest is timed inside it.
    timers.wrap(DSparkDrafter, "extend_context", "ingest",
                condition=lambda self, features, *a, **k: features is not None and features.shape[1] > 0)
    timers.wrap(DSparkDrafter, "forward", "drafter_forward")
    timers.wrap(DSparkDrafter, "draft_logits", "lm_head")
    timers.wrap(candidate_generator, "sample_drafts", "sample")
    timers.wrap(type(target), "forward", "target_all")
    rounds = 0
    total = 0.0
    tokens = 0
    for index, ids in enumerate([torch.tensor([p]) for p in prompts]):
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=False,
                              max_new_tokens=args.max_new_tokens)
        elapsed = time.perf_counter() - start
        if index == 0:  # warm-up: discard
            timers.seconds.clear(), timers.calls.clear()
            continue
        total += elapsed
        tokens += out.shape[1] - ids.shape[1]
        rounds += len(drafter.generation_stats.rounds)
    seconds = dict(timers.seconds)
    calls = dict(timers.calls)
    parts = {
        "ingest": seconds.get("ingest", 0.0),
        "block": seconds.get("drafter_forward", 0.0) - seconds.get("ingest", 0.0),
        "lm_head": seconds.get("lm_head", 0.0),
        "sample": seconds.get("sample", 0.0),
        "target (incl. prefill)": seconds.get("target_all", 0.0),
    }
    parts["loop"] = total - sum(parts.values())
    result = {
        "command": "python " + " ".join(sys.argv),
        "machine": machine_info(),
        "versions": version_info(),
        "target_dtype": str(target.dtype),
        "drafter_dtype": str(drafter.dtype),
        "policy": args.policy,
        "prompts": len(prompts) - 1,
        "new_tokens": tokens,
        "rounds": rounds,
        "seconds": total,
        "tokens_per_second": tokens / total,
        "ms_per_round": {name: 1000 * value / rounds for name, value in parts.items()},
        "calls": calls,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
