"""Tree buffers (mask, positions, retrieval) for hand-checkable, named and calibrated trees."""

from __future__ import annotations

import pytest
import torch

from distill.engine.tree import DEFAULT_NODES, build_buffers, default_accuracy, resolve_tree, subtree
from distill.errors import ConfigError
from distill.heads.tree import save_tree, sparse_tree

# root=0, (0,)=1, (1,)=2, (0,0)=3, (0,1)=4, (1,0)=5, (0,0,0)=6
HAND = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def test_hand_tree_buffers_match_a_drawing():
    b = build_buffers(HAND)
    assert b.size == 7 and b.nodes == 6 and b.num_heads_used == 3 and b.max_rank == 2
    assert b.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert b.parent.tolist() == [-1, 0, 0, 1, 1, 2, 3]
    expected_mask = [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ]
    assert b.mask.long().tolist() == expected_mask
    # head d's rank r lives at (d - 1) * I + r of the flattened (K, I) top-I table, I = 2
    assert b.cand_index.tolist() == [0, 0, 1, 2, 3, 2, 4]
    # leaves in canonical order: (0,1), (1,0), (0,0,0)
    assert b.retrieve.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    assert b.children.tolist() == [[1, 2], [3, 4], [5, -1], [6, -1], [-1, -1], [-1, -1], [-1, -1]]


def test_root_only_tree_is_plain_decoding():
    b = build_buffers([])
    assert b.size == 1 and b.nodes == 0 and b.num_heads_used == 0
    assert b.mask.tolist() == [[True]] and b.retrieve.tolist() == [[0]] and b.children.tolist() == [[-1]]


def _check_consistent(paths, b):
    """Mask = prefix relation, depth = path length, retrieval rows = root-to-leaf chains."""
    index = {(): 0, **{p: i + 1 for i, p in enumerate(paths)}}
    inv = {i: p for p, i in index.items()}
    for i in range(b.size):
        for j in range(b.size):
            assert bool(b.mask[i, j]) == (inv[i][: len(inv[j])] == inv[j])
        assert int(b.depth[i]) == len(inv[i])
    leaves = {p for p in index if not any(q[: len(p)] == p and len(q) > len(p) for q in index)}
    got = set()
    for row in b.retrieve.tolist():
        chain = [x for x in row if x >= 0]
        assert [len(inv[x]) for x in chain] == list(range(len(chain)))
        assert all(inv[chain[k]][:-1] == inv[chain[k - 1]] for k in range(1, len(chain)))
        got.add(inv[chain[-1]])
    assert got == leaves


def test_calibrated_tree_from_heads_folder_is_the_default(tmp_path):
    acc = [[0.6, 0.2, 0.1], [0.4, 0.15, 0.05], [0.3, 0.1, 0.05]]
    paths = sparse_tree(acc, 9)
    save_tree(tmp_path / "tree.json", paths, num_heads=3, accuracy=acc, source="calibrate")
    resolved = resolve_tree(None, num_heads=3, heads_folder=tmp_path)
    assert resolved.paths == paths and resolved.accuracy == acc
    b = build_buffers(resolved.paths)
    assert b.nodes == 9
    _check_consistent(resolved.paths, b)
    # an explicit spec still wins over the folder's tree.json
    assert resolve_tree("chain", 3, heads_folder=tmp_path).paths == [(0,), (0, 0), (0, 0, 0)]


def test_named_trees():
    assert resolve_tree("chain-2", 4).paths == [(0,), (0, 0)]
    cart = resolve_tree("3,2,1", 3).paths
    assert len(cart) == 3 + 6 + 6
    sparse = resolve_tree("sparse-12", 4)
    assert len(sparse.paths) == 12 and sparse.accuracy == default_accuracy(4)
    assert len(resolve_tree(None, 4).paths) == DEFAULT_NODES
    for spec in ("chain-2", "3,2,1", "sparse-12"):
        paths = resolve_tree(spec, 4).paths
        _check_consistent(paths, build_buffers(paths))


def test_bad_tree_specs_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown tree"):
        resolve_tree("bushy", 4)
    with pytest.raises(ConfigError, match="only 2 heads"):
        resolve_tree("3,2,2", 2)
    with pytest.raises(ConfigError, match="at least one head"):
        resolve_tree("chain-0", 4)
    with pytest.raises(ConfigError, match="at least one node"):
        resolve_tree("sparse-0", 4)
    with pytest.raises(ConfigError, match="not found"):
        resolve_tree(str(tmp_path / "missing.json"), 4)


def test_subtree_keeps_the_most_probable_nodes_and_stays_a_tree():
    acc = default_accuracy(4)
    full = sparse_tree(acc, 30)
    for n in (1, 5, 15, 29):
        sub = subtree(full, acc, n)
        assert len(sub) == n
        assert all(p[:-1] in set(sub) or len(p) == 1 for p in sub)
        # greedy sparse trees are nested: the n best nodes of a 30-node tree are the n-node sparse tree
        assert set(sub) == set(sparse_tree(acc, n))


def test_buffers_move_to_a_device():
    b = build_buffers(HAND).to("cpu")
    assert b.mask.device == torch.device("cpu") and b.paths == tuple(HAND)
