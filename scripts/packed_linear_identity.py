"""Does packing the target's linear weights change its own greedy output? Target-only greedy decoding of the
benchmark prompts with the layers packed and unpacked (`dspark_hf.packed_linear`), in one process: identical outputs,
and at each first divergence the unpacked target's top-1 minus top-2 logit margin there.

Packing changes the summation order of every linear layer, so like any change of kernels (thread count, CPU, torch
build) it can flip a greedy choice where the top two logits (nearly) tie. DSpark's guarantee is against the target
object it runs with: target-only and speculative decoding over the same packed target (`bench-*/` in
`benchmarks/results/packed-linear/`). This measures how far that target is from the unpacked one.

    python scripts/packed_linear_identity.py --dtype float32 --limit 6 --max_new_tokens 256 \
        --output benchmarks/results/packed-linear/identity-fp32.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dspark_hf.benchmarks.bench import machine_info, version_info
from dspark_hf.benchmarks.exactness import first_divergence, next_token_margin
from dspark_hf.benchmarks.prompts import load_prompts, render_conversation
from dspark_hf.models import DEFAULT_TARGET, load_target
from dspark_hf.packed_linear import pack_linear_weights

SHARED = Path(__file__).resolve().parents[2] / "shared"
SETS = ["gsm8k", "humaneval", "mt-bench"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()

    target, tokenizer = load_target(DEFAULT_TARGET, dtype=getattr(torch, args.dtype), packed_linear="off")
    files = [str(SHARED / "data/eval" / f"{name}.jsonl") for name in SETS]
    records = []
    for prompt in load_prompts(files, limit=args.limit):
        ids = tokenizer(render_conversation(tokenizer, prompt.turns[:1], []), return_tensors="pt",
                        add_special_tokens=False)
        outputs = {}
        for mode in ("off", "on"):
            pack_linear_weights(target, mode)
            generated = target.generate(**ids, do_sample=False, max_new_tokens=args.max_new_tokens,
                                        pad_token_id=tokenizer.pad_token_id)
            outputs[mode] = generated[0, ids["input_ids"].shape[1]:].tolist()
        index = first_divergence(outputs["on"], outputs["off"])
        record = {"prompt_id": prompt.prompt_id, "category": prompt.category, "tokens": len(outputs["off"]),
                  "identical": index is None}
        if index is not None and index < min(len(outputs["on"]), len(outputs["off"])):
            pack_linear_weights(target, "off")
            margin, top1 = next_token_margin(target, ids["input_ids"][0].tolist() + outputs["off"][:index])
            record.update(position=index, margin=margin, top1_logit=top1)
        records.append(record)
        print(json.dumps(record), flush=True)
    pack_linear_weights(target, "off")
    summary = {"identical": sum(r["identical"] for r in records), "prompts": len(records),
               "margins": [r["margin"] for r in records if "margin" in r]}
    print(json.dumps(summary))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    document = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(), "versions": version_info(),
                "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "summary": summary, "records": records}
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
