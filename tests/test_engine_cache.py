"""The slot cache on tiny synthetic tensors: attention masks, in-place writes, compaction, rows leaving and joining."""

from __future__ import annotations

import pytest
import torch

from distill.engine import cache as kv
from distill.errors import ModelError
from helpers import tiny_llama_config, tiny_sizes

CPU = torch.device("cpu")


def shape(layers: int = 2, heads: int = 1, key_dim: int = 1, value_dim: int = 1) -> kv.KVShape:
    return kv.KVShape(layers, heads, key_dim, value_dim, torch.float32, CPU)


def write(cache: kv.SlotCache, values: torch.Tensor, slots: torch.Tensor, window: int, from_start: bool = False) -> list:
    """One forward's writes: ``values`` (B, T) at ``slots`` (B, T) in every layer (keys = values, values = -values)."""
    cache.prepare(slots, window, from_start=from_start)
    out = []
    for layer in range(cache.shape.layers):
        x = values[:, None, :, None].float()  # (B, 1, T, 1)
        out.append(cache.update(x + layer, -x, layer))
    return out


def keys(cache: kv.SlotCache, layer: int = 0) -> list[list[float]]:
    """Row-major (B, S) keys of one layer (head 0, dim 0) of the rows in use."""
    return cache.keys[layer, : cache.rows, 0, :, 0].tolist()


def test_a_prefills_block_copy_writes_what_the_scatter_writes():
    values = torch.tensor([[1, 2, 3], [4, 5, 0]])
    slots = torch.arange(3)[None].expand(2, 3)
    caches = [kv.SlotCache(shape(), 2, 8) for _ in range(2)]
    outs = [write(c, values, slots, 3, from_start=f) for c, f in zip(caches, (False, True))]
    assert torch.equal(caches[0].keys, caches[1].keys) and torch.equal(caches[0].values, caches[1].values)
    assert all(torch.equal(a, b) for x, y in zip(*outs) for a, b in zip(x, y))
    assert keys(caches[1]) == [[1, 2, 3, 0, 0, 0, 0, 0], [4, 5, 0, 0, 0, 0, 0, 0]]
    write(caches[1], torch.tensor([[7], [8]]), torch.tensor([[3], [2]]), 4)  # the next step scatters again
    assert keys(caches[1]) == [[1, 2, 3, 7, 0, 0, 0, 0], [4, 5, 8, 0, 0, 0, 0, 0]]


def test_prefill_is_causal_for_every_right_padded_row():
    allowed = kv.prefill_allowed(3, CPU)
    assert allowed.shape == (1, 1, 3, 3)
    assert allowed[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    bias = kv.attention_bias(allowed, torch.float32)
    assert bias[0, 0, 0, 0] == 0 and bias[0, 0, 0, 1] == torch.finfo(torch.float32).min


def test_step_mask_sees_each_rows_own_committed_slots_and_tree_ancestors():
    # row 0 has 3 committed slots, row 1 has 1; a tree root -> a (child) and root -> b: T = 3
    tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
    m = kv.step_allowed(torch.tensor([3, 1]), tree, window=6)
    assert m.shape == (2, 1, 3, 6)
    assert m[0, 0].tolist() == [
        [True, True, True, True, False, False],  # root at slot 3
        [True, True, True, True, True, False],  # a at slot 4 sees the root
        [True, True, True, True, False, True],  # b at slot 5 sees the root, not a
    ]
    assert m[1, 0].tolist() == [
        [True, True, False, False, False, False],  # root at slot 1; slots 4, 5 are outside this row's tree
        [True, True, True, False, False, False],
        [True, True, False, True, False, False],
    ]


def test_plain_step_mask_is_everything_up_to_the_row_end():
    m = kv.step_allowed(torch.tensor([2, 4]), torch.ones(1, 1, dtype=torch.bool), window=5)
    assert m[:, 0, 0].tolist() == [[True, True, True, False, False], [True, True, True, True, True]]


def test_update_writes_in_place_at_each_rows_slots_and_returns_the_window():
    cache = kv.SlotCache(shape(), rows=2, slots=8)
    storage = cache.keys.data_ptr()
    write(cache, torch.tensor([[10, 11, 12], [20, 21, 0]]), torch.arange(3)[None].expand(2, 3), window=3)  # prefill
    out = write(cache, torch.tensor([[13, 14], [22, 23]]), torch.tensor([[3, 4], [2, 3]]), window=5)  # per-row ends 3, 2
    assert cache.keys.data_ptr() == storage  # no reallocation, no growing copies
    k, v = out[1]
    assert k.shape == (2, 1, 5, 1) and k.data_ptr() == cache.keys[1].data_ptr()  # views of the storage
    assert keys(cache)[0][:5] == [10, 11, 12, 13, 14]
    assert keys(cache)[1][:4] == [20, 21, 22, 23]
    assert keys(cache, layer=1)[0][:5] == [11, 12, 13, 14, 15] and torch.equal(cache.values[0], -cache.keys[0])
    with pytest.raises(ValueError, match="window"):
        cache.prepare(torch.zeros(2, 1, dtype=torch.long), 9)
    with pytest.raises(ValueError, match="rows"):
        cache.prepare(torch.zeros(1, 1, dtype=torch.long), 2)


def test_compaction_moves_accepted_tree_slots_behind_the_root():
    cache = kv.SlotCache(shape(), rows=2, slots=10)
    write(cache, torch.tensor([[1, 2], [5, 0]]), torch.arange(2)[None].expand(2, 2), window=2)
    end = torch.tensor([2, 1])
    tree = torch.tensor([[100, 101, 102, 103], [200, 201, 202, 203]])  # tree positions 0..3 at end + 0..3
    write(cache, tree, end[:, None] + torch.arange(4)[None], window=6)
    path = torch.tensor([[0, 2, 3], [0, 1, 0]])  # row 0 accepts positions 2, 3; row 1 accepts 1 (then don't-care)
    cache.move(end[:, None] + path, end[:, None] + torch.arange(3)[None])
    assert keys(cache)[0][:5] == [1, 2, 100, 102, 103]
    assert keys(cache)[1][:3] == [5, 200, 201]
    assert keys(cache, layer=1)[0][:5] == [2, 3, 101, 103, 104]
    assert torch.equal(cache.values[:, :, :, :5], -(cache.keys[:, :, :, :5] - torch.arange(2).view(2, 1, 1, 1, 1)))  # values moved too


def test_a_finished_row_s_place_goes_to_the_last_running_row_and_the_rows_before_stay():
    cache = kv.SlotCache(shape(), rows=4, slots=4)
    write(cache, torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]]), torch.arange(2)[None].expand(4, 2), window=2)
    cache.keep_rows([3, 1, 2], used=2)  # row 0 finished: the last row takes its place
    assert cache.rows == 3 and [r[:2] for r in keys(cache)] == [[7, 8], [3, 4], [5, 6]]
    assert [r[:2] for r in keys(cache, layer=1)] == [[8, 9], [4, 5], [6, 7]]


def test_rows_leave_to_the_front_and_rows_join_with_growth():
    cache = kv.SlotCache(shape(), rows=3, slots=4)
    write(cache, torch.tensor([[1, 2], [3, 4], [5, 6]]), torch.arange(2)[None].expand(3, 2), window=2)
    cache.keep_rows([0, 2], used=2)
    assert cache.rows == 2 and keys(cache)[1][:2] == [5, 6] and keys(cache)[0][:2] == [1, 2]
    with pytest.raises(ValueError, match="distinct"):
        cache.keep_rows([1, 1], used=2)
    with pytest.raises(ValueError, match="distinct"):
        cache.keep_rows([0, 2], used=2)  # two rows now

    other = kv.SlotCache(shape(), rows=2, slots=6)
    write(other, torch.tensor([[7, 8, 9], [10, 11, 12]]), torch.arange(3)[None].expand(2, 3), window=3)
    cache.append(other, used=3)
    assert cache.rows == 4 and cache.capacity_rows >= 4 and cache.slots >= 6  # grown: 3 rows of 4 slots were too few
    assert [r[:2] for r in keys(cache)[:2]] == [[1, 2], [5, 6]]  # kept through the growth
    assert [r[:3] for r in keys(cache)[2:]] == [[7, 8, 9], [10, 11, 12]]
    assert keys(cache, layer=1)[3][:3] == [11, 12, 13]
    write(cache, torch.tensor([[3], [7], [10], [13]]), torch.tensor([[2], [2], [3], [3]]), window=4)  # one step of all rows
    assert [r[:4] for r in keys(cache)] == [[1, 2, 3, 0], [5, 6, 7, 0], [7, 8, 9, 10], [10, 11, 12, 13]]


def test_kv_shape_probe_reads_the_models_layers_and_refuses_sliding_windows():
    from transformers import LlamaForCausalLM, MistralConfig, MistralForCausalLM

    small = dict(vocab=16, hidden=16, intermediate=32, layers=2, heads=4, kv_heads=2, positions=64)
    s = kv.KVShape.of(LlamaForCausalLM(tiny_llama_config(**small)).eval())
    assert (s.layers, s.heads, s.key_dim, s.value_dim) == (2, 2, 4, 4)
    assert s.slot_bytes == 2 * 2 * (4 + 4) * 4
    with pytest.raises(ModelError, match="full-attention"):
        kv.KVShape.of(MistralForCausalLM(MistralConfig(**tiny_sizes(**small), sliding_window=8)).eval())


def test_keys_in_dimension_order_hold_what_slot_order_holds_through_every_operation():
    """A ``"dims"`` cache (the order vLLM's CPU kernel reads) behind the same (…, slots, key_dim) view: prefill, step
    writes, compaction, rows leaving and joining give the keys a slot-order cache gives; the kernel's view holds each
    head's keys as (key_dim, slots)."""
    s = shape(heads=2, key_dim=3, value_dim=3)
    kinds = {"slots": {}, "dims": {"key_order": "dims"}}
    caches = {kind: kv.SlotCache(s, 3, 40, **kw) for kind, kw in kinds.items()}
    assert caches["dims"].slots % kv.DIMS_SLOT_MULTIPLE == 0 and caches["dims"].keys.stride(-1) != 1
    g = torch.Generator().manual_seed(0)
    prompt, step = torch.randn(3, 2, 5, 3, generator=g), torch.randn(3, 2, 4, 3, generator=g)
    other = {kind: kv.SlotCache(s, 2, 40, **kw) for kind, kw in kinds.items()}
    for order, cache in caches.items():
        cache.prepare(torch.arange(5)[None].expand(3, 5), 5, from_start=True)
        for layer in range(s.layers):
            cache.update(prompt + layer, -prompt, layer)
        end = torch.tensor([5, 3, 4])
        cache.prepare(end[:, None] + torch.arange(4)[None], 9)
        for layer in range(s.layers):
            cache.update(step + layer, -step, layer)
        cache.move(end[:, None] + torch.tensor([[0, 2], [0, 1], [0, 3]]), end[:, None] + torch.arange(2)[None])
        cache.keep_rows([0, 2], used=9)
        o = other[order]
        o.prepare(torch.arange(5)[None].expand(2, 5), 5, from_start=True)
        for layer in range(s.layers):
            o.update(prompt[:2] * 2, prompt[:2], layer)
        cache.append(o, used=5)
        cache.reserve(4, 80)  # growth copies in the cache's own order
    a, b = caches["slots"], caches["dims"]
    assert b.key_order == "dims" and b.rows == a.rows == 4 and b.slots >= 80
    assert torch.equal(a.keys[:, :4, :, :9], b.keys[:, :4, :, :9]) and torch.equal(a.values[:, :4, :, :9], b.values[:, :4, :, :9])
    blocks = b.kernel_keys[0, 1, 0].reshape(-1)  # row 1 (the old row 2), head 0: dimension 0 of every slot first
    assert torch.equal(blocks[: b.slots][:9], a.keys[0, 1, 0, :9, 0]) and torch.equal(blocks[b.slots :][:9], a.keys[0, 1, 0, :9, 1])
    with pytest.raises(ValueError, match="only a cache"):
        a.kernel_keys
    with pytest.raises(ValueError, match="key order"):
        kv.SlotCache(s, 1, 8, key_order="heads")



def test_a_pool_of_kernel_ordered_storage_keeps_the_slots_asked_for_and_one_spare():
    shape = kv.KVShape(2, 1, 4, 4, torch.float32, torch.device("cpu"))
    pool = kv.SlotPool(shape, keep=1, key_order="dims", powers_of_two=False)
    with pytest.raises(ValueError, match="its pool's"):
        kv.SlotCache(shape, 1, 64, pool=pool)  # slot-ordered keys from a pool of dimension-ordered storage
    a = kv.SlotCache(shape, 2, 100, pool=pool, key_order="dims")
    assert (a.capacity_rows, a.slots) == (2, 128) and a.kernel_keys.is_contiguous()  # a multiple of 32, not a power of two
    first = a.keys.data_ptr()
    a.keys[:, :, :, :100] = 7.0
    del a
    b = kv.SlotCache(shape, 1, 90, pool=pool, key_order="dims")  # the spare: earlier values in slots not written yet
    assert b.keys.data_ptr() == first and pool.reused == 1 and b.key_order == "dims"
    c = kv.SlotCache(shape, 1, 64, pool=pool, key_order="dims")
    del b, c
    assert len(pool) == 1 and pool.allocated == 2  # keep=1: one spare only
