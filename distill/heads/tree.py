"""Medusa trees: the ``tree.json`` contract, Cartesian and calibrated sparse trees.

Terms
-----
path (node)
    a tuple of ranks ``(r_1, ..., r_d)``: the node whose token is head j's rank-r_j
    candidate at depth j (ranks 0-based; depth 1 is head 1, which guesses token t+2).
    The root, the base model's own next token, is not a node; a tree of N nodes
    verifies N + 1 tokens per forward pass.
tree
    a prefix-closed set of paths (every prefix of a path is in the set), stored
    sorted by (depth, path) — Medusa's ``medusa_choices`` with 0-based ranks.
accuracy table ``acc``
    ``acc[j][i]`` = probability that head j+1's rank-i candidate is the true token
    (measured by ``distill calibrate`` on held-out data), shape (K, I).
expected acceptance length
    tokens per decoding step if head events are independent:
    ``1 + Σ_{path} Π_j acc[j][r_j]`` (the 1 is the base model's own token).
sparse tree
    built greedily: repeatedly add the node, among those whose parent is already in
    the tree, with the highest product of accuracies, until the node budget is spent.

File ``tree.json``::

    {"format": "distill-tree/v1", "num_heads": K, "nodes": N, "paths": [[0], [1], [0, 0], ...],
     "expected_acceptance_length": 2.7, "accuracy": [[...], ...], "source": "calibrate"}

``accuracy`` and ``expected_acceptance_length`` are present when the tree was
calibrated; ``source`` says how it was made.
"""

from __future__ import annotations

import heapq
import itertools
import json
from pathlib import Path
from typing import Sequence

from distill.errors import ConfigError
from distill.store.atomic import atomic_write_json

TREE_FORMAT = "distill-tree/v1"
Path_ = tuple[int, ...]


def canonical(paths: Sequence[Sequence[int]]) -> list[Path_]:
    """Sort paths by (depth, ranks) and check they form a prefix-closed tree of distinct nodes."""
    out = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
    if len(out) != len(paths):
        raise ConfigError("tree has duplicate paths")
    members = set(out)
    for p in out:
        if not p or any(r < 0 for r in p):
            raise ConfigError(f"tree path {list(p)} must be a non-empty list of ranks >= 0")
        if len(p) > 1 and p[:-1] not in members:
            raise ConfigError(f"tree is not prefix-closed: {list(p)} has no parent {list(p[:-1])}")
    return out


def cartesian_tree(topk_per_head: Sequence[int]) -> list[Path_]:
    """Every path whose rank at depth j is below ``topk_per_head[j]`` (the full product tree)."""
    if not topk_per_head or any(k < 1 for k in topk_per_head):
        raise ConfigError(f"Cartesian tree needs a top-k >= 1 per head; got {list(topk_per_head)}")
    paths: list[Path_] = []
    for depth in range(1, len(topk_per_head) + 1):
        paths.extend(itertools.product(*(range(k) for k in topk_per_head[:depth])))
    return canonical(paths)


def parse_cartesian(spec: str) -> list[Path_]:
    """``"3,2,2,1"`` -> the Cartesian tree with top-3 of head 1, top-2 of heads 2-3, top-1 of head 4."""
    try:
        ks = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"a Cartesian tree spec is comma-separated integers like 3,2,2,1; got '{spec}'") from None
    return cartesian_tree(ks)


def path_probability(path: Sequence[int], acc: Sequence[Sequence[float]]) -> float:
    prob = 1.0
    for depth, rank in enumerate(path):
        if depth >= len(acc) or rank >= len(acc[depth]):
            return 0.0
        prob *= float(acc[depth][rank])
    return prob


def expected_acceptance_length(paths: Sequence[Sequence[int]], acc: Sequence[Sequence[float]]) -> float:
    """Tokens per step predicted for ``paths`` from the accuracy table (see module docstring)."""
    return 1.0 + sum(path_probability(p, acc) for p in paths)


def sparse_tree(acc: Sequence[Sequence[float]], nodes: int) -> list[Path_]:
    """The greedy sparse tree of ``nodes`` nodes for accuracy table ``acc`` (K heads x I ranks).

    Ties are broken towards shallower, lower-rank paths so the result is deterministic.
    """
    num_heads = len(acc)
    if nodes < 1 or num_heads < 1:
        raise ConfigError(f"a tree needs at least one node and one head; got {nodes} nodes, {num_heads} heads")
    ranks = len(acc[0])
    capacity = sum(ranks ** d for d in range(1, num_heads + 1))
    if nodes > capacity:
        raise ConfigError(f"{nodes} nodes exceed the {capacity} paths that {num_heads} heads x top-{ranks} allow")
    frontier: list[tuple[float, int, Path_]] = [(-path_probability((i,), acc), 1, (i,)) for i in range(ranks)]
    heapq.heapify(frontier)
    chosen: list[Path_] = []
    while len(chosen) < nodes:
        _, _, p = heapq.heappop(frontier)
        chosen.append(p)
        if len(p) < num_heads:
            for i in range(ranks):
                child = p + (i,)
                heapq.heappush(frontier, (-path_probability(child, acc), len(child), child))
    return canonical(chosen)


def save_tree(path: Path, paths: Sequence[Sequence[int]], num_heads: int, **extra) -> None:
    """Write ``tree.json`` atomically (``extra``: accuracy, expected_acceptance_length, source, ...)."""
    tree = canonical(paths)
    if max(len(p) for p in tree) > num_heads:
        raise ConfigError(f"tree is {max(len(p) for p in tree)} deep but there are only {num_heads} heads")
    doc = {"format": TREE_FORMAT, "num_heads": num_heads, "nodes": len(tree), "paths": [list(p) for p in tree], **extra}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, doc, indent=1)


def load_tree(path: Path) -> dict:
    """Read and check a ``tree.json``; returns the document with ``paths`` as canonical tuples."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"tree file {path} not found (make one with `distill calibrate`)")
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != TREE_FORMAT:
        raise ConfigError(f"{path} is not a {TREE_FORMAT} tree file")
    doc["paths"] = canonical(doc["paths"])
    if doc["nodes"] != len(doc["paths"]):
        raise ConfigError(f"{path}: 'nodes' says {doc['nodes']} but there are {len(doc['paths'])} paths")
    return doc
