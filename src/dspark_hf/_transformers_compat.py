"""Everything dspark-hf touches in transformers' private generation API lives here.

transformers has no public hook for a new kind of assistant, so we wrap a few private methods:

- `GenerationMixin._get_candidate_generator`: when `assistant_model` is a DSpark drafter (possibly PEFT-wrapped),
  return a `DSparkCandidateGenerator`; otherwise defer to transformers.
- `GenerationMixin._assisted_decoding`: for a DSpark assistant and batch > 1, run our batched engine instead of
  raising transformers' "batch_size = 1 only" error.
- `GenerationMixin._validate_generation_mode`: checks a DSpark drafter against the target, and refuses beam search
  and contradictory speculation settings, before transformers' own checks.
- `prepare_inputs_for_generation` (on the target instance, for one call): a cache filled by an earlier call makes the
  assisted loop's first forward start after the cached positions, as generate's prefill does without an assistant.
- `GenerationConfig._get_default_generation_params`: tells which of transformers' speculation settings
  (`num_assistant_tokens`, `assistant_confidence_threshold`) a call sets, which then pick the verification policy.
- `AutoModel.from_pretrained` / `AutoModelForCausalLM.from_pretrained`: a checkpoint whose `architectures[0]` is a
  DSpark class (written with `model_type: "qwen3"` in the official layout) loads as its DSpark drafter class instead
  of a plain Qwen3 model that would silently drop the DSpark tensors.
- `GenerationConfig._eos_token_tensor` / `_pad_token_tensor`: the special tokens generate resolved for this call.

And what moved inside the supported range (5.16-5.25): the cache's name (`CACHE_ARGUMENT`, `cache_argument`:
`past_key_values` before 5.24), how a list `output_hidden_states=[...]` is numbered (`hidden_states_request`,
`select_hidden_states`) and the assisted loop's stopping checks before 5.18 (`_LOOP_CHECKS_CANDIDATES`).

The rest of dspark-hf uses public names only (`tests/test_private_api_boundary.py` fails otherwise). `check_contract()`
checks the signatures we call at import time; `tests/test_transformers_contract.py` runs it and checks the behaviour
(the hooks are called, with the target's hidden states) on a tiny model, so an upstream change fails loudly instead of
silently disabling speculation.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect

import torch
import transformers
from packaging import version
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.utils import GenerationMixin
from transformers import AutoModel, AutoModelForCausalLM, GenerationConfig, LogitsProcessorList
from transformers import PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor
from transformers.utils import logging

from . import registry
from .generation.gqa import use_native_gqa
from .generation.policies import policy_for_call
from .generation.stopping import RoundStopping, token_criteria


logger = logging.get_logger(__name__)

# Keep in sync with pyproject.toml.
SUPPORTED_TRANSFORMERS = (version.parse("5.16.0"), version.parse("5.26.0"))
_INSTALLED = version.parse(transformers.__version__)
# Before 5.18 the assisted loop asks the stopping criteria of each round's unverified candidates too, and does not cut
# accepted drafts at an EOS (the candidate generator cuts its drafts after the first EOS instead).
_LOOP_CHECKS_CANDIDATES = _INSTALLED < version.parse("5.18.0")



def check_contract() -> list[str]:
    """The list of broken assumptions about transformers' generation internals (empty when all hold).

    Cheap enough for import time: the version range, the signatures of the private methods we wrap or call, and the
    names we read. What the assisted loop does with them (passing the target's outputs and hidden states to the
    candidate generator, resolving the special tokens) is checked by running it, in
    `tests/test_transformers_contract.py`.
    """
    problems = []
    if not SUPPORTED_TRANSFORMERS[0] <= _INSTALLED < SUPPORTED_TRANSFORMERS[1]:
        problems.append(
            f"transformers {_INSTALLED} is outside the tested range "
            f"[{SUPPORTED_TRANSFORMERS[0]}, {SUPPORTED_TRANSFORMERS[1]})"
        )
    original = getattr(_get_candidate_generator, "__wrapped__", GenerationMixin._get_candidate_generator)
    params = inspect.signature(original).parameters
    for name in ("generation_config", "input_ids", "logits_processor", "model_kwargs", "assistant_model"):
        if name not in params:
            problems.append(f"GenerationMixin._get_candidate_generator lost its `{name}` argument")
    loop_params = list(inspect.signature(inspect.unwrap(GenerationMixin._assisted_decoding)).parameters)
    expected = ["self", "input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus",
                "streamer", "inputs_tensor", "assistant_model"]
    if loop_params[: len(expected)] != expected:
        problems.append(f"GenerationMixin._assisted_decoding's arguments changed: {loop_params}")
    mode_params = list(inspect.signature(inspect.unwrap(GenerationMixin._validate_generation_mode)).parameters)
    if mode_params != ["self", "generation_mode", "generation_config", "generation_mode_kwargs"]:
        problems.append(f"GenerationMixin._validate_generation_mode's arguments changed: {mode_params}")
    defaults = getattr(GenerationConfig, "_get_default_generation_params", lambda: {})()
    if "num_assistant_tokens" not in defaults or "assistant_confidence_threshold" not in defaults:
        problems.append("GenerationConfig._get_default_generation_params() no longer lists the assistant settings")
    prepare_params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    if not {"next_sequence_length", "is_first_iteration"} <= set(prepare_params):
        problems.append("GenerationMixin.prepare_inputs_for_generation lost `next_sequence_length` or "
                        "`is_first_iteration` (a pre-filled cache's first forward is sliced with them)")
    if not hasattr(CandidateGenerator, "requires_model_outputs"):
        problems.append("CandidateGenerator.requires_model_outputs is gone")
    constrained = PrefixConstrainedLogitsProcessor(lambda batch_id, sent: [0], 1)
    if not callable(getattr(constrained, "_prefix_allowed_tokens_fn", None)):
        problems.append("PrefixConstrainedLogitsProcessor._prefix_allowed_tokens_fn is gone (batched rows adapt it)")
    if not hasattr(RepetitionPenaltyLogitsProcessor(1.5), "prompt_ignore_length"):
        problems.append("RepetitionPenaltyLogitsProcessor.prompt_ignore_length is gone (batched rows adapt it)")
    return problems


# What forward, generate and the model outputs call the cache: `cache` from transformers 5.24 on, `past_key_values`
# before (5.24 keeps the old name as a deprecated alias).
CACHE_ARGUMENT = ("cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
                  else "past_key_values")


def cache_argument(model) -> str:
    """The name under which `model`'s forward takes its cache: the one its signature lists (a model with remote code
    may keep `past_key_values`), else transformers' (a wrapper that passes `**kwargs` on). Read once per class's
    forward (the engine asks before every step); a forward set on the instance is read each time."""
    forward = model.forward
    function = getattr(forward, "__func__", None)
    return _cache_argument_of(function) if function is not None else _cache_argument_of.__wrapped__(forward)


@functools.lru_cache(maxsize=None)
def _cache_argument_of(forward) -> str:
    parameters = inspect.signature(forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), CACHE_ARGUMENT)


# How a list `output_hidden_states=[...]` numbers the hidden states it captures: by their index in the full tuple
# (index 0 the embedding output) from transformers 5.23 on; 5.17-5.22 leave the embedding output out (their index `j`
# is the output of layer `j`, the full tuple's `j + 1`) and cannot capture it; earlier releases capture every layer.
_SELECTION_OFFSET = 0 if _INSTALLED >= version.parse("5.23.0") else 1 if _INSTALLED >= version.parse("5.17.0") else None


def hidden_states_request(indices: list[int]) -> list[int] | bool:
    """The `output_hidden_states` value that captures the hidden states at `indices` (positions in the full tuple,
    index 0 the embedding output) and no others; `True` (every layer) where the installed transformers cannot select
    them (the embedding output before 5.23, any before 5.17). Read them with [`select_hidden_states`]."""
    if _SELECTION_OFFSET is None or min(indices) < _SELECTION_OFFSET:
        return True
    return [i - _SELECTION_OFFSET for i in indices]


def select_hidden_states(hidden_states, indices: list[int], request: list[int] | bool) -> list:
    """The hidden states at `indices` (full-tuple positions) of a forward run with `output_hidden_states=request`."""
    if request is True:
        return [hidden_states[i] for i in indices]
    return [hidden_states[i - _SELECTION_OFFSET] for i in indices]


def changed_speculation_settings(generation_config) -> dict:
    """transformers' own speculation settings that this call sets to other than transformers' defaults
    (`num_assistant_tokens`, `num_assistant_tokens_schedule`, `assistant_confidence_threshold`): the generation
    config that reaches generate's internals has the defaults filled in, so "set by the user" reads as "not the
    default"."""
    defaults = GenerationConfig._get_default_generation_params()
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {name: getattr(generation_config, name, None) for name in names
            if getattr(generation_config, name, None) not in (None, defaults.get(name))}


def unwrap_drafter(assistant_model):
    """The `DSparkDrafter` behind `assistant_model` (itself, or the base model of a PEFT wrapper), else `None`."""
    from .modeling_dspark import DSparkDrafter

    model = assistant_model
    for _ in range(3):  # PeftModel -> LoraModel -> DSparkDrafter
        if isinstance(model, DSparkDrafter):
            return model
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif hasattr(model, "model") and model is not getattr(model, "model"):
            model = model.model
        else:
            return None
    return model if isinstance(model, DSparkDrafter) else None


def _make_candidate_generator(original):
    @functools.wraps(original)
    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, *args, **kwargs):
        drafter = unwrap_drafter(assistant_model)
        if drafter is None:
            return original(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                            assistant_model, *args, **kwargs)
        from .generation.candidate_generator import DSparkCandidateGenerator

        return DSparkCandidateGenerator(
            drafter=drafter,
            target=self,
            generation_config=generation_config,
            logits_processor=logits_processor,
            input_ids=input_ids,
            model_kwargs=model_kwargs,
            policy=policy_for_call(changed_speculation_settings(generation_config)),
            eos_token_ids=eos_token_ids(generation_config),
        )

    return _get_candidate_generator


def eos_token_ids(generation_config) -> list[int]:
    """The EOS ids generate resolved for this call (`_eos_token_tensor`), as a list (empty when there are none)."""
    eos = generation_config._eos_token_tensor
    return [] if eos is None else eos.flatten().tolist()


def row_logits_processor(processors, row: int):
    """`processors` (built by generate for the whole batch) adapted to run on row `row` alone, with that row's
    padded history as their input (`DSparkBatchEngine` verifies rows one by one): `repetition_penalty`'s per-row
    padding lengths cut to the row's, `prefix_allowed_tokens_fn` called with the row's batch index. `None` when no
    processor needs it (every row then shares `processors`)."""
    adapted, changed = LogitsProcessorList(), False
    for processor in processors or ():
        if isinstance(processor, RepetitionPenaltyLogitsProcessor) and torch.is_tensor(processor.prompt_ignore_length):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = processor.prompt_ignore_length[row: row + 1]
            changed = True
        elif isinstance(processor, PrefixConstrainedLogitsProcessor):
            allowed = processor._prefix_allowed_tokens_fn
            processor = copy.copy(processor)
            processor._prefix_allowed_tokens_fn = lambda batch_id, sent, allowed=allowed: allowed(row, sent)
            changed = True
        adapted.append(processor)
    return adapted if changed else None


# What generate hands its decoding loop besides the inputs, that the batched engine builds itself or reads
# (`position_ids` generate derives from the attention mask); any other model input would be ignored there.
_BATCHED_MODEL_KWARGS = {"attention_mask", CACHE_ARGUMENT, "use_cache", "logits_to_keep", "position_ids", "tokenizer",
                         "assistant_tokenizer"}
# generate's per-step outputs (one entry per step for the whole batch), which batched DSpark rows cannot give
_PER_STEP_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def _make_assisted_decoding(original):
    """Routes batch > 1 with a DSpark assistant to our batched engine (transformers refuses it)."""

    @functools.wraps(original)
    def _assisted_decoding(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                           streamer=None, inputs_tensor=None, assistant_model=None, *args, **model_kwargs):
        drafter = unwrap_drafter(assistant_model)
        if drafter is None:
            return original(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                            streamer, inputs_tensor, assistant_model, *args, **model_kwargs)
        if input_ids.shape[1] == 0 and model_kwargs.get("inputs_embeds") is not None:
            raise ValueError(
                "generate() got inputs_embeds without input_ids. DSpark drafts from token ids at absolute positions: "
                "pass input_ids= with the prompt's ids as well (the inputs_embeds still feed the target's first "
                "forward)."
            )
        from .generation.candidate_generator import cached_length

        if input_ids.shape[0] == 1:
            cached = cached_length(model_kwargs)
            # transformers asks its stopping criteria once per round; stop strings and custom criteria are asked of
            # every prefix the round committed instead, and the output cut at the first that stops
            # (generation/stopping.py)
            stopping = RoundStopping(stopping_criteria, streamer, input_ids.shape[1], _LOOP_CHECKS_CANDIDATES) if (
                token_criteria(stopping_criteria) or _LOOP_CHECKS_CANDIDATES) else None
            try:
                with _forward_uncached_only(self, cached):
                    output = original(self, input_ids, logits_processor, stopping or stopping_criteria,
                                      generation_config, synced_gpus,
                                      streamer if stopping is None else stopping.streamer, inputs_tensor,
                                      assistant_model, *args, **model_kwargs)
            finally:  # the candidate generator turns native GQA on for each verification forward (generation/gqa.py)
                use_native_gqa(False)
            return output if stopping is None else stopping.cut(output)
        from .generation.batched import generate_batch

        if cached_length(model_kwargs):
            logger.warning_once("dspark-hf: batched DSpark generation builds its own caches; the pre-filled cache "
                                "passed to generate() is not used (the prompts are prefilled again, and it is not "
                                "extended). Continue a cache at batch size 1.")

        if getattr(generation_config, "assistant_ensemble_weight", None) is not None:
            raise ValueError("assistant_ensemble_weight (verification against a mixture of target and draft, not "
                             "lossless) is transformers' batch-1 loop's; batched DSpark generation verifies against "
                             "the target alone. Use batch size 1 for it, or drop it.")
        unused = sorted(name for name, value in model_kwargs.items()
                        if value is not None and name not in _BATCHED_MODEL_KWARGS)
        if unused:
            raise ValueError(f"Batched DSpark generation runs the target on input_ids and attention_mask alone; this "
                             f"call also passes {unused}, which it would ignore. Use batch size 1 for them.")
        asked = [f"{name}=True" for name in _PER_STEP_OUTPUTS if getattr(generation_config, name, False)]
        asked = (["a streamer"] if streamer is not None else []) + (
            asked if generation_config.return_dict_in_generate else [])
        if asked:
            raise ValueError(
                f"Batched DSpark generation returns sequences only (its rows advance by different numbers of tokens "
                f"per round); this call asks for {', '.join(asked)}. Use batch size 1 for a streamer or per-step "
                f"outputs."
            )
        by_row = [row_logits_processor(logits_processor, row) for row in range(input_ids.shape[0])]
        sequences = generate_batch(
            self, drafter, input_ids, model_kwargs.get("attention_mask"), generation_config.max_length,
            generation_config.do_sample, logits_processor, eos_token_ids(generation_config),
            generation_config._pad_token_tensor.item() if generation_config._pad_token_tensor is not None else None,
            policy=policy_for_call(changed_speculation_settings(generation_config)),
            prompt_lookup_num_tokens=generation_config.prompt_lookup_num_tokens,
            max_matching_ngram_size=generation_config.max_matching_ngram_size,
            stopping_criteria=stopping_criteria,
            logits_processor_by_row=by_row if any(p is not None for p in by_row) else None,
        )
        if generation_config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    return _assisted_decoding


@contextlib.contextmanager
def _forward_uncached_only(model, cached: int):
    """Within the block, the assisted loop's first forward on `model` skips the `cached` positions that a cache from
    an earlier call holds (nothing changes when `cached` is 0). The loop's first forward takes the whole prompt
    (`next_sequence_length=None`), which on a pre-filled cache appends the prompt after it again, at shifted
    positions (transformers' own prompt lookup then gives other tokens than decoding without an assistant); generate's
    prefill for decoding without an assistant slices `input_ids[:, cached:]`, and so does this."""
    if not cached:
        yield
        return
    prepare = model.prepare_inputs_for_generation

    @functools.wraps(prepare)
    def prepare_inputs_for_generation(input_ids, *args, next_sequence_length=None, is_first_iteration=False, **kwargs):
        if is_first_iteration and next_sequence_length is None:
            next_sequence_length = input_ids.shape[1] - cached
        return prepare(input_ids, *args, next_sequence_length=next_sequence_length,
                       is_first_iteration=is_first_iteration, **kwargs)

    own = vars(model).get("prepare_inputs_for_generation")  # a wrapper's own, set on the instance
    model.prepare_inputs_for_generation = prepare_inputs_for_generation
    try:
        yield
    finally:
        if own is None:
            del model.prepare_inputs_for_generation
        else:
            model.prepare_inputs_for_generation = own


def _make_validate_generation_mode(original):
    """Checks a DSpark drafter against the target before transformers' own checks, whose message for a drafter of
    another vocabulary points at universal assisted decoding (tokenizer pairs) instead of the actual mistake, and lets
    `num_return_sequences` through (the expanded rows go to the batched engine)."""

    @functools.wraps(original)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        drafter = unwrap_drafter(generation_mode_kwargs.get("assistant_model"))
        if drafter is not None:
            drafter.check_target(self)
            if (generation_config.num_beams or 1) > 1:
                raise ValueError(
                    f"num_beams={generation_config.num_beams} cannot use a DSpark assistant: speculative decoding "
                    "verifies one sequence per prompt (greedy or sampling). Drop num_beams, or drop assistant_model "
                    "for beam search."
                )
            if generation_config.guidance_scale not in (None, 1):
                raise ValueError(
                    f"guidance_scale={generation_config.guidance_scale} cannot use a DSpark assistant: classifier-free "
                    "guidance runs the model on the unconditional prompt once per token, with a cache of its own that "
                    "a round verifying several tokens would corrupt. Drop guidance_scale, or drop assistant_model."
                )
            policy_for_call(changed_speculation_settings(generation_config))  # refuses contradictory settings early
            # transformers refuses num_return_sequences > 1 for its batch-1 assisted loop; generate expands the prompt
            # to that many rows after this check, and a DSpark assistant samples them in the batched engine
            wanted = generation_config.num_return_sequences
            generation_config.num_return_sequences = 1
            try:
                return original(self, generation_mode, generation_config, generation_mode_kwargs)
            finally:
                generation_config.num_return_sequences = wanted
        return original(self, generation_mode, generation_config, generation_mode_kwargs)

    return _validate_generation_mode


def _make_auto_from_pretrained(original):
    original = original.__func__

    @functools.wraps(original)
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        config = kwargs.get("config")
        if config is None or isinstance(config, str):
            try:
                config_dict, _ = transformers.PreTrainedConfig.get_config_dict(
                    pretrained_model_name_or_path,
                    **{k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only", "subfolder")
                       if k in kwargs},
                )
            except (OSError, ValueError):
                config_dict = {}
            drafter_class = registry.drafter_class((config_dict.get("architectures") or [None])[0])
            if drafter_class is not None:
                return drafter_class.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        return original(cls, pretrained_model_name_or_path, *model_args, **kwargs)

    return classmethod(from_pretrained)


_get_candidate_generator = _make_candidate_generator(GenerationMixin._get_candidate_generator)


def install() -> None:
    """Installs the generate and Auto* integrations (idempotent); warns if the contract looks broken."""
    if getattr(GenerationMixin._get_candidate_generator, "_dspark", False):
        return
    _get_candidate_generator._dspark = True
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    GenerationMixin._assisted_decoding = _make_assisted_decoding(GenerationMixin._assisted_decoding)
    GenerationMixin._validate_generation_mode = _make_validate_generation_mode(GenerationMixin._validate_generation_mode)
    # transformers gives every Auto class its own copy of from_pretrained, so each one is wrapped.
    for auto_class in (AutoModel, AutoModelForCausalLM):
        auto_class.from_pretrained = _make_auto_from_pretrained(auto_class.from_pretrained)
    for problem in check_contract():
        logger.warning(f"dspark-hf: {problem}; DSpark generation may misbehave. Pin transformers to the tested range.")
