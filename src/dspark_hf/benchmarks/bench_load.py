"""`dspark-hf bench-load`: throughput and per-request speed under concurrent load.

At each concurrency level c, a closed loop keeps c requests in flight in a [`DSparkBatchEngine`] (a finished request
is replaced by the next prompt at the following round) until `--requests` have finished. Methods run interleaved per
level (`--repeats` passes, rotating the order, pooled; by default every method's loop runs one step in turn, each on
its own clock, `--interleave steps`, since a shared CPU's speed drifts by tens of percent within seconds): target-only
batched decoding, then DSpark with each
verification policy (`POLICY+lookup`: with prompt lookup inside its rounds; `prompt_lookup`: batched prompt lookup
decoding without a drafter). Reports total tokens/s at full load (the steps with c requests in flight) and over the whole
run (including the drain once the queue is empty), each with its ratio to target-only at the same level, mean
per-request tokens/s, tau and the share of rounds run without the drafter, and how many requests' outputs equal
target-only's for the same request (with the target's logit margin where they part, which happens outside float32 at
near-ties); writes JSON, a markdown table and a throughput / per-user-speed frontier plot.

By default every request has the same budget (`--max_new_tokens`) and, as prompts rarely end within it, target-only
requests finish in lockstep: each wave is admitted in one prefill, while a speculative method's rows finish apart and
are admitted a few at a time (a prefill of one prompt costs ~2x per prompt what a prefill of 16 does on a 2-core CPU).
`--random_range_ratio r` draws each request's budget from ``[1 - r, 1 + r] · max_new_tokens`` (the same draws for
every method), as lengths vary in serving. `--admission_wait_rounds N` (every method alike) lets requests that arrive
while others decode wait up to N rounds so that several are prefilled together ([`DSparkBatchEngine`]; the default,
`auto`, waits while that is cheaper than a prefill of their own); several values (`auto,0`) run every method at each,
side by side (`METHOD wait=N` rows; ratios against target-only at the first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..cli import ArgumentParser
from ..generation.batched import AUTO_ADMISSION, DSparkBatchEngine, parse_admission_wait_rounds
from ..generation.policies import get_policy
from ..modeling_dspark import DSparkDrafter
from ..models import DEFAULT_TARGET, DTYPES, EMBEDDED_DRAFTERS, check_model_path, drafter_dtype, load_target
from ..models import target_dtype
from ..packed_linear import PACKED_LINEAR_MODES, is_packed, pack_linear_weights
from ..profiling import load_speed_tables, profile_dtype_mismatch, steps_per_second_here
from .bench import machine_info, version_info
from .exactness import conversation_divergence, summarize_divergences
from .methods import split_lookup
from .prompts import first_turn_ids


def _parse_args(argv) -> argparse.Namespace:
    parser = ArgumentParser(prog="dspark-hf bench-load", description=__doc__)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--drafter", default=None, help="drafter path (default: the embedded one)")
    parser.add_argument("--prompts", nargs="+", required=True, help="jsonl prompt files ({'turns': [...]})")
    parser.add_argument("--target_dtype", default="auto", choices=DTYPES,
                        help="dtype the target runs in, every method alike (auto: bfloat16 where computed natively, "
                        "else float32; outside float32 outputs may differ from target-only's at near-ties)")
    parser.add_argument("--packed_linear", default="auto", choices=PACKED_LINEAR_MODES,
                        help="read the target's linear weights packed for oneDNN (CPU): auto (where this machine runs "
                        "them faster), on, off; every method runs the same target")
    parser.add_argument("--drafter_dtype", default="auto", choices=DTYPES,
                        help="dtype the drafter runs in (auto: bfloat16 where computed natively, else float32)")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32", help="comma-separated levels")
    parser.add_argument("--requests", type=int, default=None, help="requests finished per level (default: 2 × c, >= 8)")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--random_range_ratio", type=float, default=0.0,
                        help="each request's new-token budget drawn uniformly from max_new_tokens x [1 - r, 1 + r] "
                        "(seeded: the same requests for every method), so that requests finish apart as in serving; "
                        "0: every request gets max_new_tokens (default: %(default)s)")
    parser.add_argument("--methods", default="target,full,threshold,hardware_aware",
                        help="comma-separated: target, prompt_lookup (batched, no drafter), and verification policies, "
                        "each optionally POLICY+lookup (prompt lookup inside DSpark rounds) (default: %(default)s)")
    parser.add_argument("--prompt_lookup_num_tokens", type=int, default=10,
                        help="most lookup drafts per row and round for prompt_lookup and POLICY+lookup "
                        "(default: %(default)s)")
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--sps", default=None, help="profile from `dspark-hf profile` with these batch sizes (default: "
                        "the drafter folder's if measured on this kind of machine in this dtype at these levels, else "
                        "one measured here once and cached)")
    parser.add_argument("--admission_wait_rounds", default="auto",
                        help="rounds a new request may wait while others decode, so that requests arriving in "
                        "successive rounds share one prefill, or 'auto' (while waiting costs less than a prefill); the "
                        "same for every method; comma-separated values run every method at each, as 'METHOD wait=N' "
                        "rows (default: %(default)s)")
    parser.add_argument("--interleave", default="steps", choices=("steps", "passes"),
                        help="steps: every method's closed loop runs one engine step in turn, each timed on its own "
                        "clock, so that the host's drift hits all methods alike (a step is 0.05-0.5 s); passes: one "
                        "method's whole pass after another (default: %(default)s)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2,
                        help="passes over all methods per level, in rotated order; numbers are pooled (default: 2)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.prompt_lookup_num_tokens < 1:
        parser.error(f"--prompt_lookup_num_tokens must be >= 1, got {args.prompt_lookup_num_tokens}")
    try:
        args.admission_waits = [parse_admission_wait_rounds(part) for part in args.admission_wait_rounds.split(",")]
    except ValueError:
        parser.error(f"--admission_wait_rounds takes comma-separated integers >= 0 (0 admits at every step) or "
                     f"'{AUTO_ADMISSION}', got {args.admission_wait_rounds!r}")
    if not 0.0 <= args.random_range_ratio < 1.0:
        parser.error(f"--random_range_ratio must be in [0, 1) (0.5: budgets from 0.5x to 1.5x --max_new_tokens), got "
                     f"{args.random_range_ratio}")
    return args


def request_budgets(max_new_tokens: int, range_ratio: float, num_requests: int, seed: int) -> list[int]:
    """Each request's new-token budget: `max_new_tokens`, or drawn uniformly from ``max_new_tokens · [1 - r, 1 + r]``
    with a seeded generator (vLLM's `--random-range-ratio`), identical for every method at a level."""
    if not range_ratio:
        return [max_new_tokens] * num_requests
    low, high = max(1, round(max_new_tokens * (1 - range_ratio))), round(max_new_tokens * (1 + range_ratio))
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (num_requests,), generator=generator).tolist()


class StepClock:
    """A clock that runs only while its engine steps (`with clock.running(): ...`), frozen in between.

    Closed loops of several methods run step by step in turn ([`run_level_interleaved`]); each engine reads its own
    clock (arrival, finish, the drafting and step times its policy learns from), so that a method's time is the time
    of its own forwards, and the others' steps in between do not count. `timer`: the underlying clock (seconds)."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter):
        self.timer = timer
        self._paused_at: float | None = timer()
        self._paused_seconds = 0.0

    def __call__(self) -> float:
        now = self.timer() if self._paused_at is None else self._paused_at
        return now - self._paused_seconds

    @contextmanager
    def running(self):
        self._paused_seconds += self.timer() - self._paused_at
        self._paused_at = None
        try:
            yield self
        finally:
            self._paused_at = self.timer()


class ClosedLoop:
    """One closed loop over an engine: `concurrency` requests in flight (a finished request is replaced by the next
    prompt at the following round) until `num_requests` have finished; `step()` runs one engine step, `result()`
    summarizes. `max_new_tokens`: one budget for every request, or each request's in order ([`request_budgets`]).

    Two throughputs: over the whole run, and over the steps at full load (the engine holding `concurrency` requests;
    admission included). Once the queue is empty the loop drains: fewer rows per step, and how long that tail lasts
    depends on how unevenly requests finish, not on the speed at load c. Target-only decoding finishes equal-length
    requests together (no tail); speculative rows finish apart, so with few requests per level the whole-run figure
    mixes in a tail run at lower concurrency. The full-load figure is the throughput *at* concurrency c."""

    def __init__(self, engine: DSparkBatchEngine, prompts: list[list[int]], concurrency: int, num_requests: int,
                 max_new_tokens: int | list[int]):
        self.engine, self.concurrency, self.num_requests = engine, concurrency, num_requests
        self._queue = iter(prompts * (num_requests // max(len(prompts), 1) + 1))
        self._budgets = [max_new_tokens] * num_requests if isinstance(max_new_tokens, int) else list(max_new_tokens)
        self.requests: list = []
        self.finished: list = []
        self._full_rows = min(concurrency, num_requests)
        self._start = engine.clock()
        while len(self.requests) < self._full_rows:
            self._add()
        self.full_tokens, self.full_seconds, self.full_steps, self.steps = 0, 0.0, 0, 0

    @property
    def done(self) -> bool:
        return not (self.engine.active or self.engine.waiting)

    def _add(self) -> None:
        self.requests.append(self.engine.add_request(next(self._queue), self._budgets[len(self.requests)]))

    def step(self) -> None:
        engine = self.engine
        before = sum(len(r.output_ids) for r in self.requests)
        # all c requests in the engine, decoding or waiting (held back by `admission_wait_rounds`, or admitted now)
        full = sum(not r.finished for r in engine.active) + len(engine.waiting) == self._full_rows
        step_start = engine.clock()
        done = engine.step()
        step_seconds = engine.clock() - step_start
        self.steps += 1
        if full:
            self.full_tokens += sum(len(r.output_ids) for r in self.requests) - before
            self.full_seconds += step_seconds
            self.full_steps += 1
        self.finished += done
        for _ in done:
            if len(self.requests) < self.num_requests:
                self._add()
        if self.done:
            self._elapsed = engine.clock() - self._start

    def result(self) -> dict:
        engine, finished = self.engine, self.finished
        tokens = sum(len(r.output_ids) for r in finished)
        per_request = [len(r.output_ids) / (r.finish_time - r.arrival_time) for r in finished]
        rounds = [rnd for r in finished for rnd in (r.stats.rounds if r.stats else [])]
        full_rows = self._full_rows
        return {
            "concurrency": self.concurrency,
            "requests": len(finished),
            "tokens": tokens,
            "seconds": self._elapsed,
            "throughput_tok_s": tokens / self._elapsed,
            "full_load_tokens": self.full_tokens,
            "full_load_seconds": self.full_seconds,
            "full_load_throughput_tok_s": self.full_tokens / self.full_seconds if self.full_seconds else 0.0,
            "full_load_steps": self.full_steps,
            "steps": self.steps,
            "per_request_tok_s": sum(per_request) / len(per_request),
            "tau": (sum(r.accepted for r in rounds) + len(rounds)) / len(rounds) if rounds else 1.0,
            "mean_verified": sum(r.verified for r in rounds) / len(rounds) if rounds else 0.0,
            "rounds": len(rounds),
            "skipped_rounds": sum(not r.drafted for r in rounds),
            "lookup_rounds": sum(r.source == "lookup" for r in rounds),
            # the engine's own timings at full load (a cost model's inputs; `pool_passes` keeps their medians)
            "full_load_step_seconds": [(width, seconds) for rows, width, seconds in engine.step_timings
                                       if rows == full_rows],
            "full_load_draft_seconds": [seconds for rows, seconds in engine.draft_timings if rows == full_rows],
            "admissions": [list(timing) for timing in engine.admit_timings],
            "prompt_ids": [list(r.prompt_ids) for r in self.requests],  # in admission order, the same in every method
            "outputs": [list(r.output_ids) for r in self.requests],
        }


def run_level(engine: DSparkBatchEngine, prompts: list[list[int]], concurrency: int, num_requests: int,
              max_new_tokens: int | list[int]) -> dict:
    """Runs one closed loop ([`ClosedLoop`]) to the end; returns throughput, per-request speeds and tau."""
    loop = ClosedLoop(engine, prompts, concurrency, num_requests, max_new_tokens)
    while not loop.done:
        loop.step()
    return loop.result()


def run_level_interleaved(engines: list[DSparkBatchEngine], prompts: list[list[int]], concurrency: int,
                          num_requests: int, max_new_tokens: int | list[int], rotation: int = 0) -> list[dict]:
    """One closed loop per engine ([`ClosedLoop`], same requests), run step by step in turn; returns their results.

    On a shared CPU whose speed drifts by tens of percent within seconds, methods timed one after another meet
    different machines; stepped in turn (a step is 0.05-0.5 s), they meet the same one. Each engine runs on its own
    [`StepClock`], which counts only its own steps. The order rotates every round (starting at `rotation`), so no
    method always follows the same one."""
    loops = []
    for engine in engines:
        engine.clock = StepClock()
        loops.append(ClosedLoop(engine, prompts, concurrency, num_requests, max_new_tokens))
    turn = rotation
    while not all(loop.done for loop in loops):
        start = turn % len(loops)
        for loop in loops[start:] + loops[:start]:
            if not loop.done:
                with loop.engine.clock.running():
                    loop.step()
        turn += 1
    return [loop.result() for loop in loops]


def run_passes(engines: list[tuple[str, Callable[[], DSparkBatchEngine]]], prompts: list[list[int]],
               concurrency: int, num_requests: int, max_new_tokens: int | list[int], repeats: int,
               interleave: str = "steps") -> dict[str, list[dict]]:
    """`repeats` passes of every method's closed loop at one level, each on a fresh engine from its factory; returns
    each method's pass results by name. The order rotates per pass, so drift and ordering hit every method alike;
    `interleave="steps"` runs the loops of a pass step by step in turn ([`run_level_interleaved`]), `"passes"` one
    after another."""
    passes: dict[str, list[dict]] = {name: [] for name, _ in engines}
    for repeat in range(repeats):
        rotation = repeat % len(engines)
        if interleave == "steps":
            rows = run_level_interleaved([make_engine() for _, make_engine in engines], prompts, concurrency,
                                         num_requests, max_new_tokens, rotation)
            for (name, _), row in zip(engines, rows):
                passes[name].append(row)
            continue
        for name, make_engine in engines[rotation:] + engines[:rotation]:
            passes[name].append(run_level(make_engine(), prompts, concurrency, num_requests, max_new_tokens))
    return passes


def pooled_rows(passes: dict[str, list[dict]]) -> list[dict]:
    """One row per method of a level: its passes pooled ([`pool_passes`]) under `method`, with its throughput ratios
    to target-only's (`throughput_vs_target`, `full_load_vs_target`) where the level ran `target`."""
    baseline = pool_passes(passes["target"]) if passes.get("target") else None
    rows = []
    for name, runs in passes.items():
        row = {"method": name, **pool_passes(runs)}
        if baseline:
            row["throughput_vs_target"] = row["throughput_tok_s"] / baseline["throughput_tok_s"]
            row["full_load_vs_target"] = row["full_load_throughput_tok_s"] / baseline["full_load_throughput_tok_s"]
        rows.append(row)
    return rows


def level_exactness(target, reference_passes: list[dict], passes: list[dict]) -> dict:
    """Each request's output against target-only's for the same request in the same pass (rows of [`run_level`]):
    `identical` of `identical_of` requests, and where the others first part, the target's top-1/top-2 logit margin
    (`first_divergences`, with `pass` and `request` indices, summarized like `dspark-hf bench`)."""
    identical, total, divergences = 0, 0, []
    for repeat, (reference, run) in enumerate(zip(reference_passes, passes)):
        for index, (prompt, expected, output) in enumerate(
                zip(reference["prompt_ids"], reference["outputs"], run["outputs"])):
            divergence = conversation_divergence(target, [prompt], [expected], [output])
            total += 1
            identical += divergence is None
            if divergence is not None:
                divergences.append({"pass": repeat, "request": index, **divergence})
    return {"identical": identical, "identical_of": total, **summarize_divergences(divergences),
            "first_divergences": divergences}


def pool_passes(passes: list[dict]) -> dict:
    """One row from several passes of the same method and level: tokens and seconds summed (throughput = total
    tokens / total seconds), per-request speed and tau weighted by requests and rounds; each pass's throughput kept."""
    requests = sum(p["requests"] for p in passes)
    rounds = sum(p["rounds"] for p in passes)
    tokens, seconds = sum(p["tokens"] for p in passes), sum(p["seconds"] for p in passes)
    full_tokens, full_seconds = sum(p["full_load_tokens"] for p in passes), sum(p["full_load_seconds"] for p in passes)
    return {
        "concurrency": passes[0]["concurrency"],
        "passes": len(passes),
        "requests": requests,
        "tokens": tokens,
        "seconds": seconds,
        "throughput_tok_s": tokens / seconds,
        "pass_throughputs_tok_s": [p["throughput_tok_s"] for p in passes],
        "full_load_tokens": full_tokens,
        "full_load_seconds": full_seconds,
        "full_load_throughput_tok_s": full_tokens / full_seconds if full_seconds else 0.0,
        "pass_full_load_throughputs_tok_s": [p["full_load_throughput_tok_s"] for p in passes],
        "full_load_steps": sum(p["full_load_steps"] for p in passes),
        "steps": sum(p["steps"] for p in passes),
        "per_request_tok_s": sum(p["per_request_tok_s"] * p["requests"] for p in passes) / requests,
        "tau": sum(p["tau"] * p["rounds"] for p in passes) / rounds if rounds else 1.0,
        "mean_verified": sum(p["mean_verified"] * p["rounds"] for p in passes) / rounds if rounds else 0.0,
        "rounds": rounds,
        "skipped_rounds": sum(p["skipped_rounds"] for p in passes),
        "lookup_rounds": sum(p.get("lookup_rounds", 0) for p in passes),
        **_pooled_timings(passes),
    }


def _pooled_timings(passes: list[dict]) -> dict:
    """Medians of the engine's step seconds by width and drafting seconds at full load, and every admission's
    (requests, padded prompt tokens, seconds), over the passes: what a cost model for the simulator needs."""
    if "full_load_step_seconds" not in passes[0]:
        return {}
    steps: dict[int, list[float]] = {}
    for p in passes:
        for width, seconds in p["full_load_step_seconds"]:
            steps.setdefault(width, []).append(seconds)
    drafts = [seconds for p in passes for seconds in p["full_load_draft_seconds"]]
    return {
        "full_load_step_seconds_by_width": {str(w): {"median": statistics.median(v), "count": len(v)}
                                            for w, v in sorted(steps.items())},
        "full_load_draft_seconds": {"median": statistics.median(drafts), "count": len(drafts)} if drafts else None,
        "admissions": [a for p in passes for a in p["admissions"]],
    }


def _speed_profile(args, target, drafter, levels: list[int]) -> Path | None:
    """`--sps` (refused when measured in another dtype), else the profile the library's default policy would use,
    covering these concurrency levels (`steps_per_second_here`: the drafter folder's when it was measured on this
    kind of machine in the target's dtype at those batch sizes, else one measured here once and cached)."""
    if args.sps:
        mismatch = profile_dtype_mismatch(args.sps, target.dtype, is_packed(target))
        if mismatch:
            raise ValueError(f"--sps {args.sps}: {mismatch}.")
        return Path(args.sps)
    wanted = any(split_lookup(name, f"--methods {name}")[0] == "hardware_aware" for name in args.methods.split(",")
                 if name not in ("target", "prompt_lookup"))
    if not wanted or drafter.confidence_head is None:
        return None
    return steps_per_second_here(target, drafter, batch_sizes=levels)[1]


def _engines(args, target, drafter, pad_token_id, eos_token_id, sps_path: Path | None):
    """(name, engine factory) per method and `--admission_wait_rounds` value (the first unnamed)."""
    for index, wait in enumerate(args.admission_waits):
        suffix = f" wait={wait}" if index else ""
        for name, make_engine in _method_engines(args, target, drafter, pad_token_id, eos_token_id, sps_path, wait):
            yield name + suffix, make_engine


def _method_engines(args, target, drafter, pad_token_id, eos_token_id, sps_path: Path | None, wait: int | str):
    by_rows = load_speed_tables(sps_path) if sps_path is not None else None
    lookup_tokens = args.prompt_lookup_num_tokens
    common = {"eos_token_id": eos_token_id, "pad_token_id": pad_token_id, "admission_wait_rounds": wait}
    for name in args.methods.split(","):
        if name in ("target", "prompt_lookup"):
            tokens = lookup_tokens if name == "prompt_lookup" else None
            yield name, lambda t=tokens: DSparkBatchEngine(target, None, prompt_lookup_num_tokens=t, **common)
            continue
        policy_name, lookup = split_lookup(name, f"--methods {name}")
        tokens = lookup_tokens if lookup else None
        if policy_name == "hardware_aware":
            if sps_path is None:
                print("[bench-load] skipping hardware_aware: the drafter has no confidence head")
                continue
            policy = get_policy(policy_name, steps_per_second=str(sps_path))
        elif policy_name == "threshold":
            policy = get_policy(policy_name, threshold=args.threshold)
        else:
            policy = get_policy(policy_name)
        yield name, (lambda p=policy, t=tokens: DSparkBatchEngine(
            target, drafter, policy=p, steps_per_second_by_rows=by_rows, prompt_lookup_num_tokens=t, **common))


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in dict.fromkeys(r["method"] for r in results):
        rows = sorted((r for r in results if r["method"] == method), key=lambda r: r["concurrency"])
        line, = left.plot([r["concurrency"] for r in rows], [r["full_load_throughput_tok_s"] for r in rows],
                          marker="o", label=method)
        left.plot([r["concurrency"] for r in rows], [r["throughput_tok_s"] for r in rows], linestyle=":",
                  color=line.get_color())
        right.plot([r["per_request_tok_s"] for r in rows], [r["full_load_throughput_tok_s"] for r in rows],
                   marker="o", label=method)
    left.set(xscale="log", xlabel="concurrent requests", ylabel="total tokens/s",
             title="Throughput under load (dotted: whole run incl. drain)")
    right.set(xlabel="per-request tokens/s", ylabel="total tokens/s at full load",
              title="Throughput / per-user speed frontier")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = _parse_args(argv)
    torch.manual_seed(args.seed)
    path = args.drafter or EMBEDDED_DRAFTERS.get(args.target)
    if path is None:
        raise ValueError(f"No drafter ships for --target {args.target}; pass --drafter DRAFTER_DIR.")
    check_model_path(str(path))
    target, tokenizer = load_target(args.target, dtype=target_dtype(args.target_dtype),
                                    packed_linear=args.packed_linear)
    drafter = DSparkDrafter.from_pretrained(path, target=target, dtype=drafter_dtype(args.drafter_dtype)).eval()
    pack_linear_weights(drafter, args.packed_linear)
    prompts = first_turn_ids(tokenizer, args.prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    levels = [int(c) for c in args.concurrency.split(",")]
    sps_path = _speed_profile(args, target, drafter, levels)
    engines = list(_engines(args, target, drafter, pad, tokenizer.eos_token_id, sps_path))
    for _, make_engine in engines:  # untimed warmup: first-call allocations and kernel selection
        run_level(make_engine(), prompts, 2, 2, 8)
    results = []
    for level in tqdm(levels, desc="bench-load"):
        num_requests = args.requests or max(2 * level, 8)
        budgets = request_budgets(args.max_new_tokens, args.random_range_ratio, num_requests, args.seed + level)
        passes = run_passes(engines, prompts, level, num_requests, budgets, args.repeats, args.interleave)
        for row in pooled_rows(passes):
            name = row["method"]
            if name != "target" and "target" in passes:
                row.update(level_exactness(target, passes["target"], passes[name]))
            results.append(row)
            tqdm.write(f"c={level:>3} {name:>15}: {row['full_load_throughput_tok_s']:7.2f} tok/s at full load "
                       f"({row.get('full_load_vs_target', 1.0):.3f}x target), whole run {row['throughput_tok_s']:7.2f} "
                       f"({row.get('throughput_vs_target', 1.0):.3f}x), {row['per_request_tok_s']:6.2f} tok/s "
                       f"per request, tau {row['tau']:.2f}, {row['skipped_rounds']}/{row['rounds']} rounds without drafter")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    document = {"command": " ".join(["dspark-hf", "bench-load", *(argv if argv is not None else sys.argv[2:])]),
                "machine": machine_info(), "versions": version_info(),
                "speed_profile": str(sps_path) if sps_path else None,
                "settings": {**vars(args),
                             "target_dtype_resolved": str(target.dtype).removeprefix("torch."),
                             "target_packed_linear": is_packed(target),
                             "drafter_packed_linear": is_packed(drafter),
                             "drafter_dtype_resolved": str(drafter.dtype).removeprefix("torch.")},
                "results": results}
    (out / "bench_load.json").write_text(json.dumps(document, indent=2) + "\n")
    lines = [f"Target in {document['settings']['target_dtype_resolved']}, drafter in "
             f"{document['settings']['drafter_dtype_resolved']}; ratios and identity are against target-only batched "
             "decoding in the same dtype (margin: the target's top-1 minus top-2 logit at each first divergence).",
             "",
             "| concurrency | method | tok/s at full load | vs target | whole-run tok/s | vs target | "
             "per-request tok/s | tau | mean verified | rounds without drafter | of them lookup | identical | "
             "margin max / median |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ratios = [f"{r[key]:.3f}x" if key in r else "-" for key in ("full_load_vs_target", "throughput_vs_target")]
        skipped = f"{r['skipped_rounds'] / r['rounds']:.0%}" if r["rounds"] else "-"
        lookup = f"{r.get('lookup_rounds', 0) / r['rounds']:.0%}" if r["rounds"] else "-"
        identical = f"{r['identical']}/{r['identical_of']}" if "identical" in r else "-"
        margins = (f"{r['divergence_margin_max']:.3f} / {r['divergence_margin_median']:.3f}"
                   if r.get("divergences") else "-")
        lines.append(f"| {r['concurrency']} | {r['method']} | {r['full_load_throughput_tok_s']:.2f} | {ratios[0]} | "
                     f"{r['throughput_tok_s']:.2f} | {ratios[1]} | {r['per_request_tok_s']:.2f} | {r['tau']:.2f} | "
                     f"{r['mean_verified']:.2f} | {skipped} | {lookup} | {identical} | {margins} |")
    (out / "bench_load.md").write_text("\n".join(lines) + "\n")
    _plot(results, out / "bench_load.png")
    print("\n".join(lines))
    return 0
