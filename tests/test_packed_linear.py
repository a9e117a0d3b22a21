"""Linear weights packed for oneDNN (`dspark_hf.packed_linear`): the same model to rounding, DSpark still lossless over
it, training untouched, and the speed profiles that plans read kept apart from unpacked ones."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import left_pad, make_drafter, make_target, solo
from dspark_hf.packed_linear import PackedLinear, is_packed, pack_linear_weights, packing_supported, real_tokens_only
from dspark_hf.profiling import _profile_fits, main, profile_dtype_mismatch, profile_steps_per_second


pytestmark = pytest.mark.skipif(not packing_supported(torch.float32),
                                reason="this torch build has no oneDNN (mkldnn) CPU backend to pack weights for")


def _linears(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_target_computes_the_same_logits(dtype):
    target = make_target("qwen3").to(dtype)
    ids = torch.tensor([[5, 9, 31, 2, 77, 40]])
    with torch.no_grad():
        expected = target(ids).logits
    count = pack_linear_weights(target, "on")
    assert count == len(_linears(target)) and is_packed(target)
    assert all(type(m) is PackedLinear for m in _linears(target))
    with torch.no_grad():
        actual = target(ids).logits
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(actual, expected, atol=tolerance, rtol=tolerance)
    assert pack_linear_weights(target, "off") == 0 and not is_packed(target)
    assert all(type(m) is torch.nn.Linear for m in _linears(target))
    assert not any(hasattr(m, "_packed_weight") for m in _linears(target))


@settings(max_examples=12, deadline=None)
@given(arch=st.sampled_from(["llama", "qwen2", "qwen3"]), target_seed=st.integers(0, 10_000),
       block_size=st.integers(2, 6), prompt=st.lists(st.integers(3, 96), min_size=1, max_size=10),
       max_new_tokens=st.integers(1, 20))
def test_greedy_dspark_over_a_packed_target_is_the_packed_targets_output(arch, target_seed, block_size, prompt,
                                                                         max_new_tokens):
    """Packed verification forwards of several tokens against packed one-token decoding: token for token."""
    target = make_target(arch, seed=target_seed)
    drafter = make_drafter(target, block_size=block_size)
    pack_linear_weights(target, "on")
    pack_linear_weights(drafter, "on")
    input_ids = torch.tensor([prompt])
    expected = target.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens)
    actual = target.generate(input_ids, assistant_model=drafter, do_sample=False, max_new_tokens=max_new_tokens)
    assert actual.tolist() == expected.tolist()


def test_training_forwards_run_the_unpacked_layer_and_get_its_gradients():
    torch.manual_seed(0)
    layer = torch.nn.Linear(12, 5)
    reference = torch.nn.Linear(12, 5)
    reference.load_state_dict(layer.state_dict())
    pack_linear_weights(layer, "on")
    assert type(layer) is PackedLinear
    x = torch.randn(3, 12)
    layer(x).square().sum().backward()
    reference(x).square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():  # autocast casts as nn.Linear would
        assert layer(x).dtype == torch.bfloat16


def test_a_changed_weight_is_packed_again():
    layer = torch.nn.Linear(8, 4, bias=False)
    pack_linear_weights(layer, "on")
    x = torch.randn(2, 8)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2.0)  # in place: same storage, new version
        torch.testing.assert_close(layer(x), 2.0 * before)
        layer.weight = torch.nn.Parameter(torch.zeros(4, 8))  # replaced
        assert layer(x).abs().max() == 0


def test_a_packed_model_can_be_copied_and_saved_after_use(tmp_path):
    import copy

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    pack_linear_weights(model, "on")
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)  # makes the opaque packed copies
    clone = copy.deepcopy(model)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    with torch.no_grad():
        for other in (clone, loaded, model):
            assert is_packed(other)
            torch.testing.assert_close(other(x), expected)


def test_layers_made_under_inference_mode_are_packed_too():
    with torch.inference_mode():
        layer = torch.nn.Linear(6, 3)
        x = torch.randn(2, 6)
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    pack_linear_weights(layer, "on")
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_auto_packs_only_what_this_machine_times_faster():
    """"auto" times the model's own layers packed and not; either way the model computes the same."""
    target = make_target("llama")
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        expected = target(ids).logits
    count = pack_linear_weights(target, "auto")
    assert count in (0, len(_linears(target)))
    with torch.no_grad():
        torch.testing.assert_close(target(ids).logits, expected, atol=1e-4, rtol=1e-4)


def test_unknown_mode_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"Unknown packed_linear 'fast'; choose one of \['auto', 'on', 'off'\]"):
        pack_linear_weights(torch.nn.Linear(2, 2), "fast")
    from dspark_hf.models import load_target

    with pytest.raises(ValueError, match=r"Unknown packed_linear 'yes'; choose one of \['auto', 'on', 'off'\]"):
        load_target("no/such-target", packed_linear="yes")  # refused before anything loads


def test_profiles_record_packing_and_plans_read_only_a_matching_one(tmp_path):
    """A packed target's verification forwards cost about one decode step where unpacked float32 ones cost up to 2:
    a profile of one must not plan for the other."""
    target = make_target()
    unpacked = profile_steps_per_second(target, max_tokens=2, context_length=4, warmup=0, repeats=1)
    assert unpacked["settings"]["packed_linear"] is False
    assert _profile_fits(unpacked, target, 2)
    pack_linear_weights(target, "on")
    assert not _profile_fits(unpacked, target, 2)
    packed = profile_steps_per_second(target, max_tokens=2, context_length=4, warmup=0, repeats=1)
    assert packed["settings"]["packed_linear"] is True and _profile_fits(packed, target, 2)
    path = tmp_path / "unpacked.json"
    path.write_text(json.dumps(unpacked))
    message = profile_dtype_mismatch(path, torch.float32, packed=True)
    assert "linear weights not packed, but they are packed here" in message and "--packed_linear off" in message
    assert profile_dtype_mismatch(path, torch.float32, packed=False) is None
    assert profile_dtype_mismatch(path, torch.float32) is None  # packing not asked about


def test_profile_command_packs_as_asked(tmp_path):
    make_target().save_pretrained(tmp_path / "target")
    for mode, packed in (("on", True), ("off", False)):
        output = tmp_path / f"{mode}.json"
        argv = ["--target", str(tmp_path / "target"), "--max_tokens", "2", "--context_length", "4", "--warmup", "0",
                "--repeats", "1", "--device", "cpu", "--target_dtype", "float32", "--packed_linear", mode,
                "--output", str(output)]
        assert main(argv) == 0
        assert json.loads(output.read_text())["settings"]["packed_linear"] is packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_tokens_only_computes_the_padded_forwards_logits_at_real_tokens(dtype):
    """Left-padded prompts through a packed target: inside `real_tokens_only` the real positions' logits are the
    padded forward's (computed by the same kernel in a shorter batch), and the linear layers give zeros at padding."""
    target = make_target("qwen3", seed=2).to(dtype)
    pack_linear_weights(target, "on")
    ids, mask = left_pad([[5, 9, 31, 2, 77, 40, 8], [11, 12], [60, 61, 62, 63]])
    mask = mask.bool()
    ids[~mask] = 3  # a pad token with an embedding: padding computes something unless skipped
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    seen = []
    hook = target.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append(out))
    with torch.no_grad():
        expected = target(ids, attention_mask=mask, position_ids=positions).logits
        with real_tokens_only(mask):
            actual = target(ids, attention_mask=mask, position_ids=positions).logits
    hook.remove()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual[mask], expected[mask], atol=tolerance, rtol=tolerance)
    assert seen[1][~mask].abs().sum() == 0 and seen[0][~mask].abs().sum() > 0


def test_real_tokens_only_leaves_other_forwards_alone():
    """Inputs of another shape (a last-position LM head), a mask with too little padding to pay, layers that are not
    packed, and forwards that autograd records compute every token as usual."""
    layer = torch.nn.Linear(4, 3)
    inputs = torch.randn(2, 5, 4)
    with torch.no_grad():
        plain = layer(inputs)
    few = torch.ones(2, 20, dtype=torch.bool)
    few[0, 0] = False  # 1 of 40 positions padding: under RAGGED_MIN_PADDING
    mask = torch.tensor([[False, False, True, True, True], [True] * 5])
    with torch.no_grad(), real_tokens_only(mask):
        assert torch.equal(layer(inputs), plain)  # not packed
    pack_linear_weights(layer, "on")
    with torch.no_grad():
        packed = layer(inputs)
        with real_tokens_only(mask):
            torch.testing.assert_close(layer(inputs[:, -1:]), packed[:, -1:])  # another shape: every row computed
            assert layer(inputs)[0, :2].abs().sum() == 0
        with real_tokens_only(few):
            assert layer(torch.randn(2, 20, 4))[0, 0].abs().sum() > 0
        with real_tokens_only(mask.long()):  # a 0/1 attention mask reads the same
            torch.testing.assert_close(layer(inputs)[0, 2:], packed[0, 2:])
            assert layer(inputs)[0, :2].abs().sum() == 0
    with real_tokens_only(mask):
        recorded = layer(inputs)
    assert recorded.requires_grad and recorded[0, :2].abs().sum() > 0


@pytest.mark.parametrize("with_drafter", [False, True])
def test_engine_over_a_packed_target_computes_real_tokens_and_stays_exact(with_drafter, monkeypatch):
    """The batched engine's forwards over a packed target (left-padded prefills, rounds of different widths) skip
    padding in the linear layers, and every request is the packed target's own greedy output."""
    from dspark_hf.generation import batched
    from dspark_hf.generation.batched import DSparkBatchEngine

    target = make_target("llama", seed=7)
    drafter = make_drafter(target, block_size=4) if with_drafter else None
    pack_linear_weights(target, "on")
    ragged = []
    original = batched.real_tokens_only

    def counting(mask):
        ragged.append(mask is not None and bool((~mask.bool()).any()))
        return original(mask)

    monkeypatch.setattr(batched, "real_tokens_only", counting)
    engine = DSparkBatchEngine(target, drafter, pad_token_id=0, prompt_lookup_num_tokens=3 if with_drafter else None)
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10], [20, 21, 22, 23, 24], [30]]
    requests = [engine.add_request(p, 12) for p in prompts]
    engine.run()
    assert any(ragged)  # the prefill at least
    for prompt, request in zip(prompts, requests):
        assert request.output_ids == solo(target, prompt, 12, eos_token_id=None)
