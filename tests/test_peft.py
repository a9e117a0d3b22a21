"""A PEFT-wrapped (LoRA) drafter works as `assistant_model` directly."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from conftest import make_drafter


def test_lora_wrapped_drafter_is_lossless_and_uses_the_adapter(target):
    drafter = make_drafter(target, block_size=4)
    lora = get_peft_model(drafter, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "fc"], init_lora_weights=False))
    prompt = torch.tensor([[7, 3, 11, 2]])
    expected = target.generate(prompt, do_sample=False, max_new_tokens=16)
    actual = target.generate(prompt, assistant_model=lora, do_sample=False, max_new_tokens=16)
    assert actual.tolist() == expected.tolist()
    assert drafter.generation_stats.num_rounds > 0

    # The adapter is live: the same inputs draft differently with it disabled.
    kwargs = dict(input_ids=torch.tensor([[4, 0, 0, 0]]),
                  target_hidden_states=torch.randn(1, 3, drafter.config.num_context_features),
                  position_ids=torch.arange(3, 7)[None], context_position_ids=torch.arange(3)[None])
    with_adapter = drafter(**kwargs).logits
    with lora.disable_adapter():
        without_adapter = drafter(**kwargs).logits
    assert not torch.allclose(with_adapter, without_adapter)
