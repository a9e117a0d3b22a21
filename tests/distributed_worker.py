"""`dspark-hf train` (or `prepare-data`) as launched by torchrun / accelerate launch, recording per rank what the
multi-process tests check (no tests here).

    torchrun --standalone --nproc_per_node 2 tests/distributed_worker.py RECORD_DIR train --target ... --output_dir ...

runs the command's own `main` unchanged and writes to RECORD_DIR:

- `batches-rank{R}.jsonl`: the `prompt_index` of every example each batch of this rank held, in order;
- `saves-rank{R}.jsonl`: every folder this rank wrote a drafter to (`save_pretrained`);
- `weights-rank{R}.safetensors`: this rank's drafter weights after training;
- `teardown-rank{R}.jsonl`: at `destroy_process_group`, whether a DDP wrapper was still alive (none may be: its
  `Reducer` freeing the gloo group can deadlock the rank at exit).

With `DSPARK_TEST_INTERRUPT_AT=N` every rank raises after step N, as a run killed there would stop.
"""

from __future__ import annotations

import json
import os
import sys
import weakref

import torch.distributed
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from dspark_hf import DSparkDrafter
from dspark_hf.training import data, train
from dspark_hf.training.collator import DSparkDataCollator


RANK = int(os.environ.get("RANK", "0"))


class Interrupt(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError(f"simulated interruption after step {self.step}")


def _append(record_dir: str, name: str, entry) -> None:
    with open(os.path.join(record_dir, f"{name}-rank{RANK}.jsonl"), "a") as handle:
        handle.write(json.dumps(entry) + "\n")


def _record(record_dir: str) -> None:
    collate = DSparkDataCollator.__call__
    save = DSparkDrafter.save_pretrained
    build_trainer = train.build_trainer
    save_final = train.save_final

    def recording_collate(self, examples):
        _append(record_dir, "batches", [example["prompt_index"] for example in examples])
        return collate(self, examples)

    def recording_save(self, save_directory, *args, **kwargs):
        _append(record_dir, "saves", str(save_directory))
        return save(self, save_directory, *args, **kwargs)

    def interruptible_build_trainer(*args, **kwargs):
        trainer = build_trainer(*args, **kwargs)
        if os.environ.get("DSPARK_TEST_INTERRUPT_AT"):
            trainer.add_callback(Interrupt(int(os.environ["DSPARK_TEST_INTERRUPT_AT"])))
        return trainer

    wrappers = []
    destroy = torch.distributed.destroy_process_group
    wrap = DistributedDataParallel.__init__

    def recording_wrap(self, *args, **kwargs):
        wrappers.append(weakref.ref(self))
        return wrap(self, *args, **kwargs)

    def recording_destroy(*args, **kwargs):
        _append(record_dir, "teardown", {"wrappers": len(wrappers),
                                         "alive": sum(ref() is not None for ref in wrappers)})
        return destroy(*args, **kwargs)

    def recording_save_final(trainer, *args, **kwargs):
        model = trainer.accelerator.unwrap_model(trainer.model)
        weights = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
        save_file(weights, os.path.join(record_dir, f"weights-rank{RANK}.safetensors"))
        return save_final(trainer, *args, **kwargs)

    DSparkDataCollator.__call__ = recording_collate
    DSparkDrafter.save_pretrained = recording_save
    train.build_trainer = interruptible_build_trainer
    train.save_final = recording_save_final
    torch.distributed.destroy_process_group = recording_destroy
    DistributedDataParallel.__init__ = recording_wrap


if __name__ == "__main__":
    record_dir, command, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    _record(record_dir)
    sys.exit({"train": train.main, "prepare-data": data.main}[command](argv))
