"""Native grouped-query attention (`dspark_hf.generation.gqa`) on and off, interleaved in one process:

1. one target forward of `width` new tokens per row over a 250-token left-padded cache, for each row count and width
   (median of `--repeats` per setting, the settings alternating), and whether the logits are bitwise equal; with
   `--packed`, a third setting: native GQA with packed query heads (`gqa.packed_gqa`, as the batched engine runs
   forwards of 2-8 tokens per row);
2. batch-1 `generate` with the embedded drafter (`--policy`, default the full block; 128 new tokens, 3 gsm8k + 3
   humaneval prompts), tokens/s with the switch on and off, alternating prompt by prompt (the outputs must be equal).

    python scripts/profile_gqa.py --output benchmarks/results/gqa/gqa.json
    # the forwards at the engine's row counts and widths only (`scripts/sim_engine_gqa.py` reads them)
    python scripts/profile_gqa.py --rows 8 16 32 --widths 2 3 4 5 6 7 8 --skip_generation --output ...
    # packed query heads as well
    python scripts/profile_gqa.py --rows 1 8 16 32 --widths 2 3 4 6 8 --packed --skip_generation \
        --output benchmarks/results/gqa/packed.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from dspark_hf.benchmarks.bench import machine_info, version_info
from dspark_hf.benchmarks.prompts import load_prompts, render_conversation
from dspark_hf.generation import gqa
from dspark_hf.modeling_dspark import DSparkDrafter
from dspark_hf.models import DEFAULT_TARGET, DTYPES, EMBEDDED_DRAFTERS, drafter_dtype, load_target, target_dtype

ALWAYS_WANTED = gqa.wanted


def switch(on: bool) -> None:
    gqa.wanted = ALWAYS_WANTED if on else (lambda device, num_new_tokens: False)


def forward_case(target, rows: int, width: int, repeats: int, context: int = 250, packed: bool = False) -> dict:
    generator = torch.Generator().manual_seed(rows * 100 + width)
    ids = torch.randint(100, 20000, (rows, context), generator=generator)
    mask = torch.ones(rows, context, dtype=torch.long)
    mask[1:, :10] = 0  # left padding on all rows but the first
    cache = DynamicCache(config=target.config)
    target(input_ids=ids, attention_mask=mask, cache=cache)
    new = torch.randint(100, 20000, (rows, width), generator=generator)
    new_mask = torch.cat([mask, torch.ones(rows, width, dtype=torch.long)], dim=1)

    def forward(setting):
        if cache.get_seq_length() > context:
            cache.crop(context - cache.get_seq_length())
        with contextlib.ExitStack() as stack:
            if setting:
                stack.enter_context(gqa.native_gqa(target.device, width))
            if setting == "packed":
                stack.enter_context(gqa.packed_gqa(target, width))
            start = time.perf_counter()
            logits = target(input_ids=new, attention_mask=new_mask, cache=cache).logits
            return time.perf_counter() - start, logits

    settings = [True, False] + (["packed"] if packed else [])
    times, logits = {setting: [] for setting in settings}, {}
    for setting in settings:
        forward(setting)  # warm-up
    for _ in range(repeats):
        for setting in settings:
            seconds, logits[setting] = forward(setting)
            times[setting].append(seconds)
    case = {"rows": rows, "width": width, "native_ms": 1e3 * statistics.median(times[True]),
            "copied_ms": 1e3 * statistics.median(times[False]),
            "bitwise_equal": torch.equal(logits[True], logits[False])}
    if packed:
        case.update(packed_ms=1e3 * statistics.median(times["packed"]),
                    packed_bitwise_equal=torch.equal(logits["packed"], logits[True]),
                    packed_max_abs_difference=float((logits["packed"].float() - logits[True].float()).abs().max()),
                    packed_argmax_equal=torch.equal(logits["packed"].argmax(-1), logits[True].argmax(-1)))
    return case


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target_dtype", default="auto", choices=DTYPES)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--policy", default="full", help="the drafter's verification policy in part 2")
    parser.add_argument("--prompt_lookup_num_tokens", type=int, default=0, help="prompt lookup inside rounds (part 2)")
    parser.add_argument("--packed", action="store_true", help="part 1 with packed query heads as a third setting")
    parser.add_argument("--skip_forwards", action="store_true", help="part 2 only")
    parser.add_argument("--skip_generation", action="store_true", help="part 1 only")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    target, tokenizer = load_target(DEFAULT_TARGET, dtype=target_dtype(args.target_dtype))
    forwards = [] if args.skip_forwards else [forward_case(target, rows, width, args.repeats, packed=args.packed)
                                              for rows in args.rows
                                              for width in args.widths]
    for case in forwards:
        print(case)
    generation = None if args.skip_generation else generation_case(target, tokenizer, args)
    result = {"command": "python " + " ".join(sys.argv), "machine": machine_info(), "versions": version_info(),
              "target_dtype": str(target.dtype), "forwards": forwards, "generation": generation}
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def generation_case(target, tokenizer, args) -> dict:
    drafter = DSparkDrafter.from_pretrained(str(EMBEDDED_DRAFTERS[DEFAULT_TARGET]), target=target,
                                            dtype=drafter_dtype("auto"))  # fmt: skip
    drafter.verification_policy = args.policy
    lookup = {"prompt_lookup_num_tokens": args.prompt_lookup_num_tokens} if args.prompt_lookup_num_tokens else {}
    prompts = load_prompts(["../shared/data/eval/gsm8k.jsonl", "../shared/data/eval/humaneval.jsonl"], limit=3)
    seconds, tokens, equal = {True: 0.0, False: 0.0}, {True: 0, False: 0}, True
    for index, prompt in enumerate(prompts):
        ids = tokenizer(render_conversation(tokenizer, prompt.turns[:1], []), add_special_tokens=False,
                        return_tensors="pt").input_ids  # fmt: skip
        outputs = {}
        for on in ((True, False) if index % 2 else (False, True)):
            switch(on)
            start = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=False,
                                  max_new_tokens=args.max_new_tokens, **lookup)  # fmt: skip
            seconds[on] += time.perf_counter() - start
            tokens[on] += out.shape[1] - ids.shape[1]
            outputs[on] = out
        switch(True)
        equal &= torch.equal(outputs[True], outputs[False])
    generation = {"native_tokens_per_second": tokens[True] / seconds[True],
                  "copied_tokens_per_second": tokens[False] / seconds[False], "outputs_equal": bool(equal),
                  "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "policy": args.policy,
                  "prompt_lookup_num_tokens": args.prompt_lookup_num_tokens}
    print(generation)
    return generation


if __name__ == "__main__":
    sys.exit(main())
