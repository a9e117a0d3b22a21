"""`dspark-hf profile`: the target's forward steps per second by number of tokens in a verification forward.

The hardware-aware scheduler (docs/design.md, "Scheduler: Algorithm 1") needs ``SPS(B)``, measured on the machine that
serves. Every size from 1 to `--max_tokens` is timed on its own, because real curves are not smooth: on a small CPU,
verifying 2 tokens costs 2-3x a one-token decode step, then cost barely grows with more tokens (see the module docs of
`dspark_hf.scheduling` for how sizes missing from a profile are read).

Each forward runs over a cache of `--context_length` tokens (cropped back after every forward, as speculative
decoding does), with warmup rounds first, and the sizes are timed round-robin so that load drifts spread over all of
them; the median of the repeats is kept. The JSON also records the raw timings and the machine.

```bash
# writes path/to/drafter/dspark_sps_profile.json
dspark-hf profile --target smollm2-135m-instruct --drafter path/to/drafter
dspark-hf profile --target my-target --max_tokens 16 --batch_sizes 1 2 4 --output sps.json
```
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.utils import logging

from . import _transformers_compat
from .configuration_dspark import hidden_state_indices
from .models import cpuinfo
from .packed_linear import PACKED_LINEAR_MODES, is_packed, pack_linear_weights


logger = logging.get_logger(__name__)

PROFILE_FILE_NAME = "dspark_sps_profile.json"
PROFILE_FORMAT = "dspark-hf-sps-profile"
# The widest forward a profile measured on first use covers: a block of up to 15 drafts, or the anchor and
# `prompt_lookup_num_tokens=10` lookup drafts (wider forwards are never verified).
FIRST_USE_MAX_TOKENS = 16
PROFILE_VERSION = 1
# How profiles time batches of several rows: as the batched engine runs them (`time_verification_forwards`,
# `engine_layout`). Profiles without it timed them as one sequence is timed, at up to 2.5x the engine's cost per step:
# on first use they are measured again, and a file passed in that lacks it gets a warning (`load_speed_tables`).
BATCHED_LAYOUT = "engine"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


@torch.no_grad()
def time_verification_forwards(
    model: torch.nn.Module,
    num_tokens: Sequence[int],
    batch_size: int = 1,
    context_length: int = 256,
    warmup: int = 2,
    repeats: int = 5,
    timer: Callable[[], float] = time.perf_counter,
    seed: int = 0,
    forward_kwargs: dict | None = None,
    on_forward: Callable[[], None] | None = None,
    engine_layout: bool = False,
) -> dict[int, list[float]]:
    """Wall-clock seconds of target forwards of `k` new tokens per row over a `context_length`-token cache.

    Args:
        model (`PreTrainedModel`): the target, called as ``model(input_ids=..., cache=..., use_cache=True)``.
        num_tokens (`Sequence[int]`): the forward sizes k (tokens per row) to time.
        batch_size (`int`): rows per forward.
        context_length (`int`): tokens already in the cache (a prompt plus earlier output).
        warmup (`int`), repeats (`int`): untimed and timed rounds; each round times every size once, in order.
        timer (`Callable[[], float]`): the clock (seconds).
        forward_kwargs (`dict`, *optional*): extra arguments of every forward, e.g. the
            ``output_hidden_states=[...]`` request that DSpark's verification forwards carry.
        on_forward (`Callable[[], None]`, *optional*): called after every forward (a progress bar's `update`).
        engine_layout (`bool`, defaults to `False`): time the forwards as the batched engine runs them
            (`generation.batched.engine_forward`: its appending cache, an attention mask over the slots with one
            padding slot per row, as rows of different lengths have, and packed or native grouped-query attention),
            instead of as `generate` runs one sequence (transformers' cache, no mask). The two differ far more than
            rounding: without a mask transformers runs grouped-query attention head by head, which at 32 rows of
            SmolLM2-135M in bf16 made a one-token forward cost 2.5x the engine's (`benchmarks/results/profile-layout/`).

    Returns:
        `dict[int, list[float]]`: the `repeats` timings of each size.
    """
    if context_length < 1 or batch_size < 1 or repeats < 1 or warmup < 0 or any(k < 1 for k in num_tokens):
        raise ValueError(
            f"Need context_length, batch_size, repeats >= 1, warmup >= 0 and sizes >= 1; got {context_length}, "
            f"{batch_size}, {repeats}, {warmup}, {list(num_tokens)}."
        )
    device = model.device
    vocab_size = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(seed)
    context = torch.randint(vocab_size, (batch_size, context_length), generator=generator)
    forward_kwargs = forward_kwargs or {}
    if engine_layout:
        from .generation.batched import engine_forward
        from .generation.cache_ops import slot_cache

        cache = slot_cache(model.config)
        slots = torch.ones(batch_size, context_length, dtype=torch.bool, device=device)
        slots[:, 0] = False  # a padding slot: the engine's rows are left-padded to a shared slot axis

        def forward(ids):
            width, start = ids.shape[1], cache.get_seq_length()
            mask = torch.cat([slots, slots.new_ones(batch_size, width)], dim=1)[:, : start + width]
            positions = torch.arange(start, start + width, device=device).expand(batch_size, width)
            return engine_forward(model, ids, mask, positions, cache, **forward_kwargs)
    else:
        cache = DynamicCache(config=model.config)
        cache_argument = _transformers_compat.cache_argument(model)

        def forward(ids):
            return model(input_ids=ids, use_cache=True, **{cache_argument: cache}, **forward_kwargs)
    forward(context.to(device))
    timings = {k: [] for k in num_tokens}
    for round_index in range(warmup + repeats):
        for k in num_tokens:
            new_tokens = torch.randint(vocab_size, (batch_size, k), generator=generator).to(device)
            _synchronize(device)
            start = timer()
            forward(new_tokens)
            _synchronize(device)
            elapsed = timer() - start
            cache.crop(-k)  # drop the verified tokens again, as a rejected draft block would be
            if on_forward is not None:
                on_forward()
            if round_index >= warmup:
                timings[k].append(elapsed)
    return timings


def machine_metadata(device: torch.device | str = "cpu") -> dict:
    """What the profile is only valid for: device, processor, thread count and library versions."""
    device = torch.device(device)
    cpu = cpuinfo("model name") or platform.processor() or platform.machine()
    try:
        version = importlib.metadata.version("dspark-hf")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dspark_hf": version,
    }


def profile_steps_per_second(
    model: torch.nn.Module,
    max_tokens: int = 16,
    batch_sizes: Sequence[int] = (1,),
    context_length: int = 256,
    warmup: int = 2,
    repeats: int = 5,
    timer: Callable[[], float] = time.perf_counter,
    forward_kwargs: dict | None = None,
    progress: bool | None = None,
) -> dict:
    """Profiles ``SPS`` for every forward size ``1..max_tokens`` (tokens per row) and every batch size.

    Returns:
        `dict`: the profile (JSON-ready): ``steps_per_second`` (batch 1, or the smallest batch size profiled) maps
        ``"k"`` to the median steps/s, ``by_batch_size`` maps ``"rows"`` to such a table, ``seconds`` holds the raw
        timings, ``settings`` and ``metadata`` describe the run. Save it with [`save_profile`].
    """
    if max_tokens < 1 or not batch_sizes:
        raise ValueError(f"Need max_tokens >= 1 and at least one batch size, got {max_tokens} and {list(batch_sizes)}.")
    sizes = list(range(1, max_tokens + 1))
    by_batch_size, seconds = {}, {}
    all_rows = sorted(set(int(b) for b in batch_sizes))
    # progress=None: a bar on terminals only (tqdm's own check), so logs and tests stay quiet
    bar = tqdm(total=len(all_rows) * (warmup + repeats) * len(sizes), desc="profiling forwards", unit="fwd",
               disable=None if progress is None else not progress, leave=False)
    for rows in all_rows:
        timings = time_verification_forwards(
            model, sizes, rows, context_length, warmup, repeats, timer, forward_kwargs=forward_kwargs,
            on_forward=bar.update, engine_layout=rows > 1,
        )
        seconds[str(rows)] = {str(k): t for k, t in timings.items()}
        by_batch_size[str(rows)] = {str(k): 1.0 / statistics.median(t) for k, t in timings.items()}
    bar.close()
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "steps_per_second": next(iter(by_batch_size.values())),
        "by_batch_size": by_batch_size,
        "seconds": seconds,
        "settings": {
            "target": getattr(model, "name_or_path", None) or type(model).__name__,
            "dtype": str(getattr(model, "dtype", None)),
            "packed_linear": is_packed(model),
            "max_tokens": max_tokens,
            "batch_sizes": [int(b) for b in by_batch_size],
            "context_length": context_length,
            "warmup": warmup,
            "repeats": repeats,
            "statistic": "median",
            "forward_kwargs": forward_kwargs or {},
            # one row timed as `generate` runs it, several as the batched engine does (`time_verification_forwards`)
            "batched_layout": BATCHED_LAYOUT,
        },
        "metadata": {
            **machine_metadata(model.device),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
    }


def _profile_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path / PROFILE_FILE_NAME if path.is_dir() else path


def save_profile(profile: dict, path: str | os.PathLike) -> Path:
    """Writes `profile` as JSON to `path` (a file, or a folder such as the drafter's, which gets
    `dspark_sps_profile.json`) and returns the file written."""
    path = _profile_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2) + "\n")
    return path


_WARNED_PROFILES: set[str] = set()


def profile_mismatches(metadata: dict) -> list[str]:
    """How the machine a profile was measured on differs from this one (processor, cores, threads, GPU, and the torch
    build, which may bring other kernels)."""
    on_gpu = metadata.get("device", "cpu").startswith("cuda")
    here = machine_metadata("cuda" if on_gpu and torch.cuda.is_available() else "cpu")
    keys = ["device_name", "cpu_count", "torch"]
    if not on_gpu:
        keys.append("torch_num_threads")  # CPU speed scales with the threads torch uses
    return [f"{key} {metadata[key]!r} there, {here[key]!r} here" for key in keys
            if key in metadata and metadata[key] != here[key]]


def warn_if_profiled_elsewhere(metadata: dict, path: str | os.PathLike) -> None:
    """Warns (once per file) when a profile was measured on another kind of machine: its speeds, and so the
    hardware-aware schedule, may not hold here. Output stays lossless either way; only the speed is at stake."""
    differences = profile_mismatches(metadata)
    if differences and str(path) not in _WARNED_PROFILES:
        _WARNED_PROFILES.add(str(path))
        logger.warning(
            f"The steps-per-second profile {path} was measured on another machine ({'; '.join(differences)}). "
            "The hardware-aware policy will schedule for that machine's speeds; profile this one with "
            "`dspark-hf profile --target TARGET --drafter DRAFTER_DIR --output PROFILE.json`, or leave "
            "drafter.verification_policy at its default 'auto', which measures this machine on first use."
        )


def _profile_fits(profile: dict, target: torch.nn.Module, max_tokens: int, batch_sizes: Sequence[int] = (1,)) -> bool:
    """Whether a saved profile was measured on this kind of machine, in the target's dtype, up to `max_tokens`, at
    every batch size of `batch_sizes`."""
    settings = profile.get("settings") or {}
    return (
        profile.get("format") == PROFILE_FORMAT
        and not profile_mismatches(profile.get("metadata") or {})
        and settings.get("dtype") == str(target.dtype)
        and bool(settings.get("packed_linear", False)) == is_packed(target)
        and int(settings.get("max_tokens", 0)) >= max_tokens
        and {str(int(b)) for b in batch_sizes} <= set(profile.get("by_batch_size") or {"1": None})
        and (all(int(b) == 1 for b in batch_sizes) or settings.get("batched_layout") == BATCHED_LAYOUT)
    )


def _cached_profile_path(target: torch.nn.Module, max_tokens: int, forward_kwargs: dict,
                         batch_sizes: Sequence[int] = (1,)) -> Path:
    """Where a profile measured on first use is kept: the dspark-hf cache folder, keyed by what the speed depends
    on (the target's architecture, dtype and device, this machine and its torch build), not by the weights."""
    from .models import cache_dir

    architecture = {k: v for k, v in target.config.to_dict().items()
                    if not k.startswith("_") and k not in ("transformers_version", "name_or_path")}
    here = machine_metadata(target.device)
    key = json.dumps({
        "architecture": architecture, "dtype": str(target.dtype), "max_tokens": max_tokens,
        **({"packed_linear": True} if is_packed(target) else {}),
        "forward_kwargs": forward_kwargs,
        "machine": {k: here[k] for k in ("device", "device_name", "cpu_count", "torch_num_threads", "torch")},
        **({"batch_sizes": sorted(set(int(b) for b in batch_sizes)), "batched_layout": BATCHED_LAYOUT}
           if list(batch_sizes) != [1] else {}),
    }, sort_keys=True, default=str)
    return cache_dir() / "profiles" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def steps_per_second_here(target: torch.nn.Module, drafter, batch_sizes: Sequence[int] = (1,)
                          ) -> tuple[dict[int, float], Path]:
    """The target's steps/s table for this machine, and the file it came from (whose `by_batch_size` covers
    `batch_sizes`: `bench-load` asks for its concurrency levels).

    The drafter folder's profile (`dspark_sps_profile.json`) is used when it was measured on this kind of machine
    (processor, cores, threads, torch build) in the target's dtype, up to a full block; else a profile measured here
    earlier (cached in the dspark-hf cache folder); else one is measured now, at batch 1 up to a full block and at
    least `FIRST_USE_MAX_TOKENS` tokens (prompt lookup inside rounds verifies up to `prompt_lookup_num_tokens` drafts,
    never more than the profile covers; a few seconds for a small target on a CPU), and cached. Nothing is written
    into the drafter's folder, which may be an installed package.
    """
    max_tokens = max(drafter.config.block_size + 1, FIRST_USE_MAX_TOKENS)
    forward_kwargs = {
        "output_hidden_states": _transformers_compat.hidden_states_request(drafter.config.hidden_state_indices)
    }
    batch_sizes = sorted({1, *(int(b) for b in batch_sizes)})
    cached = _cached_profile_path(target, max_tokens, forward_kwargs, batch_sizes)
    folder = Path(drafter.name_or_path) if drafter.name_or_path else None
    candidates = [(cached, max_tokens)]
    if folder is not None:
        candidates.insert(0, (folder / PROFILE_FILE_NAME, drafter.config.block_size + 1))
    for path, needed in candidates:
        if path.is_file():
            profile = json.loads(path.read_text())
            if _profile_fits(profile, target, needed, batch_sizes):
                return {int(k): float(v) for k, v in profile["steps_per_second"].items()}, path
    logger.warning(
        f"dspark-hf: measuring this machine's verification speed for the hardware-aware policy (once per target, "
        f"dtype and machine; cached in {cached.parent})..."
    )
    start = time.perf_counter()
    profile = profile_steps_per_second(target, max_tokens, batch_sizes=batch_sizes, context_length=256, warmup=1,
                                       repeats=3, forward_kwargs=forward_kwargs)
    save_profile(profile, cached)
    logger.warning(f"dspark-hf: measured in {time.perf_counter() - start:.1f} s.")
    return {int(k): float(v) for k, v in profile["steps_per_second"].items()}, cached


def profile_dtype_mismatch(path: str | os.PathLike, dtype: torch.dtype, packed: bool | None = None) -> str | None:
    """Why the profile at `path` does not fit a target running in `dtype` (the speeds of bf16 and float32 forwards
    differ, and so do the schedules planned from them) with its linear weights packed or not (`packed`, when given:
    packed verification forwards cost about one decode step where unpacked float32 ones cost up to 2), or `None` when
    it fits or records no dtype (a hand-written table)."""
    path = _profile_path(path)
    data = json.loads(path.read_text()) if path.is_file() else None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        return None
    settings = data.get("settings") or {}
    measured = str(settings.get("dtype", "")).removeprefix("torch.")
    wanted = str(dtype).removeprefix("torch.")
    if measured and measured != wanted:
        return (f"the speed profile {path} was measured with the target in {measured}, but the target runs in "
                f"{wanted}; profile it in {wanted} (`dspark-hf profile --target_dtype {wanted} --output PROFILE.json`) "
                f"or run the target in {measured} (--target_dtype {measured})")
    was_packed = bool(settings.get("packed_linear", False))
    if measured and packed is not None and was_packed != packed:
        state = {True: "packed", False: "not packed"}
        return (f"the speed profile {path} was measured with the target's linear weights {state[was_packed]}, but "
                f"they are {state[packed]} here; profile it so (`dspark-hf profile --packed_linear "
                f"{'on' if packed else 'off'} --output PROFILE.json`) or pass --packed_linear "
                f"{'on' if was_packed else 'off'}")
    return None


def load_steps_per_second(path: str | os.PathLike, batch_size: int = 1) -> dict[int, float]:
    """The ``{num_tokens: steps_per_second}`` table of a saved profile, for forwards of `batch_size` rows.

    Args:
        path (`str` or `os.PathLike`): a profile written by `dspark-hf profile`, the folder holding one
            (`dspark_sps_profile.json`), or a hand-written JSON table (``{"1": 12.5, "2": 5.1, ...}`` or a list whose
            entry i is the speed at i + 1 tokens).
        batch_size (`int`, defaults to 1): which profiled batch size to read.
    """
    path = _profile_path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"No steps-per-second profile at {path}; create one with `dspark-hf profile --output {path}`."
        )
    data = json.loads(path.read_text())
    if isinstance(data, list):
        return {i + 1: float(v) for i, v in enumerate(data)}
    if data.get("format") != PROFILE_FORMAT:
        try:
            return {int(k): float(v) for k, v in data.items()}
        except (TypeError, ValueError):
            raise ValueError(
                f"{path} is neither a `dspark-hf profile` file nor a {{num_tokens: steps/s}} table."
            ) from None
    warn_if_profiled_elsewhere(data.get("metadata") or {}, path)
    tables = data["by_batch_size"]
    if str(batch_size) not in tables:
        raise ValueError(
            f"{path} has no profile for batch size {batch_size} (it has {sorted(map(int, tables))}); rerun "
            f"`dspark-hf profile --batch_sizes ... {batch_size}`."
        )
    return {int(k): float(v) for k, v in tables[str(batch_size)].items()}


def load_speed_tables(path: str | os.PathLike) -> dict[int, dict[int, float]]:
    """Every ``{num_tokens: steps_per_second}`` table of a `dspark-hf profile` file, by batch size (the form
    `DSparkBatchEngine(steps_per_second_by_rows=...)` and the simulator take)."""
    data = json.loads(_profile_path(path).read_text())
    if not isinstance(data, dict) or "by_batch_size" not in data:
        raise ValueError(f"{path} is not a `dspark-hf profile` file (no by_batch_size tables); profile with "
                         f"`dspark-hf profile --batch_sizes 1 2 4 ... --output {path}`.")
    tables = {int(rows): {int(k): float(v) for k, v in table.items()} for rows, table in data["by_batch_size"].items()}
    if any(rows > 1 for rows in tables) and (data.get("settings") or {}).get("batched_layout") != BATCHED_LAYOUT:
        logger.warning_once(
            f"The profile {path} timed its batches of several rows as one sequence is timed, which on CPUs costs up to "
            f"2.5x what the batched engine's forwards cost; re-profile with `dspark-hf profile --batch_sizes ...` for "
            f"plans that fit the engine."
        )
    return tables


@dataclass
class ProfileArguments:
    target: str = field(
        default="smollm2-135m-instruct", metadata={"help": "target model: embedded name, Hub id or local folder"}
    )
    drafter: str | None = field(
        default=None, metadata={"help": f"drafter folder to save the profile in (as {PROFILE_FILE_NAME})"}
    )
    output: str | None = field(
        default=None,
        metadata={"help": f"profile file or folder (default: the drafter folder, else ./{PROFILE_FILE_NAME})"},
    )
    max_tokens: int = field(default=16, metadata={"help": "profile forwards of 1..max_tokens tokens per row"})
    batch_sizes: list[int] = field(default_factory=lambda: [1], metadata={"help": "rows per forward to profile"})
    context_length: int = field(default=256, metadata={"help": "tokens already in the cache during each forward"})
    warmup: int = field(default=2, metadata={"help": "untimed rounds over all sizes"})
    repeats: int = field(default=5, metadata={"help": "timed rounds over all sizes (the median is kept)"})
    device: str | None = field(default=None, metadata={"help": "cuda, cpu, ... (default: cuda if available)"})
    target_dtype: str = field(
        default="auto",
        metadata={"aliases": ["--dtype"], "help": "target dtype: auto (bfloat16 where the device computes it natively, "
                  "else float32), float32, bfloat16, float16; the profile records it, and only a profile of the "
                  "target's dtype is used"},
    )
    packed_linear: str = field(
        default="auto",
        metadata={"choices": list(PACKED_LINEAR_MODES), "help": "read the target's linear weights packed for oneDNN: "
                  "auto (where this CPU runs them faster), on, off; the profile records it, and only a profile of the "
                  "same setting is used"},
    )


def _print_table(profile: dict) -> None:
    for rows, table in profile["by_batch_size"].items():
        decode = table["1"]
        print(f"batch {rows}: tokens/row  ms/forward  steps/s  cost vs 1 token")
        for k, speed in table.items():
            print(f"        {int(k):>10}  {1000.0 / speed:>10.2f}  {speed:>7.2f}  {decode / speed:>6.2f}x")


def _drafter_forward_kwargs(drafter_dir: str | None) -> dict:
    """The hidden-state request a DSpark verification forward carries, read from the drafter's config.json."""
    config_path = Path(drafter_dir) / "config.json" if drafter_dir else None
    if config_path is None or not config_path.is_file():
        return {}
    layer_ids = json.loads(config_path.read_text()).get("target_layer_ids") or []
    if not layer_ids:
        return {}
    return {"output_hidden_states": _transformers_compat.hidden_states_request(hidden_state_indices(layer_ids))}


def main(argv: list[str] | None = None) -> int:
    from .cli import dataclass_parser

    parser = dataclass_parser(ProfileArguments, "profile", description=__doc__.split("\n\n")[0])
    (args,) = parser.parse_args_into_dataclasses(args=argv if argv is not None else sys.argv[1:])
    from transformers import AutoModelForCausalLM

    from .models import check_model_path, resolve_target_path, target_dtype

    if args.drafter is not None:
        check_model_path(args.drafter)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = target_dtype(args.target_dtype, device)
    model = AutoModelForCausalLM.from_pretrained(resolve_target_path(args.target), dtype=dtype).to(device).eval()
    pack_linear_weights(model, args.packed_linear)
    profile = profile_steps_per_second(
        model, args.max_tokens, args.batch_sizes, args.context_length, args.warmup, args.repeats,
        forward_kwargs=_drafter_forward_kwargs(args.drafter),
    )
    profile["settings"]["target"] = args.target
    profile["metadata"]["command"] = ["dspark-hf", "profile", *(argv if argv is not None else sys.argv[1:])]
    path = save_profile(profile, args.output or args.drafter or PROFILE_FILE_NAME)
    _print_table(profile)
    packed = "packed" if is_packed(model) else "unpacked"
    print(f"saved {path} (target in {str(dtype).removeprefix('torch.')}, linear weights {packed})")
    return 0
