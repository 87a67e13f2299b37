"""The lookup proposer: drafts from n-gram matches in each row's own context (and a datastore); nothing trained.

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
datastore
    optional (:mod:`distill.engine.proposers.datastore`): the n-grams of the model's own replies in a
    self-distilled dataset. Its continuations after the context's longest suffix found there
    join the context's, sharing ``store_weight`` times the context's weight (the context's
    own occurrences count 1 each): what this conversation repeats ranks first, what the
    model usually writes next fills the rest of the budget and drafts where the context
    has no match.
history
    optional, on by default (:class:`~distill.engine.proposers.datastore.History`): the replies this
    engine finished before, up to a budget of tokens, oldest dropped first. A row that leaves
    its batch adds its reply (with the prompt's last ``max_ngram`` tokens before it); what
    followed the context's longest suffix in them joins the continuations like the
    datastore's, at the same weight. A server's requests then draft from its earlier answers
    (SuffixDecoding's global tree, Oliaro et al. 2024). Only greedy rows draft from it: their
    output never depends on the drafts, while a sampled row's does (typical acceptance accepts
    what was drafted if the model finds it typical; rejection sampling draws its seeded
    randomness per drafted node), so other requests' replies could change a sampled row's
    text and a seed would stop reproducing it. Sampled rows' replies still join it. A
    benchmark that decodes one prompt twice clears it between the passes
    (:meth:`Lookup.forget`).
tree
    the trie of those continuations. A node's count is the summed weight of the continuations
    that start with its path. The tree of a step is the ``nodes`` nodes with the highest
    counts, ties to the shallower and then the more recent: a child never counts more than
    its parent, so the set is prefix-closed. Siblings are distinct tokens decided by the
    context alone: point-mass proposals, which every acceptance rule takes exactly
    (:mod:`distill.engine.acceptance`).
no match
    in neither source: the row drafts nothing. A step in which no row drafts anything is a
    plain step.
filler
    rows drafting fewer nodes than the batch's largest tree are padded to its size with
    children of the root whose tokens no sibling carries (lowest ids first): ordinary
    point-mass candidates, so acceptance stays exact and the batch keeps one tree size.
expected tokens per step
    :data:`DEFAULT_TAUS` until measured: the policy's starting table, corrected from then on
    by the acceptance it observes (:class:`~distill.engine.policy.AdaptivePolicy`).
proposal cost
    none: no weights are read to draft (the datastore is searched on the host, a few
    binary searches per row).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from distill.engine.acceptance import Acceptance
from distill.engine.config import LOOKUP
from distill.engine.proposers.datastore import Datastore, History
from distill.engine.policy import candidate_sizes
from distill.engine.proposers.base import Proposal, host_proposal
from distill.engine.tree import build_buffers
from distill.errors import ConfigError

#: Tokens per step of this proposer for a budget of n nodes: the bundled SmolLM2-135M-Instruct's greedy replies to the
#: MT-Bench first turns, replayed through the proposer's tree.
#: Measured: BENCHMARKS.md, "The lookup proposer".
DEFAULT_TAUS = {1: 1.35, 2: 1.53, 4: 1.71, 8: 1.82, 16: 1.85, 32: 1.87}
DEFAULT_NODES, DEFAULT_DEPTH, DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, DEFAULT_OCCURRENCES = 8, 6, 6, 1, 64
#: A datastore's share of a row's tree weight against its own context's, and the occurrences it samples: the best of
#: the values tried in a replay of MT-Bench.
#: Measured: BENCHMARKS.md, "The lookup proposer".
DEFAULT_STORE_WEIGHT, DEFAULT_STORE_OCCURRENCES = 0.5, 16
#: Tokens of the engine's own replies the history keeps (about 1,000-2,000 chat replies): enough for the earlier
#: replies to raise the tokens per step over the context alone, with an index of a few MiB that rebuilds in a fraction
#: of a second. Measured: BENCHMARKS.md, "The lookup proposer".
DEFAULT_HISTORY_TOKENS = 262_144


class _Context:
    """One row's tokens and where each n-gram (n <= max_ngram) of them was followed by another token."""

    def __init__(self, tokens: list[int], max_ngram: int, first: int | None = None, greedy: bool = True):
        self.tokens: list[int] = []
        self.max_ngram = max_ngram
        self.first = len(tokens) if first is None else first  # where the reply starts (the prompt is context only)
        self.greedy = greedy  # decodes greedily: its output never depends on the drafts, so it may read the history
        self.follows: dict[tuple[int, ...], list[int]] = defaultdict(list)  # n-gram -> positions right after it
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        t = self.tokens
        for tok in new:
            p = len(t)  # the position tok takes: every n-gram ending at p - 1 is followed by it
            for n in range(1, min(self.max_ngram, p) + 1):
                self.follows[tuple(t[p - n:p])].append(p)
            t.append(tok)

    def continuations(self, depth: int, min_ngram: int, occurrences: int) -> tuple[int, list[tuple[int, ...]]]:
        """(n, continuations): what followed the ``occurrences`` most recent occurrences of the longest matching suffix
        (n tokens; 0 and none when no suffix of at least ``min_ngram`` tokens occurred before), the most recent first."""
        t = self.tokens
        for n in range(min(self.max_ngram, len(t) - 1), min_ngram - 1, -1):
            starts = self.follows.get(tuple(t[len(t) - n:]), [])
            if starts:
                return n, [tuple(t[s:s + depth]) for s in reversed(starts[-occurrences:])]
        return 0, []

    def draft(self, nodes: int, depth: int, min_ngram: int, occurrences: int) -> list[tuple[int, int]]:
        """The step's tree from this context alone: (parent position, token) per node, parents first (:func:`_tree`)."""
        return _tree([(c, 1.0) for c in self.continuations(depth, min_ngram, occurrences)[1]], nodes)


def _tree(weighted: list[tuple[tuple[int, ...], float]], nodes: int) -> list[tuple[int, int]]:
    """The trie of weighted continuations, cut to its ``nodes`` heaviest nodes: (parent position, token) per node,
    parents first; position 0 is the root. Ties go to the shallower node, then to the continuation listed first."""
    if nodes < 1:
        return []
    counts: dict[tuple[int, ...], float] = {}
    order: dict[tuple[int, ...], int] = {}
    for cont, w in weighted:
        for d in range(1, len(cont) + 1):
            path = cont[:d]
            counts[path] = counts.get(path, 0.0) + w
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
    """Per row: its :class:`_Context`; the rows that leave give their replies to the proposer's history."""

    def __init__(self, rows: list[_Context], history: History | None = None):
        self.rows = rows
        self.history = history

    def keep(self, rows: list[int], used: int) -> None:
        if self.history is not None:
            kept = set(rows)
            for i, ctx in enumerate(self.rows):
                if i not in kept:  # finished (or aborted): its reply so far is the model's text
                    lo = max(0, ctx.first - ctx.max_ngram)
                    self.history.add(ctx.tokens[lo:], ctx.first - lo)
        self.rows = [self.rows[i] for i in rows]

    def join(self, other: "LookupState", used: int) -> None:
        self.rows = self.rows + other.rows


@dataclass
class Lookup:
    """The lookup proposer (see the module docstring); a :class:`~distill.engine.proposers.base.Proposer`."""

    max_nodes: int = DEFAULT_NODES
    depth: int = DEFAULT_DEPTH
    max_ngram: int = DEFAULT_MAX_NGRAM
    min_ngram: int = DEFAULT_MIN_NGRAM
    occurrences: int = DEFAULT_OCCURRENCES
    datastore: Datastore | None = None  # the second source: n-grams of the model's own text in a dataset
    store_weight: float = DEFAULT_STORE_WEIGHT
    store_occurrences: int = DEFAULT_STORE_OCCURRENCES
    history_tokens: int = DEFAULT_HISTORY_TOKENS  # the third source: this engine's earlier replies (0: none)
    name = "lookup"
    feature_layers = None  # reads no features

    def __post_init__(self) -> None:
        if min(self.max_nodes, self.depth, self.min_ngram, self.occurrences, self.store_occurrences) < 1 \
                or self.max_ngram < self.min_ngram:
            raise ConfigError("lookup drafting needs nodes, depth, occurrences >= 1 and 1 <= min_ngram <= max_ngram")
        if not self.store_weight > 0:
            raise ConfigError(f"the datastore's weight must be > 0; got {self.store_weight}")
        self.history = History(self.history_tokens, self.max_ngram, self.depth) if self.history_tokens else None  # checks it
        self._plain = build_buffers([])
        self.accuracy: list[list[float]] = []  # no per-depth table: the policy starts from DEFAULT_TAUS

    def taus(self) -> dict[int, float]:
        table = sorted(DEFAULT_TAUS.items())
        def tau(n: int) -> float:  # the largest measured budget <= n
            return max((v for k, v in table if k <= n), default=1.0)
        return {n: tau(n) for n in candidate_sizes(self.max_nodes) if n}

    def proposal_cost(self, nodes: int, forward_weights: int) -> float:
        return 0.0

    def start(self, features: torch.Tensor, ids: torch.Tensor, lengths: list[int], root: torch.Tensor, slots: int,
              greedy: list[bool] | None = None) -> LookupState:
        ids_h, root_h = ids.tolist(), root.tolist()
        greedy = greedy if greedy is not None else [True] * len(ids_h)
        return LookupState([_Context(row[:n] + [r], self.max_ngram, first=n, greedy=g)
                            for row, n, r, g in zip(ids_h, lengths, root_h, greedy)], self.history)

    def forget(self) -> None:
        """Clear the history of earlier replies (a benchmark's pass over its prompts starts from none)."""
        if self.history is not None:
            self.history.clear()

    def propose(self, state: LookupState, root: torch.Tensor, end: torch.Tensor, longest: int, nodes: int,
                sampling=None) -> Proposal:
        """Each row's tree from its context (point masses whatever ``sampling`` says)."""
        n = min(nodes, self.max_nodes)
        trees = [_tree(self._weighted(ctx), n) for ctx in state.rows] if n >= 1 else [[] for _ in state.rows]
        return host_proposal(root, trees, self._plain_on(root.device))

    def commit(self, state: LookupState, proposal: Proposal, features: torch.Tensor, acc: Acceptance, ends: list[int],
               lengths: list[int]) -> None:
        """Each row's context gains its accepted nodes and its next root."""
        host = torch.cat([proposal.tokens.gather(1, acc.path[:, 1:]), acc.next_token[:, None]], dim=1).tolist()
        for ctx, row, L in zip(state.rows, host, lengths):
            ctx.extend(row[:L] + [row[-1]])

    def _weighted(self, ctx: _Context) -> list[tuple[tuple[int, ...], float]]:
        """A row's continuations with their weights: 1 each from its context; from the datastore and (greedy rows) from
        the history, each ``store_weight`` times the context's count (at least 1) shared among its continuations."""
        n, own = ctx.continuations(self.depth, self.min_ngram, self.occurrences)
        weighted = [(c, 1.0) for c in own]
        for source in (self.datastore, self.history if ctx.greedy else None):
            if source is not None:
                _, found = source.continuations(ctx.tokens, self.store_occurrences, self.min_ngram)
                if found:
                    w = self.store_weight * max(1, len(own)) / len(found)
                    weighted += [(c[:self.depth], w) for c in found]  # the store's depth was fixed when it was built
        return weighted

    def _plain_on(self, device: torch.device):
        if self._plain.depth.device != device:
            self._plain = self._plain.to(device)
        return self._plain


__all__ = ["DEFAULT_HISTORY_TOKENS", "DEFAULT_TAUS", "Lookup", "LookupState"]
