"""Held-out model selection of the training campaign (issue 19): full-block tau, first-draft acceptance and acceptance
by block position, per prompt set, for drafters traced over the same greedy outputs of the target.

Full-block tau is what a drafter can give: every round verifies the whole block, and tau = committed tokens per round
(bench's definition). It needs no timing, so it can be measured beside a training job. Generate the target's outputs
once (that trace is also the first drafter's), then trace every other drafter over them (one target forward per
output, no generation):

    dspark-hf trace --prompts benchmarks/prompts/*.jsonl ../shared/data/eval/{gsm8k,humaneval,mt-bench}.jsonl \\
        --limit 20 --first_turn_only --max_new_tokens 256 --output runs/shipped.trace.json.gz
    dspark-hf trace --outputs_from runs/shipped.trace.json.gz --drafter CANDIDATE --output runs/candidate.trace.json.gz
    python scripts/campaign_eval.py shipped=runs/shipped.trace.json.gz candidate=runs/candidate.trace.json.gz \\
        --output benchmarks/results/smollm2-training/heldout-tau
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from dspark_hf.generation.policies import get_policy
from dspark_hf.simulation.cost import KneeCost
from dspark_hf.simulation.replay import replay_generation
from dspark_hf.simulation.trace import Trace


def full_block_rounds(trace: Trace) -> dict[str, list[tuple[int, int]]]:
    """(verified, accepted) of every full-block round, by category, replayed with the package's own `full` policy."""
    rounds: dict[str, list[tuple[int, int]]] = {}
    for sequence in trace.sequences:
        run = replay_generation(sequence, get_policy("full"), KneeCost(), trace.block_size, trace.max_new_tokens,
                                trace.eos_token_ids)
        rounds.setdefault(sequence.category, []).extend((r.verified, r.accepted) for r in run.rounds)
    return rounds


def summarize(rounds: list[tuple[int, int]], block_size: int) -> dict:
    """Tau, first-draft acceptance and P(draft k accepted | drafts before it accepted, k verified)."""
    by_position = []
    for k in range(block_size):
        reached = [accepted for verified, accepted in rounds if verified > k and accepted >= k]
        by_position.append(round(sum(accepted > k for accepted in reached) / len(reached), 4) if reached else None)
    return {"rounds": len(rounds), "tau": round((sum(a for _, a in rounds) + len(rounds)) / len(rounds), 4),
            "first_draft_acceptance": by_position[0], "acceptance_by_position": by_position}


def evaluate(traces: dict[str, Trace]) -> dict:
    outputs = None
    document = {}
    for name, trace in traces.items():
        these = [(s.prompt_id, s.output_ids) for s in trace.sequences]
        if outputs is not None and these != outputs:
            raise SystemExit(f"{name}: its outputs differ from the first trace's; trace it with --outputs_from the "
                             "first trace so that all drafters are judged on the same text.")
        outputs = these
        rounds = full_block_rounds(trace)
        categories = {category: summarize(values, trace.block_size) for category, values in rounds.items()}
        categories["all"] = summarize([r for values in rounds.values() for r in values], trace.block_size)
        document[name] = {"drafter": trace.metadata.get("drafter"), "command": trace.metadata.get("command"),
                          "dtype": trace.metadata.get("dtype"), "drafter_dtype": trace.metadata.get("drafter_dtype"),
                          "categories": categories}
    return document


def markdown(document: dict, outputs: dict) -> str:
    names = list(document)
    categories = list(next(iter(document.values()))["categories"])
    lines = ["# Held-out full-block tau (greedy, teacher-forced over the same target outputs)", "",
             f"Outputs: `{outputs.get('command')}` ({outputs.get('dtype')}). Drafters:", ""]
    lines += [f"- {name}: `{document[name]['drafter']}` ({document[name]['drafter_dtype']})" for name in names]
    lines += ["", "| prompt set | rounds | " + " | ".join(f"{n} tau | {n} first-draft" for n in names) + " |",
              "|---|---:|" + "---:|---:|" * len(names)]
    for category in categories:
        cells = [f"{document[n]['categories'][category]['tau']:.3f} | "
                 f"{document[n]['categories'][category]['first_draft_acceptance']:.3f}" for n in names]
        rounds = document[names[0]]["categories"][category]["rounds"]
        lines.append(f"| {category} | {rounds} | " + " | ".join(cells) + " |")
    lines += ["", ("Rounds are the first drafter's (each drafter has its own). Acceptance by block position is in "
                   "the JSON beside this file.")]
    return "\n".join(lines) + "\n"


def outputs_only(trace: Trace) -> Trace:
    """`trace` without its drafter's per-anchor fields: what `dspark-hf trace --outputs_from` reads."""
    sequences = [replace(s, draft_ids=[], confidences=[], confidence_logits=[], accept_lengths=[])
                 for s in trace.sequences]
    return Trace(trace.block_size, trace.max_new_tokens, trace.eos_token_ids, sequences, dict(trace.metadata))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", metavar="NAME=TRACE", help="traces over the same outputs, named")
    parser.add_argument("--output", type=Path, required=True, help="folder for heldout-tau.json and .md")
    parser.add_argument("--save_outputs", type=Path, help="write the first trace's prompts and outputs here")
    args = parser.parse_args(argv)
    traces = {}
    for item in args.traces:
        name, _, path = item.rpartition("=")
        if not name or not Path(path).is_file():
            parser.error(f"{item!r}: write NAME=TRACE with an existing trace file (from `dspark-hf trace`).")
        traces[name] = Trace.load(path)
    document = evaluate(traces)
    first = next(iter(traces.values())).metadata
    outputs = first.get("outputs_from") or first
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "heldout-tau.json").write_text(json.dumps({"outputs": outputs, "drafters": document}, indent=1))
    (args.output / "heldout-tau.md").write_text(markdown(document, outputs))
    if args.save_outputs:
        outputs_only(next(iter(traces.values()))).save(args.save_outputs)
    print(markdown(document, outputs))
    return document


if __name__ == "__main__":
    main()
