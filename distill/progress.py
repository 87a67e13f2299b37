"""How far a long command is: ``generate``, ``train-heads``, ``calibrate`` and ``bench`` report through :class:`Progress`.

On a terminal it draws a rich bar: the label, the bar, done/total, tok/s where tokens are counted, the
command's own fields (train-heads: loss, top-1), the elapsed time and an ETA. Off a terminal (nohup, a
scheduler's job, a pipe) a bar's redraws would fill the log, so it writes one plain line at most every
``DISTILL_PROGRESS_SECONDS`` seconds (default 30) and a last one when the run ends::

    train-heads: 120/400 steps, 1,234 tok/s, loss 2.345, top-1 0.412, 0:01:05 elapsed, ETA 0:03:02

A run shorter than the interval that printed no periodic line prints no last line either: a quick command's
log holds its results only. Stage lines (``generate: starting the vllm backend for MODEL``) say what a slow
start is doing, on a terminal and off it. Everything goes to stderr; stdout carries the command's results.
``quiet`` turns all of it off.

Rates and the ETA count from :meth:`Progress.begin` when the command calls it (after loading a model or
starting an engine), else from the start: a minute of engine start-up is no part of the work's speed.
"""

from __future__ import annotations

import math
import os
import sys
import time
from datetime import timedelta
from typing import Callable, TextIO

from distill.errors import ConfigError

#: Seconds between two progress lines off a terminal.
INTERVAL_ENV = "DISTILL_PROGRESS_SECONDS"
DEFAULT_INTERVAL = 30.0


def interval_from_env() -> float:
    """The seconds between two progress lines off a terminal: ``DISTILL_PROGRESS_SECONDS``, else 30."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 <= value < math.inf):
        raise ConfigError(f"{INTERVAL_ENV}={raw}: give the seconds between two progress lines, a number >= 0")
    return value


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=int(max(seconds, 0))))


def _rate(per_s: float) -> str:
    return f"{per_s:,.1f}" if per_s < 100 else f"{per_s:,.0f}"


class Progress:
    """One long command's progress: a bar on a terminal, a plain line every ``interval`` seconds off it.

    ``clock`` (seconds, monotonic) is what the interval, the rates and the ETA are measured with; ``terminal``
    (default: whether ``stream`` is one) chooses the bar or the lines. ``interval`` defaults to
    :func:`interval_from_env`.
    """

    def __init__(self, label: str, unit: str, total: int | None = None, quiet: bool = False, stream: TextIO | None = None,
                 interval: float | None = None, clock: Callable[[], float] = time.monotonic, terminal: bool | None = None):
        self.label, self.unit, self.total, self.quiet = label, unit, total, quiet
        self.stream = stream if stream is not None else sys.stderr
        self.interval = 0.0 if quiet else interval_from_env() if interval is None else interval
        self.clock = clock
        self.done = self.tokens = 0
        self.counts_tokens = False
        self.fields: dict[str, str] = {}
        self.started = self._last_line = clock()
        self._base = (self.started, 0, 0)  # (time, done, tokens) the rates count from
        self._lines = 0  # periodic lines written
        self._printed: tuple | None = None  # (done, tokens, total) of the last line written
        self._closed = False
        if terminal is None:
            isatty = getattr(self.stream, "isatty", None)
            terminal = bool(isatty and isatty())
        self.terminal = terminal and not quiet
        self._console = self._bar = self._task = None  # the bar starts with the work, not while a model loads

    # -- what commands call ------------------------------------------------------------------
    def stage(self, message: str) -> None:
        """One line saying what the command does now (loading a model, starting an engine)."""
        if self.quiet:
            return
        if self.terminal:
            from rich.text import Text

            self._terminal_console().print(Text.assemble((f"{self.label}:", "bold"), f" {message}"))
        else:
            self._write(f"{self.label}: {message}")

    def begin(self, total: int | None = None, done: int | None = None, unit: str | None = None) -> None:
        """The work starts now: rates and the ETA count from here (``done``, ``total`` and ``unit`` reset when given)."""
        if total is not None:
            self.total = total
        if done is not None:
            self.done = done
        if unit is not None:
            self.unit = unit
        self._base = (self.clock(), self.done, self.tokens)
        self._show(self.clock(), periodic=False, start=True)

    def update(self, advance: int = 1, tokens: int = 0, total: int | None = None, fields: dict | None = None) -> None:
        """``advance`` more units done and ``tokens`` more tokens processed; ``fields`` (name -> value) shown beside."""
        if total is not None:
            self.total = total
        self.done += advance
        self.tokens += tokens
        self.counts_tokens = self.counts_tokens or bool(tokens)
        if fields:
            self.fields.update({str(k): str(v) for k, v in fields.items()})
        self._show(self.clock(), periodic=bool(advance or tokens), start=bool(advance or tokens))

    def close(self) -> None:
        """The last line (off a terminal: when the run printed a periodic line or outlasted the interval)."""
        if self._closed:
            return
        self._closed = True
        if self.quiet:
            return
        now = self.clock()
        if self._bar is not None:
            self._show(now, periodic=False)
            self._bar.stop()
        elif not self.terminal and (self._lines or now - self.started >= self.interval) and self._printed != self._state():
            self._write(self.line(now))

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what is shown ------------------------------------------------------------------------
    def rate(self, now: float) -> float | None:
        """Tokens per second since :meth:`begin` (None before a token or a measurable time)."""
        t0, _, tokens0 = self._base
        return (self.tokens - tokens0) / (now - t0) if self.counts_tokens and now > t0 else None

    def eta(self, now: float) -> float | None:
        """Seconds left at the pace since :meth:`begin` (None without a total or any progress since)."""
        t0, done0, _ = self._base
        if self.total is None or self.done <= done0 or now <= t0:
            return None
        return max(self.total - self.done, 0) * (now - t0) / (self.done - done0)

    def line(self, now: float) -> str:
        """The plain progress line at ``now``."""
        total = self._total()
        parts = [f"{self.done:,}/{total:,} {self.unit}" if total is not None else f"{self.done:,} {self.unit}"]
        if (rate := self.rate(now)) is not None:
            parts.append(f"{_rate(rate)} tok/s")
        parts += [f"{k} {v}" for k, v in self.fields.items()]
        parts.append(f"{_duration(now - self.started)} elapsed")
        if (eta := self.eta(now)) is not None and self.done < (total or 0):
            parts.append(f"ETA {_duration(eta)}")
        return f"{self.label}: " + ", ".join(parts)

    def _total(self) -> int | None:
        """The total shown: never below what is done (a token budget is checked per batch, and overshoots)."""
        return None if self.total is None else max(self.total, self.done)

    def _state(self) -> tuple:
        return self.done, self.tokens, self.total

    def _show(self, now: float, periodic: bool, start: bool = False) -> None:
        if self.quiet:
            return
        if self.terminal and self._bar is None and start:
            self._start_bar()
        if self._bar is not None:
            rate, eta = self.rate(now), self.eta(now)
            self._bar.update(self._task, completed=self.done, total=self._total(), unit=self.unit,
                             rate=f"{_rate(rate)} tok/s" if rate is not None else "",
                             extra=" ".join(f"{k} {v}" for k, v in self.fields.items()),
                             eta=f"ETA {_duration(eta)}" if eta is not None else "ETA ?")
        elif periodic and now - self._last_line >= self.interval:
            self._write(self.line(now))
            self._last_line, self._lines, self._printed = now, self._lines + 1, self._state()

    def _write(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def _terminal_console(self):
        if self._console is None:
            from rich.console import Console

            self._console = Console(file=self.stream, force_terminal=True)
        return self._console

    def _start_bar(self) -> None:
        from rich.markup import escape
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar
        from rich.table import Column

        def text(template: str) -> TextColumn:
            return TextColumn(template, table_column=Column(no_wrap=True, overflow="ellipsis"))

        # the bar takes what the counts, rates and times leave of the terminal's width (none on a narrow one)
        self._bar = Bar(text(f"[bold]{escape(self.label)}"), BarColumn(bar_width=None, table_column=Column(ratio=1)),
                        MofNCompleteColumn(table_column=Column(no_wrap=True)), text("{task.fields[unit]}"),
                        text("{task.fields[rate]}"), text("{task.fields[extra]}"),
                        TimeElapsedColumn(table_column=Column(no_wrap=True)), text("{task.fields[eta]}"),
                        console=self._terminal_console(), transient=False, expand=True)
        self._bar.start()
        self._task = self._bar.add_task(self.label, total=self.total, unit=self.unit, rate="", extra="", eta="ETA ?")
