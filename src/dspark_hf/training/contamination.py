"""Keeping evaluation prompts out of training prompts: word n-gram overlap against a set of evaluation texts.

A training prompt is rejected when, after normalising case, punctuation and whitespace, it shares any 13-word n-gram
with an evaluation prompt, or when more than half of its 8-word n-grams occur in one single evaluation prompt (the
near-copy with a few words changed, too short or too edited for a 13-gram to survive). Prompts shorter than 8 words
are rejected only when they equal an evaluation prompt.

Boilerplate is not evidence of overlap: an 8-gram that occurs in many evaluation prompts (`boilerplate_min_texts`, e.g.
HumanEval's "write a solution to the following problem and make sure that it passes the tests" or GSM8K's "please
reason step by step ...") is a template that training prompts may share on purpose, so n-grams touching it are not
indexed and it does not count towards a prompt's 8-grams.

Example:

    >>> index = EvalOverlapIndex(["Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning."])
    >>> index.overlap("janet's ducks lay 16 eggs per day; she eats three for breakfast every morning!")
    '13-gram "janet s ducks lay 16 eggs per day she eats three for breakfast"'
    >>> index.overlap("Write a haiku about the sea.") is None
    True
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path


_WORD = re.compile(r"\w+")


def normalized_words(text: str) -> list[str]:
    """Lower-cased word tokens of `text` (letters, digits and `_`; punctuation and whitespace dropped)."""
    return _WORD.findall(text.lower())


def _ngrams(words: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


class EvalOverlapIndex:
    """N-gram index of evaluation texts; [`overlap`] says whether (and why) a candidate training text overlaps them.

    Args:
        eval_texts (`Iterable[str]`): every evaluation prompt (each user turn as its own text is fine).
        long_n (`int`): any shared n-gram of this many words rejects (13).
        short_n (`int`): n-gram length of the near-copy rule (8).
        max_short_fraction (`float`): reject when more than this fraction of the candidate's `short_n`-grams occur in
            one evaluation text (0.5).
        boilerplate_min_texts (`int`): a `short_n`-gram found in at least this many evaluation texts is boilerplate.
    """

    def __init__(self, eval_texts: Iterable[str], long_n: int = 13, short_n: int = 8,
                 max_short_fraction: float = 0.5, boilerplate_min_texts: int = 5):
        if not 0 < short_n <= long_n:
            raise ValueError(f"Expected 0 < short_n <= long_n, got short_n={short_n}, long_n={long_n}.")
        if not 0.0 <= max_short_fraction < 1.0:
            raise ValueError(f"max_short_fraction must be in [0, 1), got {max_short_fraction}.")
        self.long_n, self.short_n, self.max_short_fraction = long_n, short_n, max_short_fraction
        texts = [normalized_words(text) for text in eval_texts]
        self.num_texts = len(texts)
        counts = Counter(gram for words in texts for gram in set(_ngrams(words, short_n)))
        self.boilerplate = {gram for gram, count in counts.items() if count >= boilerplate_min_texts}
        self.whole_texts = {tuple(words) for words in texts if 0 < len(words) < short_n}
        self.long_grams: dict[tuple[str, ...], int] = {}
        self.short_grams: dict[tuple[str, ...], set[int]] = defaultdict(set)
        for text_id, words in enumerate(texts):
            content = self._content_mask(words)
            for start in range(len(words) - short_n + 1):
                if all(content[start:start + short_n]):
                    self.short_grams[tuple(words[start:start + short_n])].add(text_id)
                if all(content[start:start + long_n]) and start + long_n <= len(words):
                    self.long_grams.setdefault(tuple(words[start:start + long_n]), text_id)

    def _content_mask(self, words: Sequence[str]) -> list[bool]:
        """False at the positions covered by a boilerplate n-gram."""
        mask = [True] * len(words)
        for start, gram in enumerate(_ngrams(words, self.short_n)):
            if gram in self.boilerplate:
                mask[start:start + self.short_n] = [False] * self.short_n
        return mask

    def overlap(self, text: str) -> str | None:
        """`None` when `text` may be used for training, else a short reason naming the shared words."""
        words = normalized_words(text)
        if len(words) < self.short_n:
            return "equals an evaluation prompt" if tuple(words) in self.whole_texts else None
        for gram in _ngrams(words, self.long_n):
            if gram in self.long_grams:
                return f'{self.long_n}-gram "{" ".join(gram)}"'
        grams = [gram for gram in _ngrams(words, self.short_n) if gram not in self.boilerplate]
        if not grams:
            return None
        shared = Counter(text_id for gram in grams for text_id in self.short_grams.get(gram, ()))
        if shared:
            text_id, count = shared.most_common(1)[0]
            if count / len(grams) > self.max_short_fraction:
                return f"{count} of its {len(grams)} {self.short_n}-grams are in evaluation prompt #{text_id}"
        return None


def prompt_file_texts(path: str | Path, skip_lines: tuple[int, int] | None = None) -> list[str]:
    """Every user turn of a `{"turns": [...]}` jsonl file, leaving out the 1-based lines `skip_lines=(first, last)`."""
    texts = []
    with Path(path).open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip() or (skip_lines and skip_lines[0] <= line_number <= skip_lines[1]):
                continue
            try:
                turns = json.loads(line)["turns"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f'{path}:{line_number}: expected a JSON object with "turns" ({error!r}).') from error
            texts += [turn for turn in turns if isinstance(turn, str)]
    return texts
