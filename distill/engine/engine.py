"""The decoding engine: plain and speculative (Medusa or EAGLE) decoding of a batch, on any transformers decoder-only model.

Terms
-----
prefill
    one forward over the right-padded prompts into a fresh :class:`~distill.engine.cache.SlotCache`;
    each row's logits at its last prompt token give its first token (emitted) and its hidden state.
root
    the next token of a sequence, decided but not yet in the KV cache.
step
    one forward after the prefill. The proposer (:mod:`distill.engine.proposers.base`: Medusa heads
    or an EAGLE drafter) turns its draft state into tree tokens (root + candidates, one
    :class:`~distill.engine.tree.TreeBuffers` tree for all rows or one per row); the tree is
    written at each row's next slots and verified in one forward with a tree attention bias
    and per-depth position ids; the acceptance rule (:mod:`distill.engine.acceptance`) picks
    the accepted path; the accepted nodes are compacted behind the root in the cache
    (:meth:`SlotCache.move`), the next token becomes the new root, and the proposer's commit
    hook reads the features of the accepted path. Plain decoding is the same step with the
    root alone (a tree of no nodes): the same bias, cache and acceptance code, and nothing to
    compact.
emitted tokens
    per step: the accepted candidates and the next token, ``L + 1`` tokens
    (``GenerationResult.accepted``); the prefill emits the first token.
hidden state
    the backbone's last hidden state after the final norm (what the LM head reads):
    the decoder's (``model.get_decoder()``) ``last_hidden_state``, equal to
    ``hidden_states[-1]`` of the model's output. Medusa's feature.
features
    what the proposer reads from each forward (``Proposer.feature_layers``): the hidden
    state, or the hidden states entering the listed decoder layers (EAGLE-3's aux layers,
    ``hidden_states[i]``), taken with forward hooks for the duration of the call.
CUDA graphs
    on a GPU the step's forward is replayed from a graph recorded per (rows in use, tree
    size) and attends over all of the cache's slots (:mod:`distill.engine.graphs`;
    ``EngineConfig.cuda_graphs``); an EAGLE proposer's drafter passes are graphed the same way.
host state
    per step, one transfer from the device brings the emitted tokens and accepted lengths
    to the host; each row's committed length (``end``) lives there and is sent back with
    the next step's inputs. Nothing else in a step waits for the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import record_function

from distill.engine import cache as kv
from distill.engine.attention import use_gqa_sdpa
from distill.engine.logits import RowContext, TokenLogprob, changes_logits, process, token_logprobs
from distill.engine.acceptance import (
    Acceptance,
    greedy_accept,
    rejection_accept,
    typical_accept,
)
from distill.engine.config import EngineConfig, resolve_placement
from distill.engine.graphs import Graphs, cache_key
from distill.engine.norms import prepare_norms
from distill.engine.costs import forward_setup, step_costs
from distill.engine.policy import DEFAULT_COST_RATIO, AdaptivePolicy, StepCosts, choose_tree_size
from distill.engine.proposers.base import DraftSampling, Proposal, Proposer
from distill.engine.proposers.datastore import Datastore
from distill.engine.proposers.eagle import DEFAULT_DEPTH, DEFAULT_NODES, DEFAULT_TOPK, Eagle
from distill.engine.proposers.lookup import LOOKUP, Lookup
from distill.engine.proposers.medusa import Medusa
from distill.engine.proposers.union import Union
from distill.engine.rotary import prepare_rotary, rotary_kernel
from distill.engine.tree import ResolvedTree, TreeBuffers, build_buffers, resolve_tree
from distill.engine.weights import prepare_linears, rowwise_modules, valid_rows
from distill.errors import ConfigError, ModelError
from distill.heads.eagle import EagleDrafter, is_eagle3_folder
from distill.heads.model import MedusaHeads
from distill.heads.tree import load_tree
from distill.models import context_limit, distill_home
from distill.sampling import warp

#: The largest token id, count (top_k, max_tokens, logprobs) SamplingParams takes: int32's, far beyond any vocabulary.
MAX_TOKEN_ID = 2**31 - 1


@dataclass
class SamplingParams:
    """Per request. The fields and their meanings are vLLM's (:mod:`distill.engine.logits` for the order they
    apply in); every one of them keeps speculative decoding lossless."""

    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # per-request torch.Generator seed (None: a random one)
    stop_token_ids: tuple[int, ...] = ()  # the engine always also stops at the tokenizer's eos (unless ignore_eos)
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages every token of the prompt and the output so far
    frequency_penalty: float = 0.0  # minus this times the token's count in the output so far
    presence_penalty: float = 0.0  # minus this once the token is in the output
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to +-100)
    min_tokens: int = 0  # stop tokens are held back until this many tokens are out
    ignore_eos: bool = False  # eos does not stop (stop_token_ids still do)
    logprobs: int | None = None  # each emitted token's raw logprob and this many top alternatives (0: the token's only)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (GenerationResult.prompt_logprobs)

    def __post_init__(self) -> None:
        """Every field's type and range (each error names its field): nothing that reaches the engine can
        overflow its tensors or turn its logits into NaN."""
        _integer("max_tokens", self.max_tokens, 1, MAX_TOKEN_ID)
        _number("temperature", self.temperature, 0.0, math.inf)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _integer("top_k", self.top_k, -1, MAX_TOKEN_ID, f"-1 or 0 (all tokens) or a count up to {MAX_TOKEN_ID}")
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _integer("min_tokens", self.min_tokens, 0, self.max_tokens, f"in [0, max_tokens={self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _integer(name, getattr(self, name), 0, MAX_TOKEN_ID)
        try:
            self.stop_token_ids = tuple(self.stop_token_ids)
        except TypeError:
            raise ConfigError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r:.80}") from None
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t, 0, MAX_TOKEN_ID, f"token ids in [0, {MAX_TOKEN_ID}]")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (AttributeError, TypeError, ValueError):
                raise ConfigError(f"logit_bias maps token ids to numbers, got {self.logit_bias!r:.80}") from None
            for k, v in self.logit_bias.items():
                _integer("logit_bias", k, 0, MAX_TOKEN_ID, f"keyed by token ids in [0, {MAX_TOKEN_ID}]")
                if not math.isfinite(v):
                    raise ConfigError(f"logit_bias values must be finite numbers, got {v!r} for token {k}")


def _integer(name: str, value, low: int, high: int, what: str | None = None) -> None:
    """Raises ConfigError naming ``name`` unless ``value`` is an integer (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise ConfigError(f"{name} must be {what or f'an integer in [{low}, {high}]'}, got {value!r:.80}")


def _number(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    """Raises ConfigError naming ``name`` unless ``value`` is a finite number (not a bool) in [low, high]
    (``(low, high]`` with ``low_open``)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or not low <= value <= high or (low_open and value == low)):
        if math.isinf(high):
            bounds = f"a finite number {'>' if low_open else '>='} {low:g}"
        else:
            bounds = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise ConfigError(f"{name} must be {bounds}, got {value!r:.80}")


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only (no prompt, no stop token)
    finish_reason: str  # "stop" (eos / stop token), "length", or "cancelled"
    steps: int  # decoding steps (forward passes after the prefill) this sequence took part in
    accepted: list[int]  # tokens emitted per step (acceleration rate = mean)
    logprobs: list[TokenLogprob] | None = None  # per token of token_ids (SamplingParams.logprobs set)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, None for the first (prompt_logprobs set)


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
    accepted_per_step: list[list[int]] = field(default_factory=list)  # per step, each row's accepted speculated nodes
    kv_bytes: int = 0  # largest KV cache (slot cache storage) held at once


class _Seq:
    """One request's progress."""

    def __init__(self, index: int, params: SamplingParams, stop: set[int], device: torch.device, prompt: list[int]):
        self.index = index
        self.params = params
        self.prompt = prompt
        self.stop = (set() if params.ignore_eos else stop) | set(params.stop_token_ids)
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.accepted: list[int] = []
        self.steps = 0
        self.finish: str | None = None
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))

    def emit(self, new: list[int], on_tokens: Callable[..., bool] | None, logprobs: list[TokenLogprob] | None = None) -> None:
        """Append ``new`` up to a stop token or max_tokens; tell the callback; set finish.

        ``logprobs``: one per token of ``new`` (when the params ask for them); the callback gets
        those of the tokens taken as ``logprobs=``, and with the first tokens the prompt's as
        ``prompt_logprobs=`` (when asked for).
        """
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
        extra = {}
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.extend(logprobs[: len(taken)])
            extra["logprobs"] = logprobs[: len(taken)]
        if self.prompt_logprobs is not None and len(self.tokens) == len(taken):  # the first tokens: the prompt's too
            extra["prompt_logprobs"] = self.prompt_logprobs
        if taken and on_tokens is not None and on_tokens(self.index, taken, **extra) is False:
            self.finish = "cancelled"

    def context(self) -> RowContext:
        return RowContext(self.params, self.prompt, self.tokens, self.stop)

    def result(self) -> GenerationResult:
        return GenerationResult(list(self.tokens), self.finish or "length", self.steps, list(self.accepted),
                                self.logprobs, self.prompt_logprobs)


class Engine:
    """Plain, Medusa and EAGLE decoding (see the module docstring). One generate() at a time per instance.

    ``heads``: Medusa heads (:class:`MedusaHeads`), an EAGLE-3 drafter (:class:`EagleDrafter`), or
    the lookup proposer (:class:`~distill.engine.proposers.lookup.Lookup`: n-gram matches in the context). The engine prepares the model (and heads) it is given, in place, values unchanged: weights
    re-laid out per ``EngineConfig.weight_layout`` (:mod:`distill.engine.weights`), RMS normalisations and the
    rotary embedding on one kernel each (:mod:`distill.engine.norms`, :mod:`distill.engine.rotary`; same switch; a
    compiled forward traces the modules' own code) and ``sdpa`` attention switched to ``distill_sdpa`` (:mod:`distill.engine.attention`).
    """

    def __init__(
        self,
        model,
        tokenizer,
        heads: MedusaHeads | EagleDrafter | Lookup | None = None,
        config: EngineConfig | None = None,
        model_name: str = "",
        tree: ResolvedTree | None = None,
        lookup: Lookup | None = None,
    ):
        """``tree``: Medusa's resolved tree; for an EAGLE drafter, its calibrated accuracy only (no paths). ``lookup``:
        a lookup proposer whose trees are merged with the heads' or drafter's (:class:`~distill.engine.proposers.union.Union`)."""
        self.config = config or EngineConfig()
        self.model = model.eval()
        # the model's linear layers, prepared in place (values unchanged) where the rule says they multiply faster
        self.linear_prep = prepare_linears(model, None if self.config.compile else self._example(model), self._kept("kernels")) \
            if self.config.weight_layout == "auto" else {}
        if self.config.weight_layout == "auto":  # a compiled forward traces the modules' own code (inductor fuses it)
            self.linear_prep.update(prepare_norms(model) | prepare_rotary(model))
        self._rotary = bool(self.linear_prep.get("rotary_vllm"))  # eager forwards rotate on vLLM's kernel (engine.rotary)
        use_gqa_sdpa(model)  # sdpa without copying shared key/value heads under the engine's masks (same outputs)
        self.tokenizer = tokenizer
        self.model_name = model_name or getattr(model.config, "_name_or_path", "") or "model"
        self.device = next(model.parameters()).device
        self._decoder = model.get_decoder()  # its output's last_hidden_state is what the LM head reads
        self._rowwise = rowwise_modules(getattr(self._decoder, "layers", ()))  # dense MLPs: a padded prefill's rows
        self.dtype = next(model.parameters()).dtype
        self.stop_ids = self._eos_ids()
        self.kv_shape = kv.KVShape.of(model)
        self._plain = build_buffers([]).to(self.device)
        self.proposer: Proposer | None = None
        self._taus: dict[int, float] = {}
        self._revision = 0  # the proposer's revision the tables were read at
        self._proposal: dict[int, float] = {}
        if lookup is not None and (heads is None or isinstance(heads, Lookup)):
            raise ConfigError("a lookup proposer merges with Medusa heads or an EAGLE drafter: pass it as heads alone")
        if heads is not None:  # a Lookup drafts from the context: nothing to check against the model
            self.proposer = heads if isinstance(heads, Lookup) else self._proposer(heads, tree)
            if lookup is not None:
                self.proposer = Union([lookup, self.proposer], forward_weights=self._forward_weights())
            self._price()
        self.step_costs: StepCosts | None = None  # the measured curve the policy prices trees with (None: the line)
        measure = self.config.measured_costs
        if measure is None:
            measure = self.device.type == "cpu" and self.config.step_cost_ratio is None
        if self.proposer is not None and measure and self.config.speculate_max_batch is None:
            setup = forward_setup(model) | {"rotary": self._rotary, "compile": self.config.compile}
            self.step_costs = step_costs(model, self.proposer.max_nodes, self.config.max_batch, setup,
                                         self._kept("step-costs"))
        self.policy: AdaptivePolicy | None = None
        if self.proposer is not None and self.config.adaptive and self.config.speculate_max_batch is None:
            self.policy = AdaptivePolicy(self._taus, self._cost_model(), self._proposal)
        self.max_len = context_limit(model.config, self.max_tree_size - 1)  # prompt + max_tokens, at most
        self._hidden: dict = {}  # compiled forwards: the decoder's last_hidden_state, from a hook registered once
        self._compiled = None
        self.compiled_forwards = 0
        if self.config.compile:
            self._decoder.register_forward_hook(self._keep_hidden)  # traced into the graph (a per-call hook would recompile)
            self._compiled = torch.compile(self.model, dynamic=True)
        graphs = self.config.cuda_graphs
        if graphs is None:
            graphs = self.device.type == "cuda" and not self.config.compile
        if graphs and self.device.type != "cuda":
            raise ConfigError(f"cuda_graphs needs a model on a CUDA device; this one is on {self.device}")
        self.use_graphs(Graphs(capture=True) if graphs else None)  # decoding steps (and EAGLE's drafter passes) as CUDA graphs

    def use_graphs(self, graphs: Graphs | None) -> None:
        """Run the decoding steps (and an EAGLE proposer's drafter passes) through ``graphs`` (None: eagerly).

        With graphs, batches take their KV storage from a pool (engine.cache, "pooled storage"), so
        that later requests write the same memory and replay the graphs already recorded.
        """
        self.graphs = graphs
        self.kv_pool = kv.SlotPool(self.kv_shape) if graphs is not None else None
        if isinstance(self.proposer, (Eagle, Union)):
            self.proposer.use_graphs(graphs)

    def _keep_hidden(self, module, args, output) -> None:
        self._hidden["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def _kept(self, name: str) -> Path | None:
        """Where start-up measurements of one kind are kept (engine.kept), or None where they are timed every start."""
        return distill_home() / name if self.config.cached_costs else None

    @staticmethod
    def _example(model):
        """One short forward of ``model`` -> its logits: what :func:`~distill.engine.weights.prepare_linears` learns
        the linears that read one input from (not under ``compile``: the compiled forward multiplies per linear)."""
        device = next(model.parameters()).device

        def run():
            return model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device), use_cache=False).logits
        return run

    @torch.inference_mode()
    def warmup(self) -> None:
        """Compile (``EngineConfig.compile``) before the first request: a few plain batch-1 steps of a short prompt."""
        if self._compiled is not None:
            first = next(iter(self.stop_ids), 0)
            self.generate([[first] * 4], SamplingParams(max_tokens=3, ignore_eos=True), speculative=False)

    def _proposer(self, heads: MedusaHeads | EagleDrafter, tree: ResolvedTree | None) -> Proposer:
        """Check the heads or drafter against the model, prepare its linears, wrap it in its proposer."""
        model = self.model
        hp = next(heads.parameters())
        if hp.dtype != self.dtype or hp.device != self.device:
            raise ModelError(f"heads are {hp.dtype} on {hp.device} but the model is {self.dtype} on {self.device}: "
                             "load both with the same dtype and device")
        hidden, vocab = model.config.get_text_config().hidden_size, model.get_output_embeddings().weight.shape[0]
        hc = heads.config
        if hc.hidden_size != hidden:
            raise ModelError(f"heads hidden_size {hc.hidden_size} != model's {hidden}")
        if hc.vocab_size != vocab:
            raise ModelError(f"heads vocab_size {hc.vocab_size} != model's {vocab}")
        if self.config.weight_layout == "auto":
            prepared = prepare_linears(heads, kept_in=self._kept("kernels")) | prepare_norms(heads)
            for k, v in prepared.items():
                self.linear_prep[k] = self.linear_prep.get(k, 0) + v
        if isinstance(heads, EagleDrafter):
            layers = model.config.get_text_config().num_hidden_layers
            if max(hc.aux_layer_ids) >= layers:
                raise ModelError(f"the drafter fuses layers {hc.aux_layer_ids} but the model has {layers}")
            if (tree is not None and tree.paths) or self.config.tree is not None:
                raise ConfigError("an EAGLE drafter drafts a dynamic tree: set draft_nodes / draft_depth / draft_topk "
                                  "(--draft-nodes ...), not a Medusa tree")
            c = self.config
            return Eagle(heads, model.get_input_embeddings(), c.draft_nodes or DEFAULT_NODES, c.draft_depth or DEFAULT_DEPTH,
                         c.draft_topk or DEFAULT_TOPK,
                         accuracy=tree.accuracy if tree is not None and tree.accuracy else None)
        return Medusa(heads, tree or resolve_tree(self.config.tree, hc.num_heads), self.device)

    @property
    def trained(self) -> Medusa | Eagle | None:
        """The proposer of the Medusa heads or EAGLE drafter, alone or merged with the lookup's (None: neither)."""
        parts = self.proposer.parts if isinstance(self.proposer, Union) else [self.proposer]
        return next((p for p in parts if isinstance(p, (Medusa, Eagle))), None)

    @property
    def heads(self) -> MedusaHeads | EagleDrafter | None:
        """The Medusa heads or the EAGLE drafter (None: plain decoding only, or the lookup proposer alone)."""
        p = self.trained
        return None if p is None else p.heads if isinstance(p, Medusa) else p.drafter

    @property
    def tree(self) -> ResolvedTree | None:
        """Medusa's static tree (None for EAGLE, whose tree is drafted per step, and without heads)."""
        p = self.trained
        return p.tree if isinstance(p, Medusa) else None

    @property
    def max_tree_size(self) -> int:
        """T of the largest step: the root and the full tree's nodes (1 without a proposer)."""
        return 1 + (self.proposer.max_nodes if self.proposer is not None else 0)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str | None, heads: str | Path | None, config: EngineConfig | None = None) -> "Engine":
        """model: None = the bundled default, a local folder or Hub id; heads: a Medusa heads or EAGLE-3 drafter folder
        (:func:`~distill.heads.eagle.is_eagle3_folder`), :data:`LOOKUP` (the lookup proposer: no drafter), or None
        (plain only)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from distill.models import model_record, resolve_model

        config = config or EngineConfig()
        resolved = resolve_model(model)
        lookup = heads == LOOKUP
        if config.lookup and (heads is None or lookup):
            raise ConfigError(f"lookup merges the lookup proposer's trees with trained heads' or a drafter's: pass their "
                              f"folder as heads (or heads '{LOOKUP}' alone)")
        if config.lookup_data is not None and not (lookup or config.lookup):
            raise ConfigError(f"a lookup datastore ({config.lookup_data}) is for the lookup proposer: pass heads "
                              f"'{LOOKUP}' with it")
        if config.lookup_history is not None and not (lookup or config.lookup):
            raise ConfigError(f"lookup_history is the lookup proposer's: pass heads '{LOOKUP}' with it")
        where = resolve_placement(config, resolved.path, heads)
        config = dataclasses.replace(config, device=where.device, dtype=where.dtype)
        device = torch.device(config.device)
        lm = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=config.torch_dtype).to(device).eval()
        tok = AutoTokenizer.from_pretrained(resolved.path)
        lk = None
        if lookup or config.lookup:
            store = None
            if config.lookup_data is not None:
                record = model_record(resolved, lm.get_output_embeddings().weight.shape[0], None)
                store = Datastore.from_dataset(config.lookup_data, record["vocab_size"], record["tokenizer_sha256"])
            nodes = config.lookup_nodes or (config.draft_nodes if lookup else None)
            options = dict({"max_nodes": nodes} if nodes else {},
                           **({"history_tokens": config.lookup_history} if config.lookup_history is not None else {}))
            lk = Lookup(**options, datastore=store)
        if lookup:
            mh, tree, lk = lk, None, None
        else:
            mh, tree = load_heads(heads, config) if heads is not None else (None, None)
        return cls(lm, tok, mh, config, model_name=resolved.name, tree=tree, lookup=lk)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (getattr(self.tokenizer, "eos_token_id", None), getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(x) for x in src)
        return ids

    def _price(self) -> None:
        """The policy's tables from the proposer: expected tokens and proposal cost per tree size (again when a union's
        measured acceptance moved its shares: ``revision``)."""
        self._revision = getattr(self.proposer, "revision", 0)
        self._taus = self.proposer.taus()
        forward = self._forward_weights()
        self._proposal = {n: self.proposer.proposal_cost(n, forward) for n in self._taus}
        if getattr(self, "policy", None) is not None:
            self.policy.retable(self._taus, self._proposal)

    def _forward_weights(self) -> int:
        """Weights one forward reads: every parameter once, an untied input embedding not at all (it is looked up)."""
        forward = sum({id(p): p.numel() for p in self.model.parameters()}.values())
        emb_in, emb_out = self.model.get_input_embeddings().weight, self.model.get_output_embeddings().weight
        if emb_in is not emb_out:
            forward -= emb_in.numel()
        return forward

    # -- policy ------------------------------------------------------------------------------
    def _cost_model(self) -> float | StepCosts:
        """The policy's step cost: the measured curve, else the line of ``step_cost_ratio`` (or the device's default r)."""
        if self.step_costs is not None:
            return self.step_costs
        ratio = self.config.step_cost_ratio
        if ratio is None:
            ratio = DEFAULT_COST_RATIO.get(self.device.type, DEFAULT_COST_RATIO["cuda"])
        return ratio

    def tree_size_for(self, batch: int) -> int:
        """Tree nodes the policy would use now for a batch of ``batch`` sequences (0 = plain decoding)."""
        if self.proposer is None:
            return 0
        if self.config.speculate_max_batch is not None:  # the user decides: the full tree up to this batch size
            return self.proposer.max_nodes if batch <= self.config.speculate_max_batch else 0
        if self.policy is not None:
            return self.policy.best(batch)
        return choose_tree_size(batch, self._taus, self._cost_model(), None, self._proposal)

    # -- model calls -------------------------------------------------------------------------
    def _forward(self, ids, positions, bias, cache: kv.SlotCache, keep: int | torch.Tensor = 0,
                 layers: tuple[int, ...] | None = None):
        """ids/positions (B, T), bias (B or 1, 1, T, window) -> logits (B, T', V) float32, features (B, T, F).

        ``keep``: which positions get logits (0: all; a tensor: those indices, ``logits_to_keep``).
        ``layers`` None: the features are the decoder's ``last_hidden_state`` (after the final norm);
        layer ids: the hidden states entering those decoder layers, concatenated (EAGLE-3's aux
        layers). Either is taken with forward hooks for the duration of the call, so no other
        layer's states are kept.
        """
        if self._compiled is not None and layers is None and ids.numel() == 1:
            # one token: every linear multiplies a single row (DualLinear's traceable path); multi-row forwards
            # (prefills, trees, batches) stay eager on the oneDNN-packed weights, which the compiler cannot trace
            for storage in (cache.keys, cache.values):  # the slots grow with the sequences: one graph for every capacity
                torch._dynamo.maybe_mark_dynamic(storage, 3)
            out = self._compiled(input_ids=ids, position_ids=positions, attention_mask=bias, past_key_values=cache,
                                 use_cache=True, logits_to_keep=keep)
            self.compiled_forwards += 1
            return out.logits.float(), self._hidden.pop("hidden")
        captured: dict = {}

        def grab(module, args, output):
            captured["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

        def entering(i):
            def hook(module, args, kwargs):
                captured[i] = args[0] if args else kwargs["hidden_states"]
            return hook

        if layers is None:
            handles = [self._decoder.register_forward_hook(grab)]
        else:
            handles = [self._decoder.layers[i].register_forward_pre_hook(entering(i), with_kwargs=True) for i in layers]
        try:
            with rotary_kernel() if self._rotary else contextlib.nullcontext():
                out = self.model(input_ids=ids, position_ids=positions, attention_mask=bias, past_key_values=cache,
                                 use_cache=True, logits_to_keep=keep)
        finally:
            for h in handles:
                h.remove()
        self._hidden.clear()  # the compile hook's copy of an eager forward's states
        features = captured["hidden"] if layers is None else torch.cat([captured[i] for i in layers], dim=-1)
        return out.logits.float(), features

    def _accept(self, tokens, logits, buf: TreeBuffers, seqs: list[_Seq], draft: torch.Tensor | None = None) -> Acceptance:
        """Greedy rows with greedy_accept, sampled rows with the configured rule; merged per row.

        Rows whose options change the logits (penalties, bias, min_tokens) are judged on their
        processed logits (:func:`distill.engine.logits.process`); ``logits`` itself is left raw.
        ``draft`` (B, T, V): the proposer drew each node's children from these (rejection mode).
        """
        logits = process(logits, tokens, buf, {b: s.context() for b, s in enumerate(seqs) if changes_logits(s.params)})
        greedy_rows = [i for i, s in enumerate(seqs) if s.generator is None]
        if len(greedy_rows) == len(seqs):
            return greedy_accept(tokens, logits, buf)
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
            sub = greedy_accept(tokens[idx], logits[idx], part)
        elif mode == "typical":
            sub = typical_accept(tokens[idx], probs, part, gens, self.config.typical_epsilon, self.config.typical_delta)
        else:
            sub = rejection_accept(tokens[idx], probs, part, gens, draft[idx] if draft is not None else None)
        if not greedy_rows:
            return sub
        full = greedy_accept(tokens, logits, buf)
        for name in ("length", "path", "next_token", "last"):
            getattr(full, name)[idx] = getattr(sub, name)
        return full

    @staticmethod
    def _logprobs(logits, tokens, acc: Acceptance, seqs: list[_Seq]) -> dict[int, list[TokenLogprob]]:
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

    # -- generation --------------------------------------------------------------------------
    def _check(self, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        if len(params) != len(prompts):
            raise ConfigError(f"{len(prompts)} prompts but {len(params)} sampling params")
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if not p:
                raise ConfigError(f"prompt {i} is empty")
            vocab = self.model.get_output_embeddings().weight.shape[0]
            if sp.logit_bias and not all(0 <= t < vocab for t in sp.logit_bias):
                raise ConfigError(f"prompt {i}: logit_bias names a token id outside 0..{vocab - 1}")
            if len(p) + sp.max_tokens > self.max_len:
                raise ConfigError(f"prompt {i}: {len(p)} tokens + max_tokens {sp.max_tokens} exceed the engine's limit of {self.max_len}")

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams] | SamplingParams | None = None,
        speculative: bool = True,
        on_tokens: Callable[[int, list[int]], bool] | None = None,
    ) -> tuple[list[GenerationResult], StepStats]:
        """Decode ``prompts`` (token ids); batches of at most ``config.max_batch`` run at once.

        ``on_tokens(i, new_ids)`` is called whenever sequence i emits tokens (with ``logprobs=``, one
        :class:`~distill.engine.logits.TokenLogprob` per token, and the first time ``prompt_logprobs=``, when
        its params ask for them); returning False cancels it. ``speculative=False`` (or no heads) is plain decoding with the same code.
        """
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        self._check(prompts, params)
        seqs = [_Seq(i, sp, self.stop_ids, self.device, p) for i, (sp, p) in enumerate(zip(params, prompts))]
        stats = StepStats()
        B = self.config.max_batch
        speculative = speculative and self.proposer is not None
        for lo in range(0, len(prompts), B):
            batch = _Batch.prefill(self, prompts[lo : lo + B], seqs[lo : lo + B], on_tokens, stats, speculative)
            batch.compact()
            while len(batch):
                batch.step(on_tokens, stats)
                batch.compact()
        stats.tokens = sum(len(s.tokens) for s in seqs)
        return [s.result() for s in seqs], stats

    def running_batch(self, speculative: bool = True, on_tokens: Callable[[object, list[int]], bool] | None = None) -> "RunningBatch":
        """A batch that sequences join between steps (continuous batching; see :class:`RunningBatch`)."""
        return RunningBatch(self, speculative and self.proposer is not None, on_tokens)


class _Batch:
    """The rows decoding together: their sequences, KV cache and per-row state (see engine.cache).

    Row b's state: ``ends[b]`` its committed length (host), ``root[b]`` its next token (device),
    and, when the batch speculates, its row of the proposer's draft state ``draft``
    (:mod:`distill.engine.proposers.base`; None for plain decoding throughout).
    """

    def __init__(self, engine: Engine, seqs: list[_Seq], cache: kv.SlotCache, ends: list[int], root: torch.Tensor, draft):
        self.engine = engine
        self.seqs = seqs
        self.cache = cache
        self.ends = ends
        self.root = root  # (B,)
        self.draft = draft  # the proposer's DraftState, or None

    def __len__(self) -> int:
        return len(self.seqs)

    @classmethod
    def prefill(cls, engine: Engine, prompts: list[list[int]], seqs: list[_Seq], on_tokens, stats: StepStats,
                speculative: bool) -> "_Batch":
        """One forward over the right-padded prompts into a fresh cache; emits each sequence's first token.

        ``speculative``: the proposer's prefill hook runs (its draft state follows the batch).
        """
        with record_function("distill.prefill"):
            return cls._prefill(engine, prompts, seqs, on_tokens, stats, speculative and engine.proposer is not None)

    @classmethod
    def _prefill(cls, engine: Engine, prompts: list[list[int]], seqs: list[_Seq], on_tokens, stats: StepStats,
                 speculative: bool) -> "_Batch":
        dev = engine.device
        t0 = time.perf_counter()
        lengths = [len(p) for p in prompts]
        P = max(lengths)
        slots = -(-(max(n + s.params.max_tokens for n, s in zip(lengths, seqs)) + engine.max_tree_size) // SLOT_ROUND) * SLOT_ROUND
        cache = kv.SlotCache(engine.kv_shape, len(prompts), slots, pool=engine.kv_pool)
        ids = torch.tensor([list(p) + [0] * (P - len(p)) for p in prompts], dtype=torch.long, device=dev)  # (B, P)
        positions = torch.arange(P, device=dev)[None].expand(len(prompts), P)  # (B, P)
        cache.prepare(positions, P)
        echo = [b for b, s in enumerate(seqs) if s.params.prompt_logprobs is not None]
        # the positions whose logits are needed: each row's last, or all of them for prompt logprobs
        last = list(range(P)) if echo else sorted(set(n - 1 for n in lengths))
        keep = torch.tensor(last, dtype=torch.long, device=dev)
        bias = kv.attention_bias(kv.prefill_allowed(P, dev), engine.dtype)  # (1, 1, P, P)
        layers = engine.proposer.feature_layers if speculative else None
        with valid_rows(lengths, P, dev, engine._rowwise):  # the linears and MLPs take the prompts' tokens, not the padding
            logits, features = engine._forward(ids, positions, bias, cache, keep, layers)  # (B, U, V), (B, P, F)
        rows = torch.arange(len(prompts), device=dev)
        col = torch.tensor([last.index(n - 1) for n in lengths], device=dev)
        for b in echo:  # position t's distribution drew prompt token t + 1
            n, top = lengths[b], seqs[b].params.prompt_logprobs
            where = torch.arange(n - 1, device=dev)[None]
            chosen, tids, vals = token_logprobs(logits, rows[b : b + 1], where, ids[b : b + 1, 1:n], top)
            seqs[b].prompt_logprobs = [None] + [TokenLogprob(t, c, tuple(zip(i, v)))
                                                for t, c, i, v in zip(prompts[b][1:], chosen[0], tids[0], vals[0])]
        zeros = torch.zeros(len(seqs), 1, dtype=torch.long, device=dev)
        first_logits = logits[rows, col][:, None]  # (B, 1, V)
        first = engine._accept(zeros, first_logits, engine._plain, seqs)
        lps = engine._logprobs(first_logits, zeros, first, seqs)
        root = first.next_token  # (B,)
        for b, (s, tok) in enumerate(zip(seqs, root.tolist())):
            s.emit([tok], on_tokens, lps.get(b))
        draft = (engine.proposer.start(features, ids, lengths, root, slots, greedy=[s.generator is None for s in seqs])
                 if speculative else None)
        stats.prefill_seconds += time.perf_counter() - t0
        stats.kv_bytes = max(stats.kv_bytes, cache.nbytes)
        return cls(engine, list(seqs), cache, lengths, root, draft)

    def compact(self) -> list[_Seq]:
        """Drop the finished rows (the cache keeps the others, moved to the front); -> the finished sequences."""
        keep = [i for i, s in enumerate(self.seqs) if s.finish is None]
        done = [s for s in self.seqs if s.finish is not None]
        if done:
            used = max((self.ends[i] for i in keep), default=0)
            self.cache.keep_rows(keep, used)
            if self.draft is not None:
                self.draft.keep(keep, used)
            self.root = self.root[torch.tensor(keep, dtype=torch.long, device=self.root.device)]
            self.ends = [self.ends[i] for i in keep]
            self.seqs = [self.seqs[i] for i in keep]
        return done

    def join(self, other: "_Batch") -> None:
        """Append ``other``'s rows (their cache and draft state included) after this batch's."""
        self.cache.append(other.cache, max(other.ends))
        if self.draft is not None:
            self.draft.join(other.draft, max(other.ends))
        self.ends = self.ends + other.ends
        self.root = torch.cat([self.root, other.root])
        self.seqs = self.seqs + other.seqs

    def _sampling(self) -> DraftSampling | None:
        """In rejection mode with sampled rows: their temperatures and generators, so the proposer may draw its drafts."""
        cfg = self.engine.config
        if cfg.acceptance != "rejection" or not cfg.sample_drafts or all(s.generator is None for s in self.seqs):
            return None
        temps = [s.params.temperature if s.generator is not None else 0.0 for s in self.seqs]
        return DraftSampling(torch.tensor(temps, device=self.root.device), [s.generator for s in self.seqs])

    def step(self, on_tokens, stats: StepStats) -> None:
        """One decoding step of every row (all unfinished): propose, verify, accept, compact, emit."""
        e = self.engine
        active = self.seqs
        B = len(active)
        speculative = self.draft is not None
        stats.batch_size = max(stats.batch_size, B)
        t0 = time.perf_counter()
        if not speculative:
            nodes = 0
        elif e.policy is not None:
            nodes = e.policy.next_size(B)
        else:
            nodes = e.tree_size_for(B)
        end = torch.tensor(self.ends, dtype=torch.long, device=e.device)  # (B,)
        with record_function("distill.propose"):
            if nodes:
                proposal = e.proposer.propose(self.draft, self.root, end, max(self.ends), nodes, self._sampling())
            else:
                proposal = Proposal(self.root[:, None], e._plain)  # (B, 1)
        tokens, buf = proposal.tokens, proposal.buffers
        T = buf.size
        graphs = e.graphs
        with record_function("distill.mask"):
            offsets = torch.arange(T, device=e.device)
            write = end[:, None] + offsets[None]  # (B, T): tree position t of row b goes to slot end_b + t
            # eager: the longest row's committed slots and its tree; graphed: every slot (a static shape)
            window = self.cache.slots if graphs is not None else max(self.ends) + T
            bias = kv.attention_bias(kv.step_allowed(end, buf.mask, window), e.dtype)  # (B, 1, T, W)
        with record_function("distill.forward"):
            layers = e.proposer.feature_layers if speculative else None
            if graphs is not None:
                cache = self.cache

                def forward(ids, positions, write, bias):
                    cache.prepare(write, cache.slots)
                    return e._forward(ids, positions, bias, cache, layers=layers)

                logits, features = graphs(("step", cache_key(cache), T, layers), forward, tokens, end[:, None] + buf.depth, write, bias)
            else:
                self.cache.prepare(write, window)
                logits, features = e._forward(tokens, end[:, None] + buf.depth, bias, self.cache, layers=layers)
        with record_function("distill.accept"):
            acc = e._accept(tokens, logits, buf, active, proposal.draft)
        with record_function("distill.compact"):
            if buf.nodes:  # the accepted nodes follow the root: tree slot end + path_k -> end + k
                self.cache.move(end[:, None] + acc.path, end[:, None] + offsets[None, : acc.path.shape[1]])
            self.root = acc.next_token
        with record_function("distill.host"):  # the one transfer of the step: accepted candidates, next token, length
            host = torch.cat([tokens.gather(1, acc.path[:, 1:]), self.root[:, None], acc.length[:, None]], dim=1).tolist()
        lengths_acc = [row[-1] for row in host]
        lps = e._logprobs(logits, tokens, acc, active)
        if speculative:
            with record_function("distill.commit"):
                e.proposer.commit(self.draft, proposal, features, acc, self.ends, lengths_acc)
            if getattr(e.proposer, "revision", 0) != e._revision:  # a union moved its shares: price the sizes again
                e._price()
        stats.steps += 1
        stats.tree_nodes = max(stats.tree_nodes, buf.nodes)
        stats.tree_nodes_per_step.append(buf.nodes)
        stats.accepted_per_step.append(list(lengths_acc))
        for b, (s, row) in enumerate(zip(active, host)):
            L = row[-1]
            new = row[:L] + [row[-2]]
            self.ends[b] += L + 1
            s.steps += 1
            s.accepted.append(len(new))
            s.emit(new, on_tokens, lps.get(b))
        seconds = time.perf_counter() - t0
        stats.step_seconds.append(seconds)
        if e.policy is not None and speculative:  # the size it chose: a lookup tree may hold fewer nodes (its taus are
            e.policy.observe(B, nodes, seconds, lengths_acc)  # per budget, no-match steps included)


def load_heads(folder: str | Path, config: EngineConfig) -> tuple[MedusaHeads | EagleDrafter, ResolvedTree | None]:
    """A Medusa heads or EAGLE-3 drafter folder -> (heads or drafter on ``config``'s device and dtype, tree for the Engine).

    Medusa: the tree ``config.tree`` names (its ``tree.json`` by default). EAGLE: no paths, only
    the per-depth accuracy ``distill calibrate`` wrote into its ``tree.json`` (None without one).
    """
    folder = Path(folder)
    device = torch.device(config.device)
    if is_eagle3_folder(folder):
        drafter = EagleDrafter.load(folder, device=device, dtype=config.torch_dtype)
        tree = None
        if (folder / "tree.json").is_file():  # `distill calibrate`: per-depth acceptance for the policy
            tree = ResolvedTree([], load_tree(folder / "tree.json").get("accuracy") or [], f"{folder}/tree.json")
        return drafter, tree
    heads = MedusaHeads.load(folder, device=device, dtype=config.torch_dtype)
    return heads, resolve_tree(config.tree, heads.config.num_heads, heads_folder=folder)


#: Slot capacities are rounded up to a multiple of this (fewer distinct shapes, some room for joins).
SLOT_ROUND = 64


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
        return len(self._batch) if self._batch is not None else 0

    def _finished(self, done: list[_Seq]) -> list[tuple[object, GenerationResult]]:
        self.stats.tokens += sum(len(s.tokens) for s in done)
        if self._batch is not None and not len(self._batch):
            self._batch = None
        return [(s.index, s.result()) for s in done]

    @torch.inference_mode()
    def add(self, prompts: list[list[int]], params: list[SamplingParams], keys: list) -> list[tuple[object, GenerationResult]]:
        """Prefill ``prompts`` and let them join; -> those already finished (first token a stop, max_tokens 1)."""
        e = self.engine
        e._check(prompts, params)
        if len(keys) != len(prompts):
            raise ConfigError(f"{len(prompts)} prompts but {len(keys)} keys")
        seqs = [_Seq(k, sp, e.stop_ids, e.device, p) for k, sp, p in zip(keys, params, prompts)]
        new = _Batch.prefill(e, prompts, seqs, self.on_tokens, self.stats, self.speculative)
        done = new.compact()
        if len(new):
            if self._batch is None:
                self._batch = new
            else:
                self._batch.join(new)
                self.stats.kv_bytes = max(self.stats.kv_bytes, self._batch.cache.nbytes)
        return self._finished(done)

    @torch.inference_mode()
    def step(self) -> list[tuple[object, GenerationResult]]:
        """One decoding step of every row; -> the sequences that finished in it."""
        if self._batch is None:
            return []
        self._batch.step(self.on_tokens, self.stats)
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
