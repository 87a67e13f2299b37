"""The EAGLE proposer: an EAGLE-3 drafter with its own KV cache drafts a dynamic tree (EAGLE-2) per row.

Terms (the drafter's own are in :mod:`distill.heads.eagle`)
-----
features
    the hidden states entering the drafter's aux layers, concatenated (B, T, A·H): the
    engine captures them in every target forward (``feature_layers``); the drafter fuses them.
drafter cache
    a :class:`~distill.engine.cache.SlotCache` of the drafter's one layer, laid out as the
    target's: row b's committed slots ``0 .. end_b - 1`` hold the drafter's keys for the
    committed tokens (slot = position), computed from the target's features. The slots from
    ``end_b`` on are the draft scratch: ``(D - 1)·K`` slots, depth d's expanded nodes at
    ``end_b + (d - 1)·K + j``. They are overwritten by the next catch-up.
catch-up
    one drafter pass over the tokens a forward committed (the prompt after the prefill; the
    root and the accepted nodes after a step): at position t it reads the target's feature
    at t and the embedding of the token after t, writes its keys at slot t, and its output at
    the last committed position gives the depth-1 draft distribution and the feature the
    depth-1 nodes are expanded with. Rows accept different lengths: the pass is padded to the
    longest, padded queries write free slots and are never read.
dynamic tree (EAGLE-2: Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with
Dynamic Draft Trees", Sec. 4)
    node score = cumulative draft log-probability of its path. Depth 1: the root's top-K
    tokens. Expansion: the K best-scoring nodes of the newest depth are run through the
    drafter together (one pass, position ``end - 1 + d``, each seeing the committed slots and
    its own ancestors' scratch slots); each gets its top-K children, the K² candidates of
    the next depth. After D - 1 expansions, rerank: the N best-scoring candidates of all
    depths form the tree (a child never scores above its parent and ties keep the parent
    first, so the set is prefix-closed). Draft ids are mapped to target ids with ``d2t``.
sampled tree (rejection sampling of sampled rows)
    the same expansion, but each expanded node's K children are drawn i.i.d. from its draft
    distribution q (the drafter's at the row's temperature; greedy rows keep their top-K),
    and the rerank keeps whole sibling groups, ranked by their parent's score: the root's
    group, then the best ``N // K - 1``. Whether a group exists then never depends on its
    own draws, which multi-round speculative sampling with q needs to stay lossless
    (:func:`~distill.engine.acceptance.rejection_accept` with ``draft``).
deferred catch-up
    a step the drafter did not draft for (a plain step: the policy chose no tree; or a
    union's step whose budget went to the other parts) has its catch-up kept (the committed
    tokens' next tokens and features) instead of run, and the kept steps are caught up in
    one drafter pass before the next draft, before rows leave or join, after
    :data:`DEFER_STEPS` steps, or before the rows' padding in that pass would outgrow the
    scratch slots. Rows commit their tokens at consecutive positions, so one pass over them
    is the same computation as one pass per step, and a server whose batches run plain steps
    (the policy finds no tree pays at that batch) does not read the drafter's weights every
    step.
proposal cost ``h(N)``
    weights the drafter reads per step, D passes (the catch-up and D - 1 expansions) of its
    layer, fc and draft LM head, over the weights of one target forward.
"""

from __future__ import annotations

import torch

from distill.engine import cache as kv
from distill.engine.acceptance import Acceptance
from distill.engine.graphs import Graphs, cache_key
from distill.engine.policy import candidate_sizes
from distill.engine.proposers.base import DraftSampling, Proposal
from distill.engine.tree import row_buffers
from distill.errors import ConfigError
from distill.heads.eagle import EagleDrafter

#: Default dynamic tree: node budget N, depth D, top-K per expanded node. N sized for a CPU, where a verification
#: forward costs more per token than on a GPU (EAGLE-2's GPU default is 60 nodes, depth 6, top-10).
DEFAULT_NODES, DEFAULT_DEPTH, DEFAULT_TOPK = 24, 5, 8
#: Per-depth acceptance assumed until ``distill calibrate`` measures it: the probability that depth d's rank-i draft is
#: the target's token given a correct prefix, top-1 0.6 at every depth (EAGLE reports 0.6-0.8 on 7B chat models),
#: halving per rank. Used only by the policy's expected tokens per step.
DEFAULT_TOP1, DEFAULT_RANK_DECAY = 0.6, 0.5
#: Steps whose catch-up waits for one pass at most (module docstring: deferred catch-up).
DEFER_STEPS = 32


def default_eagle_accuracy(depth: int, ranks: int) -> list[list[float]]:
    """The (D, I) acceptance table the policy assumes without a calibration (see :data:`DEFAULT_TOP1`)."""
    return [[DEFAULT_TOP1 * DEFAULT_RANK_DECAY**i for i in range(ranks)] for _ in range(depth)]


class EagleState:
    """Per batch: the drafter's cache, and per row the depth-1 draft (log-probabilities) and its parent feature."""

    def __init__(self, cache: kv.SlotCache, eagle: "Eagle"):
        self.cache = cache
        self.eagle = eagle
        self.feature: torch.Tensor | None = None  # (B, H): the drafter output at the last committed position
        self.logp: torch.Tensor | None = None  # (B, Vd) float32: its draft log-probabilities (the depth-1 draft)
        # steps not caught up: next tokens (B, Q), features (B, Q, A·H), committed per row (B,) (None: Q, every row)
        self.deferred: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self.deferred_start: torch.Tensor | None = None  # (B,): the first deferred step's position per row
        self.deferred_window = 0  # host: the longest row's committed length at the first deferred step
        self.deferred_padding = 0  # host: Σ (Q - 1) of the deferred steps, what a row's padding can reach
        self.proposed = False  # this step's tree is (partly) the drafter's: its catch-up runs now

    def keep(self, rows: list[int], used: int) -> None:
        self.eagle.catch_up_deferred(self)
        self.cache.keep_rows(rows, used)
        index = torch.tensor(rows, dtype=torch.long, device=self.logp.device)
        self.feature, self.logp = self.feature[index], self.logp[index]

    def join(self, other: "EagleState", used: int) -> None:
        self.eagle.catch_up_deferred(self)
        self.eagle.catch_up_deferred(other)
        self.cache.append(other.cache, used)
        self.feature, self.logp = torch.cat([self.feature, other.feature]), torch.cat([self.logp, other.logp])


class Eagle:
    """An EAGLE-3 drafter drafting EAGLE-2 dynamic trees; a :class:`~distill.engine.proposers.base.Proposer`."""

    name = "eagle3"

    def __init__(self, drafter: EagleDrafter, embed: torch.nn.Module, nodes: int = DEFAULT_NODES, depth: int = DEFAULT_DEPTH,
                 topk: int = DEFAULT_TOPK, accuracy: list[list[float]] | None = None):
        if nodes < 1 or depth < 1 or topk < 1:
            raise ConfigError(f"an EAGLE tree needs nodes, depth and top-k >= 1; got {nodes}, {depth}, {topk}")
        if topk > drafter.config.draft_vocab_size:
            raise ConfigError(f"top-k {topk} exceeds the draft vocabulary ({drafter.config.draft_vocab_size} tokens)")
        self.drafter = drafter.eval()
        self.embed = embed  # the target's input embedding (frozen, shared)
        self.feature_layers = tuple(drafter.config.aux_layer_ids)
        self.max_nodes, self.depth, self.topk = nodes, depth, topk
        acc = [list(r) for r in (accuracy or default_eagle_accuracy(depth, topk))]
        self.accuracy = (acc + [acc[-1]] * depth)[:depth]  # a shallower calibration: its deepest row repeats
        p = next(drafter.parameters())
        attn = drafter.midlayer.self_attn
        conf = drafter.config.llama_config()
        head_dim = getattr(conf, "head_dim", None) or conf.hidden_size // conf.num_attention_heads
        self.kv_shape = kv.KVShape(1, attn.k_proj.out_features // head_dim, head_dim, head_dim, p.dtype, p.device)
        self.target_ids = drafter.vocab.target_ids.to(p.device)  # (Vd,): draft id -> target id (d2t applied)
        self.graphs: Graphs | None = None  # the engine's CUDA graphs: catch-ups and expansions replayed (engine.graphs)
        self.pool: kv.SlotPool | None = None  # with graphs: the drafter caches' storage, reused (engine.cache, "pooled storage")

    def use_graphs(self, graphs: Graphs | None) -> None:
        """Record the drafter's catch-ups and expansions in ``graphs`` (None: eager), its caches from a pool."""
        self.graphs = graphs
        self.pool = kv.SlotPool(self.kv_shape) if graphs is not None else None

    def shape(self, nodes: int) -> tuple[int, int, int]:
        """(N, D, K) of a tree of at most ``nodes`` nodes."""
        n = min(nodes, self.max_nodes)
        return n, min(self.depth, n), min(self.topk, n)

    @property
    def scratch(self) -> int:
        """Draft slots after a row's end: the expanded nodes' (D - 1)·K, and room for a catch-up's padding."""
        return max((self.depth - 1) * self.topk, self.depth + 1)

    # -- the policy's figures ------------------------------------------------------------------
    def taus(self) -> dict[int, float]:
        """Expected tokens per step of N nodes: the best static tree of N nodes under the acceptance table."""
        from distill.heads.tree import expected_acceptance_length, sparse_tree

        acc = self.accuracy
        return {n: expected_acceptance_length(sparse_tree(acc, n), acc) for n in candidate_sizes(self.max_nodes) if n}

    def proposal_cost(self, nodes: int, forward_weights: int) -> float:
        _, D, _ = self.shape(nodes)
        per_pass = sum(p.numel() for p in self.drafter.parameters())
        return D * per_pass / forward_weights

    # -- the proposer's calls --------------------------------------------------------------------
    def start(self, features: torch.Tensor, ids: torch.Tensor, lengths: list[int], root: torch.Tensor, slots: int,
              greedy: list[bool] | None = None) -> EagleState:
        """Catch up on the prompts: features (B, P, A·H), ids (B, P) right-padded, roots (B,)."""
        B, P = ids.shape
        state = EagleState(kv.SlotCache(self.kv_shape, B, slots + self.scratch, pool=self.pool), self)
        count = torch.tensor(lengths, dtype=torch.long, device=ids.device)  # (B,)
        nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # (B, P): the token after each position
        nxt.scatter_(1, (count - 1)[:, None], root[:, None])  # the root follows each prompt's last token
        self._catch_up(state, nxt, features, torch.zeros_like(count), count, P, graphed=False)  # prompts: lengths vary
        return state

    def commit(self, state: EagleState, proposal: Proposal, features: torch.Tensor, acc: Acceptance, ends: list[int],
               lengths: list[int]) -> None:
        """Catch up on the root and the accepted nodes with the verification's features (B, T, A·H).

        A step the drafter did not draft for has its catch-up deferred (module docstring).
        """
        proposed, state.proposed = state.proposed, False
        if proposal.buffers.nodes == 0:  # one token per row, at position ends[b]; the next token is the new root
            nxt, feats, count = acc.next_token[:, None], features[:, :1], None
        else:
            Q = max(lengths) + 1
            path = acc.path[:, :Q]  # (B, Q): root, a_1..a_L, then don't-care
            committed = proposal.tokens.gather(1, path)  # (B, Q)
            nxt = torch.cat([committed[:, 1:], committed[:, :1]], dim=1)  # the token after each committed one
            nxt.scatter_(1, acc.length[:, None], acc.next_token[:, None])  # after a_L: the next token (the new root)
            feats = features.gather(1, path[:, :, None].expand(-1, -1, features.shape[-1]))  # (B, Q, A·H)
            count = acc.length + 1
        if proposed:
            self.catch_up_deferred(state)
            start = torch.tensor(ends, dtype=torch.long, device=nxt.device)
            self._catch_up(state, nxt, feats, start, count if count is not None else torch.ones_like(start),
                           max(ends) + nxt.shape[1])
            return
        if state.deferred and state.deferred_padding + nxt.shape[1] - 1 > self.scratch:
            self.catch_up_deferred(state)  # the rows' padding in one pass would outgrow the scratch slots
        if not state.deferred:
            state.deferred_start = torch.tensor(ends, dtype=torch.long, device=features.device)
            state.deferred_window = max(ends)
            state.deferred_padding = 0
        state.deferred.append((nxt, feats, count))
        state.deferred_padding += nxt.shape[1] - 1
        if len(state.deferred) >= DEFER_STEPS:
            self.catch_up_deferred(state)

    def catch_up_deferred(self, state: EagleState) -> None:
        """One drafter pass over the steps whose catch-up was deferred (none: nothing to do): each row's committed
        tokens of those steps, one after the other, padded to the longest row's."""
        if not state.deferred:
            return
        steps, state.deferred = state.deferred, []
        B, dev = steps[0][0].shape[0], steps[0][0].device
        if all(c is None for _, _, c in steps):  # every row committed every step's Q tokens: columns side by side
            nxt = torch.cat([n for n, _, _ in steps], dim=1)  # (B, P)
            feats = torch.cat([f for _, f, _ in steps], dim=1)  # (B, P, A·H)
            count = torch.full((B,), nxt.shape[1], dtype=torch.long, device=dev)
        else:
            counts = [c if c is not None else torch.full((B,), n.shape[1], dtype=torch.long, device=dev) for n, _, c in steps]
            width = sum(n.shape[1] for n, _, _ in steps)  # column `width`: where the rows' padding lands, then dropped
            nxt = torch.zeros(B, width + 1, dtype=torch.long, device=dev)
            feats = torch.zeros(B, width + 1, steps[0][1].shape[-1], dtype=steps[0][1].dtype, device=dev)
            offset = torch.zeros(B, dtype=torch.long, device=dev)
            for (n, f, _), c in zip(steps, counts):
                j = torch.arange(n.shape[1], device=dev)[None]  # (1, Q)
                at = torch.where(j < c[:, None], offset[:, None] + j, width)  # (B, Q): each row's next positions
                nxt.scatter_(1, at, n)
                feats.scatter_(1, at[:, :, None].expand(-1, -1, f.shape[-1]), f)
                offset = offset + c
            count = offset
            P = int(count.max())
            nxt, feats = nxt[:, :P], feats[:, :P]
        self._catch_up(state, nxt, feats, state.deferred_start, count, state.deferred_window + nxt.shape[1])

    def _catch_up(self, state: EagleState, nxt: torch.Tensor, features: torch.Tensor, start: torch.Tensor,
                  count: torch.Tensor, window: int, graphed: bool = True) -> None:
        """Drafter pass over Q committed positions per row: next tokens (B, Q), features (B, Q, A·H), first slot (B,),
        real positions per row (B,), attention window (host; with graphs, all the cache's slots)."""
        d, cache = self.drafter, state.cache
        graphs = self.graphs if graphed else None
        B, Q = nxt.shape
        if graphs is not None:
            window = cache.slots
        pos = start[:, None] + torch.arange(Q, device=nxt.device)[None]  # (B, Q): slot = position
        keep = (torch.arange(window, device=nxt.device)[None, None, :] <= pos[:, :, None])[:, None]  # (B, 1, Q, W) causal

        def run(nxt, features, pos, keep, count):
            cache.prepare(pos, keep.shape[-1])
            out = d(self.embed(nxt), d.fuse(features), pos, keep, cache)  # (B, Q, H)
            last = out[torch.arange(B, device=out.device), count - 1]  # (B, H)
            return last, torch.log_softmax(d.logits(last).float(), dim=-1)  # (B, Vd)

        if graphs is None:
            state.feature, state.logp = run(nxt, features, pos, keep, count)
        else:
            state.feature, state.logp = graphs(("eagle catch-up", cache_key(cache), Q), run, nxt, features, pos, keep, count)

    def _expand(self, state: EagleState, tok: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor, write: torch.Tensor,
                keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One expansion pass: draft ids (B, K), parent outputs (B, K, H), positions and scratch slots (B, K),
        keep-mask (B, 1, K, W) -> outputs (B, K, H) and draft log-probabilities (B, K, Vd)."""
        d, cache = self.drafter, state.cache

        def run(tok, feat, pos, write, keep):
            cache.prepare(write, keep.shape[-1])
            out = d(self.embed(self.target_ids[tok]), feat, pos, keep, cache)  # (B, K, H)
            return out, torch.log_softmax(d.logits(out).float(), dim=-1)

        if self.graphs is None:
            return run(tok, feat, pos, write, keep)
        return self.graphs(("eagle expansion", cache_key(cache), tok.shape[1]), run, tok, feat, pos, write, keep)

    def propose(self, state: EagleState, root: torch.Tensor, end: torch.Tensor, longest: int, nodes: int,
                sampling: DraftSampling | None = None) -> Proposal:
        """The dynamic tree of at most ``nodes`` nodes (module docstring): tokens (B, N + 1) and per-row buffers.

        ``sampling`` given: the sampled tree (module docstring), with each node's draft distribution.
        """
        self.catch_up_deferred(state)
        state.proposed = True
        N, D, K = self.shape(nodes)
        B, dev = root.shape[0], root.device
        S = (D - 1) * K  # scratch slots used
        window = state.cache.slots if self.graphs is not None else longest + S  # graphs: a static window
        logq = self._warp(state.logp, sampling)  # (B, Vd): the root's draft distribution
        lp, tok = self._children(logq[:, None], K, sampling)  # (B, 1, K)
        score, tok = lp[:, 0], tok[:, 0]  # (B, K): depth-1 candidates (draft ids), cumulative log q
        scores, tokens, parents, depths = [score], [tok], [torch.full((B, K), -1, dtype=torch.long, device=dev)], [1] * K
        probs = [score.exp()]  # (B, K): draft probability given the parent
        qs, q_at = [logq[:, None]], [torch.full((B, 1), -1, dtype=torch.long, device=dev)]  # expanded nodes' log q, candidate index
        groups, group_score = [], []  # sampled tree: per expanded node, its children's candidate indices and its score
        front = torch.arange(K, device=dev).expand(B, K)  # (B, K): candidate index of each expanded node
        f_score, f_tok = score, tok
        f_feat = state.feature[:, None].expand(B, K, state.feature.shape[-1])  # (B, K, H): their parents' outputs
        anc = torch.zeros(B, K, max(S, 1), dtype=torch.bool, device=dev)  # (B, K, S): scratch slots each may see
        base = K
        for depth in range(1, D):  # expand the K best nodes of depth `depth`
            own = (depth - 1) * K + torch.arange(K, device=dev)  # (K,) their scratch slots
            anc[:, torch.arange(K, device=dev), own] = True
            pos = (end - 1 + depth)[:, None].expand(B, K)  # (B, K)
            keep = kv.step_allowed(end, anc, window)  # (B, 1, K, W)
            out, logq = self._expand(state, f_tok, f_feat, pos, end[:, None] + own[None], keep)  # (B, K, H), (B, K, Vd)
            logq = self._warp(logq, sampling)
            lp, ct = self._children(logq, K, sampling)  # (B, K, K): each expanded node's K children
            cs = (f_score[:, :, None] + lp).flatten(1)  # (B, K²) cumulative scores
            scores.append(cs)
            tokens.append(ct.flatten(1))
            probs.append(lp.exp().flatten(1))
            parents.append(front[:, :, None].expand(B, K, K).flatten(1))
            depths += [depth + 1] * (K * K)
            qs.append(logq)
            q_at.append(front)
            groups.append((base + torch.arange(K * K, device=dev).view(K, K)).expand(B, K, K))
            group_score.append(f_score)
            if depth < D - 1:
                f_score, pick = cs.topk(K, dim=-1)  # (B, K): the next depth's expanded nodes
                up = pick // K  # (B, K): their parents among this depth's expanded nodes
                f_tok = ct.flatten(1).gather(1, pick)
                f_feat = out.gather(1, up[:, :, None].expand(B, K, out.shape[-1]))
                anc = anc.gather(1, up[:, :, None].expand(B, K, anc.shape[-1]))
                front = base + pick
            base += K * K
        score_all, tok_all, par_all = torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1)  # (B, M)
        if sampling is None:  # rerank nodes: the N best of all depths
            chosen = score_all.sort(dim=1, descending=True, stable=True).indices[:, :N]
        else:  # rerank sibling groups by their parent's score: the root's, then the best N // K - 1 others
            g = min(N // K - 1, len(groups) * K)
            chosen = torch.arange(K, device=dev).expand(B, K)
            if g > 0:
                kids = torch.cat(groups, 1)  # (B, G, K)
                best = torch.cat(group_score, 1).sort(dim=1, descending=True, stable=True).indices[:, :g]  # (B, g)
                chosen = torch.cat([chosen, kids.gather(1, best[:, :, None].expand(B, g, K)).flatten(1)], 1)
            N = chosen.shape[1]
        chosen = chosen.sort(dim=1).values  # (B, N): candidate order, parents first
        position = torch.zeros_like(score_all, dtype=torch.long)  # (B, M): tree position of each chosen candidate
        position.scatter_(1, chosen, torch.arange(1, N + 1, device=dev).expand(B, N).contiguous())
        up = par_all.gather(1, chosen)  # (B, N) parent candidate, -1 = root
        parent = torch.where(up < 0, torch.zeros_like(up), position.gather(1, up.clamp(min=0)))  # (B, N)
        depth_all = torch.tensor(depths, dtype=torch.long, device=dev)
        minus = torch.full((B, 1), -1, dtype=torch.long, device=dev)
        zero = torch.zeros(B, 1, dtype=torch.long, device=dev)
        buffers = row_buffers(torch.cat([minus, parent], 1), torch.cat([zero, depth_all[chosen]], 1), D, K)
        tree_tokens = torch.cat([root[:, None], self.target_ids[tok_all.gather(1, chosen)]], 1)  # (B, N + 1)
        q = torch.cat([torch.ones(B, 1, device=dev), torch.cat(probs, 1).gather(1, chosen)], 1)  # (B, N + 1)
        draft = None
        if sampling is not None:  # each tree node's draft distribution (its children's), over the target vocabulary
            at = torch.cat(q_at, 1)  # (B, E): candidate index of each expanded node (-1: the root)
            where = torch.where(at < 0, torch.zeros_like(at), position.gather(1, at.clamp(min=0)))  # (B, E); 0 = outside
            where = torch.where((at >= 0) & (where == 0), torch.full_like(where, N + 1), where)  # not in the tree: trash row
            dq = torch.zeros(B, N + 2, self.target_ids.numel(), device=dev)
            dq.scatter_(1, where[:, :, None].expand(-1, -1, dq.shape[-1]), torch.cat(qs, 1).exp())
            draft = torch.zeros(B, N + 1, self.drafter.config.vocab_size, device=dev)
            draft[:, :, self.target_ids] = dq[:, : N + 1]
        return Proposal(tree_tokens, buffers, q, draft)

    @staticmethod
    def _warp(logp: torch.Tensor, sampling: DraftSampling | None) -> torch.Tensor:
        """Draft log-probabilities (B, ..., Vd) at each sampled row's temperature (greedy rows unchanged)."""
        if sampling is None:
            return logp
        t = torch.where(sampling.temperature > 0, sampling.temperature, torch.ones_like(sampling.temperature)).float()
        return torch.log_softmax(logp / t.view(-1, *([1] * (logp.dim() - 1))), dim=-1)

    @staticmethod
    def _children(logq: torch.Tensor, K: int, sampling: DraftSampling | None) -> tuple[torch.Tensor, torch.Tensor]:
        """K children per node: logq (B, n, Vd) -> their log q and draft ids (B, n, K).

        The top-K (deterministic); with ``sampling``, sampled rows draw K i.i.d. from q instead.
        """
        lp, ids = logq.topk(K, dim=-1)  # (B, n, K)
        if sampling is None:
            return lp, ids
        for b, (t, gen) in enumerate(zip(sampling.temperature.tolist(), sampling.generators)):
            if t > 0:
                draws = torch.multinomial(logq[b].exp(), K, replacement=True, generator=gen)  # (n, K)
                ids[b] = draws
                lp[b] = logq[b].gather(-1, draws)
        return lp, ids


__all__ = ["DEFAULT_DEPTH", "DEFAULT_NODES", "DEFAULT_TOPK", "Eagle", "EagleState", "default_eagle_accuracy"]
