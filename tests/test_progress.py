"""One progress style for the long commands (distill.progress): a bar on a terminal; off one, a plain line every
DISTILL_PROGRESS_SECONDS and a last one, stage lines while a model loads, all on stderr, nothing with --quiet."""

from __future__ import annotations

import io
import re

import pytest

from conftest import REPO, run_distill
from distill.errors import ConfigError
from distill.progress import Progress, interval_from_env


class Clock:
    """A clock the test moves: the interval, rates and ETA without sleeping."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _progress(clock, **kw) -> tuple[Progress, io.StringIO]:
    out = io.StringIO()
    kw.setdefault("interval", 30)
    return Progress("train-heads", "steps", stream=out, clock=clock, **kw), out


def test_off_a_terminal_a_line_per_interval_and_a_last_one_with_count_rate_and_eta():
    clock = Clock()
    p, out = _progress(clock, total=100)
    for _ in range(100):
        clock.now += 1
        p.update(1, tokens=50, fields={"loss": "2.500"})
    p.close()
    lines = out.getvalue().splitlines()
    # 30, 60 and 90 s after the start, then the last line at 100/100 (no ETA left to give)
    assert lines == [
        "train-heads: 30/100 steps, 50.0 tok/s, loss 2.500, 0:00:30 elapsed, ETA 0:01:10",
        "train-heads: 60/100 steps, 50.0 tok/s, loss 2.500, 0:01:00 elapsed, ETA 0:00:40",
        "train-heads: 90/100 steps, 50.0 tok/s, loss 2.500, 0:01:30 elapsed, ETA 0:00:10",
        "train-heads: 100/100 steps, 50.0 tok/s, loss 2.500, 0:01:40 elapsed",
    ], lines


def test_rates_and_eta_count_from_begin_not_from_a_slow_start():
    clock = Clock()
    p, out = _progress(clock, interval=0)
    p.stage("loading the model")
    clock.now += 600  # ten minutes of loading
    p.begin(total=10)
    clock.now += 10
    p.update(5, tokens=2000)
    p.close()
    first, line = out.getvalue().splitlines()
    assert first == "train-heads: loading the model"
    assert line == "train-heads: 5/10 steps, 200 tok/s, 0:10:10 elapsed, ETA 0:00:10", line


def test_a_run_shorter_than_the_interval_prints_no_line_but_its_stages():
    clock = Clock()
    with _progress(clock)[0] as p:
        out = p.stream
        p.stage("starting the hf backend")
        for _ in range(5):
            clock.now += 1
            p.update(1, tokens=3)
    assert out.getvalue() == "train-heads: starting the hf backend\n"
    clock = Clock()
    p, out = _progress(clock)
    clock.now += 31
    p.update(1)
    clock.now += 1
    p.update(1)
    p.close()  # a line was printed: the last one too, without a tok/s (no tokens counted)
    assert out.getvalue().splitlines() == ["train-heads: 1 steps, 0:00:31 elapsed", "train-heads: 2 steps, 0:00:32 elapsed"]


def test_quiet_prints_nothing():
    clock = Clock()
    p, out = _progress(clock, quiet=True, interval=0, total=3)
    p.stage("loading")
    p.begin()
    for _ in range(3):
        clock.now += 40
        p.update(1, tokens=10)
    p.close()
    p, tty = _progress(clock, quiet=True, terminal=True)
    p.stage("loading")
    p.update(1)
    p.close()
    assert out.getvalue() == tty.getvalue() == ""


def test_on_a_terminal_a_bar_and_no_periodic_lines():
    clock = Clock()
    p, out = _progress(clock, terminal=True)
    p.stage("loading")
    p.begin(total=4)
    for _ in range(4):
        clock.now += 1
        p.update(1, tokens=10, fields={"loss": "1.000"})
    p.close()
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.getvalue())  # without the colours and cursor moves
    assert "train-heads: loading" in text and "4/4" in text and "10.0 tok/s" in text and "loss 1.000" in text, text
    assert "elapsed" not in text  # the plain lines' wording: the bar has its own columns


def test_the_interval_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("DISTILL_PROGRESS_SECONDS", raising=False)
    assert interval_from_env() == 30
    monkeypatch.setenv("DISTILL_PROGRESS_SECONDS", "2.5")
    assert interval_from_env() == 2.5 and Progress("x", "y", stream=io.StringIO()).interval == 2.5
    for bad in ("soon", "-1", "inf"):
        monkeypatch.setenv("DISTILL_PROGRESS_SECONDS", bad)
        with pytest.raises(ConfigError, match="DISTILL_PROGRESS_SECONDS"):
            interval_from_env()


def test_generate_and_bench_still_take_their_plain_callables():
    from distill.bench.runner import _progress as bench_progress
    from distill.generate.runner import _reporters

    said: list[str] = []
    lines = bench_progress(said.append)  # bench's message lines
    lines.stage("loading")
    lines.begin(total=2, done=0, unit="greedy prompts")
    lines.update(1, tokens=12)
    assert said == ["loading", "1/2 greedy prompts"]
    calls: list = []
    counts, stage, begin = _reporters(lambda n, t, total=None: calls.append((n, t, total)))  # generate's counts
    counts(0, 0, total=3)
    counts(1, 7)
    stage("starting")
    begin()
    assert calls == [(0, 0, 3), (1, 7, None)]

    clock = Clock()
    p, out = _progress(clock, interval=0)
    counts, stage, begin = _reporters(p)  # a Progress: counts, stage lines and the start of the work
    counts(0, 0, total=2)
    stage("starting the hf backend")
    clock.now += 50
    begin()
    clock.now += 2
    counts(1, 40)
    assert out.getvalue().splitlines() == ["train-heads: starting the hf backend",
                                           "train-heads: 1/2 steps, 20.0 tok/s, 0:00:52 elapsed, ETA 0:00:02"]


# -- the commands, off a terminal (click's runner captures stderr: no terminal) ---------------------------------------------
def test_train_heads_and_calibrate_print_progress_lines_on_stderr_only(plain_shards, tmp_path, cli_env):
    env = dict(cli_env, DISTILL_PROGRESS_SECONDS="0")
    out = tmp_path / "heads"
    r = run_distill(["train-heads", "--data", plain_shards, "--out", out, "--num-heads", "2", "--share-lm-head", "--max-len", "32",
                     "--batch-size", "2", "--steps", "3", "--warmup-steps", "0"], env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert lines[0].startswith("train-heads: loading "), r.stderr
    steps = [line for line in lines if re.match(r"train-heads: \d+/3 steps, [\d,.]+ tok/s, loss \d+\.\d+, top-1 \d\.\d+, "
                                                r"\d:\d\d:\d\d elapsed", line)]
    assert [s.split()[1] for s in steps] == ["1/3", "2/3", "3/3"], r.stderr
    assert "ETA" in steps[0] and "ETA" not in steps[-1]
    assert all(line.startswith(("heads", str(out), "  ")) for line in r.stdout.splitlines()) and "3 steps" in r.stdout
    assert "train-heads:" not in r.stdout

    cal = run_distill(["calibrate", "--heads", out, "--data", plain_shards, "--nodes", "3", "--max-len", "32", "--no-plots"], env=env)
    assert cal.returncode == 0, cal.stderr[-2000:]
    lines = cal.stderr.splitlines()
    assert lines[0].startswith(f"calibrate: {out} on {plain_shards} (every held-out token)") and lines[1].startswith("calibrate: loading ")
    counts = [re.match(r"calibrate: ([\d,]+)/([\d,]+) tokens, [\d,.]+ tok/s", line) for line in lines[2:] if line.startswith("calibrate:")]
    assert counts and all(counts), cal.stderr
    done, total = counts[-1].groups()
    assert done == total, cal.stderr  # the last line: all of it measured
    assert "calibrate:" not in cal.stdout and "tree.json" in cal.stdout

    quiet = run_distill(["train-heads", "--data", plain_shards, "--out", tmp_path / "quiet", "--num-heads", "2", "--share-lm-head",
                         "--max-len", "32", "--batch-size", "2", "--steps", "1", "-q"], env=env)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


def test_generate_says_which_backend_starts_and_prints_progress_lines(tmp_path, cli_env):
    out = tmp_path / "out"
    r = run_distill(["generate", "--backend", "hf", "--seed", "mt-bench", "--mode", "single-turn", "--limit", "2", "--max-tokens", "4",
                     "--dtype", "float32", "--shard-size", "1", "--out", out], env=dict(cli_env, DISTILL_PROGRESS_SECONDS="0"), cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    assert re.fullmatch(r"generate: starting the hf backend for \S+ \(cpu, float32\)", lines[0]), r.stderr
    counts = [re.match(r"generate: (\d)/2 conversations, [\d,.]+ tok/s, \d:\d\d:\d\d elapsed", line) for line in lines[1:]]
    assert counts and all(counts), r.stderr  # a line per reply and per conversation done (DISTILL_PROGRESS_SECONDS=0)
    assert [m.group(1) for m in counts] == sorted(m.group(1) for m in counts) and counts[-1].group(1) == "2", r.stderr
    assert any("ETA" in line for line in lines if line.startswith("generate: 1/2"))
    assert "generate:" not in r.stdout and "2 generated" in r.stdout
