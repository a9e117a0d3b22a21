"""`DSparkCandidateGenerator`: drafts a block per round for transformers' assisted decoding loop.

Each round (docs/design.md, "Forward pass"):
1. take the target's hidden states at `target_layer_ids` for the newly committed positions from the verification
   forward that just ran, and append their context K/V to the drafter's cache;
2. run the drafter once on ``[anchor, mask × (B-1)]``;
3. sample drafts left to right with the Markov bias, asking the verification policy before each slot (the shared
   `drafting.sample_drafts`, which the batched engine and the custom_generate recipe run too), and tell the policy
   the round's outcome once transformers has verified it (`VerificationPolicy.end_round`);
4. return the drafts and, when sampling, their Markov-corrected, processor-applied logits, so that transformers' own
   speculative sampling verifies exactly the distribution the drafts were drawn from (greedy matching needs the
   drafts alone).

While transformers verifies a round's drafts (from `get_candidates` to `update_candidate_strategy`), a CPU target's
SDPA attention groups query heads natively instead of copying K/V per head (`generation/gqa.py`: bitwise the same
output, less time).

A policy may skip the drafter for a round (`VerificationPolicy.begin_round`): the target then decodes one token and
the new target features wait in a buffer until the next drafted round appends them to the drafter's context. With
`prompt_lookup_num_tokens` set in the call, a round whose last n-gram occurred earlier in the sequence verifies the
continuation found there instead (`generation/lookup.py`); its features wait in the same buffer, and the policy does not
see the round.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from .. import _transformers_compat
from ..modeling_dspark import DSparkDrafter
from . import gqa
from .drafting import DraftedBlock, block_inputs, sample_drafts
from .lookup import PromptLookup
from .policies import VerificationPolicy, resolve_policy
from .stats import DSparkGenerationStats, DSparkRoundStats
from .stopping import drop_last
from .verification_policy import RoundOutcome


class DSparkCandidateGenerator(CandidateGenerator):
    """Candidate generator for a [`DSparkDrafter`] (batch size 1).

    Args:
        drafter ([`DSparkDrafter`]): the drafter (unwrapped from PEFT if it was wrapped).
        target ([`PreTrainedModel`]): the model being generated from.
        generation_config ([`GenerationConfig`]): the call's generation config.
        logits_processor ([`LogitsProcessorList`], *optional*): the call's processors and warpers; applied to each
            draft's corrected logits exactly as the target's logits get them.
        input_ids (`torch.LongTensor` of shape `(batch, seq)`): the prompt.
        model_kwargs (`dict`): the call's model kwargs (for the attention mask).
        policy ([`VerificationPolicy`], *optional*): defaults to `drafter.verification_policy` (see `resolve_policy`).
        eos_token_ids (`list[int]`, *optional*): the call's EOS ids (prompt-lookup drafts stop before one).
    """

    requires_model_outputs = True

    def __init__(
        self,
        drafter: DSparkDrafter,
        target: PreTrainedModel,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any],
        policy: VerificationPolicy | None = None,
        eos_token_ids: list[int] | None = None,
    ):
        _check_inputs(input_ids, model_kwargs)
        drafter.check_target(target)
        self.drafter = drafter
        self.config = drafter.config
        self.policy = resolve_policy(drafter, target, policy)
        if self.policy.requires_confidence and drafter.confidence_head is None:
            raise ValueError(
                f"The {self.policy.name!r} verification policy needs confidences, but this drafter has no confidence "
                "head (enable_confidence_head=false). Use the 'full' policy."
            )
        # Ask the target for exactly the hidden states the drafter reads (index i + 1 is the output of layer i), or for
        # all of them when the call returns them (`output_hidden_states=True`: generate's output holds every layer's).
        wanted = generation_config.output_hidden_states or _transformers_compat.hidden_states_request(
            self.config.hidden_state_indices
        )
        self.model_kwargs_overrides = {"output_hidden_states": wanted}
        self.max_length = generation_config.max_length
        self.do_sample = generation_config.do_sample
        # transformers reads the drafts' logits in speculative sampling and, in greedy decoding, only to mix them in
        # (`assistant_ensemble_weight`, transformers >= 5.25); otherwise building them would be wasted.
        ensemble_weight = getattr(generation_config, "assistant_ensemble_weight", None)
        self.returns_logits = self.do_sample or ensemble_weight is not None
        self.logits_processor = logits_processor if logits_processor is not None else LogitsProcessorList()
        # The drafter's context for the target cache this call extends: carried over from the call that filled it
        # (a chat's previous turn), else the positions it already holds have no target features here and the context
        # starts after them. Either way only the drafts change; their verification is the target's.
        self.context = DrafterContext.for_cache(
            drafter, model_kwargs.get(_transformers_compat.CACHE_ARGUMENT), cached_length(model_kwargs)
        )
        self.policy.reset()
        self.stats = DSparkGenerationStats(block_size=self.config.block_size)
        self._pending_round: DSparkRoundStats | None = None
        self._pending_outcome: RoundOutcome | None = None
        self._observed: list[float] | None = None  # the confidences of the last observed round
        self.lookup = _prompt_lookup(generation_config, eos_token_ids)
        self.eos_token_ids = set(eos_token_ids or [])
        drafter.generation_stats = self.stats

    @property
    def num_drafting_tokens(self) -> int:
        """The most drafts one round proposes (transformers >= 5.25 sizes the cache's past recording with it)."""
        return self.config.block_size

    @torch.no_grad()
    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs: Any = None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        # The first call precedes the target's prefill: nothing to draft from yet, so the target decodes one token.
        if is_first_iteration:
            return input_ids, None
        if self.lookup is not None:
            found = self._lookup_candidates(input_ids, drafting=True)
            if found.numel():
                return self._lookup_round(input_ids, model_outputs, found)
        if not self.policy.begin_round([self._observed], self.config.block_size):
            self._pending_outcome = RoundOutcome([[]], [0], [0], drafted=False)
            found = input_ids.new_empty(0) if self.lookup is None else self._lookup_candidates(input_ids, drafting=False)
            if found.numel():  # the policy skips the drafter; lookup drafts still beat plain decoding
                return self._lookup_round(input_ids, model_outputs, found)
            self._defer_features(input_ids, model_outputs)
            self._pending_round = DSparkRoundStats(confidences=[], verified=0, drafted=False)
            return input_ids, None
        start = time.perf_counter()
        block = self._draft(input_ids, model_outputs)
        length = block.lengths[0]
        draft_ids = block.ids[0, :length].tolist()
        # drafts after an EOS are never committed (and transformers < 5.18 would accept them past it)
        length = next((i + 1 for i, token in enumerate(draft_ids) if token in self.eos_token_ids), length)
        draft_ids = draft_ids[:length]
        self._pending_round = DSparkRoundStats(confidences=block.confidences[0], verified=length,
                                               confidence_logits=block.confidence_logits[0], draft_ids=draft_ids)
        self._pending_outcome = RoundOutcome(block.confidences, [length], [0], observed=block.observed,
                                             draft_seconds=time.perf_counter() - start)  # fmt: skip
        if block.observed:
            self._observed = block.confidences[0]
        if not length:
            return input_ids, None
        candidates = block.ids[:, :length].to(device=input_ids.device, dtype=input_ids.dtype)
        gqa.use_native_gqa(gqa.wanted(input_ids.device, 1 + length))  # for the verification forward, until it ends
        return torch.cat([input_ids, candidates], dim=-1), block.logits[:, :length] if self.returns_logits else None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        gqa.use_native_gqa(False)
        if self._pending_round is not None:
            round_stats, outcome = self._pending_round, self._pending_outcome
            round_stats.accepted = int(num_matches)
            if round_stats.source == "lookup":
                self.lookup.record(round_stats.verified, int(num_matches))
            elif self.lookup is not None and round_stats.drafted:
                self.lookup.record_drafted(round_stats.verified, int(num_matches))
            if outcome is not None:  # the policy hears of its own rounds (a lookup round in place of a skipped one too)
                if outcome.drafted:
                    outcome.accepted = [int(num_matches)]
                self.policy.end_round(outcome)
            self.stats.rounds.append(round_stats)
            self._pending_round = self._pending_outcome = None

    def _lookup_candidates(self, input_ids: torch.LongTensor, drafting: bool) -> torch.LongTensor:
        """Lookup drafts for this round, when they beat a drafted round (`drafting`) or plain decoding."""
        return self.lookup.candidates(input_ids, self.max_length - input_ids.shape[1] - 1,
                                      getattr(self.policy, "steps_per_second", None),
                                      draft_seconds=getattr(self.policy, "drafting_cost", lambda: 0.0)(),
                                      drafting=drafting)  # fmt: skip

    def _lookup_round(self, input_ids: torch.LongTensor, model_outputs: Any, found: torch.LongTensor):
        """Proposes `found` for verification; the drafter's context waits in the buffer, as in a skipped round."""
        self._defer_features(input_ids, model_outputs)
        self._pending_round = DSparkRoundStats(confidences=[], verified=found.numel(), drafted=False,
                                               draft_ids=found.tolist(), source="lookup")
        gqa.use_native_gqa(gqa.wanted(input_ids.device, 1 + found.numel()))
        return torch.cat([input_ids, found[None].to(input_ids.dtype)], dim=-1), None

    def _draft(self, input_ids: torch.LongTensor, model_outputs: Any) -> DraftedBlock:
        """Drafts this round's block with the shared left-to-right sampling, asking the policy before each slot. A
        policy that plans from whole rounds looks at more slots than it verifies (`num_slots`): the slots past the cut
        are still sampled to compute their confidences, but never verified, and only as far as the policy's plan
        could still change (`settled`)."""
        hidden_states = self._run_drafter(input_ids, model_outputs)
        max_drafts = min(self.config.block_size, self.max_length - input_ids.shape[1] - 1)

        def process(drafts: torch.LongTensor, logits: torch.Tensor) -> torch.Tensor:
            sequence = torch.cat([input_ids, drafts.to(input_ids.device)], dim=-1)
            return self.logits_processor(sequence, logits.to(input_ids.device))

        num_slots = self.policy.num_slots(self.config.block_size, [max_drafts])
        return sample_drafts(self.drafter, hidden_states, self.drafter.draft_logits(hidden_states), input_ids[:, -1],
                             [max_drafts], self.policy, num_slots=num_slots,
                             process=process if len(self.logits_processor) else None,
                             do_sample=self.do_sample)  # fmt: skip

    def _run_drafter(self, input_ids: torch.LongTensor, model_outputs: Any) -> torch.Tensor:
        """Feeds the newly committed positions' target features to the drafter and runs the block forward.

        Returns the block's final-normed hidden states `(1, block, hidden)`.
        """
        anchor_position = input_ids.shape[1] - 1  # the anchor itself has not been through the target yet
        self._defer_features(input_ids, model_outputs)
        features, context_positions = self.context.take_pending()  # skipped rounds' features, then this round's
        device = self.drafter.device
        block_ids, positions = block_inputs(input_ids[:, -1].to(device), torch.tensor([anchor_position], device=device),
                                            self.config.block_size, self.config.mask_token_id)  # fmt: skip
        output = self.drafter(
            input_ids=block_ids,
            target_hidden_states=features.to(device),
            position_ids=positions,
            context_position_ids=context_positions[None].to(device),
            cache=self.context.cache,
            compute_logits=False,
        )
        return output.last_hidden_state

    def _defer_features(self, input_ids: torch.LongTensor, model_outputs: Any) -> None:
        """Buffers the target features of the positions committed since the last call (up to, not including, the
        anchor) until a drafted round appends the whole buffer to the drafter's context."""
        anchor_position = input_ids.shape[1] - 1
        features = self._new_target_features(model_outputs, anchor_position - self.context.end)
        self.context.defer(features, anchor_position)

    def _new_target_features(self, model_outputs: Any, num_new: int) -> torch.Tensor:
        """`(1, num_new, m * hidden)`: the first `num_new` rows of the last target forward's selected layers.

        Those rows are the positions the target just committed: the whole prompt after prefill, else the previous
        anchor plus the accepted drafts (the rejected tail is dropped).
        """
        hidden_states = getattr(model_outputs, "hidden_states", None)
        if hidden_states is None:
            raise RuntimeError(
                "The target returned no hidden states; DSpark needs a target that supports `output_hidden_states` "
                "(transformers' generate contract changed? see dspark_hf._transformers_compat)."
            )
        layers = _transformers_compat.select_hidden_states(
            hidden_states, self.config.hidden_state_indices, self.model_kwargs_overrides["output_hidden_states"]
        )
        if any(layer is None for layer in layers) or layers[0].shape[1] < num_new:
            raise RuntimeError(
                f"Expected the target's last forward to cover the {num_new} newly committed positions at hidden-state "
                f"indices {self.config.hidden_state_indices}; got shapes "
                f"{[None if layer is None else tuple(layer.shape) for layer in layers]}. (Did transformers' "
                "assisted loop change how it slices its first forward? see dspark_hf._transformers_compat)"
            )
        return torch.cat([layer[:, :num_new] for layer in layers], dim=-1)


class DrafterContext:
    """The drafter's context for one target cache: the context K/V of the target positions it has ingested (`cache`,
    their positions in `positions`) and the features of later positions that wait to be ingested (rounds that did
    not draft buffer theirs; the next drafted round ingests them all in one pass).

    A generate call that returns its target cache leaves this beside it (`for_cache`, keyed weakly by the cache
    object), so the call that continues that cache (a chat's next turn) drafts from the whole conversation's features,
    not only from the positions new to it. The last round of a call gives no features (its forward's outputs reach no
    later round), so those positions, up to a block, stay missing; attention reads the rest at their own positions.
    """

    _by_cache: "weakref.WeakKeyDictionary[Any, DrafterContext]" = weakref.WeakKeyDictionary()

    def __init__(self, drafter: DSparkDrafter, start: int):
        self.drafter = weakref.ref(drafter)
        self.dtype, self.device = drafter.dtype, drafter.device
        self.cache = DynamicCache(config=drafter.config)
        self.positions = torch.zeros(0, dtype=torch.long)  # of the entries in `cache`, ascending
        self._pending: list[torch.Tensor] = []
        self._pending_positions: list[torch.Tensor] = []
        self.end = start  # the first target position whose features have not arrived

    @classmethod
    def for_cache(cls, drafter: DSparkDrafter, target_cache: Any, cached: int) -> "DrafterContext":
        """The context left beside `target_cache` by this drafter, kept for the `cached` positions the cache still
        holds (a cropped cache keeps its prefix) and expecting features from there on; else a new one from there."""
        try:
            context = None if target_cache is None else cls._by_cache.get(target_cache)
        except TypeError:  # a cache class of its own, unhashable or not weakly referable: nothing carries over
            return cls(drafter, cached)
        if context is None or context.drafter() is not drafter or (context.dtype, context.device) != (
                drafter.dtype, drafter.device):
            context = cls(drafter, cached)
        else:
            context._restart_at(cached)
        if target_cache is not None:
            cls._by_cache[target_cache] = context
        return context

    def defer(self, features: torch.Tensor, end: int) -> None:
        """Buffers `features` `(1, end - self.end, m * hidden)`, those of positions `self.end` to `end - 1`."""
        self._pending.append(features)
        self._pending_positions.append(torch.arange(self.end, end))
        self.end = end

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffered features and their positions, in order, counted as ingested: the caller feeds them to the
        drafter with `cache` at once."""
        features, positions = torch.cat(self._pending, dim=1), torch.cat(self._pending_positions)
        self._pending, self._pending_positions = [], []
        self.positions = torch.cat([self.positions, positions])
        return features, positions

    def _restart_at(self, length: int) -> None:
        keep = int((self.positions < length).sum())
        if keep < self.positions.numel():
            drop_last(self.cache, self.positions.numel() - keep)
            self.positions = self.positions[:keep]
        kept = [(f[:, p < length], p[p < length]) for f, p in zip(self._pending, self._pending_positions)]
        self._pending, self._pending_positions = [f for f, _ in kept], [p for _, p in kept]
        self.end = length


def _prompt_lookup(generation_config: GenerationConfig, eos_token_ids: list[int] | None) -> PromptLookup | None:
    """Lookup drafts for the rounds where they exist, when the call sets transformers' `prompt_lookup_num_tokens`."""
    if not generation_config.prompt_lookup_num_tokens:
        return None
    return PromptLookup(generation_config.prompt_lookup_num_tokens, generation_config.max_matching_ngram_size or 3,
                        eos_token_ids)


def _check_inputs(input_ids: torch.LongTensor, model_kwargs: dict[str, Any]) -> None:
    """Refuses inputs that the batch-1 assisted loop would mishandle, with the reason and the fix."""
    if input_ids.shape[0] != 1:  # batches go to generation/batched.py before reaching here
        raise ValueError(f"DSparkCandidateGenerator drafts for one sequence, got a batch of {input_ids.shape[0]}.")
    if input_ids.shape[1] == 0:
        raise ValueError(
            "The prompt is empty (0 tokens). DSpark drafts from the target's hidden states of the prompt: give it at "
            "least one token (e.g. the tokenizer's BOS token, or a chat template)."
        )
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "The attention_mask has padding (zeros) for a single sequence. DSpark drafts at absolute positions and "
            "needs an unpadded prompt: tokenize it without padding (or strip the pad tokens)."
        )
    cached = cached_length(model_kwargs)
    if cached >= input_ids.shape[1]:
        raise ValueError(
            f"The cache passed to generate() holds {cached} positions, the whole prompt of {input_ids.shape[1]} "
            "tokens; its last token must be uncached (its forward gives the first new token): pass "
            "`input_ids` with the new turn appended, or crop the cache by one (`cache.crop(-1)`)."
        )


def cached_length(model_kwargs: dict[str, Any]) -> int:
    """How many positions the target's cache already holds at the start of the call (a cache of an earlier call)."""
    cache = model_kwargs.get(_transformers_compat.CACHE_ARGUMENT)
    return 0 if cache is None else cache.get_seq_length()
