"""Prompt lookup inside DSpark rounds: when the sequence's last n-gram occurred before, verify the tokens that
followed it there instead of running the drafter.

Long greedy answers of small models repeat themselves (code, lists, quoted passages), and there a continuation copied
from earlier in the sequence is accepted far more often than a 1-layer drafter's block; elsewhere the drafter runs as
usual. Turned on by transformers' own knob, `target.generate(..., assistant_model=drafter, prompt_lookup_num_tokens=10)`
(`max_matching_ngram_size` sets the longest n-gram looked for). Unlike transformers' prompt lookup this one takes the
most recent occurrence, and it chooses per round between the lookup drafts and the drafter:

- with a speed profile (the hardware-aware policy), by expected tokens per second. Lookup drafts found after an
  n-gram match are worth ``(1 + Σ_{j<=K} a_n^j) · SPS(1 + K)`` for K verified, where a_n is the per-slot acceptance
  of earlier lookup rounds after a match of the same n (a one-token match is a weaker guess than a three-token one),
  and K maximizes it on the profiled curve (0: plain decoding pays more, and the drafter runs). A match of 2+ tokens
  then takes the round. A one-token match takes it only over a drafted round's expected rate,
  ``(1 + E_d) / (draft_seconds + 1 / SPS(1 + V_d))`` from the drafts accepted (E_d) and verified (V_d) in earlier
  drafted rounds, or when the policy skips drafting. (The drafter is not weighed against 2+-token matches: its
  rate is measured where lookup found nothing, and it accepts less where text repeats.)
- without one (the `full` or threshold policies), a match of two tokens or more is verified in full.

`dspark-hf simulate --policies hardware_aware+lookup` replays these choices on a trace, as the generator makes them.

Lookup drafts are a deterministic function of the sequence so far, so verifying them is lossless in both decoding modes:
greedy matching in greedy mode, and in sampling mode transformers samples the target's own token at each slot and
keeps the drafts that equal it (speculative sampling with a one-hot proposal). Every choice reads finished rounds only.
"""

from __future__ import annotations

import torch

from ..scheduling import StepsPerSecondCurve, drafted_step_throughput, verification_capacity


MIN_NGRAM = 2  # without a speed profile: the shortest match worth verifying instead of a drafted block


def match_continuation(ids: torch.LongTensor, num_tokens: int, max_ngram: int = 3,
                       min_ngram: int = MIN_NGRAM) -> tuple[torch.LongTensor, int]:
    """The tokens that followed the most recent earlier occurrence of the longest matching suffix n-gram of `ids`,
    and that n (0 with an empty result when no suffix of `min_ngram`..`max_ngram` tokens occurred before)."""
    length = ids.shape[0]
    for n in range(min(max_ngram, length - 1), max(min_ngram, 1) - 1, -1):
        windows = ids[: length - 1].unfold(0, n, 1)  # windows ending before the last token: the suffix itself is not one
        starts = (windows == ids[length - n:]).all(dim=1).nonzero().flatten()
        if starts.numel():
            begin = int(starts[-1]) + n
            return ids[begin: begin + num_tokens], n
    return ids.new_empty(0), 0


def find_continuation(ids: torch.LongTensor, num_tokens: int, max_ngram: int = 3) -> torch.LongTensor:
    """The tokens that followed the most recent earlier occurrence of the longest matching suffix n-gram of `ids`.

    Args:
        ids (`torch.LongTensor` of shape `(seq,)`): the sequence so far (prompt and generated tokens).
        num_tokens (`int`): the most tokens to return.
        max_ngram (`int`, defaults to 3): the longest suffix tried; suffixes down to 2 tokens are tried in turn.

    Returns:
        `torch.LongTensor` of shape `(k,)` with 0 <= k <= num_tokens (empty when nothing matches).

    ```python
    >>> import torch
    >>> from dspark_hf.generation.lookup import find_continuation
    >>> find_continuation(torch.tensor([5, 6, 7, 8, 1, 5, 6, 9, 5, 6]), 3).tolist()  # the latest "5 6" was followed by 9
    [9, 5, 6]

    ```
    """
    return match_continuation(ids, num_tokens, max_ngram)[0]


class NgramIndex:
    """[`match_continuation`] for a sequence that only grows, in time independent of its length: the most recent
    start of every n-gram (1 to `max_ngram` tokens) that ends before the last token, updated as tokens are appended.

    The batched engine matches every row's sequence every round; rescanning ~300 tokens per row cost ~4 ms a round at
    32 rows (~4% of a decoding step), this a few microseconds per row.

    ```python
    >>> from dspark_hf.generation.lookup import NgramIndex
    >>> index = NgramIndex(max_ngram=3)
    >>> index.extend([5, 6, 7, 8, 1, 5, 6, 9, 5, 6])
    >>> index.match(3)  # the latest earlier "5 6" was followed by 9
    ([9, 5, 6], 2)

    ```
    """

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.ids: list[int] = []
        self._starts: dict[tuple[int, ...], int] = {}

    def extend(self, tokens) -> None:
        """Appends `tokens` to the indexed sequence."""
        ids, starts = self.ids, self._starts
        for token in tokens:
            end = len(ids)  # the windows ending at the current last token now end before the last token
            for n in range(1, min(self.max_ngram, end) + 1):
                starts[tuple(ids[end - n:end])] = end - n
            ids.append(int(token))

    def match(self, num_tokens: int, min_ngram: int = MIN_NGRAM) -> tuple[list[int], int]:
        """What [`match_continuation`] returns for the sequence so far, as a list."""
        ids, length = self.ids, len(self.ids)
        for n in range(min(self.max_ngram, length - 1), max(min_ngram, 1) - 1, -1):
            start = self._starts.get(tuple(ids[length - n:]))
            if start is not None:
                return ids[start + n: start + n + num_tokens], n
        return [], 0


class PromptLookup:
    """Chooses each round's source (lookup drafts, or the drafter) and sizes the lookup drafts.

    Args:
        num_tokens (`int`): the most lookup drafts per round (`prompt_lookup_num_tokens`).
        max_ngram (`int`): the longest n-gram matched (`max_matching_ngram_size`, at least 2).
        eos_token_ids (`list[int]`): lookup drafts stop before an EOS token (transformers would otherwise keep drafts
            past an accepted EOS).
        decay (`float`, defaults to 0.9): weight of the earlier rounds in the acceptance estimates.
    """

    def __init__(self, num_tokens: int, max_ngram: int = 3, eos_token_ids: list[int] | None = None,
                 decay: float = 0.9):
        if num_tokens < 1:
            raise ValueError(f"prompt_lookup_num_tokens must be >= 1 to use prompt lookup, got {num_tokens}.")
        self.num_tokens = num_tokens
        self.max_ngram = max(MIN_NGRAM, max_ngram)
        self.eos_token_ids = list(eos_token_ids or [])
        self.decay = decay
        self.reset()

    def reset(self) -> None:
        """Forgets the rounds of the last generation (each prompt repeats itself differently)."""
        # Per n-gram size, decayed counts of lookup slots the target reached and of those it accepted; the prior is one
        # of two after a match of 2+ tokens, one of four after a one-token match (a weaker guess).
        self._lookup = {n: [2.0 if n > 1 else 4.0, 1.0] for n in range(1, self.max_ngram + 1)}
        # Decayed drafted rounds, drafts accepted and drafts verified in them: one round, one of two drafts.
        self._drafted = [1.0, 1.0, 2.0]
        self.last_ngram = 0  # the match length of the last lookup drafts returned
        self._index: NgramIndex | None = None  # `match_sequence`'s index of the sequence so far

    def acceptance(self, ngram: int = MIN_NGRAM) -> float:
        """Estimated P(lookup draft k accepted | drafts before it accepted) after an `ngram`-token match."""
        reached, accepted = self._lookup[ngram]
        return accepted / reached

    def drafted_rate(self, steps_per_second: StepsPerSecondCurve, draft_seconds: float) -> float:
        """Expected committed tokens per second of a drafted round, from earlier drafted rounds."""
        rounds, accepted, verified = self._drafted
        speed = steps_per_second(1 + max(1, round(verified / rounds))) or steps_per_second(1)
        return drafted_step_throughput(1.0 + accepted / rounds, speed, draft_seconds)

    def candidates(self, input_ids: torch.LongTensor, budget: int, steps_per_second=None, draft_seconds: float = 0.0,
                   drafting: bool = True) -> torch.LongTensor:
        """This round's lookup drafts for the one sequence in `input_ids` `(1, seq)`, at most `budget` of them; empty
        when nothing matches or when lookup does not pay.

        Args:
            steps_per_second (*optional*): the target's profiled curve; without it any match of 2+ tokens is verified
                in full.
            draft_seconds (`float`): one drafting pass's seconds (with `steps_per_second`).
            drafting (`bool`): whether the drafter would run this round (the alternative lookup has to beat); `False`
                when the policy skips drafting, so that lookup competes with plain decoding only.
        """
        curve = None if steps_per_second is None else StepsPerSecondCurve.from_table(steps_per_second)
        found, ngram = self.match(input_ids[0], budget, MIN_NGRAM if curve is None else 1)
        if curve is not None and found.numel():
            acceptance = self.acceptance(ngram)
            found = found[: verification_capacity([[acceptance] * found.numel()], curve)]
            if found.numel() and drafting and ngram == 1:
                expected = sum(acceptance ** j for j in range(found.numel() + 1))
                if expected * curve(1 + found.numel()) < self.drafted_rate(curve, draft_seconds):
                    found = found[:0]
        self.last_ngram = ngram if found.numel() else 0
        return found

    def match(self, ids: torch.LongTensor, budget: int, min_ngram: int = MIN_NGRAM) -> tuple[torch.LongTensor, int]:
        """The continuation of the longest earlier match of the suffix of `ids` `(seq,)` (`match_continuation`), at
        most `budget` and `num_tokens` tokens, cut before any EOS token; and the match length (0: nothing found)."""
        if budget < 1:
            return ids.new_empty(0), 0
        found, ngram = match_continuation(ids, min(self.num_tokens, budget), self.max_ngram, min_ngram)
        return self._before_eos(found.tolist(), ngram, ids.device)

    def match_sequence(self, sequence: list[int], budget: int, min_ngram: int = MIN_NGRAM
                       ) -> tuple[torch.LongTensor, int]:
        """[`match`] for the growing sequence of one request (its prompt, then its output), through an incremental
        [`NgramIndex`]: only the tokens appended since the last call are indexed. A sequence that does not extend the
        indexed one starts a new index."""
        index = self._index
        if index is None or len(sequence) < len(index.ids) or sequence[:len(index.ids)] != index.ids:
            index = self._index = NgramIndex(self.max_ngram)
        index.extend(sequence[len(index.ids):])
        if budget < 1:
            return torch.empty(0, dtype=torch.long), 0
        return self._before_eos(*index.match(min(self.num_tokens, budget), min_ngram))

    def _before_eos(self, found: list[int], ngram: int, device=None) -> tuple[torch.LongTensor, int]:
        """`found` cut before its first EOS token, as a tensor, and `ngram` (0 when nothing is left)."""
        for cut, token in enumerate(found):
            if token in self.eos_token_ids:
                found = found[:cut]
                break
        return torch.tensor(found, dtype=torch.long, device=device), (ngram if found else 0)

    def record(self, verified: int, accepted: int, ngram: int | None = None) -> None:
        """A lookup round's outcome: `accepted` of its `verified` drafts, found after an `ngram`-token match (the last
        one `candidates` returned by default)."""
        counts = self._lookup[ngram or self.last_ngram or MIN_NGRAM]
        reached = accepted + (accepted < verified)  # the slots the target got to; the first rejected one included
        counts[0] = self.decay * counts[0] + reached
        counts[1] = self.decay * counts[1] + accepted

    def record_drafted(self, verified: int, accepted: int) -> None:
        """A drafted round's outcome (0 verified: the drafter ran but the policy verified none of its drafts)."""
        rounds, total_accepted, total_verified = self._drafted
        self._drafted = [self.decay * rounds + 1, self.decay * total_accepted + accepted,
                         self.decay * total_verified + verified]
