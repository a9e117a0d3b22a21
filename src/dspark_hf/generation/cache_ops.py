"""Slot-level operations on `DynamicCache`s for the batched engine.

Rows of a batch accept different numbers of drafts, so the engine keeps one shared slot axis: every verification
forward appends the same number of slots to every row, and a boolean `slot_mask` says which slots hold committed
tokens (rejected drafts and padding become masked holes). These helpers align, merge and trim such caches.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


class AppendingLayer(DynamicLayer):
    """A `DynamicLayer` that appends new slots into spare capacity instead of concatenating a new tensor every step.

    `DynamicLayer.update` copies the whole cache on every forward (`torch.cat`); with many rows that copy is a large
    part of a decode step on a CPU (it grows with rows x slots x layers, every step). Here `keys`/`values` are
    views of the first slots of a larger buffer; an update writes the new slots in place and only reallocates (with
    50% headroom) when the buffer is full or when `keys`/`values` were replaced by a tensor that is not such a view
    (the slot operations below do that; crops keep the view, and their slots are overwritten).
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = self._append("keys", key_states)
        self.values = self._append("values", value_states)
        return self.keys, self.values

    def _append(self, name: str, new: torch.Tensor) -> torch.Tensor:
        current, buffer = getattr(self, name), getattr(self, f"_{name}_buffer", None)
        length = current.shape[-2] if current.dim() == new.dim() else 0
        end = length + new.shape[-2]
        in_place = (
            buffer is not None and length > 0 and end <= buffer.shape[-2]
            and current.data_ptr() == buffer.data_ptr() and current.shape[:-2] == buffer.shape[:-2]
            and current.stride() == buffer.stride()
        )
        if not in_place:
            buffer = new.new_empty(*new.shape[:-2], end + max(64, end // 2), new.shape[-1])
            if length:
                buffer[..., :length, :] = current
            setattr(self, f"_{name}_buffer", buffer)
        buffer[..., length:end, :] = new
        return buffer[..., :end, :]


def slot_window(config) -> int | None:
    """The sliding window of `config`'s sliding-window attention layers (`None` when every layer is full attention);
    refuses cache layers the slot axis cannot carry (chunked, linear or recurrent attention).

    The slot axis keeps every layer's K/V in full ([`slot_cache`]); a sliding-window layer then needs a mask whose
    window is counted in positions, not slots (rejected drafts leave holes between positions): [`slot_masks`]."""
    layers = DynamicCache(config=config).layers
    other = sorted({type(layer).__name__ for layer in layers
                    if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer)})
    if other:
        raise ValueError(
            f"{type(config).__name__} has cache layers other than full and sliding-window attention "
            f"({', '.join(other)}), which DSpark's batched engine cannot keep on its shared slot axis. Generate one "
            "prompt at a time (batch size 1 runs in transformers' own loop)."
        )
    if not any(type(layer) is DynamicSlidingWindowLayer for layer in layers):
        return None
    return int(config.get_text_config().sliding_window)


def slot_masks(real: torch.Tensor, num_queries: int, window: int, layer_types, dtype: torch.dtype):
    """4-D additive masks for a forward over the slot axis of a model with sliding-window layers.

    `real` `(rows, slots)` marks the slots that hold tokens (committed ones, then this forward's last `num_queries`
    slots); a real slot's position is the number of real slots before it in its row. A query attends to real slots up
    to its own (causal by slot) and, in sliding-window layers, only to those fewer than `window` positions back, as
    one-token decoding would. A query always sees itself (padding queries would otherwise see nothing). Returns
    ``{layer type: mask}`` for models with `layer_types`, else the sliding mask alone."""
    slots = real.shape[1]
    positions = real.long().cumsum(dim=-1) - 1
    key_index = torch.arange(slots, device=real.device)
    query_index = key_index[slots - num_queries:]
    causal = key_index[None, :] <= query_index[:, None]
    itself = key_index[None, :] == query_index[:, None]
    allowed = real[:, None, :] & causal[None]
    near = positions[:, slots - num_queries:, None] - positions[:, None, :] < window

    def additive(mask):
        blocked = torch.full(mask.shape, torch.finfo(dtype).min, dtype=dtype, device=mask.device)
        return blocked.masked_fill(mask, 0.0)[:, None]

    sliding = additive((allowed & near) | itself[None])
    if not layer_types:
        return sliding
    masks = {"sliding_attention": sliding}
    if "full_attention" in layer_types:
        masks["full_attention"] = additive(allowed | itself[None])
    return masks


def slot_cache(config) -> DynamicCache:
    """A `DynamicCache` for `config` whose layers append in place ([`AppendingLayer`]), sliding-window ones too (they
    keep every slot; their masks apply the window, [`slot_masks`])."""
    cache = DynamicCache(config=config)
    kinds = (DynamicLayer, DynamicSlidingWindowLayer)
    cache.layers = [AppendingLayer() if type(layer) in kinds else layer for layer in cache.layers]
    return cache


def initialized_layers(cache: DynamicCache):
    """The layers of `cache` that hold K/V (a drafter's cache may have fewer layers filled than configured)."""
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0]


def pad_slots_left(cache: DynamicCache | None, num_slots: int) -> None:
    """Prepends `num_slots` empty slots to every row of `cache` (the caller masks them)."""
    if cache is None or num_slots <= 0:
        return
    for layer in initialized_layers(cache):
        for name in ("keys", "values"):
            states = getattr(layer, name)
            pad = states.new_zeros(*states.shape[:2], num_slots, states.shape[-1])
            setattr(layer, name, torch.cat([pad, states], dim=2))


def pad_mask_left(slot_mask: torch.Tensor, num_slots: int) -> torch.Tensor:
    return torch.cat([slot_mask.new_zeros(slot_mask.shape[0], max(num_slots, 0)), slot_mask], dim=1)


def drop_slots_left(cache: DynamicCache | None, num_slots: int) -> None:
    """Removes the first `num_slots` slots of every row of `cache`."""
    if cache is None or num_slots <= 0:
        return
    for layer in initialized_layers(cache):
        layer.keys = layer.keys[:, :, num_slots:]
        layer.values = layer.values[:, :, num_slots:]


def leading_holes(slot_mask: torch.Tensor) -> int:
    """How many leading slots are holes in every row (e.g. after the longest prompt finished)."""
    valid_columns = slot_mask.any(dim=0).nonzero()
    return int(valid_columns[0]) if valid_columns.numel() else slot_mask.shape[1]


def concat_rows(first: DynamicCache, second: DynamicCache) -> None:
    """Appends the rows of `second` to `first` in place; both must have the same number of slots."""
    for layer_a, layer_b in zip(first.layers, second.layers):
        if getattr(layer_a, "keys", None) is None or layer_a.keys.numel() == 0:
            layer_a.keys, layer_a.values = layer_b.keys, layer_b.values
            layer_a.is_initialized = True
            continue
        layer_a.keys = torch.cat([layer_a.keys, layer_b.keys], dim=0)
        layer_a.values = torch.cat([layer_a.values, layer_b.values], dim=0)


def compact_slots(caches: list[DynamicCache | None], slot_mask: torch.Tensor) -> torch.Tensor:
    """Squeezes the holes out of every row: each row's valid slots move, in order, to the right end of a slot axis
    as wide as the fullest row (shorter rows are left-padded with holes). Returns the new `slot_mask`.

    Valid because keys carry their rotary position already and attention ignores key order under the mask; the
    engine keeps each row's positions separately. The slots are picked by advanced indexing (whole head-dim vectors at
    a time): on a 2-core CPU about 3x faster than `gather` along the slot axis, which moves one element at a time
    (`scripts/compaction_cost.py`).
    """
    rows, width = slot_mask.shape
    kept = slot_mask.sum(dim=1)
    new_width = int(kept.max()) if rows else 0
    # Sort each row's slots holes-first, keeping order within valid slots and within holes (stable), then keep the
    # last `new_width`: exactly the valid slots, right-aligned.
    order = torch.sort(slot_mask.to(torch.int8), dim=1, stable=True).indices[:, width - new_width:]
    for cache in caches:
        if cache is None:
            continue
        for layer in initialized_layers(cache):
            layer.keys, layer.values = select_slots(layer.keys, order), select_slots(layer.values, order)
    return torch.gather(slot_mask, 1, order)


def select_slots(states: torch.Tensor, order: torch.LongTensor) -> torch.Tensor:
    """`states[r, h, order[r, j]]` for every row r, head h and j: `(rows, heads, slots, dim)` -> `(rows, heads,
    order.shape[1], dim)`, contiguous."""
    order = order.to(states.device)
    rows = torch.arange(states.shape[0], device=states.device)[:, None, None]
    heads = torch.arange(states.shape[1], device=states.device)[None, :, None]
    return states[rows, heads, order[:, None, :]]
