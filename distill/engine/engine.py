"""The decoding engine: plain and speculative (Medusa, EAGLE-3, lookup) decoding on any transformers decoder-only model.

:class:`Engine` is the facade: it loads the model and its drafter (:meth:`Engine.from_pretrained`),
wires them (:class:`~distill.engine.target.Target` for the model, a proposer from
:mod:`distill.engine.proposers`, :class:`~distill.engine.policy.Pricing` for when to speculate) and
runs requests (:meth:`Engine.generate`, :meth:`Engine.running_batch`). The decoding step itself, its
terms and its math, is :meth:`distill.engine.batch.Batch.step`.

Terms
-----
prefill
    one forward over the right-padded prompts into a fresh :class:`~distill.engine.cache.SlotCache`;
    each row's logits at its last prompt token give its first token (emitted) and its features.
root
    the next token of a sequence, decided but not yet in the KV cache.
step
    one forward after the prefill: propose, verify, accept, commit (:mod:`distill.engine.batch`).
emitted tokens
    per step: the accepted candidates and the next token, ``L + 1`` tokens
    (``GenerationResult.accepted``); the prefill emits the first token.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Callable, Iterator

import torch

from distill.engine.batch import Batch, Decoding, RunningBatch
from distill.engine.config import EngineConfig, resolve_placement
from distill.engine.costs import forward_setup, step_costs
from distill.engine.graphs import Graphs
from distill.engine.policy import DEFAULT_COST_RATIO, Pricing, StepCosts
from distill.engine.proposers.base import Proposer
from distill.engine.proposers.datastore import Datastore
from distill.engine.proposers.eagle import DEFAULT_DEPTH, DEFAULT_NODES, DEFAULT_TOPK, Eagle
from distill.engine.proposers.lookup import LOOKUP, Lookup
from distill.engine.proposers.medusa import Medusa
from distill.engine.proposers.union import Union
from distill.engine.requests import GenerationResult, SamplingParams, Sequence, StepStats
from distill.engine.target import Target
from distill.engine.tree import ResolvedTree, resolve_tree
from distill.errors import ConfigError, ModelError
from distill.heads.eagle import EagleDrafter, is_eagle3_folder
from distill.heads.model import MedusaHeads
from distill.heads.tree import load_tree
from distill.models import context_limit, distill_home


class Engine:
    """Plain, Medusa, EAGLE and lookup decoding (see the module docstring). One generate() at a time per instance.

    ``heads``: Medusa heads (:class:`MedusaHeads`), an EAGLE-3 drafter (:class:`EagleDrafter`), or the
    lookup proposer (:class:`~distill.engine.proposers.lookup.Lookup`: n-gram matches in the context). The
    model (and the heads) are prepared as :class:`~distill.engine.target.Target` says, values unchanged.
    ``tree``: Medusa's resolved tree; for an EAGLE drafter, its calibrated accuracy only (no paths). ``lookup``: a
    lookup proposer whose trees are merged with the heads' or drafter's (:class:`~distill.engine.proposers.union.Union`).
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
        self.config = config or EngineConfig()
        self.target = Target(model, self.config, self._kept("kernels"))
        self.model, self.tokenizer = self.target.model, tokenizer
        self.model_name = model_name or getattr(model.config, "_name_or_path", "") or "model"
        self.stop_ids = self._eos_ids()
        self.proposer: Proposer | None = None
        if lookup is not None and (heads is None or isinstance(heads, Lookup)):
            raise ConfigError("a lookup proposer merges with Medusa heads or an EAGLE drafter: pass it as heads alone")
        if heads is not None:  # a Lookup drafts from the context: nothing to check against the model
            self.proposer = heads if isinstance(heads, Lookup) else self._proposer(heads, tree)
            if lookup is not None:
                self.proposer = Union([lookup, self.proposer], forward_weights=self.target.forward_weights())
        if isinstance(self.proposer, Lookup):  # a lookup drafts chains where the target verifies them for less
            self.proposer.use_chains(not self.target.paged_problem)
        self.step_costs: StepCosts | None = None  # the measured curve the policy prices trees with (None: the line)
        self.pricing: Pricing | None = None
        if self.proposer is not None:
            measure = self.config.measured_costs
            if measure is None:
                measure = self.device.type == "cpu" and self.config.step_cost_ratio is None
            if measure and self.config.speculate_max_batch is None:
                paths = {k: self.target.prep.get(k, 0) for k in ("attention_vllm", "direct_steps")}
                setup = forward_setup(model) | {"compile": self.target.compile} | paths
                self.step_costs = step_costs(self.target, self.proposer.max_nodes, self.config.max_batch, setup,
                                             self._kept("step-costs"), getattr(self.proposer, "drafts_chains", False))
            self.pricing = Pricing(self.proposer, self.target.forward_weights(), self._cost_model(), self.config)
            if self.pricing.budget is not None:  # a lookup's chains, priced node by node
                self.proposer.use_budget(self.pricing.budget.lengths)
        max_len = context_limit(model.config, self.max_tree_size - 1)  # prompt + max_tokens, at most
        self.decoding = Decoding(self.target, self.proposer, self.pricing, self.config, self.stop_ids, max_len)
        self.target.compile_steps(getattr(self.proposer, "feature_layers", None))
        if isinstance(self.proposer, (Eagle, Union)):
            self.proposer.use_graphs(self.target.graphs)

    # -- what the target holds -----------------------------------------------------------------
    device = property(lambda self: self.target.device)
    dtype = property(lambda self: self.target.dtype)
    kv_shape = property(lambda self: self.target.kv_shape)
    graphs = property(lambda self: self.target.graphs)
    kv_pool = property(lambda self: self.target.kv_pool)
    compile = property(lambda self: self.target.compile)
    compiled_forwards = property(lambda self: self.target.compiled_forwards)
    linear_prep = property(lambda self: self.target.prep)  # what the CPU kernels prepared (engine.cpu)
    max_len = property(lambda self: self.decoding.max_len)  # prompt + max_tokens, at most
    policy = property(lambda self: self.pricing.policy if self.pricing is not None else None)

    def use_graphs(self, graphs: Graphs | None) -> None:
        """Run the decoding steps (and an EAGLE proposer's drafter passes) through ``graphs`` (None: eagerly).

        With graphs, batches take their KV storage from a pool (engine.cache, "pooled storage"), so
        that later requests write the same memory and replay the graphs already recorded.
        """
        self.target.use_graphs(graphs)
        if isinstance(self.proposer, (Eagle, Union)):
            self.proposer.use_graphs(graphs)

    def _kept(self, name: str) -> Path | None:
        """Where start-up measurements of one kind are kept (engine.kept), or None where they are timed every start."""
        return distill_home() / name if self.config.cached_costs else None

    @torch.inference_mode()
    def warmup(self) -> None:
        """Compile (:attr:`compile`) before the first request: a few plain batch-1 steps of a short prompt (with CUDA
        graphs, their buckets recorded too)."""
        if self.compile:
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
        if self.config.weight_layout == "auto" and self.device.type == "cpu":
            from distill.engine import cpu

            for k, v in cpu.prepare(heads, None, self._kept("kernels"), attention=False).items():
                self.target.prep[k] = self.target.prep.get(k, 0) + v
        if isinstance(heads, EagleDrafter):
            layers = model.config.get_text_config().num_hidden_layers
            if max(hc.aux_layer_ids) >= layers:
                raise ModelError(f"the drafter fuses layers {hc.aux_layer_ids} but the model has {layers}")
            if (tree is not None and tree.paths) or (self.config.tree is not None and tree is None):
                raise ConfigError(EAGLE_TREE)
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
        return self.pricing.size(batch) if self.pricing is not None else 0

    @contextlib.contextmanager
    def full_tree(self) -> Iterator[None]:
        """Within it, every speculative step verifies the whole tree at any batch size (the policy's choice set aside):
        what the tree itself accepts, measured on the running engine (the policy reads the setting at each step)."""
        before = self.config.speculate_max_batch
        self.config.speculate_max_batch = self.config.max_batch
        try:
            yield
        finally:
            self.config.speculate_max_batch = before

    # -- generation --------------------------------------------------------------------------
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
        self.decoding.check(prompts, params)
        seqs = [Sequence(i, sp, self.stop_ids, self.device, p) for i, (sp, p) in enumerate(zip(params, prompts))]
        stats = StepStats()
        B = self.config.max_batch
        speculative = speculative and self.proposer is not None
        for lo in range(0, len(prompts), B):
            batch = Batch.prefill(self.decoding, prompts[lo : lo + B], seqs[lo : lo + B], on_tokens, stats, speculative)
            batch.compact()
            while len(batch):
                batch.step(on_tokens, stats)
                batch.compact()
        stats.tokens = sum(len(s.tokens) for s in seqs)
        return [s.result() for s in seqs], stats

    def running_batch(self, speculative: bool = True, on_tokens: Callable[[object, list[int]], bool] | None = None) -> "RunningBatch":
        """A batch that sequences join between steps (continuous batching; see :class:`RunningBatch`)."""
        return RunningBatch(self.decoding, speculative and self.proposer is not None, on_tokens)


EAGLE_TREE = ("an EAGLE drafter drafts a dynamic tree: set draft_nodes / draft_depth / draft_topk (--draft-nodes ...); "
              "--tree takes only a tree.json of `distill calibrate` for it (the per-depth accuracy the policy prices with)")


def load_heads(folder: str | Path, config: EngineConfig) -> tuple[MedusaHeads | EagleDrafter, ResolvedTree | None]:
    """A Medusa heads or EAGLE-3 drafter folder -> (heads or drafter on ``config``'s device and dtype, tree for the Engine).

    Medusa: the tree ``config.tree`` names (its ``tree.json`` by default). EAGLE: no paths, only
    the per-depth accuracy ``distill calibrate`` wrote into a ``tree.json``: the one ``config.tree`` names (a file;
    a preset or a spec is an error), else the folder's (None without one).
    """
    folder = Path(folder)
    device = torch.device(config.device)
    if is_eagle3_folder(folder):
        if config.tree is not None:
            calibration = Path(config.tree).expanduser()
            if calibration.suffix != ".json" and not calibration.exists():
                raise ConfigError(EAGLE_TREE)
        else:
            calibration = folder / "tree.json" if (folder / "tree.json").is_file() else None
        drafter = EagleDrafter.load(folder, device=device, dtype=config.torch_dtype)
        tree = None
        if calibration is not None:  # `distill calibrate`: per-depth acceptance for the policy
            tree = ResolvedTree([], load_tree(calibration).get("accuracy") or [], str(calibration))
        return drafter, tree
    heads = MedusaHeads.load(folder, device=device, dtype=config.torch_dtype)
    return heads, resolve_tree(config.tree, heads.config.num_heads, heads_folder=folder)


__all__ = ["LOOKUP", "Engine", "GenerationResult", "RunningBatch", "SamplingParams", "StepStats", "load_heads"]
