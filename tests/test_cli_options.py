"""The one options -> config path of the stage commands: file section < --set < command line; unknown keys; --help defaults."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import DISTILL
from distill.configs import stage_options
from distill.errors import ConfigError


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="250", TERM="dumb")
    return subprocess.run([DISTILL, *args], capture_output=True, text=True, env=env, timeout=300)


def test_file_then_sets_then_command_line(tmp_path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("calibrate:\n  nodes: 7\n  ranks: 3\ntrain:\n  lr: 0.5\n")
    assert stage_options("calibrate", cfg, ["ranks=4", "max-len=9"], {"nodes": 5, "out": tmp_path}) == {
        "nodes": 5, "ranks": 4, "max_len": 9, "out": str(tmp_path)}
    assert stage_options("generate", None, ["topk=a,b"], {}) == {"topk": "a,b"}  # YAML value: a string here
    with pytest.raises(ConfigError, match="--set takes KEY=VALUE"):
        stage_options("train", None, ["lr"], {})


def test_each_layer_reaches_the_stage_config(tmp_path):
    """A bad value names where it came from: the file, overridden by --set, overridden by the option."""
    cfg = tmp_path / "p.yaml"
    cfg.write_text("calibrate:\n  heads: h\n  data: d\n  nodes: -3\n")
    assert run("calibrate", "-c", str(cfg)).stderr.strip() == "error: --nodes must be >= 1; got -3"
    assert run("calibrate", "-c", str(cfg), "--set", "nodes=-2").stderr.strip() == "error: --nodes must be >= 1; got -2"
    assert run("calibrate", "-c", str(cfg), "--set", "nodes=-2", "--nodes", "0").stderr.strip() == "error: --nodes must be >= 1; got 0"


@pytest.mark.parametrize("command, stage", [("generate", "generate"), ("train-heads", "train"), ("calibrate", "calibrate"),
                                            ("bench", "bench"), ("serve", "serve")])
def test_an_unknown_key_is_a_one_line_error_naming_the_stage(tmp_path, command, stage):
    extra = ["--heads", str(tmp_path), "--data", str(tmp_path)] if command == "calibrate" else \
        ["--heads", str(tmp_path)] if command == "bench" else []
    r = run(command, *extra, "--set", "no_such_option=1")
    assert r.returncode == 2 and r.stderr.strip() == f"error: unknown {stage} option(s): no_such_option", r.stderr
    assert not list(tmp_path.iterdir())  # nothing written before the config was whole


def test_the_stage_configs_and_the_inspect_tokenizer_load_without_torch(model_dir):
    """--help, unknown options and `distill data inspect` read torch-free modules (importing torch for --help took seconds)."""
    import sys

    code = ("import importlib, sys, types\n"
            "from distill.cli import STAGE_CONFIGS\n"
            "for module, cls in STAGE_CONFIGS.values():\n"
            "    getattr(importlib.import_module(module), cls)\n"
            "from distill.data.inspect import load_tokenizer\n"
            "tok = load_tokenizer(types.SimpleNamespace(meta={}, root='data'), sys.argv[1])\n"
            "print(repr(tok.decode([tok.convert_tokens_to_ids('<|im_start|>')])))\n"
            "print(sorted(m for m in ('torch', 'vllm', 'transformers.modeling_utils') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split("\n")[:2] == ["'<|im_start|>'", "[]"], out.stdout + out.stderr[-2000:]


def test_help_shows_the_effective_defaults():
    out = run("train-heads", "--help").stdout
    assert "[default: 0.001]" in out  # TrainConfig.lr, though the option itself defaults to None
    help_of = out[out.index("--num-heads"):out.index("--layers")]
    assert "[default: 4]" in help_of  # TrainConfig.heads: the option's name is not the field's
    out = run("bench", "--help").stdout
    assert "[default: greedy,typical]" in out and "[default: 1,2,4,8,16,32,64]" in out
    out = run("serve", "--help").stdout
    help_of = out[out.index("--generation-config"):out.index("--chat-template")]
    assert "[default: auto]" in help_of  # ServeConfig.generation_config, though the option itself defaults to None


def test_compile_is_an_option_of_the_distill_engine_only():
    """--compile reaches serve's config; with --engine vllm it is one line, not a quiet no-op (vLLM compiles its own way)."""
    r = run("serve", "--engine", "vllm", "--compile", "--print-command")
    assert r.returncode == 2 and r.stderr.strip() == ("error: --compile compiles the distill engine's forwards: "
                                                     "vLLM compiles its own (see its -O levels)")
    for command in ("serve", "bench"):
        assert "--compile" in run(command, "--help").stdout


def test_cuda_graphs_is_an_option_of_the_distill_engine_only():
    """--cuda-graphs / --no-cuda-graphs reach serve's config; with --engine vllm either one is an error (vLLM has its own)."""
    for flag in ("--cuda-graphs", "--no-cuda-graphs"):
        r = run("serve", "--engine", "vllm", flag, "--print-command")
        assert r.returncode == 2 and r.stderr.strip() == ("error: --cuda-graphs sets the distill engine's CUDA graphs: "
                                                         "vLLM captures its own (--enforce-eager turns them off)")
    for command in ("serve", "bench"):
        assert "--no-cuda-graphs" in run(command, "--help").stdout
