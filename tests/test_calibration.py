"""Calibration metrics, Sequential Temperature Scaling, round recording and `dspark-hf calibrate`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import make_drafter, make_target
from dspark_hf import DSparkDrafter
from dspark_hf.calibration import (
    auroc,
    brier,
    calibration_data_from_stats,
    calibration_metrics,
    collect_calibration_data,
    cumulative_confidences,
    expected_calibration_error,
    fit_sequential_temperatures,
    main,
)
from dspark_hf.generation.policies import ThresholdPolicy
from dspark_hf.generation.stats import DSparkGenerationStats, DSparkRoundStats


# ----------------------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------------------


def test_expected_calibration_error_by_hand():
    # Bin [0.9, 0.95): mean p 0.9, frequency 0.5 -> gap 0.4 on half the samples; bin [0.2, 0.25): gap 0.2 on half.
    assert expected_calibration_error([0.9, 0.9, 0.2, 0.2], [1, 0, 0, 0]) == pytest.approx(0.3)
    assert expected_calibration_error([1.0, 1.0], [1, 1]) == 0.0  # p = 1 lands in the last bin
    assert expected_calibration_error(torch.tensor([0.5, 0.5]), torch.tensor([1, 0])) == 0.0
    assert np.isnan(expected_calibration_error([], []))
    # 20 equal-width bins of 0.05: 0.51 and 0.54 share [0.50, 0.55) (|0.525 - 0.5|); 0.54 and 0.56 do not.
    assert expected_calibration_error([0.51, 0.54], [0, 1]) == pytest.approx(0.025)
    assert expected_calibration_error([0.54, 0.56], [0, 1]) == pytest.approx((0.54 + 0.44) / 2)


def test_calibrated_samples_have_small_ece():
    rng = np.random.default_rng(0)
    p = rng.uniform(size=20000)
    y = rng.uniform(size=p.size) < p
    assert expected_calibration_error(p, y) < 0.02
    assert expected_calibration_error(np.clip(p * 1.5, 0, 1), y) > 0.1


@pytest.mark.parametrize(
    "probabilities, labels, message",
    [([0.5, 1.2], [1, 0], r"in \[0, 1\]"), ([0.5], [1, 0], "differ in size"), ([0.5], [2], "0 or 1")],
)
def test_metric_inputs_are_checked(probabilities, labels, message):
    with pytest.raises(ValueError, match=message):
        expected_calibration_error(probabilities, labels)


def test_auroc_matches_pairwise_counting():
    assert auroc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert auroc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    assert auroc([0.5, 0.5, 0.5], [0, 1, 1]) == 0.5
    assert np.isnan(auroc([0.1, 0.2], [1, 1]))
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 10, size=300) / 10  # many ties
    labels = rng.uniform(size=300) < 0.4
    positives, negatives = scores[labels], scores[~labels]
    pairwise = (positives[:, None] > negatives[None]).mean() + 0.5 * (positives[:, None] == negatives[None]).mean()
    assert auroc(scores, labels) == pytest.approx(pairwise)


def test_brier():
    assert brier([1.0, 0.0, 0.5], [1, 0, 1]) == pytest.approx(0.25 / 3)


# ----------------------------------------------------------------------------------------------------------------------
# Sequential Temperature Scaling
# ----------------------------------------------------------------------------------------------------------------------


def _synthetic_rounds(true_temperatures, num_rounds=6000, seed=0):
    """Rounds whose draft k is accepted with probability σ(s_k) given the earlier ones were, while the head reports
    z_k = s_k · T_k (so σ(z_k / T_k) is calibrated). Rounds stop at a random verified length."""
    rng = np.random.default_rng(seed)
    block = len(true_temperatures)
    scores = rng.normal(0.8, 1.5, size=(num_rounds, block))
    accepted = rng.uniform(size=scores.shape) < 1 / (1 + np.exp(-scores))
    labels = np.cumprod(accepted, axis=1).astype(float)
    lengths = rng.integers(1, block + 1, size=num_rounds)
    valid = np.arange(block)[None] < lengths[:, None]
    return scores * np.asarray(true_temperatures), labels, valid


def test_sts_recovers_temperatures_and_reduces_ece():
    true_temperatures = [2.5, 0.5, 4.0, 1.0]
    logits, labels, valid = _synthetic_rounds(true_temperatures)
    fitted = fit_sequential_temperatures(logits, labels, valid)
    # Early positions pin their temperature down; later ones matter less to a_k (a small product), so ECE is flat
    # in T_k there and only the calibration itself is checked.
    for fit, true in zip(fitted[:2], true_temperatures[:2]):
        assert abs(np.log(fit / true)) < np.log(1.35), (fitted, true_temperatures)
    before = calibration_metrics(logits, labels, valid)
    after = calibration_metrics(logits, labels, valid, fitted)
    oracle = calibration_metrics(logits, labels, valid, true_temperatures)
    assert after["ece"] < before["ece"] / 3
    assert after["ece"] <= oracle["ece"] + 0.01
    for position_after, position_oracle in zip(after["per_position"], oracle["per_position"]):
        assert position_after["ece"] <= position_oracle["ece"] + 0.01
    assert after["brier"] < before["brier"]
    # Temperature scaling is monotone: it never changes how a position's confidences rank rounds.
    first = valid[:, 0]
    assert auroc(cumulative_confidences(logits, fitted)[first, 0], labels[first, 0]) == pytest.approx(
        auroc(logits[first, 0], labels[first, 0])
    )


def test_sts_keeps_earlier_temperatures_fixed_and_handles_empty_positions():
    logits, labels, valid = _synthetic_rounds([2.0, 1.0, 1.0], num_rounds=3000)
    valid[:, 2] = False  # no round reached position 3
    fitted = fit_sequential_temperatures(logits, labels, valid)
    assert fitted[2] == 1.0
    # T_1 is fitted on position 1 alone: the same data restricted to position 1 gives the same T_1.
    assert fit_sequential_temperatures(logits[:, :1], labels[:, :1], valid[:, :1]) == fitted[:1]


def test_sts_ties_prefer_temperature_one():
    logits = np.zeros((10, 2))  # σ(0 / T) = 0.5 for every T: all grid points tie
    labels = np.tile([[1.0, 0.0]], (10, 1))
    assert fit_sequential_temperatures(logits, labels) == [1.0, 1.0]


def test_sts_input_checks():
    logits, labels, valid = _synthetic_rounds([1.0, 1.0], num_rounds=10)
    bad = valid.copy()
    bad[0] = [False, True]
    with pytest.raises(ValueError, match="prefix"):
        fit_sequential_temperatures(logits, labels, bad)
    with pytest.raises(ValueError, match="shape"):
        fit_sequential_temperatures(logits[:, :1], labels, valid)
    with pytest.raises(ValueError, match="positive"):
        fit_sequential_temperatures(logits, labels, valid, grid=[0.0, 1.0])


# ----------------------------------------------------------------------------------------------------------------------
# Recording
# ----------------------------------------------------------------------------------------------------------------------


def _stats(*rounds):
    return DSparkGenerationStats(block_size=3, rounds=list(rounds))


def test_rounds_become_accept_prefix_labels():
    stats = _stats(
        DSparkRoundStats(confidences=[], verified=3, accepted=1, confidence_logits=[0.1, 0.2, 0.3]),
        DSparkRoundStats(confidences=[], verified=0, accepted=0, confidence_logits=[]),  # nothing verified: dropped
        DSparkRoundStats(confidences=[], verified=2, accepted=2, confidence_logits=[0.4, 0.5, 0.6]),  # c_3 unused
    )
    data = calibration_data_from_stats(stats)
    np.testing.assert_array_equal(data.valid, [[True, True, True], [True, True, False]])
    np.testing.assert_array_equal(data.labels, [[1, 0, 0], [1, 1, 0]])
    np.testing.assert_allclose(data.logits, [[0.1, 0.2, 0.3], [0.4, 0.5, 0.0]])


@pytest.mark.parametrize(
    "draft_ids, expected_valid, expected_labels",
    [
        ([5, 2, 7], [True, True, False], [1, 1, 0]),  # the EOS draft was accepted: label it, cut what follows
        ([5, 6, 7], [True, True, True], [1, 0, 0]),  # EOS was the target's correction: an ordinary rejection
        (None, [True, False, False], [1, 0, 0]),  # unknown drafts: the ambiguous slot is cut
    ],
)
def test_last_round_ending_with_eos(draft_ids, expected_valid, expected_labels):
    last = DSparkRoundStats(confidences=[], verified=3, accepted=1, confidence_logits=[0.1, 0.2, 0.3])
    if draft_ids is not None:
        last.draft_ids = draft_ids
    data = calibration_data_from_stats(_stats(last), output_ids=[9, 5, 2], eos_token_ids=[2])
    np.testing.assert_array_equal(data.valid[0], expected_valid)
    np.testing.assert_array_equal(data.labels[0], expected_labels)


def test_collect_calibration_data_with_a_tiny_pair():
    target = make_target(vocab_size=16)
    drafter = make_drafter(target, block_size=4)
    drafter.verification_policy = ThresholdPolicy(0.9)
    data, output = collect_calibration_data(target, drafter, torch.tensor([[1, 5, 7, 3]]), max_new_tokens=20)
    assert isinstance(drafter.verification_policy, ThresholdPolicy)  # restored
    rounds = [r for r in drafter.generation_stats.rounds if r.verified]
    assert output.shape[1] == 4 + 20 and len(data.logits) == len(rounds)
    np.testing.assert_array_equal(data.valid.sum(1), [r.verified for r in rounds])
    np.testing.assert_array_equal(data.labels.sum(1), [min(r.accepted, r.verified) for r in rounds])
    assert rounds[0].verified == 4  # the full policy ran, not the drafter's threshold policy
    no_head = make_drafter(target, block_size=4, enable_confidence_head=False)
    with pytest.raises(ValueError, match="no confidence head"):
        collect_calibration_data(target, no_head, torch.tensor([[1, 5]]))


# ----------------------------------------------------------------------------------------------------------------------
# `dspark-hf calibrate`
# ----------------------------------------------------------------------------------------------------------------------

WORDS = "the a of to and is in it you that he was for on are with as his they at be this have from or one".split()


def _save_tiny_chat_target(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        chat_template="{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
                      "{% if add_generation_prompt %}<s> {% endif %}",
    )
    target = make_target(vocab_size=len(vocab))
    target.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return target


@pytest.fixture
def calibration_setup(tmp_path):
    target = _save_tiny_chat_target(tmp_path / "target")
    make_drafter(target, block_size=3).save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"turns": [" ".join(WORDS[i:i + 6])]} for i in range(0, 18, 3)]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return tmp_path, prompts


def test_calibrate_command(calibration_setup):
    tmp_path, prompts = calibration_setup
    out = tmp_path / "calibrated"
    argv = ["--drafter", str(tmp_path / "drafter"), "--target", str(tmp_path / "target"), "--prompts", str(prompts),
            "--first_line", "2", "--num_prompts", "4", "--max_new_tokens", "12", "--output_dir", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "calibration_report.json").read_text())
    assert report["prompts"]["count"] == 4 and report["fit"]["num_prompts"] == 3 and report["eval"]["num_prompts"] == 1
    assert len(report["temperatures"]) == 3 and report["decoding"] == "greedy"
    for key in ("ece", "auroc", "brier", "per_position", "reliability"):
        assert key in report["fit"]["before"] and key in report["fit"]["after"]
    assert report["fit"]["after"]["ece"] <= report["fit"]["before"]["ece"] + 1e-12  # T = 1 is on the grid
    assert (out / "calibration_reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    reloaded = DSparkDrafter.from_pretrained(out)
    assert reloaded.config.confidence_temperatures == report["temperatures"]


def test_calibrate_in_place_rewrites_only_the_config(calibration_setup):
    tmp_path, prompts = calibration_setup
    drafter_dir = tmp_path / "drafter"
    weights = {p.name: p.read_bytes() for p in drafter_dir.iterdir() if p.name != "config.json"}
    argv = ["--drafter", str(drafter_dir), "--target", str(tmp_path / "target"), "--prompts", str(prompts),
            "--num_prompts", "2", "--max_new_tokens", "8", "--eval_fraction", "0", "--report", str(tmp_path / "r.json")]
    assert main(argv) == 0
    assert {p.name: p.read_bytes() for p in drafter_dir.iterdir() if p.name in weights} == weights
    temperatures = json.loads((tmp_path / "r.json").read_text())["temperatures"]
    assert DSparkDrafter.from_pretrained(drafter_dir).config.confidence_temperatures == temperatures
