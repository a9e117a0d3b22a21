"""Fails loudly when transformers changes the private generation API dspark-hf relies on.

`check_contract()` checks signatures; the tests below run `generate` on tiny models and check what the assisted loop
does with our hooks (what we relied on reading upstream source before): the candidate generator gets the target's
outputs with the hidden states it asked for, the special tokens reach the batched engine, and so on.
"""

import pytest
import torch
from transformers import AutoModel, GenerationConfig
from transformers.generation.utils import GenerationMixin

from conftest import make_drafter, make_target
from dspark_hf import DSparkDrafter, _transformers_compat
from dspark_hf.generation import batched
from dspark_hf.generation.candidate_generator import DSparkCandidateGenerator


def test_transformers_contract_holds():
    assert _transformers_compat.check_contract() == []


def test_integration_is_installed_once():
    _transformers_compat.install()
    _transformers_compat.install()
    wrapped = GenerationMixin._get_candidate_generator
    assert getattr(wrapped, "_dspark", False)
    assert not getattr(wrapped.__wrapped__, "_dspark", False)


def test_assisted_loop_feeds_the_candidate_generator(target, drafter, monkeypatch):
    calls, updates = [], []
    get_candidates, update = DSparkCandidateGenerator.get_candidates, DSparkCandidateGenerator.update_candidate_strategy

    def spy_get_candidates(self, input_ids, *args, **kwargs):
        calls.append(dict(kwargs, length=input_ids.shape[1]))
        return get_candidates(self, input_ids, *args, **kwargs)

    def spy_update(self, input_ids, scores, num_matches):
        updates.append(num_matches)
        return update(self, input_ids, scores, num_matches)

    monkeypatch.setattr(DSparkCandidateGenerator, "get_candidates", spy_get_candidates)
    monkeypatch.setattr(DSparkCandidateGenerator, "update_candidate_strategy", spy_update)
    prompt = torch.tensor([[3, 4, 5, 6]])
    target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=6)

    assert calls[0]["is_first_iteration"] and not any(call["is_first_iteration"] for call in calls[1:])
    outputs = calls[1]["model_outputs"]
    wanted = [i + 1 for i in drafter.config.target_layer_ids]  # model_kwargs_overrides asked for these
    assert outputs.hidden_states is not None
    layers = _transformers_compat.select_hidden_states(
        outputs.hidden_states, wanted, _transformers_compat.hidden_states_request(wanted)
    )
    assert all(layer is not None for layer in layers)
    assert layers[0].shape[-1] == target.config.hidden_size
    assert all(int(call["n_last_matches"]) >= 0 for call in calls)  # an int (a 0-d tensor before 5.18)
    assert len(updates) == len(calls)  # update_candidate_strategy closes every round


def test_batches_reach_the_engine_with_the_special_tokens(target, drafter, monkeypatch):
    received, generate_batch = {}, batched.generate_batch

    def spy(*args, **kwargs):
        received.update(eos=args[7], pad=args[8])  # resolved from GenerationConfig._eos/_pad_token_tensor
        return generate_batch(*args, **kwargs)

    monkeypatch.setattr(batched, "generate_batch", spy)
    prompts = torch.tensor([[0, 3, 4, 5], [6, 7, 8, 9]])
    target.generate(prompts, attention_mask=(prompts != 0).long(), assistant_model=drafter, do_sample=False,
                    max_new_tokens=4, eos_token_id=2, pad_token_id=0)
    assert received == {"eos": [2], "pad": 0}


def test_default_generation_params_name_the_speculation_settings():
    config = GenerationConfig(num_assistant_tokens=3)
    assert _transformers_compat.changed_speculation_settings(config) == {"num_assistant_tokens": 3}
    assert _transformers_compat.changed_speculation_settings(GenerationConfig()) == {}


def test_validation_reaches_our_check_first(target):
    other = make_drafter(make_target(hidden_size=48))
    with pytest.raises(ValueError, match="target hidden size of 48"):
        target.generate(torch.tensor([[3, 4]]), assistant_model=other, max_new_tokens=2)


def test_auto_classes_load_drafters(drafter, tmp_path):
    drafter.save_pretrained(tmp_path)
    assert type(AutoModel.from_pretrained(tmp_path)) is DSparkDrafter


def test_the_templates_call_resolves_the_generation_config(target):
    # custom_generate/generate.py runs without dspark-hf, so it calls this private method itself.
    config, unknown = target._prepare_generation_config(None, max_new_tokens=3, not_an_option=1)
    assert isinstance(config, GenerationConfig) and config.max_new_tokens == 3
    assert "not_an_option" in unknown


def test_other_assistants_still_go_to_transformers(target):
    assistant = make_target(seed=11)
    prompt = torch.tensor([[3, 4, 5]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=8)
    assert target.generate(prompt, assistant_model=assistant, do_sample=False, max_new_tokens=8).tolist() == \
        expected.tolist()
    assert target.generate(prompt, prompt_lookup_num_tokens=3, do_sample=False, max_new_tokens=8).tolist() == \
        expected.tolist()
