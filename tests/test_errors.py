"""Bad input gets a clear error naming the value and the fix."""

from __future__ import annotations

import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf import DSparkConfig, DSparkDrafter, ThresholdPolicy


PROMPT = torch.tensor([[5, 6, 7]])


def test_drafter_for_another_hidden_size_is_refused():
    drafter = make_drafter(make_target(hidden_size=32))
    other = make_target(hidden_size=48, num_attention_heads=4)
    with pytest.raises(ValueError, match=r"hidden size of 32 \(config.hidden_size\) but the target .* has 48"):
        other.generate(PROMPT, assistant_model=drafter, max_new_tokens=4)


def test_drafter_for_another_vocabulary_is_refused():
    drafter = make_drafter(make_target(vocab_size=97))
    other = make_target(vocab_size=120)
    # transformers would take a vocab-size mismatch for "different tokenizers"; ours must say what is wrong first,
    # with or without tokenizer arguments.
    with pytest.raises(ValueError, match="vocabulary size of 97"):
        other.generate(PROMPT, assistant_model=drafter, max_new_tokens=4)
    with pytest.raises(ValueError, match="vocabulary size of 97"):
        other.generate(PROMPT, assistant_model=drafter, max_new_tokens=4, tokenizer=object(),
                       assistant_tokenizer=object())


def test_drafter_for_another_depth_is_refused():
    drafter = make_drafter(make_target(num_hidden_layers=4))
    with pytest.raises(ValueError, match="number of layers of 4"):
        make_target(num_hidden_layers=6).generate(PROMPT, assistant_model=drafter, max_new_tokens=4)


def test_last_target_layer_is_refused():
    target = make_target(num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"last layer \(3\) cannot be used"):
        DSparkDrafter.from_target(target, target_layer_ids=[1, 3])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(target_layer_ids=[2, 1]), "strictly increasing"),
        (dict(mask_token_id=500), "mask_token_id must be an id in"),
        (dict(markov_head_type="lstm"), "markov_head_type must be one of"),
        (dict(block_size=0), "block_size must be >= 1"),
        (dict(confidence_temperatures=[1.0]), "confidence_temperatures must hold"),
    ],
)
def test_invalid_config_values_are_named(kwargs, message):
    base = dict(vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=64, mask_token_id=0, target_layer_ids=[0, 1])
    with pytest.raises(ValueError, match=message):
        DSparkConfig(**{**base, **kwargs})


def test_right_padded_batch_is_refused(target, drafter):
    with pytest.raises(ValueError, match="right-padded.*padding_side = 'left'"):
        target.generate(torch.tensor([[5, 6, 7], [8, 9, 0]]), attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
                        assistant_model=drafter, max_new_tokens=4, pad_token_id=0)


def test_confidence_policy_needs_a_confidence_head(target):
    drafter = make_drafter(target, enable_confidence_head=False)
    drafter.verification_policy = ThresholdPolicy(0.5)
    with pytest.raises(ValueError, match="needs confidences"):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=4)


def test_unknown_policy_name_is_refused(target, drafter, monkeypatch):
    with pytest.raises(ValueError, match="Unknown verification policy 'sometimes'"):
        drafter.verification_policy = "sometimes"  # refused when set, not at the next generate
    monkeypatch.setenv("DSPARK_HF_VERIFICATION_POLICY", "sometimes")
    with pytest.raises(ValueError, match="Unknown verification policy 'sometimes'"):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=4)


def test_drafter_trained_for_another_model_of_the_same_shape_warns(monkeypatch):
    import dspark_hf.modeling_dspark as modeling

    warnings = []
    monkeypatch.setattr(modeling.logger, "warning_once", lambda message: warnings.append(message))
    drafter = make_drafter(make_target(seed=0))
    drafter.check_target(make_target(seed=0))
    assert warnings == []
    drafter.check_target(make_target(seed=5))  # same shapes, other weights: output stays exact, drafts will miss
    assert len(warnings) == 1 and "trained for another model" in warnings[0]
