"""What a decoding step costs on this model and machine: tree steps timed, and the policy's step-cost curve.

:func:`time_tree_steps` times one step per tree size the way the engine runs it: a context of
``context`` tokens prefilled into a slot cache, then for each size a forward of the tree's
tokens with its attention mask and per-depth positions, logits for every token, written after
the context (the next size overwrites them). Sizes are timed round-robin after one untimed
round, so that machine noise spreads over all of them, and the median of ``repeats`` rounds is
kept. ``distill bench --sweep-tree`` times Medusa's trees with it, heads included.

:func:`measure_step_costs` times the engine's own steps (:meth:`~distill.engine.target.Target.step`,
the path a step of that shape takes: on a CPU, a plain step or a chain on vLLM's attention kernel
and the direct loop, a branching tree on the direct loop under its mask) of 1, 2, 3, 5, 9, ... new tokens, as
the proposer drafts them (one chain, or a root and its children), and returns the
:class:`~distill.engine.policy.StepCosts` curve the policy prices trees with. The engine measures
it when it starts on a CPU with a proposer, since a CPU's curve is far from the line
``1 + r·(m − 1)`` (flat over the first rows while the products read each weight once, then steep),
and priced by the line the policy drafts fewer nodes than pay. Timed on the model alone (outside the
engine's step paths) the plain step came out dearer than the engine's, and trees looked cheaper
than they are against it.
Measured: BENCHMARKS.md, "Step costs and the speculation policy".

:func:`step_costs` is what the engine calls: the curve is a property of the machine, the model's
shapes and how its forwards run, not of one run, so it is kept under ``$DISTILL_HOME/step-costs``
(one JSON file per :func:`cost_key`) and timed again only where the key changes, as compilers
keep their autotuning results. Timing it costs seconds of every start with a proposer (many
more for a full batch of large trees on a busy machine), so ``distill serve`` and
``distill bench`` start that much sooner the second time.
Delete the folder (or pass ``cached_costs=False``) to time it again.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from distill.engine.kept import kept
from distill.engine.policy import StepCosts, candidate_sizes

#: Context (tokens) before the timed steps (a prompt and part of its reply: a tree's attention grows with it), timed
#: rounds (the median of 5), and rows timed at most (beyond them the curve goes on with its last slope).
COST_CONTEXT, COST_REPEATS, MAX_COST_ROWS = 256, 5, 65


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def time_tree_steps(model, heads, trees: dict[int, list[tuple[int, ...]]], context: int, repeats: int, seed: int = 0) -> dict[int, float]:
    """Median seconds of one decoding step per tree size (0 = plain), see the module docstring.

    ``heads``: Medusa heads whose top-k proposal is timed with each tree (None: the context's
    last tokens stand in for the tree's, nothing proposed).
    """
    return {n: statistics.median(ts) for n, ts in tree_step_rounds(model, heads, trees, context, repeats, seed).items()}


@torch.inference_mode()
def tree_step_rounds(model, heads, trees: dict[int, list[tuple[int, ...]]], context: int, repeats: int,
                     seed: int = 0) -> dict[int, list[float]]:
    """Seconds of one decoding step per tree size, one entry per timed round (see :func:`time_tree_steps`)."""
    from distill.engine.cache import KVShape, SlotCache, attention_bias, prefill_allowed, step_allowed
    from distill.engine.tree import build_buffers

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    sync = _sync(device)
    vocab = model.get_output_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(seed)
    buffers = {n: build_buffers(paths).to(device) for n, paths in trees.items()}
    context = max(context, max(b.size for b in buffers.values()))  # the tree's stand-in tokens come from it
    ctx = torch.randint(0, vocab, (1, context), generator=gen).to(device)  # (1, C)
    cache = SlotCache(KVShape.of(model), 1, context + max(b.size for b in buffers.values()))
    slots = torch.arange(context, device=device)[None]  # (1, C)
    cache.prepare(slots, context)
    out = model(input_ids=ctx, position_ids=slots, attention_mask=attention_bias(prefill_allowed(context, device), dtype),
                past_key_values=cache, use_cache=True, output_hidden_states=True, logits_to_keep=1)
    hidden = out.hidden_states[-1][:, -1]  # (1, H)
    end = torch.tensor([context], device=device)  # (1,)

    def step(buf) -> None:
        if buf.nodes and heads is not None:
            tops = [heads.head_logits(hidden, k).topk(buf.max_rank, dim=-1).indices for k in range(buf.num_heads_used)]
            tokens = torch.cat(tops, dim=-1)[:, buf.cand_index]  # (1, T)
        else:
            tokens = ctx[:, -buf.size:]  # (1, T)
        positions = context + buf.depth[None]  # (1, T)
        cache.prepare(context + torch.arange(buf.size, device=device)[None], context + buf.size)  # the tree after the context
        mask = attention_bias(step_allowed(end, buf.mask, context + buf.size), dtype)  # (1, 1, T, C + T)
        model(input_ids=tokens, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True)

    return _rounds(buffers, step, repeats, sync)


def _rounds(buffers: dict, step: Callable, repeats: int, sync: Callable[[], None]) -> dict[int, list[float]]:
    """Seconds of ``step(buffer)`` per tree, ``repeats`` timed rounds over all of them in turn after one untimed round
    (it warms up kernels and allocators), so that machine noise spreads over every size."""
    times: dict[int, list[float]] = {n: [] for n in buffers}
    for rnd in range(repeats + 1):
        for n, buf in buffers.items():
            sync()
            t0 = time.perf_counter()
            step(buf)
            sync()
            elapsed = time.perf_counter() - t0
            if rnd:
                times[n].append(elapsed)
    return times


@torch.inference_mode()
def target_step_rounds(target, trees: dict[int, list[tuple[int, ...]]], chains: bool, context: int, repeats: int,
                       seed: int = 0) -> dict[int, list[float]]:
    """Seconds of one :meth:`~distill.engine.target.Target.step` of one sequence per tree (by node count), one entry
    per timed round: a cache of ``context`` filled slots (random keys and values: a step's time does not depend on
    them), the tree's tokens written after them, its mask built inside the timed step as the engine builds it.
    ``chains``: the trees are chains, verified as the engine verifies chains. Rounds as in :func:`tree_step_rounds`."""
    from distill.engine import cache as kv
    from distill.engine.tree import build_buffers

    device = target.device
    sync = _sync(device)
    gen = torch.Generator().manual_seed(seed)
    buffers = {n: build_buffers(paths).to(device) for n, paths in trees.items()}
    top = max(b.size for b in buffers.values())
    cache = target.new_cache(1, context + top)
    for storage in (cache.keys, cache.values):
        storage.copy_(torch.randn(storage.shape, generator=gen, dtype=storage.dtype))
    tokens = torch.randint(0, target.vocab_size, (1, top), generator=gen).to(device)
    ends = [context]
    end = torch.tensor(ends, device=device)  # (1,)

    def step(buf) -> None:
        T = buf.size
        write = end[:, None] + torch.arange(T, device=device)[None]  # (1, T)

        def bias():
            return kv.attention_bias(kv.step_allowed(end, buf.mask, target.window(cache, context + T)), target.dtype)

        target.step(tokens[:, :T], end[:, None] + buf.depth, write, bias, cache, None, ends, chains and T > 1)

    return _rounds(buffers, step, repeats, sync)


def measure_step_costs(target, max_nodes: int, max_batch: int = 1, chains: bool = False, context: int = COST_CONTEXT,
                       repeats: int = COST_REPEATS) -> StepCosts:
    """The step-cost curve of ``target`` (a :class:`~distill.engine.target.Target`): rows n + 1 for the policy's
    candidate sizes up to ``max_nodes``, and 2^k + 1 rows up to what a full batch of ``max_batch`` trees takes (at most
    :data:`MAX_COST_ROWS`).

    Each size is one sequence's step of n + 1 tokens: a chain where the proposer drafts chains (``chains``), else a
    root with n children (a star: the products, which grow with the rows, are a tree's; its mask's shape does not
    change them). A size's cost is the median over rounds of its time over the plain step's time in the same round:
    a shared machine's speed drifts between rounds, much less within one.
    """
    trees = cost_trees(max_nodes, max_batch, chains)
    rounds = target_step_rounds(target, trees, chains, context, repeats)
    return StepCosts({n + 1: statistics.median(t / t0 for t, t0 in zip(rounds[n], rounds[0])) for n in trees})


def cost_trees(max_nodes: int, max_batch: int, chains: bool = False) -> dict[int, list[tuple[int, ...]]]:
    """The trees :func:`measure_step_costs` times, by node count (0: the plain step): chains, or stars."""
    top = min(max(max_nodes + 1, max_batch * (max_nodes + 1)), MAX_COST_ROWS)
    sizes = {n for n in candidate_sizes(max_nodes) if n} | {2**k for k in range(1, 8) if 2**k + 1 <= top}
    if chains:
        return {0: []} | {n: [(0,) * (d + 1) for d in range(n)] for n in sorted(sizes)}
    return {0: []} | {n: [(i,) for i in range(n)] for n in sorted(sizes)}


#: Bumped when what :func:`measure_step_costs` times changes: every kept curve is then timed again.
COST_CACHE_VERSION = 3


def cost_key(model, max_nodes: int, max_batch: int, setup: dict | None = None, context: int = COST_CONTEXT,
             repeats: int = COST_REPEATS, chains: bool = False) -> dict:
    """What a measured curve depends on: the machine (CPU model or GPU name, torch's threads), torch, the model's
    shapes and dtype, how its forwards run (``setup``: the engine's prepared kernels, compilation, the attention and
    step paths), the shape of the trees (``chains``) and the rows timed. The weights' values are not in it: a forward
    costs the same whatever they are."""
    from distill.runtime import cpu_info

    param = next(model.parameters())
    config = {k: v for k, v in model.config.to_dict().items()
              if not k.startswith("_") and k not in ("transformers_version", "name_or_path", "architectures")}
    device = torch.cuda.get_device_name(param.device) if param.device.type == "cuda" else cpu_info().model
    return {"version": COST_CACHE_VERSION, "device": f"{param.device.type}: {device}", "threads": torch.get_num_threads(),
            "torch": torch.__version__, "dtype": str(param.dtype), "model": config, "setup": setup or {},
            "rows": sorted(n + 1 for n in cost_trees(max_nodes, max_batch)), "shape": "chain" if chains else "tree",
            "context": context, "repeats": repeats}


def forward_setup(model) -> dict[str, int]:
    """How ``model``'s forwards run, read from its modules as they are now (a model prepared by an earlier engine
    reads the same): its linears by kernel (torch's, oneDNN's or vLLM's packed copy; fused with others or not) and
    the modules the CPU kernels put in place of the model's own (engine.cpu). Not the single-row kernels: each is
    whichever timed fastest at start, and they flip on noise. Reads the modules' classes only, so the GPU path does
    not import the CPU kernels."""
    from collections import Counter

    from torch import nn

    kinds: Counter[str] = Counter()
    for m in model.modules():
        kernel = type(m).__module__.startswith("distill.engine.cpu.")
        if kernel and isinstance(m, nn.Linear):
            kinds[f"linear {m.kind}{' fused' if m.fused is not None else ''}"] += 1
        elif isinstance(m, nn.Linear):
            kinds["linear torch"] += 1
        elif kernel:
            kinds[f"{type(m.original).__name__} on a kernel"] += 1
    return dict(sorted(kinds.items()))


def step_costs(target, max_nodes: int, max_batch: int = 1, setup: dict | None = None, cache: Path | None = None,
               chains: bool = False, context: int = COST_CONTEXT, repeats: int = COST_REPEATS) -> StepCosts:
    """:func:`measure_step_costs` of ``target``, kept in ``cache`` (a folder; None: timed every call) under its
    :func:`cost_key`.

    A kept file that cannot be read, or whose key differs, is timed again and replaced (engine.kept).
    """
    key = cost_key(target.model, max_nodes, max_batch, setup, context, repeats, chains)

    def measure() -> dict:
        curve = measure_step_costs(target, max_nodes, max_batch, chains, context, repeats)
        return {"points": {str(m): c for m, c in curve.points.items()}}

    doc, source = kept(cache, key, measure)
    return StepCosts({int(m): float(c) for m, c in doc["points"].items()}, source=source)
