"""When to speculate, and with how big a tree, for a given batch size.

Terms
-----
step cost ``c(m) + h``
    time of one forward over ``m`` new tokens (the whole batch's tree tokens),
    relative to a one-token forward: ``c(m) = 1 + r·(m − 1)``. ``r`` (the step cost
    ratio) is what each extra token costs: near 0 while a forward is bound by reading
    the weights (small batches on a GPU), larger on a CPU, where compute dominates early.
    ``h`` (proposal cost) is the heads' share: the weights the heads read (residual
    blocks and LM heads of the heads the tree uses) over the weights one forward reads;
    heads with their own LM heads on a small model cost a good part of a forward.
expected tokens per step ``τ(n)``
    for the n most probable nodes of the tree under its accuracy table:
    ``1 + Σ_path Π acc`` (:func:`distill.heads.tree.expected_acceptance_length`).
throughput
    tokens per unit time for one sequence of a batch of B: ``τ(n) / (c(B·(n + 1)) + h(n))``;
    plain decoding is ``n = 0``, ``τ = 1``.
policy
    speculation is off above ``speculate_max_batch`` (when set); otherwise the tree
    size with the highest throughput wins, among the full tree and its prefixes of
    half, a quarter, ... of the nodes; plain decoding when none beats it.
"""

from __future__ import annotations

from typing import Sequence

#: Default step cost ratios r by device type. CPU: measured for SmolLM2-135M float32 on the shared 2-core x86
#: development machine (bench/bench_engine_smoke.py --cost, 1 thread: 73 ms for 1 token, 109 ms for 8, 182 ms for 16,
#: 345 ms for 32 after a 128-token context; r = 0.07-0.10); CUDA: a figure for a memory-bound forward (assumption).
DEFAULT_COST_RATIO = {"cpu": 0.08, "cuda": 0.002}


def candidate_sizes(nodes: int) -> list[int]:
    """The tree sizes the policy chooses among: n, n/2, n/4, ..., 1 (and 0 = plain)."""
    sizes, n = [], nodes
    while n >= 1:
        sizes.append(n)
        n //= 2
    return sizes + [0]


def choose_tree_size(
    batch: int,
    taus: dict[int, float],
    cost_ratio: float,
    speculate_max_batch: int | None = None,
    proposal_cost: dict[int, float] | None = None,
) -> int:
    """The tree size (0 = plain decoding) with the best throughput for ``batch`` sequences.

    ``taus`` maps candidate tree sizes to their expected tokens per step (size 0 need not be
    given); ``proposal_cost`` maps them to ``h`` (default 0).
    """
    if speculate_max_batch is not None and batch > speculate_max_batch:
        return 0
    best, best_rate = 0, 1.0 / (1.0 + cost_ratio * (batch - 1))
    for n in sorted(taus):
        if n <= 0:
            continue
        h = (proposal_cost or {}).get(n, 0.0)
        rate = taus[n] / (1.0 + cost_ratio * (batch * (n + 1) - 1) + h)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = n, rate
    return best


def taus_for(paths: Sequence[tuple[int, ...]], accuracy: Sequence[Sequence[float]]) -> dict[int, float]:
    """Expected tokens per step for every candidate size of a tree (see :func:`candidate_sizes`)."""
    from distill.engine.tree import subtree
    from distill.heads.tree import expected_acceptance_length

    return {n: expected_acceptance_length(subtree(paths, accuracy, n), accuracy) for n in candidate_sizes(len(paths)) if n}
