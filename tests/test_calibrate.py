"""Calibration: per-head accuracy on held-out data, greedy sparse tree vs Cartesian trees, files and plots."""

from __future__ import annotations

import json

import pytest

from distill.heads.tree import canonical, cartesian_tree, expected_acceptance_length, load_tree, sparse_tree
from distill.train.calibrate import CalibrateConfig, best_cartesian_of_size, calibrate


def test_best_cartesian_of_a_size_is_found_and_never_beats_the_greedy_tree():
    acc = [[0.6, 0.15, 0.05, 0.03], [0.35, 0.12, 0.06, 0.02], [0.2, 0.1, 0.05, 0.02]]
    for nodes in (3, 6, 9, 12):
        spec, eal = best_cartesian_of_size(acc, nodes)
        assert len(cartesian_tree(spec)) == nodes
        assert expected_acceptance_length(sparse_tree(acc, nodes), acc) >= eal - 1e-12
    assert best_cartesian_of_size(acc, 1) == ([1], pytest.approx(1.6))


def test_calibrate_writes_a_prefix_closed_tree_that_beats_the_cartesian_tree(trained_heads, real_shards, tmp_path):
    out = tmp_path / "cal"
    r = calibrate(CalibrateConfig(heads=str(trained_heads), data=str(real_shards), out=str(out), nodes=12, max_len=64,
                                  max_tokens=800))
    doc = load_tree(out / "tree.json")
    paths = doc["paths"]
    assert len(paths) == doc["nodes"] == 12 == r.nodes
    assert canonical(paths) == paths  # prefix-closed, sorted, distinct
    assert max(len(p) for p in paths) <= 2 and doc["source"] == "calibrate"
    acc = doc["accuracy"]
    assert len(acc) == 2 and all(len(row) == 10 for row in acc)
    assert all(0 <= a <= 1 for row in acc for a in row) and all(sum(row) <= 1 + 1e-9 for row in acc)
    eal = expected_acceptance_length(paths, acc)
    assert doc["expected_acceptance_length"] == pytest.approx(eal)
    spec, cart_eal = r.cartesian["spec"], r.cartesian["expected_acceptance_length"]
    assert len(cartesian_tree(spec)) == 12 and eal >= cart_eal
    # the square-ish Cartesian trees of 12 nodes, e.g. top-3 x top-3 (3 + 9)
    assert eal >= expected_acceptance_length(cartesian_tree([3, 3]), acc)
    cal = json.loads((out / "calibration.json").read_text())
    assert cal["accuracy"] == acc and len(cal["curve"]) == 12 and cal["curve"][-1] == pytest.approx(eal)
    assert all(b >= a for a, b in zip(cal["curve"], cal["curve"][1:]))
    assert min(cal["positions"]) > 100
    for png in ("tree.png", "acceptance.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plot_that_fails_while_writing_leaves_the_old_png_whole(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from distill.train.calibrate import plot_curve, plot_tree

    curve, acc = [1.0, 1.5, 1.7], [[0.6, 0.2], [0.4, 0.1]]
    plot_curve(curve, tmp_path / "acceptance.png")
    plot_tree(sparse_tree(acc, 3), acc, tmp_path / "tree.png")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["acceptance.png", "tree.png"]

    def torn_savefig(self, fname, *args, **kwargs):  # half a PNG, then the writer dies
        with open(fname, "wb") as f:
            f.write(b"\x89PNG\r\n")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", torn_savefig)
    with pytest.raises(OSError, match="disk full"):
        plot_curve(curve + [1.8], tmp_path / "acceptance.png")
    with pytest.raises(OSError, match="disk full"):
        plot_tree(sparse_tree(acc, 2), acc, tmp_path / "tree.png")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no torn PNG, no temp file left
