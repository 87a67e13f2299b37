"""The decoding engine: plain and Medusa decoding of a batch, on any transformers decoder-only model.

Terms
-----
prefill
    one forward over the left-padded prompts; its last logits give each sequence's
    first token (emitted) and its last hidden state.
root
    the next token of a sequence, decided but not yet in the KV cache.
step
    one forward after the prefill. Medusa: the heads read the hidden state of the
    last accepted token and propose their top-I tokens; the tree (root + candidates,
    :class:`~distill.engine.tree.TreeBuffers`) is verified in one forward with a tree
    attention mask and per-depth position ids; the acceptance rule
    (:mod:`distill.engine.acceptance`) picks the accepted path; the root and the
    accepted nodes stay in the cache (:func:`distill.engine.cache.commit`), the next
    token becomes the new root, and the hidden state of the last accepted node feeds
    the heads next step. Plain decoding is the same step with the root alone (a tree
    of no nodes): the same mask, cache and acceptance code.
emitted tokens
    per step: the accepted candidates and the next token, ``L + 1`` tokens
    (``GenerationResult.accepted``); the prefill emits the first token.
hidden state
    the backbone's last hidden state after the final norm (what the LM head reads):
    the decoder's (``model.get_decoder()``) ``last_hidden_state``, equal to
    ``hidden_states[-1]`` of the model's output.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from distill.engine import cache as kv
from distill.engine.acceptance import (
    TYPICAL_DELTA,
    TYPICAL_EPSILON,
    Acceptance,
    greedy_accept,
    rejection_accept,
    typical_accept,
    warp,
)
from distill.engine.policy import DEFAULT_COST_RATIO, AdaptivePolicy, choose_tree_size, taus_for
from distill.engine.tree import ResolvedTree, TreeBuffers, build_buffers, resolve_tree, subtree
from distill.errors import ConfigError, ModelError
from distill.heads.model import MedusaHeads, read_distill_meta
from distill.runtime import canonical_dtype, stage_dtype, torch_dtype

ACCEPTANCE_MODES = ("greedy", "typical", "rejection")


@dataclass
class SamplingParams:
    """Per request."""

    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # per-request torch.Generator seed (None: a random one)
    stop_token_ids: tuple[int, ...] = ()  # the engine always also stops at the tokenizer's eos

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


@dataclass
class EngineConfig:
    """Engine settings (see README-engine.md)."""

    acceptance: str = "typical"  # what sampled (temperature > 0) requests use; temperature 0 always uses greedy
    typical_epsilon: float = TYPICAL_EPSILON
    typical_delta: float = TYPICAL_DELTA
    tree: str | None = None  # tree.json path, chain[-K], sparse-N, Cartesian "3,2,2,1"; None = heads' tree.json or sparse-24
    max_batch: int = 8  # largest batch generate() runs at once
    speculate_max_batch: int | None = None  # set: the full tree up to this batch size, plain above; None: the cost model decides
    dtype: str = "auto"  # auto: the heads' teacher dtype, else distill.runtime's rule
    device: str = "auto"  # auto: CUDA when available, else CPU
    step_cost_ratio: float | None = None  # r of the policy's cost model (None: DEFAULT_COST_RATIO of the device type)
    adaptive: bool = False  # correct the policy with measured acceptance and step times (policy.AdaptivePolicy)

    def __post_init__(self) -> None:
        if self.acceptance not in ACCEPTANCE_MODES:
            raise ConfigError(f"acceptance must be one of {', '.join(ACCEPTANCE_MODES)}; got '{self.acceptance}'")
        if not (0 < self.typical_epsilon < 1 and self.typical_delta > 0):
            raise ConfigError("typical acceptance needs 0 < epsilon < 1 and delta > 0")
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.speculate_max_batch is not None and self.speculate_max_batch < 0:
            raise ConfigError(f"speculate_max_batch must be >= 0, got {self.speculate_max_batch}")
        self.dtype = canonical_dtype(self.dtype)
        if self.step_cost_ratio is not None and self.step_cost_ratio < 0:
            raise ConfigError(f"step_cost_ratio must be >= 0, got {self.step_cost_ratio}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only (no prompt, no stop token)
    finish_reason: str  # "stop" (eos / stop token), "length", or "cancelled"
    steps: int  # decoding steps (forward passes after the prefill) this sequence took part in
    accepted: list[int]  # tokens emitted per step (acceleration rate = mean)


@dataclass
class StepStats:
    """Per generate() call."""

    steps: int = 0  # forward passes after the prefill(s)
    tokens: int = 0  # tokens emitted in all (all sequences)
    step_seconds: list[float] = field(default_factory=list)
    prefill_seconds: float = 0.0
    batch_size: int = 0  # largest batch run at once
    tree_nodes: int = 0  # largest tree used (0: plain decoding throughout)
    tree_nodes_per_step: list[int] = field(default_factory=list)


class _Seq:
    """One request's progress."""

    def __init__(self, index: int, params: SamplingParams, stop: set[int], device: torch.device):
        self.index = index
        self.params = params
        self.stop = stop | set(params.stop_token_ids)
        self.tokens: list[int] = []
        self.accepted: list[int] = []
        self.steps = 0
        self.finish: str | None = None
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))

    def emit(self, new: list[int], on_tokens: Callable[[int, list[int]], bool] | None) -> None:
        """Append ``new`` up to a stop token or max_tokens; tell the callback; set finish."""
        taken: list[int] = []
        for tok in new:
            if tok in self.stop:
                self.finish = "stop"
                break
            taken.append(tok)
            if len(self.tokens) + len(taken) >= self.params.max_tokens:
                self.finish = "length"
                break
        self.tokens.extend(taken)
        if taken and on_tokens is not None and on_tokens(self.index, taken) is False:
            self.finish = "cancelled"

    def result(self) -> GenerationResult:
        return GenerationResult(list(self.tokens), self.finish or "length", self.steps, list(self.accepted))


class Engine:
    """Plain and Medusa decoding (see the module docstring). One generate() at a time per instance."""

    def __init__(
        self,
        model,
        tokenizer,
        heads: MedusaHeads | None = None,
        config: EngineConfig | None = None,
        model_name: str = "",
        tree: ResolvedTree | None = None,
    ):
        self.config = config or EngineConfig()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.heads = heads.eval() if heads is not None else None
        self.model_name = model_name or getattr(model.config, "_name_or_path", "") or "model"
        self.device = next(model.parameters()).device
        self._decoder = model.get_decoder()  # its output's last_hidden_state is what the LM head reads
        self.dtype = next(model.parameters()).dtype
        self.stop_ids = self._eos_ids()
        self._plain = build_buffers([]).to(self.device)
        self._buffers: dict[int, TreeBuffers] = {}
        self.tree: ResolvedTree | None = None
        self._taus: dict[int, float] = {}
        self._proposal: dict[int, float] = {}
        if self.heads is not None:
            hc = self.heads.config
            hp = next(self.heads.parameters())
            if hp.dtype != self.dtype or hp.device != self.device:
                raise ModelError(f"heads are {hp.dtype} on {hp.device} but the model is {self.dtype} on {self.device}: "
                                 "load both with the same dtype and device")
            if hc.hidden_size != model.config.get_text_config().hidden_size:
                raise ModelError(f"heads hidden_size {hc.hidden_size} != model's {model.config.get_text_config().hidden_size}")
            if hc.vocab_size != model.get_output_embeddings().weight.shape[0]:
                raise ModelError(f"heads vocab_size {hc.vocab_size} != model's {model.get_output_embeddings().weight.shape[0]}")
            self.tree = tree or resolve_tree(self.config.tree, hc.num_heads)
            self._taus = taus_for(self.tree.paths, self.tree.accuracy)
            self._proposal = {n: self._proposal_cost(n) for n in self._taus}
        self.policy: AdaptivePolicy | None = None
        if self.heads is not None and self.config.adaptive and self.config.speculate_max_batch is None:
            self.policy = AdaptivePolicy(self._taus, self._cost_ratio(), self._proposal)
        window = getattr(model.config.get_text_config(), "sliding_window", None)
        self._max_len = min(
            getattr(model.config.get_text_config(), "max_position_embeddings", None) or 1 << 30,
            window if isinstance(window, int) and window > 0 else 1 << 30,
        )

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str | None, heads: str | Path | None, config: EngineConfig | None = None) -> "Engine":
        """model: None = the bundled default, a local folder or Hub id; heads: a heads folder or None (plain only)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from distill.models import resolve_model

        config = config or EngineConfig()
        resolved = resolve_model(model)
        teacher = read_distill_meta(Path(heads)).get("teacher_dtype") if heads is not None else None
        where = stage_dtype(resolved.path, config.device, config.dtype, teacher, what=f"the heads in {heads}")
        config = dataclasses.replace(config, device=where.device, dtype=where.dtype)
        device = torch.device(config.device)
        lm = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=config.torch_dtype).to(device).eval()
        tok = AutoTokenizer.from_pretrained(resolved.path)
        mh, tree = None, None
        if heads is not None:
            mh = MedusaHeads.load(Path(heads), device=device, dtype=config.torch_dtype)
            tree = resolve_tree(config.tree, mh.config.num_heads, heads_folder=Path(heads))
        return cls(lm, tok, mh, config, model_name=resolved.name, tree=tree)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.tokenizer, "eos_token_id", None), getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(x) for x in src)
        return ids

    # -- policy ------------------------------------------------------------------------------
    def _cost_ratio(self) -> float:
        ratio = self.config.step_cost_ratio
        if ratio is None:
            ratio = DEFAULT_COST_RATIO.get(self.device.type, DEFAULT_COST_RATIO["cuda"])
        return ratio

    def tree_size_for(self, batch: int) -> int:
        """Tree nodes the policy would use now for a batch of ``batch`` sequences (0 = plain decoding)."""
        if self.heads is None or self.tree is None:
            return 0
        if self.config.speculate_max_batch is not None:  # the user decides: the full tree up to that batch size
            return len(self.tree.paths) if batch <= self.config.speculate_max_batch else 0
        if self.policy is not None:
            return self.policy.best(batch)
        return choose_tree_size(batch, self._taus, self._cost_ratio(), None, self._proposal)

    def _proposal_cost(self, nodes: int) -> float:
        """h of the policy: weights the heads read for a tree of ``nodes`` nodes / weights a forward reads."""
        assert self.heads is not None and self.tree is not None
        depth = max(len(p) for p in subtree(self.tree.paths, self.tree.accuracy, nodes))
        unique = {id(p): p.numel() for p in self.model.parameters()}
        forward = sum(unique.values())
        emb_in, emb_out = self.model.get_input_embeddings().weight, self.model.get_output_embeddings().weight
        if emb_in is not emb_out:  # an untied input embedding is looked up, not read whole
            forward -= emb_in.numel()
        hc = self.heads.config
        block = hc.num_layers * (hc.hidden_size**2 + (hc.hidden_size if hc.bias else 0))
        lm = hc.vocab_size * hc.hidden_size
        heads = depth * block + (1 if hc.share_lm_head else depth) * lm
        return heads / forward

    def buffers(self, nodes: int) -> TreeBuffers:
        """Buffers of the tree's ``nodes`` most probable nodes (built once per size)."""
        if nodes <= 0:
            return self._plain
        if nodes not in self._buffers:
            assert self.tree is not None
            self._buffers[nodes] = build_buffers(subtree(self.tree.paths, self.tree.accuracy, nodes)).to(self.device)
        return self._buffers[nodes]

    # -- model calls -------------------------------------------------------------------------
    def _forward(self, ids, positions, allowed, cache, last_only: bool = False):
        """ids/positions (B, n), allowed (B, 1, n, S + n) -> logits (B, n', V) float32, hidden (B, n', H).

        The hidden state is the decoder's ``last_hidden_state`` (after the final norm), taken with a
        forward hook for the duration of the call, so no other layer's states are kept.
        """
        captured: dict[str, torch.Tensor] = {}

        def grab(module, args, output):
            captured["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

        handle = self._decoder.register_forward_hook(grab)
        try:
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                attention_mask=kv.attention_bias(allowed, self.dtype),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
            )
        finally:
            handle.remove()
        hidden = captured["hidden"]
        if last_only:
            hidden = hidden[:, -1:]
        return out.logits.float(), hidden

    def _propose(self, hidden: torch.Tensor, root: torch.Tensor, buf: TreeBuffers) -> torch.Tensor:
        """Heads' top-I tokens laid out as the tree: hidden (B, H), root (B,) -> tokens (B, T)."""
        assert self.heads is not None
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

    def _accept(self, tokens, logits, buf: TreeBuffers, seqs: list[_Seq]) -> Acceptance:
        """Greedy rows with greedy_accept, sampled rows with the configured rule; merged per row."""
        greedy_rows = [i for i, s in enumerate(seqs) if s.generator is None]
        if len(greedy_rows) == len(seqs):
            return greedy_accept(tokens, logits, buf)
        sampled_rows = [i for i, s in enumerate(seqs) if s.generator is not None]
        idx = torch.tensor(sampled_rows, device=tokens.device)
        temp = torch.tensor([seqs[i].params.temperature for i in sampled_rows], device=tokens.device)
        top_p = torch.tensor([seqs[i].params.top_p for i in sampled_rows], device=tokens.device)
        probs = warp(logits[idx], temp, top_p)
        gens = [seqs[i].generator for i in sampled_rows]
        mode = self.config.acceptance
        if mode == "greedy":
            sub = greedy_accept(tokens[idx], logits[idx], buf)
        elif mode == "typical":
            sub = typical_accept(tokens[idx], probs, buf, gens, self.config.typical_epsilon, self.config.typical_delta)
        else:
            sub = rejection_accept(tokens[idx], probs, buf, gens)
        if not greedy_rows:
            return sub
        full = greedy_accept(tokens, logits, buf)
        for name in ("length", "path", "next_token", "last"):
            getattr(full, name)[idx] = getattr(sub, name)
        return full

    # -- generation --------------------------------------------------------------------------
    def _check(self, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        if len(params) != len(prompts):
            raise ConfigError(f"{len(prompts)} prompts but {len(params)} sampling params")
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if not p:
                raise ConfigError(f"prompt {i} is empty")
            if len(p) + sp.max_tokens + 64 > self._max_len:
                raise ConfigError(f"prompt {i}: {len(p)} tokens + max_tokens {sp.max_tokens} exceed the model's {self._max_len}")

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams] | SamplingParams | None = None,
        speculative: bool = True,
        on_tokens: Callable[[int, list[int]], bool] | None = None,
    ) -> tuple[list[GenerationResult], StepStats]:
        """Decode ``prompts`` (token ids); batches of at most ``config.max_batch`` run at once.

        ``on_tokens(i, new_ids)`` is called whenever sequence i emits tokens; returning False
        cancels it. ``speculative=False`` (or no heads) is plain decoding with the same code.
        """
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        self._check(prompts, params)
        seqs = [_Seq(i, sp, self.stop_ids, self.device) for i, sp in enumerate(params)]
        stats = StepStats()
        B = self.config.max_batch
        speculative = speculative and self.heads is not None
        for lo in range(0, len(prompts), B):
            batch: _Batch | None = self._prefill(prompts[lo : lo + B], seqs[lo : lo + B], on_tokens, stats)
            while (batch := self._compact(batch)[0]) is not None:
                self._step(batch, speculative, on_tokens, stats)
        stats.tokens = sum(len(s.tokens) for s in seqs)
        return [s.result() for s in seqs], stats

    def running_batch(self, speculative: bool = True, on_tokens: Callable[[object, list[int]], bool] | None = None) -> "RunningBatch":
        """A batch that sequences join between steps (continuous batching; see :class:`RunningBatch`)."""
        return RunningBatch(self, speculative and self.heads is not None, on_tokens)

    def _prefill(self, prompts, seqs: list[_Seq], on_tokens, stats: StepStats) -> "_Batch":
        """One forward over the left-padded prompts; emits each sequence's first token."""
        dev = self.device
        t0 = time.perf_counter()
        cache = kv.new_cache()
        lengths = [len(p) for p in prompts]
        P = max(lengths)
        ids = torch.tensor([[0] * (P - len(p)) + list(p) for p in prompts], dtype=torch.long, device=dev)
        valid, positions, allowed = kv.prefill_layout(lengths, dev)
        logits, hidden = self._forward(ids, positions, allowed, cache, last_only=True)
        first = self._accept(torch.zeros(len(seqs), 1, dtype=torch.long, device=dev), logits, self._plain, seqs)
        root = first.next_token  # (B,)
        end = torch.full((len(seqs),), P, dtype=torch.long, device=dev)
        pos = torch.tensor(lengths, dtype=torch.long, device=dev)
        for s, tok in zip(seqs, root.tolist()):
            s.emit([tok], on_tokens)
        stats.prefill_seconds += time.perf_counter() - t0
        return _Batch(list(seqs), cache, valid, end, pos, root, hidden[:, -1])

    def _compact(self, batch: "_Batch | None") -> tuple["_Batch | None", list[_Seq]]:
        """Drop the finished rows -> (the rest or None when none is left, the finished sequences)."""
        if batch is None:
            return None, []
        keep = [i for i, s in enumerate(batch.seqs) if s.finish is None]
        done = [s for s in batch.seqs if s.finish is not None]
        if not keep:
            return None, done
        if len(keep) < len(batch.seqs):
            rows = torch.tensor(keep, dtype=torch.long, device=self.device)
            batch.valid, batch.end = kv.select(batch.cache, batch.valid, batch.end, rows)
            batch.pos, batch.root, batch.hidden = batch.pos[rows], batch.root[rows], batch.hidden[rows]
            batch.seqs = [batch.seqs[i] for i in keep]
        return batch, done

    def _step(self, batch: "_Batch", speculative: bool, on_tokens, stats: StepStats) -> None:
        """One decoding step of every row (all unfinished): propose, verify, accept, commit, emit."""
        active = batch.seqs
        stats.batch_size = max(stats.batch_size, len(active))
        t0 = time.perf_counter()
        if not speculative:
            nodes = 0
        elif self.policy is not None:
            nodes = self.policy.next_size(len(active))
        else:
            nodes = self.tree_size_for(len(active))
        buf = self.buffers(nodes)
        if buf.nodes:
            tokens = self._propose(batch.hidden, batch.root, buf)  # (B, T)
        else:
            tokens = batch.root[:, None]
        step_pos = batch.pos[:, None] + buf.depth[None]  # (B, T)
        allowed = kv.step_mask(batch.valid, buf.mask)
        logits, tree_hidden = self._forward(tokens, step_pos, allowed, batch.cache)
        acc = self._accept(tokens, logits, buf, active)
        M = int(acc.length.max()) + 1
        batch.valid, batch.end = kv.commit(batch.cache, batch.valid, batch.end, acc.path[:, :M], acc.length + 1)
        batch.pos = batch.pos + acc.length + 1
        rows = torch.arange(len(active), device=self.device)
        batch.hidden = tree_hidden[rows, acc.last]  # (B, H)
        batch.root = acc.next_token
        root = batch.root
        emitted = torch.cat([tokens.gather(1, acc.path[:, 1:M]), root[:, None]], dim=1).tolist() if M > 1 else root[:, None].tolist()
        lengths_acc = acc.length.tolist()
        stats.steps += 1
        stats.tree_nodes = max(stats.tree_nodes, buf.nodes)
        stats.tree_nodes_per_step.append(buf.nodes)
        for s, row, L in zip(active, emitted, lengths_acc):
            new = row[:L] + [row[-1]] if M > 1 else row
            s.steps += 1
            s.accepted.append(len(new))
            s.emit(new, on_tokens)
        seconds = time.perf_counter() - t0
        stats.step_seconds.append(seconds)
        if self.policy is not None and speculative:
            self.policy.observe(len(active), buf.nodes, seconds, lengths_acc)


@dataclass
class _Batch:
    """The rows decoding together: their sequences, KV cache and per-row state (see engine.cache)."""

    seqs: list[_Seq]
    cache: object  # DynamicCache
    valid: torch.Tensor  # (B, S) bool
    end: torch.Tensor  # (B,) next cache slot
    pos: torch.Tensor  # (B,) next position id
    root: torch.Tensor  # (B,) next token, not yet in the cache
    hidden: torch.Tensor  # (B, H) hidden state of the last committed token

    def join(self, other: "_Batch") -> "_Batch":
        """This batch's rows followed by ``other``'s in one cache (the shorter is padded with holes)."""
        self.valid, other.valid = kv.join(self.cache, self.valid, other.cache, other.valid)
        self.valid = torch.cat([self.valid, other.valid])
        self.end, self.pos = torch.cat([self.end, other.end]), torch.cat([self.pos, other.pos])
        self.root, self.hidden = torch.cat([self.root, other.root]), torch.cat([self.hidden, other.hidden])
        self.seqs = self.seqs + other.seqs
        return self


class RunningBatch:
    """Continuous batching: sequences join a running batch between steps and leave as they finish.

    ``add`` prefills the newcomers in one forward of their own and appends their rows
    (cache included) to the running batch; ``step`` runs one decoding step of every row.
    Both return the sequences that finished, as ``(key, GenerationResult)``. ``on_tokens``
    is called with a sequence's key. Greedy rows decode exactly as in batch-1 decoding
    whichever rows they share the batch with; sampled rows draw from their own seeded
    generators. ``stats`` collects the step figures until the caller swaps it out.
    """

    def __init__(self, engine: Engine, speculative: bool, on_tokens: Callable[[object, list[int]], bool] | None):
        self.engine = engine
        self.speculative = speculative
        self.on_tokens = on_tokens
        self.stats = StepStats()
        self._batch: _Batch | None = None

    def __len__(self) -> int:
        return len(self._batch.seqs) if self._batch is not None else 0

    def _finished(self, done: list[_Seq]) -> list[tuple[object, GenerationResult]]:
        self.stats.tokens += sum(len(s.tokens) for s in done)
        return [(s.index, s.result()) for s in done]

    @torch.inference_mode()
    def add(self, prompts: list[list[int]], params: list[SamplingParams], keys: list) -> list[tuple[object, GenerationResult]]:
        """Prefill ``prompts`` and let them join; -> those already finished (first token a stop, max_tokens 1)."""
        e = self.engine
        e._check(prompts, params)
        if len(keys) != len(prompts):
            raise ConfigError(f"{len(prompts)} prompts but {len(keys)} keys")
        seqs = [_Seq(k, sp, e.stop_ids, e.device) for k, sp in zip(keys, params)]
        new, done = e._compact(e._prefill(prompts, seqs, self.on_tokens, self.stats))
        if new is not None:
            self._batch = new if self._batch is None else self._batch.join(new)
        return self._finished(done)

    @torch.inference_mode()
    def step(self) -> list[tuple[object, GenerationResult]]:
        """One decoding step of every row; -> the sequences that finished in it."""
        if self._batch is None:
            return []
        self.engine._step(self._batch, self.speculative, self.on_tokens, self.stats)
        self._batch, done = self.engine._compact(self._batch)
        return self._finished(done)

    def clear(self) -> list:
        """Drop every row (after a failed step, or when stopping): -> their keys."""
        keys = [s.index for s in self._batch.seqs] if self._batch is not None else []
        self._batch = None
        return keys
