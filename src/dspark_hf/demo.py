"""`dspark-hf demo`: the embedded default target with and without DSpark, side by side, offline.

For each prompt (math, code, chat) it generates target-only greedy, then with the DSpark drafter (streaming the text),
checks the two texts are identical, and prints tokens/s, speed-up, tau and the per-round verified/accepted lengths.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import TextStreamer

from .cli import ArgumentParser
from .generation.policies import HardwareAwarePolicy, get_policy
from .modeling_dspark import DSparkDrafter
from .models import check_model_path, DEFAULT_TARGET, DRAFTER_DTYPES, EMBEDDED_DRAFTERS, drafter_dtype, load_target
from .profiling import PROFILE_FILE_NAME


DEMO_PROMPTS = [
    ("math", "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether in April and May? Think step by step."),
    ("code", "Write a Python function `is_palindrome(s: str) -> bool` that ignores case and spaces, "
             "with a docstring and two examples."),
    ("chat", "Give me three tips for staying focused while working from home."),
]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="dspark-hf demo", description=__doc__)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model name or path (default: %(default)s)")
    parser.add_argument("--drafter", default=None,
                        help="drafter path or repo id (default: the drafter shipped for the embedded target)")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--policy", default=None,
                        help="verification policy: hardware_aware, full, threshold, fixed (default: hardware_aware "
                             "when the drafter folder has a speed profile, else full)")
    parser.add_argument("--length", type=int, default=None, help="drafts per round for --policy fixed")
    parser.add_argument("--threshold", type=float, default=None, help="confidence threshold for --policy threshold")
    parser.add_argument("--drafter_dtype", default="auto", choices=DRAFTER_DTYPES,
                        help="dtype the drafter runs in (auto: bfloat16 where the device computes it natively, else "
                        "float32; the output is identical either way)")
    parser.add_argument("--no_stream", action="store_true", help="do not stream the DSpark text")
    parser.add_argument("--prompt", action="append", default=None, help="your own prompt(s) instead of the demo set")
    return parser.parse_args(argv)


def _load_drafter(args: argparse.Namespace, target) -> tuple[DSparkDrafter, Path | None]:
    """The drafter and the folder it came from (where its speed profile may sit)."""
    path = Path(args.drafter) if args.drafter is not None else EMBEDDED_DRAFTERS.get(args.target)
    dtype = drafter_dtype(args.drafter_dtype, target.device)
    if args.drafter is not None or (path is not None and (path / "config.json").exists()):
        drafter = DSparkDrafter.from_pretrained(str(path), target=target, dtype=dtype).eval()
        return drafter, path if path.is_dir() else None
    print(f"[demo] no trained drafter ships for {args.target!r}: using an UNTRAINED one "
          "(output is still identical; expect no speed-up). Pass --drafter PATH for a trained one.")
    return DSparkDrafter.from_target(target).to(dtype).eval(), None


def _policy(args: argparse.Namespace, drafter_dir: Path | None):
    """`--policy`, else the hardware-aware policy on the drafter's profile, else full-block verification."""
    name = args.policy
    has_profile = drafter_dir is not None and (drafter_dir / PROFILE_FILE_NAME).is_file()
    if name is None:
        name = "hardware_aware" if has_profile else "full"
    if name == "hardware_aware":
        if not has_profile:
            raise SystemExit("[demo] --policy hardware_aware needs a speed profile in the drafter folder: run "
                             "`dspark-hf profile --drafter DRAFTER_DIR` first.")
        return HardwareAwarePolicy.from_profile(drafter_dir)
    if name == "threshold" and args.threshold is not None:
        return get_policy(name, threshold=args.threshold)
    if name == "fixed":
        return get_policy(name, length=args.length or 2)
    return get_policy(name)


def _timed_generate(target, inputs, **kwargs) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    out = target.generate(**inputs, do_sample=False, **kwargs)
    return out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.drafter is not None:
        check_model_path(args.drafter)
    torch.manual_seed(0)
    print(f"[demo] loading target {args.target} (the first run converts the packaged GGUF once)...")
    target, tokenizer = load_target(args.target)
    drafter, drafter_dir = _load_drafter(args, target)
    drafter.verification_policy = _policy(args, drafter_dir)
    print(f"[demo] verification policy: {drafter.verification_policy.name}")
    prompts = [("yours", p) for p in args.prompt] if args.prompt else DEMO_PROMPTS
    gen = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id)

    # Warm both paths up once so the first prompt's timing is not the allocator's.
    warm = tokenizer("Hello", return_tensors="pt")
    target.generate(**warm, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    target.generate(**warm, assistant_model=drafter, max_new_tokens=4, do_sample=False,
                    pad_token_id=tokenizer.pad_token_id)

    rows, all_identical = [], True
    for kind, text in prompts:
        messages = [{"role": "user", "content": text}]
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        prompt_len = inputs["input_ids"].shape[1]
        print(f"\n=== [{kind}] {text}\n--- DSpark (streaming):")
        streamer = None if args.no_stream else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        fast, fast_s = _timed_generate(target, inputs, assistant_model=drafter, streamer=streamer, **gen)
        stats = drafter.generation_stats
        slow, slow_s = _timed_generate(target, inputs, **gen)
        identical = torch.equal(fast, slow)
        all_identical &= identical
        new = fast.shape[1] - prompt_len
        rows.append((kind, new, new / slow_s, new / fast_s, slow_s / fast_s, stats.tau, identical))
        if args.no_stream:
            print(tokenizer.decode(fast[0, prompt_len:], skip_special_tokens=True))
        drafted = [r for r in stats.rounds if r.drafted]
        print(f"--- identical to target-only: {identical}; {stats.num_rounds} rounds, {stats.skipped_rounds} without "
              f"the drafter (not worth its cost here); drafted rounds: verified {[r.verified for r in drafted]}, "
              f"accepted {[r.accepted for r in drafted]}")

    print("\n| prompt | new tokens | target-only tok/s | DSpark tok/s | speed-up | tau | identical |")
    print("|---|---|---|---|---|---|---|")
    for kind, new, slow_tps, fast_tps, speedup, tau, identical in rows:
        print(f"| {kind} | {new} | {slow_tps:.1f} | {fast_tps:.1f} | {speedup:.2f}x | {tau:.2f} | {identical} |")
    print("\nTimings from this single run on this machine; for reproducible numbers use `dspark-hf bench`.")
    return 0 if all_identical else 1
