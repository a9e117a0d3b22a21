"""The checkpoint spec as data: tensor tables, config rules, conformance of what we save, vLLM weight names."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dspark_hf import DSparkDrafter, interop, testing

from conftest import make_target


# Spec section 1/2 values of the released deepseek-ai/dspark_qwen3_4b_block7 and dspark_gemma4_12b_block7.
QWEN3_4B = dict(
    architectures=["Qwen3DSparkModel"], model_type="qwen3", vocab_size=151936, hidden_size=2560,
    intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_hidden_layers=5,
    target_layer_ids=[1, 9, 17, 25, 33], markov_rank=256, markov_head_type="vanilla", enable_confidence_head=True,
    confidence_head_with_markov=True,
)  # fmt: skip
GEMMA4_12B = dict(
    architectures=["Gemma4DSparkModel"], model_type="gemma4_text", vocab_size=262144, hidden_size=3840,
    intermediate_size=15360, num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
    num_global_key_value_heads=1, attention_k_eq_v=True, num_hidden_layers=5, target_layer_ids=[5, 17, 29, 41, 46],
    markov_rank=256, markov_head_type="vanilla", enable_confidence_head=True, confidence_head_with_markov=True,
)  # fmt: skip


def test_qwen3_4b_tensor_table_matches_the_spec():
    shapes = interop.expected_tensor_shapes(QWEN3_4B)
    assert shapes["fc.weight"] == (2560, 12800)
    assert shapes["layers.4.self_attn.q_proj.weight"] == (4096, 2560)  # head_dim * heads != hidden
    assert shapes["layers.0.self_attn.v_proj.weight"] == (1024, 2560)
    assert shapes["layers.0.self_attn.o_proj.weight"] == (2560, 4096)
    assert shapes["markov_head.markov_w2.weight"] == (151936, 256)
    assert shapes["confidence_head.proj.weight"] == (1, 2816)
    assert "layers.5.input_layernorm.weight" not in shapes and "rotary_emb.inv_freq" not in shapes
    # "The 4B checkpoint holds about 1.39 B parameters"
    assert sum(math.prod(s) for s in shapes.values()) / 1e9 == pytest.approx(1.39, abs=0.01)


def test_gemma4_12b_tensor_table_matches_the_spec():
    shapes = interop.expected_tensor_shapes(GEMMA4_12B)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (16 * 512, 3840)  # global head dim
    assert shapes["layers.0.self_attn.k_proj.weight"] == (512, 3840)  # one global KV head
    assert "layers.0.self_attn.v_proj.weight" not in shapes  # attention_k_eq_v
    assert "layers.0.self_attn.v_norm.weight" not in shapes  # weightless
    assert shapes["layers.3.layer_scalar"] == (1,)
    assert shapes["layers.3.pre_feedforward_layernorm.weight"] == (3840,)
    assert shapes["fc.weight"] == (3840, 5 * 3840)


@pytest.mark.parametrize(
    "head_type, extra",
    [
        ("gated", {"markov_head.gate_proj.weight": (8, 72), "markov_head.gate_proj.bias": (8,)}),
        ("rnn", {"markov_head.joint_proj.weight": (24, 80), "markov_head.joint_proj.bias": (24,)}),
    ],
)
def test_markov_head_variants_add_their_tensors(head_type, extra):
    shapes = interop.expected_tensor_shapes(testing.synthetic_config(markov_head_type=head_type))
    assert {k: v for k, v in shapes.items() if k in extra} == extra


@pytest.mark.parametrize("variant", ["qwen3", "gemma4"])
@pytest.mark.parametrize("dflash", [False, True])
@pytest.mark.parametrize("num_shards", [1, 3])
def test_synthetic_official_checkpoints_conform(tmp_path, variant, dflash, num_shards):
    path = testing.write_synthetic_checkpoint(tmp_path, variant=variant, dflash=dflash, num_shards=num_shards)
    assert interop.check_checkpoint(path, for_vllm=True) == []
    config = json.loads((path / "config.json").read_text())
    assert ("markov_head_type" in config) is not dflash and ("confidence_head_with_markov" in config) is not dflash
    assert (path / "model.safetensors.index.json").exists() is (num_shards > 1)


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda c: c.pop("markov_head_type"), "markov_head_type must be written iff"),
        (lambda c: c.update(confidence_head_with_markov=True, enable_confidence_head=False), "iff enable_confidence"),
        (lambda c: c.update(layer_types=["sliding_attention", "full_attention"]), "layer_types="),
        (lambda c: c.update(rope_theta=1e6), "'rope_theta' must not be written"),
        (lambda c: c.update(_attn_implementation="sdpa"), "'_attn_implementation' must not"),
        (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 3, 5, 7, 9]), "overrides vLLM"),
        (lambda c: c.update(mask_token_id=300), "mask_token_id=300"),
        (lambda c: c.update(target_layer_ids=[1, 3, 11]), "last usable one is 10"),
        (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings=True"),
        (lambda c: c.pop("num_anchors"), "missing key 'num_anchors'"),
        (lambda c: c.update(markov_head_type="rnn"), "serve 'vanilla' only"),
    ],
)
def test_config_problems_name_each_departure(change, problem):
    config = testing.synthetic_config()
    change(config)
    problems = interop.config_problems(config, for_vllm=True)
    assert any(problem in p for p in problems), problems


def test_check_checkpoint_names_missing_vocabulary_and_wrong_dtype(tmp_path):
    config = testing.synthetic_config()
    tensors = testing.synthetic_state_dict(config)
    del tensors["lm_head.weight"]
    tensors["fc.weight"] = tensors["fc.weight"].float()
    path = testing.write_synthetic_checkpoint(tmp_path, config, state_dict=tensors)
    problems = interop.check_checkpoint(path)
    assert any("lm_head.weight is missing" in p for p in problems)
    assert any("fc.weight is F32" in p for p in problems)
    with pytest.raises(ValueError, match="official DSpark checkpoint layout"):
        interop.assert_conforms(path)


@pytest.mark.parametrize(
    "drafter_kwargs",
    [
        dict(markov_rank=8),
        dict(markov_rank=8, markov_head_type="gated"),
        dict(markov_rank=8, markov_head_type="rnn", confidence_head_with_markov=False),
        dict(markov_rank=0, enable_confidence_head=False),  # DFlash-style sibling
    ],
)
def test_save_pretrained_writes_the_official_layout_in_bf16(tmp_path, drafter_kwargs):
    target = make_target("qwen3")
    drafter = DSparkDrafter.from_target(target, block_size=4, num_hidden_layers=2, **drafter_kwargs)
    drafter.to(torch.bfloat16).save_pretrained(tmp_path)
    assert interop.check_checkpoint(tmp_path) == []
    headers = interop.read_tensor_headers(tmp_path)
    assert {dtype for _, dtype in headers.values()} == {"BF16"}
    assert "embed_tokens.weight" in headers and "lm_head.weight" in headers
    assert json.loads((tmp_path / "config.json").read_text())["num_anchors"] == 512


def test_save_pretrained_with_attention_bias_conforms(tmp_path):
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          attention_bias=True))  # fmt: skip
    DSparkDrafter.from_target(target, markov_rank=4).save_pretrained(tmp_path)
    assert "layers.0.self_attn.o_proj.bias" in interop.read_tensor_headers(tmp_path)
    assert interop.check_checkpoint(tmp_path) == []


# --- vLLM -----------------------------------------------------------------------------------------------------------


def vllm_qwen3_dspark_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """The parameters vLLM's `Qwen3DSparkForCausalLM` fills in `load_weights`, from vllm-project/vllm sources.

    qwen3_dflash.py `DFlashQwen3Model`: `embed_tokens` (VocabParallelEmbedding V x d); `layers[i]`
    (`DFlashQwen3DecoderLayer`): `self_attn.qkv_proj` (QKVParallelLinear, rows (H + 2 H_kv) * hd), `self_attn.o_proj`
    (d x H hd), `self_attn.q_norm` / `k_norm` (hd), `mlp.gate_up_proj` (MergedColumnParallelLinear, 2I x d),
    `mlp.down_proj` (d x I), `input_layernorm` / `post_attention_layernorm` (d); `fc` (ReplicatedLinear d x m d, no
    bias), `hidden_norm`, `norm` (d). qwen3_dspark.py `Qwen3DSparkModel` adds `markov_head.markov_w1` (nn.Embedding
    V x r), `markov_head.markov_w2` (ParallelLMHead V x r), `confidence_head.proj` (ReplicatedLinear 1 x (d + r), with
    bias); `Qwen3DSparkForCausalLM` adds `lm_head` (ParallelLMHead V x d) outside `model.`. `mask_embedding` is a
    placeholder the checkpoint does not carry.
    """
    vocab, hidden, inter = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
    rank = config["markov_rank"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    params = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.fc.weight": (hidden, len(config["target_layer_ids"]) * hidden),
        "model.hidden_norm.weight": (hidden,),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
        "model.markov_head.markov_w1.weight": (vocab, rank),
        "model.markov_head.markov_w2.weight": (vocab, rank),
        "model.confidence_head.proj.weight": (1, hidden + rank),
        "model.confidence_head.proj.bias": (1,),
    }
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        params.update({
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
            layer + "self_attn.qkv_proj.weight": ((heads + 2 * kv_heads) * head_dim, hidden),
            layer + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            layer + "self_attn.q_norm.weight": (head_dim,),
            layer + "self_attn.k_norm.weight": (head_dim,),
            layer + "mlp.gate_up_proj.weight": (2 * inter, hidden),
            layer + "mlp.down_proj.weight": (hidden, inter),
        })  # fmt: skip
    return params


def test_vllm_names_and_fused_shapes_match_the_qwen3_dspark_loader(tmp_path):
    path = testing.write_synthetic_checkpoint(tmp_path, variant="qwen3")
    drafter = DSparkDrafter.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    state = drafter.state_dict()
    mapped = interop.to_vllm_state_dict(state, config)
    assert {name: tuple(t.shape) for name, t in mapped.items()} == vllm_qwen3_dspark_parameters(config)
    # QKVParallelLinear shards q, k, v in that order; MergedColumnParallelLinear gate (0) then up (1).
    q, k = state["layers.1.self_attn.q_proj.weight"], state["layers.1.self_attn.k_proj.weight"]
    qkv = mapped["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv[: q.shape[0]], q) and torch.equal(qkv[q.shape[0] : q.shape[0] + k.shape[0]], k)
    assert torch.equal(qkv[q.shape[0] + k.shape[0] :], state["layers.1.self_attn.v_proj.weight"])
    gate_up = mapped["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(gate_up[: config["intermediate_size"]], state["layers.0.mlp.gate_proj.weight"])
    assert torch.equal(gate_up[config["intermediate_size"] :], state["layers.0.mlp.up_proj.weight"])


def test_vllm_mapping_of_gemma4_keeps_qkv_and_drops_the_confidence_head():
    config = testing.synthetic_config("gemma4")
    mapped = interop.to_vllm_state_dict(testing.synthetic_state_dict(config), config)
    # gemma4_dspark.py: separate k_proj (no v_proj with k_eq_v), stacked gate_up_proj, confidence head not loaded.
    assert "model.layers.0.self_attn.k_proj.weight" in mapped
    assert "model.layers.0.self_attn.qkv_proj.weight" not in mapped
    assert mapped["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * config["intermediate_size"], 64)
    assert "model.layers.1.layer_scalar" in mapped and "lm_head.weight" in mapped
    assert not any("confidence_head" in name for name in mapped)


def test_vllm_mapping_refuses_markov_heads_vllm_cannot_serve():
    config = testing.synthetic_config(markov_head_type="gated")
    with pytest.raises(ValueError, match="only the vanilla Markov head"):
        interop.to_vllm_state_dict(testing.synthetic_state_dict(config), config)
