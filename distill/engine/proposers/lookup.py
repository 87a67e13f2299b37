"""The lookup proposer: drafts from suffix matches in each row's own context and in a global store; nothing trained.

Prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` method) drafts the tokens that followed
an earlier occurrence of the context's last few tokens; SuffixDecoding (Oliaro et al. 2024;
vLLM's ``suffix`` method) matches the longest recent suffix in the request's own tokens and in
the earlier responses, scores what followed by its frequency and drafts as far as the match and
the frequencies warrant. Chat models repeat their prompt and themselves (names, code, lists,
the phrases of their own style) and their earlier answers, so those tokens are often what the
model says next. Here the draft is a tree of the most probable continuations, and the engine's
verification keeps the output exactly the model's.

Terms
-----
context
    a row's prompt, the tokens it has committed, and its root (the next token, decided).
sources
    where the occurrences of the context's suffixes are looked up: the context itself (its
    most recent ``occurrences`` occurrences of the last token, each matched back over up to
    ``max_match`` tokens); a ``datastore`` (:class:`~distill.engine.proposers.datastore.Datastore`,
    the model's own replies in a self-distilled dataset); the ``history``
    (:class:`~distill.engine.proposers.datastore.History`, on by default: the replies this engine
    finished before, up to a budget of tokens, oldest dropped first). Together the datastore and
    the history are SuffixDecoding's global tree, the context its per-request tree.
draft of a source
    :func:`~distill.engine.proposers.suffix.best_draft`: per match length, the trie of what
    followed, each node's probability its share of the occurrences (with the current position
    counted as one not yet followed, ``prior``); nodes under ``min_prob`` are dropped, a match of
    n tokens drafts at most ``spec_factor * n + spec_offset`` nodes, and the match length whose
    tree has the highest sum of probabilities drafts.
tree
    the sources' drafts merged (:func:`~distill.engine.proposers.suffix.merge`): each path at its
    highest probability, the step's ``nodes`` most probable, prefix-closed. A step drafts fewer
    nodes than its budget when few are probable enough, and none when nothing matched (then
    it is a plain step if no row of the batch drafts). Siblings are distinct tokens decided by
    the context alone: point-mass proposals, which every acceptance rule takes exactly
    (:mod:`distill.engine.acceptance`).
greedy rows only for the history
    a sampled row's output depends on what is drafted (typical acceptance accepts what was
    drafted if the model finds it typical; rejection sampling draws its seeded randomness per
    drafted node), so other requests' replies could change a sampled row's text and a seed
    would stop reproducing it: only greedy rows draft from the history. Sampled rows' replies
    still join it. A benchmark that decodes one prompt twice clears it between the passes
    (:meth:`Lookup.forget`).
chains
    where the target verifies a chain for less than a branching tree of as many nodes (on a
    CPU, chains attend on vLLM's kernel, trees under their mask over the cache read in place),
    each row drafts one path (:func:`~distill.engine.proposers.suffix.merge` with ``chain``):
    from the root, the most probable continuation of the sources' drafts. ``Lookup.chains``
    decides it: None (default) lets the engine choose (:meth:`Lookup.use_chains`), True or
    False fixes it.
chain odds
    drafting chains, how likely each node is accepted once its parent was (:class:`ChainOdds`): by
    the match length of the source the chain's first node came from and by the node's depth,
    from a measured table, moved by what the rows accept. A long match is a copy of earlier text
    and its chain is accepted far more often than a one-token match's.
node budget
    with the engine's pricing (:meth:`Lookup.use_budget`), each row's chain is cut where the batch's
    expected tokens stop paying for the step's cost: the engine prices every node of every row
    together (:class:`~distill.engine.policy.TokenBudget`), so a row with a long match drafts
    long while a row with a weak one drafts little or nothing, and a batch drafts only where a
    node's odds beat what a token costs at its size.
filler
    rows drafting fewer nodes than the batch's largest tree are padded to its size with
    children of the root whose tokens no sibling carries (lowest ids first): ordinary
    point-mass candidates, so acceptance stays exact and the batch keeps one tree size.
    Drafting chains, a row's chain ends where its draft does and the positions after it are
    filler no path reaches (:func:`~distill.engine.tree.chain_buffers`): the kernel's forward
    skips them and acceptance never judges them.
expected tokens per step
    :data:`DEFAULT_TAUS` until measured: the policy's starting table, corrected from then on
    by the acceptance it observes (:class:`~distill.engine.policy.AdaptivePolicy`).
proposal cost
    none in weights read: the lookup runs on the host (a vectorized scan of the row's tokens and
    a few binary searches in the stores per row and step; its time is benchmarks/replay_lookup.py's
    ``lookup_us_per_step``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from distill.engine.acceptance import Acceptance
from distill.engine.config import LOOKUP
from distill.engine.policy import candidate_sizes
from distill.engine.proposers.base import Proposal, host_proposal
from distill.engine.proposers.datastore import DEFAULT_STORE_NGRAM, Datastore, History
from distill.engine.proposers.suffix import Draft, Level, best_draft, merge
from distill.engine.tree import build_buffers
from distill.errors import ConfigError

#: Tokens per step of this proposer for a budget of n nodes: the bundled SmolLM2-135M-Instruct's greedy replies to the
#: MT-Bench first turns, replayed through the proposer's tree.
#: Measured: BENCHMARKS.md, "The lookup proposer".
DEFAULT_TAUS = {1: 1.35, 2: 1.53, 4: 1.71, 8: 1.82, 16: 1.85, 32: 1.87}
#: The same for chains (one path of at most n nodes a step): the tree table's extra tokens scaled by the share of them
#: that chains keep in a replay of those replies (context and history, 192 tokens: 0.99 at 2 nodes, 0.96 at 4, 0.91 at 8).
#: Measured: BENCHMARKS.md, "The lookup proposer".
DEFAULT_CHAIN_TAUS = {1: 1.35, 2: 1.52, 4: 1.68, 8: 1.74, 16: 1.75, 32: 1.77}
DEFAULT_NODES, DEFAULT_DEPTH, DEFAULT_OCCURRENCES = 8, 16, 64
#: The longest suffix matched in a row's context, and the shortest that drafts.
DEFAULT_MAX_MATCH, DEFAULT_MIN_NGRAM = 32, 1
#: The n-gram range vLLM's ``ngram`` method is given for ``serve --engine vllm --heads lookup``: the stores' key length.
DEFAULT_MAX_NGRAM = DEFAULT_STORE_NGRAM
#: No node under 0.1, SuffixDecoding's floor (ArcticInference's and vLLM's ``suffix`` default ``min_token_prob``), and at
#: most 4 nodes a matched token: SuffixDecoding's factor of 1 (one chain on a GPU) cut the tokens per step by a tenth
#: in a replay of MT-Bench, where 4 keeps those of no length rule with about 0.7 of its nodes.
#: Measured: BENCHMARKS.md, "The lookup proposer".
DEFAULT_MIN_PROB, DEFAULT_SPEC_FACTOR, DEFAULT_SPEC_OFFSET = 0.1, 4.0, 0.0
#: The current position, counted as an occurrence of the matched suffix that nothing followed yet (SuffixDecoding's
#: trees hold the context they match).
DEFAULT_PRIOR = 1.0
#: Occurrences sampled per match length in a store, evenly over its range (more changed nothing in a replay of MT-Bench).
DEFAULT_STORE_OCCURRENCES = 16
#: Tokens of the engine's own replies the history keeps (about 1,000-2,000 chat replies): enough for the earlier
#: replies to raise the tokens per step over the context alone, with an index of a few MiB that rebuilds in a fraction
#: of a second. Measured: BENCHMARKS.md, "The lookup proposer".
DEFAULT_HISTORY_TOKENS = 262_144
#: The match lengths that start a bucket of :class:`ChainOdds`, and its depths (the last one: that depth and deeper).
MATCH_BUCKETS, ODDS_DEPTHS = (1, 2, 3, 4, 5, 8, 16), 5
#: P(node accepted | its parent accepted) per match bucket (rows) and depth (columns): the bundled model's greedy
#: replies to the MT-Bench first turns replayed through the lookup's chains, 128 tokens, context and history (the
#: held-out prompts give the same table within 0.05-0.1); no cell above 0.97 (a sure node would always be drafted),
#: and the one cell measured on 8 nodes (one-token matches, depth 4) at 0.70.
#: Measured: BENCHMARKS.md, "The node budget".
DEFAULT_CHAIN_ODDS = ((0.23, 0.42, 0.59, 0.68, 0.70),
                      (0.38, 0.52, 0.62, 0.77, 0.82),
                      (0.51, 0.66, 0.69, 0.74, 0.84),
                      (0.66, 0.66, 0.74, 0.78, 0.90),
                      (0.80, 0.77, 0.79, 0.86, 0.92),
                      (0.64, 0.89, 0.90, 0.94, 0.95),
                      (0.97, 0.97, 0.93, 0.97, 0.97))


class ChainOdds:
    """How likely a chain's node is accepted once its parent was, by the chain's match bucket and the node's depth
    (module docstring, "chain odds"): ``prior`` as ``weight`` pseudo-observations per cell, then every observed node,
    older ones fading with a half-life of ``halflife`` observations of the cell."""

    def __init__(self, prior=DEFAULT_CHAIN_ODDS, weight: float = 16.0, halflife: float = 2048.0):
        if len(prior) != len(MATCH_BUCKETS) or any(len(row) != ODDS_DEPTHS for row in prior):
            raise ValueError(f"chain odds need {len(MATCH_BUCKETS)} x {ODDS_DEPTHS} values")
        self.accepted = [[p * weight for p in row] for row in prior]
        self.seen = [[weight] * ODDS_DEPTHS for _ in prior]
        self._decay = 0.5 ** (1.0 / halflife)

    @staticmethod
    def bucket(match: int) -> int:
        return max(bisect.bisect_right(MATCH_BUCKETS, match) - 1, 0)

    def odds(self, match: int, depth: int) -> float:
        b, d = self.bucket(match), min(depth, ODDS_DEPTHS - 1)
        return self.accepted[b][d] / self.seen[b][d]

    def values(self, match: int, length: int) -> list[float]:
        """Expected accepted tokens of each node of a chain of ``length`` nodes: P(it and its ancestors accepted)."""
        out, v = [], 1.0
        for depth in range(length):
            v *= self.odds(match, depth)
            out.append(v)
        return out

    def observe(self, match: int, length: int, accepted: int) -> None:
        """A row's chain of ``length`` nodes of which the first ``accepted`` were: every node whose parent was."""
        b, k = self.bucket(match), self._decay
        for depth in range(min(accepted + 1, length)):
            d = min(depth, ODDS_DEPTHS - 1)
            self.accepted[b][d] = self.accepted[b][d] * k + (depth < accepted)
            self.seen[b][d] = self.seen[b][d] * k + 1.0


class _Context:
    """One row's tokens, and the positions of each token in them (to find the last token's earlier occurrences)."""

    def __init__(self, tokens: list[int], max_match: int = DEFAULT_MAX_MATCH, first: int | None = None,
                 greedy: bool = True):
        self.max_match = max_match
        self.first = len(tokens) if first is None else first  # where the reply starts (the prompt is context only)
        self.greedy = greedy  # decodes greedily: its output never depends on the drafts, so it may read the history
        self.tokens: list[int] = []
        self.where: dict[int, list[int]] = {}  # token -> its positions, ascending
        self.extend(tokens)

    def extend(self, new: list[int]) -> None:
        t, where = self.tokens, self.where
        for tok in new:
            where.setdefault(tok, []).append(len(t))
            t.append(tok)

    def levels(self, depth: int, occurrences: int, min_len: int = 1) -> list[Level]:
        """The earlier occurrences of the context's suffixes as nested levels, ascending (see
        :mod:`~distill.engine.proposers.suffix`): the ``occurrences`` most recent earlier positions of the last token,
        each matched back over up to ``max_match`` tokens, with the up to ``depth`` tokens that followed it; the root's
        own position counts as an occurrence not yet followed (the scoring's ``prior``)."""
        t = self.tokens
        L = len(t)
        at = self.where.get(t[-1], ())
        if len(at) < 2:
            return []
        M = min(self.max_match, L - 1)
        found = []  # (tokens matched, position of the occurrence's last token)
        for p in reversed(at[-occurrences - 1 : -1]):
            m = 1
            while m < M and m <= p and t[p - m] == t[L - 1 - m]:
                m += 1
            if m >= min_len:
                found.append((m, p))
        found.sort(key=lambda f: (-f[0], -f[1]))  # the longest matches first, the newest first among equals
        levels, conts = [], []
        for i, (m, p) in enumerate(found):
            conts.append(t[p + 1 : p + 1 + depth])
            if i + 1 == len(found) or found[i + 1][0] != m:  # the last occurrence matching m tokens: a level
                levels.append(Level(m, conts[:], len(conts)))
        return levels[::-1]

    def draft(self, nodes: int, depth: int, occurrences: int = DEFAULT_OCCURRENCES, min_ngram: int = DEFAULT_MIN_NGRAM,
              min_prob: float = DEFAULT_MIN_PROB, factor: float = DEFAULT_SPEC_FACTOR,
              offset: float = DEFAULT_SPEC_OFFSET) -> list[tuple[int, int]]:
        """The step's tree from this context alone: (parent position, token) per node, parents first."""
        levels = self.levels(depth, occurrences, min_ngram)
        return merge([best_draft(levels, nodes, min_prob, factor, offset, nested=True)], nodes)


class LookupState:
    """Per row: its :class:`_Context`; the rows that leave give their replies to the proposer's history."""

    def __init__(self, rows: list[_Context], history: History | None = None, context_tokens: int = DEFAULT_STORE_NGRAM):
        self.rows = rows
        self.history = history
        self.context_tokens = context_tokens  # the prompt's last tokens a reply keeps in the history (what it followed)
        self.drafted: list[tuple[int, int]] | None = None  # the step's chains: (match length, nodes) per row

    def keep(self, rows: list[int], used: int) -> None:
        if self.history is not None:
            kept = set(rows)
            for i, ctx in enumerate(self.rows):
                if i not in kept:  # finished (or aborted): its reply so far is the model's text
                    lo = max(0, ctx.first - self.context_tokens)
                    self.history.add(ctx.tokens[lo:], ctx.first - lo)
        self.rows = [self.rows[i] for i in rows]
        self.drafted = None

    def join(self, other: "LookupState", used: int) -> None:
        self.rows = self.rows + other.rows
        self.drafted = None


@dataclass
class Lookup:
    """The lookup proposer (see the module docstring); a :class:`~distill.engine.proposers.base.Proposer`."""

    max_nodes: int = DEFAULT_NODES
    depth: int = DEFAULT_DEPTH  # the longest drafted path
    max_match: int = DEFAULT_MAX_MATCH
    min_ngram: int = DEFAULT_MIN_NGRAM
    occurrences: int = DEFAULT_OCCURRENCES
    datastore: Datastore | None = None  # the model's own text in a dataset
    store_occurrences: int = DEFAULT_STORE_OCCURRENCES
    history_tokens: int = DEFAULT_HISTORY_TOKENS  # this engine's earlier replies (0: none)
    min_prob: float = DEFAULT_MIN_PROB
    spec_factor: float = DEFAULT_SPEC_FACTOR
    spec_offset: float = DEFAULT_SPEC_OFFSET
    prior: float = DEFAULT_PRIOR
    chains: bool | None = None  # one path a step (module docstring, "chains"); None: as the engine finds cheaper
    name = "lookup"
    feature_layers = None  # reads no features

    def __post_init__(self) -> None:
        if min(self.max_nodes, self.depth, self.min_ngram, self.occurrences, self.store_occurrences) < 1 \
                or self.max_match < self.min_ngram:
            raise ConfigError("lookup drafting needs nodes, depth, occurrences >= 1 and 1 <= min_ngram <= max_match")
        if not 0 <= self.min_prob <= 1 or self.spec_factor < 0 or self.prior < 0:
            raise ConfigError(f"lookup drafting needs 0 <= min_prob <= 1, spec_factor >= 0 and prior >= 0; got "
                              f"{self.min_prob}, {self.spec_factor}, {self.prior}")
        self.history = History(self.history_tokens) if self.history_tokens else None  # checks it
        self._plain = build_buffers([])
        self.accuracy: list[list[float]] = []  # no per-depth table: the policy starts from DEFAULT_TAUS
        self.drafts_chains = bool(self.chains)
        self.odds = ChainOdds()
        self._budget: Callable[[int, list[list[float]]], list[int]] | None = None

    @property
    def prices_nodes(self) -> bool:
        """Drafting chains, every node carries its odds (:class:`ChainOdds`): the engine may price them one by one."""
        return self.drafts_chains

    def use_budget(self, lengths: Callable[[int, list[list[float]]], list[int]] | None) -> None:
        """The engine's node budget (module docstring, "node budget"): ``lengths(batch, values)`` takes each row's
        nodes' expected accepted tokens and returns how many of them each row drafts; None drafts each row's chain
        whole, up to the step's node count."""
        self._budget = lengths

    def use_chains(self, cheaper: bool) -> None:
        """The engine's word: its target verifies chains for less than trees (``cheaper``). Drafts chains then, unless
        :attr:`chains` fixes the shape."""
        self.drafts_chains = cheaper if self.chains is None else bool(self.chains)

    def taus(self) -> dict[int, float]:
        table = sorted((DEFAULT_CHAIN_TAUS if self.drafts_chains else DEFAULT_TAUS).items())
        def tau(n: int) -> float:  # the largest measured budget <= n
            return max((v for k, v in table if k <= n), default=1.0)
        return {n: tau(n) for n in candidate_sizes(self.max_nodes) if n}

    def proposal_cost(self, nodes: int, forward_weights: int) -> float:
        return 0.0

    def start(self, features: torch.Tensor, ids: torch.Tensor, lengths: list[int], root: torch.Tensor, slots: int,
              greedy: list[bool] | None = None) -> LookupState:
        ids_h, root_h = ids.tolist(), root.tolist()
        greedy = greedy if greedy is not None else [True] * len(ids_h)
        return LookupState([_Context(row[:n] + [r], self.max_match, first=n, greedy=g)
                            for row, n, r, g in zip(ids_h, lengths, root_h, greedy)], self.history)

    def forget(self) -> None:
        """Clear the history of earlier replies (a benchmark's pass over its prompts starts from none)."""
        if self.history is not None:
            self.history.clear()

    def propose(self, state: LookupState, root: torch.Tensor, end: torch.Tensor, longest: int, nodes: int,
                sampling=None) -> Proposal:
        """Each row's tree from its sources (point masses whatever ``sampling`` says)."""
        n = min(nodes, self.max_nodes)
        state.drafted = None
        if n < 1:
            trees = [[] for _ in state.rows]
        elif self.drafts_chains:
            chains = [self.chain(ctx, n) for ctx in state.rows]
            trees = [tree for tree, _ in chains]
            if self._budget is not None:
                lengths = self._budget(len(chains), [self.odds.values(m, len(t)) for t, m in chains])
                trees = [tree[:L] for tree, L in zip(trees, lengths)]
            state.drafted = [(m, len(tree)) for (_, m), tree in zip(chains, trees)]
        else:
            trees = [self.draft(ctx, n) for ctx in state.rows]
        return host_proposal(root, trees, self._plain_on(root.device), chain=self.drafts_chains)

    def commit(self, state: LookupState, proposal: Proposal, features: torch.Tensor, acc: Acceptance, ends: list[int],
               lengths: list[int]) -> None:
        """Each row's context gains its accepted nodes and its next root."""
        host = torch.cat([proposal.tokens.gather(1, acc.path[:, 1:]), acc.next_token[:, None]], dim=1).tolist()
        for ctx, row, L in zip(state.rows, host, lengths):
            ctx.extend(row[:L] + [row[-1]])
        for (match, nodes), L in zip(state.drafted or (), lengths):
            if nodes:
                self.odds.observe(match, nodes, L)

    def draft(self, ctx: _Context, nodes: int) -> list[tuple[int, int]]:
        """A row's tree of at most ``nodes`` nodes: (parent position, token) per node, parents first."""
        return merge(self.drafts(ctx, nodes), nodes, chain=self.drafts_chains)

    def chain(self, ctx: _Context, nodes: int) -> tuple[list[tuple[int, int]], int]:
        """A row's chain of at most ``nodes`` nodes, and the match length of the source its first node came from
        (0 when it drafts nothing)."""
        drafts = self.drafts(ctx, nodes)
        tree = merge(drafts, nodes, chain=True)
        if not tree:
            return tree, 0
        first = (tree[0][1],)
        odds = [(p, d.match) for d in drafts for path, p in d.paths if path == first]
        return tree, max(odds, key=lambda o: o[0])[1]  # the source merge took it from (ties: the first listed)

    def drafts(self, ctx: _Context, nodes: int) -> list[Draft]:
        """Each source's best draft for a row: its context, the datastore and (greedy rows) the history."""
        rule = (nodes, self.min_prob, self.spec_factor, self.spec_offset, self.prior)
        chain = self.drafts_chains
        out = [best_draft(ctx.levels(self.depth, self.occurrences, self.min_ngram), *rule, nested=True, chain=chain)]
        for source in (self.datastore, self.history if ctx.greedy else None):
            if source is not None:
                levels = source.levels(ctx.tokens, self.depth, self.store_occurrences, self.min_ngram)
                out.append(best_draft(levels, *rule, chain=chain))
        return out

    def _plain_on(self, device: torch.device):
        if self._plain.depth.device != device:
            self._plain = self._plain.to(device)
        return self._plain


__all__ = ["ChainOdds", "DEFAULT_CHAIN_ODDS", "DEFAULT_CHAIN_TAUS", "DEFAULT_HISTORY_TOKENS", "DEFAULT_MAX_NGRAM", "DEFAULT_MIN_NGRAM", "DEFAULT_TAUS", "LOOKUP",
           "Lookup", "LookupState"]
