"""The attention the engine's forwards use: transformers' SDPA attention, grouped key/value heads read in place,
each run of rows over no more keys than its longest row needs.

Terms
-----
grouped key/value heads (GQA)
    ``heads`` query heads share ``kv_heads`` key/value heads (groups = heads / kv_heads).
    transformers' ``sdpa`` attention copies each key/value head ``groups`` times
    (``repeat_kv``) whenever an attention mask is given, and the engine always gives one
    (tree and padding masks). On CPU, ``F.scaled_dot_product_attention(enable_gqa=True)``
    reads the shared heads in place, much faster than copy + attention at decoding sizes,
    with identical results. Measured: BENCHMARKS.md, "The engine's step on a CPU".
row chunks
    a batch's rows have different lengths, and one attention call reads every row's keys up
    to the longest row's window, the shorter rows' extra keys masked. A plan of row chunks
    ``(first row, end row, queries, keys)`` splits the rows into contiguous runs, each
    attended over its own longest row's keys and queries (:func:`plan_row_chunks`); the
    masked keys left out add nothing to a softmax, so the outputs are the same but for float
    rounding (another summation order). The plan reaches the attention as the forward's ``row_chunks`` keyword, which
    transformers' decoder layers hand down to the attention function untouched.
keys in dimension order
    a slot cache whose keys vLLM's CPU kernel reads keeps them (key_dim, slots) per head
    (:mod:`distill.engine.cache`, "key order"). Forwards the kernel computes (causal per row) get a
    :class:`~distill.engine.cpu.paged.PagedPlan` as the ``paged`` keyword and attend on it; the others
    (branching trees) multiply the queries by those keys as they lie (:func:`attend_dims`): SDPA would
    read them through a copy into slot order, slower than either (BENCHMARKS.md, "The attention path").
``distill_sdpa``
    the attention implementation registered here through transformers' public
    ``AttentionInterface`` / ``AttentionMaskInterface``: :func:`sdpa_gqa` for the
    attention, transformers' own ``sdpa`` mask builder for masks. Everything but the
    masked-GQA case goes to transformers' ``sdpa_attention_forward`` unchanged, so a model
    switched to it behaves as with ``sdpa`` everywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

NAME = "distill_sdpa"

#: What one more attention call costs, in query-key pairs of one row, with a margin (BENCHMARKS.md, "The attention path").
CHUNK_OVERHEAD = 512

RowChunk = tuple[int, int, int, int]  # (first row, end row, queries, keys)


def plan_row_chunks(queries: list[int], keys: list[int], overhead: int = CHUNK_OVERHEAD) -> list[RowChunk] | None:
    """Contiguous runs of rows that attend at the least cost; None when one call over all rows is best.

    Row b needs its first ``queries[b]`` queries and ``keys[b]`` keys. A run of rows costs
    ``overhead + rows x its longest queries x its longest keys`` (query-key pairs); the runs are
    chosen by dynamic programming over where they start.
    """
    B = len(keys)
    Q, K = max(queries, default=0), max(keys, default=0)
    whole = overhead + B * Q * K
    if B < 2 or whole - sum(q * k for q, k in zip(queries, keys)) <= overhead:
        return None
    best = [0] + [None] * B  # best[i]: the least cost of rows 0..i-1
    start = [0] * (B + 1)
    for i in range(1, B + 1):
        q = k = 0
        for j in range(i - 1, -1, -1):  # the last run is rows j..i-1
            q, k = max(q, queries[j]), max(k, keys[j])
            cost = best[j] + overhead + (i - j) * q * k
            if best[i] is None or cost < best[i]:
                best[i], start[i] = cost, j
    if best[B] >= whole:
        return None
    chunks, i = [], B
    while i:
        j = start[i]
        chunks.append((j, i, max(queries[j:i]), max(keys[j:i])))
        i = j
    return chunks[::-1]


def _sdpa(query, key, value, mask, dropout, scaling):
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                            scale=scaling, enable_gqa=True)


def attend_dims(query, key, value, mask, scaling):
    """SDPA's attention (B, heads, T, d) with keys in dimension order (module docstring): ``key`` a (B, kv_heads, S, d)
    view of (d, S) blocks, mask (B | 1, 1, T, S). Each key/value head's query groups are one product."""
    B, H, T, d = query.shape
    G = H // key.shape[1]
    scores = torch.matmul(query.reshape(B, key.shape[1], G * T, d), key.transpose(2, 3))  # (B, kv_heads, G T, S)
    scores = scores.view(B, key.shape[1], G, T, -1).mul_(d ** -0.5 if scaling is None else scaling).add_(mask[:, :, None])
    weights = torch.softmax(scores, dim=-1).view(B, key.shape[1], G * T, -1)
    return torch.matmul(weights, value).view(B, H, T, value.shape[-1])


def sdpa_gqa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
             row_chunks: list[RowChunk] | None = None, paged=None, **kwargs):
    """query (B, heads, T, d), key/value (B, kv_heads, S, d), mask (B | 1, 1, T, S) -> ((B, T, heads, d), None).

    ``row_chunks``: attend each run of rows over its own queries and keys (module docstring, "row chunks"); a
    row's queries past its run's are padding, and their outputs are zeros. ``paged``: the forward's plan on vLLM's
    CPU kernel (module docstring, "keys in dimension order"), which reads ``module.layer_idx``'s cache itself.
    """
    if paged is not None:
        from distill.engine.cpu.paged import paged_attention

        return paged_attention(paged, module.layer_idx, query, scaling), None
    plain = attention_mask is None or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
    dims = key.stride(-1) != 1 and dropout == 0.0 and not plain
    if not dims and (plain or query.shape[1] == key.shape[1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if row_chunks is None:
        if dims:
            return attend_dims(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None
        out = _sdpa(query, key, value, attention_mask, dropout, scaling)  # (B, heads, T, d)
        return out.transpose(1, 2).contiguous(), None
    B, H, T, _ = query.shape
    out = query.new_empty(B, T, H, value.shape[-1])
    per_row = attention_mask.shape[0] > 1
    for r0, r1, q, k in row_chunks:
        mask = attention_mask[r0:r1] if per_row else attention_mask
        args = (query[r0:r1, :, :q], key[r0:r1, :, :k], value[r0:r1, :, :k], mask[:, :, :q, :k])
        part = attend_dims(*args, scaling) if dims else _sdpa(*args, dropout, scaling)
        out[r0:r1, :q] = part.transpose(1, 2)
        if q < T:
            out[r0:r1, q:] = 0
    return out, None


@dataclass(frozen=True)
class Masked:
    """A forward whose queries attend under a mask instead of causally (a branching tree's step), read from the cache's
    keys and values as :func:`sdpa_gqa` reads them through the model's modules (the direct loop's branching trees,
    :attr:`distill.engine.cpu.paged.PagedPlan.masked`): ``keys`` / ``values`` the cache's (layers, rows, kv_heads, slots,
    d) views, ``bias`` (B or 1, 1, T, window) the additive mask, ``chunks`` the row chunks (:func:`plan_row_chunks`)."""

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor
    chunks: list | None

    def attend(self, layer: int, query: torch.Tensor, B: int, T: int, scaling: float) -> torch.Tensor:
        """Packed queries (B·T, heads, d) of layer ``layer`` -> their attention (B·T, heads, d)."""
        W = self.bias.shape[-1]
        q = query.view(B, T, *query.shape[1:]).transpose(1, 2)  # (B, heads, T, d), as the modules hand it over
        out, _ = sdpa_gqa(None, q, self.keys[layer, :B, :, :W], self.values[layer, :B, :, :W], self.bias, scaling=scaling,
                          row_chunks=self.chunks)
        return out.view(B * T, *query.shape[1:])


AttentionInterface.register(NAME, sdpa_gqa)
AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_gqa_sdpa(model) -> bool:
    """Switch a model that runs transformers' ``sdpa`` attention to ``distill_sdpa``; -> whether it was switched."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME


__all__ = ["CHUNK_OVERHEAD", "NAME", "Masked", "RowChunk", "attend_dims", "plan_row_chunks", "sdpa_gqa", "use_gqa_sdpa"]
