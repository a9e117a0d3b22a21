"""`dspark-hf bench`: speculative decoding methods side by side on the same prompts, in the same run.

For every prompt (and mode), every method runs the whole conversation before the next prompt starts, in an order
rotated by one method per prompt, so that machine drift and cache effects hit all methods alike. Each method runs once
untimed first (warmup). Speed-ups are per-prompt ratios to target-only on the same prompt.

```bash
dspark-hf bench --drafter untrained --prompts data/eval/gsm8k.jsonl data/eval/mt-bench.jsonl \
    --limit 2 --max-new-tokens 16 --output-dir bench-smoke
```

In Python, on models already in memory:

```python
>>> from dspark_hf.benchmarks import BenchSettings, build_methods, load_prompts, run_benchmark  # doctest: +SKIP
>>> methods, skipped = build_methods(drafter=drafter, policies=["full"])  # doctest: +SKIP
>>> records = run_benchmark(target, tokenizer, methods, load_prompts(["gsm8k.jsonl"], limit=4))  # doctest: +SKIP
```
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .methods import BenchMethod, GenerationMeasurement, generation_kwargs, measure_generation
from .prompts import BenchPrompt, render_conversation
from .report import acceptance_by_position, summarize_records, write_report


WARMUP_MAX_NEW_TOKENS = 16


@dataclass
class BenchSettings:
    """How each prompt is generated.

    Attributes:
        modes: `"greedy"` and/or `"sample"` (temperature 1.0, no top-k/top-p, seed per prompt and turn).
        max_new_tokens: per turn.
        seed: base seed; turn `t` of prompt `i` samples with seed `seed + 1000 * i + t` in every method.
        use_chat_template: render turns with the tokenizer's chat template (else join them with blank lines).
        warmup: run every method once, untimed, on the first prompt before measuring.
        save_outputs: keep each method's answers (text) in the records.
    """

    modes: tuple[str, ...] = ("greedy",)
    max_new_tokens: int = 128
    seed: int = 0
    use_chat_template: bool = True
    warmup: bool = True
    save_outputs: bool = False


@dataclass
class ConversationRun:
    """One method's measurements over the turns of one prompt."""

    turns: list[GenerationMeasurement] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [token for turn in self.turns for token in turn.new_token_ids]


def run_conversation(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    method: BenchMethod,
    prompt: BenchPrompt,
    mode: str,
    settings: BenchSettings,
    prompt_index: int = 0,
    num_turns: int | None = None,
    max_new_tokens: int | None = None,
) -> ConversationRun:
    """Asks the turns of `prompt` one after the other, each with the method's own earlier answers in the context."""
    run = ConversationRun()
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kwargs = generation_kwargs(mode, max_new_tokens or settings.max_new_tokens, pad_token_id)
    for turn in range(num_turns or len(prompt.turns)):
        text = render_conversation(tokenizer, prompt.turns, run.answers, settings.use_chat_template)
        # A chat template writes its own special tokens (BOS included); raw text gets the tokenizer's.
        encoded = tokenizer(text, return_tensors="pt", add_special_tokens=not settings.use_chat_template)
        input_ids = encoded["input_ids"].to(target.device)
        seed = settings.seed + 1000 * prompt_index + turn if mode == "sample" else None
        measurement = measure_generation(target, input_ids, method, kwargs, seed=seed)
        run.turns.append(measurement)
        run.prompt_lengths.append(input_ids.shape[1])
        run.answers.append(tokenizer.decode(measurement.new_token_ids, skip_special_tokens=True).strip())
    return run


def conversation_record(
    prompt: BenchPrompt, method: BenchMethod, mode: str, run: ConversationRun, baseline: ConversationRun,
    save_outputs: bool = False,
) -> dict[str, Any]:
    """The raw numbers of one method on one prompt, with its speed-up and exactness against `baseline`."""
    new_tokens = sum(len(turn.new_token_ids) for turn in run.turns)
    seconds = sum(turn.seconds for turn in run.turns)
    forwards = sum(turn.target_forwards for turn in run.turns)
    if method.kind == "dspark":
        # tau from the drafter's own statistics: committed tokens per draft-and-verify round (prefill excluded).
        rounds = [r for turn in run.turns for r in (turn.dspark_rounds or [])]
        tau_tokens, tau_forwards = sum(a for _, a in rounds) + len(rounds), len(rounds)
    else:
        rounds = None if any(t.rounds is None for t in run.turns) else [r for t in run.turns for r in t.rounds]
        tau_tokens, tau_forwards = new_tokens, forwards
    tokens_per_second = new_tokens / seconds if seconds else None
    baseline_seconds = sum(turn.seconds for turn in baseline.turns)
    baseline_tps = sum(len(t.new_token_ids) for t in baseline.turns) / baseline_seconds if baseline_seconds else None
    record = {
        "prompt_id": prompt.prompt_id, "category": prompt.category, "mode": mode, "method": method.name,
        "kind": method.kind, "num_turns": len(run.turns), "prompt_tokens": run.prompt_lengths,
        "new_tokens": new_tokens, "seconds": seconds, "tokens_per_second": tokens_per_second,
        "target_forwards": forwards, "tokens_per_forward": new_tokens / forwards if forwards else None,
        "tau": tau_tokens / tau_forwards if tau_forwards else None, "tau_tokens": tau_tokens,
        "tau_forwards": tau_forwards,
        "round_lengths": [list(r) for r in rounds] if rounds is not None else None,
        "mean_verified": sum(v for v, _ in rounds) / len(rounds) if rounds else None,
        "acceptance_by_position": acceptance_by_position(rounds) if rounds is not None else None,
        "speedup": tokens_per_second / baseline_tps if tokens_per_second and baseline_tps else None,
        "identical": run.token_ids == baseline.token_ids if mode == "greedy" else None,
        "peak_memory_bytes": max((t.peak_memory_bytes for t in run.turns if t.peak_memory_bytes is not None),
                                 default=None),
        "turn_seconds": [turn.seconds for turn in run.turns],
        "turn_new_tokens": [len(turn.new_token_ids) for turn in run.turns],
        "output_sha1": hashlib.sha1(str(run.token_ids).encode()).hexdigest()[:12],
    }
    if save_outputs:
        record["outputs"] = run.answers
    return record


def run_benchmark(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    methods: Sequence[BenchMethod],
    prompts: Sequence[BenchPrompt],
    settings: BenchSettings | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Runs every method on every prompt (interleaved per prompt) and returns one record per (prompt, mode, method).

    Args:
        methods (`Sequence[BenchMethod]`): from [`build_methods`]; must include the `target` method (the baseline).
        prompts (`Sequence[BenchPrompt]`): from [`load_prompts`].
        progress (`bool`): show a tqdm bar over prompts.
    """
    settings = settings or BenchSettings()
    if not any(method.name == "target" for method in methods):
        raise ValueError(f"run_benchmark needs the target-only baseline among the methods, got "
                         f"{[m.name for m in methods]}; build them with build_methods().")
    if settings.warmup and prompts:
        for mode in settings.modes:
            for method in methods:
                run_conversation(target, tokenizer, method, prompts[0], mode, settings, num_turns=1,
                                 max_new_tokens=min(settings.max_new_tokens, WARMUP_MAX_NEW_TOKENS))
    from tqdm.auto import tqdm

    records = []
    for index, prompt in enumerate(tqdm(prompts, desc="bench", unit="prompt", disable=not progress)):
        shift = index % len(methods)
        order = list(methods[shift:]) + list(methods[:shift])
        for mode in settings.modes:
            runs = {m.name: run_conversation(target, tokenizer, m, prompt, mode, settings, index) for m in order}
            records += [conversation_record(prompt, m, mode, runs[m.name], runs["target"], settings.save_outputs)
                        for m in methods]
    return records


# ---------------------------------------------------------------------------------------------------------------------
# Run metadata
# ---------------------------------------------------------------------------------------------------------------------


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """CPU model, core counts, torch threads, OS, and the GPU name when running on CUDA."""
    cpu_model = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "device": str(device),
    }
    if torch.device(device).type == "cuda":
        info["cuda_device"] = torch.cuda.get_device_name(torch.device(device))
    return info


def version_info() -> dict[str, str]:
    import transformers

    import dspark_hf

    return {"dspark_hf": dspark_hf.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def results_document(
    records: list[dict[str, Any]], argv: Sequence[str], settings: BenchSettings, methods: Sequence[BenchMethod],
    skipped: dict[str, str], prompts: Sequence[BenchPrompt], device: torch.device | str, **extra: Any,
) -> dict[str, Any]:
    """Everything `results.json` holds: how the run was made and every raw number."""
    return {
        "command": shlex.join(["dspark-hf", "bench", *argv]),
        "argv": list(argv),
        "machine": machine_info(device),
        "versions": version_info(),
        "settings": {**asdict(settings), "num_prompts": len(prompts), **extra},
        "methods": [{"name": m.name, "kind": m.kind, **m.details} for m in methods],
        "skipped_methods": skipped,
        "prompts": [{"prompt_id": p.prompt_id, "category": p.category, "num_turns": len(p.turns)} for p in prompts],
        "summary": summarize_records(records),
        "records": records,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """`dspark-hf bench ...`; see `dspark-hf bench --help`."""
    from .cli import parse_args, run_from_args

    argv = list(sys.argv[1:] if argv is None else argv)
    return run_from_args(parse_args(argv), argv)
