"""Do plain steps get slower after verification rounds run under native GQA (`generation/gqa.py`) in the engine?

Two drafter engines hold the same 32 prompts and run 10 full-block rounds each, one with native grouped-query
attention for its multi-token forwards and one without; then both, and a target-only engine over the same prompts,
run plain one-token steps interleaved in alternating order (medians of 12). The slot-axis width is printed too: rows
that accepted drafts hold longer contexts than target-only's.

    python scripts/gqa_plain_steps.py
"""

from __future__ import annotations

import statistics
import time

import torch

from dspark_hf.benchmarks.prompts import first_turn_ids
from dspark_hf.generation import gqa
from dspark_hf.generation.batched import DSparkBatchEngine
from dspark_hf.modeling_dspark import DSparkDrafter
from dspark_hf.models import DEFAULT_TARGET, EMBEDDED_DRAFTERS, drafter_dtype, load_target, target_dtype

ALWAYS_WANTED = gqa.wanted
PROMPTS = ["../shared/data/eval/gsm8k.jsonl", "../shared/data/eval/humaneval.jsonl"]


def switch(on: bool) -> None:
    gqa.wanted = ALWAYS_WANTED if on else (lambda device, num_new_tokens: False)


def engine_for(target, drafter, prompts: list[list[int]]) -> DSparkBatchEngine:
    engine = DSparkBatchEngine(target, drafter, policy="full" if drafter is not None else None, pad_token_id=0)
    for prompt in prompts:
        engine.add_request(prompt, 1 << 20)
    engine.step()  # admission
    return engine


@torch.no_grad()
def main() -> None:
    target, tokenizer = load_target(DEFAULT_TARGET, dtype=target_dtype("auto"))
    drafter = DSparkDrafter.from_pretrained(EMBEDDED_DRAFTERS[DEFAULT_TARGET], target=target,
                                            dtype=drafter_dtype("auto")).eval()
    prompts = first_turn_ids(tokenizer, PROMPTS)[:32]
    engines = {}
    for native in (True, False):
        switch(native)
        engines[native] = engine_for(target, drafter, prompts)
    engines["target-only"] = engine_for(target, None, prompts)
    for _ in range(10):  # full-block rounds: drafts accepted and rejected, holes left behind
        for native in (True, False):
            switch(native)
            engines[native].step()
    for native in (True, False):  # from here on plain steps only
        engines[native].policy.begin_round = lambda *args, **kwargs: False
        engines[native].policy.end_round = lambda *args, **kwargs: None
    times = {key: [] for key in engines}
    order = list(engines)
    for index in range(15):
        for key in order if index % 2 else order[::-1]:
            switch(key is not False)
            start = time.perf_counter()
            engines[key].step()
            times[key].append(time.perf_counter() - start)
    switch(True)
    for key, seconds in times.items():
        name = {True: "native GQA", False: "copied K/V"}.get(key, key)
        print(f"{name}: plain step median {1e3 * statistics.median(seconds[3:]):.1f} ms, "
              f"slot axis {engines[key].slot_mask.shape[1]} slots")


if __name__ == "__main__":
    main()
