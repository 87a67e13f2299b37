"""Tree size chosen for the hardware: step latency against tree size, and the node budget that maximizes speedup.

Method
------
1. Prefill ``context`` tokens into the engine's slot cache (a realistic KV length for the
   attention part of a step).
2. For every tree size N (0 = plain decoding) time one decoding step: the heads'
   top-I proposal from one hidden state (N > 0), then one forward of the N + 1 tree
   tokens with the tree attention mask and per-depth position ids, logits for every
   tree token, written at the slots after the context (the next step overwrites them). Sizes are timed
   round-robin (so machine noise spreads evenly over them), after one untimed round,
   and the median of ``repeats`` rounds is kept.
3. ``overhead(N) = t(N) / t(0)``; ``tau(N)`` = expected acceptance length of the
   greedy sparse tree of N nodes under the accuracy table
   (:func:`distill.heads.tree.sparse_tree`, :func:`~distill.heads.tree.expected_acceptance_length`);
   ``predicted speedup(N) = tau(N) / overhead(N)``; the best N wins.
4. ``step_cost_ratio`` is the least-squares ``r`` of ``overhead(N) = 1 + r·N``: the
   engine's cost model (:mod:`distill.engine.policy`) takes it as ``EngineConfig.step_cost_ratio``.

The acceptance side is the calibrated head accuracies (``distill calibrate`` on
held-out data), so the prediction assumes head events are independent; ``distill
bench`` measures the real acceleration rate next to it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from distill.bench.stats import Sweep, SweepPoint
from distill.engine.costs import time_tree_steps
from distill.heads.tree import expected_acceptance_length, sparse_tree


def max_nodes(accuracy: Sequence[Sequence[float]]) -> int:
    k, ranks = len(accuracy), len(accuracy[0])
    return sum(ranks**d for d in range(1, k + 1))


def sweep_tree_sizes(
    model,
    heads,
    accuracy: Sequence[Sequence[float]],
    nodes: Sequence[int],
    context: int,
    repeats: int,
    accuracy_source: str,
) -> Sweep:
    """Time steps for every size in ``nodes`` (capped by what the heads allow) and pick the best budget."""
    cap = max_nodes(accuracy)
    sizes = sorted({min(int(n), cap) for n in nodes if n >= 1})
    trees = {0: []} | {n: sparse_tree(accuracy, n) for n in sizes}
    secs = time_tree_steps(model, heads, trees, context, repeats)
    base = secs[0]
    points = []
    for n in [0] + sizes:
        tau = expected_acceptance_length(trees[n], accuracy) if n else 1.0
        overhead = secs[n] / base
        points.append(SweepPoint(nodes=n, tokens=n + 1, seconds=secs[n], overhead=overhead,
                                 expected_acceptance_length=tau, predicted_speedup=tau / overhead))
    best = max(points, key=lambda p: (p.predicted_speedup, -p.nodes))
    num = sum(p.nodes * (p.overhead - 1) for p in points)
    den = sum(p.nodes**2 for p in points)
    device = next(model.parameters()).device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    return Sweep(context=context, repeats=repeats, accuracy_source=accuracy_source, accuracy=[list(map(float, r)) for r in accuracy],
                 points=points, best_nodes=best.nodes, best_predicted_speedup=best.predicted_speedup,
                 step_cost_ratio=max(num / den, 0.0) if den else 0.0, device=name)
