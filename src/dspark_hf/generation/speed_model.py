"""The measured speed model the hardware-aware policies plan with: a profile's steps-per-second curve, corrected online
by the verification-step and drafting times measured while generating.

A profile is measured once, at one context length, on an idle machine; the steps an engine actually runs (longer caches
with holes, other load) can cost markedly more, and not uniformly across widths. Measured sizes replace the profile's
guess, so a plan that does not pay on the live machine stops being chosen.

Wide steps are kept relative to plain decoding: a width the policy runs rarely was timed rounds ago, on shorter
contexts and perhaps another load, while plain steps are timed nearly every round under load. So a wide step's time
is stored as its ratio to the plain step of its row count at that moment, and read back as that ratio times the
current plain step. (Absolute medians of rarely run widths made plans under load optimistic: at 32 rows and 256-token
contexts a width-3 step was expected to take 210 ms and took 234, and the round lost against two plain steps.)

```python
>>> from dspark_hf.generation.speed_model import SpeedModel
>>> model = SpeedModel({1: 10.0, 2: 8.0})
>>> model.record_step_seconds(0.2, rows=1, width=1)  # plain decoding runs at 5 steps/s here, half the profile
>>> model.speed(1)(2)  # an unmeasured width scales with it
4.0

```
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Callable, Mapping

from ..scheduling import StepsPerSecondCurve


# Timings kept per size: the model reads their median, so it follows the machine's load within a few steps while one
# slow step (a cache reallocation, a compaction, another process) moves nothing.
WINDOW = 5
# Plain steps run nearly every round under load, and every wide step is read relative to them: a longer window, so
# that one noisy plain estimate does not make drafting look cheap.
PLAIN_WINDOW = 15


def batch_speed_table(by_rows: Mapping[int, Mapping[int, float]], rows: int) -> Callable[[int], float | None]:
    """`speed(tokens_per_row)` for `rows` rows from a profile's ``{rows: {tokens_per_row: steps/s}}`` tables, using
    the smallest profiled row count >= `rows` (a conservative estimate); `None` past the profiled sizes."""
    profiled = sorted(int(r) for r in by_rows)
    index = bisect.bisect_left(profiled, rows)
    if index == len(profiled):
        return lambda width: None
    table = {int(k): float(v) for k, v in by_rows[profiled[index]].items()}
    return table.get


class SpeedModel:
    """Steps per second of the target's verification forwards and seconds of the drafter's passes.

    Args:
        steps_per_second (`Mapping[int, float]`, `Sequence[float]` or [`StepsPerSecondCurve`]): the profiled curve by
            number of tokens in one forward (see `dspark_hf.scheduling`).
        draft_seconds (`float`, *optional*): a fixed drafting time per row (0: free, the paper's GPU setting); by
            default drafting passes are measured.
    """

    def __init__(self, steps_per_second, draft_seconds: float | None = None):
        self.curve = StepsPerSecondCurve.from_table(steps_per_second)
        self.draft_seconds = draft_seconds
        self._draft_seconds: dict[int, float] = {}  # rows -> median of recent drafting passes
        self._step_seconds: dict[tuple[int, int], float] = {}  # (rows, width) -> median of recent steps
        self._relative: dict[tuple[int, int], float] = {}  # (rows, width > 1) -> median of recent steps / plain step
        self._timings: dict[object, deque] = {}  # the recent timings behind them

    @property
    def step_seconds(self) -> dict[tuple[int, int], float]:
        """The measured steps: ``{(rows, width): seconds}`` (medians of the last `WINDOW`)."""
        return dict(self._step_seconds)

    def forget(self) -> None:
        """Drops every measurement (the profile stays)."""
        self._draft_seconds.clear()
        self._step_seconds.clear()
        self._relative.clear()
        self._timings.clear()

    def record_draft_seconds(self, seconds: float, rows: int = 1) -> None:
        """Receives the wall time of a drafting pass over `rows` rows."""
        self._draft_seconds[rows] = self._recent_median(("draft", rows), seconds)

    def record_step_seconds(self, seconds: float, rows: int, width: int) -> None:
        """Receives the wall time of a verification step of `rows` rows verifying `width` tokens each."""
        self._step_seconds[(rows, width)] = self._recent_median((rows, width), seconds,
                                                                PLAIN_WINDOW if width == 1 else WINDOW)
        plain = self._step_seconds.get((rows, 1))
        if width > 1 and plain:
            self._relative[(rows, width)] = self._recent_median(("relative", rows, width), seconds / plain)

    def _recent_median(self, key, value: float, window: int = WINDOW) -> float:
        recent = self._timings.setdefault(key, deque(maxlen=window))
        recent.append(value)
        return statistics.median(recent)

    def has_step(self, rows: int, width: int) -> bool:
        """Whether a step of `rows` rows verifying `width` tokens each has been timed."""
        return (rows, width) in self._step_seconds

    def drafting_cost(self, rows: int = 1) -> float:
        """Seconds of one drafting pass over `rows` rows: the fixed `draft_seconds` per row when given, else measured
        (at the nearest measured row count, scaled linearly), else 0."""
        if self.draft_seconds is not None:
            return self.draft_seconds * rows
        if not self._draft_seconds:
            return 0.0
        if rows in self._draft_seconds:
            return self._draft_seconds[rows]
        nearest = min(self._draft_seconds, key=lambda r: abs(r - rows))
        return self._draft_seconds[nearest] * rows / nearest

    def measured_speed(self, rows: int, width: int, profiled: Callable[[int], float | None]) -> float | None:
        """Steps per second of a (rows, width) step: measured when this size has run (a wide step as its measured ratio
        to plain decoding times plain decoding's current time), else the profile `profiled(width)` scaled by how much
        faster or slower than profiled this many rows decode now (`None` past the profile)."""
        base, relative = self._step_seconds.get((rows, 1)), self._relative.get((rows, width))
        if relative is not None and base is not None:
            return 1.0 / (relative * base)
        measured = self._step_seconds.get((rows, width))
        if measured is not None:
            return 1.0 / measured
        speed = profiled(width)
        profiled_base = profiled(1)
        if speed is None or base is None or not profiled_base:
            return speed
        return speed * (1.0 / base) / profiled_base

    def speed(self, rows: int, by_rows: Mapping[int, Mapping[int, float]] | None = None):
        """`speed(width)` of `rows` rows verifying `width` tokens each: measured where that size has run, else the
        profile (`by_rows`, a profile's per-row-count tables, or the curve at ``rows · width`` tokens), rescaled by
        the measured plain-decoding speed."""
        if by_rows is not None:
            profiled = batch_speed_table(by_rows, rows)
        else:
            profiled = lambda width: self.curve(rows * width)  # noqa: E731
        return lambda width: self.measured_speed(rows, width, profiled)

    def __repr__(self) -> str:
        table = dict(zip(self.curve.sizes, self.curve.speeds))
        return f"SpeedModel(steps_per_second={table}, draft_seconds={self.draft_seconds!r})"
