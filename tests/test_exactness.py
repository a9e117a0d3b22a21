"""Exactness reporting: where an output first parts from target-only's, and the target's logit margin there."""

from __future__ import annotations

import pytest
import torch

from conftest import make_target
from dspark_hf.benchmarks.exactness import conversation_divergence, first_divergence, summarize_divergences
from dspark_hf import models
from dspark_hf.models import target_dtype


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 4], [1, 2, 3]) == 2
    assert first_divergence([9], [1, 2]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one output stopped early


def _direct_margin(model, sequence: list[int], position: int) -> tuple[float, float]:
    """The top-1/top-2 margin of the logits predicting `sequence[position]`, from a forward over the whole
    sequence (not only the prefix, as the library does)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([sequence])).logits[0, position - 1].float()
    top = torch.topk(logits, 2).values
    return (top[0] - top[1]).item(), top[0].item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_margin_at_a_forced_divergence_equals_a_direct_computation(dtype):
    target = make_target(seed=5).to(dtype)
    prompts = [[5, 17, 33, 8], [40, 41]]
    reference = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=6)[0, len(p):].tolist()
                 for p in prompts]
    changed = [reference[0], [*reference[1][:3], (reference[1][3] + 1) % 97, *reference[1][4:]]]

    divergence = conversation_divergence(target, prompts, reference, changed)

    assert divergence["turn"] == 1 and divergence["position"] == len(reference[0]) + 3
    assert divergence["target_token"] == reference[1][3] and divergence["token"] == changed[1][3]
    sequence = [*prompts[1], *reference[1]]
    margin, top1 = _direct_margin(target, sequence, len(prompts[1]) + 3)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7  # a forward of another length may round differently
    assert divergence["margin"] == pytest.approx(margin, abs=tolerance)
    assert divergence["top1_logit"] == pytest.approx(top1, abs=tolerance)
    assert divergence["margin"] >= 0
    # the reference token is the target's own greedy choice there, so it is the top-1 of those logits
    assert conversation_divergence(target, prompts, reference, reference) is None


def test_summarize_divergences():
    summary = summarize_divergences([None, {"margin": 0.125, "top1_logit": 20.0}, {"margin": 0.0, "top1_logit": 9.5},
                                     {"margin": 1.0, "top1_logit": 3.0}])
    assert summary == {"divergences": 3, "divergence_margin_max": 1.0, "divergence_margin_median": 0.125,
                       "divergence_top1_logit_max": 20.0}
    assert summarize_divergences([None, None])["divergence_margin_max"] is None


@pytest.mark.parametrize("capabilities, expected", [
    ({"amx_bf16": False, "avx512_bf16": True}, torch.bfloat16),
    ({"amx_bf16": False, "avx512_bf16": False}, torch.float32),  # emulated bf16: float32
])
def test_target_dtype_auto_follows_native_bf16_like_the_drafter(monkeypatch, capabilities, expected):
    monkeypatch.setattr(models, "cpu_capabilities", lambda: capabilities)
    assert target_dtype("auto", "cpu") is expected
    assert target_dtype("float32", "cpu") is torch.float32
    with pytest.raises(ValueError, match="Unknown target dtype 'fp8'"):
        target_dtype("fp8")
