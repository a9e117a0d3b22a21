"""Fails loudly when transformers changes the private generation API dspark-hf relies on."""

from transformers.generation.utils import GenerationMixin

from dspark_hf import _transformers_compat


def test_transformers_contract_holds():
    assert _transformers_compat.check_contract() == []


def test_integration_is_installed_once():
    _transformers_compat.install()
    _transformers_compat.install()
    wrapped = GenerationMixin._get_candidate_generator
    assert getattr(wrapped, "_dspark", False)
    assert not getattr(wrapped.__wrapped__, "_dspark", False)


def test_other_assistants_still_go_to_transformers(target):
    import torch

    from conftest import make_target

    assistant = make_target(seed=11)
    prompt = torch.tensor([[3, 4, 5]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=8)
    assert target.generate(prompt, assistant_model=assistant, do_sample=False, max_new_tokens=8).tolist() == \
        expected.tolist()
    assert target.generate(prompt, prompt_lookup_num_tokens=3, do_sample=False, max_new_tokens=8).tolist() == \
        expected.tolist()
