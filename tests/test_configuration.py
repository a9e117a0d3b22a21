"""DSparkConfig reads every spelling of the RoPE settings and keeps them through save -> load."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dspark_hf import DSparkConfig, DSparkDrafter, interop, testing


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}


@pytest.fixture
def yarn_v4_checkpoint(tmp_path):
    """An official-layout drafter whose config.json spells RoPE the v4 way: `rope_theta` beside `rope_scaling`."""
    path = testing.write_synthetic_checkpoint(tmp_path / "v4", spelling="v4", rope_scaling=YARN)
    written = json.loads((path / "config.json").read_text())
    assert written["rope_theta"] == 1e6 and "rope_parameters" not in written
    return path


def test_v4_rope_theta_and_rope_scaling_are_both_kept(yarn_v4_checkpoint):
    rope = DSparkConfig.from_pretrained(yarn_v4_checkpoint).rope_parameters
    assert rope["rope_theta"] == 1e6 and rope["rope_type"] == "yarn" and rope["factor"] == 4.0
    assert rope["original_max_position_embeddings"] == 4096


def test_oldest_rope_scaling_spelling_names_its_type():
    config = testing.synthetic_config("qwen3", spelling="v4", rope_scaling={"type": "linear", "factor": 2.0})
    assert DSparkConfig.from_dict(config).rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}


def test_yarn_config_round_trips(yarn_v4_checkpoint, tmp_path):
    drafter = DSparkDrafter.from_pretrained(yarn_v4_checkpoint)
    drafter.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "rope_theta" not in saved and "rope_scaling" not in saved  # written in the v5 spelling only
    assert DSparkConfig.from_pretrained(tmp_path / "saved").rope_parameters == drafter.config.rope_parameters
    assert interop.check_checkpoint(tmp_path / "saved") == []


def test_drafter_rotary_embedding_is_yarn_at_the_configured_theta(yarn_v4_checkpoint):
    rotary = DSparkDrafter.from_pretrained(yarn_v4_checkpoint).rotary_emb
    head_dim = 16  # testing.SYNTHETIC_SHAPES["qwen3"]
    default = 1e6 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    # YaRN with theta 1e6, head_dim 16 and 4096 original positions keeps the two fastest frequencies and divides
    # the slowest ones (dimension pairs 4 to 7) by the factor; it also scales attention by 0.1 ln(factor) + 1.
    torch.testing.assert_close(rotary.inv_freq[:2].double(), default[:2], rtol=1e-6, atol=0)
    torch.testing.assert_close(rotary.inv_freq[4:].double(), default[4:] / 4.0, rtol=1e-6, atol=0)
    assert rotary.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_a_z_lab_dflash_config_is_refused_with_its_convention_named():
    """z-lab's DFlash drafters drop the anchor's output: read as DSpark drafters they would draft one position off."""
    config = {**testing.synthetic_config("qwen3"), "architectures": ["DFlashDraftModel"]}
    with pytest.raises(ValueError, match=r"z-lab DFlash drafter .* one position off"):
        DSparkConfig.from_dict(config)
