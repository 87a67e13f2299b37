"""Cache bookkeeping on synthetic tensors: prefill layout, step masks, commit and batch selection."""

from __future__ import annotations

import torch

from distill.engine import cache as kv


def _cache_with(values: torch.Tensor, layers: int = 2):
    """A DynamicCache whose keys/values (B, 1, S, 1) hold ``values`` (B, S) in every layer."""
    c = kv.new_cache()
    for i in range(layers):
        x = values[:, None, :, None].float()
        c.update(x.clone(), x.clone(), i)
    return c


def test_prefill_layout_left_pads_and_never_leaves_a_row_empty():
    valid, pos, allowed = kv.prefill_layout([3, 1], torch.device("cpu"))
    assert valid.tolist() == [[True, True, True], [False, False, True]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert allowed[1, 0].tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    assert allowed[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    bias = kv.attention_bias(allowed, torch.float32)
    assert bias[0, 0, 0, 0] == 0 and bias[0, 0, 0, 1] == torch.finfo(torch.float32).min


def test_step_mask_joins_the_cache_validity_and_the_tree_mask():
    valid = torch.tensor([[True, True, False], [False, True, True]])
    tree = torch.tensor([[True, False], [True, True]])
    m = kv.step_mask(valid, tree)
    assert m.shape == (2, 1, 2, 5)
    assert m[0, 0].tolist() == [[True, True, False, True, False], [True, True, False, True, True]]
    assert m[1, 0, 0].tolist() == [False, True, True, True, False]


def test_commit_moves_each_sequences_accepted_entries_after_its_own_tokens():
    # S = 3 committed slots; sequence 1 has a hole at slot 2 (end = 2); tree of T = 4 appended (slots 3..6)
    values = torch.tensor([[10, 11, 12, 100, 101, 102, 103], [20, 21, -1, 200, 201, 202, 203]])
    c = _cache_with(values)
    valid = torch.tensor([[True, True, True], [True, True, False]])
    end = torch.tensor([3, 2])
    keep = torch.tensor([[0, 2, 3], [0, 1, 0]])  # tree positions root, a1, a2 (row 1 keeps only root + 1)
    new_valid, new_end = kv.commit(c, valid, end, keep, torch.tensor([3, 2]))
    assert new_end.tolist() == [6, 4]
    for layer in c.layers:
        got = layer.keys[:, 0, :, 0]
        assert got.shape == (2, 6)
        assert got[0].tolist() == [10, 11, 12, 100, 102, 103]
        assert got[1, :4].tolist() == [20, 21, 200, 201]
        assert torch.equal(layer.keys, layer.values)
    assert new_valid.tolist() == [[True] * 6, [True, True, True, True, False, False]]


def test_commit_in_place_fast_path_and_select():
    values = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])  # S = 2, T = 2
    c = _cache_with(values)
    valid = torch.ones(2, 2, dtype=torch.bool)
    new_valid, new_end = kv.commit(c, valid, torch.tensor([2, 2]), torch.tensor([[0, 1], [0, 1]]), torch.tensor([2, 1]))
    assert new_end.tolist() == [4, 3] and c.layers[0].keys[:, 0, :, 0].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert new_valid.tolist() == [[True] * 4, [True, True, True, False]]
    sel_valid, sel_end = kv.select(c, new_valid, new_end, torch.tensor([1]))
    assert sel_end.tolist() == [3] and sel_valid.tolist() == [[True, True, True]]
    assert c.layers[1].keys[:, 0, :, 0].tolist() == [[5, 6, 7]]
