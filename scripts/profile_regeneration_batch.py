"""Seconds of one decode step of the embedded target by batch size: how `campaign_v2.sh data` picks its batch size.

Decoding `rows` prompts of `--prompt_tokens` random tokens together, after their prefill, in the dtype prepare-data
uses (`--target_dtype auto`), on `--threads` threads (the campaign's workers run one each). Median of 10 steps after 2
warm-up steps. Run it with the machine otherwise idle.

    python scripts/profile_regeneration_batch.py --rows 16 32 64 128
"""

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from dspark_hf.models import load_target, target_dtype


def step_seconds(target, rows: int, prompt_tokens: int, steps: int = 12, warmup: int = 2) -> float:
    ids = torch.randint(100, target.config.vocab_size - 100, (rows, prompt_tokens))
    cache = DynamicCache(config=target.config)
    times = []
    with torch.inference_mode():
        token = target(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(steps):
            start = time.perf_counter()
            token = target(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--prompt_tokens", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target_dtype", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = target_dtype(args.target_dtype)
    target, _ = load_target(dtype=dtype)
    for rows in args.rows:
        seconds = step_seconds(target, rows, args.prompt_tokens)
        print(f"rows {rows:4d}  step {seconds * 1e3:7.1f} ms  {rows / seconds:6.0f} tokens/s  ({dtype})", flush=True)


if __name__ == "__main__":
    main()
