"""Attention on vLLM's CPU kernel, reading the slot cache in place.

vLLM's CPU build attends with ``_C::cpu_attention_with_kv_cache``: queries of several rows packed
one after another (``query_start_loc``), each row causal over its own ``seq_len`` keys, read from
paged caches of (blocks, kv_heads, block_size, head_dim) through a block table. It reads the keys
at memory speed, where SDPA over a batch pays for padding and copies; at a batch of rows of uneven
lengths, and in a prefill, it takes about half of SDPA's time (row chunks included). Measured:
BENCHMARKS.md, "The attention path".

How the slot cache serves it. One block per row (block table ``[[0], [1], ...]``, block size =
the cache's slots) makes a slot cache layer, (rows, kv_heads, slots, head_dim), a paged cache. The
values are laid out as vLLM's. Its keys are not: with the ``vec`` instruction set (float32 on x86,
block sizes a multiple of 32) a block holds each head's keys dimension-major, (head_dim, slots),
so a cache whose keys the kernel reads keeps them in that order (:mod:`distill.engine.cache`,
"key order"). :func:`paged_problem` checks that order on the library that is loaded (its own cache
writer against ours) and that its outputs are SDPA's, before any cache is made that way.

What the kernel computes is causal attention per row: a prefill (queries = the prompt), a plain
step (one query after the row's keys) and a chain of drafted tokens (query t sees the keys up to
its own slot). A branching tree's queries must not see their siblings, so tree steps attend in
:func:`distill.engine.attention.sdpa_gqa` under the tree's mask (:class:`distill.engine.attention.Masked` in the direct loop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distill.engine.cpu.linears import vllm_kernels

#: The kernel's instruction set whose key order :func:`paged_problem` checks (vLLM's choice for float32 on x86).
ISA = "vec"
OPS = ("cpu_attention_with_kv_cache", "get_scheduler_metadata", "cpu_attn_reshape_and_cache")

_checked: dict[tuple, str] = {}


@dataclass(frozen=True)
class PagedPlan:
    """One forward's attention on the kernel, shared by every layer.

    ``keys`` / ``values``: the cache's storage, (layers, rows, kv_heads, slots, head_dim), keys in the
    kernel's order (a reinterpreting view); ``starts`` (B + 1,) int32: where each row's queries begin in
    the packed queries; ``seq_lens`` (B,) int32: each row's keys, its queries' last slot + 1; ``table``
    (B, 1) int32: row b is block b; ``meta``: the kernel's work split for these lengths; ``pack``: the
    (rows, positions) of the real queries of a right-padded forward, None when every row's T queries are real;
    ``padding``: those of its padding queries; ``slots`` (tokens,) int64: where each real query's key and value go in the
    paged view (row b is block b: b · the cache's slots + the slot), packed as the queries are; ``masked``: the queries
    attend under this mask, not on the kernel (the direct loop's branching trees; the keys and values are written the same).
    """

    keys: torch.Tensor
    values: torch.Tensor
    starts: torch.Tensor
    seq_lens: torch.Tensor
    table: torch.Tensor
    meta: torch.Tensor
    pack: tuple[torch.Tensor, torch.Tensor] | None
    padding: tuple[torch.Tensor, torch.Tensor] | None = None
    slots: torch.Tensor | None = None
    masked: object | None = None  # a distill.engine.attention.Masked


def plan(cache, queries: list[int], ends: list[int], heads: int, padded: bool, masked=None) -> PagedPlan:
    """The plan of a forward whose row b has ``queries[b]`` queries written at slots ``ends[b] ..`` of ``cache``
    (a slot cache with keys in the kernel's order) -> :class:`PagedPlan`. ``padded``: the forward's queries are
    right-padded to the longest row's (a prefill), else every row has ``queries[b]`` = T; ``masked``: they attend under
    that mask instead (:attr:`PagedPlan.masked`, a :class:`distill.engine.attention.Masked`)."""
    B = len(queries)
    lens = [e + q for e, q in zip(ends, queries)]
    starts = torch.zeros(B + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(queries, dtype=torch.int32), 0, out=starts[1:])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    shape = cache.shape
    meta = torch.ops._C.get_scheduler_metadata(B, heads, shape.heads, shape.key_dim, seq_lens, shape.dtype, starts, True, -1,
                                               ISA, False, None, "auto")
    pack = padding = None
    if padded and len(set(queries)) > 1:
        real = torch.arange(max(queries))[None] < torch.tensor(queries)[:, None]  # (B, T)
        pack, padding = real.nonzero(as_tuple=True), (~real).nonzero(as_tuple=True)
    S = cache.slots
    slots = torch.tensor([b * S + e + t for b, (e, q) in enumerate(zip(ends, queries)) for t in range(q)], dtype=torch.int64)
    return PagedPlan(cache.kernel_keys, cache.values, starts, seq_lens, torch.arange(B, dtype=torch.int32)[:, None], meta,
                     pack, padding, slots, masked)


def paged_attention(plan: PagedPlan, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """query (B, heads, T, d) of layer ``layer`` -> its attention (B, T, heads, d); a padded forward's padding
    queries get zeros."""
    B, H, T, d = query.shape
    rows = query.transpose(1, 2)  # (B, T, H, d)
    packed = rows[plan.pack] if plan.pack is not None else rows.reshape(B * T, H, d)
    out = attend_packed(plan, layer, packed, scaling)
    if plan.pack is None:
        return out.view(B, T, H, d)
    full = out.new_empty(B, T, H, d)
    full[plan.pack] = out
    full[plan.padding] = 0  # finite: they become the padding slots' keys, which a masked SDPA still multiplies
    return full


def attend_packed(plan: PagedPlan, layer: int, rows: torch.Tensor, scaling: float) -> torch.Tensor:
    """Packed queries ``rows`` (tokens, heads, d), row b's from ``plan.starts[b]`` on, of layer ``layer`` -> their
    attention (tokens, heads, d): :func:`paged_attention` of a forward without padding, the queries already packed."""
    packed = rows.contiguous()
    out = torch.empty_like(packed)
    torch.ops._C.cpu_attention_with_kv_cache(packed, plan.keys[layer], plan.values[layer], out, plan.starts, plan.seq_lens,
                                             scaling, True, None, -1, plan.table, 0.0, plan.meta, None, None, 1.0, 1.0, "auto")
    return out


def write_packed(plan: PagedPlan, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write the packed keys and values (tokens, kv_heads, d) of layer ``layer`` at ``plan.slots`` with vLLM's cache writer,
    which takes them strided (columns of a wider product) and writes the keys in the kernel's order; a scatter into the
    cache's view does the same at several times the cost from a few rows on. Measured: BENCHMARKS.md, "Against vLLM as
    its server runs it"."""
    torch.ops._C.cpu_attn_reshape_and_cache(keys, values, plan.keys[layer], plan.values[layer], plan.slots, ISA, 1.0, 1.0, "auto")


def paged_problem(kv_shape, heads: int) -> str:
    """Why the kernel cannot attend for a model of this cache shape and ``heads`` query heads, or "" (checked once per
    shape): vLLM's CPU library and its ops load, the dtype is float32 on a CPU, the kernel writes keys in the order
    :mod:`distill.engine.cache` keeps for it, and its attention over such a cache equals SDPA's."""
    key = (kv_shape.heads, kv_shape.key_dim, kv_shape.value_dim, kv_shape.dtype, kv_shape.device.type, heads)
    if key not in _checked:
        _checked[key] = _problem(kv_shape, heads)
    return _checked[key]


def _problem(kv_shape, heads: int) -> str:
    if kv_shape.device.type != "cpu" or kv_shape.dtype != torch.float32:
        return f"the kernel's key order is checked for float32 on a CPU, not {kv_shape.dtype} on {kv_shape.device.type}"
    if kv_shape.key_dim != kv_shape.value_dim or heads % kv_shape.heads:
        return "keys and values of different sizes, or query heads not a multiple of key/value heads"
    why = vllm_kernels()
    if why:
        return why
    missing = [op for op in OPS if not hasattr(torch.ops._C, op)]
    if missing:
        return f"vLLM's library has no {', '.join(missing)}"
    from distill.engine.cache import DIMS_SLOT_MULTIPLE, KVShape, SlotCache

    g = torch.Generator().manual_seed(0)
    H, d, S = kv_shape.heads, kv_shape.key_dim, DIMS_SLOT_MULTIPLE
    shape = KVShape(1, H, d, d, torch.float32, torch.device("cpu"))
    cache = SlotCache(shape, 2, S, key_order="dims")
    keys, values = torch.randn(2, H, S, d, generator=g), torch.randn(2, H, S, d, generator=g)
    try:
        theirs_k, theirs_v = torch.zeros(2, H, S, d), torch.zeros(2, H, S, d)
        flat = [t.transpose(1, 2).reshape(2 * S, H, d).contiguous() for t in (keys, values)]
        torch.ops._C.cpu_attn_reshape_and_cache(*flat, theirs_k, theirs_v, torch.arange(2 * S), ISA, 1.0, 1.0, "auto")
        cache.prepare(torch.arange(S)[None].expand(2, S), S, from_start=True)
        cache.update(keys, values, 0)
        if not (torch.equal(cache.kernel_keys[0], theirs_k) and torch.equal(cache.values[0], theirs_v)):
            return f"vLLM's kernel keeps keys in another order than the ({d}, slots) blocks checked here"
        lengths, T = [S - 4, 11], 4  # two rows of different lengths, four queries each: causal over its own keys
        query = torch.randn(2, heads, T, d, generator=g)
        got = paged_attention(plan(cache, [T, T], [n - T for n in lengths], heads, False), 0, query, d ** -0.5)
    except (RuntimeError, TypeError) as exc:
        return f"vLLM's attention kernel did not run: {exc}"
    for b, n in enumerate(lengths):
        allowed = torch.arange(n)[None] <= torch.arange(n - T, n)[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(query[b : b + 1], keys[b : b + 1, :, :n], values[b : b + 1, :, :n],
                                                                attn_mask=allowed, enable_gqa=True)
        if not torch.allclose(got[b], want[0].transpose(0, 1), atol=1e-5, rtol=1e-4):
            return "vLLM's attention kernel gives other outputs than SDPA over the same cache"
    return ""


__all__ = ["ISA", "PagedPlan", "attend_packed", "paged_attention", "paged_problem", "plan", "write_packed"]
