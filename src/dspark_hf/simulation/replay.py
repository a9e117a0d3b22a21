"""Replaying verification policies on a trace: batch 1 through the assisted loop's protocol, many requests through
the batched engine's own scheduling code, with every second taken from a cost model.

- [`replay_generation`] drives a policy exactly as `DSparkCandidateGenerator` and transformers' assisted loop do,
  through the policy interface (`reset`, `begin_round`, `num_slots`, `verified` and `settled` slot by slot through
  the drafting loop's `SlotSchedule`, `end_round`), with the trace's confidences and acceptance lengths in place of
  the models. For a greedy target the rounds are exactly the live ones (`tests/test_simulate.py`).
- [`SimulatedBatchEngine`] is a `DSparkBatchEngine` whose model calls are replaced: admission, drafting, the target
  forward and verification read the trace and advance a simulated clock by the cost model. Everything that decides
  (width planning, probes, backoff, online corrections from measured step and drafting times, admission into
  finished rows, retirement at EOS and budget) is the engine's and the policy's own code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..generation.batched import AUTO_ADMISSION, DSparkBatchEngine, DSparkRequest, check_admission_wait_rounds
from ..generation.drafting import DraftedBlock, SlotSchedule
from ..generation.lookup import PromptLookup
from ..generation.policies import VerificationPolicy, get_policy
from ..generation.verification_policy import RoundOutcome
from .cost import CostModel
from .trace import TraceSequence, _accept_length


@dataclass
class SimulatedRound:
    """One batch-1 round: drafts verified and accepted, slots sampled, whether the drafter ran, seconds spent, and where
    the drafts came from."""

    verified: int
    accepted: int
    slots: int
    drafted: bool
    seconds: float
    source: str = "drafter"  # "lookup": prompt-lookup drafts (`verified` of them), the drafter did not run


@dataclass
class SimulatedGeneration:
    """One replayed `generate` call."""

    new_tokens: int
    seconds: float
    rounds: list[SimulatedRound] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Committed tokens per round (as `bench` reports DSpark's tau: the prefill is not a round)."""
        return (sum(r.accepted for r in self.rounds) + len(self.rounds)) / len(self.rounds) if self.rounds else 1.0


def _choose(
    policy: VerificationPolicy, confidences: Sequence[Sequence[float]], budgets: list[int], block_size: int
) -> tuple[list[list[float]], SlotSchedule]:
    """The drafting loop (`drafting.sample_drafts`) on known confidences, one row per entry of `confidences` (empty
    rows for a drafter without confidence head): the confidences it computed, and its schedule (drafts verified,
    slots sampled, whether the policy observed the round), through the same `SlotSchedule`."""
    schedule, seen = SlotSchedule(policy, budgets), [[] for _ in confidences]
    for slot in range(min(block_size, policy.num_slots(block_size, budgets))):
        for row, values in zip(seen, confidences):
            if values:
                row.append(values[slot])
        if not schedule.admit(slot, seen):
            break
    return seen, schedule


def replay_generation(
    sequence: TraceSequence, policy: VerificationPolicy | None, cost: CostModel, block_size: int,
    max_new_tokens: int, eos_token_ids: Sequence[int] = (), lookup: PromptLookup | None = None,
) -> SimulatedGeneration:
    """One batch-1 `generate` call on `sequence` (`policy=None`: target-only decoding) with at most `max_new_tokens`.

    The committed output is the trace's, cut at `max_new_tokens`; each round accepts ``min(verified, A(c))`` drafts,
    cut again at an EOS and at the budget, as transformers' assisted loop cuts them. With `lookup` (prompt lookup
    inside rounds, `prompt_lookup_num_tokens`), rounds choose between lookup drafts and the drafter as
    `DSparkCandidateGenerator` does; lookup drafts are checked against the trace's output.
    """
    output = _committed_output(sequence, max_new_tokens, eos_token_ids)
    seconds = cost.prefill_seconds(1, len(sequence.prompt_ids))
    run = SimulatedGeneration(new_tokens=len(output), seconds=seconds)
    if policy is None:
        run.seconds += (len(output) - 1) * cost.verify_seconds(1, 1)
        return run
    policy.reset()
    if lookup is not None:
        lookup.reset()
    speed = getattr(policy, "steps_per_second", None)
    ids = torch.tensor(sequence.prompt_ids + output)

    def lookup_round(committed: int, drafting: bool) -> SimulatedRound | None:
        if lookup is None:
            return None
        found = lookup.candidates(ids[None, : len(sequence.prompt_ids) + committed], max_new_tokens - committed - 1,
                                  speed, getattr(policy, "drafting_cost", lambda: 0.0)(), drafting=drafting)
        if not found.numel():
            return None
        reference = output[committed: len(output) - 1]  # a draft past the budget or the EOS is never committed
        accepted = _accept_length(found.tolist(), reference)
        lookup.record(found.numel(), accepted)
        return SimulatedRound(found.numel(), accepted, 0, False, cost.verify_seconds(1, 1 + found.numel()), "lookup")

    committed, observed = 1, None  # the prefill commits the first token; rounds start after it
    while committed < len(output):
        looked_up = lookup_round(committed, drafting=True)
        if looked_up is None and not policy.begin_round([observed], block_size):
            policy.end_round(RoundOutcome([[]], [0], [0], drafted=False))
            looked_up = lookup_round(committed, drafting=False) or SimulatedRound(0, 0, 0, False,
                                                                                  cost.verify_seconds(1, 1))
        if looked_up is not None:
            run.rounds.append(looked_up)
            committed += looked_up.accepted + 1
            continue
        max_drafts = min(block_size, max_new_tokens - committed - 1)
        seen, schedule = _choose(policy, [sequence.confidences[committed - 1]], [max_drafts], block_size)
        verified, slots, settled = schedule.lengths[0], schedule.num_sampled, schedule.observed(seen)
        draft = cost.drafting_seconds(1, slots)
        accepted = min(sequence.accepted(committed, verified), len(output) - committed - 1)
        policy.end_round(RoundOutcome(seen, [verified], [accepted], observed=settled, draft_seconds=draft))
        if lookup is not None:
            lookup.record_drafted(verified, accepted)
        observed = seen[0] if settled else observed
        run.rounds.append(SimulatedRound(verified, accepted, slots, True, draft + cost.verify_seconds(1, 1 + verified)))
        committed += accepted + 1
    run.seconds += sum(r.seconds for r in run.rounds)
    return run


def replay_prompt_lookup(
    sequence: TraceSequence, cost: CostModel, max_new_tokens: int, eos_token_ids: Sequence[int] = (),
    num_tokens: int = 10, max_ngram: int = 2,
) -> SimulatedGeneration:
    """transformers' own prompt lookup decoding (`generate(prompt_lookup_num_tokens=num_tokens)` without a drafter,
    the `bench` baseline) on `sequence`: each round verifies the `num_tokens` tokens that followed the *earliest*
    earlier occurrence of the longest suffix n-gram (`max_ngram` tokens down to 1), cut before an EOS, as transformers'
    `PromptLookupCandidateGenerator` picks them; no match decodes one token."""
    output = _committed_output(sequence, max_new_tokens, eos_token_ids)
    run = SimulatedGeneration(new_tokens=len(output), seconds=cost.prefill_seconds(1, len(sequence.prompt_ids)))
    ids, prompt_length, eos = sequence.prompt_ids + output, len(sequence.prompt_ids), set(eos_token_ids)
    committed = 1
    while committed < len(output):
        length = prompt_length + committed
        found: list[int] = []
        for n in range(min(max_ngram, length - 1), 0, -1):
            suffix = ids[length - n: length]
            start = next((i + n for i in range(length - n) if ids[i: i + n] == suffix), None)
            if start is not None:
                found = ids[start: min(start + num_tokens, length)]
                break
        found = found[: next((j for j, token in enumerate(found) if token in eos), len(found))]
        found = found[: max(0, max_new_tokens - committed - 1)]
        reference = output[committed: len(output) - 1]
        accepted = _accept_length(found, reference)
        run.rounds.append(SimulatedRound(len(found), accepted, 0, False, cost.verify_seconds(1, 1 + len(found)),
                                         "lookup"))
        committed += accepted + 1
    run.seconds += sum(r.seconds for r in run.rounds)
    return run


def _committed_output(sequence: TraceSequence, max_new_tokens: int, eos_token_ids: Sequence[int]) -> list[int]:
    """The trace's output cut at `max_new_tokens` and the first EOS; refuses a budget the trace does not cover."""
    output, eos = sequence.output_ids, set(eos_token_ids)
    if len(output) < max_new_tokens and not (output and output[-1] in eos):
        raise ValueError(f"The trace of {sequence.prompt_id} (turn {sequence.turn}) stops after {len(output)} tokens "
                         f"without an EOS, short of max_new_tokens={max_new_tokens}; trace with a larger "
                         "--max_new_tokens or simulate a smaller one.")
    output = output[:max_new_tokens]
    return output[: next((i + 1 for i, token in enumerate(output) if token in eos), len(output))]


class SimulatedClock:
    """Seconds since the simulation started; advanced only by simulated work."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SimulatedBatchEngine(DSparkBatchEngine):
    """A [`DSparkBatchEngine`] on a trace: requests are added by prompt ids (a trace sequence's `prompt_ids`), and
    every model call is replaced by the trace and the cost model's seconds.

    Args:
        sequences (`Sequence[TraceSequence]`): the generations requests may ask for (looked up by prompt ids).
        cost ([`CostModel`]): seconds of prefill, drafting and verification forwards.
        block_size (`int`): the drafter's block size.
        policy (`str` or [`VerificationPolicy`], *optional*): `None` simulates target-only batched decoding.
        eos_token_ids (`Sequence[int]`), steps_per_second_by_rows, prompt_lookup_num_tokens,
            max_matching_ngram_size, admission_wait_rounds: as for the engine (lookup drafts are checked against the
            trace's output; with `policy=None` and lookup, batched prompt lookup decoding without a drafter).
    """

    def __init__(self, sequences: Sequence[TraceSequence], cost: CostModel, block_size: int,
                 policy: str | VerificationPolicy | None = None, eos_token_ids: Sequence[int] = (),
                 steps_per_second_by_rows=None, prompt_lookup_num_tokens: int | None = None,
                 max_matching_ngram_size: int = 3, admission_wait_rounds: int | str = AUTO_ADMISSION):
        self.clock = SimulatedClock()
        self.admission_wait_rounds, self._waited_rounds = check_admission_wait_rounds(admission_wait_rounds), 0
        self.prompt_lookup_num_tokens, self.max_matching_ngram_size = prompt_lookup_num_tokens, max_matching_ngram_size
        self.cost = cost
        self.by_prompt = {tuple(s.prompt_ids): s for s in sequences}
        self.target, self.drafter, self.policy = None, None, None
        if policy is not None:
            self.drafter = SimpleNamespace(config=SimpleNamespace(block_size=block_size))  # what scheduling reads
            self._use_policy(get_policy(policy), steps_per_second_by_rows)
        self.do_sample, self.logits_processor, self._processing, self.stopping_criteria = False, [], False, []
        self.eos_token_ids, self.pad_token_id = set(int(e) for e in eos_token_ids), 0
        self.device = torch.device("cpu")
        self.waiting, self.active, self.finished = [], [], []
        self.draft_timings, self.step_timings, self.admit_timings = [], [], []
        self._next_id = 0
        self._sequence_of: dict[int, TraceSequence] = {}
        self._reset_batch_state()

    def add_request(self, prompt_ids, max_new_tokens: int) -> DSparkRequest:
        key = tuple(int(t) for t in prompt_ids)
        if key not in self.by_prompt:
            raise ValueError("No trace sequence has this prompt; trace the prompts first (`dspark-hf trace`).")
        request = super().add_request(list(key), max_new_tokens)
        _committed_output(self.by_prompt[key], max_new_tokens, self.eos_token_ids)  # refuses uncovered budgets
        self._sequence_of[request.request_id] = self.by_prompt[key]
        return request

    # --- the model calls, replaced ------------------------------------------------------------------------------

    def _admit(self) -> list[DSparkRequest]:
        new, self.waiting, self._waited_rounds = self.waiting, [], 0
        self.clock.advance(self.cost.prefill_seconds(len(new), max(len(r.prompt_ids) for r in new)))
        free = [row for row, request in enumerate(self.active) if request.finished][: len(new)]
        for row, request in zip(free, new):  # take over finished rows in place, as the engine does
            self.active[row] = request
            self.next_position[row] = len(request.prompt_ids)
        rest = new[len(free):]
        if rest:
            self.active += rest
            self.next_position = torch.cat([self.next_position, torch.tensor([len(r.prompt_ids) for r in rest])])
            self.anchor = torch.cat([self.anchor, torch.zeros(len(rest), dtype=torch.long)])
            self.slot_mask = torch.zeros(len(self.active), 0, dtype=torch.bool)
        new_rows = free + list(range(len(self.active) - len(rest), len(self.active)))
        firsts = [self._sequence_of[r.request_id].output_ids[:1] for r in new]
        return self._commit_and_retire(dict(zip(new_rows, firsts)))

    def _select_rows(self, keep_rows: list[int]) -> None:
        self.active = [self.active[i] for i in keep_rows]
        if not self.active:
            self._reset_batch_state()
            return
        index = torch.tensor(keep_rows)
        self.next_position, self.anchor = self.next_position[index], self.anchor[index]
        self.slot_mask = torch.zeros(len(self.active), 0, dtype=torch.bool)

    def _draft(self, budgets: list[int]) -> DraftedBlock:
        """The engine's slot loop (`DSparkBatchEngine._draft`) on the trace: the same `SlotSchedule` and policy."""
        rows, block_size = len(self.active), self.drafter.config.block_size
        at_anchor = [self._sequence_of[r.request_id] for r in self.active]
        committed = [len(r.output_ids) for r in self.active]
        # a finished request's row kept for a waiting one is drafted along but never seen: zeros, as the policy sees it
        kept = [r.finished for r in self.active]
        rows_at_anchor = list(zip(at_anchor, committed, kept))
        confidences, schedule = _choose(
            self.policy, [[0.0] * block_size if k else s.confidences[c - 1] for s, c, k in rows_at_anchor], budgets,
            block_size)
        slots = schedule.num_sampled
        self.clock.advance(self.cost.drafting_seconds(rows, slots))
        ids = torch.tensor([[0] * slots if k else s.draft_ids[c - 1][:slots] for s, c, k in rows_at_anchor],
                           dtype=torch.long)
        return DraftedBlock(ids.view(rows, slots), torch.zeros(rows, slots, 0), confidences, [[] for _ in range(rows)],
                            schedule.lengths, schedule.observed(confidences))  # fmt: skip

    def _target_forward(self, input_ids, attention_mask, position_ids, cache, logits_to_keep: int = 0):
        self.clock.advance(self.cost.verify_seconds(*input_ids.shape))
        return None, None

    def _greedy_choices(self, logits) -> None:
        return None  # no logits: the trace decides each row (`_verify_row`)

    def _verify_row(self, request, row, length, verify_ids, logits, draft, choices=None) -> tuple[list[int], int]:
        sequence, committed = self._sequence_of[request.request_id], len(request.output_ids)
        if draft is None and length:  # lookup drafts: accepted as far as they are the trace's output
            accepted = _accept_length(verify_ids[row, 1:1 + length].tolist(), sequence.tokens_after(committed, length))
            return sequence.tokens_after(committed, accepted + 1), accepted
        accepted = sequence.accepted(committed, length) if length else 0
        return sequence.tokens_after(committed, accepted + 1), accepted

    def _advance(self, accepted: list[int], longest: int, features, positions) -> None:
        self.next_position = self.next_position + 1 + torch.tensor(accepted)
