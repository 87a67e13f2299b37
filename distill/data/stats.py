"""``distill data stats``: what a dataset holds, computed in one streamed pass.

Terms
-----
position
    one generated token (``loss_mask`` true); the teacher stored K candidates for it.
top-1 mass
    the probability of the teacher's most likely candidate at a position.
top-k coverage
    the probability mass the K stored candidates hold: ``sum_i exp(logprob_i)``.
    1 - coverage is the mass of the rest of the vocabulary (the *tail*).
stored entropy
    the entropy (nats) of the K stored candidates plus one tail bucket holding
    ``1 - coverage``: ``-sum_i p_i log p_i - tail log tail``. Lumping the tail into
    one bucket makes this a lower bound of the model's full entropy (equal when the
    tail is empty); with K=20 the tail is usually a few percent.

Statistics are plain dataclasses (DESIGN principle 8); printing and plotting live in
:mod:`distill.data.report`. Distributions are fixed-bin histograms filled batch by
batch, so memory does not grow with the dataset.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from distill.data.dataset import Dataset
from distill.store.teacher import TeacherEncoding


@dataclass
class Histogram:
    """Fixed-bin counts over ``[lo, hi]``; values outside are clipped into the end bins."""

    lo: float
    hi: float
    bins: int
    counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * self.bins
        self._acc = np.asarray(self.counts, dtype=np.int64)

    @property
    def edges(self) -> np.ndarray:
        return np.linspace(self.lo, self.hi, self.bins + 1)

    def add(self, values: np.ndarray) -> None:
        if values.size:
            idx = np.clip(((values - self.lo) * (self.bins / (self.hi - self.lo))).astype(np.int64), 0, self.bins - 1)
            self._acc += np.bincount(idx, minlength=self.bins)
            self.counts = self._acc.tolist()

    @property
    def total(self) -> int:
        return int(self._acc.sum())

    def quantile(self, q: float) -> float:
        """Approximate quantile: linear interpolation inside the bin where the cumulative count reaches q."""
        if not self.total:
            return float("nan")
        cum = np.cumsum(self._acc)
        target = q * self.total
        i = min(int(np.searchsorted(cum, target)), self.bins - 1)
        below = cum[i - 1] if i else 0
        frac = (target - below) / self._acc[i] if self._acc[i] else 0.0
        width = (self.hi - self.lo) / self.bins
        return float(self.lo + (i + frac) * width)

    def to_dict(self) -> dict:
        """Bin layout and counts; trailing empty bins are left out of ``counts``."""
        nz = np.flatnonzero(self._acc)
        n = int(nz[-1]) + 1 if nz.size else 0
        return {"lo": self.lo, "hi": self.hi, "bins": self.bins, "counts": self.counts[:n]}


@dataclass
class Summary:
    """Mean, extremes and approximate quantiles of one per-item quantity."""

    count: int = 0
    total: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    hist: Histogram | None = None

    def add(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64)
        if not values.size:
            return
        self.count += int(values.size)
        self.total += float(values.sum())
        self.min = min(self.min, float(values.min()))
        self.max = max(self.max, float(values.max()))
        if self.hist is not None:
            self.hist.add(values)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else float("nan")

    def quantile(self, q: float) -> float:
        """Approximate quantile from the histogram, kept inside the observed [min, max]."""
        if not self.count or self.hist is None:
            return float("nan")
        return min(max(self.hist.quantile(q), self.min), self.max)

    def to_dict(self) -> dict:
        d = {"count": self.count, "mean": _num(self.mean), "min": _num(self.min), "max": _num(self.max)}
        if self.hist is not None:
            d.update(p50=_num(self.quantile(0.5)), p90=_num(self.quantile(0.9)), histogram=self.hist.to_dict())
        return d


def _num(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else round(x, 6)


def _length_summary() -> Summary:
    return Summary(hist=Histogram(0, 16384, 2048))


@dataclass
class TeacherStats:
    """Teacher distribution statistics over every generated position (see the module's terms)."""

    k: int
    positions: int = 0
    top1: Summary = field(default_factory=lambda: Summary(hist=Histogram(0.0, 1.0, 50)))
    entropy: Summary = field(default_factory=lambda: Summary(hist=Histogram(0.0, 5.0, 100)))  # log(65) < 5
    coverage: Summary = field(default_factory=lambda: Summary(hist=Histogram(0.0, 1.0, 50)))
    sampled_in_topk: int = 0  # positions whose generated token is one of the K candidates
    sampled_rank1: int = 0  # positions whose generated token is the teacher's top-1

    def to_dict(self) -> dict:
        return {
            "k": self.k, "positions": self.positions,
            "top1_mass": self.top1.to_dict(), "entropy_nats": self.entropy.to_dict(), "topk_coverage": self.coverage.to_dict(),
            "sampled_in_topk_fraction": _num(self.sampled_in_topk / self.positions) if self.positions else None,
            "sampled_is_top1_fraction": _num(self.sampled_rank1 / self.positions) if self.positions else None,
        }


@dataclass
class DatasetStats:
    """Everything ``distill data stats`` reports about one dataset folder."""

    path: str
    model: str | None
    shards: int = 0
    rows: int = 0
    conversations: int = 0  # rows that open a conversation (a ``#t<turn>`` row continues one)
    continued_rows: int = 0  # rows ``<conversation>#t<turn>``: a template that re-renders history starts a new row
    messages: int = 0
    user_turns: int = 0
    assistant_turns: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)  # per assistant turn
    stop_reasons: dict[str, int] = field(default_factory=dict)  # per conversation: its last row's (not "continued")
    rejects_by_reason: dict[str, int] = field(default_factory=dict)
    prompt_len: Summary = field(default_factory=_length_summary)  # prompt tokens per conversation
    generated_len: Summary = field(default_factory=_length_summary)  # generated tokens per conversation
    turn_len: Summary = field(default_factory=_length_summary)  # generated tokens per assistant turn
    teacher: TeacherStats | None = None  # None for a teacher-less dataset

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("prompt_len", "generated_len", "turn_len", "teacher")}
        d.update(
            tokens=self.tokens,
            prompt_tokens_per_conversation=self.prompt_len.to_dict(),
            generated_tokens_per_conversation=self.generated_len.to_dict(),
            generated_tokens_per_turn=self.turn_len.to_dict(),
            teacher=self.teacher.to_dict() if self.teacher else None,
        )
        return d


def teacher_position_stats(codes: np.ndarray, enc: TeacherEncoding) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-position top-1 mass, stored entropy and top-k coverage from flat ``teacher_lp`` codes.

    codes: (N*K,) uint16 as stored. Returns three (N,) float64 arrays.
    """
    q = np.cumsum(codes.reshape(-1, enc.k).astype(np.int32), axis=1)  # (N, K) quantized -logprob
    p = np.exp(-q / enc.scale)  # (N, K)
    coverage = p.sum(axis=1)  # (N,)
    tail = np.clip(1.0 - coverage, 0.0, 1.0)  # (N,)
    entropy = (p * (q / enc.scale)).sum(axis=1) - np.where(tail > 0, tail * np.log(np.where(tail > 0, tail, 1.0)), 0.0)
    return p[:, 0], entropy, coverage


def _list_values(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    return pc.list_flatten(col).to_numpy(zero_copy_only=False)


def compute_stats(root: Path | str) -> DatasetStats:
    """Stream every shard of ``root`` once (record batches) and aggregate :class:`DatasetStats`."""
    ds = Dataset.open(root)
    enc = ds.encoding
    model = (ds.meta.get("model") or {}).get("id")
    st = DatasetStats(path=str(ds.root), model=model, shards=len(ds.files), teacher=TeacherStats(k=enc.k) if enc else None)
    finish: Counter = Counter()
    stops: Counter = Counter()
    columns = ["id", "messages", "turns", "stop_reason", "n_prompt_tokens", "n_generated_tokens"]
    if enc:
        columns += ["input_ids", "loss_mask", "teacher_ids", "teacher_lp"]
    for batch in ds.iter_batches(columns):
        continued = int(pc.sum(pc.match_substring_regex(batch.column("id"), r"#t\d+$")).as_py() or 0)
        st.rows += batch.num_rows
        st.conversations += batch.num_rows - continued
        st.continued_rows += continued
        st.messages += int(pc.sum(pc.list_value_length(batch.column("messages"))).as_py() or 0)
        turns = pc.list_flatten(batch.column("turns"))
        roles = turns.field("role").to_numpy(zero_copy_only=False)
        is_asst = roles == "assistant"
        st.user_turns += int((roles == "user").sum())
        st.assistant_turns += int(is_asst.sum())
        st.turn_len.add(turns.field("n_tokens").to_numpy(zero_copy_only=False)[is_asst])
        finish.update(str(r) for r in np.asarray(turns.field("finish_reason").to_pylist(), dtype=object)[is_asst])
        stops.update(r for r in batch.column("stop_reason").to_pylist() if r != "continued")  # its conversation goes on
        n_prompt = batch.column("n_prompt_tokens").to_numpy(zero_copy_only=False)
        n_gen = batch.column("n_generated_tokens").to_numpy(zero_copy_only=False)
        st.prompt_tokens += int(n_prompt.sum())
        st.generated_tokens += int(n_gen.sum())
        st.prompt_len.add(n_prompt)
        st.generated_len.add(n_gen)
        if enc:
            codes = _list_values(batch.column("teacher_lp"))
            top1, entropy, coverage = teacher_position_stats(codes, enc)
            t = st.teacher
            t.positions += top1.size
            t.top1.add(top1)
            t.entropy.add(entropy)
            t.coverage.add(coverage)
            mask = _list_values(batch.column("loss_mask")).astype(bool)
            sampled = _list_values(batch.column("input_ids"))[mask]  # (N,)
            cand = _list_values(batch.column("teacher_ids")).reshape(-1, enc.k)  # (N, K)
            if cand.shape[0] == sampled.size:
                t.sampled_rank1 += int((cand[:, 0] == sampled).sum())
                t.sampled_in_topk += int((cand == sampled[:, None]).any(axis=1).sum())
    st.finish_reasons = dict(sorted(finish.items()))
    st.stop_reasons = dict(sorted(stops.items()))
    st.rejects_by_reason = dict(sorted(Counter(r.get("reason", "unknown") for r in ds.rejects()).items()))
    return st
