"""Teacher-forced traces of a drafter over a target's greedy outputs (`dspark-hf trace`).

With a greedy target the committed output is the same for every verification policy. At the anchor that follows the
first `c` committed tokens (the token ``output[c - 1]`` at absolute position ``P + c - 1``), the drafter's block, its
confidences and the number of drafts the target would accept are fixed by the prefix alone. So one target forward over
``prompt + output`` gives the features of every position, and the drafter runs at every anchor at once (the training
objective's block mask: the block at anchor p sees the context strictly before p). A simulator then replays any
policy on the trace without running a model (`dspark_hf.simulation.replay`).

What the live generator computes differs only by float rounding: it feeds the drafter context from verification
forwards of varying lengths and attends without a mask, while the trace uses one forward over the whole sequence and
a block mask. Tokens match exactly except at near-ties; confidences match to about 1e-5 in float32
(`tests/test_simulate.py` checks both on a tiny model).

```bash
dspark-hf trace --prompts data/eval/gsm8k.jsonl --limit 6 --max_new_tokens 128 --output gsm8k.trace.json.gz
# another drafter over the same greedy outputs (no generation: one target forward per output)
dspark-hf trace --outputs_from gsm8k.trace.json.gz --drafter my-drafter --output mine.trace.json.gz
```
"""

from __future__ import annotations

import argparse
import gzip
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..cli import ArgumentParser
from ..modeling_dspark import DSparkDrafter
from ..training.blocks import build_blocks, pad_anchors
from ..training.features import compute_target_signals
from ..training.objective import drafter_block_states


TRACE_FORMAT = "dspark-hf-trace"
TRACE_VERSION = 1
ANCHORS_PER_FORWARD = 32  # drafter blocks per teacher-forced forward (bounds memory: anchors x context)


@dataclass
class TraceSequence:
    """One greedy generation (one turn of a prompt) and the drafter's view at every anchor.

    Attributes:
        prompt_id, category, turn: where the generation comes from (turn is 0-based).
        prompt_ids: the tokenized prompt (P tokens).
        output_ids: the committed greedy output, N tokens (ends at the first EOS or at `max_new_tokens`).
        continuation_ids: what the target writes after an EOS that ended the output early (up to a block; empty when
            the output ran to `max_new_tokens`): a batched engine accepts drafts past an EOS before cutting there.
        draft_ids: per anchor c = 1..N-1 (index c - 1), the block of greedy drafts for output positions c, c+1, ...
        confidences: per anchor, the calibrated c_k of every slot (empty lists for drafters without confidence head).
        confidence_logits: per anchor, the raw confidence logits z_k.
        accept_lengths: per anchor, A(c): the leading drafts equal to ``output_ids + continuation_ids`` from c.
    """

    prompt_id: str
    category: str
    turn: int
    prompt_ids: list[int]
    output_ids: list[int]
    continuation_ids: list[int] = field(default_factory=list)
    draft_ids: list[list[int]] = field(default_factory=list)
    confidences: list[list[float]] = field(default_factory=list)
    confidence_logits: list[list[float]] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)

    def accepted(self, committed: int, verified: int) -> int:
        """Drafts the target accepts at the anchor after `committed` output tokens when `verified` are sent (before
        any cut at an EOS or the length budget)."""
        return min(verified, self.accept_lengths[committed - 1])

    def tokens_after(self, committed: int, count: int) -> list[int]:
        """The `count` tokens the target commits after `committed` output tokens (past an EOS too)."""
        return (self.output_ids + self.continuation_ids)[committed:committed + count]


@dataclass
class Trace:
    """A set of [`TraceSequence`]s with how they were made (`metadata`: command, versions, dtypes, models)."""

    block_size: int
    max_new_tokens: int
    eos_token_ids: list[int]
    sequences: list[TraceSequence]
    metadata: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        """Writes gzipped JSON (floats round-trip exactly)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        document = {"format": TRACE_FORMAT, "version": TRACE_VERSION, **asdict(self)}
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            json.dump(document, handle, separators=(",", ":"))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No trace at {path}; write one with `dspark-hf trace --output {path} ...`.")
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as handle:
            document = json.load(handle)
        if document.get("format") != TRACE_FORMAT:
            raise ValueError(f"{path} is not a `dspark-hf trace` file (format {document.get('format')!r}).")
        sequences = [TraceSequence(**s) for s in document.pop("sequences")]
        fields = {k: document[k] for k in ("block_size", "max_new_tokens", "eos_token_ids", "metadata")}
        return cls(sequences=sequences, **fields)


def _accept_length(drafts: Sequence[int], reference: Sequence[int]) -> int:
    length = 0
    while length < len(drafts) and length < len(reference) and drafts[length] == reference[length]:
        length += 1
    return length


@torch.no_grad()
def greedy_continuation(target: PreTrainedModel, ids: torch.LongTensor, num_tokens: int) -> list[int]:
    """The target's next `num_tokens` greedy tokens after `ids` `(1, seq)`, ignoring EOS."""
    tokens = []
    for _ in range(num_tokens):
        token = target(input_ids=ids).logits[0, -1].argmax()
        tokens.append(int(token))
        ids = torch.cat([ids, token.view(1, 1).to(ids.dtype)], dim=1)
    return tokens


@torch.no_grad()
def draft_at_anchors(
    target: PreTrainedModel, drafter: DSparkDrafter, prompt_ids: Sequence[int], output_ids: Sequence[int]
) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
    """Greedy drafts, calibrated confidences and raw confidence logits at every anchor c = 1..N-1, teacher forced.

    One target forward over ``prompt + output`` gives the context features; the drafter then runs on
    `ANCHORS_PER_FORWARD` blocks at a time, and the Markov-corrected greedy sampling runs slot by slot for all anchors
    of a forward together (each slot conditioned on the block's own previous draft, as at inference).
    """
    config = drafter.config
    ids = torch.tensor([list(prompt_ids) + list(output_ids)], device=target.device)
    features = compute_target_signals(target, ids, None, config.target_layer_ids).context_features
    features = features.to(drafter.device)
    anchors = list(range(len(prompt_ids), len(prompt_ids) + len(output_ids) - 1))
    drafts, confidences, logits = [], [], []
    for start in range(0, len(anchors), ANCHORS_PER_FORWARD):
        chunk = torch.tensor(anchors[start:start + ANCHORS_PER_FORWARD])
        anchor_ids, keep = pad_anchors([chunk])
        blocks = build_blocks(ids.cpu(), torch.ones_like(ids.cpu()), anchor_ids, keep, config.block_size,
                              config.mask_token_id)
        blocks = type(blocks)(**{k: v.to(drafter.device) for k, v in vars(blocks).items()})
        context = features[:, : int(chunk.max())]  # every block sees positions strictly before its anchor
        states = drafter_block_states(drafter, blocks, context, config.block_size)[0]  # (n, B, hidden)
        chunk_drafts, chunk_confidences, chunk_logits = _sample_blocks(drafter, states, ids[0, chunk].to(drafter.device))
        drafts += chunk_drafts
        confidences += chunk_confidences
        logits += chunk_logits
    return drafts, confidences, logits


def _sample_blocks(drafter: DSparkDrafter, states: torch.Tensor, anchor_ids: torch.LongTensor):
    """Left-to-right greedy drafting of `n` blocks at once from their states `(n, B, hidden)`, as the candidate
    generator drafts one block (confidence before each slot's token, the Markov bias from the previous draft)."""
    base_logits = drafter.draft_logits(states)
    previous, state = anchor_ids, None
    tokens, confidences, raw = [], [], []
    for slot in range(states.shape[1]):
        confidence_logits = drafter.confidence_logits(states[:, slot], previous)
        if confidence_logits is not None:
            raw.append(confidence_logits.float())
            confidences.append(drafter.calibrated_confidence(confidence_logits, slot).float())
        corrected, state = drafter.corrected_logits(base_logits[:, slot], previous, states[:, slot], state)
        previous = corrected.argmax(dim=-1)
        tokens.append(previous)
    as_rows = lambda columns: torch.stack(columns, dim=1).tolist() if columns else [[] for _ in anchor_ids]  # noqa: E731
    return as_rows(tokens), as_rows(confidences), as_rows(raw)


def trace_sequence(
    target: PreTrainedModel, drafter: DSparkDrafter, prompt_ids: Sequence[int], output_ids: Sequence[int],
    eos_token_ids: Sequence[int], max_new_tokens: int, **labels,
) -> TraceSequence:
    """The [`TraceSequence`] of one greedy output (`labels`: prompt_id, category, turn)."""
    output_ids = list(output_ids)
    continuation = []
    if output_ids and output_ids[-1] in set(eos_token_ids) and len(output_ids) < max_new_tokens:
        ids = torch.tensor([list(prompt_ids) + output_ids], device=target.device)
        continuation = greedy_continuation(target, ids, drafter.config.block_size)
    drafts, confidences, logits = draft_at_anchors(target, drafter, prompt_ids, output_ids)
    reference = output_ids + continuation
    accept = [_accept_length(block, reference[c:]) for c, block in enumerate(drafts, start=1)]
    return TraceSequence(prompt_ids=list(prompt_ids), output_ids=output_ids, continuation_ids=continuation,
                         draft_ids=drafts, confidences=confidences, confidence_logits=logits, accept_lengths=accept,
                         **labels)


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    from ..models import DEFAULT_TARGET, DRAFTER_DTYPES

    parser = ArgumentParser(prog="dspark-hf trace", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target name or folder (default: %(default)s)")
    parser.add_argument("--drafter", help="drafter folder (default: the one embedded for the target)")
    parser.add_argument("--prompts", nargs="+", metavar="FILE", help="jsonl prompt files")
    parser.add_argument("--outputs_from", metavar="TRACE",
                        help="instead of --prompts: the prompts and greedy outputs of this trace, drafted again by "
                        "--drafter (compares drafters on the same outputs without generating them again)")
    parser.add_argument("--start", type=int, default=0, help="skip this many prompts per category")
    parser.add_argument("--limit", type=int, help="keep at most this many prompts per category")
    parser.add_argument("--first_turn_only", action="store_true",
                        help="trace only each prompt's first turn (what `bench-load` sends)")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="per turn (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--drafter_dtype", default="auto", choices=DRAFTER_DTYPES,
                        help="as in `bench` (default: %(default)s)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU; 1 beside other jobs)")
    parser.add_argument("--output", required=True, help="trace file to write (.json.gz)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if (args.prompts is None) == (args.outputs_from is None):
        parser.error("give --prompts (generate and trace) or --outputs_from TRACE (trace that trace's outputs), "
                     "not both or neither")
    return args


def trace_prompts(target, tokenizer, drafter, prompts, max_new_tokens: int, first_turn_only: bool = False,
                  progress: bool = False):
    """Greedy conversations as `dspark-hf bench` runs them (each turn sees the earlier answers), traced per turn."""
    from tqdm.auto import tqdm

    from ..benchmarks.methods import generation_kwargs
    from ..benchmarks.prompts import render_conversation

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kwargs = generation_kwargs("greedy", max_new_tokens, pad)
    eos = target.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    sequences = []
    for prompt in tqdm(prompts, desc="trace", unit="prompt", disable=not progress):
        answers = []
        for turn in range(1 if first_turn_only else len(prompt.turns)):
            text = render_conversation(tokenizer, prompt.turns, answers)
            input_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(target.device)
            with torch.no_grad():
                output = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
            new_ids = output[0, input_ids.shape[1]:].tolist()
            sequences.append(trace_sequence(target, drafter, input_ids[0].tolist(), new_ids, eos, max_new_tokens,
                                            prompt_id=prompt.prompt_id, category=prompt.category, turn=turn))
            answers.append(tokenizer.decode(new_ids, skip_special_tokens=True).strip())
    return sequences, eos


def retrace(target: PreTrainedModel, drafter: DSparkDrafter, trace: Trace, progress: bool = False) -> Trace:
    """`trace` with `drafter`'s drafts, confidences and A(c) over the same prompts and greedy outputs."""
    from tqdm.auto import tqdm

    sequences = [
        trace_sequence(target, drafter, s.prompt_ids, s.output_ids, trace.eos_token_ids, trace.max_new_tokens,
                       prompt_id=s.prompt_id, category=s.category, turn=s.turn)
        for s in tqdm(trace.sequences, desc="trace", unit="output", disable=not progress)
    ]
    return Trace(drafter.config.block_size, trace.max_new_tokens, list(trace.eos_token_ids), sequences)


def main(argv: Sequence[str] | None = None) -> int:
    from ..benchmarks.bench import default_drafter, version_info
    from ..benchmarks.prompts import load_prompts
    from ..models import drafter_dtype, load_target

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    source = Trace.load(args.outputs_from) if args.outputs_from else None
    prompts = load_prompts(args.prompts, start=args.start, limit=args.limit) if source is None else None
    target, tokenizer = load_target(args.target, dtype=getattr(torch, args.dtype))
    drafter_path = args.drafter or default_drafter(args.target)
    draft_dtype = drafter_dtype(args.drafter_dtype)
    drafter = DSparkDrafter.from_pretrained(drafter_path, target=target, dtype=draft_dtype).eval()
    metadata = {"command": shlex.join(["dspark-hf", "trace", *argv]), "versions": version_info(),
                "target": args.target, "drafter": str(drafter_path), "dtype": args.dtype,
                "drafter_dtype": str(draft_dtype).removeprefix("torch."),
                "policy_free": "greedy; drafts, confidences and A(c) do not depend on the verification policy"}
    if source is None:
        sequences, eos = trace_prompts(target, tokenizer, drafter, prompts, args.max_new_tokens,
                                       args.first_turn_only, progress=True)
        trace = Trace(drafter.config.block_size, args.max_new_tokens, eos, sequences, metadata)
    else:
        trace = retrace(target, drafter, source, progress=True)
        trace.metadata = {**metadata, "outputs_from": {"path": args.outputs_from,
                                                       "command": source.metadata.get("command"),
                                                       "dtype": source.metadata.get("dtype")}}
    path = trace.save(args.output)
    anchors = sum(len(s.draft_ids) for s in trace.sequences)
    print(f"wrote {path}: {len(trace.sequences)} generations, {anchors} anchors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
