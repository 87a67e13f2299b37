"""Held-out accuracy counts of a drafter's heads (or an EAGLE-3 drafter's draft depths).

The type lives with the drafter formats so that calibration (:mod:`distill.train.calibrate`) and
EAGLE-3 training (:mod:`distill.train.eagle`, whose per-depth accuracy extends it) share it without
importing each other. Terms (rank-i hit, the accuracy table) are those of :mod:`distill.train.calibrate`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HeadAccuracy:
    """Counts over evaluated positions (stats only; plotting and files live elsewhere)."""

    ranks: int
    counts: list[int]  # per head: positions evaluated
    hits: list[list[int]]  # per head, per rank: rank-i hits
    loss_sum: list[float]  # per head: summed hard CE
    tokens: int = 0

    @property
    def table(self) -> list[list[float]]:
        return [[h / max(n, 1) for h in row] for row, n in zip(self.hits, self.counts)]

    def topk(self, k: int) -> list[float]:
        """Per head: fraction of positions whose true token is within the top-k."""
        return [sum(row[:k]) / max(n, 1) for row, n in zip(self.hits, self.counts)]

    @property
    def loss(self) -> list[float]:
        return [s / max(n, 1) for s, n in zip(self.loss_sum, self.counts)]


__all__ = ["HeadAccuracy"]
