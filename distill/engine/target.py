"""The target model: how it is prepared, its forward, the hooks that read its features, its KV storage and graphs.

Terms
-----
target
    the model being decoded (a transformers decoder-only model). :class:`Target` prepares it once:
    on a CPU, with ``EngineConfig.weight_layout="auto"``, through the CPU kernels' one interface
    (:func:`distill.engine.cpu.prepare`; the GPU path never imports them); everywhere, ``sdpa``
    attention switched to ``distill_sdpa`` (:mod:`distill.engine.attention`), whose eager forwards
    attend each run of rows over no more keys than its longest row needs ("row chunks" there).
kernel attention
    on a CPU with ``weight_layout="auto"`` and eager steps, where vLLM's attention kernel passes its
    check (:func:`distill.engine.cpu.paged.paged_problem`): the caches keep their keys in the
    kernel's order, and every forward it computes (a prefill, a plain step, a step whose rows all
    verify a chain) attends on it; a branching tree's step attends in ``distill_sdpa`` under its mask.
direct steps
    where the attention runs on the kernel, the steps it computes and the prefills run the model's
    prepared modules' kernels layer by layer (:mod:`distill.engine.cpu.direct`), not through the modules'
    calls, a prefill's prompts packed without padding: the same operations, checked once to give the
    modules' logits, features and cache writes exactly. A step may prefill prompts in its own forward,
    packed after its rows (:meth:`Target.mixed_step`).
hidden state
    the backbone's last hidden state after the final norm (what the LM head reads): the decoder's
    (``model.get_decoder()``) ``last_hidden_state``. Medusa's feature.
features
    what a proposer reads from each forward (``Proposer.feature_layers``): the hidden state, or the
    hidden states entering the listed decoder layers, concatenated (EAGLE-3's aux layers), taken
    with forward hooks for the duration of the call (compiled steps: hooks registered once).
compiled steps
    ``EngineConfig.compile``: the decoding steps' forwards run through ``torch.compile`` of the
    whole model: every step where no linear runs on packed CPU weights (on a GPU the compiler fuses
    each layer's elementwise work between the products, and CUDA graphs replay the result); else
    single-token steps only (each CPU linear multiplies one row, the path the compiler traces).
    Prefills stay eager (their row selection, :mod:`distill.engine.rows`, hooks in per call).
graphed steps
    ``EngineConfig.cuda_graphs``: each step's forward is recorded once per bucket and replayed
    (:mod:`distill.engine.graphs`); the KV storage then comes from a pool, so later batches write
    the same memory and replay what is recorded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from distill.engine import cache as kv
from distill.engine.attention import NAME as ATTENTION_NAME
from distill.engine.attention import Masked, plan_row_chunks, use_gqa_sdpa
from distill.engine.config import EngineConfig
from distill.engine.graphs import Graphs, cache_key
from distill.engine.rows import rowwise_modules, valid_rows
from distill.errors import ConfigError


def _packing(used: list[int], T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose first ``used[b]`` of T positions are real, packed one after another -> (real (B, T): those positions,
    index (B, T): the packed token each position reads; the positions after a row's real ones read its last)."""
    n = torch.tensor(used, device=device)[:, None]
    t = torch.arange(T, device=device)[None]
    return t < n, (n.cumsum(0) - n) + torch.minimum(t, n - 1)


def _unpacked(packed: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Packed rows (N, F) -> (B, T, F) at the ``real`` (B, T) positions, zeros elsewhere."""
    out = packed.new_zeros(*real.shape, packed.shape[-1])
    out[real] = packed
    return out


class Target:
    """The target model as the engine runs it (module docstring). ``kept``: where the CPU kernels' start-up probe
    keeps its times (None: timed at every start)."""

    def __init__(self, model, config: EngineConfig, kept: Path | None = None):
        self.model = model.eval()
        self.config = config
        self.device = next(model.parameters()).device
        graphs = config.cuda_graphs if config.cuda_graphs is not None else self.device.type == "cuda"
        if graphs and self.device.type != "cuda":
            raise ConfigError(f"cuda_graphs needs a model on a CUDA device; this one is on {self.device}")
        self.compile = config.compile
        #: what the CPU kernels prepared (:func:`distill.engine.cpu.prepare`); empty off the CPU or with "as-loaded"
        self.prep: dict[str, int] = {}
        if config.weight_layout == "auto" and self.device.type == "cpu":
            from distill.engine import cpu

            self.prep = cpu.prepare(model, None if self.compile else self._example(), kept)
        use_gqa_sdpa(model)  # sdpa without copying shared key/value heads under the engine's masks (same outputs)
        switched = getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME  # now, or by an engine before
        self.decoder = model.get_decoder()  # its output's last_hidden_state is what the LM head reads
        self.rowwise = rowwise_modules(getattr(self.decoder, "layers", ()))  # dense MLPs: a padded prefill's rows
        self.dtype = next(model.parameters()).dtype
        self.kv_shape = kv.KVShape.of(model)
        self._kept: dict = {}  # compiled forwards: the states the hooks registered once keep
        self._compiled = None
        self.compiled_forwards = 0
        # every step's forward compiles where no linear runs on packed weights (a GPU, or "as-loaded" weights)
        self._compile_all = self.compile and (self.device.type != "cpu" or config.weight_layout == "as-loaded")
        self.use_graphs(Graphs(capture=True) if graphs else None)
        self.heads = model.config.get_text_config().num_attention_heads
        #: why the attention does not run on vLLM's kernel ("": it does; module docstring, "kernel attention")
        self.paged_problem = ("attention 'sdpa', or not a CPU with its kernels, or compiled or graphed steps, or a model not "
                              "on sdpa attention")
        if (switched and config.attention == "auto" and config.weight_layout == "auto" and self.device.type == "cpu"
                and not self.compile and self.graphs is None):
            from distill.engine.cpu.paged import paged_problem

            self.paged_problem = paged_problem(self.kv_shape, self.heads)
        self.prep["attention_vllm"] = int(not self.paged_problem)
        #: greedy decoding's argmax over the logits' last axis: vLLM's kernel where the attention runs on its library
        #: (None: torch's)
        self.argmax = None
        if not self.paged_problem:
            from distill.engine.cpu.argmax import argmax

            self.argmax = argmax
            self.kv_pool = kv.SlotPool(self.kv_shape, keep=1, key_order="dims", powers_of_two=False)  # cache.py, "pooled storage"
        #: the steps' direct forward (module docstring, "direct steps"), None where ``direct_problem`` says why not
        self.direct, self.direct_problem = None, "the attention is not on vLLM's kernel"  # None during _direct's check too
        if not self.paged_problem:
            self.direct, self.direct_problem = self._direct()
        self.prep["direct_steps"] = int(self.direct is not None)

    def _direct(self):
        """The model's :class:`~distill.engine.cpu.direct.DirectDecoder` where it applies and reproduces the modules'
        step exactly (logits, features, the cache's writes) on two uneven rows, a chain of two tokens, a single token
        with features of two layers and a tree of a root and two siblings, and their prefill of two prompts of uneven
        lengths -> (decoder or None, why not)."""
        from distill.engine.cpu import paged
        from distill.engine.cpu.direct import DirectDecoder

        direct = DirectDecoder.of(self.model)
        if isinstance(direct, str):
            return None, direct
        g = torch.Generator().manual_seed(0)
        ends, slots = [3, 6], 16
        filled = [torch.randn(self.new_cache(2, slots).keys.shape, generator=g) for _ in range(2)]
        end = torch.tensor(ends, device=self.device)
        siblings = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool, device=self.device)  # root, 2 children
        for T, layers, tree in ((2, None, None), (1, (0, len(direct.layers) - 1), None), (3, None, siblings)):
            ids = torch.randint(0, self.vocab_size, (2, T), generator=g, device=self.device)
            depth = torch.arange(T, device=self.device) if tree is None else tree.sum(1) - 1
            positions = end[:, None] + depth
            bias = torch.zeros(2, 1, T, max(ends) + T, dtype=self.dtype, device=self.device)
            chunks = None
            if tree is not None:
                bias = kv.attention_bias(kv.step_allowed(end, tree, max(ends) + T), self.dtype)
                chunks = plan_row_chunks([T] * 2, [e + T for e in ends])
            got = []
            for run in ("modules", "direct"):
                cache = self.new_cache(2, slots)
                cache.keys.copy_(filled[0])
                cache.values.copy_(filled[1])
                cache.prepare(end[:, None] + torch.arange(T, device=self.device), bias.shape[-1])  # slot end + t
                masked = Masked(cache.keys, cache.values, bias, chunks) if tree is not None else None
                plan = paged.plan(cache, [T] * 2, ends, self.heads, padded=False, masked=masked)
                with torch.inference_mode():
                    if run == "modules" and tree is not None:
                        out = self.forward(ids, positions, bias, cache, layers=layers, step=True, chunks=chunks)
                    elif run == "modules":
                        out = self.forward(ids, positions, bias, cache, layers=layers, step=True, paged=plan)
                    else:
                        logits, features = direct.forward(ids, positions, plan, layers)
                        out = logits.float(), features
                got.append((*out, cache.keys.clone(), cache.values.clone()))
            same = [torch.equal(a, b) for a, b in zip(*got)]
            if not all(same):
                what = [name for name, ok in zip(("logits", "features", "keys", "values"), same) if not ok]
                shape = "a tree of 3" if tree is not None else f"{T} token(s) a row"
                return None, f"its step differs from the modules' ({', '.join(what)}, {shape})"
        lengths, P = [5, 3], 5
        ids = torch.randint(0, self.vocab_size, (2, P), generator=g).to(self.device)
        positions = torch.arange(P, device=self.device)[None].expand(2, P)
        bias = kv.attention_bias(kv.prefill_allowed(P, self.device), self.dtype)
        layers = (0, len(direct.layers) - 1)
        got = []
        for run in ("modules", "direct"):
            cache = self.new_cache(2, slots)
            cache.prepare(positions, P, from_start=True)
            with torch.inference_mode():
                if run == "modules":
                    logits, features = self.prefill(ids, positions, bias, cache, layers, lengths)
                else:
                    logits, features = self._direct_prefill(direct, ids, positions, cache, layers, lengths)
            written = [(store[:, b, :, :n].clone()) for store in (cache.keys, cache.values) for b, n in enumerate(lengths)]
            got.append((logits, *(features[b, :n] for b, n in enumerate(lengths)), *written))
        if not all(torch.equal(a, b) for a, b in zip(*got)):
            return None, "its prefill differs from the modules'"
        return direct, ""

    def _example(self):
        """One short forward -> its logits: what the CPU linears learn which of them read one input from."""
        model, device = self.model, self.device

        def run():
            return model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device), use_cache=False).logits
        return run

    def compile_steps(self, feature_layers: tuple[int, ...] | None) -> None:
        """Compile the steps' forwards (``EngineConfig.compile``): the hooks that keep the features are registered now,
        once (traced into the graph; a hook added per call would recompile it)."""
        if not self.compile or self._compiled is not None:
            return
        self.decoder.register_forward_hook(self._keep_hidden)
        if self._compile_all:
            for i in feature_layers or ():
                self.decoder.layers[i].register_forward_pre_hook(self._keep_entering(i), with_kwargs=True)
        self._compiled = torch.compile(self.model, dynamic=True)

    def _keep_hidden(self, module, args, output) -> None:
        self._kept["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def _keep_entering(self, i: int):
        def hook(module, args, kwargs):
            self._kept[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    def use_graphs(self, graphs: Graphs | None) -> None:
        """Run the steps' forwards through ``graphs`` (None: eagerly); with graphs, KV storage comes from a pool."""
        self.graphs = graphs
        self.kv_pool = kv.SlotPool(self.kv_shape) if graphs is not None else None

    def new_cache(self, rows: int, slots: int) -> kv.SlotCache:
        if not self.paged_problem:
            return kv.SlotCache(self.kv_shape, rows, slots, pool=self.kv_pool, key_order="dims")
        return kv.SlotCache(self.kv_shape, rows, slots, pool=self.kv_pool)

    def forward_weights(self) -> int:
        """Weights one forward reads: every parameter once, an untied input embedding not at all (it is looked up)."""
        model = self.model
        forward = sum({id(p): p.numel() for p in model.parameters()}.values())
        emb_in, emb_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        if emb_in is not emb_out:
            forward -= emb_in.numel()
        return forward

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    # -- forwards ------------------------------------------------------------------------------
    def prefill(self, ids, positions, bias, cache: kv.SlotCache, layers, lengths: list[int], every: bool = False):
        """The prefill's forward over right-padded prompts ids (B, P) of ``lengths`` tokens -> (logits, features
        (B, P, F)): the logits of each row's last token (B, V), or with ``every`` of every position (B, P, V).

        With the direct steps (module docstring) the prompts' tokens go through the direct loop packed, one after
        another without padding, and only the last tokens' logits are computed; else through the modules, whose
        products skip the padding."""
        dev = self.device
        if not self.paged_problem:
            from distill.engine.cpu import paged

            if not every and self.direct is not None and self._direct_current():
                return self._direct_prefill(self.direct, ids, positions, cache, layers, lengths)
        keep = 0 if every else torch.tensor(sorted(set(n - 1 for n in lengths)), dtype=torch.long, device=dev)
        with valid_rows(lengths, ids.shape[1], dev, self.rowwise):
            if not self.paged_problem:
                plan = paged.plan(cache, lengths, [0] * len(lengths), self.heads, padded=True)
                logits, features = self.forward(ids, positions, bias, cache, keep, layers, paged=plan)
            else:
                logits, features = self.forward(ids, positions, bias, cache, keep, layers,
                                                chunks=plan_row_chunks(lengths, lengths))
        if every:
            return logits, features
        col = [keep.tolist().index(n - 1) for n in lengths]
        return logits[torch.arange(len(lengths), device=dev), torch.tensor(col, device=dev)], features

    def _direct_prefill(self, direct, ids, positions, cache: kv.SlotCache, layers, lengths: list[int]):
        """:meth:`prefill` through ``direct``: the prompts packed, their features back in padded rows (zeros after each)."""
        from distill.engine.cpu import paged

        B, P = ids.shape
        real, _ = _packing(lengths, P, self.device)  # (B, P)
        plan = paged.plan(cache, lengths, [0] * B, self.heads, padded=False)
        last = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        logits, packed = direct.packed(ids[real][None], positions[real][None], plan, layers, last)
        return logits.float(), _unpacked(packed, real)

    def _direct_step(self, tokens, positions, cache: kv.SlotCache, layers, ends: list[int], used: list[int] | None):
        """:meth:`step` through the direct loop; chains of uneven lengths (``used`` below T) go packed, each row's
        ``used`` tokens only, the filler after them never computed."""
        from distill.engine.cpu import paged

        B, T = tokens.shape
        if used is None or min(used) == T:
            plan = paged.plan(cache, [T] * B, ends, self.heads, padded=False)
            logits, features = self.direct.forward(tokens, positions, plan, layers)
            return logits.float(), features
        real, index = _packing(used, T, tokens.device)
        plan = paged.plan(cache, used, ends, self.heads, padded=False)
        logits, features = self.direct.forward(tokens[real][None], positions[real][None], plan, layers, index)
        return logits.float(), features

    def _direct_tree(self, tokens, positions, cache: kv.SlotCache, layers, ends: list[int], bias, chunks):
        """:meth:`step` of a branching tree through the direct loop: the keys and values written as in any direct step,
        the queries attending under the tree's ``bias`` with ``chunks`` as through the modules
        (:class:`~distill.engine.attention.Masked`)."""
        from distill.engine.cpu import paged

        B, T = tokens.shape
        plan = paged.plan(cache, [T] * B, ends, self.heads, padded=False,
                          masked=Masked(cache.keys, cache.values, bias, chunks))
        logits, features = self.direct.forward(tokens, positions, plan, layers)
        return logits.float(), features

    def mixes(self, T: int, chain: bool) -> bool:
        """Whether a step of T tokens a row (``chain``: chains) can prefill prompts in its own forward
        (:meth:`mixed_step`): it runs on the direct loop."""
        return (self.graphs is None and not self.paged_problem and (T == 1 or chain) and self.direct is not None
                and self._direct_current())

    def mixed_step(self, tokens, positions, cache: kv.SlotCache, layers, ends: list[int], used: list[int] | None,
                   prompts: list[list[int]]):
        """A direct step of the B running rows (:meth:`step` where :meth:`mixes`) that prefills ``prompts`` in the same
        forward: cache rows B .. B + J - 1 are theirs (slots from 0), their tokens packed after the running rows', each
        attending causally over its own. -> (the step's logits (B, T, V) float32 and features (B, T, F), the prompts'
        last tokens' logits (J, V) float32, their features (J, P, F) right-padded with zeros). The running rows read
        the weights once for both; only the prompts' last tokens reach the LM head."""
        from distill.engine.cpu import paged

        B, T = tokens.shape
        dev = tokens.device
        used = used if used is not None else [T] * B
        real, index = _packing(used, T, dev)  # the running rows' tokens
        lengths = [len(p) for p in prompts]
        run = sum(used)
        flat = torch.tensor([x for p in prompts for x in p], dtype=tokens.dtype, device=dev)
        P = max(lengths)
        in_prompt, _ = _packing(lengths, P, dev)  # (J, P)
        at = torch.arange(P, device=dev).expand(len(prompts), P)[in_prompt]  # each prompt token's position
        ids = torch.cat([tokens[real], flat])[None]
        pos = torch.cat([positions[real], at])[None]
        last = run + torch.tensor(lengths, device=dev).cumsum(0) - 1
        heads = torch.cat([torch.arange(run, device=dev), last])
        plan = paged.plan(cache, used + lengths, ends + [0] * len(prompts), self.heads, padded=False)
        logits, features = self.direct.packed(ids, pos, plan, layers, heads)
        logits = logits.float()
        return logits[:run][index], features[index], logits[run:], _unpacked(features[run:], in_prompt)

    def _direct_current(self) -> bool:
        """Whether the direct loop still applies (the model holds its modules, none hooked); else the modules compute
        from now on."""
        if self.direct.current():
            return True
        self.direct, self.direct_problem = None, "the model's modules changed, or gained hooks, after the engine was built"
        self.prep["direct_steps"] = 0
        return False

    def window(self, cache: kv.SlotCache, eager: int) -> int:
        """The slots a step attends to: ``eager`` (the longest row's end + tree size), or, graphed, every slot of the
        cache (a static shape: graphs.py, "static window")."""
        return cache.slots if self.graphs is not None else eager

    def step(self, tokens, positions, write, bias, cache: kv.SlotCache, layers, ends: list[int], chain: bool = False,
             used: list[int] | None = None):
        """A decoding step's forward: ``tokens`` written at slots ``write`` (B, T) -> (logits (B, T, V) float32,
        features); replayed from its graph bucket when graphs are on. ``bias``: a function that builds the attention
        bias (B or 1, 1, T, window), called only for a forward that reads it (the direct loop does not; an eager
        window is the longest row's end + T). ``ends``: the rows' committed lengths (host),
        so that an eager forward attends each run of rows over its own keys only. ``chain``: every row's tokens are a
        chain (each the parent of the next), which the kernel attention computes (module docstring); ``used``: of
        each row's chain, the first ``used[b]`` tokens are wanted (the rest filler): the direct loop computes only
        those, and the positions after them repeat the last one's logits and features."""
        if self.graphs is None:
            T = tokens.shape[1]
            cache.prepare(write, max(ends) + T)
            if not self.paged_problem and (T == 1 or chain):
                from distill.engine.cpu import paged

                if self.direct is not None and self._direct_current():
                    return self._direct_step(tokens, positions, cache, layers, ends, used)
                plan = paged.plan(cache, [T] * len(ends), ends, self.heads, padded=False)
                return self.forward(tokens, positions, bias(), cache, layers=layers, step=True, paged=plan)
            chunks = plan_row_chunks([T] * len(ends), [e + T for e in ends])
            if not self.paged_problem and self.direct is not None and self._direct_current():
                return self._direct_tree(tokens, positions, cache, layers, ends, bias(), chunks)
            return self.forward(tokens, positions, bias(), cache, layers=layers, step=True, chunks=chunks)

        def forward(ids, positions, write, bias):
            cache.prepare(write, cache.slots)
            return self.forward(ids, positions, bias, cache, layers=layers, step=True)

        return self.graphs(("step", cache_key(cache), tokens.shape[1], layers), forward, tokens, positions, write, bias())

    def forward(self, ids, positions, bias, cache: kv.SlotCache, keep: int | torch.Tensor = 0,
                layers: tuple[int, ...] | None = None, step: bool = False, chunks=None, paged=None):
        """ids/positions (B, T), bias (B or 1, 1, T, window) -> logits (B, T', V) float32, features (B, T, F).

        ``keep``: which positions get logits (0: all; a tensor: those indices, ``logits_to_keep``).
        ``layers``: None, the features are the hidden state; layer ids, the hidden states entering
        those decoder layers, concatenated. ``step``: a decoding step's forward, compiled under
        ``EngineConfig.compile`` (module docstring, "compiled steps"). ``chunks``: the eager attention's
        row chunks (:func:`distill.engine.attention.plan_row_chunks`; a compiled forward attends over the whole window);
        ``paged``: its plan on vLLM's kernel instead (module docstring, "kernel attention").
        """
        if self._compiled is not None and step and (self._compile_all or (layers is None and ids.numel() == 1)):
            for storage in (cache.keys, cache.values):  # the slots grow with the sequences: one graph for every capacity
                torch._dynamo.maybe_mark_dynamic(storage, 3)
            out = self._compiled(input_ids=ids, position_ids=positions, attention_mask=bias, past_key_values=cache,
                                 use_cache=True, logits_to_keep=keep)
            self.compiled_forwards += 1
            hidden = self._kept.pop("hidden")
            return out.logits.float(), hidden if layers is None else torch.cat([self._kept.pop(i) for i in layers], dim=-1)
        captured: dict = {}

        def grab(module, args, output):
            captured["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

        def entering(i):
            def hook(module, args, kwargs):
                captured[i] = args[0] if args else kwargs["hidden_states"]
            return hook

        if layers is None:
            handles = [self.decoder.register_forward_hook(grab)]
        else:
            handles = [self.decoder.layers[i].register_forward_pre_hook(entering(i), with_kwargs=True) for i in layers]
        try:
            extra = {"row_chunks": chunks} if chunks is not None else {"paged": paged} if paged is not None else {}
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=bias, past_key_values=cache,
                             use_cache=True, logits_to_keep=keep, **extra)
        finally:
            for h in handles:
                h.remove()
        self._kept.clear()  # the compile hooks' copies of an eager forward's states
        features = captured["hidden"] if layers is None else torch.cat([captured[i] for i in layers], dim=-1)
        return out.logits.float(), features


__all__ = ["Target"]
