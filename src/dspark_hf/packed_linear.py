"""Linear layers whose weights are laid out once for oneDNN: the same model, faster on a CPU.

A decode step of a small model is a few hundred `torch.nn.functional.linear` calls, and verifying k drafted tokens is
the same calls with k input rows. On the project's 2-core CPUs those k-row calls cost far more than one-row ones in
float32 (a forward of 2-8 tokens 1.6-2x one token's). PyTorch's oneDNN backend, with each weight reordered once into
its blocked layout (what `torch.compile`'s CPU freezing pass emits, here without compiling), runs 1-8 rows at about
the cost of one. Measured on a 2-core AMD EPYC (SmolLM2-135M, 256-token cache, `benchmarks/results/packed-linear/`):
float32 forwards of 1 token 1.4x and of 2-8 tokens 2.0-2.6x faster, so verifying a block costs about one decode step
as in bf16; bf16 forwards 1.2-1.5x faster.

The weights are not changed, only read through a second, packed copy (memory for a second copy of the linear
weights); outputs agree with `nn.Linear`'s to rounding (another summation order). A speculative method's output is
judged against the same target's own decoding, so pack the target once, before both: then target-only decoding and
verification run the same layers.

```python
>>> import torch
>>> from dspark_hf.packed_linear import pack_linear_weights
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
>>> pack_linear_weights(model, "off")  # "auto" packs where this machine measures it faster, "on" wherever it can
0

```
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import time

import torch
from torch import nn


__all__ = ["PACKED_LINEAR_MODES", "PackedLinear", "pack_linear_weights", "is_packed", "packing_supported",
           "check_packed_linear", "real_tokens_only"]

PACKED_LINEAR_MODES = ("auto", "on", "off")
# dtypes oneDNN packs on every x86 CPU torch supports (float16 needs AVX512-FP16 or AMX-FP16)
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# "auto" packs when the packed layers take at most this fraction of the default layers' time
_AUTO_MAX_RATIO = 0.95
_AUTO_DECISIONS: dict[tuple, bool] = {}
# `real_tokens_only`: skipped when fewer than this fraction of a forward's tokens are padding (the gather and scatter
# around each layer have a cost of their own: a prefill of 4 prompts with 15% padding took 0.95x the padded time in
# float32 but 1.06x in bf16, one of 16 with 25% 0.87x and 0.92x; `benchmarks/results/ragged-verification/`)
RAGGED_MIN_PADDING = 0.2


class _RealTokens:
    """The positions a forward computes in [`real_tokens_only`]: flat indices into (rows x width) inputs."""

    def __init__(self, mask: torch.Tensor):
        self.index = mask.reshape(-1).nonzero().squeeze(1)
        self.shape = tuple(mask.shape)

    def gather(self, input: torch.Tensor) -> torch.Tensor:
        # every layer gathers its own input: q/k/v read one tensor, but a model may change a tensor in place between
        # two layers' calls, and a gather is a small copy next to the layer
        return input.reshape(-1, input.shape[-1]).index_select(0, self.index.to(input.device))

    def scatter(self, rows: torch.Tensor) -> torch.Tensor:
        full = rows.new_zeros(math.prod(self.shape), rows.shape[-1])
        return full.index_copy_(0, self.index.to(rows.device), rows).view(*self.shape, rows.shape[-1])


_REAL_TOKENS: contextvars.ContextVar[_RealTokens | None] = contextvars.ContextVar("dspark_real_tokens", default=None)


@contextlib.contextmanager
def real_tokens_only(mask: torch.Tensor | None):
    """Inside the block, [`PackedLinear`] layers whose input is `mask`-shaped (rows, width, features) compute only the
    positions where `mask` is true and give zeros at the others (padding): what ragged batching does in serving engines,
    for the linear layers, where a CPU forward spends most of its time (attention still runs padded).

    A batch of left-padded prompts, or a verification round whose rows verify different numbers of drafts, then costs
    what its real tokens cost: a prefill of 32 gsm8k / humaneval prompts (3,951 tokens padded to 10,048) took 0.62x
    the padded time in float32 on a 2-core EPYC, a round where 8 of 32 rows verify 5 tokens 0.72x
    (`benchmarks/results/ragged-verification/`). A real token's outputs are computed by the same kernel on the same
    weights, only in a shorter batch: they matched the padded forward's bitwise there, in float32 and bf16. Skipped
    (`mask` `None`, or under `RAGGED_MIN_PADDING` of it padding) where it would not pay; layers that are not packed are
    unaffected.

    ```python
    >>> import torch
    >>> from dspark_hf.packed_linear import pack_linear_weights, real_tokens_only
    >>> layer = torch.nn.Linear(4, 2)
    >>> pack_linear_weights(layer, "on")
    1
    >>> mask = torch.tensor([[False, True, True]])  # one left-padded row of 3 positions
    >>> with torch.no_grad():
    ...     with real_tokens_only(mask):
    ...         out = layer(torch.ones(1, 3, 4))
    ...     real = layer(torch.ones(1, 2, 4))  # the real tokens alone
    >>> out[0, 0].tolist(), torch.equal(out[0, 1:], real[0])
    ([0.0, 0.0], True)

    ```
    """
    mask = None if mask is None else mask.bool()  # an attention mask of 0/1 integers too
    if mask is None or mask.dim() != 2 or (~mask).sum().item() < RAGGED_MIN_PADDING * mask.numel():
        yield
        return
    token = _REAL_TOKENS.set(_RealTokens(mask))
    try:
        yield
    finally:
        _REAL_TOKENS.reset(token)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def _packed_linear(input: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(input, packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose inference forwards read a oneDNN-packed copy of its weight (made on first use, remade
    when the weight changes). Forwards that autograd records, under autocast, or on another device run
    `nn.Linear`'s own. Inside [`real_tokens_only`] it computes only a batch's real tokens. Made by
    [`pack_linear_weights`], which turns `nn.Linear` layers into this class in place."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (input.device.type != "cpu" or input.dtype != weight.dtype or torch.is_autocast_enabled("cpu")
                or (torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad))):
            return super().forward(input)
        # (inference tensors keep no version counter: a weight made under inference_mode is repacked when replaced)
        version = 0 if weight.is_inference() else weight._version
        key = (weight.data_ptr(), version, weight.dtype, tuple(weight.shape))
        if getattr(self, "_packed_key", None) != key:
            self._packed_weight, self._packed_key = _pack(weight), key
        tokens = _REAL_TOKENS.get()
        if tokens is not None and tuple(input.shape[:-1]) == tokens.shape:
            return tokens.scatter(_packed_linear(tokens.gather(input), self._packed_weight, self.bias))
        return _packed_linear(input, self._packed_weight, self.bias)

    def __getstate__(self):
        # the packed copy is an opaque oneDNN tensor that cannot be copied or saved: dropped, remade on first use
        state = dict(super().__getstate__())
        state.pop("_packed_weight", None)
        state.pop("_packed_key", None)
        return state


def packing_supported(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether this torch build packs linear weights of `dtype` on `device` (CPUs with PyTorch's oneDNN backend)."""
    return torch.device(device).type == "cpu" and _packs(dtype)


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    if dtype not in _PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ones(4, 4, dtype=dtype)
        out = _packed_linear(torch.ones(2, 4, dtype=dtype), _pack(weight), None)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool((out == 4).all())


def is_packed(model: nn.Module) -> bool:
    """Whether `model` has layers packed by [`pack_linear_weights`] (its speed profiles record this)."""
    return any(isinstance(module, PackedLinear) for module in model.modules())


def _linears(model: nn.Module, cls: type) -> list[nn.Linear]:
    return [module for module in model.modules() if type(module) is cls]


def _set_class(layers: list[nn.Linear], cls: type) -> None:
    for layer in layers:
        layer.__class__ = cls
        if cls is nn.Linear:
            for name in ("_packed_weight", "_packed_key"):
                layer.__dict__.pop(name, None)


def _time_layers(layers: list[nn.Linear], rows: int, repeats: int = 3) -> float:
    """Seconds of one pass of `rows` input rows through every layer (the fastest of `repeats`), as the weights are
    read in a forward: one after another, most of them out of cache."""
    inputs = {layer.in_features: torch.randn(rows, layer.in_features, dtype=layer.weight.dtype)
              for layer in layers}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for layer in layers:
                layer(inputs[layer.in_features])
            best = min(best, time.perf_counter() - start)
    return best


def _packing_pays(layers: list[nn.Linear]) -> bool:
    """Times the model's own layers at 1 and 4 input rows (a decode step and a verification), packed and not,
    interleaved, after one untimed pass of each (first calls include oneDNN's set-up for each shape; in bf16 on a
    2-core EPYC, where packed layers are near the line at one row, that once tipped `auto` to unpacked): whether packed
    takes at most `_AUTO_MAX_RATIO` of the time at both. Decided once per layer shapes and dtype in a process (a
    fraction of a second for a small model)."""
    key = (layers[0].weight.dtype, tuple(sorted({(l.in_features, l.out_features) for l in layers})))
    if key not in _AUTO_DECISIONS:
        totals = {"packed": [0.0, 0.0], "default": [0.0, 0.0]}
        # untimed: oneDNN's first call at each shape (switching back to `nn.Linear` drops the packed copies; the
        # timed passes remake them in their first repeat, which best-of-`repeats` leaves out)
        for cls in (nn.Linear, PackedLinear):
            _set_class(layers, cls)
            for rows in (1, 4):
                _time_layers(layers, rows, repeats=1)
        for _ in range(2):
            for variant, cls in (("default", nn.Linear), ("packed", PackedLinear)):
                _set_class(layers, cls)
                for index, rows in enumerate((1, 4)):
                    totals[variant][index] += _time_layers(layers, rows)
        _set_class(layers, nn.Linear)
        _AUTO_DECISIONS[key] = all(p <= _AUTO_MAX_RATIO * d for p, d in zip(totals["packed"], totals["default"]))
    return _AUTO_DECISIONS[key]


def check_packed_linear(mode: str) -> str:
    """`mode` if it names a packed-linear setting ("auto", "on", "off"), else a one-line error."""
    if mode not in PACKED_LINEAR_MODES:
        raise ValueError(f"Unknown packed_linear {mode!r}; choose one of {list(PACKED_LINEAR_MODES)} (auto: packed "
                         "oneDNN weights where this CPU runs them faster).")
    return mode


def pack_linear_weights(model: nn.Module, mode: str = "auto") -> int:
    """Turns the `nn.Linear` layers of `model` into [`PackedLinear`] layers in place (inference only: training and
    autocast forwards run as before); returns how many layers are packed afterwards.

    Args:
        model (`nn.Module`): a model on the CPU (a target, a drafter); other devices are left as they are.
        mode (`str`, defaults to `"auto"`): `"auto"` packs where this machine computes the model's own layers faster
            packed (timed once per process, at 1 and 4 rows); `"on"` packs wherever torch can; `"off"` undoes
            packing.
    """
    if check_packed_linear(mode) == "off":
        _set_class(_linears(model, PackedLinear), nn.Linear)
        return 0
    layers = [layer for layer in _linears(model, nn.Linear)
              if packing_supported(layer.weight.dtype, layer.weight.device)]
    if layers and (mode == "on" or _packing_pays(layers)):
        _set_class(layers, PackedLinear)
    return len(_linears(model, PackedLinear))
