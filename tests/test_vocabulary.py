"""Reduced draft vocabularies (`draft_vocab_size`, `d2t` / `t2d`): same scores on kept ids, never drafts others,
output unchanged, saved in the EAGLE-3 / vLLM convention, refused where it would be wrong."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import datasets
import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf import DSparkDrafter, hub, interop, testing
from dspark_hf.training.objective import supervised_targets
from dspark_hf.vocabulary import coverage, main as reduce_vocab_main, select_draft_vocabulary


PROMPT = torch.tensor([[5, 17, 33, 8, 41]])


def _kept_ids(vocab_size: int, seed: int = 0, fraction: float = 0.5) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(vocab_size, generator=generator)[: int(vocab_size * fraction)].tolist())


def _reduced_pair(seed: int = 0, **drafter_kwargs):
    target = make_target("llama", seed=seed)
    full = make_drafter(target, seed=seed + 1, **drafter_kwargs)
    reduced = make_drafter(target, seed=seed + 1, **drafter_kwargs)
    # keep the target's greedy continuation drafteable, plus a random half of the vocabulary
    trajectory = target.generate(PROMPT, do_sample=False, max_new_tokens=24, pad_token_id=0)[0].tolist()
    kept = sorted(set(_kept_ids(target.config.vocab_size, seed)) | set(trajectory))
    return target, full, reduced.reduce_vocabulary(kept), kept


@torch.no_grad()
def test_reduced_scores_equal_full_scores_on_kept_ids():
    _, full, reduced, kept = _reduced_pair(markov_rank=8)
    assert reduced.config.draft_vocab_size == len(kept) == reduced.lm_head.weight.shape[0]
    assert reduced.draft_token_ids.tolist() == kept
    assert reduced.t2d.nonzero().flatten().tolist() == kept
    hidden = torch.randn(3, full.config.hidden_size)
    outside = torch.ones(full.config.vocab_size, dtype=torch.bool)
    outside[kept] = False
    torch.testing.assert_close(reduced.base_logits(hidden)[:, kept], full.base_logits(hidden)[:, kept])
    assert torch.isneginf(reduced.base_logits(hidden)[:, outside]).all()
    previous = torch.tensor([4, 9, 60])
    ours, _ = reduced.corrected_logits(reduced.draft_logits(hidden), previous, hidden)
    theirs, _ = full.corrected_logits(full.draft_logits(hidden), previous, hidden)
    torch.testing.assert_close(ours[:, kept], theirs[:, kept])
    assert torch.isneginf(ours[:, outside]).all()


@pytest.mark.parametrize("seed", range(4))
def test_reduced_drafter_keeps_greedy_output_and_drafts_only_kept_ids(seed):
    target, _, drafter, kept = _reduced_pair(seed, block_size=4, markov_rank=8)
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=24, pad_token_id=0)
    actual = target.generate(PROMPT, assistant_model=drafter, do_sample=False, max_new_tokens=24, pad_token_id=0)
    assert actual.tolist() == expected.tolist()
    drafted = [t for r in drafter.generation_stats.rounds for t in (r.draft_ids or [])]
    assert drafted and set(drafted) <= set(kept)


def test_reduced_drafter_in_a_batch_matches_solo_generation():
    target, _, drafter, _ = _reduced_pair(2, block_size=3, markov_rank=8)
    prompts = [[5, 17, 33, 8, 41], [9, 12], [60, 61, 62]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batch = target.generate(input_ids=ids, attention_mask=mask, assistant_model=drafter, do_sample=False,
                            max_new_tokens=12, pad_token_id=0, eos_token_id=None)  # fmt: skip
    for row, prompt in enumerate(prompts):
        solo = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=0,
                               eos_token_id=None)  # fmt: skip
        assert batch[row, width:].tolist() == solo[0, len(prompt):].tolist()


@torch.no_grad()
@pytest.mark.parametrize("do_sample", [False, True])
def test_sampling_over_the_draft_vocabulary_matches_the_target_vocabulary(do_sample):
    """Without processors the drafts are sampled over the reduced vocabulary (`sample_drafts`' fast path): the same
    drafts, and `logits` expands to the target-vocabulary logits the slow path samples from."""
    from dspark_hf.generation.drafting import sample_drafts

    _, _, drafter, kept = _reduced_pair(3, markov_rank=8)
    hidden = torch.randn(3, drafter.config.block_size, drafter.config.hidden_size)
    anchors, budgets = torch.tensor(kept[:3]), [drafter.config.block_size] * 3
    torch.manual_seed(0)
    fast = sample_drafts(drafter, hidden, drafter.draft_logits(hidden), anchors, budgets, do_sample=do_sample)
    torch.manual_seed(0)
    slow = sample_drafts(drafter, hidden, drafter.draft_logits(hidden), anchors, budgets, do_sample=do_sample,
                         process=lambda drafts, logits: logits)  # fmt: skip
    assert fast.scores.shape[-1] == len(kept) and slow.scores.shape[-1] == drafter.config.vocab_size
    assert set(fast.ids.flatten().tolist()) <= set(kept)
    if do_sample:  # one seed draws differently over 8 and 16 cells; the first slot's distribution is the same
        torch.testing.assert_close(fast.logits[:, 0], slow.logits[:, 0])
    else:
        assert fast.ids.tolist() == slow.ids.tolist()
        torch.testing.assert_close(fast.logits, slow.logits)


def test_markov_transition_follows_weight_changes():
    """Drafting multiplies by a float32 copy of W2 (`DSparkMarkovHead._transition`): it must follow in-place updates
    (optimizer steps) and replaced weights, and autograd must see the layer itself."""
    target = make_target("llama")
    head = make_drafter(target, markov_rank=8).markov_head
    embedding = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(head._transition(embedding), head.markov_w2(embedding))
        head.markov_w2.weight.add_(1.0)
        torch.testing.assert_close(head._transition(embedding), head.markov_w2(embedding))
        head.markov_w2.weight = torch.nn.Parameter(torch.randn_like(head.markov_w2.weight))
        torch.testing.assert_close(head._transition(embedding), head.markov_w2(embedding))
    head._transition(embedding).sum().backward()
    assert head.markov_w2.weight.grad is not None


@pytest.mark.parametrize("compact", [False, True])
def test_save_and_load_keep_the_reduced_vocabulary(tmp_path, compact):
    target, _, drafter, kept = _reduced_pair(markov_rank=8)
    (drafter.save_compact if compact else drafter.save_pretrained)(tmp_path)
    loaded = DSparkDrafter.from_pretrained(tmp_path, target=target if compact else None)
    assert loaded.config.draft_vocab_size == len(kept)
    assert loaded.draft_token_ids.tolist() == kept
    hidden = torch.randn(2, drafter.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded.base_logits(hidden), drafter.base_logits(hidden))
        torch.testing.assert_close(loaded.markov_head.markov_w2.weight, drafter.markov_head.markov_w2.weight)


def test_reduced_checkpoint_follows_the_official_layout_and_maps_to_vllm(tmp_path):
    target, _, drafter, kept = _reduced_pair(markov_rank=8)
    drafter.to(torch.bfloat16).save_pretrained(tmp_path)
    assert interop.check_checkpoint(tmp_path) == []
    state = interop.to_vllm_state_dict(drafter.state_dict(), drafter.config.to_dict())
    assert "t2d" not in state and state["draft_id_to_target_id"].shape == (len(kept),)
    assert (torch.arange(len(kept)) + state["draft_id_to_target_id"]).tolist() == kept
    assert state["lm_head.weight"].shape[0] == len(kept)


@pytest.mark.usefixtures("modules_cache")
def test_custom_generate_runs_a_reduced_checkpoint(tmp_path):
    """The standalone Hub generate.py scatters draft-vocabulary scores back like dspark-hf does."""
    target = testing.synthetic_target("qwen3", predictable=True)
    path = testing.write_synthetic_checkpoint(tmp_path / "full", variant="qwen3", target=target, imitate_target=True,
                                              dtype="float32")  # fmt: skip
    expected = target.generate(PROMPT, max_new_tokens=16, do_sample=False)
    kept = sorted(set(expected[0].tolist()) | set(range(0, target.config.vocab_size, 3)))
    drafter = DSparkDrafter.from_pretrained(path).reduce_vocabulary(kept)
    reduced_path = tmp_path / "reduced"
    drafter.save_pretrained(reduced_path)
    hub.write_custom_generate(reduced_path, str(reduced_path))
    assert torch.equal(target.generate(PROMPT, max_new_tokens=16, do_sample=False, assistant_model=drafter), expected)
    assert drafter.generation_stats.accepted > 0
    output = target.generate(PROMPT, max_new_tokens=16, do_sample=False, custom_generate=str(reduced_path),
                             trust_remote_code=True)  # fmt: skip
    assert torch.equal(output, expected)


def test_reducing_twice_keeps_a_subset_and_refuses_dropped_ids():
    _, full, drafter, kept = _reduced_pair(markov_rank=8)
    smaller = kept[::2]
    hidden = torch.randn(2, full.config.hidden_size)
    with torch.no_grad():
        before = drafter.base_logits(hidden)[:, smaller]
        drafter.reduce_vocabulary(smaller)
        torch.testing.assert_close(drafter.base_logits(hidden)[:, smaller], before)
    assert drafter.draft_token_ids.tolist() == smaller
    with pytest.raises(ValueError, match="not in this drafter's draft vocabulary"):
        drafter.reduce_vocabulary(kept)


@pytest.mark.parametrize("ids", [[], [3, 3], [-1, 4], [5, 97]])
def test_reduce_vocabulary_rejects_bad_ids(ids):
    drafter = make_drafter(make_target())
    with pytest.raises(ValueError, match="distinct target ids"):
        drafter.reduce_vocabulary(ids)


def test_a_reduced_vocabulary_needs_the_targets_head_to_train_and_from_target_refuses_one():
    target, _, drafter, _ = _reduced_pair()
    with pytest.raises(ValueError, match="target_lm_head"):  # the mass outside the draft vocabulary needs it
        supervised_targets(drafter, last_hidden_state=None, blocks=None)
    with pytest.raises(ValueError, match="reduce_vocabulary"):
        DSparkDrafter.from_target(target, draft_vocab_size=10)


def test_select_draft_vocabulary_ranks_by_frequency_then_fills_low_ids():
    counts = Counter({50: 9, 7: 5, 90: 5, 3: 1})
    assert select_draft_vocabulary(counts, 3, vocab_size=97, always=[2]) == [2, 7, 50]
    assert select_draft_vocabulary(counts, 7, vocab_size=97) == [0, 1, 2, 3, 7, 50, 90]
    assert coverage(counts, [7, 50]) == pytest.approx(14 / 20)
    with pytest.raises(ValueError, match="size"):
        select_draft_vocabulary(counts, 98, vocab_size=97)
    with pytest.raises(ValueError, match="more than size"):
        select_draft_vocabulary(counts, 1, vocab_size=97, always=[1, 2])


def test_reduce_vocab_command(tmp_path):
    target = make_target()
    drafter = make_drafter(target, markov_rank=8)
    drafter.save_pretrained(tmp_path / "drafter")
    rows = {"input_ids": [[1, 5, 6, 7, 7, 2], [1, 9, 7, 8, 2]], "loss_mask": [[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1]]}
    (tmp_path / "data").mkdir()
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "data" / "shard-00000.parquet"))
    assert reduce_vocab_main(["--drafter", str(tmp_path / "drafter"), "--data", str(tmp_path / "data"), "--size", "8",
                              "--output_dir", str(tmp_path / "out")]) == 0  # fmt: skip
    reduced = DSparkDrafter.from_pretrained(tmp_path / "out")
    # eos/bos/pad always, then the response tokens by count (7, 2, then 6 and 8 by id), then the lowest free ids
    assert reduced.draft_token_ids.tolist() == [0, 1, 2, 3, 4, 6, 7, 8]
    assert Path(tmp_path / "out" / "config.json").read_text().count('"draft_vocab_size": 8') == 1


def test_model_card_states_the_draft_vocabulary():
    _, _, drafter, kept = _reduced_pair()
    card = hub.render_model_card(drafter, repo_id="org/dspark-tiny",
                                 card_data={"base_model": "org/tiny", "license": "apache-2.0"})
    assert f"| Draft vocabulary | {len(kept)} of 97 ids" in str(card)
