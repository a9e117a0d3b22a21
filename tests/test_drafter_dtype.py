"""A drafter may run in another dtype than its target (bf16 drafter, fp32 target): the output stays the target's."""

from __future__ import annotations

import pytest
import torch

from conftest import left_pad, make_drafter, make_target, solo
from dspark_hf import models
from dspark_hf.models import cpu_capabilities, drafter_dtype


def test_bfloat16_drafter_fp32_target_greedy_identical():
    target = make_target("qwen3", seed=11)
    drafter = make_drafter(target, seed=12, block_size=5).to(torch.bfloat16)
    prompt = torch.tensor([[5, 9, 13, 42, 77, 8]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=24)
    actual = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=24)
    assert actual.tolist() == expected.tolist()
    assert drafter.dtype == torch.bfloat16 and target.dtype == torch.float32
    assert drafter.generation_stats.verified > 0  # drafts were made in bf16 and verified by the fp32 target


def test_bfloat16_drafter_fp32_target_batched_rows_equal_solo():
    target = make_target("llama", seed=13)
    drafter = make_drafter(target, seed=14, block_size=4).to(torch.bfloat16)
    prompts = [[5, 6, 7, 8, 9], [12], [40, 41, 42]]
    ids, mask = left_pad(prompts)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=12,
                          pad_token_id=0, eos_token_id=None)
    for row, prompt in enumerate(prompts):
        assert out[row, ids.shape[1]:].tolist() == solo(target, prompt, 12, eos_token_id=None)


@pytest.mark.parametrize("name, dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                         ("float16", torch.float16)])
def test_drafter_dtype_by_name(name, dtype):
    assert drafter_dtype(name) is dtype


def test_drafter_dtype_rejects_unknown_names():
    with pytest.raises(ValueError, match="'fp8'.*choose one of"):
        drafter_dtype("fp8")


@pytest.mark.parametrize("capabilities, expected", [
    ({"amx_bf16": True, "avx512_bf16": True}, torch.bfloat16),
    ({"amx_bf16": False, "avx512_bf16": True}, torch.bfloat16),
    ({"amx_bf16": False, "avx512_bf16": False}, torch.float32),  # emulated bf16 is slower than fp32
    ({}, torch.float32),
])
def test_drafter_dtype_auto_on_cpu_follows_native_bf16(monkeypatch, capabilities, expected):
    monkeypatch.setattr(models, "cpu_capabilities", lambda: capabilities)
    assert drafter_dtype("auto", "cpu") is expected


def test_cpu_capabilities_without_torchs_reading_come_from_the_kernel(monkeypatch):
    """torch 2.9 and older have no `torch.cpu.get_capabilities`: the kernel's CPU flags answer, with the same names."""
    torchs = cpu_capabilities() if hasattr(torch.cpu, "get_capabilities") else None
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = [line for line in cpuinfo if line.startswith("flags")][0].split(":", 1)[1].split()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    kernels = cpu_capabilities()
    assert set(kernels) == set(flags) and all(kernels.values())
    if torchs is not None:  # both readings agree on what `auto` decides by
        for name in ("avx512_bf16", "avx2"):
            assert bool(torchs.get(name)) == bool(kernels.get(name)), name
