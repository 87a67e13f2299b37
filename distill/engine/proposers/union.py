"""Several proposers' trees merged into one per row, verified in one target forward.

The lookup proposer (:mod:`distill.engine.proposers.lookup`) drafts well where the model repeats its
prompt, itself or its earlier replies, and nothing elsewhere; a trained drafter
(:mod:`distill.engine.proposers.eagle`, :mod:`distill.engine.proposers.medusa`) drafts everywhere, less surely.
Their union accepts at each step the longest path either tree holds (and more where the two
share a prefix), for the cost of the verification's extra rows and the drafter's passes.

Terms
-----
parts
    the proposers merged, in order; the first's nodes keep the first tree positions.
budget
    a step's ``nodes`` are shared among the parts by what they are expected to add: of every
    way to give each part one of its own tree sizes (or none) within the budget, the one with
    the most expected tokens per step for its proposal cost (:func:`allocate`). A small budget
    can go to one part alone (the lookup, which drafts for free, where the drafter's passes
    cost more than they add); the full tree is every part's full tree. The policy chooses among
    the union of the parts' sizes and the halvings of the full tree.
merged tree
    per row, the trie of every part's paths: a node another part already drafted (the same
    path of tokens) is kept once, so the merged tree holds at most the parts' nodes summed.
    Siblings stay distinct tokens decided by the context and drafts alone: point-mass
    proposals, exact under every acceptance rule. Rows are padded to one size with filler
    children of the root (:func:`~distill.engine.proposers.base.host_proposal`). Each part drafts
    deterministically (a sampled EAGLE tree's draft distributions do not carry over to a
    merged one), so ``draft_prob`` and ``draft`` are None.
features
    the parts that read the target's features must agree on the layers
    (``feature_layers``); every part's accept hook sees the merged proposal, whose accepted
    path holds tokens and features as its own would.
expected tokens per step
    the parts' acceptances taken as independent, each geometric with its own mean: a part
    expected to accept ``m = τ − 1`` drafts a step accepts at least ``d`` of them with
    probability ``q^d``, ``q = m / (1 + m)``, and the union at least ``d`` unless every part
    falls short: ``τ = 1 + Σ_d (1 − Π (1 − q_i^d))`` (:func:`union_tau`). For a lookup
    proposer and an EAGLE-3 drafter on MT-Bench it predicts the union's tokens per step closely.
    Measured: BENCHMARKS.md, "The lookup proposer".
proposal cost
    the parts' costs at their shares, summed.
measured acceptance
    each step, every part that drafted is credited with the drafts it would have had accepted
    alone: the longest accepted prefix among its own paths (exact under greedy acceptance). Per
    part, Σ credited / Σ (τ(k) − 1) at its share ``k`` (from :data:`PRIOR` pseudo-drafts at
    ratio 1, decaying with a half-life of :data:`HALFLIFE` row-steps) scales its table's extra
    tokens, and every :data:`REALLOCATE_EVERY` row-steps the shares and expected tokens are
    computed again from the scaled tables; ``revision`` counts the changes (the engine then
    prices its sizes again). A lookup that accepts more than its default table on this traffic
    takes the small budgets from a drafter that accepts less than its calibration said.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch

from distill.engine.acceptance import Acceptance
from distill.engine.policy import candidate_sizes
from distill.engine.proposers.base import DraftSampling, Proposal, Proposer, host_proposal
from distill.errors import ConfigError


#: Measured acceptance (module docstring): pseudo-drafts of the prior, half-life and reallocation period in row-steps.
PRIOR, HALFLIFE, REALLOCATE_EVERY = 8.0, 512.0, 64


class UnionState:
    """The parts' draft states, moved together, and what each part drafted in the last step (per row, its paths)."""

    def __init__(self, states: list):
        self.states = states
        self.drafted: list[tuple[int, int, list[set[tuple[int, ...]]]]] = []  # (part, nodes, per-row paths)

    def keep(self, rows: list[int], used: int) -> None:
        for s in self.states:
            s.keep(rows, used)

    def join(self, other: "UnionState", used: int) -> None:
        for s, o in zip(self.states, other.states):
            s.join(o, used)


def union_tau(taus: Sequence[float]) -> float:
    """Expected tokens per step of a merged tree whose parts alone expect ``taus`` (module docstring)."""
    qs = [(t - 1.0) / t for t in taus if t > 1.0]  # q = m / (1 + m), m = t - 1
    if not qs:
        return 1.0
    total, d, top = 0.0, 1, max(qs)
    while top**d > 1e-9 and d <= 10_000:
        miss = 1.0
        for q in qs:
            miss *= 1.0 - q**d
        total += 1.0 - miss
        d += 1
    return 1.0 + total


def allocate(nodes: int, taus: Sequence[dict[int, float]], sizes: Sequence[int],
             costs: Sequence[Callable[[int], float]] | None = None) -> tuple[int, ...]:
    """``nodes`` shared among parts (module docstring: budget): each part one of its sizes in ``taus`` (size -> its
    expected tokens per step) or none, the most :func:`union_tau` per unit of ``1 + Σ cost(k)`` (a one-row forward's
    time) within the budget; fewer nodes where two ways tie. ``nodes`` at or over the full trees: ``sizes``."""
    if nodes >= sum(sizes):
        return tuple(sizes)
    if nodes <= 0:
        return tuple(0 for _ in sizes)
    costs = costs or [lambda k: 0.0] * len(sizes)
    options = [[0] + sorted(k for k in t if 0 < k <= nodes) for t in taus]
    best, key = tuple(0 for _ in sizes), (1.0, 0)
    for ks in itertools.product(*options):
        used = sum(ks)
        if used == 0 or used > nodes:
            continue
        value = union_tau([t[k] for t, k in zip(taus, ks) if k]) / (1.0 + sum(c(k) for c, k in zip(costs, ks) if k))
        if value > key[0] * (1 + 1e-9) or (abs(value - key[0]) <= 1e-9 * key[0] and used < key[1]):
            best, key = ks, (value, used)
    return best


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
    """Proposers' trees merged per row (module docstring); a :class:`~distill.engine.proposers.base.Proposer`."""

    def __init__(self, parts: list[Proposer], forward_weights: int | None = None):
        if len(parts) < 2:
            raise ConfigError("a union of proposers needs two or more of them")
        layers = {p.feature_layers for p in parts if p.feature_layers is not None}
        if len(layers) > 1:
            raise ConfigError(f"the proposers read different target features ({sorted(layers)}): they cannot share a forward")
        self.parts = parts
        self.feature_layers = next(iter(layers)) if layers else None
        self.max_nodes = sum(p.max_nodes for p in parts)
        self.name = "+".join(p.name for p in parts)
        self.forward_weights = forward_weights  # the target's, pricing the parts' proposals (None: free)
        sizes = [p.max_nodes for p in parts]
        part_taus = [p.taus() for p in parts]
        costs = [(lambda k, p=p: p.proposal_cost(k, forward_weights)) for p in parts] if forward_weights else None
        keys = {n for n in candidate_sizes(self.max_nodes) if n} | {k for t in part_taus for k in t if k}
        self._keys, self._sizes, self._costs = sorted(keys), sizes, costs
        self._part_taus = part_taus  # each part's own table; the measured ratios scale it
        self._credited = [PRIOR] * len(parts)  # Σ drafts each part would have had accepted (decayed, prior included)
        self._expected = [PRIOR] * len(parts)  # Σ (τ(k) - 1) of the same steps
        self._decay = 0.5 ** (1.0 / HALFLIFE)
        self._since = 0  # row-steps since the shares were last computed
        self.revision = 0
        self._allocate()

    @property
    def acceptance_ratios(self) -> list[float]:
        """Per part: measured / tabled accepted drafts (module docstring: measured acceptance)."""
        return [c / e for c, e in zip(self._credited, self._expected)]

    def part_taus(self) -> list[dict[int, float]]:
        """Each part's table, its extra tokens scaled by its measured ratio."""
        return [{k: 1.0 + r * (t - 1.0) for k, t in table.items()}
                for table, r in zip(self._part_taus, self.acceptance_ratios)]

    def _allocate(self) -> None:
        tables = self.part_taus()
        #: per tree size the policy may choose: each part's share (module docstring: budget)
        self.shares = {n: allocate(n, tables, self._sizes, self._costs) for n in self._keys}
        self._taus = {n: union_tau([t[k] for t, k in zip(tables, ks) if k]) for n, ks in self.shares.items()}

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

    def share(self, nodes: int) -> tuple[int, ...]:
        """Each part's nodes for a step of ``nodes``: the share of the largest size the policy knows within it."""
        n = max((k for k in self.shares if k <= nodes), default=0)
        return self.shares[n] if n else tuple(0 for _ in self.parts)

    def taus(self) -> dict[int, float]:
        return dict(self._taus)

    def proposal_cost(self, nodes: int, forward_weights: int) -> float:
        return sum(p.proposal_cost(k, forward_weights) for p, k in zip(self.parts, self.share(nodes)) if k)

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
        drafted = [(i, k, paths(p.propose(s, root, end, longest, k), B))
                   for i, (p, s, k) in enumerate(zip(self.parts, state.states, self.share(nodes))) if k > 0]
        state.drafted = [(i, k, [{path for path, _ in row} for row in rows]) for i, k, rows in drafted]
        return host_proposal(root, [merge([rows[b] for _, _, rows in drafted]) for b in range(B)])

    def commit(self, state: UnionState, proposal: Proposal, features: torch.Tensor, acc: Acceptance, ends: list[int],
               lengths: list[int]) -> None:
        for p, s in zip(self.parts, state.states):
            p.commit(s, proposal, features, acc, ends, lengths)
        if proposal.tokens.shape[1] > 1 and state.drafted:
            self._credit(state.drafted, proposal.tokens.gather(1, acc.path[:, 1:]).tolist(), lengths)
        state.drafted = []

    def _credit(self, drafted, accepted: list[list[int]], lengths: list[int]) -> None:
        """Each part that drafted: the accepted prefix its own paths hold, per row (module docstring: measured acceptance)."""
        for i, k, rows in drafted:
            extra = self._part_taus[i][k] - 1.0
            for own, tokens, L in zip(rows, accepted, lengths):
                got = next((j for j in range(L, 0, -1) if tuple(tokens[:j]) in own), 0)
                self._credited[i] = self._credited[i] * self._decay + got
                self._expected[i] = self._expected[i] * self._decay + extra
        self._since += len(lengths)
        if self._since >= REALLOCATE_EVERY:
            self._since = 0
            before = (self.shares, self._taus)
            self._allocate()
            if self.shares != before[0] or any(abs(self._taus[n] - before[1][n]) > 0.01 for n in self._taus):
                self.revision += 1


__all__ = ["HALFLIFE", "PRIOR", "REALLOCATE_EVERY", "Union", "UnionState", "allocate", "merge", "union_tau"]
