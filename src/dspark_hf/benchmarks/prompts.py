"""Benchmark prompts: reading prompt files and rendering multi-turn conversations.

Two jsonl layouts are read, one JSON object per line:

- `{"turns": ["first user turn", "second user turn", ...]}`: the eval sets under `data/eval/`; the category is the file
  name without its extension (`gsm8k.jsonl` -> `gsm8k`).
- Spec-Bench's `question.jsonl`: `{"question_id": 81, "category": "writing", "turns": [...]}`; the category comes from
  each record.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark conversation.

    Attributes:
        prompt_id: `question_id` when the file has one, else `"<file stem>-<line number>"` (1-based).
        category: the record's `category`, else the file stem.
        turns: the user turns, asked one after the other; each one sees the model's answers to the earlier ones.
    """

    prompt_id: str
    category: str
    turns: tuple[str, ...]


def parse_prompt_record(record: dict, default_category: str, default_id: str) -> BenchPrompt:
    """A [`BenchPrompt`] from one decoded jsonl record (either layout).

    Raises `ValueError` naming the record when `turns` is missing, empty or not a list of strings.
    """
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(turn, str) for turn in turns):
        raise ValueError(
            f"Prompt {default_id}: expected `turns` to be a non-empty list of strings, got {turns!r:.120}. "
            'Each line must look like {"turns": ["..."]} (optionally with "question_id" and "category").'
        )
    prompt_id = str(record["question_id"]) if record.get("question_id") is not None else default_id
    category = str(record.get("category") or default_category)
    return BenchPrompt(prompt_id=prompt_id, category=category, turns=tuple(turns))


def read_prompt_file(path: str | Path) -> list[BenchPrompt]:
    """All prompts of one jsonl file, in file order (blank lines are skipped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"Prompt file {str(path)!r} does not exist; pass jsonl files such as data/eval/gsm8k.jsonl."
        )
    prompts = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number} is not valid JSON ({error}).") from error
            prompts.append(parse_prompt_record(record, path.stem, f"{path.stem}-{line_number}"))
    return prompts


def select_per_category(prompts: Iterable[BenchPrompt], start: int = 0, limit: int | None = None) -> list[BenchPrompt]:
    """Skips the first `start` prompts of each category and keeps at most `limit` of each after that.

    Per category rather than per file, so that `--limit 10` on Spec-Bench's single `question.jsonl` still covers every
    category. The input order is kept.
    """
    if start < 0 or (limit is not None and limit < 0):
        raise ValueError(f"--start and --limit must be >= 0, got start={start}, limit={limit}.")
    seen: dict[str, int] = {}
    selected = []
    for prompt in prompts:
        index = seen.get(prompt.category, 0)
        seen[prompt.category] = index + 1
        if index >= start and (limit is None or index < start + limit):
            selected.append(prompt)
    return selected


def load_prompts(paths: Sequence[str | Path], start: int = 0, limit: int | None = None) -> list[BenchPrompt]:
    """Reads every file in `paths` and applies [`select_per_category`]; raises `ValueError` if nothing is left."""
    prompts = [prompt for path in paths for prompt in read_prompt_file(path)]
    selected = select_per_category(prompts, start=start, limit=limit)
    if not selected:
        raise ValueError(
            f"No prompts selected from {[str(p) for p in paths]} with --start {start} --limit {limit} "
            f"({len(prompts)} prompts read)."
        )
    return selected


def conversation_messages(turns: Sequence[str], answers: Sequence[str]) -> list[dict[str, str]]:
    """Chat messages for asking `turns[len(answers)]`, with the earlier turns and their answers before it.

    Args:
        turns (`Sequence[str]`): all user turns of the conversation.
        answers (`Sequence[str]`): the model's answers to the first `len(answers)` turns (fewer than `len(turns)`).
    """
    if len(answers) >= len(turns):
        raise ValueError(f"Got {len(answers)} answers for {len(turns)} turns; there is no turn left to ask.")
    messages = []
    for turn, answer in zip(turns, answers):
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": turns[len(answers)]})
    return messages


def render_conversation(
    tokenizer: PreTrainedTokenizerBase, turns: Sequence[str], answers: Sequence[str], use_chat_template: bool = True
) -> str:
    """The prompt text for the next turn: the tokenizer's chat template with a generation prompt, or (without a
    template) the turns and answers joined by blank lines."""
    messages = conversation_messages(turns, answers)
    if not use_chat_template:
        return "\n\n".join(message["content"] for message in messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The tokenizer ({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '?')!r}) has no chat "
            "template. Use an instruct model's tokenizer, or pass --no_chat_template to feed the raw turns."
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def first_turn_ids(tokenizer: PreTrainedTokenizerBase, paths: Sequence[str | Path]) -> list[list[int]]:
    """Every prompt of `paths` as `dspark-hf bench-load` sends it: its first turn in the chat template, as token ids."""
    return [tokenizer(render_conversation(tokenizer, p.turns[:1], []), add_special_tokens=False)["input_ids"]
            for p in load_prompts(paths)]
