"""Target signals for training: the features the drafter reads and the target's final hidden state.

Online training runs the frozen target inside each step (`torch.no_grad`). Only its base model runs: the target's
LM head is never applied to the whole sequence; the trainer applies the drafter's frozen copy of it at the
supervised positions only. A [`FeatureCache`] stores the signals on disk so that later epochs skip the target.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from .. import _transformers_compat
from ..configuration_dspark import hidden_state_indices


@dataclass
class TargetSignals:
    """
    context_features (`torch.Tensor` of shape `(batch, seq, len(target_layer_ids) * hidden)`): raw outputs of the
        target layers `target_layer_ids` (HF ``hidden_states[i + 1]``), concatenated.
    last_hidden_state (`torch.Tensor` of shape `(batch, seq, hidden)`): the target's final-normed last hidden state
        (HF ``hidden_states[-1]``); the target's logits are ``lm_head(last_hidden_state)``.
    """

    context_features: torch.Tensor
    last_hidden_state: torch.Tensor


@torch.no_grad()
def compute_target_signals(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    target_layer_ids: list[int],
) -> TargetSignals:
    """Runs the target's base model once on a right-padded batch.

    Args:
        target ([`PreTrainedModel`]): a causal LM; its base model (`target.base_model`) is what runs.
        input_ids (`torch.LongTensor` of shape `(batch, seq)`), attention_mask (`torch.Tensor`, *optional*).
        target_layer_ids (`list[int]`): 0-based layers (-1 = embedding output).
    """
    indices = hidden_state_indices(target_layer_ids)
    request = _transformers_compat.hidden_states_request(indices)
    outputs = target.base_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=request)
    layers = _transformers_compat.select_hidden_states(outputs.hidden_states, indices, request)
    if any(layer is None for layer in layers):
        raise RuntimeError(
            f"{type(target).__name__} did not return hidden states {indices} (needed for target_layer_ids="
            f"{target_layer_ids}); it must support `output_hidden_states`."
        )
    return TargetSignals(torch.cat(layers, dim=-1), outputs.last_hidden_state)


class FeatureCache:
    """On-disk cache of [`TargetSignals`], one safetensors file per sequence, keyed by a hash of its token ids.

    The folder records the target and layers it was made for and refuses to serve another combination.

    Args:
        directory (`str`): the cache folder (created).
        fingerprint (`dict`): what the cached signals depend on (target name, `target_layer_ids`, dtype).
        dtype (`torch.dtype`): storage dtype (`torch.float32` keeps training identical to online training).
    """

    INFO_FILE = "cache_info.json"

    def __init__(self, directory: str | os.PathLike, fingerprint: dict, dtype: torch.dtype = torch.float32):
        self.directory = Path(directory)
        self.dtype = dtype
        self.directory.mkdir(parents=True, exist_ok=True)
        info_path = self.directory / self.INFO_FILE
        fingerprint = {**fingerprint, "dtype": str(dtype)}
        if info_path.exists():
            existing = json.loads(info_path.read_text())
            if existing != fingerprint:
                raise ValueError(
                    f"The feature cache at {self.directory} was made for {existing}, not {fingerprint}. "
                    "Use another --feature_cache folder (or delete this one)."
                )
        else:
            info_path.write_text(json.dumps(fingerprint, indent=2))

    @staticmethod
    def key(token_ids: torch.Tensor) -> str:
        return hashlib.sha1(token_ids.detach().cpu().to(torch.int64).numpy().tobytes()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.safetensors"

    def get(self, token_ids: torch.Tensor) -> TargetSignals | None:
        """The cached signals of one unpadded sequence `(seq,)`, each `(seq, ...)`, or `None`."""
        path = self._path(self.key(token_ids))
        if not path.exists():
            return None
        tensors = load_file(path)
        return TargetSignals(tensors["context_features"], tensors["last_hidden_state"])

    def put(self, token_ids: torch.Tensor, signals: TargetSignals) -> None:
        """Stores the signals `(seq, ...)` of one unpadded sequence (atomically: safe with several ranks)."""
        path = self._path(self.key(token_ids))
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tensors = {
            "context_features": signals.context_features.detach().to("cpu", self.dtype).contiguous(),
            "last_hidden_state": signals.last_hidden_state.detach().to("cpu", self.dtype).contiguous(),
        }
        save_file(tensors, str(tmp))
        os.replace(tmp, path)


class TargetSignalProvider:
    """Gives the [`TargetSignals`] of a right-padded batch: from the cache when every sequence is in it, else from
    the target (and then fills the cache).

    Args:
        target ([`PreTrainedModel`]): the frozen target.
        target_layer_ids (`list[int]`): the drafter's `config.target_layer_ids`.
        cache ([`FeatureCache`], *optional*).
    """

    def __init__(self, target: PreTrainedModel, target_layer_ids: list[int], cache: FeatureCache | None = None):
        self.target = target
        self.target_layer_ids = list(target_layer_ids)
        self.cache = cache

    def __call__(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor) -> TargetSignals:
        lengths = attention_mask.sum(dim=-1).tolist()
        sequences = [input_ids[row, :length] for row, length in enumerate(lengths)]
        if self.cache is not None:
            cached = [self.cache.get(sequence) for sequence in sequences]
            if all(item is not None for item in cached):
                return _pad_signals(cached, input_ids.shape[1], input_ids.device, self.target.dtype)
        signals = compute_target_signals(self.target, input_ids, attention_mask, self.target_layer_ids)
        if self.cache is not None:
            for row, (sequence, length) in enumerate(zip(sequences, lengths)):
                self.cache.put(
                    sequence,
                    TargetSignals(signals.context_features[row, :length], signals.last_hidden_state[row, :length]),
                )
        return signals


def _pad_signals(items: list[TargetSignals], seq_len: int, device, dtype) -> TargetSignals:
    """Right-pads per-sequence signals `(len_i, ...)` with zeros to `(batch, seq_len, ...)`."""

    def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
        out = tensors[0].new_zeros((len(tensors), seq_len, tensors[0].shape[-1]))
        for row, tensor in enumerate(tensors):
            out[row, : tensor.shape[0]] = tensor
        return out.to(device=device, dtype=dtype)

    return TargetSignals(
        stack([item.context_features for item in items]), stack([item.last_hidden_state for item in items])
    )
