"""One vocabulary on the command line: renamed options under both spellings, serve's `--`, and readable --help.

Every command here stops before a model loads: the library call each command makes is replaced by one that
records its config and ends the command with a one-line error.
"""

from __future__ import annotations

import os
import re

import pytest

from conftest import run_distill
from distill.errors import DistillError


class Captured(DistillError):
    """Raised by the stand-in library calls once they hold the command's config."""


@pytest.fixture()
def capture(monkeypatch):
    """``capture(module, name)``: replace ``module.name`` with a call that records its arguments and stops the command."""
    import importlib

    calls: list = []

    def replace(module: str, name: str) -> list:
        def stand_in(*args, **kwargs):
            calls.append((args, kwargs))
            raise Captured("captured")

        monkeypatch.setattr(importlib.import_module(module), name, stand_in)
        return calls

    return replace


def first_config(calls: list):
    args, kwargs = calls[-1]
    return args[0] if args else kwargs.get("cfg")


# (command and its other arguments, new spelling, old spelling, value, library call replaced, what reads the value back)
RENAMED = [
    (["generate"], "--max-tokens", "--max-new-tokens", "7", ("distill.generate", "Generator"), lambda c: c.max_new_tokens),
    (["generate"], "--random-seed", "--sampling-seed", "11", ("distill.generate", "Generator"), lambda c: c.sampling_seed),
    (["generate"], "--teacher-topk", "--topk", "5", ("distill.generate", "Generator"), lambda c: c.topk),
    (["train-heads", "--data", "d"], "--num-heads", "--heads", "3", ("distill.train", "train"), lambda c: c.heads),
    (["train-heads", "--data", "d"], "--medusa-mode", "--mode", "medusa2", ("distill.train", "train"), lambda c: c.mode),
    (["train-heads", "--data", "d"], "--random-seed", "--seed", "9", ("distill.train", "train"), lambda c: c.seed),
    (["calibrate", "--heads", "h", "--data", "d"], "--eval-tokens", "--max-tokens", "100",
     ("distill.train.calibrate", "calibrate"), lambda c: c.max_tokens),
    (["bench", "--heads", "lookup"], "--random-seed", "--seed", "4", ("distill.bench", "run_bench"), lambda c: c.seed),
]


@pytest.mark.parametrize("base, new, old, value, call, read", RENAMED, ids=[f"{r[0][0]}{r[1]}" for r in RENAMED])
def test_a_renamed_option_works_under_both_spellings(tmp_path, capture, base, new, old, value, call, read):
    calls = capture(*call)
    expected = value if not value.isdigit() else int(value)
    r = run_distill([*base, new, value, "-q"], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == "error: captured", r.stderr
    assert read(first_config(calls)) == expected
    for spelled in ([old, value], [f"{old}={value}"]):
        r = run_distill([*base, *spelled, "-q"], cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and lines[-1] == "error: captured" and len(lines) == 2, r.stderr
        assert lines[0].startswith("warning: ") and old in lines[0] and new in lines[0], r.stderr
        assert read(first_config(calls)) == expected
    assert not re.search(re.escape(old) + r"(?![\w-])", help_of(base[0]))  # hidden from --help


def test_the_deprecation_line_names_the_old_and_the_new_spelling(tmp_path, capture):
    capture("distill.bench", "run_bench")
    r = run_distill(["bench", "--heads", "lookup", "--seed", "4"], cwd=tmp_path)
    assert r.stderr.splitlines()[0] == "warning: --seed is deprecated: use --random-seed"
    capture("distill.train", "train")
    r = run_distill(["train-heads", "--data", "d", "--heads", "2"], cwd=tmp_path)
    assert r.stderr.splitlines()[0] == "warning: --heads 2 is deprecated in train-heads: use --num-heads 2"


def test_generate_seed_is_still_the_seed_dataset(tmp_path, capture):
    calls = capture("distill.generate", "Generator")
    r = run_distill(["generate", "--seed", "mt-bench", "-q"], cwd=tmp_path)
    assert r.returncode == 2 and "warning" not in r.stderr and first_config(calls).seed == "mt-bench"


@pytest.mark.parametrize("command, old, new, value, field", [
    (["data", "dedupe"], "--mode", "--match", "exact", ("distill.data.transform", "dedupe", "mode")),
    (["data", "convert"], "--to", "--format", "openai", ("distill.data.convert", "export", 1)),
])
def test_the_data_commands_renamed_options(tmp_path, capture, command, old, new, value, field):
    module, name, where = field
    calls = capture(module, name)
    for spelled, warned in (([new, value], False), ([old, value], True)):
        r = run_distill([*command, str(tmp_path), *spelled, "--out", str(tmp_path / "o")])
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == "error: captured", r.stderr
        assert (f"warning: {old} is deprecated: use {new}" in r.stderr) is warned
        args, kwargs = calls[-1]
        assert (kwargs[where] if isinstance(where, str) else args[where]) == value


def test_train_heads_heads_as_a_folder_is_a_one_line_error(tmp_path, capture):
    calls = capture("distill.train", "train")
    for args in (["--heads", "out/h"], ["--heads=out/h"]):
        r = run_distill(["train-heads", "--data", "d", *args], cwd=tmp_path)
        assert r.returncode == 2 and r.stderr.strip() == ("error: train-heads writes its folder to --out and takes the number "
                                                          "of heads as --num-heads (got --heads out/h)"), r.stderr
    assert not calls


def test_an_option_value_is_never_read_as_an_old_spelling(tmp_path, capture):
    calls = capture("distill.generate", "Generator")
    r = run_distill(["generate", "--system-prompt", "--topk", "-q"], cwd=tmp_path)
    assert "warning" not in r.stderr and first_config(calls).system_prompt == "--topk" and first_config(calls).topk == 20


def test_quiet_silences_calibrate_and_run_progress(tmp_path, capture):
    capture("distill.train.calibrate", "calibrate")
    loud = run_distill(["calibrate", "--heads", "h", "--data", "d"], cwd=tmp_path)
    quiet = run_distill(["calibrate", "--heads", "h", "--data", "d", "--quiet"], cwd=tmp_path)
    assert loud.stderr.startswith("calibrate: h on d") and quiet.stderr.strip() == "error: captured", (loud.stderr, quiet.stderr)

    import distill.pipeline

    class Pipeline:
        def __init__(self, cfg, progress=None):
            self.progress = progress

        def run(self, stages):
            if self.progress:
                self.progress("generate: running")
            raise Captured("captured")

    pipeline = tmp_path / "p.yaml"
    pipeline.write_text("run:\n  out: o\n")
    original = distill.pipeline.Pipeline
    distill.pipeline.Pipeline = Pipeline
    try:
        loud = run_distill(["run", str(pipeline)], cwd=tmp_path)
        quiet = run_distill(["run", str(pipeline), "-q"], cwd=tmp_path)
    finally:
        distill.pipeline.Pipeline = original
    assert "generate: running" in loud.stderr and quiet.stderr.strip() == "error: captured", (loud.stderr, quiet.stderr)


# -- serve: only what follows a literal `--` goes to vLLM -------------------------------------------------------
def test_serve_refuses_an_unknown_option_and_starts_nothing(capture):
    calls = capture("distill.serve", "serve")
    r = run_distill(["serve", "--topk", "3"])
    assert r.returncode == 2 and not calls
    assert [line for line in r.stderr.splitlines() if "--topk" in line and "No such option" in line], r.stderr
    r = run_distill(["serve", "--heads", "lookup", "stray"])
    assert r.returncode == 2 and not calls and "unexpected extra argument" in r.stderr


def test_serve_arguments_after_dashes_need_engine_vllm(capture):
    calls = capture("distill.serve", "serve")
    r = run_distill(["serve", "--heads", "lookup", "--", "--max-num-seqs", "4"])
    assert r.returncode == 2 and not calls
    assert r.stderr.strip() == "error: arguments after -- go to vLLM's server: they need --engine vllm (got --max-num-seqs 4)"


def test_serve_passes_what_follows_dashes_to_vllm():
    import json

    r = run_distill(["serve", "--engine", "vllm", "--heads", "lookup", "--print-command", "--", "--max-num-seqs", "4", "--topk"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["command"][-3:] == ["--max-num-seqs", "4", "--topk"]
    r = run_distill(["serve", "--engine", "vllm", "--api-key", "--", "--heads", "lookup", "--print-command"])
    assert r.returncode == 0 and "--" not in json.loads(r.stdout)["command"], r.stderr  # "--" was --api-key's value


# -- --help ------------------------------------------------------------------------------------------------------
def help_of(*command: str) -> str:
    r = run_distill([*command, "--help"], env=dict(os.environ, COLUMNS="200", TERM="dumb"))
    assert r.returncode == 0, r.stderr
    return r.stdout


def panels(text: str) -> list[str]:
    return re.findall(r"╭─ (.+?) ─", text)


def test_serve_and_train_heads_help_come_in_panels():
    assert panels(help_of("serve")) == ["Model", "Engine", "Lookup", "Server", "Output", "Config"]
    assert panels(help_of("train-heads")) == ["Data", "Model", "Training", "Medusa", "Medusa-2", "EAGLE-3", "Output", "Config"]
    for command in ("generate", "calibrate", "bench"):
        assert "Options" not in panels(help_of(command)), command  # every option has its panel


@pytest.mark.parametrize("command", [("serve",), ("train-heads",), ("data", "stats"), ("data", "validate"), ()])
def test_a_flag_shows_no_value_placeholder(command):
    text = help_of(*command)
    assert "<bool>" not in text
    flag = {"serve": "--print-command", "train-heads": "--resume"}.get(command[0] if command else "", "--help")
    line = next(line for line in text.splitlines() if f" {flag} " in line)
    assert not re.search(re.escape(flag) + r"\s+(-\w\s+)?<", line), line  # the flag, then its help: no <type> between


@pytest.mark.parametrize("command", ["inspect", "stats", "validate", "repair", "convert", "merge", "dedupe", "split"])
def test_data_usage_names_the_dataset(command):
    usage = next(line for line in help_of("data", command).splitlines() if "Usage:" in line)
    assert "{" not in usage and "DATASET" in usage, usage


@pytest.mark.parametrize("command", ["generate", "train-heads", "calibrate", "bench", "serve"])
def test_defaults_print_one_way(command):
    text = help_of(command)
    shown = re.findall(r"\[default: ([^\]]*)\]", text)
    assert shown and not [d for d in shown if d.startswith("(")], shown
    for restated in ("(default 64)", "(default 8000", "(default 10)", "(default 8).", "(default 127.0.0.1", "adaptive (default)"):
        assert restated not in text  # what the config holds is shown once, as [default: ...]
    assert not re.search(r"\d+(-\d+)?% tokens/step|BENCHMARKS\.md", text)
