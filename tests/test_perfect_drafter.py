"""A drafter that predicts the target perfectly gets every draft accepted: tau == block_size + 1 per round."""

from __future__ import annotations

import pytest
import torch

from conftest import make_drafter, make_target


VOCAB = 32  # == hidden size, so one-hot embeddings fit


def lookup_table_target():
    """A Llama whose next token is always (current token + 1) % VOCAB: attention and MLPs output zero, so the
    residual stream is the one-hot embedding and the LM head maps it to the successor."""
    target = make_target("llama", seed=0, vocab_size=VOCAB, hidden_size=32, eos_token_id=None, bos_token_id=None)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        target.model.embed_tokens.weight.copy_(torch.eye(VOCAB))
        target.lm_head.weight.copy_(torch.roll(torch.eye(VOCAB), 1, dims=0) * 20.0)
    return target


def perfect_drafter(target, block_size: int, markov_head_type: str = "vanilla"):
    """The Markov bias alone encodes the successor table, and dominates the drafter's base logits."""
    drafter = make_drafter(target, block_size=block_size, markov_rank=VOCAB, markov_head_type=markov_head_type)
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.copy_(torch.eye(VOCAB))
        drafter.markov_head.markov_w2.weight.copy_(torch.roll(torch.eye(VOCAB), 1, dims=0) * 1000.0)
    return drafter


@pytest.mark.parametrize("block_size", [1, 3, 7])
@pytest.mark.parametrize("do_sample", [False, True])
def test_perfect_drafter_accepts_everything(block_size, do_sample):
    target = lookup_table_target()
    drafter = perfect_drafter(target, block_size)
    prompt = torch.tensor([[3, 4, 5]])
    num_rounds = 4
    max_new_tokens = 1 + num_rounds * (block_size + 1)  # the prefill token, then full rounds
    out = target.generate(
        prompt, assistant_model=drafter, do_sample=do_sample, max_new_tokens=max_new_tokens, pad_token_id=0
    )
    assert out[0].tolist() == [(3 + i) % VOCAB for i in range(prompt.shape[1] + max_new_tokens)]
    stats = drafter.generation_stats
    assert stats.num_rounds == num_rounds
    assert stats.accept_lengths == [block_size] * num_rounds
    assert stats.tau == block_size + 1


def test_lookup_table_target_is_what_it_claims():
    target = lookup_table_target()
    out = target.generate(torch.tensor([[30]]), do_sample=False, max_new_tokens=4, pad_token_id=0)
    assert out[0].tolist() == [30, 31, 0, 1, 2]


CLIFF = {1: 10.0, 2: 4.0, 3: 3.9, 4: 3.8, 5: 3.6, 6: 3.5, 7: 3.4, 8: 3.3}  # verifying 2+ tokens: a 2.5x cliff


@pytest.mark.parametrize("mode", ["planned", "algorithm1"])
def test_hardware_aware_planning_gets_past_a_speed_cliff(mode):
    from dspark_hf import HardwareAwarePolicy

    target = lookup_table_target()
    drafter = perfect_drafter(target, block_size=7)
    with torch.no_grad():
        drafter.confidence_head.proj.bias.fill_(12.0)  # a drafter that knows it is right: c_k ≈ 1
        drafter.confidence_head.proj.weight.zero_()
    drafter.verification_policy = HardwareAwarePolicy(CLIFF, mode=mode)
    prompt = torch.tensor([[3, 4, 5]])
    out = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=1 + 1 + 3 * 8,
                          pad_token_id=0)
    assert out[0].tolist() == [(3 + i) % VOCAB for i in range(out.shape[1])]
    verified = [r.verified for r in drafter.generation_stats.rounds]
    if mode == "algorithm1":
        # (1 + 1) * SPS(2) = 8 < SPS(1) = 10: the early stop never verifies a draft, whatever the confidence
        assert set(verified) == {0}
    else:
        # round 1 has nothing observed and falls back to Algorithm 1; then (1 + 7) * SPS(8) = 26.4 wins
        assert verified[0] == 0 and verified[1:4] == [7, 7, 7]
        assert drafter.generation_stats.accept_lengths[1:4] == [7, 7, 7]
