"""`dspark-hf profile`: what is timed, how the profile is stored and read back. No timing is asserted: a fake clock
advanced by the forwards themselves makes the measured curve exact."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_drafter, make_target, with_cache
from dspark_hf._transformers_compat import hidden_states_request
from dspark_hf.generation.policies import HardwareAwarePolicy
from dspark_hf.profiling import (
    PROFILE_FILE_NAME,
    load_speed_tables,
    load_steps_per_second,
    main,
    profile_dtype_mismatch,
    profile_steps_per_second,
    save_profile,
    time_verification_forwards,
)
from dspark_hf.scheduling import schedule_verification_lengths, verification_capacity


# A CPU-like jagged cost (seconds per forward by tokens per row): a cliff from 1 to 2 tokens, then a dip at 4.
COST = {1: 0.010, 2: 0.028, 3: 0.029, 4: 0.027, 5: 0.031}


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ClockedTarget(torch.nn.Module):
    """Runs the real tiny target, then advances the fake clock by `COST[k] · rows` (and records the cache length
    each forward saw)."""

    def __init__(self, target, clock):
        super().__init__()
        self.target, self.clock, self.cache_lengths = target, clock, []
        self.config = target.config

    @property
    def device(self):
        return self.target.device

    def forward(self, input_ids, cache, use_cache, **kwargs):
        self.cache_lengths.append(cache.get_seq_length())
        output = self.target(input_ids=input_ids, **with_cache(cache), use_cache=use_cache, **kwargs)
        self.clock.now += COST.get(input_ids.shape[1], 0.0) * input_ids.shape[0]
        return output


def test_profile_recovers_a_jagged_curve_exactly():
    clock = FakeClock()
    model = ClockedTarget(make_target(), clock)
    profile = profile_steps_per_second(model, max_tokens=5, batch_sizes=[1, 2], context_length=16, warmup=1,
                                       repeats=3, timer=clock)
    expected = {str(k): pytest.approx(1.0 / c) for k, c in COST.items()}
    assert profile["steps_per_second"] == expected
    assert profile["by_batch_size"]["2"] == {str(k): pytest.approx(0.5 / c) for k, c in COST.items()}
    assert all(len(t) == 3 for t in profile["seconds"]["1"].values())
    # Every timed forward ran over exactly the context (the verified tokens were cropped away each time);
    # the first call of each batch size is the prefill.
    assert model.cache_lengths.count(0) == 2 and set(model.cache_lengths) == {0, 16}
    assert len(model.cache_lengths) == 2 * (1 + (1 + 3) * 5)
    settings, metadata = profile["settings"], profile["metadata"]
    assert settings["context_length"] == 16 and settings["batch_sizes"] == [1, 2]
    for key in ("device", "device_name", "cpu", "torch", "transformers", "torch_num_threads", "date"):
        assert key in metadata


def test_batches_are_timed_as_the_batched_engine_runs_them():
    """One row is timed as `generate` decodes (transformers' cache, no mask); several rows as the batched engine's
    forwards run (its appending cache, a mask over the slots with a padding slot per row): without a mask
    transformers takes another attention path, and the costs the engine plans with would not be its own."""
    from dspark_hf.generation.cache_ops import AppendingLayer

    seen = []

    class Recording(ClockedTarget):
        def forward(self, input_ids, cache, use_cache, **kwargs):
            seen.append((input_ids.shape, type(cache.layers[0]), kwargs.get("attention_mask")))
            return super().forward(input_ids, cache, use_cache, **kwargs)

    clock = FakeClock()
    profile = profile_steps_per_second(Recording(make_target(), clock), max_tokens=3, batch_sizes=[1, 2],
                                       context_length=6, warmup=0, repeats=1, timer=clock)
    assert profile["settings"]["batched_layout"] == "engine"
    one_row = [s for s in seen if s[0][0] == 1]
    two_rows = [s for s in seen if s[0][0] == 2]
    assert one_row and all(mask is None and layer is not AppendingLayer for _, layer, mask in one_row)
    assert two_rows and all(layer is AppendingLayer for _, layer, _ in two_rows)
    for shape, _, mask in two_rows:
        width = 6 if shape[1] == 6 else 6 + shape[1]  # the prefill, then k new tokens over the 6-slot context
        assert mask.shape == (2, width) and not mask[:, 0].any() and mask[:, 1:].all()
    # the timings are the same forwards': the fake clock charges COST[k] per row either way
    assert profile["by_batch_size"]["2"] == {str(k): pytest.approx(0.5 / COST[k]) for k in (1, 2, 3)}


def test_a_profile_of_several_rows_timed_the_old_way_is_flagged(tmp_path, caplog):
    clock = FakeClock()
    profile = profile_steps_per_second(ClockedTarget(make_target(), clock), max_tokens=2, batch_sizes=[1, 2],
                                       context_length=4, warmup=0, repeats=1, timer=clock)
    save_profile(profile, tmp_path / "now.json")
    del profile["settings"]["batched_layout"]  # as profiles measured before 2026-12-07 are
    save_profile(profile, tmp_path / "before.json")
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            assert load_speed_tables(tmp_path / "now.json") == load_speed_tables(tmp_path / "before.json")
    finally:
        hf_logging.disable_propagation()
    flagged = [r.getMessage() for r in caplog.records if "re-profile" in r.getMessage()]
    assert len(flagged) == 1 and "before.json" in flagged[0]


def test_a_profiled_cliff_drives_the_scheduler(tmp_path):
    clock = FakeClock()
    profile = profile_steps_per_second(ClockedTarget(make_target(), clock), max_tokens=5, context_length=8,
                                       warmup=0, repeats=1, timer=clock)
    path = save_profile(profile, tmp_path)
    assert path == tmp_path / PROFILE_FILE_NAME
    table = load_steps_per_second(tmp_path)
    assert table == {k: pytest.approx(1.0 / c) for k, c in COST.items()}
    # The 1 -> 2 token cliff (2.8x the cost) stops Algorithm 1 even for certain drafts (Θ_1 = 2 · 35.7 < 100)...
    assert schedule_verification_lengths([[1.0] * 4], table) == [0]
    assert HardwareAwarePolicy.from_profile(path).verification_length([1.0] * 4) == 0
    # ...while the production variant's global search sees that 4 drafts pay (Θ_4 = 5 · 32.3 > 100).
    assert verification_capacity([[1.0] * 4], table) == 4
    assert verification_capacity([[0.5] * 4], table) == 0


def test_load_steps_per_second_accepts_hand_written_tables(tmp_path):
    (tmp_path / "table.json").write_text(json.dumps({"1": 10.0, "2": 4.0}))
    assert load_steps_per_second(tmp_path / "table.json") == {1: 10.0, 2: 4.0}
    (tmp_path / "list.json").write_text(json.dumps([10.0, 4.0, 3.5]))
    assert load_steps_per_second(tmp_path / "list.json") == {1: 10.0, 2: 4.0, 3: 3.5}
    with pytest.raises(FileNotFoundError, match="dspark-hf profile"):
        load_steps_per_second(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text(json.dumps({"hello": "world"}))
    with pytest.raises(ValueError, match="neither"):
        load_steps_per_second(tmp_path / "other.json")


def test_load_steps_per_second_by_batch_size(tmp_path):
    clock = FakeClock()
    profile = profile_steps_per_second(ClockedTarget(make_target(), clock), max_tokens=2, batch_sizes=[2],
                                       context_length=4, warmup=0, repeats=1, timer=clock)
    save_profile(profile, tmp_path / "p.json")
    expected = {1: pytest.approx(0.5 / 0.010), 2: pytest.approx(0.5 / 0.028)}  # two rows cost twice as much
    assert load_steps_per_second(tmp_path / "p.json", batch_size=2) == expected
    with pytest.raises(ValueError, match="no profile for batch size 1"):
        load_steps_per_second(tmp_path / "p.json")
    assert load_speed_tables(tmp_path / "p.json") == {2: expected}  # every batch size, as the batched engine takes
    (tmp_path / "table.json").write_text('{"1": 12.5}')
    with pytest.raises(ValueError, match="not a `dspark-hf profile` file"):
        load_speed_tables(tmp_path / "table.json")


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="context_length"):
        time_verification_forwards(make_target(), [1, 2], context_length=0)
    with pytest.raises(ValueError, match="max_tokens"):
        profile_steps_per_second(make_target(), max_tokens=0)


def test_profile_command(tmp_path):
    target = make_target()
    target.save_pretrained(tmp_path / "target")
    drafter_dir = tmp_path / "drafter"
    make_drafter(target, target_layer_ids=[0, 2]).save_pretrained(drafter_dir)
    argv = ["--target", str(tmp_path / "target"), "--drafter", str(drafter_dir), "--max-tokens", "3",
            "--context-length", "8", "--warmup", "0", "--repeats", "1", "--device", "cpu", "--dtype", "float32"]
    assert main(argv) == 0
    profile = json.loads((drafter_dir / PROFILE_FILE_NAME).read_text())
    assert sorted(map(int, profile["steps_per_second"])) == [1, 2, 3]
    assert profile["settings"]["target"] == str(tmp_path / "target")
    assert profile["metadata"]["command"][:2] == ["dspark-hf", "profile"]
    # the hidden states DSpark verification forwards ask for
    assert profile["settings"]["forward_kwargs"] == {"output_hidden_states": hidden_states_request([1, 3])}
    assert sorted(load_steps_per_second(drafter_dir)) == [1, 2, 3]
    assert profile["settings"]["dtype"] == "torch.float32"  # --dtype: the earlier name of --target_dtype
    assert profile_dtype_mismatch(drafter_dir, torch.float32) is None
    assert "--target_dtype float32" in profile_dtype_mismatch(drafter_dir, torch.bfloat16)


def test_profile_command_records_the_target_dtype(tmp_path):
    make_target().save_pretrained(tmp_path / "target")
    argv = ["--target", str(tmp_path / "target"), "--target-dtype", "bfloat16", "--max_tokens", "2",
            "--context_length", "4", "--warmup", "0", "--repeats", "1", "--device", "cpu", "--output",
            str(tmp_path / "bf16.json")]
    assert main(argv) == 0
    assert json.loads((tmp_path / "bf16.json").read_text())["settings"]["dtype"] == "torch.bfloat16"
    message = profile_dtype_mismatch(tmp_path / "bf16.json", torch.float32)
    assert "measured with the target in bfloat16, but the target runs in float32" in message
    assert "dspark-hf profile --target_dtype float32" in message
    (tmp_path / "table.json").write_text(json.dumps({"1": 10.0}))
    assert profile_dtype_mismatch(tmp_path / "table.json", torch.float32) is None  # hand-written: no dtype to check


def test_a_profile_from_another_machine_warns_once(tmp_path, monkeypatch):
    import dspark_hf.profiling as profiling

    warnings = []
    monkeypatch.setattr(profiling.logger, "warning", lambda message: warnings.append(message))
    here = profiling.machine_metadata("cpu")
    table = {"1": 10.0, "2": 6.0}
    for name, metadata in (("same", here), ("other", {**here, "cpu_count": here["cpu_count"] + 64}),
                           ("build", {**here, "torch": "0.0.1+other"})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"format": profiling.PROFILE_FORMAT, "by_batch_size": {"1": table},
                                    "metadata": metadata}))
        for _ in range(2):
            assert profiling.load_steps_per_second(path) == {1: 10.0, 2: 6.0}
    assert len(warnings) == 2 and "other.json" in warnings[0] and "cpu_count" in warnings[0]
    assert "dspark-hf profile" in warnings[0]
    assert "build.json" in warnings[1] and "'0.0.1+other' there" in warnings[1]
