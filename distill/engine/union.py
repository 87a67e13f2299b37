"""Several proposers' trees merged into one per row, verified in one target forward.

The lookup proposer (:mod:`distill.engine.lookup`) drafts well where the model repeats its
prompt, itself or its earlier replies, and nothing elsewhere; a trained drafter
(:mod:`distill.engine.eagle`, :mod:`distill.engine.medusa`) drafts everywhere, less surely.
Their union accepts at each step the longest path either tree holds (and more where the two
share a prefix), for the cost of the verification's extra rows and the drafter's passes.

Terms
-----
parts
    the proposers merged, in order; the first's nodes keep the first tree positions.
budget
    a step's ``nodes`` are shared among the parts in proportion to their full trees
    (``max_nodes``), each part at least one node while the budget lasts; the full tree is
    every part's full tree.
merged tree
    per row, the trie of every part's paths: a node another part already drafted (the same
    path of tokens) is kept once, so the merged tree holds at most the parts' nodes summed.
    Siblings stay distinct tokens decided by the context and drafts alone: point-mass
    proposals, exact under every acceptance rule. Rows are padded to one size with filler
    children of the root (:func:`~distill.engine.proposer.host_proposal`). Each part drafts
    deterministically (a sampled EAGLE tree's draft distributions do not carry over to a
    merged one), so ``draft_prob`` and ``draft`` are None.
features
    the parts that read the target's features must agree on the layers
    (``feature_layers``); every part's accept hook sees the merged proposal, whose accepted
    path holds tokens and features as its own would.
expected tokens per step, proposal cost
    at a budget, the best part's expected tokens at its share (a floor for the union's),
    and the parts' costs summed.
"""

from __future__ import annotations

import torch

from distill.engine.acceptance import Acceptance
from distill.engine.policy import candidate_sizes
from distill.engine.proposer import DraftSampling, Proposal, Proposer, host_proposal
from distill.errors import ConfigError


class UnionState:
    """The parts' draft states, moved together."""

    def __init__(self, states: list):
        self.states = states

    def keep(self, rows: list[int], used: int) -> None:
        for s in self.states:
            s.keep(rows, used)

    def join(self, other: "UnionState", used: int) -> None:
        for s, o in zip(self.states, other.states):
            s.join(o, used)


def shares(nodes: int, sizes: list[int]) -> list[int]:
    """``nodes`` shared among parts whose full trees hold ``sizes`` nodes: in proportion, each part at least one node
    while the budget lasts, never more than its own full tree (module docstring: budget)."""
    total = sum(sizes)
    nodes = min(nodes, total)
    out = [min(s, max(1, nodes * s // total)) if nodes > 0 else 0 for s in sizes]
    while sum(out) > nodes:  # the minimum of one each overdrew a small budget: take back from the last parts
        i = max(j for j, n in enumerate(out) if n > 0)
        out[i] -= 1
    for i, s in enumerate(sizes):  # rounding left nodes over: to the parts in order, up to their full trees
        add = min(s - out[i], nodes - sum(out))
        out[i] += add
    return out


def merge(trees: list[list[tuple[tuple[int, ...], int]]]) -> list[tuple[int, int]]:
    """One row's merged tree from its parts' trees, each given as (path, token) per node in parent-first order (path:
    the node's tokens from the root, its own last): (parent position, token) per node, parents first, a path kept once."""
    where: dict[tuple[int, ...], int] = {(): 0}
    out: list[tuple[int, int]] = []
    for tree in trees:
        for path, tok in tree:
            if path in where:
                continue
            out.append((where[path[:-1]], tok))
            where[path] = len(out)
    return out


def paths(proposal: Proposal, batch: int) -> list[list[tuple[tuple[int, ...], int]]]:
    """Per row of ``proposal``, (path, token) of each drafted node in tree order (the root excluded)."""
    parent = proposal.buffers.rows(batch).parent.tolist()
    tokens = proposal.tokens.tolist()
    out = []
    for par, tok in zip(parent, tokens):
        path_of: list[tuple[int, ...]] = [()]
        row = []
        for i in range(1, len(tok)):
            path = path_of[par[i]] + (tok[i],)
            path_of.append(path)
            row.append((path, tok[i]))
        out.append(row)
    return out


class Union:
    """Proposers' trees merged per row (module docstring); a :class:`~distill.engine.proposer.Proposer`."""

    def __init__(self, parts: list[Proposer]):
        if len(parts) < 2:
            raise ConfigError("a union of proposers needs two or more of them")
        layers = {p.feature_layers for p in parts if p.feature_layers is not None}
        if len(layers) > 1:
            raise ConfigError(f"the proposers read different target features ({sorted(layers)}): they cannot share a forward")
        self.parts = parts
        self.feature_layers = next(iter(layers)) if layers else None
        self.max_nodes = sum(p.max_nodes for p in parts)
        self.name = "+".join(p.name for p in parts)
        self._sizes = [p.max_nodes for p in parts]
        self._part_taus = [p.taus() for p in parts]

    @property
    def datastore(self):
        """The lookup part's datastore (None: none, or no lookup part)."""
        return next((p.datastore for p in self.parts if getattr(p, "datastore", None) is not None), None)

    @property
    def history(self):
        """The lookup part's history of earlier replies (None: none, or no lookup part)."""
        return next((p.history for p in self.parts if getattr(p, "history", None) is not None), None)

    def use_graphs(self, graphs) -> None:
        """The parts that replay CUDA graphs (an EAGLE drafter's passes) record into ``graphs``."""
        for p in self.parts:
            if hasattr(p, "use_graphs"):
                p.use_graphs(graphs)

    @property
    def accuracy(self) -> list[list[float]]:
        """The first part with a per-depth table's (what ``/metrics`` and the benchmark report), else none."""
        return next((p.accuracy for p in self.parts if getattr(p, "accuracy", None)), [])

    def _tau_at(self, i: int, n: int) -> float:
        table = self._part_taus[i]
        return max((v for k, v in table.items() if k <= n), default=1.0)

    def taus(self) -> dict[int, float]:
        return {n: max(self._tau_at(i, k) for i, k in enumerate(shares(n, self._sizes)))
                for n in candidate_sizes(self.max_nodes) if n}

    def proposal_cost(self, nodes: int, forward_weights: int) -> float:
        return sum(p.proposal_cost(k, forward_weights) for p, k in zip(self.parts, shares(nodes, self._sizes)) if k)

    def start(self, features: torch.Tensor, ids: torch.Tensor, lengths: list[int], root: torch.Tensor, slots: int,
              greedy: list[bool] | None = None) -> UnionState:
        return UnionState([p.start(features, ids, lengths, root, slots, greedy) for p in self.parts])

    def forget(self) -> None:
        """What each part learnt from earlier requests, cleared (the lookup's history)."""
        for p in self.parts:
            if hasattr(p, "forget"):
                p.forget()

    def propose(self, state: UnionState, root: torch.Tensor, end: torch.Tensor, longest: int, nodes: int,
                sampling: DraftSampling | None = None) -> Proposal:
        B = root.shape[0]
        drafted = [paths(p.propose(s, root, end, longest, k), B)
                   for p, s, k in zip(self.parts, state.states, shares(nodes, self._sizes)) if k > 0]
        return host_proposal(root, [merge([d[b] for d in drafted]) for b in range(B)])

    def commit(self, state: UnionState, proposal: Proposal, features: torch.Tensor, acc: Acceptance, ends: list[int],
               lengths: list[int]) -> None:
        for p, s in zip(self.parts, state.states):
            p.commit(s, proposal, features, acc, ends, lengths)


__all__ = ["Union", "UnionState", "merge", "shares"]
