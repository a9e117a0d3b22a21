"""Batched, load-aware DSpark speculative decoding.

transformers' assisted loop runs one sequence at a time. `DSparkBatchEngine` runs many: each request drafts its own
block, a verification-length policy picks per-request lengths from all requests' confidences (the hardware-aware
policy runs as `PlannedWidthPolicy`: one verification width for all rows), the target verifies every row in one
forward, and each row accepts its own number of tokens. Requests may join between rounds (simple continuous batching)
and leave when done. With `prompt_lookup_num_tokens`, a row whose last n-gram occurred earlier in its sequence verifies
the continuation found there instead of its drafted block (`generation/lookup.py`), in the same forward as the others.

Rows share one slot axis in both KV caches (target and drafter): a verification appends ``1 + max_r ℓ_r`` slots to
every row, and `slot_mask` marks which hold committed tokens. Rejected drafts and padding stay behind as masked holes;
positions are per row, so holes never shift RoPE. This is a testbed for the scheduler, not a server: at scale, run the
same checkpoints in vLLM (`speculative_config={"method": "dspark", ...}`) or SGLang.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList

from .. import _transformers_compat
from ..modeling_dspark import DSparkDrafter
from ..packed_linear import is_packed, real_tokens_only
from . import cache_ops
from .cache_ops import concat_rows, drop_slots_left, leading_holes, pad_mask_left, pad_slots_left
from .drafting import DraftedBlock, block_inputs, greedy_prefix, pick_tokens, sample_drafts, verify
from .gqa import native_gqa, packed_gqa
from .lookup import MIN_NGRAM, PromptLookup
from .policies import PlannedWidthPolicy, VerificationPolicy, resolve_policy
from .stats import DSparkGenerationStats, DSparkRoundStats
from .stopping import first_stop, time_criteria, token_criteria
from .verification_policy import RoundOutcome
from ..scheduling import plan_verification_width


COMPACT_MIN_SLOTS = 8  # never compact the caches for fewer reclaimable slots than this
MAX_PENDING_SLOTS = 64  # the drafter ingests pending context at the latest after this many slots (bounded memory)
TIMINGS_KEPT = 1 << 16  # timings of the latest rounds an engine keeps (`DSparkBatchEngine.step_timings`, ...)


AUTO_ADMISSION = "auto"
# `admission_wait_rounds="auto"` never holds a request longer than this (its time to first token)
AUTO_MAX_WAIT_ROUNDS = 8


def engine_forward(target: PreTrainedModel, input_ids, attention_mask, position_ids, cache, **kwargs):
    """A target forward as the engine runs it: over its slot axis, under the 2-D `attention_mask` of its slots (holes
    masked), with grouped-query attention native or packed for multi-token forwards (`gqa`). `dspark-hf profile` times
    batches of rows through this too, so that the costs the hardware-aware policy plans with are the engine's."""
    width = input_ids.shape[1]
    if torch.is_tensor(attention_mask) and attention_mask.dim() == 2:
        attention_mask = attention_mask.long()  # else 4-D masks as they are (`cache_ops.slot_masks`)
    with native_gqa(target.device, width), packed_gqa(target, width):
        return target(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=True, **{_transformers_compat.cache_argument(target): cache}, **kwargs)


def check_admission_wait_rounds(value: int | str) -> int | str:
    """`value` if the engine takes it as `admission_wait_rounds` (an int >= 0 or "auto"), else a one-line error."""
    if value == AUTO_ADMISSION or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ValueError(f"admission_wait_rounds must be an int >= 0 (0 admits new requests at every step) or "
                     f"{AUTO_ADMISSION!r}, got {value!r}.")


def parse_admission_wait_rounds(text: str) -> int | str:
    """`admission_wait_rounds` from its command-line or JSON spelling ("auto" or an integer), checked."""
    return check_admission_wait_rounds(text if text == AUTO_ADMISSION else int(text))


def admission_is_due(active: list["DSparkRequest"], waiting: int, waited_rounds: int, wait_rounds: int | str) -> bool:
    """Whether `waiting` queued requests are admitted now, `waited_rounds` rounds after the oldest arrived.

    At once when nothing decodes; with an int `wait_rounds`, once the oldest has waited that many rounds. With
    "auto" a wait is a bet that a decoding row finishes soon and its successor shares the prefill: it holds only
    while every waiting request has a finished row to take over (otherwise the batch grows, and a wait gains no
    shared forward over what the new rows would decode), and while ``rounds · free <= rows``, where ``rounds`` is the
    wait so far plus the fewest new tokens any decoding row has left (it finishes by then, earlier at EOS) and
    ``free`` the finished rows idling meanwhile: the idle rows then cost at most one decode step of the whole batch,
    about what the fixed part of a prefill forward costs (measured on a 2-core CPU, bf16 SmolLM2-135M: a prefill's
    fixed part 60-95 ms against a decode step of 50-97 ms at 8-32 rows, `benchmarks/results/admission/`). Never
    longer than `AUTO_MAX_WAIT_ROUNDS` rounds in all.
    """
    if not waiting:
        return False
    decoding = [request for request in active if not request.finished]
    if not decoding:
        return True
    if wait_rounds != AUTO_ADMISSION:
        return waited_rounds >= wait_rounds
    free = len(active) - len(decoding)
    if free < waiting:
        return True
    rounds = waited_rounds + min(request.max_new_tokens - len(request.output_ids) for request in decoding)
    return rounds > AUTO_MAX_WAIT_ROUNDS or rounds * free > len(active)


@dataclass
class DSparkRequest:
    """One generation request and its outcome."""

    request_id: int
    prompt_ids: list[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    stats: DSparkGenerationStats | None = None
    last_confidences: list[float] | None = None  # the previous round's c_1..c_B: stale information for planning
    arrival_time: float = 0.0
    finish_time: float | None = None
    lookup: PromptLookup | None = None  # this request's prompt lookup and its acceptance estimates
    # what the logits processors and stopping criteria see before the prompt: in `generate`, the row's left padding,
    # which transformers' own loop shows them (lengths such as `min_new_tokens` count it); its own processors and
    # stopping criteria, if not the engine's (a batch-aware processor adapted to this row, a request's stop strings)
    history_prefix: list[int] = field(default_factory=list)
    logits_processor: LogitsProcessorList | None = None
    stopping_criteria: StoppingCriteriaList | None = None

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class DSparkBatchEngine:
    """Runs many requests through one target and (optionally) one DSpark drafter.

    Args:
        target ([`PreTrainedModel`]): decoder-only target.
        drafter ([`DSparkDrafter`], *optional*): `None` runs plain batched decoding (the target-only baseline).
        policy (`str` or [`VerificationPolicy`], *optional*): verification lengths; defaults to the drafter's
            `verification_policy` (see `resolve_policy`). The engine runs its `for_engine()` form (a
            `HardwareAwarePolicy` plans one width for all rows, [`PlannedWidthPolicy`]).
        do_sample (`bool`): speculative sampling instead of greedy matching.
        logits_processor ([`LogitsProcessorList`], *optional*): applied per row to target and draft logits alike
            (a request may bring its own, `add_request`).
        eos_token_id (`int` or `list[int]`, *optional*): ends a request.
        stopping_criteria ([`StoppingCriteriaList`], *optional*): end a request at the first of its tokens after
            which they stop; asked of every prefix a round commits, one row at a time, shortest first (so a stop
            string completed inside a round ends the request there, as in plain decoding). The length limit and EOS
            are the engine's own (`max_new_tokens`, `eos_token_id`); criteria that read the clock are left out
            (`MaxTimeCriteria`: `generate` asks them once per round).
        pad_token_id (`int`): filler for padding slots (never attended).
        steps_per_second_by_rows (`Mapping[int, Mapping[int, float]]`, *optional*): a profile's per-batch-size
            tables (`by_batch_size` of `dspark-hf profile`) for the hardware-aware policy; without it the policy's
            batch-1 curve is read at the total token count of the padded forward.
        prompt_lookup_num_tokens (`int`, *optional*): prompt lookup inside rounds, at most this many lookup drafts
            per row (transformers' knob of the same name). A row whose last 2+ tokens occurred earlier in its sequence
            verifies what followed them there instead of its drafted block; when the policy skips drafting, a
            one-token match counts too. With the hardware-aware policy the lookup rows' widths are planned on the
            profiled curve for this many rows from each request's measured lookup acceptance (drafting is free there);
            otherwise a match is verified whole. Without a drafter the engine is batched prompt lookup decoding.
        max_matching_ngram_size (`int`, defaults to 3): the longest n-gram matched.
        admission_wait_rounds (`int` or `"auto"`, defaults to `"auto"`): how many rounds a new request may wait
            while other requests decode, so that requests arriving in successive rounds are prefilled in one forward
            (TGI's `max_waiting_tokens`). On a CPU a forward has a large fixed cost: a one-prompt prefill of ~100
            tokens costs about twice as much per prompt as a 16-prompt one, and rows that accept different numbers of
            drafts finish, and are replaced, a few at a time. Finished rows stay in place while their successors wait
            (computed, their output dropped), so the successors take them over without copying the other rows'
            caches. 0 admits at every step; a request that arrives while nothing decodes is admitted at once.
            `"auto"` waits only as long as waiting is cheaper than a prefill of its own ([`admission_is_due`]): while
            every waiting request has a finished row to take over, and the row-rounds those rows idle until the next
            decoding row must finish (its remaining budget) stay within the batch's row count and
            `AUTO_MAX_WAIT_ROUNDS` rounds.

    Example:

    ```python
    >>> engine = DSparkBatchEngine(target, drafter)  # doctest: +SKIP
    >>> for ids in prompts: engine.add_request(ids, max_new_tokens=64)  # doctest: +SKIP
    >>> done = engine.run()  # doctest: +SKIP
    ```
    """

    # Every time the engine reads (request arrival and finish, drafting and step durations the hardware-aware policy
    # learns from). The trace-driven simulator (`dspark_hf.simulation`) replaces it with a simulated clock.
    clock: Callable[[], float] = staticmethod(time.perf_counter)

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: DSparkDrafter | None = None,
        *,
        policy: str | VerificationPolicy | None = None,
        do_sample: bool = False,
        logits_processor: LogitsProcessorList | None = None,
        eos_token_id: int | list[int] | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
        pad_token_id: int = 0,
        steps_per_second_by_rows: Mapping[int, Mapping[int, float]] | None = None,
        prompt_lookup_num_tokens: int | None = None,
        max_matching_ngram_size: int = 3,
        admission_wait_rounds: int | str = AUTO_ADMISSION,
    ):
        self.admission_wait_rounds = check_admission_wait_rounds(admission_wait_rounds)
        if prompt_lookup_num_tokens is not None and prompt_lookup_num_tokens < 1:
            raise ValueError(f"prompt_lookup_num_tokens must be >= 1 to use prompt lookup (None turns it off), got "
                             f"{prompt_lookup_num_tokens}.")
        self.prompt_lookup_num_tokens, self.max_matching_ngram_size = prompt_lookup_num_tokens, max_matching_ngram_size
        self.policy: VerificationPolicy | None = None
        if drafter is not None:
            drafter.check_target(target)
            self._use_policy(resolve_policy(drafter, target, policy), steps_per_second_by_rows)
            if self.policy.requires_confidence and drafter.confidence_head is None:
                raise ValueError(f"The {self.policy.name!r} policy needs a drafter with a confidence head.")
        # sliding-window layers (Gemma2/3, OLMo3, Mistral v0.1) get masks that count their window in positions
        self._window = cache_ops.slot_window(target.config)
        self._layer_types = set(getattr(target.config.get_text_config(), "layer_types", None) or ())
        self.target, self.drafter = target, drafter
        self._packed_target = is_packed(target)
        self.do_sample = do_sample
        self.logits_processor = logits_processor or LogitsProcessorList()
        self._processing = bool(self.logits_processor)  # any row's logits go through processors
        self.stopping_criteria = token_criteria(stopping_criteria)
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.eos_token_ids = set(int(e) for e in eos)
        self.pad_token_id = pad_token_id
        self.device = target.device
        self.waiting: list[DSparkRequest] = []
        self.active: list[DSparkRequest] = []
        self.finished: list[DSparkRequest] = []
        # the latest rounds' timings, for cost models (`dspark-hf bench-load` reports their medians): (rows, seconds) of
        # each drafting pass, (rows, width, seconds) of each verification step (target forward, acceptance, cache
        # update) and (requests, padded prompt tokens, seconds) of each admission (prefill and merge); bounded, so a
        # long-running engine does not grow
        self.draft_timings: deque[tuple[int, float]] = deque(maxlen=TIMINGS_KEPT)
        self.step_timings: deque[tuple[int, int, float]] = deque(maxlen=TIMINGS_KEPT)
        self.admit_timings: deque[tuple[int, int, float]] = deque(maxlen=TIMINGS_KEPT)
        self._next_id = 0
        self._waited_rounds = 0  # rounds run since the oldest waiting request arrived
        self._reset_batch_state()

    def _use_policy(self, policy: VerificationPolicy, steps_per_second_by_rows) -> None:
        """Runs the engine form of `policy` (`VerificationPolicy.for_engine`), reset for this engine's requests."""
        self.policy = policy.for_engine(steps_per_second_by_rows)
        self.policy.reset()

    # --- public API ---------------------------------------------------------------------------------------------

    def add_request(self, prompt_ids, max_new_tokens: int, *, logits_processor: LogitsProcessorList | None = None,
                    stopping_criteria: StoppingCriteriaList | None = None, history_prefix=()) -> DSparkRequest:
        """Queues a prompt (a list or 1-D tensor of ids, no padding); it joins at the next `step`.

        `logits_processor` and `stopping_criteria` replace the engine's for this request (say, its own stop strings:
        `StoppingCriteriaList([StopStringCriteria(tokenizer, ["\\n\\n"])])`); `history_prefix` (ids) is what they see
        before the prompt (`generate` passes a padded row's padding)."""
        # (the trace simulator's engine has no target: its prompts come from recorded generations)
        vocab_size = None if self.target is None else self.target.get_input_embeddings().num_embeddings
        prompt = _prompt_ids(prompt_ids, vocab_size)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        block = self.drafter.config.block_size if self.drafter is not None else 0
        lookup = None
        if self.prompt_lookup_num_tokens:
            lookup = PromptLookup(self.prompt_lookup_num_tokens, self.max_matching_ngram_size, sorted(self.eos_token_ids))
        if stopping_criteria is not None:
            stopping_criteria = token_criteria(stopping_criteria)
        request = DSparkRequest(self._next_id, prompt, max_new_tokens, stats=DSparkGenerationStats(block),
                                arrival_time=self.clock(), lookup=lookup, logits_processor=logits_processor,
                                stopping_criteria=stopping_criteria, history_prefix=[int(t) for t in history_prefix])
        self._processing = self._processing or bool(logits_processor)
        self._next_id += 1
        self.waiting.append(request)
        return request

    @torch.no_grad()
    def step(self) -> list[DSparkRequest]:
        """Admits waiting requests (prefill), then runs one draft-and-verify round; returns requests that finished.

        A finished request keeps its row until the next step: a request admitted then takes the row over in place
        (its prefilled K/V written into the row), which spares copying every other row's cache, as removing a row
        and appending one would. Rows nobody takes over are removed before the round, except those kept for requests
        held back by `admission_wait_rounds`."""
        done = self._admit() if self._admission_due() else []
        self._drop_finished(keep=len(self.waiting))
        if self.active:
            done += self._round()
            self._waited_rounds += bool(self.waiting)
        return done

    def run(self) -> list[DSparkRequest]:
        """Steps until every queued request is finished; returns them in arrival order."""
        while self.waiting or self.active:
            self.step()
        return sorted(self.finished, key=lambda r: r.request_id)

    # --- batch state --------------------------------------------------------------------------------------------

    def _admission_due(self) -> bool:
        """Whether waiting requests are admitted at this step ([`admission_is_due`])."""
        return admission_is_due(self.active, len(self.waiting), self._waited_rounds, self.admission_wait_rounds)

    def _reset_batch_state(self) -> None:
        self.cache: DynamicCache | None = None  # target KV, (rows, slots)
        self.draft_cache: DynamicCache | None = None  # drafter context KV, same slots
        self.slot_mask = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        self.next_position = torch.zeros(0, dtype=torch.long, device=self.device)  # position of each row's anchor
        self.anchor = torch.zeros(0, dtype=torch.long, device=self.device)  # committed, not yet in the cache
        # (features, positions) of the latest slots, not yet in the drafter's cache (`_sync_context`)
        self._pending_context: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _hidden_state_indices(self) -> list[int] | None:
        return None if self.drafter is None else self.drafter.config.hidden_state_indices

    def _target_forward(self, input_ids, attention_mask, position_ids, cache, logits_to_keep: int = 0):
        """Logits (float32) at the last `logits_to_keep` positions (0: all) and the drafter's context features."""
        indices = self._hidden_state_indices()
        request = _transformers_compat.hidden_states_request(indices) if indices else None
        kwargs = {"output_hidden_states": request} if indices else {}
        # padding (left-padded prompts, rows verifying fewer drafts than the widest) skips the packed linear layers
        real = attention_mask[:, -input_ids.shape[1]:] if self._packed_target else None
        if self._window is not None:
            attention_mask = cache_ops.slot_masks(attention_mask.bool(), input_ids.shape[1], self._window,
                                                  self._layer_types, self.target.dtype)
        with real_tokens_only(real):
            out = engine_forward(self.target, input_ids, attention_mask, position_ids, cache,
                                 logits_to_keep=logits_to_keep, **kwargs)
        features = None
        if indices:
            features = torch.cat(_transformers_compat.select_hidden_states(out.hidden_states, indices, request), dim=-1)
        return out.logits.float(), features

    def _ingest(self, cache: DynamicCache, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Appends the drafter's context K/V for new slots (masked slots included, as holes)."""
        self.drafter.extend_context(features.to(self.drafter.device), positions.to(self.drafter.device), cache)

    def _sync_context(self) -> None:
        """Ingests the rounds' target features the drafter has not seen yet, in one pass.

        Rounds append their features to `_pending_context` instead of ingesting them at once: under load the
        hardware-aware policy decodes plainly for long stretches, and ingesting one slot per row every round cost
        ~2.5% of a plain step at 32 rows. The drafter's cache is brought level with the target's slot axis before it
        drafts and before any operation on both caches' slots (admission, row removal, compaction), and at the latest
        once `MAX_PENDING_SLOTS` slots wait (their features are kept meanwhile)."""
        if not self._pending_context:
            return
        features, positions = (torch.cat(parts, dim=1) for parts in zip(*self._pending_context))
        self._pending_context = []
        self._ingest(self.draft_cache, features, positions)

    # --- admission (prefill + merge) ----------------------------------------------------------------------------

    def _admit(self) -> list[DSparkRequest]:
        start, new, self.waiting, self._waited_rounds = self.clock(), self.waiting, [], 0
        # Copies of one prompt (generate's `num_return_sequences`, a batch that repeats a prompt) are prefilled once,
        # and each copy's row of the caches and logits taken from it.
        prompts: dict[tuple[int, ...], int] = {}
        source = [prompts.setdefault(tuple(r.prompt_ids), len(prompts)) for r in new]
        width = max(len(prompt) for prompt in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long, device=self.device)
        mask = torch.zeros(len(prompts), width, dtype=torch.bool, device=self.device)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt, device=self.device)
            mask[row, width - len(prompt):] = True
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        cache = cache_ops.slot_cache(self.target.config)
        # only the last position's logits: the LM head over every prompt position would cost more than the prompt's
        # decoder layers (49k-id vocabulary)
        logits, features = self._target_forward(ids, mask, positions, cache, logits_to_keep=1)
        draft_cache = None
        if self.drafter is not None:
            draft_cache = cache_ops.slot_cache(self.drafter.config)
            self._ingest(draft_cache, features, positions)
        if len(prompts) < len(new):
            index = torch.tensor(source, device=self.device)
            cache.batch_select_indices(index)
            if draft_cache is not None:
                draft_cache.batch_select_indices(index.to(self.drafter.device))
            logits, mask, positions = logits[index], mask[index], positions[index]
        first = torch.stack([pick_tokens(self._process([r], [r.prompt_ids], logits[i, -1][None]), self.do_sample)[0]
                             for i, r in enumerate(new)])
        next_position = positions[:, -1] + 1
        self._sync_context()
        free = [row for row, request in enumerate(self.active) if request.finished][: len(new)]
        if free:
            mask = self._take_over(free, new[: len(free)], cache, draft_cache, mask, next_position, first)
        rest = new[len(free):]  # requests that found no free row: appended
        if rest:
            if free:  # keep only their rows of the prefilled caches
                index = torch.arange(len(free), len(new), device=self.device)
                cache.batch_select_indices(index)
                if draft_cache is not None:
                    draft_cache.batch_select_indices(index.to(self.drafter.device))
            tail = slice(len(free), None)
            self._merge(rest, cache, draft_cache, mask[tail], next_position[tail], first[tail])
        new_rows = free + list(range(len(self.active) - len(rest), len(self.active)))
        self.admit_timings.append((len(new), width, self.clock() - start))
        return self._commit_and_retire(dict(zip(new_rows, ([t] for t in first.tolist()))))

    def _take_over(self, rows, requests, cache, draft_cache, mask, next_position, anchor) -> torch.Tensor:
        """Writes the first `len(rows)` prefilled requests into the (finished) `rows`, right-aligned on the slot axis.
        The prefilled caches are left-padded to the slot axis in place, every row of them: returns `mask` padded alike,
        for the rows that are appended afterwards."""
        width, new_width = self.slot_mask.shape[1], mask.shape[1]
        if new_width > width:  # the prompt is longer than the slot axis: grow every row by holes on the left
            pad_slots_left(self.cache, new_width - width)
            pad_slots_left(self.draft_cache, new_width - width)
            self.slot_mask = pad_mask_left(self.slot_mask, new_width - width)
            width = new_width
        count = len(rows)
        index = torch.tensor(rows, device=self.device)
        for main, part in ((self.cache, cache), (self.draft_cache, draft_cache)):
            if main is None:
                continue
            pad_slots_left(part, width - new_width)  # right-align the new rows on the slot axis
            for main_layer, part_layer in zip(cache_ops.initialized_layers(main), cache_ops.initialized_layers(part)):
                for name in ("keys", "values"):
                    states = getattr(main_layer, name)
                    states[index.to(states.device)] = getattr(part_layer, name)[:count]
        mask = pad_mask_left(mask, width - new_width)
        self.slot_mask[index] = mask[:count]
        self.next_position[index] = next_position[:count]
        self.anchor[index] = anchor[:count]
        for row, request in zip(rows, requests):
            self.active[row] = request
        return mask

    def _drop_finished(self, keep: int = 0) -> None:
        """Removes the rows of finished requests but the first `keep` (kept for waiting requests to take over)."""
        finished = [row for row, request in enumerate(self.active) if request.finished]
        if len(finished) > keep:
            dropped = set(finished[keep:])
            self._select_rows([row for row in range(len(self.active)) if row not in dropped])

    def _merge(self, requests, cache, draft_cache, mask, next_position, anchor) -> None:
        if self.cache is None:
            self.cache, self.draft_cache, self.slot_mask = cache, draft_cache, mask
        else:
            # Align the slot axes by left-padding the shorter side with holes, then stack the rows.
            width = max(self.slot_mask.shape[1], mask.shape[1])
            grow_old, grow_new = width - self.slot_mask.shape[1], width - mask.shape[1]
            pad_slots_left(self.cache, grow_old)
            pad_slots_left(self.draft_cache, grow_old)
            pad_slots_left(cache, grow_new)
            pad_slots_left(draft_cache, grow_new)
            concat_rows(self.cache, cache)
            if self.drafter is not None:
                concat_rows(self.draft_cache, draft_cache)
            self.slot_mask = torch.cat([pad_mask_left(self.slot_mask, grow_old), pad_mask_left(mask, grow_new)])
        self.next_position = torch.cat([self.next_position, next_position])
        self.anchor = torch.cat([self.anchor, anchor])
        self.active += requests

    # --- one round ----------------------------------------------------------------------------------------------

    def _round(self) -> list[DSparkRequest]:
        # drafts that still fit; -1 for a finished request's row kept for a waiting request (computed, then dropped,
        # its confidences hidden from the policy)
        budgets = [-1 if r.finished else r.max_new_tokens - len(r.output_ids) - 1 for r in self.active]
        rows, draft, draft_seconds, began = len(self.active), None, None, False
        matches = self._lookup_matches(budgets)
        strong = [ngram >= MIN_NGRAM or r.finished for (_, ngram), r in zip(matches, self.active)]
        # A round where every row has a match of 2+ tokens needs no drafter pass (nor a plan: as at batch size 1, the
        # policy hears only of its own rounds).
        if self.drafter is not None and not all(strong):
            began = True
            block_size = self.drafter.config.block_size
            stale = [[0.0] * block_size if r.finished else r.last_confidences for r in self.active]
            if self.policy.begin_round(stale, block_size):
                # the context pending since the last sync is ingested before the drafting pass is timed: it is owed
                # whether or not this round drafts (at the latest after `MAX_PENDING_SLOTS` slots); charged to drafting
                # it made a pass after 20 plain rounds look ~40% dearer at 32 rows (`scripts/catch_up_cost.py`)
                self._sync_context()
                start = self.clock()
                draft = self._draft(budgets)
                draft_seconds = self.clock() - start
                self.draft_timings.append((rows, draft_seconds))
                if draft.observed:  # the confidences the policy plans the rows' next round from
                    for request, values in zip(self.active, draft.confidences):
                        request.last_confidences = values
        lengths = list(draft.lengths) if draft is not None else [0] * rows  # no drafter pass: plain decoding
        lookup_rows = self._lookup_lengths(matches, strong if draft is not None else None, lengths)
        for row, length in lookup_rows.items():
            lengths[row] = length
        longest = max(lengths)
        step_start = self.clock()
        verify_ids = self.anchor.new_full((rows, 1 + longest), self.pad_token_id)
        verify_ids[:, 0] = self.anchor
        if draft is not None and longest:
            drafted = draft.ids[:, :longest]
            verify_ids[:, 1:1 + drafted.shape[1]] = drafted
        for row, length in lookup_rows.items():
            verify_ids[row, 1:1 + length] = matches[row][0][:length].to(verify_ids.device)
        offsets = torch.arange(longest + 1, device=self.device)
        new_mask = offsets[None, :] <= torch.tensor(lengths, device=self.device)[:, None]
        verify_ids = verify_ids.masked_fill(~new_mask, self.pad_token_id)
        positions = self.next_position[:, None] + offsets[None, :]
        logits, features = self._target_forward(
            verify_ids, torch.cat([self.slot_mask, new_mask], dim=1), positions, self.cache
        )
        committed, accepted = {}, []
        choices = self._greedy_choices(logits)
        for row, request in enumerate(self.active):
            if request.finished:
                accepted.append(0)
                continue
            lookup = row in lookup_rows
            committed[row], num_accepted = self._verify_row(request, row, lengths[row], verify_ids, logits,
                                                            None if lookup else draft,
                                                            None if choices is None else choices[row])
            accepted.append(num_accepted)
            if lookup:
                request.lookup.record(lengths[row], num_accepted, matches[row][1])
                request.stats.rounds.append(DSparkRoundStats([], lengths[row], num_accepted, drafted=False,
                                                             draft_ids=verify_ids[row, 1:1 + lengths[row]].tolist(),
                                                             source="lookup"))
            else:
                self._record_round(request, row, lengths[row], num_accepted, draft)
        self._advance(accepted, longest, features, positions)
        step_seconds = self.clock() - step_start
        self.step_timings.append((rows, longest + 1, step_seconds))
        if began:
            # lookup rows carry no confidences: the policy corrects its confidences from drafted rows only, and times
            # the forward at its real width
            confidences = [[] if row in lookup_rows or draft is None or self.active[row].finished
                           else draft.confidences[row] for row in range(rows)]
            self.policy.end_round(RoundOutcome(confidences, lengths, accepted, drafted=draft is not None,
                                               observed=draft is not None and draft.observed,
                                               draft_seconds=draft_seconds, step_seconds=step_seconds,
                                               held=[budget < 0 for budget in budgets]))
        return self._commit_and_retire(committed)

    def _record_round(self, request: DSparkRequest, row: int, length: int, accepted: int, draft) -> None:
        """Appends a row's round to its request's statistics (none for target-only decoding without lookup)."""
        if draft is not None:
            request.stats.rounds.append(DSparkRoundStats(draft.confidences[row][: length + 1], length, accepted,
                                                         draft_ids=draft.ids[row, :length].tolist()))
        elif self.drafter is not None or self.prompt_lookup_num_tokens:
            request.stats.rounds.append(DSparkRoundStats([], 0, 0, drafted=False))

    def _lookup_matches(self, budgets: list[int]) -> list[tuple[torch.LongTensor, int]]:
        """Each row's lookup continuation and match length (empty and 0 without prompt lookup or a match). One-token
        matches are looked for only where a profiled policy can weigh them (they are weaker guesses)."""
        empty = (self.anchor.new_empty(0), 0)
        if not self.prompt_lookup_num_tokens:
            return [empty] * len(self.active)
        min_ngram = 1 if isinstance(self.policy, PlannedWidthPolicy) else MIN_NGRAM
        return [request.lookup.match_sequence(request.sequence, budget, min_ngram)
                for request, budget in zip(self.active, budgets)]

    def _lookup_lengths(self, matches, usable: list[bool] | None, lengths: list[int]) -> dict[int, int]:
        """Drafts verified per row that takes lookup drafts this round, by row.

        `usable` marks the rows whose match takes the round over their drafted block (`None`: nobody drafted, so any
        match counts). With the hardware-aware policy the rows' widths are planned together on the profiled curve for
        this many rows (`plan_verification_width`, from each request's measured lookup acceptance after a match of
        that length, no drafting cost); a row never verifies fewer lookup drafts than the width the drafted rows
        already pay for. Without it every match is verified whole."""
        rows = [row for row, (found, _) in enumerate(matches) if found.numel() and (usable is None or usable[row])]
        if not rows:
            return {}
        if not isinstance(self.policy, PlannedWidthPolicy):
            return {row: matches[row][0].numel() for row in rows}
        chosen = set(rows)
        confidences = [[self.active[row].lookup.acceptance(ngram)] * found.numel() if row in chosen else []
                       for row, (found, ngram) in enumerate(matches)]
        width = plan_verification_width(confidences, self.policy.speed(len(matches)),
                                         1 + max(len(values) for values in confidences))
        width = max(width, 1 + max((lengths[row] for row in range(len(matches)) if row not in chosen), default=0))
        return {row: length for row in rows if (length := min(matches[row][0].numel(), width - 1))}

    def _draft(self, budgets: list[int]) -> DraftedBlock:
        """One drafter forward for every row, then the shared left-to-right sampling with the Markov bias
        (`drafting.sample_drafts`), each row verifying at most its budget and the policy deciding slot by slot. The
        context the drafter has not seen yet must be ingested first (`_round` does it before timing the pass)."""
        config, rows = self.drafter.config, len(self.active)
        block_ids, positions = block_inputs(self.anchor, self.next_position, config.block_size, config.mask_token_id)
        attention = torch.cat([self.slot_mask, self.slot_mask.new_ones(rows, config.block_size)], dim=1)
        attention = attention[:, None, None, :].expand(rows, 1, config.block_size, attention.shape[1])
        device = self.drafter.device
        with native_gqa(device, config.block_size), packed_gqa(self.drafter, config.block_size):
            out = self.drafter(input_ids=block_ids.to(device), position_ids=positions.to(device),
                               cache=self.draft_cache, attention_mask=attention.to(device), compute_logits=False)
        hidden = out.last_hidden_state
        return sample_drafts(self.drafter, hidden, self.drafter.draft_logits(hidden), self.anchor, budgets,
                             self.policy, num_slots=self.policy.num_slots(config.block_size, budgets),
                             process=self._draft_processor(), do_sample=self.do_sample)  # fmt: skip

    def _draft_processor(self):
        """The logits processors for drafts, each row's committed tokens first (`None` without processors)."""
        if not self._processing:
            return None
        requests = list(self.active)
        sequences = [r.sequence for r in requests]
        return lambda drafts, logits: self._process(requests, [s + d for s, d in zip(sequences, drafts.tolist())],
                                                    logits)

    def _greedy_choices(self, logits: torch.Tensor) -> list[list[int]] | None:
        """Every row's greedy choice at each slot from one argmax over the batch when decoding greedily without logits
        processors (a verification call per row cost ~0.2 ms a row); `None` otherwise."""
        return None if self.do_sample or self._processing else logits.argmax(dim=-1).tolist()

    def _verify_row(self, request, row, length, verify_ids, logits, draft, choices=None) -> tuple[list[int], int]:
        """Greedy matching or speculative sampling (`drafting.verify`) for one row; returns (committed tokens, accepted
        drafts). Without `draft` the row's drafts are lookup drafts: a deterministic proposal, one-hot in sampling.
        `choices`: the row's greedy choices ([`_greedy_choices`]), which then decide alone."""
        drafts = verify_ids[row, 1:1 + length].tolist()
        if choices is not None:
            num_accepted, token = greedy_prefix(drafts, choices)
            return drafts[:num_accepted] + [token], num_accepted
        sequence = request.sequence
        target_logits = torch.cat([self._process([request], [sequence + drafts[:k]], logits[row, k][None])
                                   for k in range(length + 1)])
        draft_probs = None
        if length and draft is not None:
            draft_probs = draft.logits[row, :length].softmax(dim=-1)
        elif length and self.do_sample:
            proposal = torch.tensor(drafts, device=logits.device)
            draft_probs = torch.nn.functional.one_hot(proposal, target_logits.shape[-1]).to(logits.dtype)
        target_probs = target_logits.softmax(dim=-1) if self.do_sample else None
        num_accepted, token = verify(drafts, draft_probs, target_logits, target_probs, self.do_sample)
        return drafts[:num_accepted] + [token], num_accepted

    def _advance(self, accepted: list[int], longest: int, features, positions) -> None:
        """Keeps the verified slots (holes masked), crops slots that are holes in every row, moves anchors."""
        keep = 1 + max(accepted)
        self.cache.crop(-(longest + 1 - keep))
        counts = torch.tensor(accepted, device=self.device)
        kept_mask = torch.arange(keep, device=self.device)[None, :] <= counts[:, None]
        self.slot_mask = torch.cat([self.slot_mask, kept_mask], dim=1)
        if self.drafter is not None:
            self._pending_context.append((features[:, :keep], positions[:, :keep]))
            if sum(part.shape[1] for part, _ in self._pending_context) >= MAX_PENDING_SLOTS:
                self._sync_context()
        self.next_position = self.next_position + 1 + counts
        # Rejected drafts leave holes; every later step appends to (copies) and attends over the whole slot axis, so
        # squeeze them out once they are an eighth of it.
        width = self.slot_mask.shape[1]
        if width - int(self.slot_mask.sum(dim=1).max()) >= max(COMPACT_MIN_SLOTS, width // 8):
            self._sync_context()
            self.slot_mask = cache_ops.compact_slots([self.cache, self.draft_cache], self.slot_mask)

    def _commit_and_retire(self, committed: dict[int, list[int]]) -> list[DSparkRequest]:
        """Appends each row's committed tokens (cut at EOS and budget), sets anchors, marks finished requests."""
        done = []
        for row, tokens in committed.items():
            request = self.active[row]
            tokens = tokens[: request.max_new_tokens - len(request.output_ids)]
            for i, token in enumerate(tokens):
                if token in self.eos_token_ids:
                    tokens = tokens[: i + 1]
                    break
            stop = self._first_stop(request, tokens)
            if stop is not None:
                tokens = tokens[:stop]
            request.output_ids += tokens
            self.anchor[row] = tokens[-1]
            if (len(request.output_ids) >= request.max_new_tokens or tokens[-1] in self.eos_token_ids
                    or stop is not None):
                request.finished, request.finish_time = True, self.clock()
                done.append(request)
        self.finished += done  # their rows are freed at the next step (taken over by new requests, or removed)
        return done

    def _select_rows(self, keep_rows: list[int]) -> None:
        self._sync_context()
        self.active = [self.active[i] for i in keep_rows]
        if not self.active:
            self._reset_batch_state()
            return
        index = torch.tensor(keep_rows, device=self.device)
        self.cache.batch_select_indices(index)
        if self.drafter is not None:
            self.draft_cache.batch_select_indices(index.to(self.drafter.device))
        self.slot_mask = self.slot_mask[index]
        self.next_position, self.anchor = self.next_position[index], self.anchor[index]
        holes = leading_holes(self.slot_mask)
        drop_slots_left(self.cache, holes)
        drop_slots_left(self.draft_cache, holes)
        self.slot_mask = self.slot_mask[:, holes:]

    # --- token choice -------------------------------------------------------------------------------------------

    def _process(self, requests: list[DSparkRequest], sequences: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
        """Applies each row's logits processors (its request's, else the engine's) to its logits, with its history
        (`sequences[i]` after the request's `history_prefix`) as their input."""
        if not self._processing:
            return logits
        rows = []
        for i, (request, sequence) in enumerate(zip(requests, sequences)):
            processors = self.logits_processor if request.logits_processor is None else request.logits_processor
            history = torch.tensor([request.history_prefix + sequence], device=logits.device)
            rows.append(processors(history, logits[i:i + 1]) if processors else logits[i:i + 1])
        return torch.cat(rows)

    def _first_stop(self, request: DSparkRequest, tokens: list[int]) -> int | None:
        """How many of `tokens` (about to be committed) stand when the stopping criteria end the request after one of
        them, else `None`."""
        criteria = self.stopping_criteria if request.stopping_criteria is None else request.stopping_criteria
        if not criteria:
            return None
        committed = request.history_prefix + request.sequence
        stop = first_stop(criteria, torch.tensor([committed + tokens], device=self.device), len(committed))
        return None if stop is None else stop - len(committed)


def _prompt_ids(prompt_ids, vocab_size: int | None) -> list[int]:
    """A request's prompt as a list of ids: a list, a 1-D tensor or one tokenizer row `(1, seq)`; anything else (a
    batch, floats, ids outside `[0, vocab_size)` when it is given) is refused in one line."""
    if torch.is_tensor(prompt_ids):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        if prompt_ids.dim() != 1 or prompt_ids.is_floating_point():
            raise ValueError(f"A request's prompt is one sequence of token ids (a list or a 1-D integer tensor); got "
                             f"a {prompt_ids.dtype} tensor of shape {tuple(prompt_ids.shape)}. Add each row of a "
                             "batch as a request of its own.")
        prompt_ids = prompt_ids.tolist()
    bad = [t for t in prompt_ids if isinstance(t, float) or not 0 <= int(t) < (vocab_size or float("inf"))]
    if bad:
        raise ValueError(f"A request's prompt has ids outside the target's vocabulary [0, {vocab_size}) or not "
                         f"integers: {bad[:5]}. Tokenize it with the target's tokenizer.")
    if not prompt_ids:
        raise ValueError("Empty prompt: every request needs at least one token.")
    return [int(t) for t in prompt_ids]


def generate_batch(
    target: PreTrainedModel,
    drafter: DSparkDrafter,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    max_length: int,
    do_sample: bool,
    logits_processor: LogitsProcessorList | None,
    eos_token_id: list[int] | None,
    pad_token_id: int | None,
    policy: str | VerificationPolicy | None = None,
    prompt_lookup_num_tokens: int | None = None,
    max_matching_ngram_size: int | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    logits_processor_by_row: list[LogitsProcessorList] | None = None,
) -> torch.LongTensor:
    """`generate` semantics for a left-padded batch: returns `(batch, prompt + new)` ids, finished rows padded.

    Each row's logits processors and stopping criteria see the row as transformers' own loop shows it, left padding
    included (`logits_processor_by_row[i]`, when given, replaces `logits_processor` for row i: a batch-aware
    processor adapted to one row). Stop strings and other token criteria end a row at the token after which they
    stop; `MaxTimeCriteria` ends every row after the round in which time ran out."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    mask = attention_mask.bool()
    if input_ids.shape[1] == 0 or not bool(mask.any(dim=1).all()):
        raise ValueError(
            "A prompt of the batch is empty (0 unpadded tokens). DSpark drafts from the target's hidden states of the "
            "prompt: give every row at least one token (e.g. the tokenizer's BOS token)."
        )
    # Left padding means every row's mask is 0...0 1...1; anything else would silently shift positions.
    if bool((mask[:, 1:].long() - mask[:, :-1].long() < 0).any()):
        raise ValueError(
            "The batch is right-padded (a 0 after a 1 in attention_mask). DSpark batches need left padding: "
            "set tokenizer.padding_side = 'left' before tokenizing."
        )
    if pad_token_id is None:
        raise ValueError("Batched generation needs a pad token: pass pad_token_id=... (e.g. tokenizer.pad_token_id).")
    engine = DSparkBatchEngine(target, drafter, policy=policy, do_sample=do_sample, logits_processor=logits_processor,
                               eos_token_id=eos_token_id, stopping_criteria=stopping_criteria,
                               pad_token_id=pad_token_id, prompt_lookup_num_tokens=prompt_lookup_num_tokens or None,
                               max_matching_ngram_size=max_matching_ngram_size or 3)
    max_new_tokens = max_length - input_ids.shape[1]
    by_row = logits_processor_by_row or [None] * input_ids.shape[0]
    requests = [engine.add_request(row[m], max_new_tokens, logits_processor=processors, history_prefix=row[~m])
                for row, m, processors in zip(input_ids, mask, by_row)]
    clocks = time_criteria(stopping_criteria)
    while engine.waiting or engine.active:
        engine.step()
        if clocks and bool(clocks(input_ids, None).any()):
            break
    width = max(len(r.output_ids) for r in requests)
    out = torch.full((input_ids.shape[0], width), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
    for row, request in enumerate(requests):
        out[row, : len(request.output_ids)] = torch.tensor(request.output_ids, dtype=input_ids.dtype)
    merged = DSparkGenerationStats(drafter.config.block_size, [rnd for r in requests for rnd in r.stats.rounds])
    drafter.generation_stats = merged
    drafter.batch_generation_stats = [r.stats for r in requests]
    return torch.cat([input_ids, out], dim=1)
