"""Training end to end on a tiny target: the loss falls and tau through `generate` rises; the CLI; checkpoints."""

import json

import datasets
import pytest
import torch
from safetensors import safe_open

from dspark_hf import DSparkDrafter
from dspark_hf.training import train
from dspark_hf.training.collator import DSparkDataCollator
from dspark_hf.training.train import DSparkTrainer, DSparkTrainingArguments
from dspark_hf.vocabulary import count_response_tokens, select_draft_vocabulary, special_token_ids
from conftest import char_tokenizer, learnable_target, self_generated_examples, single_thread


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


def _training_args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, learning_rate=5e-3,
                  logging_steps=10, eval_strategy="no", save_strategy="no", use_cpu=True, disable_tqdm=True,
                  report_to="none", warmup_steps=0.1, seed=0)
    values.update(overrides)
    return DSparkTrainingArguments(**values)


def test_training_lowers_the_loss_and_raises_tau_through_generate(tmp_path):
    target = learnable_target()
    # the target's own greedy continuations: what prepare-data would produce, and learnable
    train_set = datasets.Dataset.from_list(self_generated_examples(target, 48, seed=0))
    held_out = self_generated_examples(target, 6, seed=1)
    torch.manual_seed(1)
    drafter = DSparkDrafter.from_target(target, block_size=4, num_hidden_layers=1, markov_rank=8)
    trainer = DSparkTrainer(
        model=drafter,
        target=target,
        tau_prompts=[example["input_ids"][: example["prompt_length"]] for example in held_out],
        tau_max_new_tokens=30,
        pad_token_id=0,
        args=_training_args(tmp_path, max_steps=120, eval_strategy="steps", eval_steps=120),
        train_dataset=train_set,
        eval_dataset=datasets.Dataset.from_list(held_out),
        data_collator=DSparkDataCollator(block_size=4, mask_token_id=0, num_anchors=16),
    )
    embedding_before = drafter.embed_tokens.weight.clone()
    drafter.verification_policy = "threshold"
    policies, generate = [], target.generate
    target.generate = lambda **kwargs: policies.append(drafter.verification_policy) or generate(**kwargs)
    tau_before = trainer.measure_tau()["eval_tau"]
    del target.generate
    # tau measures the drafter: full blocks whatever the policy set (the default one would depend on timings)
    assert policies == ["full"] * len(held_out) and drafter.verification_policy == "threshold"
    trainer.train()

    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs[-1]["loss"] < 0.85 * logs[0]["loss"], logs
    assert {"loss_ce", "loss_tv", "loss_confidence"} <= set(logs[0])
    (evaluation,) = [entry for entry in trainer.state.log_history if "eval_tau" in entry]
    assert {"eval_loss", "eval_loss_tv", "eval_acceptance_rate"} <= set(evaluation)
    assert evaluation["eval_tau"] > tau_before + 0.2, (tau_before, evaluation)
    torch.testing.assert_close(drafter.embed_tokens.weight, embedding_before)  # frozen


def _save_target(tmp_path):
    target = learnable_target()
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    return target


def _save_data(tmp_path, target, name="data", count=12):
    folder = tmp_path / name
    folder.mkdir()
    datasets.Dataset.from_list(self_generated_examples(target, count, seed=2)).to_parquet(str(folder / "a.parquet"))
    return str(folder)


def test_cli_trains_with_a_feature_cache_and_saves_the_official_layout(tmp_path, monkeypatch):
    target = _save_target(tmp_path)
    data_dir = _save_data(tmp_path, target)
    runs = []
    original = train.compute_dspark_loss
    monkeypatch.setattr(train, "compute_dspark_loss", lambda *a, **k: runs.append(1) or original(*a, **k))
    argv = ["--target", str(tmp_path / "target"), "--train_data", data_dir, "--output_dir", str(tmp_path / "run"),
            "--block_size", "3", "--num_hidden_layers", "1", "--markov_rank", "8", "--target_layer_ids", "0", "1",
            "--num_anchors", "4", "--feature_cache", str(tmp_path / "cache"), "--eval_split_size", "2",
            "--tau_eval_prompts", "2", "--tau_max_new_tokens", "8", "--num_train_epochs", "2",
            "--per_device_train_batch_size", "2", "--use_cpu", "--disable_tqdm", "true", "--logging_steps", "2"]
    assert train.main(argv + ["--save_dtype", "bfloat16"]) == 0
    assert len(runs) == 2 * 5 + 2 * 2  # 10 training rows / batch 2, 2 epochs; 2 eval rows, 2 evaluations
    assert len(list((tmp_path / "cache").glob("*/*.safetensors"))) == 12

    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == 3 and config["num_anchors"] == 4 and config["target_layer_ids"] == [0, 1]
    with safe_open(str(tmp_path / "run" / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
        assert handle.get_tensor("fc.weight").dtype == torch.bfloat16  # as the official releases
    assert {"embed_tokens.weight", "lm_head.weight", "fc.weight", "markov_head.markov_w1.weight",
            "confidence_head.proj.weight"} <= names
    drafter = DSparkDrafter.from_pretrained(tmp_path / "run")
    assert list((tmp_path / "run").glob("checkpoint-*"))

    # resume from it: fine-tuning a trained drafter keeps its architecture
    argv_resume = [a if a != str(tmp_path / "run") else str(tmp_path / "run2") for a in argv]
    argv_resume += ["--drafter", str(tmp_path / "run"), "--max_steps", "1"]
    assert train.main(argv_resume) == 0
    assert DSparkDrafter.from_pretrained(tmp_path / "run2").config.block_size == drafter.config.block_size


def test_no_data_and_bad_data_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="prepare-data"):
        train.prepare_datasets(train.DSparkDataArguments(train_data=[]), seed=0)
    folder = tmp_path / "empty"
    folder.mkdir()
    datasets.Dataset.from_list([{"input_ids": [1, 2, 3], "loss_mask": [0, 0, 1]}]).to_parquet(str(folder / "a.parquet"))
    with pytest.raises(ValueError, match="two consecutive"):
        train.prepare_datasets(train.DSparkDataArguments(train_data=[str(folder)]), seed=0)
    assert train.prompt_ids({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}) == [5, 6]


def test_architecture_options_apply_to_new_drafters_and_must_agree_with_a_loaded_one(tmp_path):
    target = learnable_target()
    new = train.build_drafter(train.DSparkModelArguments(markov_rank=0, block_size=3), target)
    assert new.config.markov_rank == 0 and new.config.block_size == 3
    assert new.config.num_hidden_layers == train.NEW_DRAFTER_DEFAULTS["num_hidden_layers"]
    DSparkDrafter.from_target(target, block_size=3, markov_rank=8).save_pretrained(tmp_path / "d")

    same = train.DSparkModelArguments(drafter=str(tmp_path / "d"), markov_rank=8, block_size=3)
    assert train.build_drafter(same, target).config.markov_rank == 8
    with pytest.raises(ValueError, match=r"--markov_rank 0 \(the drafter has 8\).*drop --drafter"):
        train.build_drafter(train.DSparkModelArguments(drafter=str(tmp_path / "d"), markov_rank=0), target)
    DSparkDrafter.from_target(target, block_size=3, markov_rank=0).save_pretrained(tmp_path / "dflash")
    dflash = train.DSparkModelArguments(drafter=str(tmp_path / "dflash"), markov_rank=0, markov_head_type="gated")
    assert train.build_drafter(dflash, target).config.markov_rank == 0  # no Markov head: its type does not apply
    with pytest.raises(ValueError, match=r"--num_hidden_layers 2 \(the drafter has 1\)"):
        train.build_drafter(train.DSparkModelArguments(drafter=str(tmp_path / "d"), num_hidden_layers=2), target)


def _cli_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    stderr = capsys.readouterr().err
    error = stderr.splitlines()[-1]  # after any loading progress bars
    assert exit_info.value.code == 2 and "Traceback" not in stderr, stderr
    assert error.startswith("dspark-hf train: error: "), stderr
    return error


def test_bad_training_data_paths_are_one_line_errors_naming_the_fix(tmp_path, capsys):
    output = ["--output_dir", str(tmp_path / "run")]
    error = _cli_error(["--train_data", "/nonexistent"] + output, capsys)
    assert "No training data at '/nonexistent'; make it with `dspark-hf prepare-data --output_dir /nonexist" in error
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("not data")
    error = _cli_error(["--train_data", str(tmp_path / "notes")] + output, capsys)
    assert "holds no parquet shards" in error and "`dspark-hf prepare-data` output folder" in error


@pytest.mark.parametrize("lora", [False, True])
def test_a_reduced_compact_drafter_trains_over_its_draft_vocabulary(tmp_path, lora):
    target = _save_target(tmp_path)
    drafter = DSparkDrafter.from_target(target, block_size=3, markov_rank=8)
    drafter.reduce_vocabulary(torch.arange(40))
    drafter.save_compact(tmp_path / "reduced")  # compact, as shipped: loaded with --target
    argv = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "reduced"), "--max_steps", "2",
            "--num_anchors", "4", "--train_data", _save_data(tmp_path, target), "--output_dir", str(tmp_path / "run"),
            "--use_cpu", "--disable_tqdm", "true", "--report_to", "none"]
    assert train.main(argv + (["--lora_r", "4", "--merge"] if lora else [])) == 0
    trained = DSparkDrafter.from_pretrained(tmp_path / "run" / ("merged" if lora else ""))
    assert trained.config.draft_vocab_size == 40 and torch.equal(trained.draft_token_ids, torch.arange(40))
    assert not torch.equal(trained.fc.weight, drafter.fc.weight)


def test_draft_vocab_size_trains_a_new_drafter_over_the_most_frequent_response_ids(tmp_path, capsys):
    target = _save_target(tmp_path)
    data_dir = _save_data(tmp_path, target)
    common = ["--target", str(tmp_path / "target"), "--train_data", data_dir, "--num_anchors", "4", "--max_steps", "2",
              "--use_cpu", "--disable_tqdm", "true", "--report_to", "none", "--eval_strategy", "no"]
    new = ["--block_size", "3", "--markov_rank", "8", "--draft_vocab_size", "24", "--output_dir", str(tmp_path / "run")]
    assert train.main(common + new) == 0
    trained = DSparkDrafter.from_pretrained(tmp_path / "run")
    counts = count_response_tokens(data_dir)
    expected = select_draft_vocabulary(counts, 24, target.config.vocab_size, special_token_ids(trained.config))
    assert trained.config.draft_vocab_size == 24 and trained.draft_token_ids.tolist() == expected
    # a trained drafter keeps its draft vocabulary: another size is refused in one line that says what to do
    with pytest.raises(SystemExit):
        train.main(common + ["--drafter", str(tmp_path / "run"), "--draft_vocab_size", "16", "--output_dir",
                             str(tmp_path / "again")])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--draft_vocab_size 16 (the drafter has 24)" in error and "reduce-vocab" in error


def test_a_new_drafter_can_start_from_target_layers():
    target = learnable_target()
    args = train.DSparkModelArguments(block_size=3, num_hidden_layers=2, markov_rank=8, init_from_target_layers=[1, 0])
    drafter = train.build_drafter(args, target)
    for draft_layer, index in zip(drafter.layers, [1, 0]):
        source = target.model.layers[index]
        torch.testing.assert_close(draft_layer.self_attn.q_proj.weight, source.self_attn.q_proj.weight, rtol=0, atol=0)
        torch.testing.assert_close(draft_layer.mlp.down_proj.weight, source.mlp.down_proj.weight, rtol=0, atol=0)
        torch.testing.assert_close(draft_layer.input_layernorm.weight, source.input_layernorm.weight, rtol=0, atol=0)
    assert drafter.init_layers_from_target(target, [1, 0]) == ["self_attn.k_norm.weight", "self_attn.q_norm.weight"]
    with pytest.raises(ValueError, match="one target layer in"):
        drafter.init_layers_from_target(target, [0])
    with pytest.raises(ValueError, match="already trained"):
        train.build_drafter(train.DSparkModelArguments(drafter="some/dir", init_from_target_layers=[0]), target)


def test_a_compact_drafter_is_loaded_with_the_given_target(tmp_path):
    target = learnable_target()
    DSparkDrafter.from_target(target, block_size=3, markov_rank=8).save_compact(tmp_path / "compact")
    drafter = train.build_drafter(train.DSparkModelArguments(drafter=str(tmp_path / "compact")), target)
    torch.testing.assert_close(drafter.lm_head.weight, target.lm_head.weight)


def test_help_lists_dspark_and_common_options_and_every_option_still_parses(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    short = capsys.readouterr().out
    assert short.startswith("usage: dspark-hf train") and "--help-all" in short
    assert "--num_anchors" in short and "--learning_rate" in short and "--resume_from_checkpoint" in short
    assert "--adam_beta2" not in short and "--dataloader_num_workers" not in short
    with pytest.raises(SystemExit):
        train.main(["--help-all"])
    full = capsys.readouterr().out
    assert "--adam_beta2" in full and "--num_anchors" in full and len(full) > 2 * len(short)
    *_, training_args = train.parse_args(["--output_dir", "x", "--adam_beta2", "0.95", "--dataloader-num-workers", "1"])
    assert training_args.adam_beta2 == 0.95 and training_args.dataloader_num_workers == 1


def _grow_argv(tmp_path, target, drafter: str, option: str, value: str) -> list[str]:
    """A two-step `dspark-hf train` run that widens the drafter saved at `tmp_path / drafter` (the grow option at
    argv[4:6])."""
    return ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / drafter), option, value, "--max_steps",
            "2", "--num_anchors", "4", "--train_data", _save_data(tmp_path, target), "--output_dir",
            str(tmp_path / "run"), "--use_cpu", "--disable_tqdm", "true", "--report_to", "none", "--eval_strategy", "no"]


def _block_logits(drafter, *models) -> list[torch.Tensor]:
    """Each model's draft logits for one random block of 3 over 5 context slots (the same inputs for all; `drafter`
    sets their shapes)."""
    hidden = torch.randn(2, 5, len(drafter.config.target_layer_ids) * drafter.config.hidden_size)
    ids = torch.randint(0, drafter.config.vocab_size, (2, 3))
    positions, context_positions = torch.arange(5, 8).expand(2, 3), torch.arange(5).expand(2, 5)
    with torch.no_grad():
        return [model(ids, target_hidden_states=hidden, position_ids=positions, context_position_ids=context_positions
                      ).logits for model in models]


def test_grown_layers_start_as_the_identity_and_train(tmp_path, capsys):
    target = _save_target(tmp_path)
    drafter = DSparkDrafter.from_target(target, block_size=3, markov_rank=8)
    drafter.save_pretrained(tmp_path / "one")
    grown = train.build_drafter(train.DSparkModelArguments(drafter=str(tmp_path / "one"), grow_layers=1), target)
    assert grown.config.num_hidden_layers == 2 and len(grown.layers) == 2
    assert grown.config.layer_types == ["full_attention"] * 2
    # same drafts, same confidences: the new layer passes its input through until training moves it
    before, after = _block_logits(drafter, drafter.float(), grown)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert not torch.equal(grown.layers[1].self_attn.q_proj.weight, torch.zeros_like(grown.layers[1].self_attn.q_proj.weight))

    argv = _grow_argv(tmp_path, target, "one", "--grow_layers", "1")
    assert train.main(argv) == 0
    trained = DSparkDrafter.from_pretrained(tmp_path / "run")
    assert trained.config.num_hidden_layers == 2
    assert trained.layers[1].self_attn.o_proj.weight.abs().sum() > 0  # the zeroed branch is learning

    with pytest.raises(ValueError, match="widens a trained drafter: give it with --drafter"):
        train.build_drafter(train.DSparkModelArguments(grow_layers=1), target)
    error = _cli_error(argv[:4] + ["--grow_layers", "0"] + argv[6:], capsys)
    assert "grow by 0 layers: give at least 1" in error


def test_a_grown_markov_rank_keeps_drafts_and_confidences_and_trains(tmp_path, capsys):
    target = _save_target(tmp_path)
    drafter = DSparkDrafter.from_target(target, block_size=3, markov_rank=8)
    drafter.save_pretrained(tmp_path / "rank8")
    grown = train.build_drafter(train.DSparkModelArguments(drafter=str(tmp_path / "rank8"), grow_markov_rank=24),
                                target)
    assert grown.config.markov_rank == 24 and grown.markov_head.markov_w2.weight.shape[-1] == 24
    assert grown.confidence_head.proj.in_features == grown.config.hidden_size + 24
    # the same bias and confidences for every previous token: the new directions start without effect
    drafter.float()
    previous = torch.arange(target.config.vocab_size)
    hidden = torch.randn(target.config.vocab_size, grown.config.hidden_size)
    with torch.no_grad():
        before, after = ((model.markov_head(previous, hidden)[0], model.confidence_logits(hidden, previous))
                         for model in (drafter, grown))
    for grown_values, values in zip(after, before):  # bias, then confidence logits
        torch.testing.assert_close(grown_values, values, rtol=0, atol=1e-6)
    assert grown.markov_head.markov_w1.weight[:, 8:].abs().sum() > 0  # so the new W2 columns get a gradient

    argv = _grow_argv(tmp_path, target, "rank8", "--grow_markov_rank", "24")
    assert train.main(argv) == 0
    trained = DSparkDrafter.from_pretrained(tmp_path / "run")
    assert trained.config.markov_rank == 24
    assert trained.markov_head.markov_w2.weight[:, 8:].abs().sum() > 0  # the zeroed directions are learning

    with pytest.raises(ValueError, match="widens a trained drafter: give it with --drafter DIR, or build a new "
                                         "drafter with --markov_rank N"):
        train.build_drafter(train.DSparkModelArguments(grow_markov_rank=24), target)
    error = _cli_error(argv[:4] + ["--grow_markov_rank", "8"] + argv[6:], capsys)
    assert "grow the Markov rank to 8: give a rank above the drafter's 8" in error
    DSparkDrafter.from_target(target, block_size=3, markov_rank=0).save_pretrained(tmp_path / "dflash")
    with pytest.raises(ValueError, match="only a vanilla Markov head can grow, this drafter has no Markov head"):
        train.build_drafter(train.DSparkModelArguments(drafter=str(tmp_path / "dflash"), grow_markov_rank=16), target)


def test_a_dropped_markov_head_leaves_the_dflash_ablation_and_trains(tmp_path, capsys):
    target = _save_target(tmp_path)
    drafter = DSparkDrafter.from_target(target, block_size=3, markov_rank=8)
    with torch.no_grad():  # a head whose bias and confidence weights matter
        drafter.markov_head.markov_w2.weight.normal_()
        drafter.confidence_head.proj.weight.normal_()
    drafter.save_pretrained(tmp_path / "dspark")
    ablation = train.build_drafter(train.DSparkModelArguments(drafter=str(tmp_path / "dspark"), drop_markov_head=True),
                                   target)
    assert ablation.config.markov_rank == 0 and ablation.markov_head is None
    assert ablation.confidence_head.proj.in_features == ablation.config.hidden_size
    # the ablation drafts and scores as the drafter would with its Markov embedding zeroed (no bias, no embedding)
    zeroed = DSparkDrafter.from_pretrained(tmp_path / "dspark", target=target, dtype=torch.float32)
    with torch.no_grad():
        zeroed.markov_head.markov_w1.weight.zero_()
    after, before = _block_logits(drafter, ablation, zeroed)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)
    states = torch.randn(4, drafter.config.hidden_size)
    previous = torch.randint(0, target.config.vocab_size, (4,))
    with torch.no_grad():
        torch.testing.assert_close(ablation.confidence_logits(states, previous), zeroed.confidence_logits(states, previous),
                                   rtol=0, atol=1e-6)
        # and not as the drafter with its head: the head did change its confidences
        assert not torch.allclose(drafter.float().confidence_logits(states, previous),
                                  ablation.confidence_logits(states, previous))

    argv = _grow_argv(tmp_path, target, "dspark", "--drop_markov_head", "true")
    assert train.main(argv) == 0
    trained = DSparkDrafter.from_pretrained(tmp_path / "run")
    assert trained.config.markov_rank == 0 and trained.markov_head is None

    with pytest.raises(ValueError, match="--drop_markov_head changes a trained drafter: give it with --drafter DIR"):
        train.build_drafter(train.DSparkModelArguments(drop_markov_head=True), target)
    error = _cli_error(argv + ["--grow_markov_rank", "16"], capsys)
    assert "--drop_markov_head and --grow_markov_rank contradict each other" in error
    with pytest.raises(ValueError, match="drop the Markov head: this drafter has none"):
        train.build_drafter(train.DSparkModelArguments(drafter=str(tmp_path / "run"), drop_markov_head=True), target)
