"""Tree buffers: everything one Medusa verification forward needs, built once per tree.

Terms (paths and trees as in :mod:`distill.heads.tree`)
-----
tree position
    index of a token in the verification input: 0 is the root (the base model's own
    next token, already decided), 1..N are the tree's paths in canonical order
    (sorted by depth, then ranks), so a parent always comes before its children.
depth
    0 for the root, ``len(path)`` for a node; the node's position id is ``past + depth``.
tree mask
    ``mask[i, j]`` is True when position j is position i or one of its ancestors:
    the only tree tokens token i may attend to (besides the committed cache).
candidate index
    a node with path ``(r_1, ..., r_d)`` carries head d's rank-``r_d`` token;
    ``cand_index = (d - 1) * I + r_d`` indexes the flattened ``(K, I)`` table of the
    heads' top-I tokens (``I`` = largest rank used + 1).
retrieval indices
    ``retrieve[p]`` lists the tree positions along leaf path p from the root
    (``[0, a_1, ..., a_d]``), padded with ``-1`` to the deepest path: (P, D + 1).
children
    ``children[i]`` lists the tree positions of node i's children in rank order,
    padded with ``-1``: (T, C).
per-row trees
    a proposer that drafts a different tree for every row (EAGLE's dynamic tree) gives
    the same buffers with a leading batch axis: depth and parent (B, T), mask (B, T, T),
    retrieve (B, P, D + 1), children (B, T, C), built by :func:`row_buffers` from each
    row's parent array. :meth:`TreeBuffers.rows` gives every tree that form (a view), so
    the verification code reads one layout.
uneven chains
    per-row chains of different lengths in one step of T positions (:func:`chain_buffers`):
    row b's nodes 1..n_b are drafted, its positions after n_b are filler that no path and no
    children list reaches, so acceptance never judges them; a forward may skip them.

Named trees (``resolve_tree``)
-----
``chain`` / ``chain-<K>``
    top-1 of every head (``K`` = the heads' count unless given): K nodes.
``"3,2,2,1"``
    a Cartesian tree (``distill.heads.tree.parse_cartesian``).
``sparse-<N>``
    the greedy sparse tree of N nodes (``distill.heads.tree.sparse_tree``) built from
    :data:`DEFAULT_ACCURACY`, or from the heads' calibrated accuracy when there is one.
a path to ``tree.json``
    a tree written by ``distill calibrate``.
``None``
    the heads folder's ``tree.json`` when it has one, else ``sparse-<DEFAULT_NODES>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from distill.errors import ConfigError
from distill.heads.tree import canonical, load_tree, parse_cartesian, path_probability, sparse_tree

#: Head top-1 accuracies reported for Vicuna-7B Medusa-1 heads (Cai et al. 2024, "Medusa", Fig. 2 / Sec. 3.3.1:
#: roughly 0.56, 0.32, 0.20, 0.15 for heads 1-4); rank i's accuracy is modelled as top-1 * 0.5**i (our assumption:
#: the top-k curves in the paper flatten after a few ranks, halving per rank is a round stand-in). Used only to shape
#: named sparse trees when no calibrated ``tree.json`` is at hand.
DEFAULT_TOP1 = (0.56, 0.32, 0.20, 0.15, 0.11)
DEFAULT_RANK_DECAY = 0.5
DEFAULT_RANKS = 8
DEFAULT_NODES = 24


def default_accuracy(num_heads: int, ranks: int = DEFAULT_RANKS) -> list[list[float]]:
    """The (K, I) accuracy table behind the named sparse trees (see :data:`DEFAULT_TOP1`)."""
    top1 = list(DEFAULT_TOP1[:num_heads])
    while len(top1) < num_heads:  # heads beyond the table: keep decaying like heads 4-5
        top1.append(top1[-1] * 0.75)
    return [[a * DEFAULT_RANK_DECAY**i for i in range(ranks)] for a in top1]


@dataclass(frozen=True)
class TreeBuffers:
    """Index tensors for one tree, or one tree per row (a leading (B,) axis; see "per-row trees"); T = nodes + 1."""

    paths: tuple[tuple[int, ...], ...]  # the shared tree's paths; () for per-row trees
    depth: torch.Tensor  # (T,) long, or (B, T)
    parent: torch.Tensor  # (T,) long, -1 for the root, or (B, T)
    mask: torch.Tensor  # (T, T) bool, ancestor-or-self, or (B, T, T)
    cand_index: torch.Tensor  # (T,) long into the flattened (K, I) head top-I table; 0 for the root (unused)
    retrieve: torch.Tensor  # (P, D + 1) long, -1 padded, or (B, P, D + 1)
    children: torch.Tensor  # (T, C) long, -1 padded (C >= 1), or (B, T, C)
    num_heads_used: int  # D: deepest path
    max_rank: int  # I: ranks per head the heads must supply

    @property
    def size(self) -> int:
        """T: tokens in one verification forward (nodes + root)."""
        return int(self.depth.shape[-1])

    @property
    def nodes(self) -> int:
        return self.size - 1

    @property
    def is_chain(self) -> bool:
        """Whether every row's tree is a chain, each node the parent of the next (a parent comes before its children,
        so the last node at depth ``nodes`` means every node sits one deeper than the one before). Reads the depths
        on the host."""
        return bool((self.depth[..., -1] == self.nodes).all())

    @property
    def per_row(self) -> bool:
        """Whether every row has its own tree (a leading batch axis)."""
        return self.depth.dim() == 2

    def rows(self, batch: int) -> "TreeBuffers":
        """The per-row form for ``batch`` rows: per-row buffers as they are, a shared tree expanded (views, no copies)."""
        if self.per_row:
            if self.depth.shape[0] != batch:
                raise ValueError(f"per-row tree buffers hold {self.depth.shape[0]} rows, not {batch}")
            return self
        grow = {k: getattr(self, k).expand(batch, *getattr(self, k).shape) for k in ("depth", "parent", "mask", "retrieve", "children")}
        return TreeBuffers(paths=self.paths, cand_index=self.cand_index, num_heads_used=self.num_heads_used,
                           max_rank=self.max_rank, **grow)

    def take(self, index: torch.Tensor) -> "TreeBuffers":
        """The trees of batch rows ``index`` (B',): per-row buffers indexed, a shared tree as it is."""
        if not self.per_row:
            return self
        part = {k: getattr(self, k)[index] for k in ("depth", "parent", "mask", "retrieve", "children")}
        return TreeBuffers(paths=self.paths, cand_index=self.cand_index, num_heads_used=self.num_heads_used,
                           max_rank=self.max_rank, **part)

    def to(self, device: str | torch.device) -> "TreeBuffers":
        move = {k: getattr(self, k).to(device) for k in ("depth", "parent", "mask", "cand_index", "retrieve", "children")}
        return TreeBuffers(paths=self.paths, num_heads_used=self.num_heads_used, max_rank=self.max_rank, **move)


def build_buffers(paths: Sequence[Sequence[int]]) -> TreeBuffers:
    """Buffers for a prefix-closed tree (possibly empty: the root alone, i.e. plain decoding)."""
    tree = canonical(paths) if paths else []
    T = len(tree) + 1
    index = {(): 0}
    for i, p in enumerate(tree, start=1):
        index[p] = i
    depth = torch.zeros(T, dtype=torch.long)
    parent = torch.full((T,), -1, dtype=torch.long)
    mask = torch.zeros(T, T, dtype=torch.bool)
    mask[0, 0] = True
    max_rank = max((max(p) for p in tree), default=-1) + 1
    D = max((len(p) for p in tree), default=0)
    cand_index = torch.zeros(T, dtype=torch.long)
    kids: list[list[int]] = [[] for _ in range(T)]
    for p, i in index.items():
        if not p:
            continue
        depth[i] = len(p)
        parent[i] = index[p[:-1]]
        cand_index[i] = (len(p) - 1) * max_rank + p[-1]
        for k in range(len(p) + 1):
            mask[i, index[p[:k]]] = True
        kids[index[p[:-1]]].append(i)  # canonical order = rank order among siblings
    leaves = [p for p in [()] + tree if not kids[index[p]]]
    retrieve = torch.full((len(leaves), D + 1), -1, dtype=torch.long)
    for r, p in enumerate(leaves):
        for k in range(len(p) + 1):
            retrieve[r, k] = index[p[:k]]
    C = max(1, max(len(k) for k in kids))
    children = torch.full((T, C), -1, dtype=torch.long)
    for i, k in enumerate(kids):
        children[i, : len(k)] = torch.tensor(k, dtype=torch.long)
    return TreeBuffers(tuple(tree), depth, parent, mask, cand_index, retrieve, children, D, max(max_rank, 0))


def row_buffers(parent: torch.Tensor, depth: torch.Tensor, max_depth: int, max_children: int) -> TreeBuffers:
    """Per-row tree buffers from each row's parent array, built with tensor ops on its device (no host sync).

    parent (B, T) long: tree position of each node's parent, -1 at the root (position 0);
    every parent comes before its children. depth (B, T) long: 0 at the root, the parent's
    + 1 elsewhere, at most ``max_depth`` (D). No node has more than ``max_children`` (C)
    children. Children keep position order; ``retrieve`` lists the path to every position
    (P = T, not only the leaves), so the longest accepted path is found as for a shared tree;
    equally long accepted paths go to the one ending at the lowest position.
    """
    B, T = parent.shape
    dev = parent.device
    D, C = max_depth, max(1, max_children)
    up = parent.clamp(min=0)  # (B, T); the root points at itself
    eye = torch.eye(T, dtype=torch.bool, device=dev).expand(B, T, T)
    mask = eye.clone()  # (B, T, T)
    for _ in range(D):  # after k passes every node of depth <= k has all its ancestors
        mask = eye | mask.gather(1, up[:, :, None].expand(B, T, T))
    pos = torch.arange(T, device=dev)
    before = (parent[:, :, None] == parent[:, None, :]) & (pos[None, None, :] < pos[None, :, None])  # (B, T, T)
    rank = before.sum(-1)  # (B, T): earlier siblings
    trash = T * C
    flat = torch.where((depth > 0) & (rank < C), up * C + rank, torch.full_like(rank, trash))  # (B, T)
    kids = torch.full((B, trash + 1), -1, dtype=torch.long, device=dev)
    kids.scatter_(1, flat, pos.expand(B, T).contiguous())
    children = kids[:, :trash].view(B, T, C)
    column = torch.where(mask, depth[:, None, :], torch.full_like(mask, D + 1, dtype=torch.long))  # (B, T, T)
    retrieve = torch.full((B, T, D + 2), -1, dtype=torch.long, device=dev)
    retrieve.scatter_(2, column, pos.expand(B, T, T).contiguous())
    return TreeBuffers(paths=(), depth=depth, parent=parent, mask=mask, cand_index=torch.zeros(T, dtype=torch.long, device=dev),
                       retrieve=retrieve[:, :, : D + 1], children=children, num_heads_used=D, max_rank=C)


def chain_buffers(nodes: Sequence[int], size: int, device: str | torch.device = "cpu") -> TreeBuffers:
    """Per-row chains of ``size`` positions of which row b drafts its first ``nodes[b]`` (module docstring, "uneven
    chains"): depth = position, each node the child of the one before, built without :func:`row_buffers`' passes."""
    B, T = len(nodes), size
    pos = torch.arange(T, device=device)
    n = torch.tensor(list(nodes), dtype=torch.long, device=device)[:, None]  # (B, 1)
    retrieve = torch.where(pos[None] <= n, pos[None], -1)[:, None, :]  # (B, 1, T): the one path, root .. node n_b
    children = torch.where(pos[None] < n, pos[None] + 1, -1)[:, :, None]  # (B, T, 1)
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T).clone()
    return TreeBuffers(paths=(), depth=pos.expand(B, T).clone(), parent=(pos - 1).expand(B, T).clone(), mask=mask,
                       cand_index=torch.zeros(T, dtype=torch.long, device=device), retrieve=retrieve, children=children,
                       num_heads_used=T - 1, max_rank=1)


_CHAIN = re.compile(r"^chain(?:-(\d+))?$")
_SPARSE = re.compile(r"^sparse-(\d+)$")
_CARTESIAN = re.compile(r"^\s*\d+(\s*,\s*\d+)*\s*$")


@dataclass(frozen=True)
class ResolvedTree:
    paths: list[tuple[int, ...]]
    accuracy: list[list[float]]  # (K, I) table used to rank nodes (calibrated or default)
    source: str  # what the tree came from, for logs and stats


def resolve_tree(spec: str | None, num_heads: int, heads_folder: Path | None = None) -> ResolvedTree:
    """Turn ``EngineConfig.tree`` into paths (see the module docstring for the accepted specs)."""
    calibrated = None
    if heads_folder is not None and (Path(heads_folder) / "tree.json").is_file():
        calibrated = load_tree(Path(heads_folder) / "tree.json")
    acc = (calibrated or {}).get("accuracy") or default_accuracy(num_heads)
    if spec is None:
        if calibrated is not None:
            return _checked(ResolvedTree(list(calibrated["paths"]), acc, f"{heads_folder}/tree.json"), num_heads)
        spec = f"sparse-{DEFAULT_NODES}"
    spec = str(spec).strip()
    if m := _CHAIN.match(spec):
        k = int(m.group(1) or num_heads)
        if k < 1:
            raise ConfigError(f"tree '{spec}': a chain needs at least one head")
        return _checked(ResolvedTree([(0,) * d for d in range(1, k + 1)], acc, spec), num_heads)
    if m := _SPARSE.match(spec):
        n = int(m.group(1))
        return _checked(ResolvedTree(sparse_tree(acc, n), acc, spec), num_heads)
    if _CARTESIAN.match(spec):
        return _checked(ResolvedTree(parse_cartesian(spec), acc, f"cartesian {spec}"), num_heads)
    path = Path(spec).expanduser()
    if path.suffix == ".json" or path.exists():
        doc = load_tree(path)
        return _checked(ResolvedTree(list(doc["paths"]), doc.get("accuracy") or acc, str(path)), num_heads)
    raise ConfigError(
        f"unknown tree '{spec}': use chain, chain-K, sparse-N, a Cartesian spec like 3,2,2,1, or a tree.json path"
    )


def _checked(tree: ResolvedTree, num_heads: int) -> ResolvedTree:
    deepest = max(len(p) for p in tree.paths)
    if deepest > num_heads:
        raise ConfigError(f"tree '{tree.source}' is {deepest} deep but the heads have only {num_heads} heads")
    return tree


def subtree(paths: Sequence[tuple[int, ...]], accuracy: Sequence[Sequence[float]], nodes: int) -> list[tuple[int, ...]]:
    """The ``nodes`` most probable nodes of a tree (by path probability under ``accuracy``), still prefix-closed.

    A child's probability never exceeds its parent's (a product of accuracies <= 1); ties keep the
    canonical order, where a parent comes first, so every prefix of the ranking is a tree.
    """
    tree = canonical(paths)
    if nodes >= len(tree):
        return tree
    order = sorted(range(len(tree)), key=lambda i: (-path_probability(tree[i], accuracy), i))
    chosen = {tree[i] for i in order[: max(nodes, 0)]}
    # Paths outside the accuracy table score 0; keep closure explicitly for them.
    closed = [p for p in tree if p in chosen and all(p[:k] in chosen for k in range(1, len(p)))]
    return closed


__all__ = [
    "DEFAULT_NODES",
    "DEFAULT_TOP1",
    "ResolvedTree",
    "TreeBuffers",
    "build_buffers",
    "default_accuracy",
    "resolve_tree",
    "row_buffers",
    "subtree",
]
