"""The KV cache of a batch of sequences with different lengths, on transformers' ``DynamicCache``.

Terms
-----
slot
    an index along the cache's sequence axis, shared by the whole batch.
valid (B, S)
    which slots hold a token of sequence b. Prompts are left-padded, so sequence b's
    tokens occupy slots ``start_b .. end_b - 1``; slots from ``end_b`` up to the cache
    length S are holes (other sequences accepted more tokens) and are masked out.
end (B,)
    the slot where sequence b's next committed token goes.
position (B,)
    sequence b's next position id (its committed token count).
commit
    after a verification forward the cache holds ``S + T`` slots (the tree appended);
    each sequence keeps its root and accepted nodes: they are gathered from the tree
    slots into ``end_b, end_b + 1, ...``, the rest is dropped and the cache is cropped
    to the longest sequence.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def new_cache() -> DynamicCache:
    """A cache of plain full-attention layers (the engine builds every attention mask itself)."""
    return DynamicCache()


def attention_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean (B, 1, q, k) -> additive float mask: 0 where allowed, the dtype's minimum elsewhere."""
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill_(~allowed, torch.finfo(dtype).min)


def prefill_layout(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompt layout: (valid (B, P) bool, positions (B, P) long, allowed (B, 1, P, P) bool).

    A padding query attends to itself only, so no attention row is empty.
    """
    P = max(lengths)
    lens = torch.tensor(lengths, device=device)
    slots = torch.arange(P, device=device)
    start = (P - lens)[:, None]  # (B, 1)
    valid = slots[None, :] >= start  # (B, P)
    positions = (slots[None, :] - start).clamp(min=0)  # (B, P)
    causal = slots[None, :] <= slots[:, None]  # (P, P) key <= query
    allowed = (causal[None] & valid[:, None, :]) | torch.eye(P, dtype=torch.bool, device=device)[None]
    return valid, positions, allowed[:, None]


def step_mask(valid: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
    """valid (B, S) and tree mask (T, T) -> allowed (B, 1, T, S + T) for one verification forward."""
    B, S = valid.shape
    T = tree_mask.shape[0]
    past = valid[:, None, None, :].expand(B, 1, T, S)
    tree = tree_mask[None, None].expand(B, 1, T, T)
    return torch.cat([past, tree], dim=-1)


def commit(
    cache: DynamicCache, valid: torch.Tensor, end: torch.Tensor, keep: torch.Tensor, keep_len: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each sequence's accepted tree slots, drop the rest (see the module docstring).

    cache: S + T slots; valid (B, S); end (B,); keep (B, M) tree positions to keep in order
    (root first), of which the first ``keep_len`` (B,) are real. Returns the new (valid, end).
    """
    B, S = valid.shape
    M = keep.shape[1]
    dev = valid.device
    new_end = end + keep_len  # (B,)
    new_len = int(new_end.max())
    offs = torch.arange(M, device=dev)
    in_place = bool((end == S).all()) and bool((keep == offs[None]).all())
    if not in_place:
        src = (S + keep)[:, None, :, None]  # (B, 1, M, 1)
        dst = (end[:, None] + offs[None])[:, None, :, None]  # (B, 1, M, 1)
        for layer in cache.layers:
            if not isinstance(layer, DynamicLayer) or getattr(layer, "is_sliding", False):
                raise TypeError(f"the engine needs full-attention dynamic cache layers, got {type(layer).__name__}")
            for name in ("keys", "values"):
                x = getattr(layer, name)  # (B, heads, S + T, d)
                shape = (B, x.shape[1], M, x.shape[3])
                moved = x.gather(2, src.expand(shape))  # (B, heads, M, d)
                x.scatter_(2, dst.expand(shape), moved)
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :new_len]
        layer.values = layer.values[:, :, :new_len]
    slots = torch.arange(new_len, device=dev)
    grown = torch.zeros(B, new_len, dtype=torch.bool, device=dev)
    grown[:, : min(S, new_len)] = valid[:, : min(S, new_len)]
    grown |= (slots[None] >= end[:, None]) & (slots[None] < new_end[:, None])
    return grown, new_end


def select(cache: DynamicCache, valid: torch.Tensor, end: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep only batch rows ``rows`` (long) of the cache, cropped to the longest kept sequence; new (valid, end)."""
    cache.batch_select_indices(rows)
    end = end[rows]
    length = int(end.max())
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]
    return valid[rows, :length], end


def join(cache: DynamicCache, valid: torch.Tensor, other: DynamicCache, other_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append ``other``'s rows to ``cache`` (batch axis); the shorter side gets hole slots on the right.

    Returns both valid masks padded to the common length (concatenate them for the joined batch).
    Every row keeps its ``end``: slots past it are holes either way.
    """
    S, S2 = valid.shape[1], other_valid.shape[1]
    L = max(S, S2)
    for layer, layer2 in zip(cache.layers, other.layers, strict=True):
        for name in ("keys", "values"):
            a, b = getattr(layer, name), getattr(layer2, name)
            a = torch.nn.functional.pad(a, (0, 0, 0, L - S))  # (B, heads, L, d)
            b = torch.nn.functional.pad(b, (0, 0, 0, L - S2))
            setattr(layer, name, torch.cat([a, b]))
    return torch.nn.functional.pad(valid, (0, L - S)), torch.nn.functional.pad(other_valid, (0, L - S2))
