"""Test fixtures: synthetic drafter checkpoints in DeepSpec's layout and tiny targets they can serve.

Not used by the library itself. [`write_synthetic_checkpoint`] writes ``config.json`` and safetensors by hand, in the
official layout and key set (scaled-down Qwen3-4B or Gemma4-12B shapes; ``docs/design.md``, "Checkpoint layout"), so
loaders can be tested offline against files no dspark-hf code wrote; [`synthetic_target`] builds a tiny random
target those drafters can serve.

Example:

```python
>>> from dspark_hf import interop, testing
>>> path = testing.write_synthetic_checkpoint("/tmp/dspark-qwen3", variant="qwen3")  # doctest: +SKIP
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
from safetensors.torch import save_file

from .interop import expected_tensor_shapes
from .registry import architectures_of
from .registry import drafter_family as drafter_variant


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
    "SYNTHETIC_SHAPES",
    "synthetic_config",
    "synthetic_state_dict",
    "write_synthetic_checkpoint",
    "synthetic_target",
]
