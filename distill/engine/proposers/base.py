"""The proposer contract: what the engine's step asks of a proposer (Medusa, EAGLE, lookup, their union).

Terms
-----
proposer
    a small object that drafts a tree of candidate tokens after each row's root. The engine
    verifies the tree in one target forward, accepts with the shared rules
    (:mod:`distill.engine.acceptance`), compacts its own KV cache and runs the policy; none
    of that knows which proposer drafted.
features
    what the proposer reads from the target's forwards, (B, T, F) per forward: the decoder's
    last hidden state (the one the LM head reads) when ``feature_layers`` is None, else the
    hidden states entering the listed decoder layers (transformers' ``hidden_states[i]``),
    concatenated in that order. The engine captures them in the prefill and in every
    verification forward, for every position.
draft state
    the proposer's per-row state of one batch (Medusa: the last committed token's hidden
    state; EAGLE: its drafter's KV cache and the next draft distribution). The batch holds
    it beside its own KV cache and moves its rows with the batch's (:meth:`DraftState.keep`,
    :meth:`DraftState.join`).
proposal
    the tokens of one step's tree, (B, T): position 0 is the root, 1..N the drafted nodes
    (target token ids), with the tree's buffers: one tree for all rows (Medusa) or one per
    row (EAGLE's dynamic tree, :func:`~distill.engine.tree.row_buffers`). Sibling candidates
    are distinct tokens chosen deterministically from the prefix (top-k), so the lossless
    rejection rule treats each as a point-mass proposal ``q = δ_x``
    (:func:`~distill.engine.acceptance.rejection_accept`); ``draft_prob`` (B, T) keeps the
    drafter's own probability of each node given its parent (1 at the root; None when the
    proposer has no distribution, as Medusa's tree positions are ranks). A proposer asked to
    sample (``DraftSampling``, rejection mode with sampled rows) may instead draw each node's
    children i.i.d. from its draft distribution q and return q per node (``draft``): the
    rejection rule then runs multi-round speculative sampling with q.

The calls, per batch: ``start`` after the prefill (prefill hook), then per step ``propose``
(a tree of at most ``nodes`` nodes) and ``commit`` with the accepted path (accept hook),
also after plain steps (nodes = 0) so that a drafter's state follows every committed token.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import torch

from distill.engine.acceptance import Acceptance
from distill.engine.tree import TreeBuffers, build_buffers, chain_buffers, row_buffers


@dataclass
class DraftSampling:
    """How a proposer may draw its drafts for rejection sampling: per row, temperature (0: a greedy row) and generator."""

    temperature: torch.Tensor  # (B,) float
    generators: list  # (B,) torch.Generator or None


@dataclass
class Proposal:
    """One step's tree (see the module docstring)."""

    tokens: torch.Tensor  # (B, T) long: root, then drafted nodes (target ids)
    buffers: TreeBuffers  # the tree: shared (T,) or per row (B, T)
    draft_prob: torch.Tensor | None = None  # (B, T) float: the drafter's probability of each node given its parent
    draft: torch.Tensor | None = None  # (B, T, V): node n's children were drawn i.i.d. from draft[:, n] (None: deterministic)
    chain_nodes: list[int] | None = None  # uneven chains (tree.chain_buffers): each row's drafted nodes, host ints


class DraftState(Protocol):
    def keep(self, rows: list[int], used: int) -> None:
        """Keep batch rows ``rows`` (distinct), row ``rows[j]`` becoming row ``j``; ``used``: the longest kept row's
        committed length."""

    def join(self, other: "DraftState", used: int) -> None:
        """Append ``other``'s rows (``used``: the longest of them) after this state's."""


class Proposer(Protocol):
    name: str  # "medusa" | "eagle3" | "lookup" | a union's parts joined by "+": what /metrics and the benchmark report
    feature_layers: tuple[int, ...] | None  # what the target's forwards must return (module docstring)
    max_nodes: int  # the full tree's nodes

    def taus(self) -> dict[int, float]:
        """Expected tokens per step for the tree sizes the policy may choose (:func:`~distill.engine.policy.candidate_sizes`)."""

    def proposal_cost(self, nodes: int, forward_weights: int) -> float:
        """h(N): weights the proposer reads for a tree of ``nodes`` nodes / the weights one target forward reads."""

    def start(self, features: torch.Tensor, ids: torch.Tensor, lengths: list[int], root: torch.Tensor, slots: int,
              greedy: list[bool] | None = None) -> DraftState:
        """Prefill hook: features (B, P, F) of the right-padded prompts ids (B, P), their lengths, roots (B,); ``greedy``
        per row: it decodes greedily, so its output never depends on what is drafted (None: all rows)."""

    def propose(self, state: DraftState, root: torch.Tensor, end: torch.Tensor, longest: int, nodes: int,
                sampling: DraftSampling | None = None) -> Proposal:
        """A tree of at most ``nodes`` nodes after each row's root (B,); ``end`` (B,) committed lengths, ``longest`` their max.

        ``sampling`` (rejection sampling of sampled rows): a proposer may draw its drafts from
        its distributions and return them as ``Proposal.draft``; it may also ignore it.
        """

    def commit(self, state: DraftState, proposal: Proposal, features: torch.Tensor, acc: Acceptance, ends: list[int],
               lengths: list[int]) -> None:
        """Accept hook: the verification's features (B, T, F), the accepted path, the rows' committed lengths before
        the step and accepted nodes per row (host)."""


def host_proposal(root: torch.Tensor, trees: list[list[tuple[int, int]]], plain: TreeBuffers | None = None,
                  chain: bool = False) -> Proposal:
    """The proposal of per-row trees drafted on the host: ``trees[b]`` lists (parent position, token) per node, parents
    first (position 0 is the root). Rows with fewer nodes than the largest tree are padded to its size with filler
    children of the root carrying tokens no sibling carries (lowest ids first): point-mass candidates like any other,
    so acceptance stays exact and the batch keeps one tree size. ``chain``: every tree is a chain (each node the child
    of the one before); a shorter one is followed by filler that no path reaches (:func:`~distill.engine.tree.chain_buffers`),
    which the kernel's forward skips. No row drafting anything: a plain step (``plain``: the empty tree's buffers on
    root's device, kept by the caller; built when None)."""
    T = 1 + max(map(len, trees), default=0)
    dev = root.device
    if T == 1:
        return Proposal(root[:, None], plain if plain is not None else build_buffers([]).to(dev))
    if chain:
        if any(p != k for tree in trees for k, (p, _) in enumerate(tree)):
            raise ValueError("a chain's node k must be the child of position k")
        tokens = [[0] + [tok for _, tok in tree] + [0] * (T - 1 - len(tree)) for tree in trees]
        tok = torch.tensor(tokens, dtype=torch.long, device=dev)
        tok[:, 0] = root
        nodes = [len(tree) for tree in trees]
        return Proposal(tok, chain_buffers(nodes, T, dev), chain_nodes=nodes)
    parent, tokens, depth = [], [], []
    for tree in trees:
        par_b, tok_b, dep_b = [-1], [0], [0]
        for p, tok in tree:  # parents come first: a node's depth is its parent's + 1
            par_b.append(p)
            tok_b.append(tok)
            dep_b.append(dep_b[p] + 1)
        taken = {tok for p, tok in tree if p == 0}
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


__all__ = ["DraftSampling", "DraftState", "Proposal", "Proposer", "host_proposal"]
