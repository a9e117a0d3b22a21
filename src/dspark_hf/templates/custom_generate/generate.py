"""DSpark speculative decoding as a `transformers` custom generation method, with no dependency on dspark-hf.

The repository that holds this file also holds the DSpark drafter (``config.json`` + safetensors, official DeepSpec
layout). Run the drafter's target with it:

    out = target.generate(**inputs, custom_generate="<this repo>", trust_remote_code=True, max_new_tokens=256)

Each round the drafter proposes up to ``block_size`` tokens in one forward pass (anchor + mask tokens attending to the
target's hidden states), left to right through its Markov head; the target verifies them in one forward pass. The
output follows the target's distribution exactly: greedy decoding returns the same tokens as ``target.generate``,
sampling uses speculative rejection sampling. Batch size 1; greedy or sampling with temperature / top-k / top-p;
stop strings (``stop_strings=..., tokenizer=...``) and ``stopping_criteria`` end the output where ``target.generate``
alone would, inside a round too.

Extra arguments: ``dspark_drafter`` (a local folder or Hub id to use instead of this repository's drafter) and
``dspark_confidence_threshold`` (stop a block at the first draft whose confidence is below it; 0 drafts full blocks).
"""

from __future__ import annotations

import inspect
import json
import os
import weakref

import torch
import transformers
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    DynamicCache,
    LogitsProcessorList,
    StoppingCriteriaList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.activations import ACT2FN

# The verification policies, the drafting and verification and the stopping check every DSpark path runs
# (dspark_hf/generation/verification_policy.py, drafting.py and stopping.py). The recipe that `dspark_hf.hub` writes
# holds those modules' source here instead of these imports, so it runs without dspark-hf.
from dspark_hf.generation.verification_policy import FullBlockPolicy, RoundOutcome, ThresholdPolicy
from dspark_hf.generation.drafting import block_inputs, pick_tokens, sample_drafts, verify
from dspark_hf.generation.stopping import cut_cache, drop_last, first_stop


# Written by dspark_hf.hub when the drafter is pushed: the Hub id (or folder) holding the drafter weights.
DRAFTER = "__DSPARK_DRAFTER__"

# generate() arguments this recipe cannot honour; each must be left unset.
_UNSUPPORTED_ARGUMENTS = ("logits_processor", "prefix_allowed_tokens_fn", "assistant_model", "streamer",
                          "negative_prompt_ids", "negative_prompt_attention_mask")  # fmt: skip
# Generation options whose non-neutral values would change the output distribution; the neutral values are listed.
_NEUTRAL_OPTIONS = {"num_beams": (1, None), "num_return_sequences": (1, None), "repetition_penalty": (1.0, None),
                    "no_repeat_ngram_size": (0, None), "bad_words_ids": (None,), "min_new_tokens": (0, None),
                    "min_length": (0, None), "typical_p": (1.0, None), "min_p": (0.0, None),
                    "epsilon_cutoff": (0.0, None), "eta_cutoff": (0.0, None), "suppress_tokens": (None,),
                    "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
                    "sequence_bias": (None,), "exponential_decay_length_penalty": (None,),
                    "guidance_scale": (None, 1.0), "watermarking_config": (None,), "renormalize_logits": (False, None),
                    "return_dict_in_generate": (False, None), "output_scores": (False, None),
                    "output_logits": (False, None)}  # fmt: skip
_LOADED: dict[tuple, DSparkStandaloneDrafter] = {}
# target cache -> (drafter, its context K/V per layer, the first and the end position they cover: the cache's length
# when the call that filled it returned): the next call on that cache (a chat's next turn) drafts from the whole
# conversation. Freed with the cache.
_CONTEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def generate(model, inputs=None, input_ids=None, attention_mask=None, generation_config=None, dspark_drafter=None,
             dspark_confidence_threshold=0.0, **kwargs):  # fmt: skip
    """Speculative decoding of `model` (the target) with this repository's DSpark drafter.

    Receives what `model.generate` received: the prompt positionally (`inputs`) or as `input_ids=`, as a tokenizer's
    `**inputs` pass it.

    Args:
        model: the target, a `transformers` causal LM the drafter was trained for.
        inputs / input_ids (`torch.LongTensor` of shape `(1, seq)`): the prompt (no padding); give one of them.
        attention_mask (`torch.LongTensor` of shape `(1, seq)`, *optional*): all ones (no padding).
        generation_config / kwargs: as for `model.generate` (`max_new_tokens`, `do_sample`, `temperature`, ...).
        dspark_drafter (`str`, *optional*): folder or Hub id of the drafter; defaults to this repository.
        dspark_confidence_threshold (`float`, *optional*): per-slot confidence cut-off (0 = always full blocks).

    Returns:
        `torch.LongTensor` of shape `(1, seq + new)`: prompt and generated tokens, like `model.generate`.
    """
    if inputs is not None and input_ids is not None:
        raise ValueError("Both `inputs` and `input_ids` were passed; pass the prompt once.")
    input_ids = inputs if inputs is not None else input_ids
    _check_prompt(input_ids, attention_mask)
    tokenizer = kwargs.pop("tokenizer", None)
    criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
    cache = _prefilled_cache(kwargs, input_ids)
    config = _generation_config(model, generation_config, kwargs)
    if config.stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: pass tokenizer=... to generate as well.")
        criteria.append(StopStringCriteria(tokenizer, config.stop_strings))
    drafter = load_drafter(dspark_drafter or DRAFTER, model)
    return speculative_generate(model, drafter, input_ids, config, dspark_confidence_threshold, criteria, cache)


def _prefilled_cache(kwargs, input_ids):
    """The target cache of an earlier call passed as `cache` (or `past_key_values`), holding the first positions of
    `input_ids` (a chat's earlier turns), or `None`. The loop continues it in place, as `model.generate` does."""
    cache = kwargs.pop("cache", None)
    legacy = kwargs.pop("past_key_values", None)
    cache = cache if cache is not None else legacy
    if cache is not None and cache.get_seq_length() >= input_ids.shape[1]:
        raise ValueError(
            f"The cache holds {cache.get_seq_length()} positions, the whole prompt of {input_ids.shape[1]} tokens; "
            "its last token must be uncached: pass input_ids with the new turn appended, or crop the cache by one."
        )
    return cache


def _check_prompt(input_ids, attention_mask) -> None:
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        shape = None if input_ids is None else tuple(input_ids.shape)
        raise ValueError(f"DSpark custom_generate decodes one prompt at a time: input_ids (1, seq), got {shape}.")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but the prompt {tuple(input_ids.shape)}; pass the "
            "tokenizer's input_ids and attention_mask together."
        )
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("The attention_mask has padding; pass the prompt without padding (batch size 1).")


def _generation_config(model, generation_config, kwargs):
    """The call's generation config, resolved as `model.generate` resolves it; refuses options it cannot honour."""
    used = [name for name in _UNSUPPORTED_ARGUMENTS if kwargs.pop(name, None) is not None]
    for name in ("synced_gpus", "use_model_defaults", "custom_generate", "use_cache"):
        kwargs.pop(name, None)
    # The same precedence as generate(): call kwargs > generation_config > model.generation_config > global defaults.
    config, unknown = model._prepare_generation_config(generation_config, **kwargs)
    used += [name for name, neutral in _NEUTRAL_OPTIONS.items() if getattr(config, name, None) not in neutral]
    if used or unknown:
        raise ValueError(
            f"The DSpark custom_generate recipe does not support {sorted(used + list(unknown))}. It implements greedy "
            "and sampled decoding with temperature / top_k / top_p, batch size 1. Install dspark-hf for the full "
            "generate() integration (`target.generate(..., assistant_model=drafter)`)."
        )
    return config


def _warpers(config) -> LogitsProcessorList:
    """The sampling transforms applied identically to target and draft logits (empty for greedy decoding)."""
    warpers = LogitsProcessorList()
    if not config.do_sample:
        return warpers
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k:
        warpers.append(TopKLogitsWarper(config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(config.top_p))
    return warpers


# --- the drafter -----------------------------------------------------------------------------------------------------


def _rms_norm(states, weight, eps, gemma: bool):
    """RMSNorm as each family computes it (Qwen3 scales after casting back, Gemma4 in fp32; no weight = no scale)."""
    normed = states.float() * torch.rsqrt(states.float().pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return normed.to(states.dtype)
    if gemma:
        return (normed * weight.float()).to(states.dtype)
    return weight * normed.to(states.dtype)


def _rotate(states, cos, sin):
    """Rotate-half RoPE on `(heads, seq, head_dim)` states with `(seq, head_dim)` cos/sin."""
    half = states.shape[-1] // 2
    rotated = torch.cat([-states[..., half:], states[..., :half]], dim=-1)
    return states * cos + rotated * sin


class DSparkStandaloneDrafter:
    """A DSpark drafter (``Qwen3DSparkModel`` or ``Gemma4DSparkModel``) run from its raw tensors.

    Keeps the post-RoPE context keys/values of every committed position; each `propose` call projects only the
    newly committed target features, then drafts one block.
    """

    def __init__(self, folder: str, device, dtype):
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
            self.config = json.load(handle)
        self.gemma = (self.config.get("architectures") or [""])[0] == "Gemma4DSparkModel"
        self.weights = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
                        for k, v in _load_tensors(folder).items()}
        self.rotary = _rotary_embedding(folder, self.gemma).to(device)
        config = self.config
        self.eps = config["rms_norm_eps"]
        self.num_layers = config["num_hidden_layers"]
        self.block_size = config["block_size"]
        k_eq_v = self.gemma and config.get("attention_k_eq_v", False)
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config["num_global_key_value_heads"] if k_eq_v else config["num_key_value_heads"]
        self.head_dim = config["global_head_dim"] if self.gemma else config["head_dim"]
        self.scaling = 1.0 if self.gemma else self.head_dim**-0.5
        self.act = ACT2FN[config.get("hidden_activation") or config.get("hidden_act")]
        self.context = [[None, None] for _ in range(self.num_layers)]
        self.context_length = 0

    def w(self, name):
        return self.weights.get(name)

    def _linear(self, states, name):
        return torch.nn.functional.linear(states, self.weights[name + ".weight"], self.w(name + ".bias"))

    def _norm(self, states, name):
        return _rms_norm(states, self.w(name + ".weight") if name else None, self.eps, self.gemma)

    def _positions(self, states, positions):
        if self.gemma:
            return self.rotary(states[None], positions[None], "full_attention")
        return self.rotary(states[None], positions[None])

    def _key_values(self, layer, states, cos, sin):
        """`(seq, hidden)` states -> rotated keys and values `(kv_heads, seq, head_dim)`."""
        prefix = f"layers.{layer}.self_attn."
        raw_keys = self._linear(states, prefix + "k_proj").view(states.shape[0], -1, self.head_dim)
        has_v_proj = prefix + "v_proj.weight" in self.weights
        raw_values = self._linear(states, prefix + "v_proj").view_as(raw_keys) if has_v_proj else raw_keys
        keys = self._norm(raw_keys, prefix + "k_norm").transpose(0, 1)
        values = raw_values.transpose(0, 1)
        if self.gemma:
            values = self._norm(values, None)
        return _rotate(keys, cos, sin), values

    def extend_context(self, features, first_position):
        """Appends the K/V of `(n, m * hidden)` target features at positions `first_position...` to every layer."""
        if features.shape[0] == 0:
            return
        context = self._norm(self._linear(features.to(self.weights["fc.weight"].dtype), "fc"), "hidden_norm")
        positions = torch.arange(first_position, first_position + features.shape[0], device=features.device)
        cos, sin = (t[0] for t in self._positions(context, positions))
        for layer, cached in enumerate(self.context):
            keys, values = self._key_values(layer, context, cos, sin)
            cached[0] = keys if cached[0] is None else torch.cat([cached[0], keys], dim=1)
            cached[1] = values if cached[1] is None else torch.cat([cached[1], values], dim=1)
        self.context_length = first_position + features.shape[0]

    def _attention(self, layer, states, cos, sin):
        prefix = f"layers.{layer}.self_attn."
        queries = self._linear(states, prefix + "q_proj").view(states.shape[0], -1, self.head_dim)
        queries = _rotate(self._norm(queries, prefix + "q_norm").transpose(0, 1), cos, sin)
        keys, values = self._key_values(layer, states, cos, sin)
        cached_keys, cached_values = self.context[layer]
        if cached_keys is not None:
            keys, values = torch.cat([cached_keys, keys], dim=1), torch.cat([cached_values, values], dim=1)
        groups = self.num_heads // self.num_kv_heads
        keys, values = keys.repeat_interleave(groups, dim=0), values.repeat_interleave(groups, dim=0)
        # Not causal: every block slot sees the whole committed context and every other slot.
        output = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, scale=self.scaling)
        return self._linear(output.transpose(0, 1).reshape(states.shape[0], -1), prefix + "o_proj")

    def _layer(self, layer, states, cos, sin):
        prefix = f"layers.{layer}."
        attended = self._attention(layer, self._norm(states, prefix + "input_layernorm"), cos, sin)
        if not self.gemma:
            states = states + attended
            return states + self._mlp(layer, self._norm(states, prefix + "post_attention_layernorm"))
        states = states + self._norm(attended, prefix + "post_attention_layernorm")
        mlp = self._mlp(layer, self._norm(states, prefix + "pre_feedforward_layernorm"))
        states = states + self._norm(mlp, prefix + "post_feedforward_layernorm")
        return states * self.weights[prefix + "layer_scalar"]

    def _mlp(self, layer, states):
        prefix = f"layers.{layer}.mlp."
        gated = self.act(self._linear(states, prefix + "gate_proj")) * self._linear(states, prefix + "up_proj")
        return self._linear(gated, prefix + "down_proj")

    def block(self, anchor, anchor_position):
        """Final-normed hidden states `(B, hidden)` and base logits `(B, vocab)` for ``[anchor, mask * (B-1)]``."""
        start = torch.tensor([anchor_position], device=anchor.device)
        ids, positions = block_inputs(anchor.view(1), start, self.block_size, self.config["mask_token_id"])
        states = torch.nn.functional.embedding(ids[0], self.weights["embed_tokens.weight"])
        if self.gemma:
            states = states * torch.tensor(self.config["hidden_size"] ** 0.5, dtype=states.dtype)
        cos, sin = (t[0] for t in self._positions(states, positions[0]))
        for layer in range(self.num_layers):
            states = self._layer(layer, states, cos, sin)
        hidden = self._norm(states, "norm")
        logits = self._linear(hidden, "lm_head").float()
        cap = self.config.get("final_logit_softcapping") if self.gemma else None
        return hidden, self._to_target(torch.tanh(logits / cap) * cap if cap else logits, float("-inf"))

    def _to_target(self, logits, fill):
        """Scatters draft-vocabulary scores into the target vocabulary (`d2t` offsets; reduced vocabularies only)."""
        if "d2t" not in self.weights:
            return logits
        ids = torch.arange(self.weights["d2t"].shape[0], device=logits.device) + self.weights["d2t"].to(logits.device)
        full = logits.new_full((*logits.shape[:-1], self.config["vocab_size"]), fill)
        return full.index_copy_(-1, ids, logits)

    def corrected_logits(self, logits, previous, hidden, state=None):
        """One slot's logits `(rows, vocab)` plus the Markov bias given the previous tokens `(rows,)` and the slot's
        hidden states `(rows, hidden)`; returns `(logits, state)`, `state` being the rnn head's (None elsewhere)."""
        if not self.config.get("markov_rank"):
            return logits, None
        embedding = self.weights["markov_head.markov_w1.weight"][previous]
        head_type = self.config.get("markov_head_type", "vanilla")
        if head_type == "gated":
            gate = torch.sigmoid(self._linear(torch.cat([hidden, embedding], dim=-1), "markov_head.gate_proj"))
            embedding = gate * embedding
        elif head_type == "rnn":
            state = torch.zeros_like(embedding) if state is None else state
            joint = self._linear(torch.cat([state, embedding, hidden], dim=-1), "markov_head.joint_proj")
            gate, candidate, out = joint.chunk(3, dim=-1)
            state = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(candidate)
            embedding = torch.tanh(out)
        return logits + self._to_target(self._linear(embedding, "markov_head.markov_w2").float(), 0.0), state

    def confidence_logits(self, hidden, previous):
        """Raw confidence logits `(rows,)` of slots with hidden states `(rows, hidden)` after the tokens `previous`
        `(rows,)`; None without a confidence head."""
        if not self.config.get("enable_confidence_head"):
            return None
        features = hidden
        if self.config.get("confidence_head_with_markov") and self.config.get("markov_rank"):
            embedding = self.weights["markov_head.markov_w1.weight"][previous].to(hidden.dtype)
            features = torch.cat([hidden, embedding], dim=-1)
        return self._linear(features, "confidence_head.proj").squeeze(-1).float()

    def calibrated_confidence(self, logits, slot):
        """The probability that this slot's draft is accepted (Sequential Temperature Scaling, if calibrated)."""
        temperatures = self.config.get("confidence_temperatures")
        return torch.sigmoid(logits / (temperatures[slot] if temperatures else 1.0))


def _load_tensors(folder):
    index = os.path.join(folder, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_file(os.path.join(folder, "model.safetensors"))
    with open(index, encoding="utf-8") as handle:
        files = sorted(set(json.load(handle)["weight_map"].values()))
    tensors = {}
    for file in files:
        tensors.update(load_file(os.path.join(folder, file)))
    return tensors


def _rotary_embedding(folder, gemma):
    """transformers' own RoPE module for the drafter's config (Gemma4: the full-attention parameters)."""
    config = AutoConfig.from_pretrained(folder)
    if gemma:
        from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

        return Gemma4TextRotaryEmbedding(config)
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    return Qwen3RotaryEmbedding(config)


def load_drafter(reference, model) -> DSparkStandaloneDrafter:
    """The drafter at `reference` (folder or Hub id), on the target's device and dtype, checked against `model`."""
    if reference == "__DSPARK" + "_DRAFTER__":
        raise ValueError("This generate.py was not written by dspark_hf.hub; pass dspark_drafter='<folder or repo>'.")
    embedding = model.get_input_embeddings().weight
    key = (reference, str(embedding.device), embedding.dtype)
    if key not in _LOADED:
        folder = reference
        if not os.path.isdir(reference):
            from huggingface_hub import snapshot_download

            folder = snapshot_download(reference, allow_patterns=["config.json", "*.safetensors", "*.json"])
        _LOADED[key] = DSparkStandaloneDrafter(folder, embedding.device, embedding.dtype)
    drafter = _LOADED[key]
    _check_target(drafter.config, model)
    if drafter.gemma and tuple(int(part) for part in transformers.__version__.split(".")[:2]) < (5, 18):
        raise ValueError(f"This recipe runs Gemma4 targets with transformers >= 5.18 (installed: "
                         f"{transformers.__version__}, whose Gemma4 verification forwards fail); upgrade transformers.")
    return drafter


def _check_target(config, model) -> None:
    text_config = model.config.get_text_config()
    checks = [("hidden_size", config["hidden_size"], text_config.hidden_size),
              ("vocab_size", config["vocab_size"], model.get_output_embeddings().weight.shape[0]),
              ("num_target_layers", config.get("num_target_layers", text_config.num_hidden_layers),
               text_config.num_hidden_layers)]  # fmt: skip
    for key, ours, theirs in checks:
        if ours != theirs:
            raise ValueError(
                f"The drafter was built for a target with {key}={ours}, but this target has {theirs}; "
                "use the drafter trained for this model."
            )


# --- the decoding loop ----------------------------------------------------------------------------------------------


def _target_forward(model, input_ids, cache):
    cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(input_ids=input_ids, use_cache=True, output_hidden_states=True, **{cache_argument: cache})


def _features(hidden_states, layer_ids):
    """`(seq, m * hidden)`: the raw outputs of the target layers `layer_ids` (HF index i + 1 is layer i's output)."""
    return torch.cat([hidden_states[i + 1][0] for i in layer_ids], dim=-1)


def _policy(drafter, threshold):
    """`dspark_confidence_threshold` as a verification policy: a block ends at its first draft whose confidence is
    below it (0, or a drafter without confidence head: full blocks)."""
    if threshold > 0 and drafter.config.get("enable_confidence_head"):
        return ThresholdPolicy(threshold)
    return FullBlockPolicy()


def _propose(drafter, sequence, budget, warpers, do_sample, policy):
    """Drafts up to `budget` tokens after `sequence` `(1, seq)` (`sample_drafts`: ``z_k = U_k + bias(x_{k-1})``,
    warped, then argmax or a sample, `policy` deciding slot by slot); returns the drafts, the `(L, vocab)`
    distributions they were drawn from and the round's outcome so far (`None` when the drafter did not run)."""
    if budget <= 0 or not policy.begin_round([None], drafter.block_size):
        return [], None, None
    hidden, logits = drafter.block(sequence[0, -1], sequence.shape[1] - 1)

    def process(drafts, scores):
        return warpers(torch.cat([sequence, drafts.to(sequence.device)], dim=-1), scores) if warpers else scores

    block = sample_drafts(drafter, hidden[None], logits[None], sequence[:, -1], [budget], policy,
                          num_slots=policy.num_slots(drafter.block_size, [budget]), process=process,
                          do_sample=do_sample)  # fmt: skip
    length = block.lengths[0]
    outcome = RoundOutcome(block.confidences, [length], [0], observed=block.observed)
    return block.ids[0, :length].tolist(), (block.logits[0, :length].softmax(dim=-1) if length else None), outcome


@torch.no_grad()
def speculative_generate(model, drafter, input_ids, config, threshold=0.0, criteria=None, cache=None):
    """The draft-verify loop (spec 3.6), batch 1. Returns `(1, seq + new)` token ids. `criteria` (stopping criteria
    of the tokens) end it at the first token after which they stop. `cache`, the target's cache of an earlier call
    holding the prompt's first positions, is continued (the drafter then drafts from the positions after them, whose
    target features this call computes); it ends holding every returned position but the last."""
    layer_ids = drafter.config["target_layer_ids"]
    warpers, do_sample = _warpers(config), bool(config.do_sample)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    limit = config.max_length if config.max_new_tokens is None else input_ids.shape[1] + config.max_new_tokens
    cache = DynamicCache(config=model.config) if cache is None else cache
    cached = cache.get_seq_length()
    _restore_context(drafter, cache, cached)
    policy = _policy(drafter, threshold)
    policy.reset()
    output = _target_forward(model, input_ids[:, cached:], cache)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()  # lets sliding-window layers roll back rejected drafts
    features = _features(output.hidden_states, layer_ids)
    first_logits = output.logits[:, -1].float()
    token = int(pick_tokens(warpers(input_ids, first_logits) if warpers else first_logits, do_sample)[0])
    sequence = torch.cat([input_ids, input_ids.new_tensor([[token]])], dim=-1)
    stopped = first_stop(criteria, sequence, input_ids.shape[1]) is not None
    while sequence.shape[1] < limit and token not in eos and not stopped:
        drafter.extend_context(features, drafter.context_length)
        drafts, draft_probs, outcome = _propose(drafter, sequence, limit - sequence.shape[1] - 1, warpers, do_sample,
                                                policy)  # fmt: skip
        verify_ids = torch.cat([sequence[:, -1:], sequence.new_tensor([drafts]).view(1, -1)], dim=-1)
        output = _target_forward(model, verify_ids, cache)
        target_logits = output.logits[0].float()
        if warpers:
            target_logits = torch.cat([warpers(sequence, row[None]) for row in target_logits])
        accepted, token = verify(drafts, draft_probs, target_logits, target_logits.softmax(dim=-1), do_sample)
        outcome = outcome or RoundOutcome([[]], [0], [0], drafted=False)
        outcome.accepted = [accepted]
        policy.end_round(outcome)
        committed = drafts[:accepted] + [token]
        if any(t in eos for t in committed):
            committed = committed[: next(i for i, t in enumerate(committed) if t in eos) + 1]
            token = committed[-1]
        drop_last(cache, len(drafts) - accepted)
        features = _features(output.hidden_states, layer_ids)[: accepted + 1]
        length, sequence = sequence.shape[1], torch.cat([sequence, sequence.new_tensor([committed])], dim=-1)
        stop = first_stop(criteria, sequence, length)  # the first prefix of the round after which they stop
        if stop is not None:
            sequence, stopped = sequence[:, :stop], True
    sequence = sequence[:, :limit]
    cut_cache(cache, sequence.shape[1])  # an output cut inside the last round
    _keep_context(drafter, cache, features)
    return sequence


def _restore_context(drafter, cache, cached):
    """Gives `drafter` the context it left beside `cache` in the call that filled it, cut to the `cached` positions
    the cache still holds (a cropped cache); else (a new cache, another drafter, a cache extended elsewhere) an empty
    one that starts after them, as their target features are not computed in this call."""
    try:
        saved = _CONTEXTS.pop(cache, None)
    except TypeError:  # a cache class that cannot be a dictionary key
        saved = None
    if saved is not None and saved[0] is drafter and saved[2] <= cached <= saved[3]:
        keep = cached - saved[2]
        drafter.context = [[keys[:, :keep], values[:, :keep]] for keys, values in saved[1]]
    else:
        drafter.context = [[None, None] for _ in range(drafter.num_layers)]
    drafter.context_length = cached


def _keep_context(drafter, cache, features):
    """Keeps the drafter's context beside `cache` for the next call, its last round's features included, cut to the
    positions the cache holds."""
    drafter.extend_context(features, drafter.context_length)
    length = cache.get_seq_length()
    if drafter.context[0][0] is None or drafter.context_length < length:
        return
    start = drafter.context_length - drafter.context[0][0].shape[1]  # 0 unless the call began on a cache it never saw
    keep = length - start
    context = [[keys[:, :keep], values[:, :keep]] for keys, values in drafter.context]
    try:
        _CONTEXTS[cache] = (drafter, context, start, length)
    except TypeError:  # a cache class that cannot be a dictionary key
        pass
