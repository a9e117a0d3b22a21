"""Hardware-aware verification scheduling (paper Algorithm 1 and its production variant; docs/design.md, "Scheduler:
Algorithm 1" and "Production scheduler").

Pure functions on calibrated confidences and a profiled steps-per-second curve; no model involved.

For request r with calibrated per-position confidences ``c[r][1..γ]``, the prefix survival probability of draft j is
``a[r][j] = Π_{i<=j} c[r][i]``. Verifying lengths ``ℓ_r`` sends ``B = Σ_r (1 + ℓ_r)`` tokens through the
target and is expected to commit ``τ = Σ_r (1 + Σ_{j<=ℓ_r} a[r][j])`` tokens: ``Θ = τ · SPS(B)`` tokens per second.

**How `SPS(B)` is read from a profile.** A profile need not list every size. A size between two profiled ones runs at
the speed of the next larger profiled size (an engine that captured CUDA graphs only at those sizes pads up to them;
interpolating would invent speeds between the cliffs that a real profile shows). A size above the largest profiled
one is not admissible: the scheduler never verifies more tokens than it has measured.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


__all__ = [
    "StepsPerSecondCurve",
    "prefix_survival_probabilities",
    "expected_throughput",
    "drafted_step_throughput",
    "schedule_verification_lengths",
    "verification_capacity",
    "plan_is_settled",
    "keeps_verifying",
    "expected_tokens_by_width",
    "plan_verification_width",
    "expected_accepted_drafts",
    "acceptance_ratio",
    "corrected_confidences",
    "blend_survival",
    "top_k_verification_lengths",
    "schedule_verification_lengths_async",
]


@dataclass(frozen=True)
class StepsPerSecondCurve:
    """A profiled ``SPS(B)`` lookup table: target forward steps per second by number of tokens in the forward.

    Build it with [`StepsPerSecondCurve.from_table`]; call it with a token count to get the speed, or `None` when that
    count is above the largest profiled size (not admissible).

    Example:

    ```python
    >>> from dspark_hf.scheduling import StepsPerSecondCurve
    >>> curve = StepsPerSecondCurve.from_table({1: 10.0, 2: 4.0, 8: 3.0})
    >>> curve(1), curve(2), curve(5), curve(9)
    (10.0, 4.0, 3.0, None)

    ```
    """

    sizes: tuple[int, ...]
    speeds: tuple[float, ...]

    @classmethod
    def from_table(cls, table: "StepsPerSecondCurve | Mapping | Sequence[float]") -> "StepsPerSecondCurve":
        """Normalizes a table to a curve.

        Args:
            table: a mapping ``{num_tokens: steps_per_second}`` (keys may be JSON strings such as ``"4"``), or a list
                whose entry ``i`` is the speed at ``i + 1`` tokens (entry 0 is plain decoding), or a curve. Use
                `dspark_hf.profiling.load_steps_per_second` for a saved profile file.
        """
        if isinstance(table, StepsPerSecondCurve):
            return table
        if isinstance(table, Mapping):
            items = list(table.items())
        elif isinstance(table, Sequence) and not isinstance(table, (str, bytes)):
            items = [(i + 1, v) for i, v in enumerate(table)]
        else:
            raise TypeError(
                f"steps_per_second must be a mapping {{num_tokens: steps/s}} or a list indexed by num_tokens - 1, got "
                f"{type(table).__name__}. For a saved profile use dspark_hf.profiling.load_steps_per_second(path)."
            )
        pairs = {}
        for key, value in items:
            try:
                size, speed = int(key), float(value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"steps_per_second entry {key!r}: {value!r} is not (token count, speed). A whole profile file? "
                    "Load it with dspark_hf.profiling.load_steps_per_second(path)."
                ) from None
            if size < 1 or not math.isfinite(speed) or speed <= 0:
                raise ValueError(
                    f"steps_per_second needs token counts >= 1 and finite speeds > 0, got {key!r}: {value!r}."
                )
            pairs[size] = speed
        if not pairs:
            raise ValueError("steps_per_second is empty; profile the target first (`dspark-hf profile`).")
        sizes = tuple(sorted(pairs))
        return cls(sizes=sizes, speeds=tuple(pairs[s] for s in sizes))

    @property
    def max_tokens(self) -> int:
        """The largest admissible number of tokens in one verification forward."""
        return self.sizes[-1]

    def __call__(self, num_tokens: int) -> float | None:
        """Steps per second of a forward over `num_tokens` tokens, or `None` above the largest profiled size."""
        index = bisect.bisect_left(self.sizes, num_tokens)
        return self.speeds[index] if index < len(self.sizes) else None


def _confidence_rows(confidences) -> list[list[float]]:
    """Validates per-request confidence rows (2-D tensor or ragged sequences) and returns them as Python floats."""
    if isinstance(confidences, torch.Tensor):
        if confidences.dim() != 2:
            raise ValueError(
                f"confidences must be 2-D (requests, positions), got a tensor of shape {tuple(confidences.shape)}; "
                "for one request pass confidences[None]."
            )
        rows = confidences.detach().double().cpu().tolist()
    else:
        rows = []
        for row in confidences:
            if isinstance(row, (int, float)):
                raise ValueError(
                    "confidences must hold one sequence per request, got a flat sequence of numbers; for one request "
                    "pass [confidences]."
                )
            rows.append([float(c) for c in (row.detach().double().cpu().tolist() if torch.is_tensor(row) else row)])
    for r, row in enumerate(rows):
        for j, c in enumerate(row):
            if not 0.0 <= c <= 1.0:  # also rejects NaN
                raise ValueError(
                    f"confidences[{r}][{j}] = {c} is not a probability in [0, 1]; pass calibrated c_k = σ(z_k / T_k), "
                    "not raw confidence logits."
                )
    return rows


def prefix_survival_probabilities(confidences) -> list[list[float]]:
    """``a[r][j] = Π_{i<=j} c[r][i]`` for every request r and position j (0-based in the returned lists).

    Args:
        confidences (`torch.Tensor` of shape `(requests, positions)`, or a sequence of per-request sequences that
            may differ in length): calibrated per-position confidences c_k in [0, 1].
    """
    survival = []
    for row in _confidence_rows(confidences):
        products, a = [], 1.0
        for c in row:
            a *= c  # left to right, so every caller gets bit-identical products
            products.append(a)
        survival.append(products)
    return survival


def expected_throughput(confidences, lengths: Sequence[int], steps_per_second) -> float:
    """``Θ = τ · SPS(B)`` expected committed tokens per second when request r verifies `lengths[r]` drafts.

    Returns 0.0 when ``B = Σ (1 + ℓ_r)`` is above the profiled range.
    """
    survival = prefix_survival_probabilities(confidences)
    if len(lengths) != len(survival):
        raise ValueError(f"Got {len(lengths)} lengths for {len(survival)} requests.")
    for r, (length, row) in enumerate(zip(lengths, survival)):
        if not 0 <= length <= len(row):
            raise ValueError(f"lengths[{r}] = {length} is outside [0, {len(row)}] (the drafts that request has).")
    curve = StepsPerSecondCurve.from_table(steps_per_second)
    tau = sum(1.0 + sum(row[:length]) for length, row in zip(lengths, survival))
    speed = curve(sum(1 + length for length in lengths))
    return tau * speed if speed is not None else 0.0


def drafted_step_throughput(expected_tokens: float, steps_per_second: float, draft_seconds: float = 0.0) -> float:
    """Expected committed tokens per second of a step that drafts and verifies: ``τ / (1 / SPS + draft_seconds)``
    (``τ · SPS`` exactly when drafting is free). A step without drafts runs at ``τ · SPS`` with no drafting cost."""
    if draft_seconds == 0:
        return expected_tokens * steps_per_second
    return expected_tokens / (1.0 / steps_per_second + draft_seconds)


def expected_tokens_by_width(confidences: Sequence[Sequence[float]], max_width: int):
    """Yields ``(width, τ)`` for widths 1..`max_width` of a padded verification forward: every row verifies
    ``width - 1`` drafts, and ``τ = R + Σ_r Σ_{j < width} a[r][j]`` tokens are expected committed (``a`` is the
    prefix survival; a row's confidences past its known ones count as 0). The running sums behind both the width
    planner and [`plan_is_settled`].
    """
    survival, expected = [1.0] * len(confidences), float(len(confidences))
    yield 1, expected
    for width in range(2, max_width + 1):
        for row, values in enumerate(confidences):
            survival[row] *= values[width - 2] if width - 2 < len(values) else 0.0
            expected += survival[row]
        yield width, expected


def plan_verification_width(
    stale_confidences: Sequence[Sequence[float]],
    speed,
    max_width: int,
    draft_seconds: float = 0.0,
    early_stop: bool = False,
    min_gain: float = 0.0,
) -> int:
    """The production scheduler (docs/design.md, "Production scheduler") for a padded batch: the verification width (1 +
    drafts per row) that maximizes ``(R + Σ_r Σ_{j < width} a_stale_rj) · speed(width)``, by global search over every
    width.

    The search sees the whole jagged speed curve (a CPU's 2-3x cliff between 1 and 2 tokens defeats the early-stopping
    Algorithm 1), and stays lossless because it reads only stale confidences (earlier rounds), never this round's
    drafts. With padding, every row verifies up to the same width at no extra cost. A width above 1 also pays
    `draft_seconds` (the drafting pass over all rows) per step; width 1 is plain decoding without drafting.

    With `early_stop=True` it is Algorithm 1 over widths instead: it stops at the first width that does not improve,
    so it may read *this* round's confidences (slot k's inclusion depends on c_1..c_k of every row only); the engine's
    probe rounds use it, whose drafts exist already.

    Args:
        stale_confidences: per-row calibrated confidences (rows may differ in length; missing slots count as 0).
        speed (`Callable[[int], float | None]`): steps per second of a forward of a given width; `None` past the
            profiled sizes.
        max_width (`int`): the widest plan allowed (block size + 1).
        draft_seconds (`float`): drafting time of a step with drafts.
        min_gain (`float`): the relative gain over plain decoding a width above 1 must be expected to bring (0.1:
            10% more tokens per second), a margin for what the plan does not see: timing noise behind the speeds
            (choosing the best of noisy estimates favours the overestimated ones) and the costs drafting adds around
            the step (holes to compact, requests that finish apart and are admitted apart).
    """
    by_width = expected_tokens_by_width(stale_confidences, max_width)
    _, expected = next(by_width)
    best_width, best = 1, expected * (speed(1) or 0.0) * (1.0 + min_gain)
    for width, expected in by_width:
        rate = speed(width)
        value = None if rate is None else drafted_step_throughput(expected, rate, draft_seconds)
        if value is not None and value > best:
            best_width, best = width, value
        elif early_stop:
            break  # Algorithm 1: never look past the first width that does not improve
    return best_width


def expected_accepted_drafts(confidences: Sequence[float], verified: int) -> float:
    """``Σ_{j<=ℓ} a_j``: the drafts a row verifying its first `verified` is expected to have accepted."""
    return sum(prefix_survival_probabilities([list(confidences[:verified])])[0])


def acceptance_ratio(accepted: float, predicted: float, prior: float) -> float:
    """Accepted drafts per predicted one, with `prior` pseudo-drafts on each side (1 before any round)."""
    return (accepted + prior) / (predicted + prior)


def corrected_confidences(confidences: Sequence[float], ratio: float | None) -> list[float]:
    """Confidences whose every survival probability is scaled by `ratio` (``c_1 ← min(1, ratio · c_1)`` scales every
    ``a_j``); `None` leaves them as they are."""
    values = [float(c) for c in confidences]
    if values and ratio is not None:
        values[0] = min(1.0, values[0] * ratio)
    return values


def blend_survival(
    previous: list[float] | None, confidences: Sequence[float], weight: float
) -> tuple[list[float], list[float]]:
    """Plan smoothing: the running average ``w · S + (1 - w) · a`` of survival probabilities, with ``S`` = `previous`
    (`None`: none yet) and ``a`` this round's survival. Rows of different length are continued at their last
    slot's confidence.

    Returns:
        `(blended survival, the per-slot confidences that give it)`.
    """
    survival = prefix_survival_probabilities([list(confidences)])[0]
    if previous is None:
        blended = survival
    else:
        length = max(len(survival), len(previous))
        blended = [weight * old + (1.0 - weight) * new
                   for old, new in zip(_continued(previous, length), _continued(survival, length))]
    # c_1 = a_1, c_j = a_j / a_{j-1} (0 once survival is 0)
    return blended, [blended[0]] + [b / a if a > 0 else 0.0 for a, b in zip(blended, blended[1:])]


def _continued(survival: list[float], length: int) -> list[float]:
    """`survival` extended to `length` slots, each further slot keeping the last slot's confidence."""
    survival = list(survival)
    last = survival[-1] / survival[-2] if len(survival) > 1 and survival[-2] > 0 else survival[-1]
    while len(survival) < length:
        survival.append(survival[-1] * last)
    return survival


def _candidates_by_survival(survival: list[list[float]]) -> list[tuple[int, int, float]]:
    """All ``(r, j, a[r][j])`` with ``a > 0`` (j 1-based), sorted by a descending.

    The sort is stable over the (r, j) enumeration order, so ties keep j order within a request (prefixes stay
    contiguous) and lower request index first across requests.
    """
    candidates = [(r, j + 1, a) for r, row in enumerate(survival) for j, a in enumerate(row) if a > 0.0]
    return sorted(candidates, key=lambda item: -item[2])


def _base_speed(curve: StepsPerSecondCurve, num_requests: int) -> float:
    speed = curve(num_requests)
    if speed is None:
        raise ValueError(
            f"The steps-per-second profile covers forwards of up to {curve.max_tokens} tokens, but {num_requests} "
            "requests need at least one token each; profile larger sizes (`dspark-hf profile --max_tokens N`)."
        )
    return speed


def schedule_verification_lengths(confidences, steps_per_second) -> list[int]:
    """Paper Algorithm 1: per-request verification lengths that greedily maximize expected tokens per second.

    Candidates (r, j) with ``a[r][j] > 0`` are admitted in order of decreasing ``a`` (stable: ties keep j order, then
    request order). Each admission adds one token to the forward and ``a[r][j]`` expected committed tokens; the
    search stops at the first admission that does not strictly improve ``Θ = τ · SPS(B)``.

    That early stop is what makes the schedule lossless (non-anticipating, docs/design.md, "Scheduler: Algorithm 1" /
    paper Appendix A): whether draft (r, k) is admitted depends only on candidates ranked above it, and the ones of
    request r among them are j < k, computed before x_{r,k} is sampled. A search that looks past the first non-improving
    step is biased.

    Args:
        confidences (`torch.Tensor` of shape `(requests, positions)`, or a sequence of per-request sequences that
            may differ in length): calibrated per-position confidences ``c[r][k]`` in [0, 1].
        steps_per_second (`Mapping[int, float]`, `Sequence[float]` or [`StepsPerSecondCurve`]): the target's profiled
            forward steps per second by number of tokens in the forward (see the module docstring for sizes that
            are not in the table).

    Returns:
        `list[int]`: ``ℓ_r`` for each request, in ``[0, len(confidences[r])]``.

    Example (the paper's Appendix A setting, with the early break):

    ```python
    >>> from dspark_hf.scheduling import schedule_verification_lengths
    >>> schedule_verification_lengths([[0.8, 0.9]], {1: 1.0, 2: 0.5, 3: 0.45})
    [0]
    >>> schedule_verification_lengths([[0.9, 0.9], [0.5, 0.5]], {1: 10.0, 2: 9.0, 3: 8.5, 4: 8.0, 5: 5.0})
    [2, 0]

    ```
    """
    survival = prefix_survival_probabilities(confidences)
    curve = StepsPerSecondCurve.from_table(steps_per_second)
    num_requests = len(survival)
    if num_requests == 0:
        return []
    lengths = [0] * num_requests
    num_tokens, tau = num_requests, float(num_requests)
    best = tau * _base_speed(curve, num_requests)
    for r, j, a in _candidates_by_survival(survival):
        speed = curve(num_tokens + 1)
        theta = (tau + a) * speed if speed is not None else -math.inf
        if not theta > best:
            break  # early stop: never look at candidates ranked below a non-improving one
        lengths[r] = j
        num_tokens, tau, best = num_tokens + 1, tau + a, theta
    return lengths


def verification_capacity(
    stale_confidences, steps_per_second, num_requests: int | None = None, draft_seconds: float = 0.0
) -> int:
    """Production scheduler, step 1 (docs/design.md, "Production scheduler"): the number K of drafts to verify this
    step, from stale confidences.

    Maximizes ``(R + Σ_{top K} a_stale) · SPS(R + K)`` over every K by global search, without Algorithm 1's early
    break, so the jagged cliffs of a real SPS curve do not trap it. This is lossless only because the confidences are
    stale (e.g. two steps old): K cannot depend on the drafts being verified now. Ties keep the smaller K.

    With `draft_seconds` > 0 the drafter's own time per step counts too: a step that verifies K >= 1 drafts runs at
    ``1 / (1 / SPS(R + K) + draft_seconds)`` steps per second, while K = 0 needs no drafting at all (plain decoding at
    ``SPS(R)``). On a GPU drafting is nearly free; on a small CPU it can cost a third of a decode step, and then a
    weak draft is worth skipping entirely.

    Args:
        stale_confidences: per-request calibrated confidences from an earlier step (same forms as
            [`schedule_verification_lengths`]).
        steps_per_second: the profiled curve.
        num_requests (`int`, *optional*): R, the requests in the coming step (defaults to the stale row count, for
            when requests joined or left since).
        draft_seconds (`float`, defaults to 0.0): wall time of one drafting pass for the step, paid only when K >= 1.

    Returns:
        `int`: K, the total number of drafts to admit (0 means plain decoding for everyone, with no drafting).

    Example:

    ```python
    >>> from dspark_hf.scheduling import verification_capacity
    >>> verification_capacity([[0.5]], {1: 10.0, 2: 9.0})  # 1.5 tokens at 9 steps/s beat 1 token at 10
    1
    >>> verification_capacity([[0.5]], {1: 10.0, 2: 9.0}, draft_seconds=0.05)  # not once drafting costs 50 ms
    0

    ```
    """
    if draft_seconds < 0 or not math.isfinite(draft_seconds):
        raise ValueError(f"draft_seconds must be a finite time >= 0, got {draft_seconds}.")
    survival = prefix_survival_probabilities(stale_confidences)
    curve = StepsPerSecondCurve.from_table(steps_per_second)
    num_requests = len(survival) if num_requests is None else int(num_requests)
    if num_requests <= 0:
        return 0
    gains = [a for _, _, a in _candidates_by_survival(survival)]
    best_capacity, best = 0, num_requests * _base_speed(curve, num_requests)
    tau = float(num_requests)
    for capacity, a in enumerate(gains, start=1):
        speed = curve(num_requests + capacity)
        if speed is None:
            break  # every larger K is out of the profiled range as well
        tau += a
        rate = drafted_step_throughput(tau, speed, draft_seconds)
        if rate > best:
            best_capacity, best = capacity, rate
    return best_capacity


def plan_is_settled(
    observed: Sequence[Sequence[float]],
    speed,
    max_width: int,
    draft_seconds: float = 0.0,
    min_gain: float = 0.0,
) -> bool:
    """Whether a width plan made from the first k confidences of every row can no longer change with more of them.

    A planner that reads the confidences of a whole block (docs/design.md, "Production scheduler") needs c_k of every
    slot, and c_{k+1} exists only after x_k is sampled. Survival never grows along a row (``a[r][j] <= a[r][k]`` for j >
    k), so every width above ``k + 1`` is worth at most ``(R + Σ_{j<=k} a + (width - 1 - k) · Σ_r a[r][k]) ·
    speed(width)`` (with the drafting cost, as [`drafted_step_throughput`]). When that bound is below the best width up
    to ``k + 1``, the plan from the full block would be the same as the one from these k slots, and sampling the rest of
    the block only to observe it is wasted work. The check is exact up to a 1e-9 relative margin, kept on the side of
    observing more.

    Args:
        observed: per-row calibrated confidences c_1..c_k observed so far (the shortest row sets k).
        speed: steps per second of a verification forward of a given width (1 + drafts per row); `None` past the
            profiled sizes. A [`StepsPerSecondCurve`] for one request.
        max_width (`int`): the widest plan allowed (block size + 1).
        draft_seconds (`float`): drafting time of a step with drafts (see [`verification_capacity`]).
        min_gain (`float`): the planner's margin over plain decoding ([`plan_verification_width`]).
    """
    if not observed:
        return True
    k = min(len(row) for row in observed)
    best, previous, tail = 0.0, 0.0, 0.0
    for width, expected in expected_tokens_by_width(observed, min(k + 1, max_width)):  # drafts all observed
        rate = speed(width)
        if width == 1:
            best = expected * (rate or 0.0) * (1.0 + min_gain)
        elif rate is None:
            return True  # wider forwards are out of the profiled range as well
        else:
            best = max(best, drafted_step_throughput(expected, rate, draft_seconds))
        previous, tail = expected, expected - previous  # tail: Σ_r a[r][width - 1], the last slot's survival
    for width in range(k + 2, max_width + 1):
        rate = speed(width)
        if rate is None:
            break
        bound = drafted_step_throughput(previous + (width - 1 - k) * tail, rate, draft_seconds)
        if bound > best * (1.0 - 1e-9):
            return False
    return True


def keeps_verifying(confidences: Sequence[Sequence[float]], speed, slot: int, max_width: int) -> bool:
    """Whether a planned round still verifies draft `slot` (0-based) now that this round's c_1..c_{slot+1} of every row
    are known: the plan's width, revised as the block's own confidences arrive, but only ever cut.

    A plan (width `max_width`, from stale confidences) bets on drafts it has not seen. Once the drafting pass has run,
    its cost is paid, and each slot's fresh confidence says more about this block than the stale ones did. The round
    goes on to the slot iff some width from ``slot + 2`` up to the plan's is expected to commit tokens faster than
    stopping at ``slot + 1``, each at ``τ(width) · speed(width)``, where ``τ`` reads every row's fresh survival up to
    the slot and the plan's stale conditional confidences beyond it (``confidences[r]`` holds both, in that order).

    The decision on slot k reads c_1..c_{k+1} of this round, and c_{k+1} reads the drafts before slot k only (the
    confidence head sees the previous draft): non-anticipating, as Algorithm 1's early break is, so lossless when
    sampling too (docs/design.md, "Production scheduler"). A global search over this round's later confidences would
    not be (the spec's counterexample, `../shared/docs/dspark-checkpoint-spec.md` §5.2).

    Args:
        confidences: per row, this round's calibrated c_1..c_{slot+1}, then the plan's c for later slots (a row that
            can no longer verify the slot ends before it: its survival there is 0).
        speed: steps per second of a forward of a given width (1 + drafts per row); `None` past the profiled sizes.
        slot (`int`): the draft slot about to be sampled; stopping here means width ``slot + 1``.
        max_width (`int`): the planned width.

    Example:

    ```python
    >>> from dspark_hf.scheduling import keeps_verifying
    >>> speed = {1: 10.0, 2: 8.0, 3: 7.5}.get
    >>> keeps_verifying([[0.9, 0.8]], speed, slot=0, max_width=3)  # 1.9 tokens at 8 beat 1 at 10
    True
    >>> keeps_verifying([[0.1, 0.8]], speed, slot=0, max_width=3)  # this block's first draft is weak: plain step
    False

    ```
    """
    stop, best = None, 0.0
    for width, expected in expected_tokens_by_width(confidences, max_width):
        if width <= slot:
            continue
        rate = speed(width)
        if rate is None:
            break
        if width == slot + 1:
            stop = expected * rate
        else:
            best = max(best, expected * rate)
    return stop is not None and best > stop


def top_k_verification_lengths(confidences, capacity: int) -> list[int]:
    """Production scheduler, step 2 (docs/design.md, "Production scheduler"): admit the `capacity` drafts with the
    highest *current* ``a[r][j]``.

    Rank-preserving and non-anticipating: draft (r, k) is admitted iff fewer than `capacity` candidates rank above
    it, and the ones of request r that could are j < k. Drafts with ``a = 0`` are never admitted.

    Returns:
        `list[int]`: ``ℓ_r`` for each request; ``Σ ℓ_r <= capacity``.
    """
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}.")
    survival = prefix_survival_probabilities(confidences)
    lengths = [0] * len(survival)
    for r, j, _ in _candidates_by_survival(survival)[:capacity]:
        lengths[r] = j  # stable order admits j - 1 before j, so this only ever extends a prefix
    return lengths


def schedule_verification_lengths_async(confidences, stale_confidences, steps_per_second) -> list[int]:
    """The production scheduler (docs/design.md, "Production scheduler"): K from stale confidences by global search,
    then top-K by current ones.

    Args:
        confidences: this step's calibrated confidences, one row per request now in the batch.
        stale_confidences: the confidences the capacity is planned from (e.g. two steps old).
        steps_per_second: the profiled curve.
    """
    num_requests = len(prefix_survival_probabilities(confidences))
    capacity = verification_capacity(stale_confidences, steps_per_second, num_requests=num_requests)
    return top_k_verification_lengths(confidences, capacity)

