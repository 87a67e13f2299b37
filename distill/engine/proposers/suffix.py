"""Suffix matching and frequency scoring: the lookup proposer's draft from one source's matches (SuffixDecoding's rule).

SuffixDecoding (Oliaro et al. 2024; Snowflake's ArcticInference, vLLM's ``suffix`` method) drafts
from the earlier occurrences of the context's recent tokens and lets their frequency decide how
much to draft. This module holds that rule, apart from where the occurrences come from (a row's
own context, :class:`~distill.engine.proposers.lookup.Lookup`; a dataset's or the engine's earlier
replies, :class:`~distill.engine.proposers.datastore.Datastore`), so that every source is scored alike.

Terms
-----
occurrence
    an earlier place where the context's last ``n`` tokens (n >= 1) appeared; its continuation
    is the up to ``depth`` tokens that followed it there.
level
    one match length n and the occurrences of the context's last n tokens (:class:`Level`): the
    longer n, the fewer occurrences and the more alike what followed them.
probability
    of a drafted path at a level: the share of the level's occurrences whose continuation
    starts with it, times ``N / (N + prior)`` for N occurrences in all. ``prior`` counts the
    current position as an occurrence that was not yet followed by anything (SuffixDecoding's
    trees hold the context being matched, so one earlier occurrence gives 1/2, two agreeing
    ones 2/3). A child's probability never exceeds its parent's, and the probabilities of a
    tree's nodes add up to the tokens a step is expected to accept from it, if they are right.
probability floor
    no node under ``min_prob`` is drafted (SuffixDecoding's ``min_token_prob``).
length rule
    a level of match length n drafts at most ``factor * n + offset`` nodes
    (``max_spec_factor``, ``max_spec_offset``): a long match earns a long draft, a one-token
    match a short one; never more than the step's budget.
score
    a level's tree is its most probable nodes within the floor and the length rule (a
    best-first walk of its trie, ties to the shallower node, then to the more recent
    occurrence); its score is the sum of their probabilities. The level with the highest score
    drafts, ties to the longer match.
chain
    the draft as one path instead of a tree (``chain=True``): from the root, each node's most
    probable child (ties to the more recent occurrence) while the floor and the length rule
    allow; scored and chosen among levels alike. SuffixDecoding's draft on a GPU is such a path;
    the engine asks for chains where its target verifies chains for less than trees of as many
    nodes (:attr:`distill.engine.proposers.lookup.Lookup.chains`).

The work per step is a trie of at most ``occurrences x depth`` tokens per level and a walk of
its best nodes, in plain Python: sources hand over short lists, and a level whose length rule
cannot beat the best score so far is never built.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

PAD = -1  # past the end of a document: never drafted


@dataclass
class Level:
    """The occurrences of the context's last ``n`` tokens in one source: what followed them (newest first; a sample
    of them when the source has more), and how many there are in all."""

    n: int
    continuations: list[Sequence[int]]
    total: int


@dataclass
class Draft:
    """A source's best level: drafted paths (tuples of tokens) with their probabilities, parents before children."""

    paths: list[tuple[tuple[int, ...], float]]
    score: float = 0.0
    match: int = 0  # the level's match length (0: nothing drafted)


def _trie(continuations: Sequence[Sequence[int]], depth: int, root: dict | None = None, start: int = 0) -> dict:
    """token -> [count, children, first row] over the continuations' first ``depth`` tokens: a new trie, or ``root``
    grown by the continuations from row ``start`` on."""
    root = {} if root is None else root
    for row, cont in enumerate(continuations[start:], start=start):
        node = root
        for tok in cont[:depth]:
            child = node.get(tok)
            if child is None:
                child = node[tok] = [0, {}, row]
            child[0] += 1
            node = child[1]
    return root


def _walk(root: dict, cap: int, scale: float, min_prob: float) -> tuple[float, list[tuple[tuple[int, ...], float]]]:
    """The trie's ``cap`` most probable nodes of probability >= ``min_prob`` (count x ``scale``), best first."""
    least = min_prob / scale if scale > 0 else float("inf")  # the count a node needs
    heap = [(-c[0], 1, c[2], tok, c[1], ()) for tok, c in root.items() if c[0] >= least]
    heapq.heapify(heap)
    out, score = [], 0.0
    while heap and len(out) < cap:
        neg, depth, _, tok, children, parent = heapq.heappop(heap)
        path = parent + (tok,)
        p = -neg * scale
        out.append((path, p))
        score += p
        for t, c in children.items():
            if c[0] >= least:
                heapq.heappush(heap, (-c[0], depth + 1, c[2], t, c[1], path))
    return score, out


def _chain(root: dict, cap: int, scale: float, min_prob: float) -> tuple[float, list[tuple[tuple[int, ...], float]]]:
    """The trie's path of most probable children (ties to the more recent occurrence), at most ``cap`` nodes of
    probability >= ``min_prob``."""
    least = min_prob / scale if scale > 0 else float("inf")
    out, score, path, node = [], 0.0, (), root
    while node and len(out) < cap:
        tok, (count, children, _) = min(node.items(), key=lambda kv: (-kv[1][0], kv[1][2]))
        if count < least:
            break
        path += (tok,)
        out.append((path, count * scale))
        score += count * scale
        node = children
    return score, out


def best_draft(levels: Sequence[Level], budget: int, min_prob: float, factor: float, offset: float,
               prior: float = 1.0, nested: bool = False, chain: bool = False) -> Draft:
    """The highest-scoring level's tree (see the module docstring), at most ``budget`` nodes; ``levels`` in ascending
    match length. ``nested``: each level's continuations start with the longer level's (the same occurrences, newest
    first within each match length), so one trie grows level by level instead of one trie per level. ``chain``: its
    one most probable path (module docstring, "chain")."""
    walk = _chain if chain else _walk
    best = Draft([])
    trie: dict = {}
    added = 0
    for level in sorted(levels, key=lambda lv: -lv.n):  # longest first: a shorter match must score higher to win
        cap = min(budget, int(factor * level.n + offset + 1e-6))
        if cap < 1 or cap <= best.score:
            break  # shorter matches draft no more nodes: none can beat the best score (<= 1 a node)
        conts = level.continuations
        if not conts:
            continue
        if nested:
            root = _trie(conts, cap, trie, added)
            added = len(conts)
        else:
            root = _trie(conts, cap)
        scale = level.total / (len(conts) * (level.total + prior))
        score, paths = walk(root, cap, scale, min_prob)
        if paths and score > best.score:
            best = Draft(paths, score, level.n)
    return best


def merge(drafts: Sequence[Draft], budget: int, chain: bool = False) -> list[tuple[int, int]]:
    """One tree from several sources' drafts: each path at its highest probability, the ``budget`` most probable
    (ties to the shallower, then to the source listed first); (parent position, token) per node, parents first,
    position 0 the root. ``chain``: one path instead, from the root each node's most probable child among the
    sources' paths (ties as above), at most ``budget`` nodes."""
    best: dict[tuple[int, ...], tuple[float, int]] = {}
    rank = 0
    for draft in drafts:
        for path, p in draft.paths:
            if path not in best or p > best[path][0]:
                best[path] = (p, best[path][1] if path in best else rank)
            rank += 1
    if chain:
        out: list[tuple[int, int]] = []
        path: tuple[int, ...] = ()
        while len(out) < budget:
            children = [q for q in best if len(q) == len(path) + 1 and q[:-1] == path]
            if not children:
                break
            path = min(children, key=lambda q: (-best[q][0], best[q][1]))
            out.append((len(out), path[-1]))
        return out
    chosen = sorted(best, key=lambda q: (-best[q][0], len(q), best[q][1]))[:budget]
    chosen.sort(key=lambda q: (len(q), best[q][1]))
    where = {(): 0}
    out = []
    for path in chosen:
        if path[:-1] not in where:  # its parent lost to the budget on a tie: so does it
            continue
        where[path] = len(out) + 1
        out.append((where[path[:-1]], path[-1]))
    return out


__all__ = ["Draft", "Level", "PAD", "best_draft", "merge"]
