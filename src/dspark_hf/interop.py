"""Interoperability with the official DSpark tooling (DeepSpec, vLLM, SGLang).

- **The checkpoint spec as data**: [`expected_tensor_shapes`] and [`config_problems`] encode the tables of
  ``docs/design.md``, "Checkpoint layout"; [`check_checkpoint`] checks a saved folder against them (exact tensor
  names, shapes and dtypes, required / conditional / forbidden config keys) without loading any weights.
- **vLLM weight names**: [`to_vllm_state_dict`] renames and fuses a drafter state dict the way vLLM's
  ``qwen3_dspark.py`` / ``gemma4_dspark.py`` ``load_weights`` do (``model.`` prefix except ``lm_head``, ``q/k/v_proj``
  stacked into ``qkv_proj`` for Qwen3, ``gate/up_proj`` into ``gate_up_proj``).

Synthetic checkpoints in this layout, for tests, are in [`dspark_hf.testing`].

Example:

```python
>>> from dspark_hf import interop
>>> interop.check_checkpoint("path/to/drafter")  # doctest: +SKIP
[]
```
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .configuration_dspark import MARKOV_HEAD_TYPES, hidden_state_indices
from .registry import DRAFTER_ARCHITECTURES, architectures_of
from .registry import drafter_family as drafter_variant


_REQUIRED_KEYS = (
    "architectures", "model_type", "num_hidden_layers", "num_target_layers", "layer_types", "tie_word_embeddings",
    "block_size", "mask_token_id", "target_layer_ids", "num_anchors", "enable_confidence_head", "markov_rank",
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "attention_bias", "attention_dropout", "rope_parameters", "max_position_embeddings", "vocab_size", "dtype",
)  # fmt: skip
_REQUIRED_BY_VARIANT = {
    "qwen3": ("hidden_act",),
    "gemma4": (
        "hidden_activation", "target_model_type", "target_text_model_type", "global_head_dim",
        "num_global_key_value_heads", "attention_k_eq_v", "final_logit_softcapping", "enable_moe_block",
        "hidden_size_per_layer_input",
    ),
}  # fmt: skip
# Keys the official files never carry: v4 spellings, runtime-only state, transformers >= 5.2x internals.
_FORBIDDEN_KEYS = {
    "_attn_implementation": "runtime-only; DeepSpec does not serialize it",
    "rope_theta": "v4 spelling; write rope_parameters",
    "torch_dtype": "v4 spelling; write dtype",
    "per_layer_config": "transformers >= 5.2x internal; write global_head_dim / num_global_key_value_heads",
}
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
# Integer / boolean tensors of a reduced draft vocabulary; the config's dtype is about the float weights.
_INDEX_TENSORS = ("d2t", "t2d")


def _attention_shape(config: Mapping[str, Any]) -> tuple[int, int, int, bool]:
    """``(heads, kv_heads, head_dim, has_v_proj)`` of the draft layers (Gemma4 uses the global attention shape)."""
    heads = config["num_attention_heads"]
    if drafter_variant(config) == "gemma4":
        k_eq_v = bool(config.get("attention_k_eq_v"))
        kv_heads = config["num_global_key_value_heads"] if k_eq_v else config["num_key_value_heads"]
        return heads, kv_heads, config["global_head_dim"], not k_eq_v
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return heads, config["num_key_value_heads"], head_dim, True


def expected_tensor_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint in the official layout, with its shape (docs/design.md, "Checkpoint layout").

    Args:
        config (`Mapping`): the drafter's ``config.json`` as a dict (or ``PreTrainedConfig.to_dict()``).

    Returns:
        `dict[str, tuple[int, ...]]`: tensor name -> shape, e.g. ``{"fc.weight": (d, m * d), ...}``.
    """
    vocab, hidden, inter = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim, has_v_proj = _attention_shape(config)
    rank = config.get("markov_rank") or 0
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (vocab, hidden),
        "fc.weight": (hidden, len(config["target_layer_ids"]) * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
        "lm_head.weight": (config.get("draft_vocab_size") or vocab, hidden),
    }
    if config.get("draft_vocab_size"):  # reduced draft vocabulary (EAGLE-3 / vLLM convention)
        shapes["d2t"] = (config["draft_vocab_size"],)
        shapes["t2d"] = (vocab,)
    projections = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim}
    if has_v_proj:
        projections["v_proj"] = kv_heads * head_dim
    sandwich_norms = drafter_variant(config) == "gemma4"
    for i in range(config["num_hidden_layers"]):
        layer = f"layers.{i}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        if sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
            shapes[layer + "layer_scalar"] = (1,)
        shapes.update({f"{layer}{name}.weight": (hidden,) for name in norms})
        for name, rows in projections.items():
            shapes[f"{layer}self_attn.{name}.weight"] = (rows, hidden)
            if config.get("attention_bias"):
                shapes[f"{layer}self_attn.{name}.bias"] = (rows,)
        shapes[f"{layer}self_attn.o_proj.weight"] = (hidden, heads * head_dim)
        if config.get("attention_bias"):
            shapes[f"{layer}self_attn.o_proj.bias"] = (hidden,)
        shapes[f"{layer}self_attn.q_norm.weight"] = (head_dim,)
        shapes[f"{layer}self_attn.k_norm.weight"] = (head_dim,)
        shapes.update({f"{layer}mlp.{name}.weight": (inter, hidden) for name in ("gate_proj", "up_proj")})
        shapes[f"{layer}mlp.down_proj.weight"] = (hidden, inter)
    shapes.update(_head_shapes(config, vocab, hidden, rank))
    return shapes


def _head_shapes(config: Mapping[str, Any], vocab: int, hidden: int, rank: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    if rank > 0:
        shapes["markov_head.markov_w1.weight"] = (vocab, rank)
        shapes["markov_head.markov_w2.weight"] = (config.get("draft_vocab_size") or vocab, rank)
        head_type = config.get("markov_head_type", "vanilla")
        if head_type == "gated":
            shapes["markov_head.gate_proj.weight"] = (rank, hidden + rank)
            shapes["markov_head.gate_proj.bias"] = (rank,)
        elif head_type == "rnn":
            shapes["markov_head.joint_proj.weight"] = (3 * rank, 2 * rank + hidden)
            shapes["markov_head.joint_proj.bias"] = (3 * rank,)
    if config.get("enable_confidence_head"):
        with_markov = bool(config.get("confidence_head_with_markov")) and rank > 0
        shapes["confidence_head.proj.weight"] = (1, hidden + (rank if with_markov else 0))
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def config_problems(config: Mapping[str, Any], *, for_vllm: bool = False) -> list[str]:
    """What in a drafter ``config.json`` dict departs from the official layout (docs/design.md, "Checkpoint layout");
    empty if nothing.

    Args:
        config (`Mapping`): the parsed ``config.json``.
        for_vllm (`bool`, *optional*): also require what vLLM/SGLang need (a vanilla Markov head).
    """
    try:
        variant = drafter_variant(config)
    except ValueError as error:
        return [str(error)]
    architecture = architectures_of(variant)[0]
    model_type = DRAFTER_ARCHITECTURES[architecture].model_type
    required = (*_REQUIRED_KEYS, *_REQUIRED_BY_VARIANT[variant])
    problems = [f"missing key {key!r}" for key in required if key not in config]
    problems += [f"key {key!r} must not be written ({why})" for key, why in _FORBIDDEN_KEYS.items() if key in config]
    problems += _conditional_key_problems(config)
    expected_values = {
        "architectures": [architecture],
        "model_type": model_type,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * config.get("num_hidden_layers", 0),
    }
    if variant == "gemma4":
        expected_values.update(enable_moe_block=False, hidden_size_per_layer_input=0)
    problems += [
        f"{key}={config[key]!r}, expected {value!r}"
        for key, value in expected_values.items()
        if key in config and config[key] != value
    ]
    problems += _value_problems(config)
    if for_vllm and config.get("markov_rank", 0) > 0 and config.get("markov_head_type") != "vanilla":
        problems.append(f"markov_head_type={config.get('markov_head_type')!r}: vLLM and SGLang serve 'vanilla' only")
    return problems


def _conditional_key_problems(config: Mapping[str, Any]) -> list[str]:
    problems = []
    has_markov = (config.get("markov_rank") or 0) > 0
    if has_markov != ("markov_head_type" in config):
        problems.append(
            f"markov_head_type must be written iff markov_rank > 0 (markov_rank={config.get('markov_rank')}, "
            f"markov_head_type {'present' if 'markov_head_type' in config else 'absent'})"
        )
    has_confidence = bool(config.get("enable_confidence_head"))
    if has_confidence != ("confidence_head_with_markov" in config):
        problems.append(
            "confidence_head_with_markov must be written iff enable_confidence_head is true "
            f"(enable_confidence_head={config.get('enable_confidence_head')})"
        )
    ids = config.get("target_layer_ids") or []
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux is not None and list(aux) != hidden_state_indices(ids):
        problems.append(f"eagle_aux_hidden_state_layer_ids={aux} overrides vLLM's target_layer_ids + 1 ({ids})")
    return problems


def _value_problems(config: Mapping[str, Any]) -> list[str]:
    problems = []
    vocab, mask = config.get("vocab_size"), config.get("mask_token_id")
    if isinstance(vocab, int) and not (isinstance(mask, int) and 0 <= mask < vocab):
        problems.append(f"mask_token_id={mask!r} must be an id in [0, vocab_size={vocab})")
    ids, num_target = list(config.get("target_layer_ids") or []), config.get("num_target_layers")
    if not ids or any(b <= a for a, b in zip(ids, ids[1:], strict=False)) or ids[0] < -1:
        problems.append(f"target_layer_ids={ids} must be a non-empty, strictly increasing list of ids >= -1")
    elif isinstance(num_target, int) and ids[-1] > num_target - 2:
        problems.append(f"target_layer_ids={ids} uses layer {ids[-1]}; the last usable one is {num_target - 2}")
    head_type = config.get("markov_head_type", "vanilla")
    if head_type not in MARKOV_HEAD_TYPES:
        problems.append(f"markov_head_type={head_type!r} is not one of {MARKOV_HEAD_TYPES}")
    return problems


def read_tensor_headers(checkpoint: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, safetensors dtype such as ``"BF16"``) of a folder's safetensors, sharded or not.

    Reads headers only; no tensor data is loaded.
    """
    folder = Path(checkpoint)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json.")
    headers = {}
    for file in files:
        with safe_open(folder / file, framework="pt") as handle:
            for name in handle.keys():
                tensor_slice = handle.get_slice(name)
                headers[name] = (tuple(tensor_slice.get_shape()), tensor_slice.get_dtype())
    return headers


def check_checkpoint(checkpoint: str | Path, *, for_vllm: bool = False) -> list[str]:
    """Checks a saved drafter folder against the official layout; returns the problems (empty when conformant).

    Checks the config keys (section 1), the exact set of tensor names, their shapes, and that every tensor has the
    config's ``dtype`` (the official files are bf16 throughout, confidence head included).

    Args:
        checkpoint (`str` or `Path`): a folder with ``config.json`` and (sharded) safetensors.
        for_vllm (`bool`, *optional*): also require what vLLM/SGLang need (see [`config_problems`]).
    """
    folder = Path(checkpoint)
    config = json.loads((folder / "config.json").read_text())
    problems = config_problems(config, for_vllm=for_vllm)
    try:
        expected = expected_tensor_shapes(config)
    except (KeyError, ValueError, TypeError) as error:
        return problems + [f"cannot derive the tensor table from config.json: {error!r}"]
    found = read_tensor_headers(folder)
    for name in ("embed_tokens.weight", "lm_head.weight"):
        if name not in found:
            problems.append(f"{name} is missing: DeepSpec's evaluator and SGLang use the drafter's own copy")
    problems += [f"missing tensor {name}" for name in sorted(set(expected) - set(found))]
    problems += [f"unexpected tensor {name}" for name in sorted(set(found) - set(expected))]
    want_dtype = _SAFETENSORS_DTYPES.get(str(config.get("dtype")))
    for name in sorted(set(expected) & set(found)):
        shape, dtype = found[name]
        if shape != expected[name]:
            problems.append(f"{name} has shape {list(shape)}, expected {list(expected[name])}")
        if want_dtype is not None and dtype != want_dtype and name not in _INDEX_TENSORS:
            problems.append(f"{name} is {dtype}, but config.json says dtype={config.get('dtype')!r}")
    return problems


def assert_conforms(checkpoint: str | Path, *, for_vllm: bool = False) -> None:
    """Raises `ValueError` listing every departure of `checkpoint` from the official layout."""
    problems = check_checkpoint(checkpoint, for_vllm=for_vllm)
    if problems:
        listed = "\n  - ".join(problems)
        raise ValueError(
            f"{checkpoint} does not follow the official DSpark checkpoint layout, so DeepSpec / vLLM / SGLang may not "
            f"load it:\n  - {listed}\nSave the drafter with `save_pretrained` from dspark-hf."
        )


# --- vLLM weight names -------------------------------------------------------------------------------------------

# Suffix -> (fused suffix, position in the fused tensor); vLLM's `orig_to_new_stacked` / `stacked` tables.
_VLLM_STACKED = {
    "qwen3": {
        ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
        ".self_attn.k_proj.": (".self_attn.qkv_proj.", 1),
        ".self_attn.v_proj.": (".self_attn.qkv_proj.", 2),
        ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
        ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
    },
    "gemma4": {".mlp.gate_proj.": (".mlp.gate_up_proj.", 0), ".mlp.up_proj.": (".mlp.gate_up_proj.", 1)},
}


def vllm_name(name: str) -> str:
    """vLLM's name for one checkpoint tensor before fusing: ``model.`` + name, except names containing ``lm_head``."""
    return name if "lm_head" in name else "model." + name


def to_vllm_state_dict(state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Renames and fuses a drafter state dict into the parameters vLLM's DSpark model holds after ``load_weights``.

    Qwen3 (``qwen3_dspark.py`` over ``qwen3_dflash.py``): q/k/v are concatenated (in that order, along the output
    dim) into ``qkv_proj``. Both variants: gate/up into ``gate_up_proj``; ``model.`` prefix except ``lm_head``.
    Gemma4 (``gemma4_dspark.py``): q/k/v stay separate and the confidence head is not loaded. A reduced draft
    vocabulary's ``d2t`` becomes ``draft_id_to_target_id``; ``t2d`` is not loaded.

    Args:
        state_dict (`Mapping[str, torch.Tensor]`): official-layout names (``drafter.state_dict()``).
        config (`Mapping`): the drafter's config dict.
    """
    variant = drafter_variant(config)
    if (config.get("markov_rank") or 0) > 0 and config.get("markov_head_type", "vanilla") != "vanilla":
        raise ValueError(
            f"vLLM serves only the vanilla Markov head; this drafter has markov_head_type="
            f"{config.get('markov_head_type')!r}. Train with markov_head_type='vanilla' to serve it with vLLM."
        )
    mapped: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state_dict.items():
        if (variant == "gemma4" and name.startswith("confidence_head.")) or name == "t2d":
            continue
        if name == "d2t":  # reduced draft vocabulary: vLLM keeps the offsets under this name
            mapped["draft_id_to_target_id"] = tensor
            continue
        target = vllm_name(name)
        for suffix, (fused_suffix, position) in _VLLM_STACKED[variant].items():
            if suffix in target:
                parts.setdefault(target.replace(suffix, fused_suffix), {})[position] = tensor
                break
        else:
            mapped[target] = tensor
    for fused_name, pieces in parts.items():
        expected_count = 3 if ".qkv_proj." in fused_name else 2
        if sorted(pieces) != list(range(expected_count)):
            raise ValueError(f"Cannot build {fused_name}: got parts {sorted(pieces)} of {expected_count}.")
        mapped[fused_name] = torch.cat([pieces[i] for i in range(expected_count)], dim=0)
    return mapped


__all__ = [
    "expected_tensor_shapes",
    "config_problems",
    "read_tensor_headers",
    "check_checkpoint",
    "assert_conforms",
    "drafter_variant",
    "vllm_name",
    "to_vllm_state_dict",
]
