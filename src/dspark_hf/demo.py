"""`dspark-hf demo`: the embedded default target with and without DSpark, side by side, offline.

For each prompt (math, code, chat) it generates with the DSpark drafter (streaming the text), then target-only greedy
(with a progress bar), checks that the two outputs are identical token for token, and prints tokens/s, speed-up and
tau per prompt. The default run (64 tokens per prompt) took 53 s on a 2-core AVX2 CPU after set-up; `--long` generates
256 tokens per prompt, the length the benchmarks use, where the policy's first probes weigh less (85 s there).

DSpark runs with prompt lookup inside its rounds (`prompt_lookup_num_tokens=10`; `--prompt_lookup_num_tokens 0` for
the drafter alone): where the answer repeats text from the prompt or from itself, the target verifies the copied
tokens instead of a drafted block.

The target runs in float32, where DSpark's greedy output is token for token the target's. `--target_dtype auto` (or
bfloat16) runs it in bf16 where the CPU computes bf16 natively: faster, but a verification forward over several tokens
rounds differently from one-token decoding, so outputs may part at near-ties; the demo then shows where, with the
target's top-1/top-2 logit margin there (README, "What identical means per dtype").
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import TextStreamer
from transformers.generation.streamers import BaseStreamer

from .cli import ArgumentParser
from .generation.policies import AUTO, POLICIES, get_policy, resolve_policy
from .benchmarks.exactness import TOKEN_EXACT_DTYPES, conversation_divergence
from .modeling_dspark import DSparkDrafter
from .models import DEFAULT_TARGET, DTYPES, EMBEDDED_DRAFTERS, check_model_path, drafter_dtype, load_target
from .models import target_dtype
from .packed_linear import PACKED_LINEAR_MODES, is_packed, pack_linear_weights


DEMO_PROMPTS = [
    ("math", "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether in April and May? Think step by step."),
    ("code", "Write a Python function `is_palindrome(s: str) -> bool` that ignores case and spaces, "
             "with a docstring and two examples."),
    ("chat", "Give me three tips for staying focused while working from home."),
]
COLUMNS = """\
Columns: new tokens = tokens generated (the same text both ways); target-only tok/s = plain greedy decoding;
DSpark tok/s = the same generation with the drafter; speed-up = target-only time / DSpark time (above 1 is faster);
tau = tokens committed per target forward (1.00 = the drafts bought nothing); identical = DSpark's output equals
target-only's token for token."""


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog="dspark-hf demo", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model name or path (default: %(default)s)")
    parser.add_argument("--drafter", default=None,
                        help="drafter folder or repo id (default: the drafter shipped for the embedded target)")
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help="tokens per prompt (default: 64, or 256 with --long)")
    parser.add_argument("--long", action="store_true", help="256 tokens per prompt (about three times longer)")
    parser.add_argument("--policy", default=AUTO, choices=[AUTO, *POLICIES],
                        help="verification policy (default: auto, hardware-aware on this machine's measured speeds)")
    parser.add_argument("--length", type=int, default=2, help="drafts per round for --policy fixed (default: 2)")
    parser.add_argument("--threshold", type=float, default=0.5,
                        help="confidence threshold for --policy threshold (default: 0.5)")
    parser.add_argument("--target_dtype", default="float32", choices=DTYPES,
                        help="dtype the target runs in (default: float32, where the output is identical token for "
                        "token; auto: bfloat16 where the device computes it natively, faster, but outputs may part "
                        "at near-ties)")
    parser.add_argument("--packed_linear", default="auto", choices=PACKED_LINEAR_MODES,
                        help="read the target's linear weights packed for oneDNN (CPU): auto (default: where this "
                        "machine runs them faster), on, off; target-only and DSpark run the same target")
    parser.add_argument("--drafter_dtype", default="auto", choices=DTYPES,
                        help="dtype the drafter runs in (auto: bfloat16 where the device computes it natively, else "
                        "float32; the output is identical either way)")
    parser.add_argument("--prompt_lookup_num_tokens", type=int, default=10,
                        help="prompt lookup inside DSpark rounds: where the text repeats itself, verify up to this many "
                        "tokens copied from earlier instead of a drafted block (default: %(default)s; 0 turns it off)")
    parser.add_argument("--no_stream", action="store_true", help="a progress bar instead of the streamed DSpark text")
    parser.add_argument("--prompt", action="append", default=None, help="your own prompt(s) instead of the demo set")
    args = parser.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = 256 if args.long else 64
    if args.max_new_tokens < 1:
        parser.error(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.prompt_lookup_num_tokens < 0:
        parser.error(f"--prompt_lookup_num_tokens must be >= 0 (0 turns prompt lookup off), got "
                     f"{args.prompt_lookup_num_tokens}")
    return args


def _load_drafter(args: argparse.Namespace, target) -> DSparkDrafter:
    path = Path(args.drafter) if args.drafter is not None else EMBEDDED_DRAFTERS.get(args.target)
    dtype = drafter_dtype(args.drafter_dtype, target.device)
    if args.drafter is not None or (path is not None and (path / "config.json").exists()):
        drafter = DSparkDrafter.from_pretrained(str(path), target=target, dtype=dtype).eval()
    else:
        print(f"[demo] no trained drafter ships for {args.target!r}: using an UNTRAINED one "
              "(output is still identical; expect no speed-up). Pass --drafter PATH for a trained one.")
        drafter = DSparkDrafter.from_target(target).to(dtype).eval()
    pack_linear_weights(drafter, args.packed_linear)
    return drafter


def _policy(args: argparse.Namespace):
    if args.policy == "fixed":
        return get_policy("fixed", length=args.length)
    if args.policy == "threshold":
        return get_policy("threshold", threshold=args.threshold)
    return args.policy


class _ProgressStreamer(BaseStreamer):
    """A tqdm bar over the new tokens of one `generate` call (the first `put` is the prompt)."""

    def __init__(self, total: int, description: str):
        self.bar = tqdm(total=total, desc=description, unit="tok", leave=False)
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.bar.update(value.numel())
        self.prompt_seen = True

    def end(self) -> None:
        self.bar.close()


def _timed_generate(target, inputs, **kwargs) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    out = target.generate(**inputs, do_sample=False, **kwargs)
    return out, time.perf_counter() - start


def _round_summary(stats) -> str:
    drafted = [r for r in stats.rounds if r.drafted]
    looked_up = [r for r in stats.rounds if r.source == "lookup"]
    lookup = (f"{len(looked_up)} verified prompt-lookup drafts instead ({sum(r.verified for r in looked_up)} "
              f"verified, {sum(r.accepted for r in looked_up)} accepted), " if looked_up else "")
    return (f"{stats.num_rounds} target forwards; {len(drafted)} ran the drafter (the target verified "
            f"{sum(r.verified for r in drafted)} drafts and accepted {sum(r.accepted for r in drafted)}), {lookup}"
            f"{stats.skipped_rounds - len(looked_up)} decoded one token without drafting (the policy judged drafting "
            "not worth it)")


def _verdict(kind: str, speedup: float) -> str:
    if speedup >= 1.02:
        return f"{kind}: DSpark {speedup:.2f}x faster"
    if speedup > 0.98:
        return f"{kind}: no real difference ({speedup:.2f}x)"
    return (f"{kind}: DSpark SLOWER ({speedup:.2f}x): the drafts the target accepted did not pay for drafting and "
            "verifying them on this machine")


def _divergence_line(target, prompt_ids: list[int], expected: list[int], generated: list[int]) -> str:
    divergence = conversation_divergence(target, [prompt_ids], [expected], [generated])
    if target.dtype in TOKEN_EXACT_DTYPES:
        meaning = "in float32 this is a bug; please report it with this prompt"
    else:
        meaning = (f"in {str(target.dtype).removeprefix('torch.')} a verification forward over several tokens may "
                   "round a near-tie differently from one-token decoding")
    return (f"--- first divergence at new token {divergence['position']}: the target's top-1 minus top-2 logit there "
            f"is {divergence['margin']:.3f} (top-1 logit {divergence['top1_logit']:.2f}); {meaning}")


def _print_report(rows: list[tuple]) -> None:
    print("\n| prompt | new tokens | target-only tok/s | DSpark tok/s | speed-up | tau | identical |")
    print("|---|---|---|---|---|---|---|")
    for kind, new, slow_tps, fast_tps, speedup, tau, identical in rows:
        print(f"| {kind} | {new} | {slow_tps:.1f} | {fast_tps:.1f} | {speedup:.2f}x | {tau:.2f} | {identical} |")
    print(COLUMNS)
    print("\nPer prompt: " + "; ".join(_verdict(row[0], row[4]) for row in rows) + ".")
    print(f"Identical on {sum(row[6] for row in rows)} of {len(rows)} prompts. Timings come from this one run on this "
          "machine (a few percent of noise); `dspark-hf bench` compares methods over many prompts.")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.drafter is not None:
        check_model_path(args.drafter)
    torch.manual_seed(0)
    print(f"[demo] loading target {args.target} (the first run converts the packaged GGUF once)...")
    target, tokenizer = load_target(args.target, dtype=target_dtype(args.target_dtype),
                                    packed_linear=args.packed_linear)
    drafter = _load_drafter(args, target)
    drafter.verification_policy = _policy(args)
    prompts = [("yours", p) for p in args.prompt] if args.prompt else DEMO_PROMPTS
    gen = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id)

    # Warm both paths up once so the first prompt's timing is not the allocator's; with the default policy this also
    # measures this machine's verification speed once (cached for later runs).
    warm = tokenizer("Hello", return_tensors="pt")
    target.generate(**warm, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    lookup = {"prompt_lookup_num_tokens": args.prompt_lookup_num_tokens} if args.prompt_lookup_num_tokens else {}
    target.generate(**warm, assistant_model=drafter, max_new_tokens=4, do_sample=False,
                    pad_token_id=tokenizer.pad_token_id, **lookup)
    policy = resolve_policy(drafter, target)
    print(f"[demo] verification policy: {policy.name} ({args.policy}); {args.max_new_tokens} new tokens per prompt; "
          + (f"prompt lookup inside rounds, up to {args.prompt_lookup_num_tokens} tokens" if lookup
             else "no prompt lookup") + " (--prompt_lookup_num_tokens)")
    print(f"[demo] target in {str(target.dtype).removeprefix('torch.')}, drafter in "
          f"{str(drafter.dtype).removeprefix('torch.')} (--target_dtype, --drafter_dtype); target's linear weights "
          f"{'packed for oneDNN' if is_packed(target) else 'not packed'} (--packed_linear)")

    rows = []
    for kind, text in prompts:
        messages = [{"role": "user", "content": text}]
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        prompt_len = inputs["input_ids"].shape[1]
        print(f"\n=== [{kind}] {text}\n--- DSpark{'' if args.no_stream else ' (streaming)'}:")
        streamer = (_ProgressStreamer(args.max_new_tokens, "DSpark") if args.no_stream
                    else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
        fast, fast_s = _timed_generate(target, inputs, assistant_model=drafter, streamer=streamer, **gen, **lookup)
        stats = drafter.generation_stats
        slow, slow_s = _timed_generate(target, inputs, streamer=_ProgressStreamer(args.max_new_tokens, "target-only"),
                                       **gen)
        identical = torch.equal(fast, slow)
        new = fast.shape[1] - prompt_len
        rows.append((kind, new, new / slow_s, new / fast_s, slow_s / fast_s, stats.tau, identical))
        if args.no_stream:
            print(tokenizer.decode(fast[0, prompt_len:], skip_special_tokens=True))
        print(f"--- identical to target-only: {identical}; {_round_summary(stats)}")
        if not identical:
            print(_divergence_line(target, inputs["input_ids"][0].tolist(), slow[0, prompt_len:].tolist(),
                                   fast[0, prompt_len:].tolist()))
        print(f"--- target-only {new / slow_s:.1f} tok/s, DSpark {new / fast_s:.1f} tok/s; "
              f"{_verdict(kind, slow_s / fast_s)}")

    _print_report(rows)
    # A divergence fails the demo only where the output must be identical token for token.
    return 0 if all(row[6] for row in rows) or target.dtype not in TOKEN_EXACT_DTYPES else 1
