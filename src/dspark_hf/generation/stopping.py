"""Stopping criteria over rounds that commit several tokens at once.

Plain decoding asks its stopping criteria after every token. A speculative round commits up to a block of tokens, and
transformers' assisted loop asks the criteria once per round, of the whole sequence, cutting a round only at EOS and
at the length limit. Any other criterion then stops late, or not at all: `StopStringCriteria` looks at the end of the
sequence, so a stop string completed in the middle of a round is missed and generation runs on past it (so does
transformers' own prompt lookup). Here every prefix a round committed is asked, shortest first, and the output is
cut at the first that stops: the tokens plain decoding would have returned.

Criteria are assumed to be functions of the tokens (and of the scores up to that token), as transformers' own are,
except `MaxTimeCriteria`, which depends on the clock and is asked once per round, of the whole sequence.
"""

from __future__ import annotations

import inspect

import torch
from transformers import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria, StoppingCriteriaList
from transformers.generation import BaseStreamer


# Asked once per round, of the whole sequence: the length limit and EOS (every loop cuts a round at those itself) and
# `MaxTimeCriteria` (a clock, not a function of the tokens).
_ONCE_PER_ROUND = (MaxLengthCriteria, EosTokenCriteria, MaxTimeCriteria)


def token_criteria(criteria) -> StoppingCriteriaList:
    """The criteria a round must ask of each prefix: all but those asked once per round."""
    return StoppingCriteriaList([c for c in criteria or () if not isinstance(c, _ONCE_PER_ROUND)])


def drop_last(cache, count: int) -> None:
    """Removes the last `count` positions of a cache, the target's or the drafter's context (transformers >= 5.2x's
    `crop` counts down, older ones up: the custom_generate recipe, which inlines this module, runs on both)."""
    if not count:
        return
    if "tokens_to_remove" in inspect.signature(cache.crop).parameters:
        cache.crop(-count)
    else:
        cache.crop(cache.get_seq_length() - count)


def cut_cache(cache, length: int) -> None:
    """Cuts a target cache to a sequence of `length` tokens: K/V for all but the last (not computed yet), dropping
    what a round computed past an output cut there."""
    drop_last(cache, max(cache.get_seq_length() - (length - 1), 0))


def time_criteria(criteria) -> StoppingCriteriaList:
    """The clock-based criteria (`MaxTimeCriteria`): asked once per round."""
    return StoppingCriteriaList([c for c in criteria or () if isinstance(c, MaxTimeCriteria)])


def first_stop(criteria: StoppingCriteriaList, sequence: torch.LongTensor, start: int, scores=None,
               scores_start: int = 0) -> int | None:
    """The shortest length `L` in ``(start, sequence.shape[-1]]`` at which `criteria` stop ``sequence[:, :L]``, or
    `None`. `sequence` is one row, ``(1, length)``; `scores`, when given, a tuple with one entry per token after
    `scores_start` (as generate keeps them), is cut to match each prefix."""
    if not criteria:
        return None
    for length in range(start + 1, sequence.shape[-1] + 1):
        prefix_scores = scores[: length - scores_start] if isinstance(scores, tuple) else scores
        if bool(criteria(sequence[:, :length], prefix_scores).any()):
            return length
    return None


class _HeldStreamer(BaseStreamer):
    """Holds each round's tokens until the round's stopping check has said how many of them stand."""

    def __init__(self, streamer: BaseStreamer):
        self.streamer, self.held = streamer, []

    def put(self, value):
        self.held.append(value)

    def release(self, count: int | None = None) -> None:
        """Passes on the first `count` held tokens (all of them with `None`) and drops the rest."""
        if self.held:
            tokens = torch.cat([value.reshape(-1) for value in self.held])[:count]
            self.held = []
            if tokens.numel():
                self.streamer.put(tokens[None])

    def end(self):
        self.release()
        self.streamer.end()


class RoundStopping(StoppingCriteriaList):
    """transformers' stopping criteria for its batch-1 assisted loop, asked of every prefix a round committed.

    Pass it (and `streamer`, which holds each round's tokens until the check) to the loop in place of the criteria
    and streamer generate built, then `cut` the loop's output at the first prefix that stopped. The prompt is what
    the loop starts from (``prompt_length`` tokens); it was streamed before the loop. `checks_candidates`: the loop
    also asks the criteria of each round's unverified candidates, before its check of the committed tokens
    (transformers < 5.18); those calls get only the once-per-round criteria, as the loop meant them, and only when
    the round drafted (told "done" of a round without drafts, that loop keeps one token fewer than none: a prompt
    ending in an EOS would come back unanswered).
    """

    def __init__(self, criteria: StoppingCriteriaList, streamer: BaseStreamer | None, prompt_length: int,
                 checks_candidates: bool = False):
        super().__init__(criteria)
        self.by_token, self.checked_length, self.prompt_length = token_criteria(criteria), prompt_length, prompt_length
        self.rest = StoppingCriteriaList([c for c in criteria if isinstance(c, _ONCE_PER_ROUND)])
        self.streamer = None if streamer is None else _HeldStreamer(streamer)
        self.stop_length: int | None = None
        self.checks_candidates, self.calls = checks_candidates, 0

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.calls += 1
        if self.checks_candidates and self.calls % 2:  # a round's candidates, not yet verified
            if input_ids.shape[-1] <= self.checked_length:
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            return self.rest(input_ids, scores, **kwargs)
        stop = first_stop(self.by_token, input_ids, self.checked_length, scores, scores_start=self.prompt_length)
        if self.streamer is not None:
            self.streamer.release(None if stop is None else stop - self.checked_length)
        self.checked_length = input_ids.shape[-1]
        if stop is not None:
            self.stop_length = stop
            return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return self.rest(input_ids, scores, **kwargs)

    def cut(self, output):
        """The loop's output (ids, or a generate output with per-token tuples and a cache) cut at the stop."""
        if self.stop_length is None:
            return output
        if torch.is_tensor(output):
            return output[:, : self.stop_length]
        kept = self.stop_length - self.prompt_length
        output.sequences = output.sequences[:, : self.stop_length]
        for name in ("scores", "logits", "attentions", "hidden_states"):
            if isinstance(getattr(output, name, None), tuple):
                setattr(output, name, getattr(output, name)[:kept])
        cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
        if cache is not None and hasattr(cache, "crop"):
            cut_cache(cache, self.stop_length)
        return output
