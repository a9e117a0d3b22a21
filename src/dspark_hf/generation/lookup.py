"""Prompt lookup inside DSpark rounds: when the sequence's last n-gram (n >= 2) occurred before, verify the tokens that
followed it there instead of running the drafter.

Long greedy answers of small models repeat themselves (code, lists, quoted passages), and there a continuation copied
from earlier in the sequence is accepted far more often than a 1-layer drafter's block; elsewhere the drafter runs as
usual. Turned on by transformers' own knob, `target.generate(..., assistant_model=drafter, prompt_lookup_num_tokens=10)`
(`max_matching_ngram_size` sets the longest n-gram looked for). Unlike transformers' prompt lookup this one only
matches n-grams of two tokens or more (a one-token match is a weak guess, and the drafter is the fallback here) and
takes the most recent occurrence.

Lookup drafts are a deterministic function of the sequence so far, so verifying them is lossless in both decoding modes:
greedy matching in greedy mode, and in sampling mode transformers samples the target's own token at each slot and
keeps the drafts that equal it (speculative sampling with a one-hot proposal). How many of them the target verifies is
decided like a drafted block's length when the drafter's policy has a speed profile (the hardware-aware policy): the
per-slot acceptance of earlier lookup rounds stands in for the confidences, and the length maximizes expected tokens
per second on the profiled curve; other policies verify every lookup draft.
"""

from __future__ import annotations

import torch

from ..scheduling import verification_capacity


MIN_NGRAM = 2


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
    length = ids.shape[0]
    for n in range(min(max_ngram, length - 1), MIN_NGRAM - 1, -1):
        windows = ids[: length - 1].unfold(0, n, 1)  # windows ending before the last token: the suffix itself is not one
        starts = (windows == ids[length - n:]).all(dim=1).nonzero().flatten()
        if starts.numel():
            begin = int(starts[-1]) + n
            return ids[begin: begin + num_tokens]
    return ids.new_empty(0)


class PromptLookup:
    """Lookup drafts for a DSpark round and the running acceptance that sizes them.

    Args:
        num_tokens (`int`): the most lookup drafts per round (`prompt_lookup_num_tokens`).
        max_ngram (`int`): the longest n-gram matched (`max_matching_ngram_size`, at least 2).
        eos_token_ids (`list[int]`): lookup drafts stop before an EOS token (transformers would otherwise keep drafts
            past an accepted EOS).
        decay (`float`, defaults to 0.9): weight of the earlier rounds in the acceptance estimate.
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
        # Decayed counts of lookup slots the target reached and of those it accepted; the prior is one accepted of two.
        self._reached, self._accepted = 2.0, 1.0

    @property
    def acceptance(self) -> float:
        """Estimated P(lookup draft k accepted | drafts before it accepted), from earlier lookup rounds."""
        return self._accepted / self._reached

    def candidates(self, input_ids: torch.LongTensor, budget: int, steps_per_second=None) -> torch.LongTensor:
        """This round's lookup drafts for the one sequence in `input_ids` `(1, seq)`, at most `budget` of them, cut to
        the length that pays on `steps_per_second` when given (empty: no match, or lookup does not pay now)."""
        found = find_continuation(input_ids[0], min(self.num_tokens, budget), self.max_ngram)
        if self.eos_token_ids and found.numel():
            is_eos = torch.isin(found, torch.tensor(self.eos_token_ids, device=found.device))
            if bool(is_eos.any()):
                found = found[: int(is_eos.nonzero()[0])]
        if steps_per_second is not None and found.numel():
            found = found[: verification_capacity([[self.acceptance] * found.numel()], steps_per_second)]
        return found

    def record(self, verified: int, accepted: int) -> None:
        """A lookup round's outcome: `accepted` of its `verified` drafts."""
        reached = accepted + (accepted < verified)  # the slots the target got to; the first rejected one included
        self._reached = self.decay * self._reached + reached
        self._accepted = self.decay * self._accepted + accepted
