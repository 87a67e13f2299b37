"""What a drafter's measured tokens per step would give at a GPU's measured step costs: a prediction, never a measurement.

On a CPU a verification step of many nodes costs much more than a plain step, so a drafter that accepts 1.5 tokens
per step may not pay there; on a GPU, where a step is bound by reading the weights once, the same drafter pays. The
step costs below are the ones measured for a 7B-shaped target on an H100 with CUDA graphs (BENCHMARKS.md, "A 7B-shaped
target against the hardware limit"); a drafter's tokens per step measured here, divided by the cost of its step
there, predicts its speedup there. Acceptance is the drafter's own (a 7B target's drafter would accept otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Where the figures below come from (BENCHMARKS.md section), named in every prediction.
SOURCE = "H100, Llama-2-7B shape, bf16, CUDA graphs"
PLAIN_MS = 8.56  # a plain step
VERIFY = {2: 1.08, 16: 1.12, 64: 1.20}  # a verification step of N nodes / a plain step
MEDUSA_PROPOSAL_MS = {16: 0.38, 64: 0.42}  # the heads' proposal, 4 heads
EAGLE_STEP_MS = {3: 13.07, 5: 14.77, 7: 16.45}  # a whole EAGLE step (drafting and a 24-node verification) by depth
EAGLE_NODES = 24


def _between(table: dict[int, float], x: float, log: bool = False) -> float:
    """``table`` read at ``x``: linear between its points (in log x when ``log``), held at its ends."""
    keys = sorted(table)
    if x <= keys[0]:
        return table[keys[0]]
    if x >= keys[-1]:
        return table[keys[-1]]
    lo = max(k for k in keys if k <= x)
    hi = min(k for k in keys if k >= x)
    if lo == hi:
        return table[lo]
    f = (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo)) if log else (x - lo) / (hi - lo)
    return table[lo] + f * (table[hi] - table[lo])


def step_ratio(proposer: str, nodes: int, depth: int | None = None) -> float:
    """A speculative step of ``proposer`` (``medusa``, ``eagle3``, ``lookup`` or a union ``a+b``) with ``nodes`` nodes
    (and, for EAGLE, ``depth`` drafting passes) over a plain step, at the measured GPU costs."""
    verify = _between(VERIFY, nodes, log=True)
    parts = proposer.split("+")
    extra = 0.0
    if "eagle3" in parts:
        d = depth or 5
        slope = (EAGLE_STEP_MS[7] - EAGLE_STEP_MS[3]) / 4
        eagle_ms = EAGLE_STEP_MS[3] + (d - 3) * slope if d > 7 or d < 3 else _between(EAGLE_STEP_MS, d)
        # the measured step verifies 24 nodes: the drafting's share is what it adds above that verification
        extra = eagle_ms / PLAIN_MS - _between(VERIFY, EAGLE_NODES, log=True)
    elif "medusa" in parts:
        extra = _between(MEDUSA_PROPOSAL_MS, nodes, log=True) / PLAIN_MS
    return verify + extra  # the lookup's n-gram matching runs on the host: not priced


@dataclass(frozen=True)
class Prediction:
    tokens_per_step: float  # measured on this machine
    step_ratio: float  # the GPU step over a plain one (:func:`step_ratio`)

    @property
    def speedup(self) -> float:
        return self.tokens_per_step / self.step_ratio

    def describe(self) -> str:
        return (f"predicted at the step costs measured on an {SOURCE} (a prediction, not measured): "
                f"{self.tokens_per_step:.2f} tokens/step / a step of {self.step_ratio:.2f}x = {self.speedup:.2f}x")


def predict(proposer: str, nodes: int, tokens_per_step: float, depth: int | None = None) -> Prediction:
    """The speedup ``tokens_per_step`` would give with ``proposer``'s ``nodes``-node tree at the GPU's step costs."""
    return Prediction(tokens_per_step, step_ratio(proposer, nodes, depth))


__all__ = ["Prediction", "SOURCE", "predict", "step_ratio"]
