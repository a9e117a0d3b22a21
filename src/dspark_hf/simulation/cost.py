"""Cost models for the simulator: seconds of a verification forward, a drafting pass and a prefill.

Two kinds of verification cost, both in seconds for a forward of `rows` requests with `width` tokens each:

- **profile** ([`ProfileCost`]): a `dspark-hf profile` file's per-batch-size tables (``1 / steps_per_second``),
  linear in rows between profiled row counts and proportional to rows past the largest (compute-bound). `scale`
  multiplies every entry (a profile measured at another context length or load than the runs it predicts).
- **knee** ([`KneeCost`]): the roofline shape of a GPU under serving load: a forward costs `forward_seconds` while
  memory-bound, up to `knee_tokens` tokens in the forward (``rows × width``), then grows linearly with the tokens
  (compute-bound), plus `row_seconds` per request (reading its KV cache). On an H100-class GPU and a ~8B model in
  bf16, a decode step reads ~16 GB of weights at ~3.3 TB/s (≈ 5 ms, ~6 ms with overheads); at ~600 TFLOP/s
  achieved, a token costs ~27 µs of compute (2 FLOPs per weight), so the forward turns compute-bound near 6 ms /
  27 µs ≈ 220 tokens; a 1k-token context of grouped-query KV is ~128 MB per request (≈ 40 µs). Those are
  back-of-envelope assumptions, not measurements.

Drafting costs ``draft_seconds + draft_seconds_per_row · rows + draft_seconds_per_slot · slots`` per round (slots:
block slots sampled left to right; the drafter's forward is the fixed part), prefill costs one decode forward plus
``prefill_seconds_per_token`` per prompt token. A cost file is JSON:

```json
{"format": "dspark-hf-cost-model", "verify": {"kind": "knee", "forward_seconds": 0.006, "knee_tokens": 256},
 "draft_seconds": 0.0015, "source": "where the numbers come from"}
```

or ``"verify": {"kind": "profile", "path": "dspark_sps_profile.json", "scale": 0.8}`` (a relative path is read from
the cost file's folder); a `dspark-hf profile` file itself is a cost model with free drafting.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..profiling import PROFILE_FORMAT, _profile_path, load_speed_tables


COST_FORMAT = "dspark-hf-cost-model"


@dataclass
class CostModel:
    """Drafting and prefill seconds; subclasses add `verify_seconds`.

    Args:
        draft_seconds (`float`): fixed seconds of a drafting pass (the drafter forward).
        draft_seconds_per_row (`float`): more seconds per request in the pass.
        draft_seconds_per_slot (`float`): more seconds per block slot sampled (Markov correction, confidence, argmax).
        prefill_seconds_per_token (`float`): seconds per prompt token on top of one decode forward.
        source (`str`): where the numbers come from (copied into every report).
    """

    draft_seconds: float = 0.0
    draft_seconds_per_row: float = 0.0
    draft_seconds_per_slot: float = 0.0
    prefill_seconds_per_token: float = 0.0
    source: str = ""

    def __post_init__(self):
        for name in ("draft_seconds", "draft_seconds_per_row", "draft_seconds_per_slot", "prefill_seconds_per_token"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"cost model {name} must be a finite number of seconds >= 0, got {value!r}.")

    def verify_seconds(self, rows: int, width: int) -> float:
        """Seconds of a target forward over `rows` requests with `width` tokens each (1 = plain decoding)."""
        raise NotImplementedError

    def drafting_seconds(self, rows: int, slots: int) -> float:
        """Seconds of one drafting pass over `rows` requests that samples `slots` block slots."""
        return self.draft_seconds + self.draft_seconds_per_row * rows + self.draft_seconds_per_slot * slots

    def prefill_seconds(self, rows: int, prompt_tokens: int) -> float:
        """Seconds of admitting `rows` prompts padded to `prompt_tokens` tokens."""
        return self.verify_seconds(rows, 1) + self.prefill_seconds_per_token * rows * prompt_tokens

    def describe(self) -> dict:
        return {"kind": type(self).__name__, **asdict(self)}


@dataclass
class KneeCost(CostModel):
    """Flat while memory-bound up to `knee_tokens` tokens per forward, then linear (see the module docstring)."""

    forward_seconds: float = 0.006
    knee_tokens: int = 256
    row_seconds: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if not (self.forward_seconds > 0 and self.knee_tokens >= 1):
            raise ValueError(f"knee cost needs forward_seconds > 0 and knee_tokens >= 1, got {self.forward_seconds} "
                             f"and {self.knee_tokens}.")

    def verify_seconds(self, rows: int, width: int) -> float:
        return self.forward_seconds * max(1.0, rows * width / self.knee_tokens) + self.row_seconds * rows


@dataclass
class ProfileCost(CostModel):
    """``scale / steps_per_second`` of a profile's ``by_batch_size`` tables (`tables`: rows -> width -> steps/s)."""

    tables: dict[int, dict[int, float]] = field(default_factory=dict)
    scale: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if not self.tables or not self.scale > 0:
            raise ValueError("profile cost needs at least one batch-size table and scale > 0; profile the target "
                             "with `dspark-hf profile --batch_sizes 1 2 4 ...`.")
        self.tables = {int(r): {int(w): float(s) for w, s in t.items()} for r, t in self.tables.items()}

    def _seconds(self, rows: int, width: int) -> float:
        table = self.tables[rows]
        if width not in table:
            raise ValueError(f"the profile has no forward of {width} tokens per row at {rows} rows (it has "
                             f"{sorted(table)}); profile with a larger --max_tokens.")
        return self.scale / table[width]

    def verify_seconds(self, rows: int, width: int) -> float:
        profiled = sorted(self.tables)
        index = bisect.bisect_left(profiled, rows)
        if index < len(profiled) and profiled[index] == rows:
            return self._seconds(rows, width)
        if index == len(profiled):  # past the largest profiled row count: proportional to rows
            return self._seconds(profiled[-1], width) * rows / profiled[-1]
        if index == 0:
            return self._seconds(profiled[0], width)
        low, high = profiled[index - 1], profiled[index]
        weight = (rows - low) / (high - low)
        return (1 - weight) * self._seconds(low, width) + weight * self._seconds(high, width)

    def describe(self) -> dict:
        described = super().describe()
        described["tables"] = {str(r): {str(w): s for w, s in t.items()} for r, t in self.tables.items()}
        return described


_DRAFT_KEYS = ("draft_seconds", "draft_seconds_per_row", "draft_seconds_per_slot", "prefill_seconds_per_token",
               "source")


def load_cost_model(path: str | Path, **overrides) -> CostModel:
    """A cost model from a cost file or a `dspark-hf profile` file (`overrides`: e.g. ``draft_seconds=0.007``)."""
    path = _profile_path(path)  # a folder means the profile `dspark-hf profile --drafter` saved in it
    if not path.is_file():
        raise FileNotFoundError(f"No cost model at {path}; pass a `dspark-hf profile` JSON or a cost file "
                                "(see dspark_hf.simulation.cost).")
    data = json.loads(path.read_text())
    if data.get("format") == PROFILE_FORMAT:
        return ProfileCost(tables=data["by_batch_size"], source=str(path), **overrides)
    if data.get("format") != COST_FORMAT:
        raise ValueError(f"{path} is neither a `dspark-hf profile` file nor a cost model (format "
                         f"{data.get('format')!r}); see dspark_hf.simulation.cost for the layout.")
    common = {key: data[key] for key in _DRAFT_KEYS if key in data}
    common.update(overrides)
    verify = dict(data.get("verify") or {})
    kind = verify.pop("kind", None)
    if kind == "knee":
        return KneeCost(**common, **verify)
    if kind == "profile":
        profile_path = Path(verify.pop("path"))
        profile_path = profile_path if profile_path.is_absolute() else path.parent / profile_path
        return ProfileCost(**common, tables=load_speed_tables(profile_path), **verify)
    raise ValueError(f"{path}: verify.kind must be 'knee' or 'profile', got {kind!r}.")
