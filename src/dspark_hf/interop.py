"""Interoperability with the official DSpark tooling (DeepSpec, vLLM, SGLang).

- **The checkpoint spec as data**: [`expected_tensor_shapes`] and [`config_problems`] encode the tables of
  ``dspark-checkpoint-spec.md`` sections 1-2; [`check_checkpoint`] checks a saved folder against them (exact tensor
  names, shapes and dtypes, required / conditional / forbidden config keys) without loading any weights.
- **vLLM weight names**: [`to_vllm_state_dict`] renames and fuses a drafter state dict the way vLLM's
  ``qwen3_dspark.py`` / ``gemma4_dspark.py`` ``load_weights`` do (``model.`` prefix except ``lm_head``, ``q/k/v_proj``
  stacked into ``qkv_proj`` for Qwen3, ``gate/up_proj`` into ``gate_up_proj``).
- **Synthetic official checkpoints**: [`write_synthetic_checkpoint`] writes ``config.json`` and safetensors by hand,
  in DeepSpec's layout and key set (scaled-down Qwen3-4B or Gemma4-12B shapes), so loaders can be tested offline;
  [`synthetic_target`] builds a tiny random target those drafters can serve.

Example:

```python
>>> from dspark_hf import interop
>>> path = interop.write_synthetic_checkpoint("/tmp/dspark-qwen3", variant="qwen3")  # doctest: +SKIP
>>> interop.check_checkpoint(path)  # doctest: +SKIP
[]
```
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .configuration_dspark import MARKOV_HEAD_TYPES
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
    """Every tensor of a checkpoint in the official layout, with its shape (spec section 2).

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
    """What in a drafter ``config.json`` dict departs from the official layout (spec section 1); empty if nothing.

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
    if aux is not None and list(aux) != [i + 1 for i in ids]:
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


# --- synthetic checkpoints in DeepSpec's layout --------------------------------------------------------------------

# Scaled-down release shapes: Qwen3-4B (head_dim != hidden / heads, 5 of 36 target layers) and Gemma4-12B
# (sliding vs global head shapes, k_eq_v, soft-capping, 5 of 48 target layers).
SYNTHETIC_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3": dict(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_attention_heads=8, num_key_value_heads=2,
        head_dim=16, num_target_layers=12, target_layer_ids=[1, 3, 5, 7, 9], mask_token_id=290,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
    ),
    "gemma4": dict(
        vocab_size=300, hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, num_global_key_value_heads=1, num_target_layers=12,
        target_layer_ids=[1, 4, 7, 9, 10], mask_token_id=4, max_position_embeddings=4096, bos_token_id=2,
        eos_token_id=1, final_logit_softcapping=30.0, sliding_window=1024,
    ),
}  # fmt: skip


def synthetic_config(
    variant: str = "qwen3",
    *,
    num_hidden_layers: int = 2,
    block_size: int = 7,
    markov_rank: int = 8,
    markov_head_type: str = "vanilla",
    enable_confidence_head: bool = True,
    confidence_head_with_markov: bool = True,
    dflash: bool = False,
    dtype: str = "bfloat16",
    spelling: str = "v5",
    **overrides,
) -> dict[str, Any]:
    """A drafter ``config.json`` dict with the keys DeepSpec writes (transformers 5.10.2 ``save_pretrained`` of the
    target's config plus the DSpark keys), at the scaled-down shapes of [`SYNTHETIC_SHAPES`].

    Args:
        variant (`str`): ``"qwen3"`` or ``"gemma4"``.
        dflash (`bool`): a DFlash sibling: ``markov_rank=0``, no confidence head, no conditional keys.
        spelling (`str`): ``"v5"`` (``rope_parameters``, ``dtype``) or ``"v4"`` (``rope_theta``, ``torch_dtype``).
        overrides: any key, e.g. ``target_layer_ids=[0, 2]`` or ``attention_bias=True``.
    """
    if variant not in SYNTHETIC_SHAPES:
        raise ValueError(f"variant must be one of {sorted(SYNTHETIC_SHAPES)}, got {variant!r}.")
    shapes = dict(SYNTHETIC_SHAPES[variant])
    config = _qwen3_inherited_keys() if variant == "qwen3" else _gemma4_inherited_keys()
    config.update(shapes)
    config.update(
        architectures=[architectures_of(variant)[0]],
        num_hidden_layers=num_hidden_layers,
        layer_types=["full_attention"] * num_hidden_layers,
        tie_word_embeddings=False,
        block_size=block_size,
        num_anchors=512,
        enable_confidence_head=enable_confidence_head and not dflash,
        markov_rank=0 if dflash else markov_rank,
        dtype=dtype,
    )
    if config["markov_rank"] > 0:
        config["markov_head_type"] = markov_head_type
    if config["enable_confidence_head"]:
        config["confidence_head_with_markov"] = confidence_head_with_markov
    config.update(overrides)
    if spelling == "v4":
        config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
        config["torch_dtype"] = config.pop("dtype")
    elif spelling != "v5":
        raise ValueError(f"spelling must be 'v5' or 'v4', got {spelling!r}.")
    return dict(sorted(config.items()))


def _qwen3_inherited_keys() -> dict[str, Any]:
    """Keys the Qwen3 release inherits from the target config (values as in Qwen3-4B's config.json)."""
    return {
        "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
        "initializer_range": 0.02, "max_window_layers": 36, "pad_token_id": None, "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "sliding_window": None,
        "transformers_version": "5.10.2", "use_cache": True, "use_sliding_window": False,
    }  # fmt: skip


def _gemma4_inherited_keys() -> dict[str, Any]:
    """Keys the Gemma4 release inherits or adds (as in ``deepseek-ai/dspark_gemma4_12b_block7``'s config.json)."""
    return {
        "model_type": "gemma4_text", "attention_bias": False, "attention_dropout": 0.0, "attention_k_eq_v": True,
        "enable_moe_block": False, "hidden_activation": "gelu_pytorch_tanh", "hidden_size_per_layer_input": 0,
        "initializer_range": 0.02, "moe_intermediate_size": None, "num_experts": None, "num_kv_shared_layers": 0,
        "pad_token_id": 0, "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            "rope_theta": None,
            "rope_type": "default",
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "target_model_type": "gemma4_unified", "target_text_model_type": "gemma4_unified_text", "top_k_experts": None,
        "transformers_version": "5.10.2", "use_bidirectional_attention": "vision", "use_cache": True,
        "use_double_wide_mlp": False, "vocab_size_per_layer_input": 300,
    }  # fmt: skip


def synthetic_state_dict(
    config: Mapping[str, Any],
    *,
    seed: int = 0,
    target: torch.nn.Module | None = None,
    imitate_target: bool = False,
    wrong_after: Sequence[int] = (),
) -> dict[str, torch.Tensor]:
    """Random tensors for every name of [`expected_tensor_shapes`], in the config's dtype.

    ``layer_scalar`` is 1.0 as in the release. With `target`, ``embed_tokens``/``lm_head`` are copies of its input
    embedding and output head (as DeepSpec makes them), so the drafter passes `check_target`.

    Args:
        imitate_target (`bool`): with a ``synthetic_target(predictable=True)`` target, make the drafter draft exactly
            the target's greedy next token: its final ``norm`` is zeroed (base logits 0) and its Markov head is the
            target's bigram (``markov_w1`` = embedding, ``markov_w2`` = LM head, both on the first ``markov_rank``
            dims, the only non-zero ones of that target's embedding).
        wrong_after (`Sequence[int]`): tokens after which the imitating drafter drafts the target's *least* likely
            token instead, so that verification rejects some drafts.
    """
    dtype = getattr(torch, str(config.get("dtype", config.get("torch_dtype", "bfloat16"))))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_tensor_shapes(config).items():
        if name.endswith("layer_scalar"):
            value = torch.ones(shape)
        elif len(shape) == 1 and name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            value = 0.02 * torch.randn(shape, generator=generator)
        tensors[name] = value
    if target is not None:
        tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
        tensors["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()
    if imitate_target:
        tensors.update(_imitation_tensors(config, target, wrong_after))
    return {name: value.to(dtype) for name, value in tensors.items()}


def _imitation_tensors(config: Mapping[str, Any], target, wrong_after: Sequence[int]) -> dict[str, torch.Tensor]:
    rank = config.get("markov_rank") or 0
    embedding = None if target is None else target.get_input_embeddings().weight.detach()
    if embedding is None or rank == 0 or embedding[:, rank:].abs().sum() > 0:
        raise ValueError("imitate_target needs markov_rank > 0 and a synthetic_target(predictable=True) target.")
    markov_w1 = embedding[:, :rank].clone()
    markov_w1[list(wrong_after)] *= -1  # flips the bigram scores: argmax becomes the target's argmin
    return {
        "norm.weight": torch.zeros(config["hidden_size"]),
        "markov_head.markov_w1.weight": markov_w1,
        "markov_head.markov_w2.weight": target.get_output_embeddings().weight.detach()[:, :rank].clone(),
    }


def write_synthetic_checkpoint(
    save_directory: str | Path,
    config: Mapping[str, Any] | None = None,
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    num_shards: int = 1,
    seed: int = 0,
    target: torch.nn.Module | None = None,
    imitate_target: bool = False,
    wrong_after: Sequence[int] = (),
    **config_kwargs,
) -> Path:
    """Writes ``config.json`` and safetensors by hand, in the layout of the official releases.

    Args:
        save_directory (`str` or `Path`): created if needed.
        config (`Mapping`, *optional*): the config dict; defaults to ``synthetic_config(**config_kwargs)``.
        state_dict (`Mapping`, *optional*): defaults to ``synthetic_state_dict(config, seed=seed, target=target,
            imitate_target=imitate_target, wrong_after=wrong_after)``.
        num_shards (`int`): > 1 writes ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``.

    Returns:
        `Path`: the folder.
    """
    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(config) if config is not None else synthetic_config(**config_kwargs)
    if state_dict is None:
        state_dict = synthetic_state_dict(
            config, seed=seed, target=target, imitate_target=imitate_target, wrong_after=wrong_after
        )
    tensors = dict(state_dict)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if num_shards <= 1:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return folder
    names = sorted(tensors)
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = {name: tensors[name].contiguous() for name in names[shard::num_shards]}
        save_file(chunk, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder


def synthetic_target(
    variant: str = "qwen3", *, seed: int = 0, num_hidden_layers: int | None = None, predictable: bool = False
):
    """A tiny random target (``Qwen3ForCausalLM`` / ``Gemma4ForCausalLM``, eval mode, fp32) with the hidden size,
    vocabulary and depth that [`synthetic_config`] drafters of `variant` expect.

    Args:
        predictable (`bool`): make greedy decoding the bigram ``x -> (x + 1) % vocab_size`` (every ``o_proj`` and
            ``down_proj`` zeroed, so each layer passes its input through; the embedding non-zero on its first 8
            dims only). A drafter written with ``synthetic_state_dict(imitate_target=True)`` then drafts exactly
            what this target decodes.
    """
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig, Qwen3Config, Qwen3ForCausalLM

    shapes = SYNTHETIC_SHAPES[variant]
    common = {k: shapes[k] for k in ("vocab_size", "hidden_size", "num_key_value_heads", "head_dim", "bos_token_id",
                                     "eos_token_id", "max_position_embeddings")}  # fmt: skip
    common.update(
        num_hidden_layers=num_hidden_layers or shapes["num_target_layers"],
        num_attention_heads=4,
        intermediate_size=128,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if variant == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common)).eval()
    else:
        config = Gemma4TextConfig(
            **common,
            global_head_dim=shapes["global_head_dim"],
            num_global_key_value_heads=shapes["num_global_key_value_heads"],
            attention_k_eq_v=True,
            hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=shapes["vocab_size"],
            final_logit_softcapping=shapes["final_logit_softcapping"],
            sliding_window=8,
        )
        model = Gemma4ForCausalLM(config).eval()
    if predictable:
        _make_bigram(model, rank=8, seed=seed)
    return model


def _make_bigram(model, rank: int, seed: int) -> None:
    """Turns `model` into the bigram ``x -> (x + 1) % vocab``: layers pass their input through, token x embeds as a
    random unit code on the first `rank` dims, and the LM head row of x + 1 is x's code (the only maximum of the
    dot product, by Cauchy-Schwarz, with a margin that survives bf16)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                parameter.zero_()
        embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        codes = torch.nn.functional.normalize(torch.randn(embedding.shape[0], rank, generator=generator), dim=-1)
        embedding.zero_()
        embedding[:, :rank] = codes
        head[:, :rank] = codes.roll(1, dims=0)


__all__ = [
    "expected_tensor_shapes",
    "config_problems",
    "read_tensor_headers",
    "check_checkpoint",
    "assert_conforms",
    "drafter_variant",
    "vllm_name",
    "to_vllm_state_dict",
    "SYNTHETIC_SHAPES",
    "synthetic_config",
    "synthetic_state_dict",
    "write_synthetic_checkpoint",
    "synthetic_target",
]
