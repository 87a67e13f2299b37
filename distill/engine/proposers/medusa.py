"""The Medusa proposer: heads read the last committed token's hidden state and propose a tree of their top-I tokens.

Terms
-----
proposal
    the tree tokens of one step, (B, T): position 0 is the root (the next token, already
    decided), positions 1..N the heads' candidates laid out by
    :class:`~distill.engine.tree.TreeBuffers` (node ``(r_1, ..., r_d)`` carries head d's
    rank-``r_d`` token). Medusa's candidates are point masses (no draft distribution): the
    rejection rule treats them as ``q = δ_x`` (:mod:`distill.engine.acceptance`).
tree size
    the number of nodes N of the subtree used in a step: the N most probable nodes of the
    resolved tree under its accuracy table (:func:`~distill.engine.tree.subtree`), chosen per
    step by the engine's policy.
proposal cost ``h(N)``
    the weights the heads read for a tree of N nodes over the weights one model forward
    reads (see :mod:`distill.engine.policy`).

The engine's step is proposer-agnostic (:mod:`distill.engine.proposers.base`): it asks
:meth:`Medusa.propose` for the tokens of a tree shape, verifies them in one forward, accepts
and compacts the KV cache itself. The only state Medusa reads is the hidden state of each
row's last committed token (:class:`MedusaState`), set by :meth:`Medusa.start` and
:meth:`Medusa.commit`.
"""

from __future__ import annotations

import torch

from distill.engine.acceptance import Acceptance
from distill.engine.policy import taus_for
from distill.engine.proposers.base import Proposal
from distill.engine.tree import ResolvedTree, TreeBuffers, build_buffers, subtree
from distill.heads.model import MedusaHeads


class MedusaState:
    """Per row: the hidden state of the last committed token (B, H)."""

    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden  # (B, H)

    def keep(self, rows: list[int], used: int) -> None:
        self.hidden = self.hidden[torch.tensor(rows, dtype=torch.long, device=self.hidden.device)]

    def join(self, other: "MedusaState", used: int) -> None:
        self.hidden = torch.cat([self.hidden, other.hidden])


class Medusa:
    """Medusa heads and their tree (see the module docstring); a :class:`~distill.engine.proposers.base.Proposer`."""

    name = "medusa"
    feature_layers = None  # the last hidden state

    def __init__(self, heads: MedusaHeads, tree: ResolvedTree, device: torch.device):
        self.heads = heads.eval()
        self.tree = tree
        self.device = device
        self._buffers: dict[int, TreeBuffers] = {}

    def taus(self) -> dict[int, float]:
        return taus_for(self.tree.paths, self.tree.accuracy)

    @property
    def max_nodes(self) -> int:
        return len(self.tree.paths)

    def buffers(self, nodes: int) -> TreeBuffers:
        """Buffers of the tree's ``nodes`` most probable nodes (built once per size, on the device)."""
        if nodes not in self._buffers:
            self._buffers[nodes] = build_buffers(subtree(self.tree.paths, self.tree.accuracy, nodes)).to(self.device)
        return self._buffers[nodes]

    # -- the proposer's calls ---------------------------------------------------------------------
    def start(self, features: torch.Tensor, ids: torch.Tensor, lengths: list[int], root: torch.Tensor, slots: int,
              greedy: list[bool] | None = None) -> MedusaState:
        """The hidden state at each prompt's last token: features (B, P, H)."""
        rows = torch.arange(features.shape[0], device=features.device)
        return MedusaState(features[rows, torch.tensor(lengths, device=features.device) - 1])  # (B, H)

    def propose(self, state: MedusaState, root: torch.Tensor, end: torch.Tensor, longest: int, nodes: int,
                sampling=None) -> Proposal:
        """The heads' top-I tree (point masses whatever ``sampling`` says)."""
        buf = self.buffers(nodes)
        return Proposal(self.tree_tokens(state.hidden, root, buf), buf)

    def commit(self, state: MedusaState, proposal: Proposal, features: torch.Tensor, acc: Acceptance, ends: list[int],
               lengths: list[int]) -> None:
        """The hidden state of the last accepted node: features (B, T, H)."""
        state.hidden = features[torch.arange(features.shape[0], device=features.device), acc.last]  # (B, H)

    def tree_tokens(self, hidden: torch.Tensor, root: torch.Tensor, buf: TreeBuffers) -> torch.Tensor:
        """Heads' top-I tokens laid out as the tree: hidden (B, H), root (B,) -> tokens (B, T)."""
        D = buf.num_heads_used
        if self.heads.config.share_lm_head:  # one LM head: one matmul for all heads
            states = torch.stack([self.heads.blocks[k](hidden) for k in range(D)], dim=1)  # (B, D, H)
            top = self.heads.lm_head(0)(states).topk(buf.max_rank, dim=-1).indices  # (B, D, I)
            flat = top.flatten(1)  # (B, D * I)
        else:
            tops = [self.heads.head_logits(hidden, k).topk(buf.max_rank, dim=-1).indices for k in range(D)]
            flat = torch.cat(tops, dim=-1)  # (B, D * I)
        tokens = flat[:, buf.cand_index]  # (B, T)
        tokens[:, 0] = root
        return tokens

    def proposal_cost(self, nodes: int, forward_weights: int) -> float:
        """h: weights the heads read for a tree of ``nodes`` nodes / ``forward_weights`` (weights one forward reads)."""
        depth = max(len(p) for p in subtree(self.tree.paths, self.tree.accuracy, nodes))
        hc = self.heads.config
        block = hc.num_layers * (hc.hidden_size**2 + (hc.hidden_size if hc.bias else 0))
        lm = hc.vocab_size * hc.hidden_size
        return (depth * block + (1 if hc.share_lm_head else depth) * lm) / forward_weights


__all__ = ["Medusa", "MedusaState"]
