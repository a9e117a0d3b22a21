"""The Gemma4 drafter (Gemma4DSparkModel): official config and tensors, forward, drafting, round trip."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from packaging import version
from transformers import AutoModel, Gemma4Config

from conftest import (
    SYNTHETIC_PROMPT as PROMPT,
    assert_round_trip_is_byte_identical,
    count_forwards,
    load_generate_module,
    predictable_pair,
)
from dspark_hf import hub, interop, testing
from dspark_hf.modeling_dspark_gemma4 import DSparkGemma4Config, DSparkGemma4Drafter, softcap_logits


def test_official_config_round_trips_exactly(tmp_path):
    path = testing.write_synthetic_checkpoint(tmp_path, variant="gemma4")
    original = json.loads((path / "config.json").read_text())
    config = DSparkGemma4Config.from_pretrained(path)
    written = json.loads(config.to_json_string())
    assert "per_layer_config" not in written
    assert {k: v for k, v in written.items() if k != "transformers_version"} == {
        k: v for k, v in original.items() if k != "transformers_version"
    }
    # transformers folds the global attention shape into per-layer configs; every draft layer uses it.
    assert config.per_layer_config[0].head_dim == 32 and config.per_layer_config[1].num_key_value_heads == 1


def test_official_checkpoint_loads_with_gemma4_modules(tmp_path):
    path = testing.write_synthetic_checkpoint(tmp_path, variant="gemma4", num_shards=2)
    drafter = DSparkGemma4Drafter.from_pretrained(path)
    assert drafter.dtype == torch.bfloat16
    attention = drafter.layers[0].self_attn
    assert attention.v_proj is None and attention.head_dim == 32 and attention.num_key_value_groups == 4
    assert attention.scaling == 1.0 and not hasattr(attention.v_norm, "weight")
    assert torch.equal(drafter.layers[1].layer_scalar, torch.ones(1, dtype=torch.bfloat16))
    assert float(drafter.embed_tokens.embed_scale) == pytest.approx(8.0)  # sqrt(hidden_size)
    # full-attention proportional RoPE: a quarter of the 16 frequency pairs rotate, the rest are 0
    assert int((drafter.rotary_emb.full_attention_inv_freq > 0).sum()) == 4
    assert set(drafter.state_dict()) == set(interop.expected_tensor_shapes(drafter.config.to_dict()))


@pytest.mark.parametrize("k_eq_v", [True, False])
@torch.no_grad()
def test_forward_matches_the_standalone_reference(tmp_path, k_eq_v):
    path = testing.write_synthetic_checkpoint(tmp_path, variant="gemma4", dtype="float32", attention_k_eq_v=k_eq_v)
    drafter = DSparkGemma4Drafter.from_pretrained(path).eval()
    assert (drafter.layers[0].self_attn.v_proj is None) is k_eq_v
    standalone = load_generate_module().DSparkStandaloneDrafter(str(path), "cpu", torch.float32)
    features = torch.randn(1, 8, drafter.config.num_context_features)
    standalone.extend_context(features[0], 0)
    hidden, logits = standalone.block(torch.tensor(7), 8)
    reference = drafter(input_ids=torch.tensor([[7] + [4] * 6]), target_hidden_states=features,
                        position_ids=torch.arange(8, 15)[None], context_position_ids=torch.arange(8)[None])  # fmt: skip
    torch.testing.assert_close(hidden, reference.last_hidden_state[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, reference.logits[0], rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_logits_are_soft_capped():
    config = DSparkGemma4Config.from_dict(testing.synthetic_config("gemma4", dtype="float32"))
    drafter = DSparkGemma4Drafter(config).eval()
    drafter.lm_head.weight.mul_(1e4)
    output = drafter(input_ids=torch.tensor([[7, 4, 4]]), target_hidden_states=torch.randn(1, 2, 320),
                     position_ids=torch.arange(2, 5)[None], context_position_ids=torch.arange(2)[None])  # fmt: skip
    assert output.logits.abs().max() <= 30.0
    torch.testing.assert_close(output.logits, softcap_logits(drafter.lm_head(output.last_hidden_state), 30.0))


@torch.no_grad()
def test_training_reads_the_gemma_targets_soft_capped_logits(tmp_path):
    from dspark_hf.training.blocks import DSparkBlocks
    from dspark_hf.training.collator import DSparkDataCollator
    from dspark_hf.training.objective import supervised_targets

    target, _ = predictable_pair(tmp_path, variant="gemma4")
    drafter = DSparkGemma4Drafter.from_target(target, mask_token_id=4).float().eval()
    assert target.config.get_text_config().final_logit_softcapping is not None
    collator = DSparkDataCollator(block_size=drafter.config.block_size, mask_token_id=drafter.config.mask_token_id,
                                  num_anchors=3, generator=torch.Generator().manual_seed(0))
    batch = collator([{"input_ids": [2, 7, 4, 9, 4, 7, 11, 3, 5, 6, 8, 10, 4, 7], "loss_mask": [0] * 3 + [1] * 11}])
    blocks = DSparkBlocks.from_dict(batch)
    out = target(input_ids=batch["input_ids"], output_hidden_states=True)
    logits = supervised_targets(drafter, out.hidden_states[-1], blocks).logits
    rows, block_index, slots = torch.nonzero(blocks.supervised, as_tuple=True)
    positions = blocks.anchors[rows, block_index] + slots
    torch.testing.assert_close(logits, out.logits[rows, positions].float(), atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("modules_cache")
def test_drafts_for_a_gemma4_target_with_dspark_hf_and_custom_generate(tmp_path):
    target, path = predictable_pair(tmp_path, variant="gemma4")
    expected = target.generate(PROMPT, max_new_tokens=20, do_sample=False)
    drafter = DSparkGemma4Drafter.from_pretrained(path).float().eval()
    calls = count_forwards(target)
    assert torch.equal(target.generate(PROMPT, max_new_tokens=20, do_sample=False, assistant_model=drafter), expected)
    rounds, with_dspark_hf = drafter.generation_stats.rounds, len(calls)
    assert any(r.accepted > 0 for r in rounds) and any(r.accepted < r.verified for r in rounds)
    hub.write_custom_generate(path, str(path))
    calls.clear()
    recipe = dict(max_new_tokens=20, do_sample=False, custom_generate=str(path), trust_remote_code=True)
    if version.parse(transformers.__version__) < version.parse("5.18"):
        with pytest.raises(ValueError, match="Gemma4 targets with transformers >= 5.18"):
            target.generate(PROMPT, **recipe)
        return
    output = target.generate(PROMPT, **recipe)
    assert torch.equal(output, expected) and len(calls) == with_dspark_hf


@pytest.mark.parametrize("dflash", [False, True])
def test_official_checkpoint_round_trips_byte_identically(tmp_path, dflash):
    source = testing.write_synthetic_checkpoint(tmp_path / "official", variant="gemma4", dflash=dflash, num_shards=2)
    DSparkGemma4Drafter.from_pretrained(source).save_pretrained(tmp_path / "saved")
    assert_round_trip_is_byte_identical(source, tmp_path / "saved")


def test_from_target_writes_a_conformant_checkpoint(tmp_path):
    target = testing.synthetic_target("gemma4")
    drafter = DSparkGemma4Drafter.from_target(target, num_hidden_layers=2, mask_token_id=4, markov_rank=8)
    config = drafter.config
    assert (config.global_head_dim, config.num_global_key_value_heads) == (32, 1)
    assert config.target_model_type == config.target_text_model_type == "gemma4_text"
    assert config.layer_types == ["full_attention"] * 2 and config.num_target_layers == 12
    assert torch.equal(drafter.embed_tokens.weight, target.get_input_embeddings().weight)
    drafter.to(torch.bfloat16).save_pretrained(tmp_path)
    assert interop.check_checkpoint(tmp_path, for_vllm=True) == []
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "gemma4_text" and saved["architectures"] == ["Gemma4DSparkModel"]
    drafter.generation_stats = None
    output = target.generate(PROMPT, max_new_tokens=8, do_sample=False, assistant_model=drafter.float().eval())
    assert torch.equal(output, target.generate(PROMPT, max_new_tokens=8, do_sample=False))


def test_kv_sharing_of_the_target_does_not_reach_the_draft_layers():
    config = DSparkGemma4Config.from_dict(testing.synthetic_config("gemma4", num_kv_shared_layers=4, dtype="float32"))
    drafter = DSparkGemma4Drafter(config)
    assert all(layer.self_attn.k_proj is not None for layer in drafter.layers)
    assert json.loads(config.to_json_string())["num_kv_shared_layers"] == 4  # kept as inherited from the target


@pytest.mark.parametrize(
    "override, message",
    [({"enable_moe_block": True}, "enable_moe_block"), ({"hidden_size_per_layer_input": 256}, "per-layer input")],
)
def test_unsupported_gemma4_features_are_refused(override, message):
    with pytest.raises(ValueError, match=message):
        DSparkGemma4Config.from_dict(testing.synthetic_config("gemma4", **override))


def test_non_gemma_targets_are_refused():
    with pytest.raises(ValueError, match="needs a Gemma4 target"):
        DSparkGemma4Config.from_target_config(testing.synthetic_target("qwen3", num_hidden_layers=2).config)


def test_qwen3_layout_is_not_read_as_gemma4(tmp_path):
    path = testing.write_synthetic_checkpoint(tmp_path, variant="qwen3")
    with pytest.raises(ValueError, match="model_type 'gemma4_text'"):
        DSparkGemma4Config.from_pretrained(path)


def test_auto_model_loads_the_gemma4_drafter(tmp_path):
    path = testing.write_synthetic_checkpoint(tmp_path, variant="gemma4")
    assert isinstance(AutoModel.from_pretrained(path), DSparkGemma4Drafter)


def test_multimodal_gemma4_target_config_is_accepted():
    text_config = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                       num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0)
    config = DSparkGemma4Config.from_target_config(Gemma4Config(text_config=text_config), mask_token_id=4)
    assert config.target_model_type == "gemma4" and config.target_text_model_type == "gemma4_text"
    assert (config.global_head_dim, config.num_global_key_value_heads, config.num_target_layers) == (32, 1, 6)
