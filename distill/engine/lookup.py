"""The lookup proposer: drafts from n-gram matches in each row's own context; no drafter, nothing trained.

Prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` method) drafts the tokens that followed
an earlier occurrence of the context's last few tokens. Chat models repeat their prompt and
themselves (names, code, lists, the phrases of their own style), so those tokens are often
what the model says next. Here the draft is a tree over all recent occurrences rather than
one chain, and the engine's verification keeps the output exactly the model's.

Terms
-----
context
    a row's prompt, the tokens it has committed, and its root (the next token, decided).
match
    the longest suffix of the context, ``max_ngram`` tokens down to ``min_ngram``, that
    occurred earlier in the context. Its occurrences' ``continuations`` are the up to
    ``depth`` tokens that followed each of its ``occurrences`` most recent occurrences.
tree
    the trie of those continuations. A node's count is the number of continuations that
    start with its path. The tree of a step is the ``nodes`` nodes with the highest counts,
    ties to the shallower and then the more recent: a child never counts more than its
    parent, so the set is prefix-closed. Siblings are distinct tokens decided by the context
    alone: point-mass proposals, which every acceptance rule takes exactly
    (:mod:`distill.engine.acceptance`).
no match
    the row drafts nothing. A step in which no row drafts anything is a plain step.
filler
    rows drafting fewer nodes than the batch's largest tree are padded to its size with
    children of the root whose tokens no sibling carries (lowest ids first): ordinary
    point-mass candidates, so acceptance stays exact and the batch keeps one tree size.
expected tokens per step
    :data:`DEFAULT_TAUS` until measured: the policy's starting table, corrected from then on
    by the acceptance it observes (:class:`~distill.engine.policy.AdaptivePolicy`).
proposal cost
    none: no weights are read to draft.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import torch

from distill.engine.acceptance import Acceptance
from distill.engine.policy import candidate_sizes
from distill.engine.proposer import Proposal
from distill.engine.tree import build_buffers, row_buffers
from distill.errors import ConfigError

#: Tokens per step of this proposer for a budget of n nodes, measured on the bundled SmolLM2-135M-Instruct: greedy
#: replies (192 tokens) to the 80 MT-Bench first turns, replayed through the proposer's tree (BENCHMARKS.md, issue 14).
DEFAULT_TAUS = {1: 1.35, 2: 1.53, 4: 1.71, 8: 1.82, 16: 1.85, 32: 1.87}
DEFAULT_NODES, DEFAULT_DEPTH, DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, DEFAULT_OCCURRENCES = 8, 6, 6, 1, 64


class _Context:
    """One row's tokens and where each n-gram (n <= max_ngram) of them was followed by another token."""

    def __init__(self, tokens: list[int], max_ngram: int):
        self.tokens: list[int] = []
        self.max_ngram = max_ngram
        self.follows: dict[tuple[int, ...], list[int]] = defaultdict(list)  # n-gram -> positions right after it
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        t = self.tokens
        for tok in new:
            p = len(t)  # the position tok takes: every n-gram ending at p - 1 is followed by it
            for n in range(1, min(self.max_ngram, p) + 1):
                self.follows[tuple(t[p - n:p])].append(p)
            t.append(tok)

    def draft(self, nodes: int, depth: int, min_ngram: int, occurrences: int) -> list[tuple[int, int]]:
        """The step's tree: (parent position, token) per node, parents first; position 0 is the root."""
        t = self.tokens
        starts: list[int] = []
        for n in range(min(self.max_ngram, len(t) - 1), min_ngram - 1, -1):
            starts = self.follows.get(tuple(t[len(t) - n:]), [])
            if starts:
                break
        if not starts or nodes < 1:
            return []
        counts: dict[tuple[int, ...], int] = {}
        order: dict[tuple[int, ...], int] = {}
        for s in reversed(starts[-occurrences:]):  # the most recent occurrence first: it wins ties
            cont = tuple(t[s:s + depth])
            for d in range(1, len(cont) + 1):
                path = cont[:d]
                counts[path] = counts.get(path, 0) + 1
                order.setdefault(path, len(order))
        chosen = sorted(counts, key=lambda p: (-counts[p], len(p), order[p]))[:nodes]
        chosen.sort(key=lambda p: (len(p), order[p]))  # parents before children
        where = {(): 0}
        out = []
        for i, path in enumerate(chosen, start=1):
            out.append((where[path[:-1]], path[-1]))
            where[path] = i
        return out


class LookupState:
    """Per row: its :class:`_Context`."""

    def __init__(self, rows: list[_Context]):
        self.rows = rows

    def keep(self, rows: list[int], used: int) -> None:
        self.rows = [self.rows[i] for i in rows]

    def join(self, other: "LookupState", used: int) -> None:
        self.rows = self.rows + other.rows


@dataclass
class Lookup:
    """The lookup proposer (see the module docstring); a :class:`~distill.engine.proposer.Proposer`."""

    max_nodes: int = DEFAULT_NODES
    depth: int = DEFAULT_DEPTH
    max_ngram: int = DEFAULT_MAX_NGRAM
    min_ngram: int = DEFAULT_MIN_NGRAM
    occurrences: int = DEFAULT_OCCURRENCES
    name = "lookup"
    feature_layers = None  # reads no features

    def __post_init__(self) -> None:
        if min(self.max_nodes, self.depth, self.min_ngram, self.occurrences) < 1 or self.max_ngram < self.min_ngram:
            raise ConfigError("lookup drafting needs nodes, depth, occurrences >= 1 and 1 <= min_ngram <= max_ngram")
        self._plain = build_buffers([])
        self.accuracy: list[list[float]] = []  # no per-depth table: the policy starts from DEFAULT_TAUS

    def taus(self) -> dict[int, float]:
        table = sorted(DEFAULT_TAUS.items())
        def tau(n: int) -> float:  # the largest measured budget <= n
            return max((v for k, v in table if k <= n), default=1.0)
        return {n: tau(n) for n in candidate_sizes(self.max_nodes) if n}

    def proposal_cost(self, nodes: int, forward_weights: int) -> float:
        return 0.0

    def start(self, features: torch.Tensor, ids: torch.Tensor, lengths: list[int], root: torch.Tensor, slots: int) -> LookupState:
        ids_h, root_h = ids.tolist(), root.tolist()
        return LookupState([_Context(row[:n] + [r], self.max_ngram) for row, n, r in zip(ids_h, lengths, root_h)])

    def propose(self, state: LookupState, root: torch.Tensor, end: torch.Tensor, longest: int, nodes: int,
                sampling=None) -> Proposal:
        """Each row's tree from its context (point masses whatever ``sampling`` says)."""
        n = min(nodes, self.max_nodes)
        trees = [ctx.draft(n, self.depth, self.min_ngram, self.occurrences) for ctx in state.rows]
        T = 1 + max(map(len, trees))
        dev = root.device
        if T == 1:
            return Proposal(root[:, None], self._plain_on(dev))
        parent, tokens, depth = [], [], []
        for tree in trees:
            par_b, tok_b, dep_b = [-1], [0], [0]
            for p, tok in tree:  # parents come first: a node's depth is its parent's + 1
                par_b.append(p)
                tok_b.append(tok)
                dep_b.append(dep_b[p] + 1)
            taken = {tok for p, tok in tree if p == 0}  # filler: children of the root with tokens no sibling carries
            tok_b += [x for x in range(T + len(taken)) if x not in taken][: T - len(par_b)]
            par_b += [0] * (T - len(par_b))
            dep_b += [1] * (T - len(dep_b))
            parent.append(par_b)
            tokens.append(tok_b)
            depth.append(dep_b)
        max_children = max(max(Counter(row[1:]).values()) for row in parent)
        par = torch.tensor(parent, dtype=torch.long, device=dev)
        dep = torch.tensor(depth, dtype=torch.long, device=dev)
        tok = torch.tensor(tokens, dtype=torch.long, device=dev)
        tok[:, 0] = root
        return Proposal(tok, row_buffers(par, dep, int(dep.max()), max_children))

    def commit(self, state: LookupState, proposal: Proposal, features: torch.Tensor, acc: Acceptance, ends: list[int],
               lengths: list[int]) -> None:
        """Each row's context gains its accepted nodes and its next root."""
        host = torch.cat([proposal.tokens.gather(1, acc.path[:, 1:]), acc.next_token[:, None]], dim=1).tolist()
        for ctx, row, L in zip(state.rows, host, lengths):
            ctx.extend(row[:L] + [row[-1]])

    def _plain_on(self, device: torch.device):
        if self._plain.depth.device != device:
            self._plain = self._plain.to(device)
        return self._plain


__all__ = ["DEFAULT_TAUS", "Lookup", "LookupState"]
