"""`dspark-hf bench`: speculative decoding methods side by side on the same prompts, in the same run.

For every prompt (and mode), every method runs the whole conversation before the next prompt starts, in an order
rotated by one method per prompt, so that machine drift and cache effects hit all methods alike. Each method runs once
untimed first (warmup). Speed-ups are per-prompt ratios to target-only on the same prompt.

```bash
dspark-hf bench --drafter untrained --prompts data/eval/gsm8k.jsonl data/eval/mt-bench.jsonl \
    --limit 2 --max_new_tokens 16 --output_dir bench-smoke
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
import json
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

from ..cli import ArgumentParser
from ..modeling_dspark import DSparkDrafter
from ..models import DEFAULT_TARGET, DTYPES, EMBEDDED_DRAFTERS, check_model_path, drafter_dtype, load_target
from ..models import cpuinfo, target_dtype
from ..packed_linear import PACKED_LINEAR_MODES, is_packed, pack_linear_weights
from ..profiling import profile_dtype_mismatch, steps_per_second_here
from .exactness import conversation_divergence
from .methods import (
    BenchMethod,
    GenerationMeasurement,
    MemoryMeter,
    build_methods,
    generation_kwargs,
    load_steps_per_second,
    measure_generation,
)
from .prompts import BenchPrompt, load_prompts, render_conversation
from .report import acceptance_by_position, summarize_records, write_report


WARMUP_MAX_NEW_TOKENS = 16
PROFILE_FILE_NAME = "dspark_sps_profile.json"  # where `dspark-hf profile --drafter DIR` saves the target's profile


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
    prompt_ids: list[list[int]] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [token for turn in self.turns for token in turn.new_token_ids]

    @property
    def prompt_lengths(self) -> list[int]:
        return [len(ids) for ids in self.prompt_ids]

    @property
    def seconds(self) -> float:
        return sum(turn.seconds for turn in self.turns)

    @property
    def target_forwards(self) -> int:
        return sum(turn.target_forwards for turn in self.turns)


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
        run.prompt_ids.append(input_ids[0].tolist())
        run.answers.append(tokenizer.decode(measurement.new_token_ids, skip_special_tokens=True).strip())
    return run


def conversation_record(
    prompt: BenchPrompt, method: BenchMethod, mode: str, run: ConversationRun, baseline: ConversationRun,
    save_outputs: bool = False, first_divergence: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The raw numbers of one method on one prompt, with its speed-up and exactness against `baseline`
    (`first_divergence`: from [`conversation_divergence`] when a greedy output differs from the baseline's)."""
    new_tokens, seconds, forwards = len(run.token_ids), run.seconds, run.target_forwards
    rounds, tau_tokens, tau_forwards = _rounds_and_tau(method, run)
    tokens_per_second = new_tokens / seconds if seconds else None
    baseline_tps = len(baseline.token_ids) / baseline.seconds if baseline.seconds else None
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
        "first_divergence": first_divergence,
        "peak_memory_bytes": _max_of(turn.peak_memory_bytes for turn in run.turns),
        "peak_memory_total_bytes": _max_of(turn.peak_memory_total_bytes for turn in run.turns),
        "turn_seconds": [turn.seconds for turn in run.turns],
        "turn_new_tokens": [len(turn.new_token_ids) for turn in run.turns],
        "output_sha1": hashlib.sha1(str(run.token_ids).encode()).hexdigest()[:12],
    }
    if save_outputs:
        record["outputs"] = run.answers
    return record


def _rounds_and_tau(method: BenchMethod, run: ConversationRun) -> tuple[list[tuple[int, int]] | None, int, int]:
    """`(rounds, tau numerator, tau denominator)`: every round's `(verified, accepted)` and committed tokens over
    target forwards. DSpark reads its drafter's own statistics (prefill excluded); the others count forwards."""
    if method.kind == "dspark":
        rounds = [r for turn in run.turns for r in (turn.dspark_rounds or [])]
        return rounds, sum(accepted for _, accepted in rounds) + len(rounds), len(rounds)
    rounds = None if any(t.rounds is None for t in run.turns) else [r for t in run.turns for r in t.rounds]
    return rounds, len(run.token_ids), run.target_forwards


def _max_of(values) -> int | None:
    return max((value for value in values if value is not None), default=None)


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
            records += [conversation_record(prompt, m, mode, runs[m.name], runs["target"], settings.save_outputs,
                                            _greedy_divergence(target, mode, runs[m.name], runs["target"]))
                        for m in methods]
    return records


def _greedy_divergence(target: PreTrainedModel, mode: str, run: ConversationRun,
                       baseline: ConversationRun) -> dict[str, Any] | None:
    """Where a greedy output first parts from target-only's, with the target's logit margin there (after the
    timed generations: one untimed forward over target-only's output)."""
    if mode != "greedy" or run.token_ids == baseline.token_ids:
        return None
    return conversation_divergence(target, baseline.prompt_ids, [t.new_token_ids for t in baseline.turns],
                                   [t.new_token_ids for t in run.turns])


# ---------------------------------------------------------------------------------------------------------------------
# Run metadata
# ---------------------------------------------------------------------------------------------------------------------


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """CPU model, core counts, torch threads, OS, and the GPU name when running on CUDA."""
    info = {
        "cpu_model": cpuinfo("model name") or platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
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


def write_record(path: str | Path, command: str, **fields: Any) -> None:
    """Writes a script's JSON results to `path` (its folder made if needed): the command that made them, this
    machine and the package versions, then `fields`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": command, "machine": machine_info(), "versions": version_info(), **fields}
    path.write_text(json.dumps(record, indent=1) + "\n")


def results_document(
    records: list[dict[str, Any]], argv: Sequence[str], settings: BenchSettings, methods: Sequence[BenchMethod],
    skipped: dict[str, str], prompts: Sequence[BenchPrompt], device: torch.device | str,
    load_average_before: Sequence[float] | None = None, **extra: Any,
) -> dict[str, Any]:
    """Everything `results.json` holds: how the run was made and every raw number.

    `load_average_before` (from `os.getloadavg()` before the run) is kept next to the load average after it: other
    processes on the machine skew timings, and these two say whether there were any.
    """
    machine = machine_info(device)
    machine["load_average_before"] = list(load_average_before) if load_average_before is not None else None
    return {
        "command": shlex.join(["dspark-hf", "bench", *argv]),
        "argv": list(argv),
        "machine": machine,
        "versions": version_info(),
        "settings": {**asdict(settings), "num_prompts": len(prompts), "memory_measure": MemoryMeter(device).method,
                     **extra},
        "methods": [{"name": m.name, "kind": m.kind, **m.details} for m in methods],
        "skipped_methods": skipped,
        "prompts": [{"prompt_id": p.prompt_id, "category": p.category, "num_turns": len(p.turns)} for p in prompts],
        "summary": summarize_records(records),
        "records": records,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="dspark-hf bench",
        description="Benchmark target-only, transformers' assisted generation and prompt lookup, and DSpark "
        "(per verification policy) side by side, interleaved per prompt.",
    )
    models = parser.add_argument_group("models")
    models.add_argument("--target", default=DEFAULT_TARGET, help="target name or folder (default: %(default)s)")
    models.add_argument("--drafter", help="DSpark drafter folder, 'untrained' (fresh from_target, for smoke tests) or "
                        "'none'; default: the drafter embedded for the target")
    models.add_argument("--dflash_drafter", help="markov_rank=0 drafter folder (DFlash ablation) or 'untrained'")
    models.add_argument("--baseline_drafter",
                        help="a second DSpark drafter folder for the same target, run with the same --policies "
                             "(rows baseline_<policy>): compares two drafters, e.g. a new training stage with the "
                             "shipped one, in one run")
    models.add_argument("--assistant", help="small draft model sharing the target's tokenizer (transformers' "
                        "assisted generation)")
    models.add_argument("--num_assistant_tokens", type=int, help="drafts per round for --assistant")
    models.add_argument("--prompt_lookup_num_tokens", type=int, default=10,
                        help="drafts per round for prompt lookup decoding; 0 skips it (default: %(default)s)")
    models.add_argument("--policies", default="full,threshold,hardware_aware",
                        help="comma-separated DSpark verification policies; fixed:K verifies K drafts per round, "
                        "hardware_aware:W sets its plan_smoothing to W (default 0.5; hardware_aware:0 is the "
                        "production scheduler's last-round plan); POLICY+lookup adds prompt lookup inside DSpark "
                        "rounds (e.g. hardware_aware+lookup; --prompt_lookup_num_tokens drafts at most) "
                        "(default: %(default)s)")
    models.add_argument("--threshold", type=float, default=0.5, help="confidence threshold of the threshold policy")
    models.add_argument("--sps", help="steps-per-second profile JSON from `dspark-hf profile` (hardware_aware); "
                        f"default: {PROFILE_FILE_NAME} in the drafter folder, if there")
    models.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    models.add_argument("--target_dtype", "--dtype", default="auto", choices=DTYPES,
                        help="dtype of the target (and of --assistant): auto (default: bfloat16 where the device "
                        "computes it natively, else float32), float32, bfloat16, float16. Every method runs in it and "
                        "is compared with target-only in it; outside float32 outputs may differ at near-ties, and the "
                        "report gives the identity rate and the target's logit margins at the divergences")
    models.add_argument("--packed_linear", default="auto", choices=PACKED_LINEAR_MODES,
                        help="read the target's linear weights packed for oneDNN (CPU): auto (default: where this "
                        "machine runs them faster), on, off; every method runs the same target")
    models.add_argument("--drafter_dtype", default="auto", choices=DTYPES,
                        help="dtype the DSpark drafters run in (auto: bfloat16 where the device computes it natively, "
                        "else float32; outputs are identical either way)")
    models.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    data = parser.add_argument_group("prompts")
    data.add_argument("--prompts", nargs="+", required=True, metavar="FILE",
                      help='jsonl files: {"turns": [...]} (category = file stem) or Spec-Bench question.jsonl')
    data.add_argument("--start", type=int, default=0, help="skip this many prompts per category")
    data.add_argument("--limit", type=int, help="keep at most this many prompts per category")
    data.add_argument("--no_chat_template", action="store_true", help="feed raw turns instead of the chat template")
    run = parser.add_argument_group("run")
    run.add_argument("--mode", default="greedy", choices=["greedy", "sample", "both"],
                     help="greedy, sampling at temperature 1.0 with fixed seeds, or both (default: %(default)s)")
    run.add_argument("--max_new_tokens", type=int, default=128, help="per turn (default: %(default)s)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--no_warmup", action="store_true", help="skip the untimed warmup generation per method")
    run.add_argument("--save_outputs", action="store_true", help="store every answer's text in results.json")
    run.add_argument("--output_dir", default="bench-results", help="where results.json/.md and PNGs go")
    run.add_argument("--no_plots", action="store_true")
    run.add_argument("--no_progress", action="store_true", help="hide the progress bar")
    return parser


def load_drafter(spec: str | None, target: PreTrainedModel, device: str, dtype: torch.dtype,
                 packed_linear: str = "off", **untrained_kwargs: Any) -> DSparkDrafter | None:
    """`None` for `"none"`, a fresh drafter for `"untrained"`, else `DSparkDrafter.from_pretrained(spec)`; its linear
    weights packed for oneDNN as `packed_linear` says ([`pack_linear_weights`])."""
    if spec is None or spec.lower() == "none":
        return None
    if spec.lower() == "untrained":
        drafter = DSparkDrafter.from_target(target, **untrained_kwargs)
        drafter.name_or_path = "untrained"
    else:
        drafter = DSparkDrafter.from_pretrained(spec, dtype=dtype, target=target)
    drafter = drafter.to(device=device, dtype=dtype).eval()
    pack_linear_weights(drafter, packed_linear)
    return drafter


def default_drafter(target_name: str) -> str:
    """The drafter embedded for an embedded target, else an error that says which flag to pass."""
    path = EMBEDDED_DRAFTERS.get(target_name)
    if path is not None and (Path(path) / "config.json").exists():
        return str(path)
    raise ValueError(
        f"No drafter is embedded for target {target_name!r}. Pass --drafter PATH (a trained drafter), "
        "--drafter untrained (a fresh one, for smoke tests) or --drafter none (baselines only)."
    )


def load_assistant(path: str, tokenizer: PreTrainedTokenizerBase, device: str, dtype: torch.dtype,
                   packed_linear: str = "auto"):
    """The draft model for transformers' assisted generation; refuses one whose vocabulary differs."""
    assistant, assistant_tokenizer = load_target(path, dtype=dtype, device=device, packed_linear=packed_linear)
    if assistant_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"--assistant {path!r} does not share the target's tokenizer ({len(assistant_tokenizer)} vs "
            f"{len(tokenizer)} tokens, or different ids). Pick a draft model of the same family as the target."
        )
    return assistant


def profile_path(sps: str | None, drafter_spec: str | None) -> str | None:
    """`--sps`, else the profile `dspark-hf profile --drafter` saved in the drafter folder, else `None`."""
    if sps:
        return sps
    if drafter_spec and (Path(drafter_spec) / PROFILE_FILE_NAME).is_file():
        return str(Path(drafter_spec) / PROFILE_FILE_NAME)
    return None


def speed_profile(sps: str | None, drafter_spec: str | None, target: PreTrainedModel,
                  drafter: DSparkDrafter | None) -> str | None:
    """The profile for `hardware_aware`: `--sps` (refused when measured in another dtype), else the one the library's
    default policy uses (`steps_per_second_here`: the drafter folder's when it was measured on this kind of machine in
    the target's dtype, else one measured here once and cached), else `None`."""
    if sps:
        mismatch = profile_dtype_mismatch(sps, target.dtype, is_packed(target))
        if mismatch:
            raise ValueError(f"--sps {sps}: {mismatch}.")
        return sps
    if drafter is not None and drafter.confidence_head is not None:
        return str(steps_per_second_here(target, drafter)[1])
    return profile_path(None, drafter_spec)


def _policy_kwargs(args: argparse.Namespace, sps: str | None) -> dict[str, dict[str, Any]]:
    kwargs: dict[str, dict[str, Any]] = {"threshold": {"threshold": args.threshold}}
    if sps:
        kwargs["hardware_aware"] = {"steps_per_second": load_steps_per_second(sps)}
    return kwargs


def run_from_args(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Loads the models and prompts named by `args`, runs the benchmark and writes the report."""
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = target_dtype(args.target_dtype, args.device)
    prompts = load_prompts(args.prompts, start=args.start, limit=args.limit)
    drafter_spec = args.drafter if args.drafter is not None else default_drafter(args.target)
    for option, spec in (("--drafter", drafter_spec), ("--dflash_drafter", args.dflash_drafter),
                         ("--baseline_drafter", args.baseline_drafter)):
        if spec is not None and spec.lower() not in ("none", "untrained"):
            check_model_path(spec, option)  # before the target loads
    target, tokenizer = load_target(args.target, dtype=dtype, device=args.device, packed_linear=args.packed_linear)
    draft_dtype = drafter_dtype(args.drafter_dtype, args.device)
    drafter = load_drafter(drafter_spec, target, args.device, draft_dtype, args.packed_linear)
    sps = speed_profile(args.sps, drafter_spec, target, drafter)
    methods, skipped = build_methods(
        drafter=drafter,
        policies=[name.strip() for name in args.policies.split(",") if name.strip()],
        policy_kwargs=_policy_kwargs(args, sps),
        dflash_drafter=load_drafter(args.dflash_drafter, target, args.device, draft_dtype, args.packed_linear,
                                    markov_rank=0),
        baseline_drafter=load_drafter(args.baseline_drafter, target, args.device, draft_dtype, args.packed_linear),
        assistant=(load_assistant(args.assistant, tokenizer, args.device, dtype, args.packed_linear) if args.assistant
                   else None),
        num_assistant_tokens=args.num_assistant_tokens,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
    )
    for name, reason in skipped.items():
        print(f"dspark-hf bench: skipping {name}: {reason}", file=sys.stderr)
    settings = BenchSettings(
        modes=("greedy", "sample") if args.mode == "both" else (args.mode,),
        max_new_tokens=args.max_new_tokens, seed=args.seed, use_chat_template=not args.no_chat_template,
        warmup=not args.no_warmup, save_outputs=args.save_outputs,
    )
    load_average_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    records = run_benchmark(target, tokenizer, methods, prompts, settings, progress=not args.no_progress)
    results = results_document(records, argv, settings, methods, skipped, prompts, args.device, load_average_before,
                               target=args.target, drafter=drafter_spec, target_dtype=_dtype_name(target.dtype),
                               target_packed_linear=is_packed(target),
                               drafter_packed_linear=drafter is not None and is_packed(drafter),
                               drafter_dtype=_dtype_name(draft_dtype), sps_profile=sps)
    paths = write_report(args.output_dir, results, plots=not args.no_plots)
    print(Path(paths["markdown"]).read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(path) for path in paths.values()))
    return 0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def main(argv: Sequence[str] | None = None) -> int:
    """`dspark-hf bench ...`; see `dspark-hf bench --help`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_from_args(build_parser().parse_args(argv), argv)


if __name__ == "__main__":
    sys.exit(main())
