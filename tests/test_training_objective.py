"""The batched training forward equals the inference forward block by block; target signals and the feature cache."""

import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf.training import features
from dspark_hf.training.blocks import DSparkBlocks
from dspark_hf.training.collator import DSparkDataCollator
from dspark_hf.training.losses import slot_weights
from dspark_hf.training.features import FeatureCache, TargetSignalProvider, compute_target_signals
from dspark_hf.training.objective import (
    compute_dspark_loss,
    corrected_draft_logits,
    drafter_block_states,
    supervised_targets,
)
from conftest import single_thread


BLOCK = 4


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


def _batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    examples = [
        {"input_ids": torch.randint(5, 97, (20,), generator=generator).tolist(), "loss_mask": [0] * 5 + [1] * 15},
        {"input_ids": torch.randint(5, 97, (13,), generator=generator).tolist(), "loss_mask": [0] * 3 + [1] * 10},
    ]
    collator = DSparkDataCollator(block_size=BLOCK, mask_token_id=0, num_anchors=5, generator=generator)
    batch = collator(examples)
    return batch, DSparkBlocks.from_dict(batch)


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_training_forward_equals_inference_forward_per_block(head):
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=BLOCK, markov_head_type=head)
    batch, blocks = _batch()
    signals = compute_target_signals(target, batch["input_ids"], batch["attention_mask"],
                                     drafter.config.target_layer_ids)
    states = drafter_block_states(drafter, blocks, signals.context_features, BLOCK)
    draft_logits = corrected_draft_logits(drafter, states, blocks.previous_ids, blocks.supervised)
    checked = 0
    for row in range(2):
        for i, (anchor, keep) in enumerate(zip(blocks.anchors[row].tolist(), blocks.keep[row].tolist())):
            if not keep:
                continue
            # inference: the context is every position before the anchor (spec 3.6), with no mask
            out = drafter(
                input_ids=blocks.input_ids[row: row + 1, i * BLOCK:(i + 1) * BLOCK],
                target_hidden_states=signals.context_features[row: row + 1, :anchor],
                position_ids=torch.arange(anchor, anchor + BLOCK)[None],
                context_position_ids=torch.arange(anchor)[None],
            )
            torch.testing.assert_close(out.last_hidden_state[0], states[row, i], atol=1e-5, rtol=1e-4)
            bias = drafter.markov_head.teacher_forced(blocks.previous_ids[row, i], out.last_hidden_state[0])
            checked += 1
            # the supervised slots' corrected logits, in the flattened (row, block, slot) order
            before = int(blocks.supervised[:row].sum() + blocks.supervised[row, :i].sum())
            count = int(blocks.supervised[row, i].sum())
            expected = (out.logits[0] + bias)[:count]
            torch.testing.assert_close(draft_logits[before: before + count], expected, atol=1e-4, rtol=1e-4)
    assert checked >= 6


def test_target_logits_are_the_targets_own_logits_at_the_predicting_position():
    target = make_target()
    drafter = make_drafter(target, block_size=BLOCK)
    batch, blocks = _batch(1)
    signals = compute_target_signals(target, batch["input_ids"], batch["attention_mask"],
                                     drafter.config.target_layer_ids)
    logits = supervised_targets(drafter, signals.last_hidden_state, blocks).logits
    with torch.no_grad():
        full = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    rows, blocks_, slots = torch.nonzero(blocks.supervised, as_tuple=True)
    positions = blocks.anchors[rows, blocks_] + slots  # slot k predicts x_{p+k+1} from position p+k
    torch.testing.assert_close(logits, full[rows, positions], atol=1e-5, rtol=1e-5)
    # and the features are the raw layer outputs hidden_states[i + 1]
    with torch.no_grad():
        hidden = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i + 1] for i in drafter.config.target_layer_ids], dim=-1)
    torch.testing.assert_close(signals.context_features, expected)


@pytest.mark.parametrize("options", [{}, {"markov_rank": 0, "enable_confidence_head": False},
                                     {"markov_rank": 8, "confidence_head_with_markov": False}])
def test_gradients_reach_the_drafter_but_not_its_frozen_vocabulary(options):
    target = make_target()
    drafter = make_drafter(target, block_size=BLOCK, **options).train()
    batch, blocks = _batch(2)
    signals = compute_target_signals(target, batch["input_ids"], batch["attention_mask"],
                                     drafter.config.target_layer_ids)
    out = compute_dspark_loss(drafter, blocks, signals)
    assert torch.isfinite(out.loss) and out.num_supervised > 0
    out.loss.backward()
    assert drafter.embed_tokens.weight.grad is None and drafter.lm_head.weight.grad is None
    for name, parameter in drafter.named_parameters():
        if parameter.requires_grad:
            assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
    assert drafter.fc.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_training_over_a_reduced_vocabulary_is_the_full_vocabulary_loss_of_the_reduced_drafter(head):
    """Over a draft vocabulary D the drafter puts no mass outside D: the full-vocabulary loss terms of its
    distribution (draft logits -inf outside D) must equal the ones computed over D plus the target's outside mass."""
    target = make_target()
    drafter = make_drafter(target, block_size=BLOCK, markov_head_type=head)
    batch, blocks = _batch(4)
    signals = compute_target_signals(target, batch["input_ids"], batch["attention_mask"],
                                     drafter.config.target_layer_ids)
    kept = torch.arange(0, 97, 2)  # every other id: some labels fall outside
    drafter.reduce_vocabulary(kept)
    weight = target.get_output_embeddings().weight
    reduced = compute_dspark_loss(drafter, blocks, signals, target_lm_head=weight)
    with pytest.raises(ValueError, match="target_lm_head"):
        compute_dspark_loss(drafter, blocks, signals)

    states = drafter_block_states(drafter, blocks, signals.context_features, BLOCK)
    draft = drafter.to_target_vocabulary(corrected_draft_logits(drafter, states, blocks.previous_ids,
                                                                blocks.supervised))
    rows, blocks_, slots = torch.nonzero(blocks.supervised, as_tuple=True)
    with torch.no_grad():
        full = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    target_probs = full[rows, blocks.anchors[rows, blocks_] + slots].float().softmax(-1)
    tv = (draft.softmax(-1) - target_probs).abs().sum(-1)
    weights = slot_weights(blocks.supervised)[blocks.supervised]
    denominator = weights.sum() + 1e-6
    labels = blocks.labels[blocks.supervised]
    inside = torch.isin(labels, kept)
    assert inside.any() and not inside.all()
    ce = -(draft.log_softmax(-1)[inside, labels[inside]] * weights[inside]).sum() / denominator
    confidence = torch.nn.functional.binary_cross_entropy_with_logits(
        drafter.confidence_logits(states[blocks.supervised], blocks.previous_ids[blocks.supervised]),
        (1 - tv / 2).clamp(0, 1).detach(), reduction="none")
    torch.testing.assert_close(reduced.tv, (tv * weights).sum() / denominator)
    torch.testing.assert_close(reduced.ce, ce)
    torch.testing.assert_close(reduced.confidence, (confidence * weights).sum() / denominator)
    reduced.loss.backward()
    assert drafter.fc.weight.grad.abs().sum() > 0 and drafter.markov_head.markov_w2.weight.grad.abs().sum() > 0


def test_feature_cache_round_trip_and_fingerprint(tmp_path, monkeypatch):
    target = make_target()
    layer_ids = [0, 1]
    batch, _ = _batch(3)
    cache = FeatureCache(tmp_path, {"target": "tiny", "target_layer_ids": layer_ids})
    provider = TargetSignalProvider(target, layer_ids, cache)
    first = provider(batch["input_ids"], batch["attention_mask"])
    assert len(list(tmp_path.glob("*/*.safetensors"))) == 2

    calls = []  # a second pass over the same sequences must not run the target
    monkeypatch.setattr(features, "compute_target_signals", lambda *args: calls.append(args))
    second = provider(batch["input_ids"], batch["attention_mask"])
    assert not calls
    lengths = batch["attention_mask"].sum(-1)
    for row, length in enumerate(lengths.tolist()):
        torch.testing.assert_close(second.context_features[row, :length], first.context_features[row, :length])
        torch.testing.assert_close(second.last_hidden_state[row, :length], first.last_hidden_state[row, :length])
    with pytest.raises(ValueError, match="was made for"):
        FeatureCache(tmp_path, {"target": "other", "target_layer_ids": layer_ids})
