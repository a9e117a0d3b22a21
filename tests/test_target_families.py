"""Targets of other families than the Llama/Qwen ones the rest of the suite uses: DSpark's output is still theirs.

Tiny random models of each family, a fresh drafter from `DSparkDrafter.from_target`, greedy, 30 new tokens. Targets
with sliding-window layers (Gemma2/3, OLMo3, Mistral with a window), some with a window of 8 positions, so that
generation runs past it: batch 1 runs in transformers' own loop; the batched engine keeps their K/V on its slot axis
in full and masks the window by position (`cache_ops.slot_masks`), across the holes rejected drafts leave.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from conftest import TINY, left_pad
from dspark_hf import DSparkDrafter


PROMPT = torch.tensor([[5, 9, 14, 2, 7]])
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                              moe_intermediate_size=32)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=8)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {}),
    "mistral_window_8": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "gemma3_window_8": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=8, sliding_window=8)),
    "gemma2_window_8": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=8, sliding_window=8)),
}


def family_pair(name: str):
    config_name, model_name, overrides = FAMILIES[name]
    config = getattr(transformers, config_name)(**{**TINY, **overrides})
    torch.manual_seed(0)
    target = getattr(transformers, model_name)(config).eval()
    torch.manual_seed(1)
    return target, DSparkDrafter.from_target(target, block_size=4, num_hidden_layers=1, markov_rank=8).eval()


@pytest.mark.parametrize("name", FAMILIES)
def test_batch_one_gives_the_targets_output(name):
    target, drafter = family_pair(name)
    settings = dict(attention_mask=torch.ones_like(PROMPT), max_new_tokens=30, do_sample=False, pad_token_id=0)
    expected = target.generate(PROMPT, **settings)  # 35 positions: past the 8-slot window
    assert target.generate(PROMPT, assistant_model=drafter, **settings).tolist() == expected.tolist()
    assert drafter.generation_stats.verified > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_batches_give_the_targets_output(name):
    target, drafter = family_pair(name)
    input_ids, mask = left_pad([[5, 9], [3, 8, 1, 6, 22, 40]])
    settings = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    expected = target.generate(input_ids, **settings)
    assert target.generate(input_ids, assistant_model=drafter, **settings).tolist() == expected.tolist()
    rounds = [r for stats in drafter.batch_generation_stats for r in stats.rounds if r.drafted]
    assert sum(r.verified - r.accepted for r in rounds) > 0  # rejected drafts: holes on the slot axis


def test_a_drafter_for_a_target_with_rope_per_layer_type_uses_its_full_attention_rope(tmp_path):
    target, drafter = family_pair("gemma3")
    full = target.config.rope_parameters["full_attention"]
    assert drafter.config.rope_parameters == full
    drafter.save_pretrained(tmp_path)
    assert DSparkDrafter.from_pretrained(tmp_path).config.rope_parameters == full
