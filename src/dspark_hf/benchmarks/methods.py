"""The decoding methods a benchmark compares, and how one generation of each is run and measured.

Every method goes through the same `target.generate` call; only the keyword arguments differ:

| kind | how |
| --- | --- |
| `target` | plain greedy / sampling |
| `assisted` | transformers' assisted generation with a small draft model sharing the target's tokenizer |
| `prompt_lookup` | transformers' prompt lookup decoding (`prompt_lookup_num_tokens`) |
| `dspark` | a [`DSparkDrafter`] as `assistant_model` with one verification policy (`dflash`: `markov_rank=0`; `baseline_<policy>`: a second drafter for the same target, e.g. the one a new training stage should beat; `<policy>+lookup`: with prompt lookup inside DSpark rounds, label `dspark_<policy>_lookup`) |

Target forwards are counted with a forward pre-hook on the target, which also sees each forward's start position and
length; from those, [`rounds_from_forward_calls`] recovers every round's verified and accepted drafts for methods that
keep no statistics of their own.
"""

from __future__ import annotations

import json
import re
import resource
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from ..generation import policies as policy_module
from ..modeling_dspark import DSparkDrafter


logger = logging.get_logger(__name__)

# Both modes override the model's own generation_config defaults (some ship top_p, top_k or a repetition penalty):
# greedy is the argmax of the raw logits, sampling draws from the raw distribution at temperature 1.
SAMPLING_KWARGS = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}
GREEDY_KWARGS = {"do_sample": False, "repetition_penalty": 1.0}
MODES = ("greedy", "sample")


@dataclass
class BenchMethod:
    """One decoding method.

    Attributes:
        name: the row label in reports (`target`, `assisted`, `prompt_lookup`, `dflash`, `dspark_<policy>`,
            `baseline_<policy>`).
        kind: `target`, `assisted`, `prompt_lookup` or `dspark`.
        generate_kwargs: extra keyword arguments for `target.generate` (e.g. `assistant_model`).
        drafter: the DSpark drafter (kind `dspark` only); `policy` is set on it before every call, since several
            methods share one drafter.
        policy: the verification policy for `drafter`.
        details: JSON-friendly description written to the results (policy arguments, draft lengths, ...).
    """

    name: str
    kind: str
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    drafter: DSparkDrafter | None = None
    policy: policy_module.VerificationPolicy | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def prepare(self) -> None:
        """Selects this method's policy on the shared drafter; call right before `generate`."""
        if self.drafter is not None:
            self.drafter.verification_policy = self.policy
            self.drafter.generation_stats = None


def load_steps_per_second(path: str | Path) -> dict[int, float]:
    """Reads a target speed profile into `{tokens per forward: steps/s}`.

    Delegates to `dspark_hf.profiling.load_steps_per_second` (a `dspark-hf profile` file or a folder holding one, or a
    hand-written table). Without that module, reads `{"1": 11.2, "2": 5.1, ...}`, the same table under
    `"steps_per_second"`, or a list whose entry i is the speed at i + 1 tokens.
    """
    try:
        from ..profiling import load_steps_per_second as load_profile
    except ImportError:
        load_profile = None
    if load_profile is not None:
        return load_profile(path)
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if isinstance(data, dict) and "steps_per_second" in data:
        data = data["steps_per_second"]
    if isinstance(data, list):
        data = {i + 1: value for i, value in enumerate(data)}
    try:
        return {int(k): float(v) for k, v in data.items()}
    except (AttributeError, TypeError, ValueError) as error:
        raise ValueError(
            f"Could not read a steps-per-second table from {str(path)!r} ({error}). Expected e.g. "
            '{"1": 11.2, "2": 5.1}; regenerate it with `dspark-hf profile`.'
        ) from error


def resolve_policy(
    name: str, drafter: DSparkDrafter, policy_kwargs: Mapping[str, Any]
) -> tuple[policy_module.VerificationPolicy | None, str | None]:
    """`(policy, None)` when `name` can run with `drafter`, else `(None, reason)`.

    Never raises for a policy that is merely unavailable (not implemented in this version, missing profile, drafter
    without a confidence head): the benchmark skips that method and reports why.
    """
    available = getattr(policy_module, "POLICIES", {})
    if name not in available:
        return None, f"verification policy {name!r} is not available in this dspark_hf (known: {sorted(available)})"
    if name == "hardware_aware" and "steps_per_second" not in policy_kwargs:
        return None, "hardware_aware needs the target's speed profile: pass --sps PROFILE.json from `dspark-hf profile`"
    try:
        policy = policy_module.get_policy(name, **policy_kwargs)
    except (TypeError, ValueError) as error:
        return None, f"could not build verification policy {name!r} with {dict(policy_kwargs)}: {error}"
    if getattr(policy, "requires_confidence", False) and drafter.confidence_head is None:
        return None, f"verification policy {name!r} needs a confidence head, which this drafter does not have"
    return policy, None


def build_methods(
    *,
    drafter: DSparkDrafter | None = None,
    policies: Sequence[str] = ("full",),
    policy_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    dflash_drafter: DSparkDrafter | None = None,
    baseline_drafter: DSparkDrafter | None = None,
    assistant: PreTrainedModel | None = None,
    num_assistant_tokens: int | None = None,
    prompt_lookup_num_tokens: int | None = 10,
) -> tuple[list[BenchMethod], dict[str, str]]:
    """The methods to compare, target-only first, and `{method name: reason}` for the ones skipped.

    Args:
        drafter ([`DSparkDrafter`], *optional*): run one `dspark_<policy>` method per name in `policies`.
        policy_kwargs (`Mapping[str, Mapping]`, *optional*): arguments per policy name, e.g.
            `{"threshold": {"threshold": 0.5}, "hardware_aware": {"steps_per_second": {1: 11.0, 2: 5.0}}}`.
        dflash_drafter ([`DSparkDrafter`], *optional*): a `markov_rank=0` drafter, run with the `full` policy.
        baseline_drafter ([`DSparkDrafter`], *optional*): a second drafter for the same target, run with the same
            policies as `drafter` (rows `baseline_<policy>`), so that two drafters are compared in one run.
        assistant ([`PreTrainedModel`], *optional*): a small draft model for transformers' assisted generation.
        num_assistant_tokens (`int`, *optional*): drafts per round for `assistant` (transformers' default otherwise).
        prompt_lookup_num_tokens (`int`, *optional*): drafts per round for prompt lookup; `None` or 0 skips it.
    """
    methods = [BenchMethod("target", "target")]
    skipped: dict[str, str] = {}
    if assistant is not None:
        details = {"model": getattr(assistant, "name_or_path", type(assistant).__name__)}
        if num_assistant_tokens:
            assistant.generation_config.num_assistant_tokens = num_assistant_tokens
        details["num_assistant_tokens"] = assistant.generation_config.num_assistant_tokens
        details["num_assistant_tokens_schedule"] = assistant.generation_config.num_assistant_tokens_schedule
        methods.append(BenchMethod("assisted", "assisted", {"assistant_model": assistant}, details=details))
    if prompt_lookup_num_tokens:
        methods.append(BenchMethod("prompt_lookup", "prompt_lookup",
                                   {"prompt_lookup_num_tokens": prompt_lookup_num_tokens},
                                   details={"prompt_lookup_num_tokens": prompt_lookup_num_tokens}))
    if dflash_drafter is not None:
        methods.append(_dspark_method("dflash", dflash_drafter, policy_module.get_policy("full")))
        if dflash_drafter.config.markov_rank:
            logger.warning(f"The --dflash_drafter has markov_rank={dflash_drafter.config.markov_rank}; the DFlash "
                           "ablation is meant to be a drafter trained with markov_rank=0.")
    for prefix, model in (("baseline", baseline_drafter), ("dspark", drafter)):
        for spec in policies if model is not None else ():
            spec, lookup = split_lookup(spec, f"Policy {spec!r}")
            name, kwargs, label = _parse_policy_spec(spec, policy_kwargs or {})
            label += "_lookup" if lookup else ""
            policy, reason = resolve_policy(name, model, kwargs)  # one policy object per drafter: policies keep state
            if policy is None:
                skipped[f"{prefix}_{label}"] = reason
            else:
                methods.append(_dspark_method(f"{prefix}_{label}", model, policy,
                                              lookup_tokens=(prompt_lookup_num_tokens or 10) if lookup else None))
    return methods, skipped


def split_lookup(spec: str, named: str) -> tuple[str, bool]:
    """`"hardware_aware+lookup"` -> `("hardware_aware", True)`: a method name's policy and whether it adds prompt lookup
    inside DSpark rounds (the one addition a policy takes); `named` leads the error (how the caller names `spec`)."""
    policy, plus, extra = spec.partition("+")
    if plus and extra != "lookup":
        raise ValueError(f"{named}: the only addition to a policy is '+lookup' (prompt lookup inside DSpark rounds), "
                         "e.g. hardware_aware+lookup.")
    return policy, bool(plus)


def _parse_policy_spec(spec: str, policy_kwargs: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict, str]:
    """`"fixed:3"` -> `("fixed", {"length": 3}, "fixed3")`; `"hardware_aware:0.5"` -> plan smoothing 0.5, label
    `"hardware_aware_smooth0.5"`; any other name -> its kwargs from `policy_kwargs`."""
    name, _, argument = spec.partition(":")
    kwargs = dict(policy_kwargs.get(name, {}))
    if name == "fixed":
        if not argument.isdigit():
            raise ValueError(f"Policy {spec!r}: write fixed:K with K drafts per round, e.g. fixed:2.")
        return name, {**kwargs, "length": int(argument)}, f"fixed{argument}"
    if name == "hardware_aware" and argument:
        try:
            smoothing = float(argument)
        except ValueError:
            raise ValueError(f"Policy {spec!r}: write hardware_aware:W with W the plan smoothing in [0, 1), e.g. "
                             "hardware_aware:0.5.") from None
        return name, {**kwargs, "plan_smoothing": smoothing}, f"hardware_aware_smooth{argument}"
    if argument:
        raise ValueError(f"Policy {spec!r}: only fixed:K and hardware_aware:W take an argument ({name!r} reads its "
                         "flags).")
    return name, kwargs, name


def _dspark_method(name: str, drafter: DSparkDrafter, policy: policy_module.VerificationPolicy,
                   lookup_tokens: int | None = None) -> BenchMethod:
    config = drafter.config
    details = {"policy": repr(policy), "block_size": config.block_size, "markov_rank": config.markov_rank,
               "num_hidden_layers": config.num_hidden_layers, "drafter": getattr(drafter, "name_or_path", "")}
    kwargs = {"assistant_model": drafter}
    if lookup_tokens:  # prompt lookup inside DSpark rounds (generation/lookup.py)
        kwargs["prompt_lookup_num_tokens"] = details["prompt_lookup_num_tokens"] = lookup_tokens
    return BenchMethod(name, "dspark", kwargs, drafter=drafter, policy=policy, details=details)


# ---------------------------------------------------------------------------------------------------------------------
# Measuring one generation
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class GenerationMeasurement:
    """What one `generate` call did.

    Attributes:
        new_token_ids: the generated tokens (prompt excluded).
        seconds: wall time of the call.
        target_forwards: forward calls of the target (prefill included).
        rounds: `(verified, accepted)` per target forward, from the forward hook (prefill is the first round); `None`
            when the forwards carried no positions to read.
        dspark_rounds: `(verified, accepted)` per round from `drafter.generation_stats` (DSpark only; no prefill).
        peak_memory_bytes: peak memory above the level at the start of the call (see [`MemoryMeter`]).
        peak_memory_total_bytes: absolute peak during the call (all loaded models included).
    """

    new_token_ids: list[int]
    seconds: float
    target_forwards: int
    rounds: list[tuple[int, int]] | None
    dspark_rounds: list[tuple[int, int]] | None
    peak_memory_bytes: int | None
    peak_memory_total_bytes: int | None = None


class TargetForwardRecorder:
    """Context manager recording `(start position, number of input tokens)` for every forward of `model`."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.calls: list[tuple[int | None, int]] = []
        self._handle = None

    def _hook(self, module, args, kwargs) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        length = input_ids.shape[1] if input_ids is not None else (embeds.shape[1] if embeds is not None else 0)
        self.calls.append((_start_position(kwargs), int(length)))

    def __enter__(self) -> "TargetForwardRecorder":
        self._handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def _start_position(kwargs: Mapping[str, Any]) -> int | None:
    """The absolute position of a forward's first input token: from `position_ids`, else the cache length."""
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        return int(position_ids.reshape(-1)[0])
    cache_position = kwargs.get("cache_position")
    if cache_position is not None:
        return int(cache_position.reshape(-1)[0])
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is not None and hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    return None


def rounds_from_forward_calls(
    calls: Sequence[tuple[int | None, int]], prompt_length: int, final_length: int
) -> list[tuple[int, int]] | None:
    """`(verified, accepted)` per target forward of one assisted-loop `generate` call.

    Each forward starts right after the committed tokens except the last one (whose token is re-fed), so it holds
    `1 + verified` tokens (the prefill: the prompt + verified), and the committed sequence grows by `accepted + 1`
    between two forwards; the last round's growth is read from `final_length`.

    Args:
        calls (`Sequence[tuple[int | None, int]]`): `(start position, input length)` per forward, in order.
        prompt_length (`int`): tokens in the prompt.
        final_length (`int`): tokens in the returned sequence (prompt + generated).

    Returns:
        The rounds, or `None` if a start position is unknown.
    """
    if not calls or any(start is None for start, _ in calls):
        return None
    # Committed sequence length when each forward ran (the prefill sees the prompt only).
    committed = [prompt_length] + [start + 1 for start, _ in calls[1:]] + [final_length]
    rounds = []
    for index, (start, length) in enumerate(calls):
        verified = length - prompt_length if index == 0 else length - 1
        rounds.append((verified, committed[index + 1] - committed[index] - 1))
    return rounds


class MemoryMeter:
    """Peak memory of a block of code above its starting level.

    - CUDA: `torch.cuda.max_memory_allocated` after resetting the peak (`method = "cuda_max_memory_allocated"`).
    - Linux CPU: the process's peak resident set (VmHWM) after resetting it through `/proc/self/clear_refs`, minus the
      resident set at the start (`"linux_vmhwm"`). Counts everything the process touched, allocator caches included.
    - Elsewhere: growth of `ru_maxrss` (`"ru_maxrss_delta"`), which stays 0 unless the process reaches a new high.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.method = self._pick_method()
        self._start = 0
        self.peak_bytes: int | None = None  # above the level at the start
        self.peak_total_bytes: int | None = None  # absolute (weights and everything else in the process included)

    def _pick_method(self) -> str:
        if self.device.type == "cuda":
            return "cuda_max_memory_allocated"
        try:
            Path("/proc/self/clear_refs").write_text("5")
            _proc_status_kib("VmHWM")
            return "linux_vmhwm"
        except (OSError, ValueError):
            return "ru_maxrss_delta"

    def __enter__(self) -> "MemoryMeter":
        if self.method == "cuda_max_memory_allocated":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        elif self.method == "linux_vmhwm":
            Path("/proc/self/clear_refs").write_text("5")
            self._start = _proc_status_kib("VmRSS") * 1024
        else:
            self._start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return self

    def __exit__(self, *exc) -> None:
        if self.method == "cuda_max_memory_allocated":
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self.method == "linux_vmhwm":
            peak = _proc_status_kib("VmHWM") * 1024
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self.peak_total_bytes = peak
        self.peak_bytes = max(peak - self._start, 0)


def _proc_status_kib(key: str) -> int:
    match = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), flags=re.MULTILINE)
    if match is None:
        raise ValueError(f"/proc/self/status has no {key} line")
    return int(match.group(1))


def generation_kwargs(mode: str, max_new_tokens: int, pad_token_id: int | None) -> dict[str, Any]:
    """`generate` keyword arguments shared by all methods: greedy, or pure sampling at temperature 1.0."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}.")
    kwargs = dict(GREEDY_KWARGS if mode == "greedy" else SAMPLING_KWARGS)
    kwargs.update(max_new_tokens=max_new_tokens, pad_token_id=pad_token_id)
    return kwargs


@torch.inference_mode()
def measure_generation(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    method: BenchMethod,
    kwargs: Mapping[str, Any],
    seed: int | None = None,
) -> GenerationMeasurement:
    """Runs `target.generate(input_ids, **kwargs, **method.generate_kwargs)` once and measures it.

    Args:
        input_ids (`torch.LongTensor` of shape `(1, prompt_len)`): the prompt, on the target's device.
        kwargs (`Mapping`): the shared arguments from [`generation_kwargs`].
        seed (`int`, *optional*): `torch.manual_seed` right before the call (same seed for every method).
    """
    method.prepare()
    if seed is not None:
        torch.manual_seed(seed)
    synchronize = torch.cuda.synchronize if input_ids.device.type == "cuda" else (lambda: None)
    with TargetForwardRecorder(target) as recorder, MemoryMeter(input_ids.device) as memory:
        synchronize()
        started = time.perf_counter()
        output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs,
                                 **method.generate_kwargs)
        synchronize()
        seconds = time.perf_counter() - started
    prompt_length, final_length = input_ids.shape[1], output.shape[1]
    dspark_rounds = None
    if method.drafter is not None and method.drafter.generation_stats is not None:
        dspark_rounds = [(r.verified, r.accepted) for r in method.drafter.generation_stats.rounds]
    return GenerationMeasurement(
        new_token_ids=output[0, prompt_length:].tolist(),
        seconds=seconds,
        target_forwards=len(recorder.calls),
        rounds=rounds_from_forward_calls(recorder.calls, prompt_length, final_length),
        dspark_rounds=dspark_rounds,
        peak_memory_bytes=memory.peak_bytes,
        peak_memory_total_bytes=memory.peak_total_bytes,
    )
