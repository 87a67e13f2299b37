"""Acceptance: which tree tokens the base model agrees with, as pure tensor functions.

Terms
-----
tree tokens ``tokens`` (B, T)
    the verification input: position 0 is the root (the next token, already decided
    by the model), positions 1..N the heads' candidates laid out by
    :class:`~distill.engine.tree.TreeBuffers`.
target distribution ``p_i`` (B, T, V)
    the model's next-token distribution after tree position i, read from the
    verification logits and warped by the request's temperature and top-p
    (:func:`distill.sampling.warp`); at temperature 0 it is the one-hot argmax.
accepted path
    root plus the nodes ``a_1, ..., a_L`` (depths 1..L) the rule accepts, each the
    child of the previous; ``L`` = accepted length (0..D).
next token
    the token after the last accepted node ``a_L``, drawn by the rule from ``p_{a_L}``
    (greedy: its argmax; rejection: the residual after rejected siblings). It is
    always emitted ("the first token is always accepted") and becomes the next root.
    A step therefore emits ``L + 1`` tokens: the accepted candidates and the next token.

Rules
-----
greedy
    node x (child of n) is correct when ``x == argmax p_n``; the longest all-correct
    path wins (first in retrieval order on ties). The output is token-for-token that
    of plain greedy decoding.
typical (Medusa's typical acceptance, Cai et al. 2024, Sec. 3.3.1)
    node x is plausible when ``p_n(x) > min(ε, δ·exp(−H(p_n)))``, H the entropy in
    nats; the longest all-plausible path wins; the next token is sampled from
    ``p_{a_L}``. Defaults ε = 0.09, δ = 0.3 (:data:`TYPICAL_EPSILON`, :data:`TYPICAL_DELTA`,
    ε² ≈ δ·exp(−H) at the entropies seen in chat). Not lossless, but at temperature 0
    (one-hot p) it accepts exactly what greedy accepts.
rejection (multi-candidate "recursive" rejection sampling, as in SpecInfer / Medusa)
    candidates are the heads' top-i tokens, i.e. drawn from a point-mass proposal
    ``q = δ_x``. Walking down from the root with residual ``r = p_n``: try the children
    of n in rank order; accept child x with probability ``min(1, r(x)/q(x)) = r(x)``
    (r normalised); on rejection set ``r ← norm(max(r − q, 0))``, i.e. zero x and
    renormalise, and try the next sibling. If a child is accepted descend into it
    (fresh ``r = p_child``); if all children are rejected (or n is a leaf) sample the
    next token from r. Each emitted token is then distributed exactly as ``p_n``
    (the residual trick makes "accept x or fall through to the residual" an exact
    draw from p), so the output is distributed as plain sampling.
rejection with draft distributions (multi-round speculative sampling, SpecInfer; EAGLE Sec. 3.3)
    when the children of node n were drawn i.i.d. from a draft distribution ``q_n``
    (``draft``, (B, T, V)), walking them in order with residual ``r = p_n``: accept child x
    with probability ``min(1, r(x)/q_n(x))``; on rejection ``r ← norm(max(r − q_n, 0))``;
    if all are rejected, sample the next token from r. Lossless as long as, given
    everything drafted outside n's children, their number does not depend on their values
    and they are i.i.d. from ``q_n`` (:mod:`distill.engine.proposers.eagle`'s sampled tree keeps whole
    sibling groups for that reason).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from distill.engine.config import TYPICAL_DELTA, TYPICAL_EPSILON
from distill.engine.tree import TreeBuffers


@dataclass
class Acceptance:
    """The outcome of one verification for a batch."""

    length: torch.Tensor  # (B,) long: accepted nodes L (0..D)
    path: torch.Tensor  # (B, D + 1) long: tree positions root, a_1..a_L, then don't-care (valid positions)
    next_token: torch.Tensor  # (B,) long
    last: torch.Tensor  # (B,) long: tree position of a_L (0 when L = 0)


def sample(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One draw per row of ``probs`` (B, V), row b with ``generators[b]`` (None: torch's default): (B,) long."""
    if all(g is None for g in generators):
        return torch.multinomial(probs, 1).squeeze(1)
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for b in range(probs.shape[0]):
        out[b] = torch.multinomial(probs[b], 1, generator=generators[b])[0]
    return out


def uniform(rows: int, cols: int, generators: Sequence[torch.Generator | None], device) -> torch.Tensor:
    """Uniform [0, 1) draws (rows, cols), row b from ``generators[b]`` (None: torch's default)."""
    if all(g is None for g in generators):
        return torch.rand(rows, cols, device=device)
    return torch.stack([torch.rand(cols, generator=g, device=device) for g in generators])


def _at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-row positions: x (B, T, ...) at index (B, M) -> (B, M, ...)."""
    return x[torch.arange(x.shape[0], device=x.device)[:, None], index]


def _parent_probs(probs: torch.Tensor, tokens: torch.Tensor, buffers: TreeBuffers) -> torch.Tensor:
    """p_{parent(i)}(token_i) for every tree position (B, T); 0 at the root."""
    par = buffers.rows(tokens.shape[0]).parent.clamp(min=0)  # (B, T)
    pp = _at(probs, par).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, T)
    pp[:, 0] = 0.0
    return pp


def longest_path(node_ok: torch.Tensor, buffers: TreeBuffers) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """node_ok (B, T) bool (node acceptable given its parent) -> (length (B,), path (B, D+1), last (B,)).

    The longest path of consecutive acceptable nodes from the root; ties go to the first
    leaf path in retrieval order.
    """
    B = node_ok.shape[0]
    ret = buffers.rows(B).retrieve  # (B, P, D+1)
    if ret.shape[-1] == 1:  # root only: plain decoding
        zeros = torch.zeros(B, dtype=torch.long, device=node_ok.device)
        return zeros, zeros[:, None].clone(), zeros
    nodes = ret[:, :, 1:]  # (B, P, D)
    P, D = nodes.shape[1:]
    ok = node_ok.gather(1, nodes.clamp(min=0).reshape(B, P * D)).view(B, P, D) & (nodes >= 0)  # (B, P, D)
    lengths = ok.long().cumprod(-1).sum(-1)  # (B, P)
    best = lengths.argmax(-1)  # (B,) first maximum
    length = lengths.gather(1, best[:, None]).squeeze(1)  # (B,)
    path = _at(ret, best[:, None])[:, 0].clamp(min=0)  # (B, D+1)
    last = path.gather(1, length[:, None]).squeeze(1)  # (B,)
    return length, path, last


def greedy_accept(tokens: torch.Tensor, logits: torch.Tensor, buffers: TreeBuffers,
                  argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Acceptance:
    """Greedy verification: tokens (B, T), logits (B, T, V) -> Acceptance. ``argmax``: the first maximum over the
    last axis (torch's when None; an engine passes its target's, which may run on a kernel)."""
    target = argmax(logits) if argmax is not None else logits.argmax(-1)  # (B, T)
    node_ok = tokens == target.gather(1, buffers.rows(tokens.shape[0]).parent.clamp(min=0))  # (B, T)
    node_ok[:, 0] = False
    length, path, last = longest_path(node_ok, buffers)
    next_token = target.gather(1, last[:, None]).squeeze(1)
    return Acceptance(length, path, next_token, last)


def typical_threshold(probs: torch.Tensor, epsilon: float, delta: float) -> torch.Tensor:
    """min(ε, δ·exp(−H(p))) for distributions (..., V) -> (...)."""
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    return torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))


def typical_accept(
    tokens: torch.Tensor,
    probs: torch.Tensor,
    buffers: TreeBuffers,
    generators: Sequence[torch.Generator | None],
    epsilon: float = TYPICAL_EPSILON,
    delta: float = TYPICAL_DELTA,
) -> Acceptance:
    """Typical acceptance: tokens (B, T), target distributions probs (B, T, V) -> Acceptance."""
    thr = typical_threshold(probs, epsilon, delta)  # (B, T)
    node_ok = _parent_probs(probs, tokens, buffers) > thr.gather(1, buffers.rows(tokens.shape[0]).parent.clamp(min=0))  # (B, T)
    node_ok[:, 0] = False
    length, path, last = longest_path(node_ok, buffers)
    last_p = probs[torch.arange(probs.shape[0], device=probs.device), last]  # (B, V)
    return Acceptance(length, path, sample(last_p, generators), last)


def rejection_accept(
    tokens: torch.Tensor, probs: torch.Tensor, buffers: TreeBuffers, generators: Sequence[torch.Generator | None],
    draft: torch.Tensor | None = None,
) -> Acceptance:
    """Tree rejection sampling (see the module docstring): lossless.

    ``draft`` None: the candidates are point-mass proposals (deterministic choices such as
    top-k); ``draft`` (B, T, V): node n's children were drawn i.i.d. from ``draft[:, n]``.
    """
    if draft is not None:
        return _rejection_with_drafts(tokens, probs, buffers, generators, draft)
    B, T, V = probs.shape
    dev = probs.device
    rows = torch.arange(B, device=dev)
    buffers = buffers.rows(B)
    D = buffers.retrieve.shape[-1] - 1
    cur = torch.zeros(B, dtype=torch.long, device=dev)  # current node per sequence
    alive = torch.ones(B, dtype=torch.bool, device=dev)  # still descending
    length = torch.zeros(B, dtype=torch.long, device=dev)
    path = torch.zeros(B, D + 1, dtype=torch.long, device=dev)
    C = buffers.children.shape[-1]
    for d in range(1, D + 1):
        kids = buffers.children[rows, cur]  # (B, C) tree positions, -1 padded
        has = kids >= 0
        alive = alive & has[:, 0]
        if not bool(alive.any()):
            break
        p = probs[rows, cur]  # (B, V)
        kid_tok = tokens.gather(1, kids.clamp(min=0))  # (B, C)
        pk = p.gather(1, kid_tok) * has  # (B, C): p(x_i)
        before = pk.cumsum(-1) - pk  # mass of the siblings tried before x_i
        ratio = pk / (1.0 - before).clamp_min(1e-12)  # r(x_i) after zeroing earlier siblings
        u = uniform(B, C, generators, dev)  # (B, C)
        hit = (u < ratio) & has  # (B, C)
        first = hit.float().argmax(-1)  # (B,) first accepted sibling (valid where any hit)
        accepted = alive & hit.any(-1)
        nxt = kids.gather(1, first[:, None]).squeeze(1)
        cur = torch.where(accepted, nxt, cur)
        path[:, d] = torch.where(accepted, nxt, path[:, d])
        length = length + accepted.long()
        alive = accepted
    # Residual at the last accepted node: its children (all tried and rejected, if any) zeroed.
    p = probs[rows, cur]  # (B, V)
    kids = buffers.children[rows, cur]  # (B, C)
    kid_tok = tokens.gather(1, kids.clamp(min=0))  # (B, C)
    tried = torch.zeros_like(p).scatter_reduce(1, kid_tok, (kids >= 0).float(), reduce="amax")  # (B, V)
    residual = p * (1.0 - tried)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)
    # path entries beyond the accepted length stay 0 (the root): valid indices, ignored by the caller
    return Acceptance(length, path, sample(residual, generators), cur)


def _rejection_with_drafts(tokens: torch.Tensor, probs: torch.Tensor, buffers: TreeBuffers,
                           generators: Sequence[torch.Generator | None], draft: torch.Tensor) -> Acceptance:
    """Multi-round speculative sampling down the tree: tokens (B, T), probs / draft (B, T, V)."""
    B, T, V = probs.shape
    dev = probs.device
    rows = torch.arange(B, device=dev)
    buffers = buffers.rows(B)
    D = buffers.retrieve.shape[-1] - 1
    C = buffers.children.shape[-1]
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)  # still descending
    length = torch.zeros(B, dtype=torch.long, device=dev)
    path = torch.zeros(B, D + 1, dtype=torch.long, device=dev)
    residual = probs[:, 0].clone()  # (B, V): where the walk stops, the distribution of the next token
    for d in range(1, D + 1):
        kids = buffers.children[rows, cur]  # (B, C)
        q = draft[rows, cur].float()  # (B, V)
        r = probs[rows, cur].clone()  # (B, V): fresh at the node
        u = uniform(B, C, generators, dev)  # (B, C)
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        nxt = cur.clone()
        for c in range(C):
            has = alive & ~moved & (kids[:, c] >= 0)  # rows trying their c-th child now
            x = tokens.gather(1, kids[:, c : c + 1].clamp(min=0)).squeeze(1)  # (B,)
            rx, qx = r.gather(1, x[:, None]).squeeze(1), q.gather(1, x[:, None]).squeeze(1)
            ok = has & (u[:, c] * qx < rx)  # u < min(1, r(x)/q(x))
            nxt = torch.where(ok, kids[:, c], nxt)
            moved = moved | ok
            rej = has & ~ok
            if bool(rej.any()):
                rest = (r - q).clamp(min=0)
                mass = rest.sum(-1, keepdim=True)
                rest = torch.where(mass > 0, rest / mass.clamp_min(1e-30), r)
                r = torch.where(rej[:, None], rest, r)
        stop = alive & ~moved  # every child rejected (or a leaf): the next token comes from r here
        residual = torch.where(stop[:, None], r, residual)
        alive = alive & moved
        cur = torch.where(alive, nxt, cur)
        path[:, d] = torch.where(alive, nxt, path[:, d])
        length = length + alive.long()
        if not bool(alive.any()):
            break
    residual = torch.where(alive[:, None], probs[rows, cur], residual)  # walked to the deepest level: p at the last node
    return Acceptance(length, path, sample(residual, generators), cur)


__all__ = [
    "Acceptance",
    "TYPICAL_DELTA",
    "TYPICAL_EPSILON",
    "greedy_accept",
    "longest_path",
    "rejection_accept",
    "sample",
    "typical_accept",
    "typical_threshold",
]
