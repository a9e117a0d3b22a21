"""Scale-out on this machine: `dspark-hf train` in two processes (DDP over gloo on CPU) under torchrun and accelerate
launch, its checkpoints and resumption; `dspark-hf prepare-data` split across two torchrun workers.

The commands are docs/training.md's, run through `distributed_worker.py`, which calls the same `main` and records
what each rank batched, saved and ended with.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
import transformers
from packaging import version
from safetensors.torch import load_file

import dspark_hf
from dspark_hf.interop import config_problems
from dspark_hf.training import data, train
from dspark_hf.training.data import load_training_dataset
from conftest import char_tokenizer, learnable_target, self_generated_examples, single_thread


pytestmark = pytest.mark.slow

WORKER = str(Path(__file__).with_name("distributed_worker.py"))
NUM_EXAMPLES = 16  # 4 steps per epoch at a global batch of 4: no uneven last batch that DDP would pad
TRAIN_OPTIONS = [
    "--block_size", "3", "--num_hidden_layers", "1", "--markov_rank", "8", "--target_layer_ids", "0", "1",
    # more anchors than a sequence has eligible positions: every rank takes them all, so the loss of a batch does not
    # depend on which process's random stream drew its anchors, and 1 and 2 processes can be compared
    "--num_anchors", "64", "--eval_split_size", "0", "--num_train_epochs", "2", "--learning_rate", "5e-3",
    "--save_strategy", "steps", "--save_steps", "3", "--logging_steps", "2", "--seed", "0",
    "--use_cpu", "--disable_tqdm", "true", "--report_to", "none",
]
STEPS_PER_EPOCH = 4


def launch_env(**extra: str) -> dict[str, str]:
    """The environment of a launched run: this checkout's `dspark_hf` first, one thread per process, offline."""
    src = str(Path(dspark_hf.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}


def run_launched(launcher: list[str], record_dir: Path, argv: list[str], **env: str) -> subprocess.CompletedProcess:
    record_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", *launcher, WORKER, str(record_dir), *argv]
    # TMPDIR: torchrun's per-run log folders (torchelastic_*) stay with the test's files instead of piling up in /tmp
    env = launch_env(TMPDIR=str(record_dir), **env)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def torchrun(record_dir: Path, argv: list[str], **env: str) -> subprocess.CompletedProcess:
    return run_launched(["torch.distributed.run", "--standalone", "--nproc_per_node", "2"], record_dir, argv, **env)


def accelerate_launch(record_dir: Path, argv: list[str], **env: str) -> subprocess.CompletedProcess:
    # `--cpu` would make accelerate start a single process (its multi-CPU launcher is mpirun); `--multi_gpu` starts
    # torchrun's workers, and `--use_cpu` of the training options keeps them on the CPU with gloo.
    launcher = ["accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port())]
    return run_launched(launcher, record_dir, argv, **env)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def succeeded(result: subprocess.CompletedProcess) -> bool:
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-5000:])
    return result.returncode == 0


def read_jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny learnable target saved with its tokenizer, and prepared data with a `prompt_index` per conversation."""
    root = tmp_path_factory.mktemp("distributed")
    with single_thread():
        target = learnable_target()
        examples = self_generated_examples(target, NUM_EXAMPLES, seed=2, new_tokens=12)
    target.save_pretrained(root / "target")
    char_tokenizer().save_pretrained(root / "target")
    (root / "data").mkdir()
    records = [{**example, "prompt_index": index} for index, example in enumerate(examples)]
    datasets.Dataset.from_list(records).to_parquet(str(root / "data" / "shard-00000.parquet"))
    return root


def train_argv(workspace: Path, output_dir: Path, *extra: str) -> list[str]:
    return ["train", "--target", str(workspace / "target"), "--train_data", str(workspace / "data"),
            "--output_dir", str(output_dir), *TRAIN_OPTIONS, *extra]


@pytest.fixture(scope="module")
def two_process_run(workspace):
    """The uninterrupted two-process run (global batch 4 = 2 processes x 2), 8 steps, checkpoints every 3."""
    records, output_dir = workspace / "records-torchrun", workspace / "run-torchrun"
    result = torchrun(records, train_argv(workspace, output_dir, "--per_device_train_batch_size", "2"))
    assert succeeded(result)
    return records, output_dir


def test_each_rank_trains_on_its_own_shard_and_the_ranks_stay_identical(two_process_run):
    records, _ = two_process_run
    batches = [read_jsonl(records / f"batches-rank{rank}.jsonl") for rank in (0, 1)]
    assert [len(b) for b in batches] == [2 * STEPS_PER_EPOCH] * 2
    for epoch in range(2):
        seen = [[i for batch in b[epoch * STEPS_PER_EPOCH:][:STEPS_PER_EPOCH] for i in batch] for b in batches]
        assert not set(seen[0]) & set(seen[1]), seen  # no sample on both ranks
        assert sorted(seen[0] + seen[1]) == list(range(NUM_EXAMPLES)), seen  # none twice, none missed
    assert batches[0][:STEPS_PER_EPOCH] != batches[0][STEPS_PER_EPOCH:]  # each epoch reshuffles

    for rank in (0, 1):  # the DDP wrapper was freed while the group was registered, so no rank can hang at exit
        assert read_jsonl(records / f"teardown-rank{rank}.jsonl") == [{"wrappers": 1, "alive": 0}]

    weights = [load_file(records / f"weights-rank{rank}.safetensors") for rank in (0, 1)]
    # every rank applies the same all-reduced gradient to the same weights: identical bit for bit
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


def test_two_processes_match_one_process_with_the_same_global_batch(two_process_run, workspace, tmp_path):
    _, output_dir = two_process_run
    with single_thread():
        assert train.main(train_argv(workspace, tmp_path / "one", "--per_device_train_batch_size", "4")[1:]) == 0
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(output_dir / "model.safetensors")
    first_checkpoint = load_file(output_dir / "checkpoint-3" / "model.safetensors")
    assert one.keys() == two.keys()
    changed = 0
    for name in one:
        # Same samples per step, same global loss normalization; only the float32 summation order differs (the
        # gradient all-reduce adds the two ranks' halves, one process sums all four sequences at once). That is
        # ~1e-7 relative per step; after 8 Adam steps the weights differed by at most 3e-7 when this was written.
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-5, msg=name)
        changed += not torch.equal(one[name], first_checkpoint[name])
    assert changed > 0  # training moved the weights after the first checkpoint


def test_checkpoints_are_written_once_by_rank_zero_in_the_official_layout(two_process_run):
    records, output_dir = two_process_run
    assert not (records / "saves-rank1.jsonl").exists()
    saved = read_jsonl(records / "saves-rank0.jsonl")
    expected = [str(output_dir / f"checkpoint-{step}") for step in (3, 6, 8)] + [str(output_dir)]
    assert saved == expected
    for folder in saved:
        config = json.loads((Path(folder) / "config.json").read_text())
        assert config_problems(config) == [], folder
        assert (Path(folder) / "model.safetensors").exists()


@pytest.mark.skipif(
    version.parse(transformers.__version__) < version.parse("5.18"),
    reason="transformers 5.16-5.17's Trainer loads a multi-process run's optimizer onto args.device, which accelerate "
    "launch on CPUs makes `cpu:0`, a location torch.load refuses (from 5.18 it loads onto the CPU)")
def test_accelerate_launch_run_interrupted_after_a_checkpoint_resumes_to_the_same_weights(
    two_process_run, workspace
):
    """Through `accelerate launch` instead of torchrun, which adds accelerate's launcher and the environment it sets
    for the `Trainer`'s `Accelerator` (ACCELERATE_* mixed precision, dynamo, CPU) on top of what torchrun covers, then
    a real interruption: the run dies after step 5, and a new launch resumes it from checkpoint-3 (mid-epoch)."""
    uninterrupted_records, uninterrupted_dir = two_process_run
    records, output_dir = workspace / "records-accelerate", workspace / "run-accelerate"
    argv = train_argv(workspace, output_dir, "--per_device_train_batch_size", "2")
    interrupted = accelerate_launch(records, argv, DSPARK_TEST_INTERRUPT_AT="5")
    assert interrupted.returncode != 0 and "simulated interruption after step 5" in interrupted.stderr
    for rank in (0, 1):  # a run that raised tears down in the same order as one that finished
        assert read_jsonl(records / f"teardown-rank{rank}.jsonl") == [{"wrappers": 1, "alive": 0}]
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-3"]
    checkpoint = load_file(output_dir / "checkpoint-3" / "model.safetensors")
    expected = load_file(uninterrupted_dir / "checkpoint-3" / "model.safetensors")
    assert all(torch.equal(checkpoint[name], expected[name]) for name in expected)  # both launchers train alike

    resumed_records = workspace / "records-resumed"
    resumed = torchrun(resumed_records, argv + ["--resume_from_checkpoint", str(output_dir / "checkpoint-3")])
    assert succeeded(resumed)
    for rank in (0, 1):  # the data order goes on where it stopped: the rest of epoch 1, then epoch 2
        assert (read_jsonl(resumed_records / f"batches-rank{rank}.jsonl")
                == read_jsonl(uninterrupted_records / f"batches-rank{rank}.jsonl")[3:])
    final, expected = load_file(output_dir / "model.safetensors"), load_file(uninterrupted_dir / "model.safetensors")
    # the checkpoint restores weights, optimizer, schedule and every rank's RNG: the same updates, bit for bit
    assert all(torch.equal(final[name], expected[name]) for name in expected)


def test_prepare_data_under_torchrun_splits_the_prompts_across_workers(workspace, tmp_path):
    """Each worker takes RANK / WORLD_SIZE from torchrun: disjoint parts whose union is the one-process output."""
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"Prompt {i}" + "?" * i}) + "\n" for i in range(6)))
    options = ["--prompts", str(source), "--target", str(workspace / "target"), "--device", "cpu",
               "--max_new_tokens", "8", "--min_loss_tokens", "1", "--batch_size", "2"]
    result = torchrun(tmp_path / "records", ["prepare-data", *options, "--output_dir", str(tmp_path / "two")])
    assert succeeded(result)
    with single_thread():
        assert data.main([*options, "--output_dir", str(tmp_path / "one")]) == 0
    written = {int(path.name.split("-")[1]): load_training_dataset(str(path))["prompt_index"]
               for path in (tmp_path / "two").glob("worker-*-of-2.shard-*.parquet")}
    assert written == {0: [0, 2, 4], 1: [1, 3, 5]}
    one, two = (load_training_dataset(str(tmp_path / name)).sort("prompt_index") for name in ("one", "two"))
    assert one.to_list() == two.to_list()
