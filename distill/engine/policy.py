"""When to speculate, and with how big a tree, for a given batch size.

Terms
-----
step cost ``c(m) + h``
    time of one forward over ``m`` new tokens (the whole batch's tree tokens),
    relative to a one-token forward. Either measured (:class:`StepCosts`: forwards of
    1, 2, 3, 5, 9, ... rows timed on this model and machine when the engine starts,
    linear between the points, the last slope beyond them) or the straight line
    ``c(m) = 1 + r·(m − 1)``. ``r`` (the step cost ratio) is what each extra token costs:
    near 0 while a forward is bound by reading the weights (small batches on a GPU),
    larger where compute dominates. A CPU's curve is not a line: a forward of a few rows
    costs little more than one of a single row, as vectorized products read each weight
    once for a few rows, and the curve steepens beyond them.
    Measured: BENCHMARKS.md, "Step costs and the speculation policy".
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
node budget
    a proposer whose nodes each carry their odds (the lookup's chains) is priced node by node
    instead (:class:`TokenBudget`): the step keeps the batch's most likely nodes, as many as
    raise the expected tokens per second of a step of ``B`` rows and ``B + k`` tokens.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from typing import Sequence

#: Default step cost ratios r by device type, used where no curve is measured. CPU: the line fitted to the bundled
#: model's float32 forwards of 1 to 32 tokens on one thread. CUDA: a figure for a memory-bound forward; a GPU's tree
#: step has a fixed cost over a plain one plus a small cost per node, which this line cannot fit, so the adaptive
#: policy corrects it from measured step times.
#: Measured: BENCHMARKS.md, "Step costs and the speculation policy".
DEFAULT_COST_RATIO = {"cpu": 0.08, "cuda": 0.002}


class StepCosts:
    """A measured step-cost curve ``c(m)``: a forward of ``m`` rows over a one-row forward.

    ``points`` maps row counts to measured ratios (1 row: 1.0). A forward of more rows does a
    forward of fewer rows' work and more, so the measured ratios are first made non-decreasing
    (pooled where timing noise put a dip: the isotonic fit, each pool at its mean). Between two
    points the curve is the straight line through them; beyond the last, the slope of the last
    two. ``source``: the file it was read from, when it was kept from an earlier run (None: timed now).
    """

    def __init__(self, points: dict[int, float], source: str | None = None):
        self.source = source
        if 1 not in points or any(m < 1 for m in points):
            raise ValueError(f"a step-cost curve needs the 1-row point and row counts >= 1; got {sorted(points)}")
        rows = sorted(points)
        self.points = dict(zip(rows, isotonic([1.0] + [max(float(points[m]), 1.0) for m in rows[1:]])))

    def __call__(self, rows: int) -> float:
        ms = list(self.points)
        if rows <= 1:
            return 1.0
        if rows in self.points:
            return self.points[rows]
        upper = next((m for m in ms if m > rows), None)
        if upper is None:  # beyond the last point: its slope goes on
            if len(ms) == 1:
                return 1.0
            a, b = ms[-2], ms[-1]
        else:
            a, b = ms[ms.index(upper) - 1], upper
        slope = max((self.points[b] - self.points[a]) / (b - a), 0.0)
        return self.points[a] + slope * (rows - a)

    def to_dict(self) -> dict[str, float]:
        return {str(m): round(c, 4) for m, c in self.points.items()}

    def __repr__(self) -> str:
        return f"StepCosts({self.points})"


def isotonic(values: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """The non-decreasing sequence nearest ``values`` (weighted least squares): adjacent values that fall are
    pooled to their weighted mean (pool adjacent violators). Step times: more tokens never cost less, so a
    dip is timing noise."""
    pools: list[list[float]] = []  # [weighted sum, weight, values pooled]
    for v, w in zip(values, weights if weights is not None else [1.0] * len(values)):
        pools.append([v * w, w, 1])
        while len(pools) > 1 and pools[-2][0] * pools[-1][1] > pools[-1][0] * pools[-2][1]:
            total, weight, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += weight
            pools[-1][2] += count
    return [total / weight for total, weight, count in pools for _ in range(count)]


def forward_cost(rows: int, cost: float | StepCosts) -> float:
    """``c(rows)``: the measured curve, or ``1 + r·(rows − 1)`` for a step cost ratio ``r``."""
    if isinstance(cost, StepCosts):
        return cost(rows)
    return 1.0 + cost * (rows - 1)


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
    cost_ratio: float | StepCosts,
    speculate_max_batch: int | None = None,
    proposal_cost: dict[int, float] | None = None,
) -> int:
    """The tree size (0 = plain decoding) with the best throughput for ``batch`` sequences.

    ``taus`` maps candidate tree sizes to their expected tokens per step (size 0 need not be
    given); ``proposal_cost`` maps them to ``h`` (default 0); ``cost_ratio`` is the cost
    model (:func:`step_cost`).
    """
    if speculate_max_batch is not None and batch > speculate_max_batch:
        return 0
    best, best_rate = 0, 1.0 / step_cost(batch, 0, cost_ratio)
    for n in sorted(taus):
        if n <= 0:
            continue
        rate = taus[n] / step_cost(batch, n, cost_ratio, proposal_cost)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = n, rate
    return best


def step_cost(batch: int, nodes: int, cost_ratio: float | StepCosts, proposal_cost: dict[int, float] | None = None) -> float:
    """``c(B·(n + 1)) + h(n)``: one step of a tree of ``nodes`` nodes for ``batch`` sequences, relative to a one-token forward.

    ``cost_ratio``: the line's ``r``, or a measured :class:`StepCosts` curve.
    """
    if nodes <= 0:
        return forward_cost(batch, cost_ratio)
    return forward_cost(batch * (nodes + 1), cost_ratio) + (proposal_cost or {}).get(nodes, 0.0)


def taus_for(paths: Sequence[tuple[int, ...]], accuracy: Sequence[Sequence[float]]) -> dict[int, float]:
    """Expected tokens per step for every candidate size of a tree (see :func:`candidate_sizes`)."""
    from distill.engine.tree import subtree
    from distill.heads.tree import expected_acceptance_length

    return {n: expected_acceptance_length(subtree(paths, accuracy, n), accuracy) for n in candidate_sizes(len(paths)) if n}


class StepTimes:
    """Each key's last ``window`` step times and their median; a key's first ``skip`` steps are not kept.

    What the policies price from (:class:`AdaptivePolicy` by batch and tree size, :class:`TokenBudget` by batch size and
    tokens): a median, as a busy server's steps have outliers (a join's allocations, the HTTP thread's turns) that an
    average would keep for as long as a key is measured rarely."""

    def __init__(self, window: int, skip: int = 0):
        self.window = window
        self.skip = skip
        self._times: dict = {}  # key -> its last `window` kept step seconds
        self._seen: dict = {}  # key -> steps observed (kept or not)

    def add(self, key, seconds: float) -> float | None:
        """One step's seconds -> the key's median now, or None for a step not kept."""
        seen = self._seen.get(key, 0)
        self._seen[key] = seen + 1
        if seen < self.skip:
            return None
        times = self._times.setdefault(key, deque(maxlen=self.window))
        times.append(seconds)
        return statistics.median(times)

    def count(self, key) -> int:
        """How many step times the key's median rests on."""
        return len(self._times.get(key, ()))

    def seen(self) -> list:
        """The keys observed so far."""
        return list(self._seen)


class AdaptivePolicy:
    """The tree size per batch size, corrected by what the engine measures while it serves.

    The static policy (:func:`choose_tree_size`) trusts two predictions: the calibrated τ
    (from held-out data, which may not look like the traffic) and the cost model (``r``,
    ``h``: a straight line through a sweep). This one replaces both by measurements as they
    come, and starts from them:

    measured acceptance ``ρ``
        Σ accepted candidates / Σ (τ(n) − 1) over the sequence-steps that used a tree of n
        nodes, each sum starting at ``prior`` pseudo-tokens (ρ = 1) and decaying with a
        half-life of ``halflife`` sequence-steps; the τ used is ``1 + ρ·(τ(n) − 1)``.
        Acceptance does not depend on the batch size, so one ρ serves all of them.
    measured step cost
        per (batch size, tree size): the median of its last ``window`` steps' wall seconds
        (:class:`StepTimes`), the first step of each pair skipped (buffers are built then). A pair not
        measured yet is predicted from a measured pair of the same batch size through the
        cost model's ratio; the cost model alone while none is.
    choice
        the size with the most tokens per second, ``τ(n) / cost(B, n)``, plain decoding included.
    margin
        a choice made on measured step times picks a tree only if it promises ``min_gain``
        (default 3%) more tokens per second than plain decoding: a busy machine's step times
        vary by more than that, and a small tree can cost about what a plain step does.
    probe
        when plain decoding wins at B but the calibrated prediction says a tree would, every
        ``probe_every``-th step at B runs that tree anyway, so that ρ and the tree's cost are
        measured again (traffic changes); it costs at most 1/``probe_every`` of a tree step's
        extra time.
    plain probe
        when a tree wins at B, plain decoding's cost there is measured, not predicted: a tree step
        measured against a plain step the cost model only predicts (the model's ratio of the two
        can be far from this machine's, a drafter's passes and a busy server's steps included)
        keeps a tree that loses. So the first steps at a batch size run plain until its cost is
        measured, and every ``plain_probe_every``-th step at B runs plain again; that costs a
        tree's extra tokens once in that many steps.
    """

    def __init__(
        self,
        taus: dict[int, float],
        cost_ratio: float | StepCosts,
        proposal_cost: dict[int, float] | None = None,
        *,
        prior: float = 8.0,
        halflife: float = 512.0,
        window: int = 9,
        probe_every: int = 32,
        plain_probe_every: int = 128,
        min_gain: float = 0.03,
    ):
        self.taus = dict(taus)
        self.cost_ratio = cost_ratio
        self.proposal_cost = dict(proposal_cost or {})
        self.sizes = sorted({0, *self.taus})
        self.probe_every = probe_every
        self.plain_probe_every = plain_probe_every
        self.min_gain = min_gain
        self._decay = 0.5 ** (1.0 / halflife)
        self._prior = prior
        self._accepted = prior  # Σ accepted candidates (decayed), pseudo-tokens included
        self._predicted = prior  # Σ (τ(n) − 1) of the same steps
        self._cost: dict[tuple[int, int], float] = {}  # (batch, nodes) -> median step seconds of the window
        self.step_times = StepTimes(window, skip=1)  # by (batch, nodes)
        self._steps: dict[int, int] = {}  # steps decided per batch size (probe clock)

    def retable(self, taus: dict[int, float], proposal_cost: dict[int, float] | None = None) -> None:
        """New calibrated tables (a union's shares moved with its parts' measured acceptance): ρ starts again from the
        prior, as it measured against the old table; the measured step times stay (each size's moves on)."""
        self.taus = dict(taus)
        self.proposal_cost = dict(proposal_cost or {})
        self.sizes = sorted({0, *self.taus})
        self._accepted = self._predicted = self._prior

    # -- predictions ---------------------------------------------------------------------------
    @property
    def acceptance_ratio(self) -> float:
        """ρ: measured / calibrated accepted candidates per sequence-step."""
        return self._accepted / self._predicted if self._predicted > 0 else 1.0

    def tau(self, nodes: int) -> float:
        """Expected tokens per step of ``nodes`` nodes, the calibrated extra scaled by ρ."""
        return 1.0 + self.acceptance_ratio * (self.taus[nodes] - 1.0) if nodes > 0 else 1.0

    def model_cost(self, batch: int, nodes: int) -> float:
        """The cost model's :func:`step_cost`."""
        return step_cost(batch, nodes, self.cost_ratio, self.proposal_cost)

    def cost(self, batch: int, nodes: int) -> float:
        """Measured seconds of a step, or its prediction in the same unit (see the class docstring).

        A tree step does a plain step's work and more, so it never counts as cheaper than the
        plain step at the same batch: where the two cost about the same (a small tree on a
        memory-bound CPU), noise in the measurements would otherwise pick a tree that gains nothing.
        """
        own = self._own_cost(batch, nodes)
        return max(own, self._own_cost(batch, 0)) if nodes > 0 else own

    def _own_cost(self, batch: int, nodes: int) -> float:
        if (batch, nodes) in self._cost:
            return self._cost[(batch, nodes)]
        anchors = [n for n in self.sizes if (batch, n) in self._cost]
        if not anchors:
            return self.model_cost(batch, nodes)
        anchor = min(anchors, key=lambda n: abs(n - nodes))  # the nearest measured size scales the model
        return self._cost[(batch, anchor)] * self.model_cost(batch, nodes) / self.model_cost(batch, anchor)

    def best(self, batch: int, measured: bool = True) -> int:
        """The size with the most tokens per second (0 = plain); ``measured=False``: the calibrated, static choice."""
        if not measured:
            return choose_tree_size(batch, self.taus, self.cost_ratio, None, self.proposal_cost)
        # on measured step times a tree must promise min_gain over plain decoding: a smaller gain is within their noise
        measured_here = any(b == batch for b, _ in self._cost)
        best, best_rate = 0, (1.0 + (self.min_gain if measured_here else 0.0)) / self.cost(batch, 0)
        for n in self.sizes:
            if n > 0 and (rate := self.tau(n) / self.cost(batch, n)) > best_rate * (1 + 1e-9):
                best, best_rate = n, rate
        return best

    # -- the engine's calls ----------------------------------------------------------------------
    def next_size(self, batch: int) -> int:
        """The size for the next step at ``batch`` (advances the probe clock)."""
        k = self._steps.get(batch, 0)
        self._steps[batch] = k + 1
        choice = self.best(batch)
        if choice == 0:
            if self.probe_every and k % self.probe_every == self.probe_every - 1:
                return self.best(batch, measured=False)
            return 0
        if (batch, 0) not in self._cost or (self.plain_probe_every and k % self.plain_probe_every == self.plain_probe_every - 1):
            return 0  # the plain probe (class docstring)
        return choice

    def observe(self, batch: int, nodes: int, seconds: float, accepted: Sequence[int]) -> None:
        """One step: its size, wall seconds, and each sequence's accepted candidates (bonus token excluded)."""
        if (median := self.step_times.add((batch, nodes), seconds)) is not None:
            self._cost[batch, nodes] = median
        if nodes > 0:
            predicted = self.taus[nodes] - 1.0
            for a in accepted:
                self._accepted = self._accepted * self._decay + a
                self._predicted = self._predicted * self._decay + predicted


class TokenBudget:
    """Each row's drafted nodes for a step, priced node by node (module docstring, "node budget").

    ``lengths(B, values)``: ``values[b]`` are row b's nodes' expected accepted tokens (non-increasing along its chain);
    the step keeps the ``k`` most valuable nodes of the batch (ties to the shallower), for the ``k`` with the most
    tokens per second, ``(B + Σ values) / cost(B, B + k)``, ``k = 0`` (plain decoding) included.

    cost
        ``cost(B, M)``: a step of ``B`` rows and ``M`` tokens. The cost model's ``c(M)`` (a measured curve times
        forwards of ``M`` tokens); with ``adaptive``, the median of the last ``window`` measured steps of the same
        ``(B, M)`` where there are some, made non-decreasing in ``M`` (:func:`isotonic`, weighted by the steps
        each median rests on: a noisy plain median pools with the drafting steps measured beside it instead of
        pricing every drafted token as free); between two measured counts at ``B``, the line through them; beyond them,
        the nearest scaled by ``c(M) / c(M')``, and above the largest at least the line through the last two (a
        CPU's products cost steps in ``M`` that a curve of a few points misses). A step with nodes never costs less
        than the plain step at ``B``, and on measured times it must promise ``min_gain`` more than plain decoding.
    plain probe
        with ``adaptive``, the first steps at a batch size run plain until its cost is measured, and every
        ``plain_probe_every``-th step there runs plain again (:meth:`speculates`), often enough that the plain
        median is measured in the same minute as the drafting steps it is compared with: a shared machine's
        speed drifts by more than the gains at stake.
    idle
        where the last ``idle_after`` steps at a batch size kept no node, only every ``probe_every``-th step there
        drafts (and is priced) until one keeps some: drafting every row to keep nothing costs a large batch's step
        a few percent.
    """

    def __init__(self, cost_ratio: float | StepCosts, adaptive: bool = True, *, window: int = 9,
                 plain_probe_every: int = 32, min_gain: float = 0.03, idle_after: int = 8, probe_every: int = 8):
        self.cost_ratio = cost_ratio
        self.adaptive = adaptive
        self.plain_probe_every = plain_probe_every
        self.min_gain = min_gain
        self.idle_after = idle_after
        self.probe_every = probe_every
        self._idle: dict[int, int] = {}  # per batch size: steps in a row that kept no node
        self.step_times = StepTimes(window)  # by (batch, tokens)
        self._medians: dict[int, dict[int, float]] = {}  # batch -> tokens -> the median of their window
        self._cost: dict[int, dict[int, float]] = {}  # batch -> tokens -> the medians' isotonic fit
        self._anchors: dict[int, list[int]] = {}  # batch -> its measured token counts, ascending
        self._steps: dict[int, int] = {}  # steps decided per batch size (probe clock)
        self._model: dict[int, float] = {}

    def model_cost(self, tokens: int) -> float:
        if (c := self._model.get(tokens)) is None:
            c = self._model[tokens] = forward_cost(tokens, self.cost_ratio)
        return c

    def cost(self, batch: int, tokens: int) -> float:
        own = self._own_cost(batch, tokens)
        return max(own, self._own_cost(batch, batch)) if tokens > batch else own

    def _own_cost(self, batch: int, tokens: int) -> float:
        measured = self._cost.get(batch)
        if not measured:
            return self.model_cost(tokens)
        if (c := measured.get(tokens)) is not None:
            return c
        anchors = self._anchors[batch]
        i = bisect.bisect_left(anchors, tokens)
        if 0 < i < len(anchors):  # between two measured counts: the line through them
            a, b = anchors[i - 1], anchors[i]
            return measured[a] + (measured[b] - measured[a]) * (tokens - a) / (b - a)
        anchor = anchors[0] if i == 0 else anchors[-1]
        scaled = measured[anchor] * self.model_cost(tokens) / self.model_cost(anchor)
        if i == 0 or len(anchors) < 2:
            return scaled
        a, b = anchors[-2], anchors[-1]  # above the largest: no less than the measured slope goes on
        return max(scaled, measured[b] + (measured[b] - measured[a]) * (tokens - b) / (b - a))

    def speculates(self, batch: int) -> bool:
        """False for a plain probe (class docstring); advances the probe clock."""
        k = self._steps.get(batch, 0)
        self._steps[batch] = k + 1
        idle = self._idle.get(batch, 0)
        if idle >= self.idle_after and (idle - self.idle_after) % self.probe_every != self.probe_every - 1:
            self._idle[batch] = idle + 1
            return False
        if not self.adaptive:
            return True
        return batch in self._cost.get(batch, ()) and not (self.plain_probe_every and k % self.plain_probe_every
                                                            == self.plain_probe_every - 1)

    def lengths(self, batch: int, values: Sequence[Sequence[float]]) -> list[int]:
        """How many of its nodes each row drafts (class docstring)."""
        nodes = sorted(((v, -depth, row) for row, vs in enumerate(values) for depth, v in enumerate(vs)), reverse=True)
        margin = self.min_gain if self._cost.get(batch) else 0.0
        plain = self._own_cost(batch, batch)  # cost()'s floor, priced once for the step's candidates
        best_k, best_rate, gain = 0, batch * (1.0 + margin) / plain, 0.0
        for k, (v, _, _) in enumerate(nodes, start=1):
            gain += v
            if (rate := (batch + gain) / max(self._own_cost(batch, batch + k), plain)) > best_rate * (1 + 1e-9):
                best_k, best_rate = k, rate
        self._idle[batch] = 0 if best_k else self._idle.get(batch, 0) + 1
        out = [0] * len(values)
        for _, neg_depth, row in nodes[:best_k]:
            out[row] = max(out[row], 1 - neg_depth)
        return out

    def observe(self, batch: int, tokens: int, seconds: float) -> None:
        """One step of ``batch`` rows and ``tokens`` tokens in all, its wall seconds."""
        if not self.adaptive:
            return
        medians = self._medians.setdefault(batch, {})
        if tokens not in medians:
            bisect.insort(self._anchors.setdefault(batch, []), tokens)
        medians[tokens] = self.step_times.add((batch, tokens), seconds)
        anchors = self._anchors[batch]
        fitted = isotonic([medians[m] for m in anchors], [self.step_times.count((batch, m)) for m in anchors])
        self._cost[batch] = dict(zip(anchors, fitted))


class Pricing:
    """The policy's view of one proposer: its trees priced, and the tree size for each step.

    ``taus`` (expected tokens per step per tree size) and ``proposal`` (``h`` per size) are read
    from the proposer, and again whenever its ``revision`` moves (a union whose measured acceptance
    moved its shares); ``cost`` is the step-cost model (a measured curve or the line ``r``). With
    the engine config's ``speculate_max_batch`` the user decides (the full tree up to that batch
    size, plain above; read at every step, so a running engine can be told); with ``adaptive`` an
    :class:`AdaptivePolicy` corrects the prediction with measured acceptance and step times;
    otherwise :func:`choose_tree_size` decides from the prediction alone.
    """

    def __init__(self, proposer, forward_weights: int, cost: float | StepCosts, config):
        self.proposer = proposer
        self.forward_weights = forward_weights
        self.cost = cost
        self.config = config  # the EngineConfig
        self.policy: AdaptivePolicy | None = None
        self.budget: TokenBudget | None = None  # the node budget, for a proposer that prices its nodes
        self.reprice()
        if config.speculate_max_batch is None and getattr(proposer, "prices_nodes", False):
            self.budget = TokenBudget(cost, adaptive=config.adaptive)
        elif config.adaptive and config.speculate_max_batch is None:
            self.policy = AdaptivePolicy(self.taus, cost, self.proposal)

    def reprice(self) -> None:
        """The tables from the proposer as it is now."""
        self.revision = getattr(self.proposer, "revision", 0)
        self.taus = self.proposer.taus()
        self.proposal = {n: self.proposer.proposal_cost(n, self.forward_weights) for n in self.taus}
        if self.policy is not None:
            self.policy.retable(self.taus, self.proposal)

    def size(self, batch: int) -> int:
        """Tree nodes for a batch of ``batch`` sequences now (0 = plain decoding), without exploring."""
        limit = self.config.speculate_max_batch
        if limit is not None:
            return self.proposer.max_nodes if batch <= limit else 0
        if self.budget is not None:  # each row's share is decided with its drafts
            return self.proposer.max_nodes
        if self.policy is not None:
            return self.policy.best(batch)
        return choose_tree_size(batch, self.taus, self.cost, None, self.proposal)

    def next_size(self, batch: int) -> int:
        """Tree nodes for the next step (the adaptive policy may explore a size it is unsure of)."""
        if self.budget is not None:
            return self.proposer.max_nodes if self.budget.speculates(batch) else 0
        if self.policy is not None and self.config.speculate_max_batch is None:
            return self.policy.next_size(batch)
        return self.size(batch)

    def observe(self, batch: int, nodes: int, seconds: float, accepted: Sequence[int], tokens: int | None = None) -> None:
        """After a speculative step of ``tokens`` tokens in all: the proposer's tables again if they moved; the
        adaptive policy's or the node budget's measurements."""
        if getattr(self.proposer, "revision", 0) != self.revision:
            self.reprice()
        if self.budget is not None:
            self.budget.observe(batch, tokens if tokens is not None else batch * (nodes + 1), seconds)
        if self.policy is not None:  # the size it chose: a lookup tree may hold fewer nodes (its taus are per budget)
            self.policy.observe(batch, nodes, seconds, accepted)
