"""The KV cache of a batch of sequences with different lengths: preallocated slots, written in place.

Terms
-----
slot
    an index along the cache's sequence axis. Row b's committed tokens occupy slots
    ``0 .. end_b - 1`` and slot = position id: prompts are right-padded in the prefill,
    so no row has holes. Slots from ``end_b`` on are free (whatever they hold is never
    attended to before it is written again).
end (B,)
    row b's committed length: the slot and position id of its next committed token.
write slots (B, T)
    where one forward's T tokens go, per row: ``end_b + t`` for tree position t in a
    decoding step, the token's own index in the prefill.
window
    the slots one forward's queries may attend to, ``0 .. window - 1`` for every row (the
    longest row's ``end + T``); the attention reads ``window`` keys, the mask hides the
    ones a row must not see.
attention bias (B or 1, 1, T, window)
    the additive float mask handed to the model: 0 where a query may attend, the dtype's
    minimum elsewhere (:func:`attention_bias`).
compaction
    after a verification forward, each row's accepted tree nodes are moved from their tree
    slots ``end_b + path_k`` to ``end_b + k`` (:meth:`SlotCache.move`); the root is already
    at ``end_b``. One gather and one scatter over all layers, in place.
capacity
    the storage's rows and slots. Rows and slots beyond what is in use are spare; joining
    rows or longer sequences grow the storage (a copy, geometric growth), never a step.

key order
    how each head's keys lie in memory: ``"slots"``, (slots, key_dim) as the values (what SDPA
    reads fastest), or ``"dims"``, (key_dim, slots): the order vLLM's CPU attention kernel reads
    (:mod:`distill.engine.cpu.paged`). ``keys`` is always a (layers, R, heads, S, key_dim) view, so
    moves and copies are the same code for both; :attr:`SlotCache.kernel_keys` is the storage as
    the kernel takes it. Writes through the model's modules are the scatter into that view; the direct loop's
    (:mod:`distill.engine.cpu.direct`) are vLLM's cache writer on the kernel's view, which takes the packed rows
    as the products leave them.

pooled storage
    with CUDA graphs (:mod:`distill.engine.graphs`) a graph is tied to the addresses of the
    storage it writes, so a batch's cache takes its storage from a :class:`SlotPool` and gives
    it back when the cache is gone: the next batch of a fitting size writes the same memory and
    replays the graphs already recorded. A pooled storage's slots are rounded up to a power of
    two, so requests of similar lengths share one. On a CPU whose attention runs on vLLM's kernel
    the caches take their storage from a pool of one spare (slots as asked): a server's prefill
    cache, gone once its rows join the running batch, and a running cache that grew, leave their
    storage to the next prefill, which otherwise pays for fresh zeroed pages (measured:
    BENCHMARKS.md, "`distill serve` against vLLM's best configuration"). A reused storage holds
    earlier keys and values (finite numbers) in slots no row has written: the kernel never reads
    them, and the modules' attention masks them to a zero weight.

:class:`SlotCache` is a transformers :class:`~transformers.Cache` built on the public
cache-layer API: the model's attention calls ``update(keys, values, layer)``, which writes
the new keys and values at the write slots and returns the first ``window`` slots.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from distill.errors import ModelError


@dataclass(frozen=True)
class KVShape:
    """What one slot of the model's cache holds: per layer, ``heads`` keys of ``key_dim`` and values of ``value_dim``."""

    layers: int
    heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot of one row takes over all layers (keys and values)."""
        return self.layers * self.heads * (self.key_dim + self.value_dim) * torch.finfo(self.dtype).bits // 8

    @classmethod
    @torch.inference_mode()
    def of(cls, model) -> "KVShape":
        """Probe ``model`` with a one-token forward into a ``DynamicCache`` and read its layers' shapes.

        The slot cache needs the same plain full-attention layer everywhere; anything else
        (sliding-window, linear-attention or differently shaped layers) is a clear error.
        """
        p = next(model.parameters())
        cache = DynamicCache(config=model.config)  # the layer types the model asks for
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=p.device), past_key_values=cache, use_cache=True)
        shapes = set()
        for i, layer in enumerate(cache.layers):
            if type(layer) is not DynamicLayer or getattr(layer, "is_sliding", False):
                raise ModelError(f"layer {i} caches with {type(layer).__name__}: the engine needs plain full-attention layers "
                                 "(sliding-window and linear-attention models are not supported)")
            shapes.add((layer.keys.shape[1], layer.keys.shape[3], layer.values.shape[3], layer.keys.dtype))
        if len(shapes) != 1:
            raise ModelError(f"the model's attention layers cache different shapes {sorted(map(str, shapes))}: "
                             "the engine's slot cache needs one shape for all layers")
        heads, kd, vd, dtype = shapes.pop()
        return cls(len(cache.layers), heads, kd, vd, dtype, p.device)


def attention_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean (B, 1, q, k) -> additive float mask: 0 where allowed, the dtype's minimum elsewhere."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)


def prefill_allowed(length: int, device: torch.device) -> torch.Tensor:
    """Right-padded prompts of ``length`` tokens: causal (1, 1, P, P), the same for every row.

    A real query j sees slots 0..j, all its own prompt's; a padding query sees real and padding
    slots (its output is never read), so no attention row is empty.
    """
    slots = torch.arange(length, device=device)
    return (slots[None, :] <= slots[:, None])[None, None]


def step_allowed(end: torch.Tensor, tree_mask: torch.Tensor, window: int) -> torch.Tensor:
    """end (B,), tree mask (Q, S) or per row (B, Q, S) -> allowed (B, 1, Q, window) of one decoding step.

    Query i of row b sees the row's committed slots ``0 .. end_b - 1`` and the slots
    ``end_b + j`` (j < S) where ``tree_mask[i, j]``: in a verification step Q = S = T and
    tree position i sits at slot ``end_b + i`` and sees its tree ancestors-or-self; a
    drafter's queries see the draft slots of their own ancestors the same way.
    """
    B = end.shape[0]
    Q, S = tree_mask.shape[-2:]
    rel = torch.arange(window, device=end.device)[None, :] - end[:, None]  # (B, W): slot - end_b
    in_tree = (rel >= 0) & (rel < S)  # (B, W)
    cols = rel.clamp(0, S - 1)  # (B, W)
    if tree_mask.dim() == 2:
        tree = tree_mask[:, cols].transpose(0, 1)  # (B, Q, W)
    else:
        tree = tree_mask.gather(2, cols[:, None, :].expand(B, Q, window))  # (B, Q, W)
    return ((tree & in_tree[:, None, :]) | (rel < 0)[:, None, :])[:, None]  # (B, 1, Q, W)


class SlotLayer(CacheLayerMixin):
    """One attention layer of a :class:`SlotCache`: views of its storage (the model's attention calls the cache)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, cache: "SlotCache", index: int):
        super().__init__()
        self.cache = weakref.proxy(cache)  # no cycle: a pooled cache gives its storage back as soon as it is dropped
        self.index = index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("a SlotCache is allocated up front")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(key_states, value_states, self.index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.window, 0

    def get_seq_length(self) -> int:
        return self.cache.window

    def get_max_length(self) -> int:
        return self.cache.slots


KEY_ORDERS = ("slots", "dims")
#: A ``"dims"`` cache's slots are a multiple of this: the block sizes vLLM's CPU kernel takes.
DIMS_SLOT_MULTIPLE = 32


def _alloc(shape: KVShape, rows: int, slots: int, key_order: str = "slots") -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed storage; keys as a (layers, rows, heads, slots, key_dim) view in either key order (module docstring)."""
    if key_order == "dims":
        slots = -(-slots // DIMS_SLOT_MULTIPLE) * DIMS_SLOT_MULTIPLE
        keys = torch.zeros(shape.layers, rows, shape.heads, shape.key_dim, slots, dtype=shape.dtype,
                           device=shape.device).transpose(3, 4)
    else:
        keys = torch.zeros(shape.layers, rows, shape.heads, slots, shape.key_dim, dtype=shape.dtype, device=shape.device)
    values = torch.zeros(shape.layers, rows, shape.heads, slots, shape.value_dim, dtype=shape.dtype, device=shape.device)
    return keys, values


class SlotPool:
    """Storages of caches that are gone, kept for later caches of one shape (see "pooled storage").

    ``take`` hands out the smallest free storage with room for the rows and slots asked for,
    else a new one (slots rounded up to a power of two, at least ``min_slots``); ``give`` takes
    one back, keeping the ``keep`` most recent.
    """

    def __init__(self, shape: KVShape, keep: int = 4, min_slots: int = 256, key_order: str = "slots",
                 powers_of_two: bool = True):
        self.shape = shape
        self.keep = keep
        self.min_slots = min_slots
        self.key_order = key_order  # of every storage it makes
        self.powers_of_two = powers_of_two  # round new storages' slots up to one (CUDA graphs' sharing), else as asked
        self._free: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.allocated = 0  # storages made
        self.reused = 0  # storages handed out again

    def __len__(self) -> int:
        return len(self._free)

    def take(self, rows: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        fits = [(k.shape[1] * k.shape[3], i) for i, (k, _) in enumerate(self._free) if k.shape[1] >= rows and k.shape[3] >= slots]
        if fits:
            self.reused += 1
            return self._free.pop(min(fits)[1])
        self.allocated += 1
        if self.powers_of_two:
            slots = max(self.min_slots, 1 << (max(slots, 1) - 1).bit_length())
        return _alloc(self.shape, rows, slots, self.key_order)

    def give(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self._free.append((keys, values))
        del self._free[: -self.keep]


class SlotCache(Cache):
    """Preallocated keys and values for ``rows`` sequences of up to ``slots`` tokens (see the module docstring).

    Storage: ``keys`` (layers, R, heads, S, key_dim) and ``values`` (layers, R, heads, S, value_dim);
    the batch is rows ``0 .. rows - 1``. Before each forward, :meth:`prepare` sets the write
    slots and the window; the model's attention then calls :meth:`update` once per layer.
    """

    def __init__(self, shape: KVShape, rows: int, slots: int, pool: SlotPool | None = None, key_order: str = "slots"):
        """``pool``: take the storage from it (room for at least ``rows`` x ``slots``, keys in the pool's order) and give
        it back when this cache is gone; ``key_order``: module docstring."""
        if key_order not in KEY_ORDERS or (pool is not None and key_order != pool.key_order):
            raise ValueError(f"key order {key_order!r}: one of {KEY_ORDERS}, and its pool's for pooled storage")
        self.shape = shape
        self.pool = pool
        self.key_order = key_order
        self._give_back = None
        self._use(*(pool.take(rows, slots) if pool is not None else _alloc(shape, rows, slots, key_order)))
        self.rows = rows  # rows in use (the batch)
        self.window = 0
        self._index_k: torch.Tensor | None = None  # (B, heads, T, key_dim) write slots, expanded
        self._index_v: torch.Tensor | None = None
        self._from_start = False  # the write slots are 0 .. T - 1 of every row: a copy, no scatter
        super().__init__(layers=[SlotLayer(self, i) for i in range(shape.layers)])

    def _use(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold this storage; a pooled one goes back to the pool when the cache is collected or grows out of it."""
        if self._give_back is not None:
            self._give_back()  # the storage it had, back to the pool now
        self.keys, self.values = keys, values
        if self.pool is not None:
            self._give_back = weakref.finalize(self, self.pool.give, keys, values)

    @property
    def capacity_rows(self) -> int:
        return self.keys.shape[1]

    @property
    def slots(self) -> int:
        return self.keys.shape[3]

    @property
    def kernel_keys(self) -> torch.Tensor:
        """The keys of a ``"dims"`` cache as vLLM's CPU kernel takes them: (layers, R, heads, S, key_dim), each (S,
        key_dim) block holding key_dim x S values (a reinterpreting view)."""
        if self.key_order != "dims":
            raise ValueError("only a cache with keys in 'dims' order is read by the kernel")
        return self.keys.transpose(3, 4).view(self.keys.shape)

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    # -- one forward ---------------------------------------------------------------------------
    def prepare(self, write: torch.Tensor, window: int, from_start: bool = False) -> None:
        """The next forward writes its (B, T) tokens at ``write`` (B, T) slots and attends over ``window`` slots.

        ``from_start``: ``write`` is slots ``0 .. T - 1`` in every row (a prefill), copied as one block.
        """
        B, T = write.shape
        if B != self.rows:
            raise ValueError(f"the forward has {B} rows but the cache holds {self.rows}")
        if window > self.slots:
            raise ValueError(f"window {window} exceeds the cache's {self.slots} slots")
        s = self.shape
        self._from_start = from_start
        self._index_k = write[:, None, :, None].expand(B, s.heads, T, s.key_dim)
        self._index_v = self._index_k if s.value_dim == s.key_dim else write[:, None, :, None].expand(B, s.heads, T, s.value_dim)
        self.window = window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write (B, heads, T, d) keys/values at the prepared slots; -> this layer's first ``window`` slots (views)."""
        keys = self.keys[layer_idx, : self.rows]  # (B, heads, S, key_dim)
        values = self.values[layer_idx, : self.rows]
        if self._from_start:
            T = key_states.shape[2]
            keys[:, :, :T].copy_(key_states)
            values[:, :, :T].copy_(value_states)
        else:
            keys.scatter_(2, self._index_k, key_states)
            values.scatter_(2, self._index_v, value_states)
        return keys[:, :, : self.window], values[:, :, : self.window]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.window

    # -- between forwards ------------------------------------------------------------------------
    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Per row b, copy slots ``src[b]`` to ``dst[b]`` (B, M) in every layer (all sources are read first)."""
        B, M = src.shape
        for store in (self.keys, self.values):
            L, _, H, _, d = store.shape
            rows = store[:, :B]  # (L, B, H, S, d)
            moved = rows.gather(3, src[None, :, None, :, None].expand(L, B, H, M, d))  # (L, B, H, M, d)
            rows.scatter_(3, dst[None, :, None, :, None].expand(L, B, H, M, d), moved)

    def keep_rows(self, rows: list[int], used: int) -> None:
        """Keep batch rows ``rows`` (distinct), row ``rows[j]`` becoming row ``j``; only the rows that change place are
        copied, their first ``used`` slots. (:meth:`Batch.compact` fills the places of finished rows with the last
        rows, so one row leaving a batch copies one row's cache, not every row after it.)"""
        if len(set(rows)) != len(rows) or any(not 0 <= r < self.rows for r in rows):
            raise ValueError(f"rows {rows} must be distinct rows within 0..{self.rows - 1}")
        moved = [j for j, r in enumerate(rows) if r != j]
        if moved:
            dst = torch.tensor(moved, device=self.keys.device)
            src = torch.tensor([rows[j] for j in moved], device=self.keys.device)
            for store in (self.keys, self.values):
                store[:, dst, :, :used] = store[:, src, :, :used]
        self.rows = len(rows)

    def append(self, other: "SlotCache", used: int) -> None:
        """Add ``other``'s rows after this cache's (their first ``used`` slots); grows the storage if needed."""
        if other.shape != self.shape:
            raise ValueError("caches of different shapes cannot be joined")
        B, B2 = self.rows, other.rows
        self.reserve(B + B2, max(other.slots, used))
        self.keys[:, B : B + B2, :, :used] = other.keys[:, :B2, :, :used]
        self.values[:, B : B + B2, :, :used] = other.values[:, :B2, :, :used]
        self.rows = B + B2

    def add_rows(self, rows: int, slots: int) -> None:
        """Add ``rows`` rows after this cache's, with room for ``slots`` slots (grows the storage if needed); their
        slots hold whatever the storage held until written (a prefill writes them from slot 0)."""
        self.reserve(self.rows + rows, slots)
        self.rows += rows

    def reserve(self, rows: int, slots: int) -> None:
        """Make room for ``rows`` rows of ``slots`` slots; growing copies the rows in use (at least doubling what grows)."""
        R, S = self.capacity_rows, self.slots
        if rows <= R and slots <= S:
            return
        R2 = max(rows, 2 * R) if rows > R else R
        S2 = max(slots, 2 * S) if slots > S else S
        keys, values = self.pool.take(R2, S2) if self.pool is not None else _alloc(self.shape, R2, S2, self.key_order)
        keys[:, : self.rows, :, :S] = self.keys[:, : self.rows]
        values[:, : self.rows, :, :S] = self.values[:, : self.rows]
        self._use(keys, values)


__all__ = ["KEY_ORDERS", "KVShape", "SlotCache", "SlotPool", "attention_bias", "prefill_allowed", "step_allowed"]
