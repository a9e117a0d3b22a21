"""`dspark-hf bench-merge`: one report from benchmark runs made in parts.

A long benchmark (hundreds of prompts, 256 new tokens each, on a CPU) is easier to run in parts with `dspark-hf bench
--start S --limit N`: a part that is disturbed can be rerun alone. Merging is only honest when the parts measured the
same thing, so the parts must agree on methods, settings, versions and machine; the merged `results.json` keeps each
part's command and load averages, and the summary is recomputed from the pooled per-prompt records.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dspark_hf.benchmarks.report import summarize_records, write_report

from ..cli import ArgumentParser

# Machine fields that must match across parts; the load averages differ by nature and are kept per part.
MACHINE_KEYS = ("cpu_model", "cpu_count", "cpus_available", "torch_threads", "platform", "device", "cuda_device")
# Settings that may differ across parts: how many prompts each part ran.
PER_PART_SETTINGS = ("num_prompts",)


def _check_same(name: str, values: Sequence[Any], sources: Sequence[str]) -> None:
    for value, source in zip(values[1:], sources[1:]):
        if value != values[0]:
            raise ValueError(
                f"Cannot merge {source} with {sources[0]}: their {name} differ ({value!r} vs {values[0]!r}). "
                "Merge only parts of one benchmark: same command except --start/--limit, same machine and versions."
            )


def merge_results(documents: Sequence[dict[str, Any]], sources: Sequence[str] | None = None,
                  command: str | None = None) -> dict[str, Any]:
    """Pools the records of several `results.json` documents of one benchmark into one document.

    Args:
        documents: parsed `results.json` of each part, in the order their prompts should appear.
        sources: a name per part (its path) for error messages; defaults to `part 1`, `part 2`, ...
        command: the merge command line, stored as the merged document's `command`.

    Raises:
        ValueError: when the parts differ in methods, settings, versions or machine, or share a prompt.
    """
    if not documents:
        raise ValueError("Nothing to merge: pass the output folders (or results.json files) of at least one run.")
    sources = list(sources or [f"part {i + 1}" for i in range(len(documents))])
    _check_same("methods", [doc["methods"] for doc in documents], sources)
    _check_same("versions", [doc["versions"] for doc in documents], sources)
    _check_same("settings", [{k: v for k, v in doc["settings"].items() if k not in PER_PART_SETTINGS}
                             for doc in documents], sources)
    _check_same("machines", [{k: doc["machine"].get(k) for k in MACHINE_KEYS} for doc in documents], sources)
    seen: dict[tuple[str, str], str] = {}
    for doc, source in zip(documents, sources):
        for prompt in doc["prompts"]:
            key = (prompt["category"], prompt["prompt_id"])
            if key in seen:
                raise ValueError(f"Prompt {prompt['prompt_id']!r} is in both {seen[key]} and {source}: the parts "
                                 "overlap. Give each part its own --start/--limit range.")
            seen[key] = source
    first = documents[0]
    machine = {k: v for k, v in first["machine"].items() if k not in ("load_average", "load_average_before")}
    records = [record for doc in documents for record in doc["records"]]
    prompts = [prompt for doc in documents for prompt in doc["prompts"]]
    return {
        **first,
        "command": command or first["command"],
        "argv": None,
        "machine": machine,
        "parts": [
            {"source": source, "command": doc["command"], "num_prompts": len(doc["prompts"]),
             "load_average_before": doc["machine"].get("load_average_before"),
             "load_average": doc["machine"].get("load_average")}
            for doc, source in zip(documents, sources)
        ],
        "settings": {**first["settings"], "num_prompts": len(prompts)},
        "skipped_methods": {k: v for doc in documents for k, v in (doc.get("skipped_methods") or {}).items()},
        "prompts": prompts,
        "summary": summarize_records(records),
        "records": records,
    }


def _results_path(path: str) -> Path:
    candidate = Path(path)
    if candidate.is_dir():
        candidate = candidate / "results.json"
    if not candidate.is_file():
        raise FileNotFoundError(f"{path!r} is neither a results.json nor a folder holding one (from dspark-hf bench "
                                "--output_dir).")
    return candidate


def main(argv: Sequence[str] | None = None) -> int:
    """`dspark-hf bench-merge PART [PART ...] --output_dir OUT`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgumentParser(
        prog="dspark-hf bench-merge",
        description="Merge the results of one benchmark run in parts (dspark-hf bench --start/--limit) into one report.",
    )
    parser.add_argument("parts", nargs="+", metavar="PART", help="output folders or results.json files of the parts")
    parser.add_argument("--output_dir", required=True, help="where the merged results.json/.md and PNGs go")
    parser.add_argument("--no_plots", action="store_true")
    args = parser.parse_args(argv)
    paths = [_results_path(part) for part in args.parts]
    documents = [json.loads(path.read_text(encoding="utf-8")) for path in paths]
    merged = merge_results(documents, sources=[str(path) for path in paths],
                           command=shlex.join(["dspark-hf", "bench-merge", *argv]))
    written = write_report(args.output_dir, merged, plots=not args.no_plots)
    print(Path(written["markdown"]).read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(path) for path in written.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
