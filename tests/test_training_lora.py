"""LoRA fine-tuning: train -> save adapter -> load -> generate with the PeftModel -> merge -> official layout."""

import json
from pathlib import Path

import datasets
import pytest
import torch
from peft import PeftModel

from dspark_hf import DSparkDrafter
from dspark_hf.training import lora, train
from dspark_hf.training.blocks import DSparkBlocks
from dspark_hf.training.collator import DSparkDataCollator
from dspark_hf.training.features import compute_target_signals
from dspark_hf.training.objective import drafter_block_states
from conftest import (
    char_tokenizer,
    greedy_outputs,
    greedy_tau,
    learnable_target,
    self_generated_examples,
    single_thread,
)


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


def test_add_lora_trains_only_adapters_and_the_confidence_head():
    target = learnable_target()
    model = lora.add_lora(DSparkDrafter.from_target(target, block_size=3, markov_rank=8), r=4)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name or "confidence_head" in name for name in trainable)
    assert any(".fc.lora_A" in name for name in trainable)
    assert not any("lm_head" in name or "embed_tokens" in name or "markov" in name for name in trainable)
    with pytest.raises(ValueError, match="rank"):
        lora.add_lora(DSparkDrafter.from_target(target, block_size=3), r=0)


def test_lora_round_trip_keeps_greedy_output_identical(tmp_path):
    target = learnable_target()
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    torch.manual_seed(0)
    base = DSparkDrafter.from_target(target, block_size=3, num_hidden_layers=1, markov_rank=8)
    base.save_pretrained(tmp_path / "base")
    (tmp_path / "data").mkdir()
    examples = self_generated_examples(target, 12, seed=3)
    datasets.Dataset.from_list(examples).to_parquet(str(tmp_path / "data" / "a.parquet"))

    argv = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "base"), "--lora_r", "4",
            "--merge", "--train_data", str(tmp_path / "data"), "--output_dir", str(tmp_path / "adapter"),
            "--max_steps", "6", "--learning_rate", "1e-2", "--num_anchors", "4", "--eval_split_size", "0",
            "--per_device_train_batch_size", "2", "--use_cpu", "--disable_tqdm", "true", "--save_strategy", "no"]
    assert train.main(argv) == 0
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert not (tmp_path / "adapter" / "config.json").exists()  # an adapter folder, not a drafter

    # load the adapter (its base drafter is found through adapter_config.json) and draft with the PeftModel
    peft_model = lora.load_lora_drafter(tmp_path / "adapter").eval()
    assert isinstance(peft_model, PeftModel)
    prompts = [example["input_ids"][:6] for example in self_generated_examples(target, 3, seed=4)]
    expected = greedy_outputs(target, prompts, max_new_tokens=16)
    _, with_lora = greedy_tau(target, peft_model, prompts, max_new_tokens=16)
    for got, want in zip(with_lora, expected):
        assert torch.equal(got, want)

    # merging gives the same drafter, in the official layout
    batch = DSparkDataCollator(block_size=3, mask_token_id=base.config.mask_token_id, num_anchors=4)(examples[:2])
    blocks = DSparkBlocks.from_dict(batch)
    signals = compute_target_signals(target, batch["input_ids"], batch["attention_mask"], [0, 1])
    with torch.no_grad():
        states_lora = drafter_block_states(peft_model, blocks, signals.context_features, 3)
    merged = lora.merge_lora(peft_model)
    assert type(merged) is DSparkDrafter
    with torch.no_grad():
        torch.testing.assert_close(drafter_block_states(merged, blocks, signals.context_features, 3), states_lora,
                                   atol=1e-5, rtol=1e-4)
    base_weights = DSparkDrafter.from_pretrained(tmp_path / "base").state_dict()
    assert not torch.equal(merged.state_dict()["layers.0.self_attn.q_proj.weight"],
                           base_weights["layers.0.self_attn.q_proj.weight"])  # the adapter did learn something

    merged_dir = tmp_path / "adapter" / "merged"
    config = json.loads((merged_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    from_disk = DSparkDrafter.from_pretrained(merged_dir).eval()
    for name, tensor in merged.state_dict().items():
        torch.testing.assert_close(from_disk.state_dict()[name], tensor, msg=name)
    _, with_merged = greedy_tau(target, from_disk, prompts, max_new_tokens=16)
    for got, want in zip(with_merged, expected):
        assert torch.equal(got, want)


def test_merge_command_line(tmp_path):
    target = learnable_target()
    base = DSparkDrafter.from_target(target, block_size=3, markov_rank=8)
    base.save_pretrained(tmp_path / "base")
    model = lora.add_lora(DSparkDrafter.from_pretrained(tmp_path / "base"), r=2)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.fill_(0.01)
    model.save_pretrained(tmp_path / "adapter")
    assert lora.main(["--adapter", str(tmp_path / "adapter"), "--output_dir", str(tmp_path / "merged"),
                      "--dtype", "bfloat16"]) == 0
    merged = DSparkDrafter.from_pretrained(tmp_path / "merged")
    assert merged.fc.weight.dtype == torch.bfloat16
    assert not torch.allclose(merged.fc.weight.float(), base.fc.weight, atol=1e-4)
    with pytest.raises(FileNotFoundError, match="adapter"):
        lora.load_lora_drafter(tmp_path / "base")


def test_adapter_loads_its_base_from_another_directory(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    DSparkDrafter.from_target(learnable_target(), block_size=3, markov_rank=8).save_pretrained("base")
    model = lora.add_lora(DSparkDrafter.from_pretrained("base"), r=2)  # the base named by a relative path
    model.save_pretrained("adapter")
    recorded = json.loads(Path("adapter/adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str((tmp_path / "run" / "base").resolve())

    monkeypatch.chdir(tmp_path / "elsewhere")
    loaded = lora.load_lora_drafter(tmp_path / "run" / "adapter")
    expected = {name: tensor for name, tensor in model.state_dict().items() if "lora_" in name}
    assert expected and all(torch.equal(loaded.state_dict()[name], tensor) for name, tensor in expected.items())
