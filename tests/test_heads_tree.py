"""The tree.json contract: canonical paths, Cartesian and greedy sparse trees, expected acceptance length."""

from __future__ import annotations

import itertools
import json

import pytest

from distill.errors import ConfigError
from distill.heads.tree import (
    canonical,
    cartesian_tree,
    expected_acceptance_length,
    load_tree,
    parse_cartesian,
    save_tree,
    sparse_tree,
)

# A made-up accuracy table: 3 heads x 4 ranks, decaying with depth and rank.
ACC = [[0.6, 0.15, 0.06, 0.03], [0.4, 0.12, 0.05, 0.02], [0.25, 0.08, 0.04, 0.01]]


def test_cartesian_tree_of_2_2_has_every_prefix_in_depth_order():
    assert cartesian_tree([2, 2]) == [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(parse_cartesian("3,2,2,1")) == 3 + 6 + 12 + 12


def test_expected_acceptance_length_of_a_chain_is_one_plus_cumulative_products():
    chain = [(0,), (0, 0), (0, 0, 0)]
    assert expected_acceptance_length(chain, ACC) == pytest.approx(1 + 0.6 + 0.6 * 0.4 + 0.6 * 0.4 * 0.25)


@pytest.mark.parametrize("nodes", [1, 5, 12, 30])
def test_sparse_tree_is_prefix_closed_sized_and_optimal_among_all_trees_of_its_size(nodes):
    tree = sparse_tree(ACC, nodes)
    assert len(tree) == nodes and canonical(tree) == tree
    # Path probabilities shrink along a path, so the best tree of N nodes is the N most probable
    # paths; check the greedy tree reaches that bound by brute force over all paths.
    every = [p for d in range(1, 4) for p in itertools.product(range(4), repeat=d)]
    best = sorted((expected_acceptance_length([p], ACC) - 1 for p in every), reverse=True)[:nodes]
    assert expected_acceptance_length(tree, ACC) == pytest.approx(1 + sum(best))


def test_sparse_tree_beats_or_ties_the_cartesian_tree_of_the_same_size():
    cart = cartesian_tree([2, 2, 1])  # 2 + 4 + 4 = 10 nodes
    assert expected_acceptance_length(sparse_tree(ACC, len(cart)), ACC) >= expected_acceptance_length(cart, ACC)


def test_tree_file_round_trips_and_bad_trees_are_refused(tmp_path):
    path = tmp_path / "tree.json"
    save_tree(path, [(0, 0), (0,), (1,)], num_heads=3, source="test")
    doc = load_tree(path)
    assert doc["paths"] == [(0,), (1,), (0, 0)] and doc["nodes"] == 3 and doc["source"] == "test"
    with pytest.raises(ConfigError, match="prefix-closed"):
        canonical([(0, 1)])
    with pytest.raises(ConfigError, match="only 1 heads"):
        save_tree(path, [(0,), (0, 0)], num_heads=1)
    path.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ConfigError, match="not a distill-tree/v1"):
        load_tree(path)
    with pytest.raises(ConfigError, match="exceed"):
        sparse_tree(ACC, 100)
