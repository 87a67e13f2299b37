"""A running batch: its rows' sequences, KV cache and draft state, its prefill, its one decoding step, its compaction.

A batch is handed the calls it needs (:class:`Decoding`: the target's forwards, the proposer, the
policy's pricing, the acceptance rules), never the engine.

One decoding step (:meth:`Batch.step`)
---------------------------------------
B rows; row b has committed ``end_b`` tokens (slots ``0 .. end_b - 1`` of its cache) and a root
``r_b``, its next token, decided but not yet in the cache.

1. size: N = the policy's tree size for B rows (0: plain decoding). The policy compares
   ``tau(N) / (c(B (N + 1)) + h(N))`` with ``1 / c(B)``: tokens per step over the step's cost, a
   forward over ``B (N + 1)`` tokens plus the proposal (:mod:`distill.engine.policy`).
2. propose: the proposer turns its draft state into tokens ``x`` (B, T = N + 1), ``x_0 = r_b``, and
   a tree (:class:`~distill.engine.tree.TreeBuffers`): ancestor-or-self mask ``M`` (T, T), depth ``d``.
3. verify: ``x_t`` goes to slot ``end_b + t`` at position ``end_b + d_t``; query t sees the committed
   slots and the slots ``end_b + j`` with ``M[t, j]``; one forward gives logits ``z`` (B, T, V).
4. accept (:mod:`distill.engine.acceptance`): node t's children are judged by ``p_t = softmax(z_t)``
   (after the row's sampling rules, :mod:`distill.engine.logits`):
   greedy, a child is accepted when it is ``argmax z_t``;
   typical, when ``p_t(x) > min(eps, delta exp(-H(p_t)))``;
   rejection, with probability ``min(1, p_t(x) / q_t(x))`` for the draft distribution ``q``, else the
   next token is drawn from ``norm(max(p_t - q_t, 0))``: the output is distributed as plain sampling.
   The longest accepted path has L candidates; the next token ``y`` is drawn at its last node.
5. commit: the accepted nodes' keys and values move from slots ``end_b + path_k`` to ``end_b + k``;
   the row emits ``L + 1`` tokens, ``end_b += L + 1``, ``r_b = y``; the proposer reads the accepted
   path's features (its draft state follows); the policy observes the step's time and acceptance.

Plain decoding is the same step with N = 0: the same bias, cache and acceptance code, nothing to
compact. One host transfer per step brings the emitted tokens and lengths back; ``end`` lives on
the host and goes back with the next step's inputs.

Joining rows (continuous batching). Sequences that join a running batch are prefilled inside its
next step's forward where that step runs on the direct loop (a plain step or chains:
:meth:`~distill.engine.target.Target.mixed_step`): their prompts' tokens packed after the running
rows', in new cache rows, so the running rows do not wait for a prefill forward of their own and
the weights are read once for both (what vLLM's chunked prefill does). They emit their first
token in that step and decode from the next. Elsewhere (a branching tree's step, prompt logprobs)
they are prefilled in a forward of their own first and join after the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch.profiler import record_function

from distill.engine import cache as kv
from distill.engine.acceptance import Acceptance, greedy_accept, rejection_accept, typical_accept
from distill.engine.config import EngineConfig
from distill.engine.logits import TokenLogprob, changes_logits, process, token_logprobs
from distill.engine.policy import Pricing
from distill.engine.proposers.base import DraftSampling, Proposal, Proposer
from distill.engine.requests import GenerationResult, SamplingParams, Sequence, StepStats
from distill.engine.target import Target
from distill.engine.tree import TreeBuffers, build_buffers
from distill.errors import ConfigError
from distill.sampling import warp

#: Slot capacities are rounded up to a multiple of this (fewer distinct shapes, some room for joins).
SLOT_ROUND = 64


@dataclass
class Joining:
    """Sequences that join a running batch in its next step (module docstring, "joining rows"): their prompts and
    sequences."""

    prompts: list[list[int]]
    seqs: list[Sequence]


def _slots(d: "Decoding", lengths: list[int], seqs: list[Sequence]) -> int:
    """Cache slots for rows of these prompt lengths and sequences: their longest prompt and answer and a full tree."""
    return -(-(max(n + s.params.max_tokens for n, s in zip(lengths, seqs)) + d.max_tree_size) // SLOT_ROUND) * SLOT_ROUND


def _first_tokens(d: "Decoding", seqs: list[Sequence], logits: torch.Tensor, on_tokens) -> torch.Tensor:
    """The prompts' last tokens' logits (B, 1, V) -> each sequence's first token (B,), emitted."""
    zeros = torch.zeros(len(seqs), 1, dtype=torch.long, device=logits.device)
    first = d.accept(zeros, logits, d.plain, seqs)
    lps = d.logprobs(logits, zeros, first, seqs)
    for b, (s, tok) in enumerate(zip(seqs, first.next_token.tolist())):
        s.emit([tok], on_tokens, lps.get(b))
    return first.next_token


@dataclass
class Decoding:
    """What a batch decodes with: the target, the proposer and its pricing (None: plain decoding only), the
    acceptance settings, the stop ids, the largest step's size and the context limit."""

    target: Target
    proposer: Proposer | None
    pricing: Pricing | None
    config: EngineConfig
    stop_ids: set[int]
    max_len: int

    def __post_init__(self) -> None:
        self.plain = build_buffers([]).to(self.target.device)  # plain decoding: the root alone

    @property
    def max_tree_size(self) -> int:
        """T of the largest step: the root and the full tree's nodes (1 without a proposer)."""
        return 1 + (self.proposer.max_nodes if self.proposer is not None else 0)

    def check(self, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        if len(params) != len(prompts):
            raise ConfigError(f"{len(prompts)} prompts but {len(params)} sampling params")
        vocab = self.target.vocab_size
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if not p:
                raise ConfigError(f"prompt {i} is empty")
            if sp.logit_bias and not all(0 <= t < vocab for t in sp.logit_bias):
                raise ConfigError(f"prompt {i}: logit_bias names a token id outside 0..{vocab - 1}")
            if len(p) + sp.max_tokens > self.max_len:
                raise ConfigError(f"prompt {i}: {len(p)} tokens + max_tokens {sp.max_tokens} exceed the engine's limit of {self.max_len}")

    def accept(self, tokens, logits, buf: TreeBuffers, seqs: list[Sequence], draft: torch.Tensor | None = None) -> Acceptance:
        """Greedy rows with greedy_accept, sampled rows with the configured rule; merged per row.

        Rows whose options change the logits (penalties, bias, min_tokens) are judged on their
        processed logits (:func:`distill.engine.logits.process`); ``logits`` itself is left raw.
        ``draft`` (B, T, V): the proposer drew each node's children from these (rejection mode).
        """
        logits = process(logits, tokens, buf, {b: s.context() for b, s in enumerate(seqs) if changes_logits(s.params)})
        greedy_rows = [i for i, s in enumerate(seqs) if s.generator is None]
        argmax = self.target.argmax
        if len(greedy_rows) == len(seqs):
            return greedy_accept(tokens, logits, buf, argmax)
        sampled_rows = [i for i, s in enumerate(seqs) if s.generator is not None]
        idx = torch.tensor(sampled_rows, device=tokens.device)
        sp = [seqs[i].params for i in sampled_rows]
        temp = torch.tensor([p.temperature for p in sp], device=tokens.device)
        top_p = torch.tensor([p.top_p for p in sp], device=tokens.device)
        top_k = torch.tensor([p.top_k for p in sp], device=tokens.device)
        min_p = torch.tensor([p.min_p for p in sp], device=tokens.device)
        probs = warp(logits[idx], temp, top_p, top_k, min_p)
        gens = [seqs[i].generator for i in sampled_rows]
        mode = self.config.acceptance
        part = buf.take(idx)
        if mode == "greedy":
            sub = greedy_accept(tokens[idx], logits[idx], part, argmax)
        elif mode == "typical":
            sub = typical_accept(tokens[idx], probs, part, gens, self.config.typical_epsilon, self.config.typical_delta)
        else:
            sub = rejection_accept(tokens[idx], probs, part, gens, draft[idx] if draft is not None else None)
        if not greedy_rows:
            return sub
        full = greedy_accept(tokens, logits, buf, argmax)
        for name in ("length", "path", "next_token", "last"):
            getattr(full, name)[idx] = getattr(sub, name)
        return full

    @staticmethod
    def logprobs(logits, tokens, acc: Acceptance, seqs: list[Sequence]) -> dict[int, list[TokenLogprob]]:
        """Raw logprobs of each row's emitted tokens (rows that ask for them): the accepted candidates, drawn
        at the path's nodes 0..L-1, and the next token, drawn at node L. -> batch row -> L + 1 entries."""
        rows = [b for b, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return {}
        idx = torch.tensor(rows, device=tokens.device)
        path = acc.path[idx]  # (R, D + 1)
        emitted = torch.cat([tokens[idx].gather(1, path[:, 1:]), torch.zeros_like(path[:, :1])], dim=1)  # (R, D + 1)
        emitted.scatter_(1, acc.length[idx][:, None], acc.next_token[idx][:, None])  # column L: the next token
        top = max(seqs[b].params.logprobs for b in rows)
        chosen, ids, vals = token_logprobs(logits, idx, path, emitted, top)
        lengths, toks = acc.length[idx].tolist(), emitted.tolist()
        out = {}
        for r, b in enumerate(rows):
            n = seqs[b].params.logprobs
            out[b] = [TokenLogprob(toks[r][k], chosen[r][k], tuple(zip(ids[r][k][:n], vals[r][k][:n])))
                      for k in range(lengths[r] + 1)]
        return out


class Batch:
    """The rows decoding together: their sequences, KV cache and per-row state (see engine.cache).

    Row b's state: ``ends[b]`` its committed length (host), ``root[b]`` its next token (device),
    and, when the batch speculates, its row of the proposer's draft state ``draft``
    (:mod:`distill.engine.proposers.base`; None for plain decoding throughout).
    """

    def __init__(self, decoding: Decoding, seqs: list[Sequence], cache: kv.SlotCache, ends: list[int], root: torch.Tensor,
                 draft):
        self.decoding = decoding
        self.seqs = seqs
        self.cache = cache
        self.ends = ends
        self.root = root  # (B,)
        self.draft = draft  # the proposer's DraftState, or None

    def __len__(self) -> int:
        return len(self.seqs)

    @classmethod
    def prefill(cls, decoding: Decoding, prompts: list[list[int]], seqs: list[Sequence], on_tokens, stats: StepStats,
                speculative: bool) -> "Batch":
        """One forward over the right-padded prompts (as rows, longest first) into a fresh cache; emits each sequence's
        first token.

        ``speculative``: the proposer's prefill hook runs (its draft state follows the batch).
        """
        with record_function("distill.prefill"):
            return cls._prefill(decoding, prompts, seqs, on_tokens, stats, speculative and decoding.proposer is not None)

    @classmethod
    def _prefill(cls, d: Decoding, prompts: list[list[int]], seqs: list[Sequence], on_tokens, stats: StepStats,
                 speculative: bool) -> "Batch":
        target, dev = d.target, d.target.device
        t0 = time.perf_counter()
        # longest first: rows of similar lengths sit together, so the attention's row chunks stay few (attention.py)
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        prompts, seqs = [prompts[i] for i in order], [seqs[i] for i in order]
        lengths = [len(p) for p in prompts]
        P = max(lengths)
        slots = _slots(d, lengths, seqs)
        cache = target.new_cache(len(prompts), slots)
        ids = torch.tensor([list(p) + [0] * (P - len(p)) for p in prompts], dtype=torch.long, device=dev)  # (B, P)
        positions = torch.arange(P, device=dev)[None].expand(len(prompts), P)  # (B, P)
        cache.prepare(positions, P, from_start=True)
        echo = [b for b, s in enumerate(seqs) if s.params.prompt_logprobs is not None]
        bias = kv.attention_bias(kv.prefill_allowed(P, dev), target.dtype)  # (1, 1, P, P)
        layers = d.proposer.feature_layers if speculative else None
        # logits of every position for prompt logprobs (B, P, V), else of each row's last (B, V); features (B, P, F)
        logits, features = target.prefill(ids, positions, bias, cache, layers, lengths, every=bool(echo))
        rows = torch.arange(len(prompts), device=dev)
        for b in echo:  # position t's distribution drew prompt token t + 1
            n, top = lengths[b], seqs[b].params.prompt_logprobs
            where = torch.arange(n - 1, device=dev)[None]
            chosen, tids, vals = token_logprobs(logits, rows[b : b + 1], where, ids[b : b + 1, 1:n], top)
            seqs[b].prompt_logprobs = [None] + [TokenLogprob(t, c, tuple(zip(i, v)))
                                                for t, c, i, v in zip(prompts[b][1:], chosen[0], tids[0], vals[0])]
        first_logits = (logits[rows, torch.tensor(lengths, device=dev) - 1] if echo else logits)[:, None]  # (B, 1, V)
        root = _first_tokens(d, seqs, first_logits, on_tokens)  # (B,)
        draft = (d.proposer.start(features, ids, lengths, root, slots, greedy=[s.generator is None for s in seqs])
                 if speculative else None)
        stats.prefill_seconds += time.perf_counter() - t0
        stats.prefill_tokens.append(sum(lengths) + len(lengths))
        stats.kv_bytes = max(stats.kv_bytes, cache.nbytes)
        return cls(d, list(seqs), cache, lengths, root, draft)

    def compact(self) -> list[Sequence]:
        """Drop the finished rows: the last running rows take their places (the rows before them stay where they
        are, so only as many rows' caches move as rows finished); -> the finished sequences."""
        done = [s for s in self.seqs if s.finish is not None]
        if done:
            n = len(self.seqs) - len(done)
            keep = list(range(n))
            tail = (i for i in range(n, len(self.seqs)) if self.seqs[i].finish is None)
            for j in range(n):
                if self.seqs[j].finish is not None:
                    keep[j] = next(tail)
            used = max((self.ends[i] for i in keep), default=0)
            self.cache.keep_rows(keep, used)
            if self.draft is not None:
                self.draft.keep(keep, used)
            self.root = self.root[torch.tensor(keep, dtype=torch.long, device=self.root.device)]
            self.ends = [self.ends[i] for i in keep]
            self.seqs = [self.seqs[i] for i in keep]
        return done

    def join(self, other: "Batch") -> None:
        """Append ``other``'s rows (their cache and draft state included) after this batch's."""
        self.cache.append(other.cache, max(other.ends))
        if self.draft is not None:
            self.draft.join(other.draft, max(other.ends))
        self.ends = self.ends + other.ends
        self.root = torch.cat([self.root, other.root])
        self.seqs = self.seqs + other.seqs

    def _sampling(self) -> DraftSampling | None:
        """In rejection mode with sampled rows: their temperatures and generators, so the proposer may draw its drafts."""
        cfg = self.decoding.config
        if cfg.acceptance != "rejection" or not cfg.sample_drafts or all(s.generator is None for s in self.seqs):
            return None
        temps = [s.params.temperature if s.generator is not None else 0.0 for s in self.seqs]
        return DraftSampling(torch.tensor(temps, device=self.root.device), [s.generator for s in self.seqs])

    def step(self, on_tokens, stats: StepStats, joining: Joining | None = None) -> None:
        """One decoding step of every row (all unfinished): size, propose, verify, accept, commit (module docstring);
        ``joining``: sequences that join in it (module docstring, "joining rows")."""
        d = self.decoding
        target, active, B = d.target, self.seqs, len(self.seqs)
        speculative = self.draft is not None
        stats.batch_size = max(stats.batch_size, B)
        t0 = time.perf_counter()
        nodes = d.pricing.next_size(B) if speculative else 0  # 1. size
        end = torch.tensor(self.ends, dtype=torch.long, device=target.device)  # (B,)
        with record_function("distill.propose"):  # 2. propose
            if nodes:
                proposal = d.proposer.propose(self.draft, self.root, end, max(self.ends), nodes, self._sampling())
            else:
                proposal = Proposal(self.root[:, None], d.plain)  # (B, 1)
        tokens, buf = proposal.tokens, proposal.buffers
        T = buf.size
        chain = buf.nodes > 0 and buf.is_chain
        used = [1 + n for n in proposal.chain_nodes] if proposal.chain_nodes is not None else None
        mixed = (joining is not None and target.mixes(T, chain)
                 and all(s.params.prompt_logprobs is None for s in joining.seqs))
        newcomers = None
        if joining is not None and not mixed:  # a prefill forward of their own; they join after the step
            before = time.perf_counter()
            newcomers = Batch.prefill(d, joining.prompts, joining.seqs, on_tokens, stats, speculative)
            t0 += time.perf_counter() - before  # the step's time without it
        with record_function("distill.mask"):  # 3. verify: slots, positions, the tree bias
            offsets = torch.arange(T, device=target.device)
            write = end[:, None] + offsets[None]  # (B, T): tree position t of row b goes to slot end_b + t
            window = target.window(self.cache, max(self.ends) + T)

            def bias():  # (B, 1, T, W), for a forward that reads it
                return kv.attention_bias(kv.step_allowed(end, buf.mask, window), target.dtype)
        with record_function("distill.forward"):
            layers = d.proposer.feature_layers if speculative else None
            if mixed:
                lengths = [len(p) for p in joining.prompts]
                self.cache.add_rows(len(lengths), _slots(d, lengths, joining.seqs))
                logits, features, first_logits, prompt_features = target.mixed_step(
                    tokens, end[:, None] + buf.depth, self.cache, layers, self.ends, used, joining.prompts)
            else:  # the kernel computes chains, not trees
                logits, features = target.step(tokens, end[:, None] + buf.depth, write, bias, self.cache, layers,
                                               self.ends, chain and not target.paged_problem, used)
        with record_function("distill.accept"):  # 4. accept
            acc = d.accept(tokens, logits, buf, active, proposal.draft)
        with record_function("distill.compact"):  # 5. commit: accepted nodes follow the root, tree slot end + path_k -> end + k
            if buf.nodes and not chain:  # a chain's accepted nodes are already there
                self.cache.move(end[:, None] + acc.path, end[:, None] + offsets[None, : acc.path.shape[1]])
            self.root = acc.next_token
        with record_function("distill.host"):  # the one transfer of the step: accepted candidates, next token, length
            host = torch.cat([tokens.gather(1, acc.path[:, 1:]), self.root[:, None], acc.length[:, None]], dim=1).tolist()
        lengths_acc = [row[-1] for row in host]
        lps = d.logprobs(logits, tokens, acc, active)
        if speculative:
            with record_function("distill.commit"):
                d.proposer.commit(self.draft, proposal, features, acc, self.ends, lengths_acc)
        stats.steps += 1
        stats.tree_nodes = max(stats.tree_nodes, buf.nodes)
        stats.tree_nodes_per_step.append(buf.nodes)
        stats.accepted_per_step.append(list(lengths_acc))
        stats.drafted_per_step.append(list(proposal.chain_nodes) if proposal.chain_nodes is not None else [buf.nodes] * B)
        for b, (s, row) in enumerate(zip(active, host)):
            L = row[-1]
            new = row[:L] + [row[-2]]
            self.ends[b] += L + 1
            s.steps += 1
            s.accepted.append(len(new))
            s.emit(new, on_tokens, lps.get(b))
        joined = 0
        if mixed:
            with record_function("distill.join"):
                self._join_prefilled(joining, first_logits, prompt_features, on_tokens)
            joined = sum(lengths) + len(lengths)
        seconds = time.perf_counter() - t0
        stats.step_seconds.append(seconds)
        stats.joined_per_step.append(joined)
        stats.kv_bytes = max(stats.kv_bytes, self.cache.nbytes)
        if speculative and not mixed:  # the policy prices steps, not prefills
            d.pricing.observe(B, nodes, seconds, lengths_acc, sum(used) if used is not None else B * T)
        if newcomers is not None:
            self.join(newcomers)

    def _join_prefilled(self, joining: Joining, logits: torch.Tensor, features: torch.Tensor, on_tokens) -> None:
        """The joining sequences, prefilled in this step's forward into the cache rows after the running ones: their
        last tokens' logits (J, V) and features (J, P, F) -> their first tokens, emitted; their rows join the batch."""
        d, seqs, prompts = self.decoding, joining.seqs, joining.prompts
        lengths = [len(p) for p in prompts]
        root = _first_tokens(d, seqs, logits[:, None], on_tokens)
        if self.draft is not None:
            P = max(lengths)
            ids = torch.tensor([list(p) + [0] * (P - len(p)) for p in prompts], dtype=torch.long, device=root.device)
            self.draft.join(d.proposer.start(features, ids, lengths, root, self.cache.slots,
                                             greedy=[s.generator is None for s in seqs]), P)
        self.ends = self.ends + lengths
        self.root = torch.cat([self.root, root])
        self.seqs = self.seqs + seqs


class RunningBatch:
    """Continuous batching: sequences join a running batch between steps and leave as they finish.

    ``add`` prefills the newcomers in one forward of their own and appends their rows
    (cache included) to the running batch; ``step`` runs one decoding step of every row, and
    prefills the sequences it is given inside that step's forward where it can (:class:`Batch`,
    "joining rows"; else in one of their own), which then join. Both return the sequences that
    finished, as ``(key, GenerationResult)``. ``on_tokens``
    is called with a sequence's key. Greedy rows decode exactly as in batch-1 decoding
    whichever rows they share the batch with; sampled rows draw from their own seeded
    generators. ``stats`` collects the step figures until the caller swaps it out.
    """

    def __init__(self, decoding: "Decoding", speculative: bool, on_tokens: Callable[[object, list[int]], bool] | None):
        self.decoding = decoding
        self.speculative = speculative
        self.on_tokens = on_tokens
        self.stats = StepStats()
        self._batch: Batch | None = None

    def __len__(self) -> int:
        return len(self._batch) if self._batch is not None else 0

    def _finished(self, done: list[Sequence]) -> list[tuple[object, GenerationResult]]:
        self.stats.tokens += sum(len(s.tokens) for s in done)
        if self._batch is not None and not len(self._batch):
            self._batch = None
        return [(s.index, s.result()) for s in done]

    @torch.inference_mode()
    def add(self, prompts: list[list[int]], params: list[SamplingParams], keys: list) -> list[tuple[object, GenerationResult]]:
        """Prefill ``prompts`` and let them join; -> those already finished (first token a stop, max_tokens 1)."""
        seqs = self._sequences(prompts, params, keys)
        new = Batch.prefill(self.decoding, prompts, seqs, self.on_tokens, self.stats, self.speculative)
        done = new.compact()
        if len(new):
            if self._batch is None:
                self._batch = new
            else:
                self._batch.join(new)
                self.stats.kv_bytes = max(self.stats.kv_bytes, self._batch.cache.nbytes)
        return self._finished(done)

    def _sequences(self, prompts: list[list[int]], params: list[SamplingParams], keys: list) -> list[Sequence]:
        d = self.decoding
        d.check(prompts, params)
        if len(keys) != len(prompts):
            raise ConfigError(f"{len(prompts)} prompts but {len(keys)} keys")
        return [Sequence(k, sp, d.stop_ids, d.target.device, p) for k, sp, p in zip(keys, params, prompts)]

    @torch.inference_mode()
    def step(self, prompts: list[list[int]] = (), params: list[SamplingParams] = (), keys: list = ()
             ) -> list[tuple[object, GenerationResult]]:
        """One decoding step of every row, which ``prompts`` join (class docstring; with no rows running, their
        prefill alone); -> the sequences that finished in it."""
        if prompts and self._batch is None:
            return self.add(prompts, params, keys)
        if self._batch is None:
            return []
        joining = Joining(list(prompts), self._sequences(prompts, params, keys)) if prompts else None
        self._batch.step(self.on_tokens, self.stats, joining)
        return self._finished(self._batch.compact())

    @property
    def kv_slots(self) -> tuple[int, int]:
        """(KV slots the running rows hold, slots allocated): what vLLM's ``kv_cache_usage_perc`` divides."""
        if self._batch is None:
            return 0, 0
        cache = self._batch.cache
        return sum(self._batch.ends), cache.capacity_rows * cache.slots

    def clear(self) -> list:
        """Drop every row (after a failed step, or when stopping): -> their keys."""
        keys = [s.index for s in self._batch.seqs] if self._batch is not None else []
        self._batch = None
        return keys


__all__ = ["SLOT_ROUND", "Batch", "Decoding", "RunningBatch"]
