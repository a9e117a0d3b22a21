"""The drafter sees exactly the target's layer outputs of every committed position, once, in order."""

from __future__ import annotations

import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf.training.features import compute_target_signals


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("layer_ids", [[-1, 1, 2], [0, 2]])  # with the embedding output and without
def test_context_features_match_a_full_target_forward(arch, layer_ids):
    target = make_target(arch, seed=7)
    drafter = make_drafter(target, block_size=3, target_layer_ids=layer_ids)
    _generate_and_check_context(target, drafter, torch.tensor([[3, 14, 15, 9, 26]]), max_new_tokens=20)


def _generate_and_check_context(target, drafter, prompt, max_new_tokens):
    """Generates while recording the context features the drafter receives; checks that every position before the
    last round's anchor arrives exactly once, in order, equal to a full target forward's hidden states there."""
    seen_features, seen_positions = [], []

    def record(module, args, kwargs):
        seen_features.append(kwargs["target_hidden_states"])
        seen_positions.append(kwargs["context_position_ids"])

    handle = drafter.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=max_new_tokens)
    finally:
        handle.remove()
    features = torch.cat(seen_features, dim=1)[0]
    positions = torch.cat(seen_positions, dim=1)[0]
    assert positions.tolist() == list(range(positions.shape[0]))
    with torch.no_grad():
        reference = target(out, output_hidden_states=True).hidden_states
    expected = torch.cat([reference[i + 1][0] for i in drafter.config.target_layer_ids], dim=-1)
    torch.testing.assert_close(features, expected[: features.shape[0]], rtol=1e-4, atol=1e-5)
    return out, len(seen_features)


def test_drafter_cache_holds_one_entry_per_committed_position(target, drafter):
    from dspark_hf.generation.candidate_generator import DSparkCandidateGenerator

    generators = []
    original_init = DSparkCandidateGenerator.__init__

    def spy(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        generators.append(self)

    DSparkCandidateGenerator.__init__ = spy
    try:
        out = target.generate(torch.tensor([[3, 4, 5]]), assistant_model=drafter, do_sample=False, max_new_tokens=15)
    finally:
        DSparkCandidateGenerator.__init__ = original_init
    (generator,) = generators
    # The cache covers every position before the last round's anchor, exactly; block K/V are never kept. That round
    # committed its accepted drafts and one more token after the anchor.
    last_round = drafter.generation_stats.rounds[-1]
    context = generator.context
    assert context.cache.get_seq_length() == context.positions.numel() == context.end
    assert context.positions.tolist() == list(range(out.shape[1] - 2 - last_round.accepted))


def test_context_is_complete_after_rounds_without_drafting():
    from dspark_hf.generation.policies import VerificationPolicy

    class EveryThirdRound(VerificationPolicy):
        name = "every_third"

        def __init__(self):
            self.rounds = 0

        def begin_round(self, stale_confidences, block_size):
            self.rounds += 1
            return self.rounds % 3 == 1

    target = make_target("llama", seed=3)
    drafter = make_drafter(target, block_size=3, target_layer_ids=[0, 2])
    drafter.verification_policy = EveryThirdRound()
    prompt = torch.tensor([[3, 14, 15, 9, 26]])
    out, drafter_calls = _generate_and_check_context(target, drafter, prompt, max_new_tokens=24)
    assert torch.equal(out, target.generate(prompt, do_sample=False, max_new_tokens=24))
    stats = drafter.generation_stats
    assert stats.skipped_rounds >= 4 and drafter_calls == stats.num_rounds - stats.skipped_rounds


@pytest.mark.parametrize("layer_ids", [[-1, 0, 2], [0, 2]])
def test_training_features_are_the_target_layers_outputs(layer_ids):
    """Training reads the same layers as generation: `compute_target_signals` against a full forward's hidden
    states (transformers releases number a selection of them differently; see `hidden_states_request`)."""
    target = make_target("qwen3", seed=3)
    ids = torch.tensor([[3, 14, 15, 9, 26, 5], [7, 7, 2, 8, 1, 0]])
    mask = torch.tensor([[1] * 6, [1] * 5 + [0]])
    signals = compute_target_signals(target, ids, mask, layer_ids)
    with torch.no_grad():
        reference = target.base_model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    expected = torch.cat([reference.hidden_states[i + 1] for i in layer_ids], dim=-1)
    torch.testing.assert_close(signals.context_features, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(signals.last_hidden_state, reference.last_hidden_state, rtol=1e-4, atol=1e-5)
