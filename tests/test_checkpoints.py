"""Save/load in the official checkpoint layout: round trips, official files, and refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM

from conftest import make_drafter
from dspark_hf import DSparkConfig, DSparkDrafter


def _draft(drafter, target, prompt=((5, 9, 14, 2, 7),)):
    out = target.generate(torch.tensor(prompt), assistant_model=drafter, do_sample=False, max_new_tokens=12)
    return out.tolist(), [r.confidences for r in drafter.generation_stats.rounds]


def assert_same_generation(a, b):
    """Same tokens exactly; same per-round confidences up to float rounding.

    Identical weights can still give confidences ~1e-7 apart: where a tensor's memory lands decides whether some CPU
    kernels (AVX2 vs AVX-512, aligned or not) take a vectorised path that sums in another order.
    """
    (tokens_a, confidences_a), (tokens_b, confidences_b) = a, b
    assert tokens_a == tokens_b
    assert [len(c) for c in confidences_a] == [len(c) for c in confidences_b]
    flat_a, flat_b = sum(confidences_a, []), sum(confidences_b, [])
    torch.testing.assert_close(torch.tensor(flat_a), torch.tensor(flat_b), rtol=0, atol=1e-5)


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_save_load_round_trip_is_bit_identical(tmp_path, target, head):
    drafter = make_drafter(target, markov_head_type=head)
    drafter.save_pretrained(tmp_path)
    loaded = DSparkDrafter.from_pretrained(tmp_path).eval()
    for (name, a), (_, b) in zip(sorted(drafter.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name
    ids = torch.tensor([[4, 2, 8, 6]])
    kwargs = dict(
        input_ids=ids,
        target_hidden_states=torch.randn(1, 3, drafter.config.num_context_features),
        position_ids=torch.arange(3, 7)[None],
        context_position_ids=torch.arange(0, 3)[None],
    )
    torch.testing.assert_close(drafter(**kwargs).logits, loaded(**kwargs).logits, rtol=1e-5, atol=1e-5)  # see above
    assert_same_generation(_draft(drafter, target), _draft(loaded, target))
    assert not loaded.embed_tokens.weight.requires_grad and not loaded.lm_head.weight.requires_grad


def test_saved_config_is_the_official_layout(tmp_path, target):
    make_drafter(target).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["Qwen3DSparkModel"]
    for key in ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "num_anchors",
                "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
        assert key in config, key
    assert config["layer_types"] == ["full_attention"] * config["num_hidden_layers"]
    tensors = load_file(tmp_path / "model.safetensors")
    assert {"embed_tokens.weight", "lm_head.weight", "fc.weight", "hidden_norm.weight", "norm.weight",
            "markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias", "layers.0.self_attn.q_norm.weight"} <= set(tensors)
    assert not any("rotary" in name for name in tensors)


def test_conditional_keys_are_omitted_like_deepspec(tmp_path, target):
    make_drafter(target, markov_rank=0, enable_confidence_head=False).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["markov_rank"] == 0 and config["enable_confidence_head"] is False
    assert "markov_head_type" not in config and "confidence_head_with_markov" not in config
    assert not any(k.startswith(("markov_head", "confidence_head")) for k in load_file(tmp_path / "model.safetensors"))


def _write_official(tmp_path, drafter, extra_tensors=None, drop=()):
    """Writes a checkpoint by hand, as DeepSpec does: bf16 tensors, v4 spellings, no transformers involved."""
    config = drafter.config.to_dict()
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["torch_dtype"] = "bfloat16"
    config.pop("dtype", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items() if k not in drop}
    tensors.update(extra_tensors or {})
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})


def test_hand_written_official_checkpoint_loads(tmp_path, target):
    drafter = make_drafter(target)
    _write_official(tmp_path, drafter)
    loaded = DSparkDrafter.from_pretrained(tmp_path)
    assert loaded.config.rope_parameters["rope_theta"] == drafter.config.rope_parameters["rope_theta"]
    assert torch.equal(loaded.fc.weight.to(torch.bfloat16), drafter.fc.weight.to(torch.bfloat16))
    auto = AutoModel.from_pretrained(tmp_path)
    assert isinstance(auto, DSparkDrafter)
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path), DSparkDrafter)


def test_unknown_tensors_are_refused(tmp_path, target):
    _write_official(tmp_path, make_drafter(target), extra_tensors={"mtp.0.main_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="unexpected_keys.*mtp.0.main_proj.weight"):
        DSparkDrafter.from_pretrained(tmp_path)


def test_missing_tensors_are_refused(tmp_path, target):
    drafter = make_drafter(target)
    _write_official(tmp_path, drafter, drop=("markov_head.markov_w2.weight",))
    with pytest.raises(ValueError, match="missing_keys.*markov_head.markov_w2.weight"):
        DSparkDrafter.from_pretrained(tmp_path)


def test_target_checkpoint_is_not_mistaken_for_a_drafter(tmp_path, target):
    target.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="llama.*DSpark drafter"):
        DSparkConfig.from_pretrained(tmp_path)
    assert not isinstance(AutoModelForCausalLM.from_pretrained(tmp_path), DSparkDrafter)


def test_dflash_sibling_config_loads_without_heads(tmp_path, target):
    drafter = make_drafter(target, markov_rank=0, enable_confidence_head=False)
    _write_official(tmp_path, drafter)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("markov_rank", "enable_confidence_head"):
        config.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = DSparkDrafter.from_pretrained(tmp_path)
    assert loaded.markov_head is None and loaded.confidence_head is None


def test_compact_checkpoint_binds_the_targets_vocabulary(tmp_path, target):
    drafter = make_drafter(target)
    drafter.save_compact(tmp_path)
    assert not {"embed_tokens.weight", "lm_head.weight"} & set(load_file(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="compact drafter.*target=target"):
        DSparkDrafter.from_pretrained(tmp_path)
    loaded = DSparkDrafter.from_pretrained(tmp_path, target=target)
    assert torch.equal(loaded.lm_head.weight, target.lm_head.weight)
    assert_same_generation(_draft(loaded, target), _draft(drafter, target))
