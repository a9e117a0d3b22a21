"""The campaign's committed shards (scripts/pack_campaign_shards.py): compact, loadable, and skipped on resumption."""

import json
from pathlib import Path

import pytest

from dspark_hf.training.data import ShardWriter, load_training_dataset

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def packer(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import pack_campaign_shards

    return pack_campaign_shards


def _record(index: int) -> dict:
    return {"prompt_index": index, "input_ids": [1, 2, 3, 4 + index], "loss_mask": [0, 0, 1, 1], "prompt_length": 2,
            "num_loss_tokens": 2, "messages": json.dumps([{"role": "user", "content": "hi"}])}


def test_pack_keeps_training_fields_and_resumption(tmp_path, packer):
    work = tmp_path / "work"
    writer = ShardWriter(work, prefix="worker-0-of-1.shard-")
    writer.write([_record(0), _record(1)], [0, 1])
    writer.write([], [2])  # a shard whose prompts were all dropped
    (work / "worker-0-of-1.shard-00002.parquet").write_bytes(b"unfinished")  # no done file: not packed

    committed = tmp_path / "committed"
    assert packer.pack(work, committed) == ["worker-0-of-1.shard-00000", "worker-0-of-1.shard-00001"]
    assert packer.pack(work, committed) == []  # already packed
    assert not (committed / "worker-0-of-1.shard-00002.parquet").exists()

    packed, full = load_training_dataset(str(committed)), load_training_dataset(str(work))
    assert "messages" not in packed.column_names
    assert packed["input_ids"] == full["input_ids"] and packed["loss_mask"] == full["loss_mask"]

    # the next session starts from a copy of the committed folder and skips every prompt it records
    resumed = ShardWriter(committed, prefix="worker-0-of-1.shard-")
    assert resumed.done == {0, 1, 2} and resumed.next_shard == 2


def test_pack_names_a_missing_source(tmp_path, packer, capsys):
    with pytest.raises(SystemExit):
        packer.main([str(tmp_path / "nowhere"), str(tmp_path / "out")])
    assert "is not a folder" in capsys.readouterr().err
