"""Presenting dataset statistics: a rich table for people, PNG charts (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from distill.data.stats import DatasetStats, Histogram
from distill.store.atomic import atomic_write_figure


def stats_table(st: DatasetStats):
    """A rich renderable summarising :class:`DatasetStats`."""
    from rich.table import Table

    t = Table(title=f"{st.path}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("model", str(st.model))
    t.add_row("shards / rows / conversations", f"{st.shards} / {st.rows:,} / {st.conversations:,}"
              + (f" ({st.continued_rows:,} rows continue one)" if st.continued_rows else ""))
    t.add_row("turns (user / assistant)", f"{st.user_turns:,} / {st.assistant_turns:,}")
    t.add_row("tokens (prompt / generated)", f"{st.prompt_tokens:,} / {st.generated_tokens:,}")
    t.add_row("generated tokens per turn", f"mean {st.turn_len.mean:.1f}, p50 {st.turn_len.quantile(.5):.0f}, max {st.turn_len.max:.0f}"
              if st.turn_len.count else "-")
    t.add_row("finish reasons (turns)", _counts(st.finish_reasons))
    t.add_row("stop reasons (conversations)", _counts(st.stop_reasons))
    t.add_row("rejects", _counts(st.rejects_by_reason) or "none")
    if st.teacher is None:
        t.add_row("teacher", "none (teacher-less dataset: hard targets only)")
    else:
        tt = st.teacher
        t.add_row("teacher k / positions", f"{tt.k} / {tt.positions:,}")
        t.add_row("top-1 mass", f"mean {tt.top1.mean:.3f}, p50 {tt.top1.quantile(.5):.2f}")
        t.add_row("stored entropy (nats)", f"mean {tt.entropy.mean:.3f}, p90 {tt.entropy.quantile(.9):.2f}")
        t.add_row("top-k coverage", f"mean {tt.coverage.mean:.4f}, min {tt.coverage.min:.4f}")
        if tt.positions:
            t.add_row("sampled token is top-1 / in top-k", f"{tt.sampled_rank1 / tt.positions:.1%} / {tt.sampled_in_topk / tt.positions:.1%}")
    return t


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in d.items())


def _bars(ax, hist: Histogram, title: str, xlabel: str, max_bars: int = 40, trim: bool = True) -> None:
    counts = np.asarray(hist.counts)
    edges = hist.edges
    if trim and counts.any():
        last = int(np.flatnonzero(counts)[-1]) + 1
        group = max(1, -(-last // max_bars))
        n = -(-last // group) * group
        counts = np.pad(counts, (0, max(0, n - counts.size)))[:n].reshape(-1, group).sum(1)
        edges = np.linspace(hist.lo, hist.lo + (hist.hi - hist.lo) * n / hist.bins, counts.size + 1)
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="#4C72B0", edgecolor="white", linewidth=0.5)
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("count")


def plot_stats(st: DatasetStats, out: Path | str) -> list[Path]:
    """Write PNG charts into folder ``out``: lengths.png and (with a teacher) teacher.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    _bars(axes[0], st.prompt_len.hist, "prompt tokens per conversation", "tokens")
    _bars(axes[1], st.generated_len.hist, "generated tokens per conversation", "tokens")
    _bars(axes[2], st.turn_len.hist, "generated tokens per assistant turn", "tokens")
    fig.suptitle(f"{Path(st.path).name}: {st.conversations:,} conversations, {st.generated_tokens:,} generated tokens")
    fig.tight_layout()
    written.append(out / "lengths.png")
    atomic_write_figure(written[-1], fig)
    plt.close(fig)
    if st.teacher is not None and st.teacher.positions:
        tt = st.teacher
        fig, axes = plt.subplots(1, 3, figsize=(15, 4))
        _bars(axes[0], tt.top1.hist, f"teacher top-1 mass (mean {tt.top1.mean:.3f})", "probability", trim=False)
        _bars(axes[1], tt.entropy.hist, f"stored entropy, K={tt.k} + tail (mean {tt.entropy.mean:.3f})", "nats", trim=False)
        _bars(axes[2], tt.coverage.hist, f"top-{tt.k} coverage (mean {tt.coverage.mean:.4f})", "probability mass", trim=False)
        fig.suptitle(f"teacher distribution over {tt.positions:,} generated positions")
        fig.tight_layout()
        written.append(out / "teacher.png")
        atomic_write_figure(written[-1], fig)
        plt.close(fig)
    return written
