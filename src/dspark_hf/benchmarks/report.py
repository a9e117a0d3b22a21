"""Aggregating per-prompt benchmark records and writing them out: JSON, a markdown table and PNG plots.

A *record* is one method's run over one prompt (all its turns) in one mode, as built by
`dspark_hf.benchmarks.bench.run_benchmark`; the summary pools records per (mode, method, category) and over all
categories (category `"all"`).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .exactness import summarize_divergences


ALL_CATEGORIES = "all"


def acceptance_by_position(rounds: Iterable[Sequence[int]]) -> list[float | None]:
    """For each draft position k = 1..max verified: P(draft k accepted | drafts before k accepted, k verified).

    Args:
        rounds (`Iterable[Sequence[int]]`): `(verified, accepted)` per round.

    Returns:
        One rate per position; `None` where no round reached that position.
    """
    rounds = [tuple(r) for r in rounds]
    longest = max((verified for verified, _ in rounds), default=0)
    rates: list[float | None] = []
    for position in range(1, longest + 1):
        reached = [accepted for verified, accepted in rounds if verified >= position and accepted >= position - 1]
        rates.append(sum(accepted >= position for accepted in reached) / len(reached) if reached else None)
    return rates


def geometric_mean(values: Iterable[float]) -> float | None:
    """Geometric mean of the positive values (`None` when there are none): the average of per-prompt ratios."""
    logs = [math.log(v) for v in values if v is not None and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def summarize_records(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pools `records` sharing (mode, method, category); adds a category `"all"` per (mode, method).

    Rates are pooled (total tokens / total seconds, total committed tokens / total forwards); the speed-up is the
    geometric mean of the per-prompt speed-ups; `identical` counts greedy prompts whose output matched target-only,
    and `divergence_margin_*` describe the target's top-1/top-2 logit margins where the others first diverged.
    """
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for record in records:
        groups[(record["mode"], record["method"], record["category"])].append(record)
        groups[(record["mode"], record["method"], ALL_CATEGORIES)].append(record)
    return [_summarize_group(mode, method, category, rows) for (mode, method, category), rows in groups.items()]


def _summarize_group(mode: str, method: str, category: str, rows: list[dict]) -> dict[str, Any]:
    rounds = [tuple(r) for row in rows for r in (row["round_lengths"] or [])]
    exactness = [row["identical"] for row in rows if row["identical"] is not None]
    memory = [row["peak_memory_bytes"] for row in rows if row["peak_memory_bytes"] is not None]
    seconds = sum(row["seconds"] for row in rows)
    new_tokens = sum(row["new_tokens"] for row in rows)
    return {
        "mode": mode,
        "method": method,
        "category": category,
        "prompts": len(rows),
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_second": _ratio(new_tokens, seconds),
        "speedup": geometric_mean(row["speedup"] for row in rows),
        "tau": _ratio(sum(row["tau_tokens"] for row in rows), sum(row["tau_forwards"] for row in rows)),
        "tokens_per_forward": _ratio(new_tokens, sum(row["target_forwards"] for row in rows)),
        "mean_verified": _ratio(sum(v for v, _ in rounds), len(rounds)) if rounds else None,
        "acceptance_by_position": acceptance_by_position(rounds),
        "identical": sum(exactness) if exactness else None,
        "identical_of": len(exactness),
        **summarize_divergences(row.get("first_divergence") for row in rows),
        "peak_memory_bytes": max(memory) if memory else None,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def markdown_table(summary: Sequence[dict[str, Any]], mode: str) -> str:
    """One row per (category, method) of `mode`, categories in first-seen order with `all` last."""
    rows = [row for row in summary if row["mode"] == mode]
    categories = sorted({row["category"] for row in rows}, key=lambda c: (c == ALL_CATEGORIES, c))
    lines = [
        "| category | method | prompts | tok/s | speed-up | tau | mean verified | identical | peak mem Δ (MiB) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | :---: | ---: |",
    ]
    for category in categories:
        for row in (r for r in rows if r["category"] == category):
            identical = "n/a" if row["identical"] is None else f"{row['identical']}/{row['identical_of']}"
            if row["identical"] is not None and row["identical"] == row["identical_of"]:
                identical = f"yes ({identical})"
            memory = None if row["peak_memory_bytes"] is None else row["peak_memory_bytes"] / 2**20
            lines.append(
                f"| {category} | {row['method']} | {row['prompts']} | {_fmt(row['tokens_per_second'])} | "
                f"{_fmt(row['speedup'], suffix='x')} | {_fmt(row['tau'])} | {_fmt(row['mean_verified'])} | "
                f"{identical} | {_fmt(memory, 1)} |"
            )
    return "\n".join(lines)


def divergence_table(summary: Sequence[dict[str, Any]], mode: str) -> str:
    """Per method (all categories), the identity rate and the target's logit margins at the first divergences."""
    lines = ["| method | identical | divergences | margin max | margin median | top-1 logit max |",
             "| --- | :---: | ---: | ---: | ---: | ---: |"]
    for row in summary:
        if row["mode"] == mode and row["category"] == ALL_CATEGORIES and row.get("divergences"):
            lines.append(f"| {row['method']} | {row['identical']}/{row['identical_of']} | {row['divergences']} | "
                         f"{_fmt(row['divergence_margin_max'], 3)} | {_fmt(row['divergence_margin_median'], 3)} | "
                         f"{_fmt(row['divergence_top1_logit_max'])} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _exactness_note(target_dtype: str | None) -> str:
    if target_dtype in (None, "float32"):
        return ("In float32 every greedy output must equal target-only's token for token; a divergence below is a "
                "bug.")
    return (f"In {target_dtype} each committed token is the argmax of the target's own verification forward, but a "
            "forward over k tokens rounds differently from k one-token forwards, so outputs may part from "
            "one-token decoding where the target's top two logits (nearly) tie. At each output's first divergence: "
            "the target's top-1 minus top-2 logit (one teacher-forced forward over target-only's output, in the "
            "run's dtype) and the top-1 logit, which sets the spacing of representable values.")


def _loads(values: Sequence[float] | None) -> str:
    return "—" if not values else " / ".join(f"{v:.2f}" for v in values)


def _load_lines(results: dict[str, Any]) -> list[str]:
    """The load-average line; one per part for a report merged by `dspark-hf bench-merge`."""
    note = "(timings are only comparable on an otherwise idle machine)"
    parts = results.get("parts")
    if not parts:
        machine = results["machine"]
        return [f"- load average (1/5/15 min) before: {_loads(machine.get('load_average_before'))}, after: "
                f"{_loads(machine.get('load_average'))} {note}"]
    lines = [f"- merged from {len(parts)} parts, load average (1/5/15 min) before / after each {note}:"]
    lines += [f"  - `{part['command']}` ({part['num_prompts']} prompts): {_loads(part['load_average_before'])}, "
              f"{_loads(part['load_average'])}" for part in parts]
    return lines


def describe_machine(machine: dict[str, Any]) -> str:
    """One line for a results file's `machine`: CPU model, CPUs, torch threads, and the GPU when there was one."""
    gpu = f", {machine['cuda_device']}" if machine.get("cuda_device") else ""
    return (f"{machine.get('cpu_model')} ({machine.get('cpu_count')} CPUs, {machine.get('torch_threads')} torch "
            f"threads){gpu}")


def markdown_report(results: dict[str, Any]) -> str:
    """The whole markdown report: how it was run, one table per mode, skipped methods."""
    machine, versions = results["machine"], results["versions"]
    settings = results["settings"]
    lines = [
        "# dspark-hf bench",
        "",
        f"- command: `{results['command']}`",
        f"- machine: {describe_machine(machine)}",
        *_load_lines(results),
        "- versions: " + ", ".join(f"{name} {version}" for name, version in versions.items()),
        f"- {settings['num_prompts']} prompts, max {settings['max_new_tokens']} new tokens, "
        f"seed {settings['seed']}, chat template: {settings['use_chat_template']}",
        f"- target dtype: {settings.get('target_dtype', settings.get('dtype'))}, drafter dtype: "
        f"{settings.get('drafter_dtype')} (speed-ups and identity are against target-only in the same dtype)",
        "",
        "tok/s: generated tokens / wall seconds (pooled); speed-up: geometric mean over prompts of tok/s ÷ target-only "
        "tok/s on the same prompt; tau: tokens committed per target forward (DSpark: per draft-and-verify round); "
        "mean verified: drafts sent to the target per round; identical: greedy outputs equal to target-only; "
        "peak mem Δ: peak memory during generation above its level at the start (see benchmarks/README.md).",
    ]
    for mode in settings["modes"]:
        lines += ["", f"## {mode}", "", markdown_table(results["summary"], mode)]
        divergences = divergence_table(results["summary"], mode)
        if divergences:
            target_dtype = settings.get("target_dtype", settings.get("dtype"))
            lines += ["", f"### Divergences from target-only ({mode})", "", _exactness_note(target_dtype), "",
                      divergences]
    if results.get("skipped_methods"):
        lines += ["", "## Skipped methods", ""]
        lines += [f"- `{name}`: {reason}" for name, reason in results["skipped_methods"].items()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never opens a window
    import matplotlib.pyplot as plt

    return plt


def _methods_in_order(rows: Sequence[dict]) -> list[str]:
    return list(dict.fromkeys(row["method"] for row in rows))


def plot_speedup(summary: Sequence[dict], mode: str, path: Path) -> None:
    """Grouped bars: speed-up over target-only per category, one bar per method."""
    plt = _pyplot()
    rows = [r for r in summary if r["mode"] == mode and r["method"] != "target"]
    categories = sorted({r["category"] for r in rows}, key=lambda c: (c == ALL_CATEGORIES, c))
    methods = _methods_in_order(rows)
    fig, ax = plt.subplots(figsize=(min(16, max(7, 0.35 * len(categories) * max(1, len(methods)) + 3)), 4))
    width = 0.8 / max(1, len(methods))
    lookup = {(r["method"], r["category"]): r["speedup"] for r in rows}
    for index, method in enumerate(methods):
        values = [lookup.get((method, category)) or 0.0 for category in categories]
        ax.bar([c + index * width for c in range(len(categories))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([c + width * (len(methods) - 1) / 2 for c in range(len(categories))], categories)
    ax.set_ylabel("speed-up over target-only (x)")
    ax.set_title(f"Speed-up per category ({mode})")
    if methods:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_acceptance(summary: Sequence[dict], mode: str, path: Path) -> None:
    """Acceptance rate per draft position (all categories pooled), one line per speculative method."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in summary:
        if row["mode"] != mode or row["category"] != ALL_CATEGORIES or not row["acceptance_by_position"]:
            continue
        rates = row["acceptance_by_position"]
        positions = [k + 1 for k, rate in enumerate(rates) if rate is not None]
        ax.plot(positions, [rate for rate in rates if rate is not None], marker="o", label=row["method"])
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accept k | 1..k-1 accepted)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Acceptance per position ({mode})")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_tau_distribution(records: Sequence[dict], mode: str, path: Path) -> None:
    """Box plot of the per-prompt tau of each method."""
    plt = _pyplot()
    rows = [r for r in records if r["mode"] == mode and r["tau"] is not None]
    methods = _methods_in_order(rows)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(methods)), 4))
    if methods:
        ax.boxplot([[r["tau"] for r in rows if r["method"] == m] for m in methods], showmeans=True)
        ax.set_xticks(range(1, len(methods) + 1), methods, rotation=20)
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title(f"Per-prompt tau ({mode})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(output_dir: str | Path, results: dict[str, Any], plots: bool = True) -> dict[str, Path]:
    """Writes `results.json`, `results.md` and (if `plots`) `{speedup,acceptance,tau}_<mode>.png` to `output_dir`.

    Returns the written paths by name.
    """
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": output_dir / "results.json", "markdown": output_dir / "results.md"}
    paths["json"].write_text(json.dumps(results, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    paths["markdown"].write_text(markdown_report(results), encoding="utf-8")
    if plots:
        for mode in results["settings"]["modes"]:
            for name, plot, data in (("speedup", plot_speedup, results["summary"]),
                                     ("acceptance", plot_acceptance, results["summary"]),
                                     ("tau", plot_tau_distribution, results["records"])):
                paths[f"{name}_{mode}"] = output_dir / f"{name}_{mode}.png"
                plot(data, mode, paths[f"{name}_{mode}"])
    return paths
