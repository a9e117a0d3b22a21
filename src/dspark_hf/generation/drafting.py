"""Drafting one block for a batch of rows, and verifying it: the one implementation every DSpark decoding path runs.

Batch 1 (`DSparkCandidateGenerator`, inside transformers' assisted loop), the batched engine (`DSparkBatchEngine`)
and the standalone ``custom_generate`` recipe each run the drafter's block forward their own way (their caches
differ), then hand its output to [`sample_drafts`]: drafts sampled left to right with the Markov bias, confidences,
and the verification lengths a policy decides slot by slot (the interface of `dspark_hf.generation.verification_policy`;
docs/design.md, "Drafting and verification").
The batched engine and the recipe verify with [`verify`]; batch 1 leaves verification to transformers' loop.

A drafter here is anything with [`DSparkDrafter`]'s three per-slot methods: `confidence_logits`,
`calibrated_confidence` and `corrected_logits` (the recipe's standalone drafter has them too).

The recipe runs on the Hub without dspark-hf installed, so `dspark_hf.hub` writes it with this module's source
inlined: keep this module to torch and the standard library (tests/test_hub.py runs the written recipe without
dspark-hf).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class DraftedBlock:
    """One round's drafts for `rows` rows.

    Attributes:
        ids (`torch.LongTensor` of shape `(rows, slots)`): the sampled drafts (target ids). A row verifies its first
            `lengths[row]`; the slots after them were sampled only to compute confidences a policy observes.
        scores (`torch.Tensor` of shape `(rows, slots, sampled_vocab)`): the processed, Markov-corrected logits each
            draft was sampled from, over the vocabulary it was sampled in (the draft vocabulary when `expand` is set).
        confidences (`list[list[float]]`): calibrated c_1, c_2, ... per row, as many as were computed (empty lists
            without a confidence head).
        confidence_logits (`list[list[float]]`): the raw logits behind `confidences`.
        lengths (`list[int]`): drafts each row verifies.
        observed (`bool`): the policy judged the computed confidences complete for what it learns from the round
            (its `settled`).
        expand (`Callable`, *optional*): maps `scores` to the target vocabulary (-inf elsewhere); `None` when they are
            over it already.
    """

    ids: torch.LongTensor
    scores: torch.Tensor
    confidences: list[list[float]]
    confidence_logits: list[list[float]]
    lengths: list[int]
    observed: bool = False
    expand: Callable[[torch.Tensor], torch.Tensor] | None = None
    _logits: torch.Tensor | None = field(default=None, repr=False)

    @property
    def logits(self) -> torch.Tensor:
        """`(rows, slots, vocab)`: `scores` over the target vocabulary, what speculative sampling compares the target
        against. Built on first use only: greedy verification never reads it, and with many rows the target-sized
        copy costs more than sampling the drafts did."""
        if self._logits is None:
            self._logits = self.scores if self.expand is None else self.expand(self.scores)
        return self._logits

    @logits.setter
    def logits(self, logits: torch.Tensor) -> None:
        self._logits = logits


class SlotSchedule:
    """Applies a verification policy slot by slot: the rows still verifying, and the drafts each verifies.

    Args:
        policy ([`VerificationPolicy`], *optional*): anything with the policy interface's `verified` and `settled`
            (`dspark_hf.generation.verification_policy`); `None` verifies every slot within the budgets.
        budgets (`Sequence[int]`): the most drafts each row may verify (its length budget); negative for a row the
            policy must not see (its confidences are shown as zeros).
    """

    def __init__(self, policy, budgets: Sequence[int]):
        self.policy, self.budgets = policy, list(budgets)
        self.verifying = [budget > 0 for budget in self.budgets]
        self.lengths = [0] * len(self.budgets)
        self.num_looked_at = 0  # slots whose confidences were computed
        self.num_sampled = 0

    def admit(self, slot: int, confidences: list[list[float]]) -> bool:
        """Called once every row's c_{slot+1} is known: whether to sample `slot` (`False` ends the block)."""
        self.num_looked_at += 1
        confidences = self._shown(confidences)
        candidates = [verifying and slot < budget for verifying, budget in zip(self.verifying, self.budgets)]
        if self.policy is None or not any(candidates):
            self.verifying = candidates
        else:
            self.verifying = self.policy.verified(slot, confidences, candidates)
        if not any(self.verifying) and self.settled(confidences):
            return False
        self.lengths = [length + verifying for length, verifying in zip(self.lengths, self.verifying)]
        self.num_sampled += 1
        return True

    def settled(self, confidences: list[list[float]]) -> bool:
        """Whether the policy has learned all it can from the confidences computed so far."""
        return self.policy is None or self.policy.settled(self._shown(confidences))

    def _shown(self, confidences: list[list[float]]) -> list[list[float]]:
        """The confidences the policy sees: zeros for a row with a negative budget (the batched engine's row of a
        finished request, kept for a waiting one: drafted along, never verified)."""
        if min(self.budgets, default=0) >= 0:
            return confidences
        return [[0.0] * len(values) if budget < 0 else values for values, budget in zip(confidences, self.budgets)]

    def observed(self, confidences: list[list[float]]) -> bool:
        """Whether the policy judges the confidences computed so far complete (never before the first slot)."""
        return self.num_looked_at > 0 and self.settled(confidences)


def block_inputs(
    anchor_ids: torch.LongTensor, anchor_positions: torch.LongTensor, block_size: int, mask_token_id: int
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """The drafter's block input: each row's anchor then `block_size - 1` mask tokens, at the anchor's position onward.

    Args:
        anchor_ids (`torch.LongTensor` of shape `(rows,)`): each row's last committed token.
        anchor_positions (`torch.LongTensor` of shape `(rows,)`): its absolute position.

    Returns:
        `(input_ids, position_ids)`, both of shape `(rows, block_size)`.
    """
    input_ids = torch.full((anchor_ids.shape[0], block_size), mask_token_id, dtype=torch.long, device=anchor_ids.device)
    input_ids[:, 0] = anchor_ids
    offsets = torch.arange(block_size, device=anchor_positions.device)
    return input_ids, anchor_positions[:, None] + offsets[None, :]


def pick_tokens(logits: torch.Tensor, do_sample: bool, generator: torch.Generator | None = None) -> torch.LongTensor:
    """`(rows, vocab)` logits -> `(rows,)` tokens: a sample of their softmax, or the argmax."""
    if do_sample:
        return torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator).squeeze(-1)
    return logits.argmax(dim=-1)


def sample_drafts(
    drafter,
    hidden_states: torch.Tensor,
    draft_logits: torch.Tensor,
    anchor_ids: torch.LongTensor,
    budgets: Sequence[int],
    policy=None,
    *,
    num_slots: int | None = None,
    process: Callable[[torch.LongTensor, torch.Tensor], torch.Tensor] | None = None,
    do_sample: bool = False,
) -> DraftedBlock:
    """Samples a block's drafts left to right for every row: ``z_k = U_k + bias(x_{k-1})``, processors, then argmax or
    a sample (docs/design.md, "Markov head and drafting").

    Before slot `k` is sampled, every row's confidence c_{k+1} (which reads x_{k-1} only) is computed and `policy`
    decides which rows verify the slot; when none does and the policy has observed enough, the block ends.

    Without processors, a drafter with a reduced draft vocabulary (`draft_token_ids`) is sampled over that vocabulary
    (8,192 ids rather than the target's 49,152 for the embedded default): the same drafts (its ids are sorted, so the
    argmax breaks ties alike; outside them the logits are -inf) at a sixth of the per-slot cost, and the logits reach
    the target vocabulary once, and only if read ([`DraftedBlock.logits`]).

    Args:
        drafter: a [`DSparkDrafter`] (or the recipe's standalone drafter).
        hidden_states (`torch.Tensor` of shape `(rows, block, hidden)`): the block forward's final-normed states.
        draft_logits (`torch.Tensor` of shape `(rows, block, draft_vocab)`): their base logits ``U_k``.
        anchor_ids (`torch.LongTensor` of shape `(rows,)`): each row's anchor, the "previous token" of slot 0.
        budgets (`Sequence[int]`): the most drafts each row may verify.
        policy ([`VerificationPolicy`], *optional*): which rows verify each slot (`verified`, `settled`); defaults to
            the full block within the budgets.
        num_slots (`int`, *optional*): the most slots to look at (defaults to the whole block).
        process (`Callable`, *optional*): the logits processors, called with the drafts so far `(rows, k)` and the
            slot's corrected logits `(rows, vocab)` (the caller prepends each row's committed tokens).
        do_sample (`bool`): sample the drafts instead of taking the argmax.

    Returns:
        [`DraftedBlock`].
    """
    rows, block_size = hidden_states.shape[:2]
    schedule = SlotSchedule(policy, budgets)
    previous, state = anchor_ids.to(hidden_states.device), None
    confidences, raw = [[] for _ in range(rows)], [[] for _ in range(rows)]
    vocabulary = getattr(drafter, "draft_token_ids", None) if process is None else None
    expand, space = (None, {}) if vocabulary is None else (drafter.to_target_vocabulary, {"target_vocabulary": False})
    tokens, logits = [], []
    for slot in range(block_size if num_slots is None else min(num_slots, block_size)):
        _add_confidences(drafter, hidden_states[:, slot], previous, slot, confidences, raw)
        if not schedule.admit(slot, confidences):
            break
        corrected, state = drafter.corrected_logits(draft_logits[:, slot], previous, hidden_states[:, slot], state,
                                                    **space)  # fmt: skip
        if process is not None:
            drafted = torch.stack(tokens, dim=1) if tokens else anchor_ids.new_zeros((rows, 0))
            corrected = process(drafted, corrected)
        token = pick_tokens(corrected, do_sample)
        if vocabulary is not None:
            token = vocabulary[token]
        tokens.append(token)
        logits.append(corrected)
        previous = token.to(hidden_states.device)
    if not tokens:
        empty_logits = draft_logits.new_zeros((rows, 0, draft_logits.shape[-1]), dtype=torch.float32)
        return DraftedBlock(anchor_ids.new_zeros((rows, 0)), empty_logits, confidences, raw, schedule.lengths,
                            schedule.observed(confidences), expand)  # fmt: skip
    return DraftedBlock(torch.stack(tokens, dim=1), torch.stack(logits, dim=1), confidences, raw, schedule.lengths,
                        schedule.observed(confidences), expand)  # fmt: skip


def _add_confidences(drafter, hidden_states, previous_ids, slot, confidences, raw) -> None:
    """Appends each row's raw and calibrated confidence of `slot` (nothing without a confidence head)."""
    logits = drafter.confidence_logits(hidden_states, previous_ids)
    if logits is None:
        return
    calibrated = drafter.calibrated_confidence(logits, slot)
    for row, (raw_value, value) in enumerate(zip(logits.tolist(), calibrated.tolist())):
        raw[row].append(raw_value)
        confidences[row].append(value)


def greedy_prefix(draft_ids: Sequence[int], choices: Sequence[int]) -> tuple[int, int]:
    """Greedy verification from the target's choices (argmax) at each verified slot (at least ``len(draft_ids) + 1``
    of them): the drafts accepted (the prefix equal to the choices) and the target's token after them."""
    accepted = 0
    while accepted < len(draft_ids) and draft_ids[accepted] == choices[accepted]:
        accepted += 1
    return accepted, choices[accepted]


def verify(draft_ids, draft_probs, target_logits, target_probs, do_sample, generator=None):
    """Accepts a prefix of one sequence's drafts; returns `(num_accepted, next_token)`.

    Args:
        draft_ids (`list[int]`): the L drafts.
        draft_probs (`torch.Tensor` of shape `(L, vocab)`): the distributions the drafts were sampled from (unused,
            and may be `None`, when greedy or when L is 0).
        target_logits (`torch.Tensor` of shape `(L + 1, vocab)`): the target's processed logits at each verified slot.
        target_probs (`torch.Tensor` of shape `(L + 1, vocab)`): their softmax (unused, and may be `None`, when greedy).
        do_sample (`bool`): speculative rejection sampling if True, else greedy prefix matching.
        generator (`torch.Generator`, *optional*): the random source of the sampling.
    """
    if not do_sample:
        return greedy_prefix(draft_ids, target_logits.argmax(dim=-1).tolist())
    for slot, token in enumerate(draft_ids):
        p, q = target_probs[slot, token], draft_probs[slot, token]
        # p >= q: always accept; else accept with probability p / q
        if torch.rand((), generator=generator, device=p.device) < torch.clamp(p / q.clamp_min(1e-8), max=1.0):
            continue
        # Rejected: sample from the normalized residual max(p_t - p_d, 0) (the target itself if it vanishes).
        residual = (target_probs[slot] - draft_probs[slot]).clamp_min(0)
        residual = residual if residual.sum() > 1e-8 else target_probs[slot]
        return slot, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    bonus = torch.multinomial(target_probs[len(draft_ids)], 1, generator=generator)
    return len(draft_ids), int(bonus)
