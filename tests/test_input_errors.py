"""Bad input is one line on stderr and exit code 2, found before any heavy work, with nothing written.

Where a command would load a model, the tests give it ``--model`` a folder with a config.json and no weights
(:func:`weightless_model`): resolving it works, loading it fails with transformers' own error. An exit code 2 and
the expected line therefore show that the check came before the model was loaded, with no timing and no patching.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import DISTILL, REPO, TINY_ENC, run_distill, tiny_row, tiny_store
from distill.configs import check_types, config_from_options, stage_options, stage_section
from distill.errors import ConfigError, StoreError
from distill.store import encode_topk


# -- helpers -------------------------------------------------------------------------------------------------
def one_line_error(r: subprocess.CompletedProcess) -> str:
    """The error line of a command that failed as bad input must: exit 2, one line on stderr, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes): a command that refuses its input changes none."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def valid_row(i: int) -> dict:
    """conftest's tiny row with teacher candidates whose probabilities sum below 1 (it passes `distill data validate`)."""
    row = tiny_row(i)
    row["teacher_ids"], row["teacher_lp"] = encode_topk(np.array([[3, 4], [5, 6]]), np.array([[-0.1, -3.0], [-0.3, -2.5]]),
                                                        TINY_ENC)
    return row


@pytest.fixture()
def dataset(tmp_path) -> Path:
    """A valid two-shard dataset of six tiny rows, written by the shard store (no model, no vLLM)."""
    root = tmp_path / "data"
    store = tiny_store(root)
    store.write_shard([valid_row(i) for i in range(3)])
    store.write_shard([valid_row(i) for i in range(3, 6)])
    store.commit(complete=True)
    store.close()
    return root


@pytest.fixture()
def weightless_model(tmp_path) -> Path:
    """A model folder that resolves (it has a config.json) but cannot load (no weights): see the module docstring."""
    folder = tmp_path / "weightless-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return folder


@pytest.fixture()
def heads_folder(tmp_path) -> Path:
    """Tiny Medusa heads (hidden size 8, a 100-token vocabulary) saved as train-heads saves them."""
    from distill.heads.model import HeadsConfig, MedusaHeads

    folder = tmp_path / "heads"
    MedusaHeads(HeadsConfig(hidden_size=8, vocab_size=100, num_heads=2)).save(folder, extra={"teacher_dtype": "float32"})
    return folder


def closed_port() -> int:
    """A local port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- 1. every option value is type-checked against its field, naming the field and the type -----------------
@pytest.mark.parametrize("command, extra, item, line", [
    ("train-heads", ["--data", "{tmp}/data"], "lr=fast", "error: train option lr: expected float, got 'fast'"),
    ("train-heads", ["--data", "{tmp}/data"], "share_lm_head=1", "error: train option share_lm_head: expected bool, got 1"),
    ("generate", [], "temperature=hot", "error: generate option temperature: expected float, got 'hot'"),
    ("generate", [], "limit=[1, 2]", "error: generate option limit: expected int or null, got [1, 2]"),
    ("calibrate", ["--heads", "{tmp}/heads", "--data", "{tmp}/data"], "nodes=many",
     "error: calibrate option nodes: expected int, got 'many'"),
    ("bench", ["--heads", "{tmp}/heads"], "sweep_nodes=1,2,lots",
     "error: bench option sweep_nodes: expected a list of int (or comma-separated text), got '1,2,lots'"),
    ("serve", [], "port=http", "error: serve option port: expected int, got 'http'"),
])
def test_a_value_of_the_wrong_type_is_one_line_naming_the_field_and_the_type(tmp_path, command, extra, item, line):
    out = tmp_path / "out"
    args = [command, *(a.format(tmp=tmp_path) for a in extra), "--set", item]
    if command != "serve":
        args += ["--out", str(out)]
    assert one_line_error(run_distill(args)) == line
    assert not list(tmp_path.iterdir())  # no output folder, nothing else either


def test_a_config_file_value_of_the_wrong_type_is_refused_the_same_way(tmp_path):
    cfg = tmp_path / "p.yaml"
    cfg.write_text("train:\n  data: d\n  steps: many\n")
    assert one_line_error(run_distill(["train-heads", "-c", cfg, "--out", tmp_path / "out"])) == \
        "error: train option steps: expected int, got 'many'"
    assert [p.name for p in tmp_path.iterdir()] == ["p.yaml"]


def test_values_that_read_one_way_only_are_taken():
    """An int for a float; YAML 1.1's undotted exponent (``3e-3`` is text to it); comma-separated lists; a mapping's
    JSON text; the EAGLE-3 options' counts and layer lists."""
    from distill.bench.config import BenchConfig
    from distill.generate.config import GenerateConfig
    from distill.serve.config import ServeConfig
    from distill.train.config import TrainConfig

    train = config_from_options(TrainConfig, stage_options("train", None, ["lr=3e-3", "decay=1", "steps=5", "pack=true"],
                                                           {"data": "d"}), "train")
    assert (train.lr, train.decay, train.steps, train.pack) == (0.003, 1, 5, True)
    eagle = config_from_options(TrainConfig, {"data": "d", "arch": "eagle3", "draft_vocab": 32000, "aux_layers": [2, 15, 27]},
                                "train")
    assert (eagle.draft_vocab, eagle.aux_layers) == ("32000", "2,15,27")
    bench = config_from_options(BenchConfig, stage_options("bench", None, ["modes=greedy", "sweep_nodes=8", "limit="],
                                                           {"heads": "h"}), "bench")
    assert (bench.modes, bench.sweep_nodes, bench.limit) == (("greedy",), (8,), None)
    bench = config_from_options(BenchConfig, {"heads": "h", "sweep_nodes": "16,4"}, "bench")
    assert bench.sweep_nodes == (4, 16)
    gen = config_from_options(GenerateConfig, {"chat_template_kwargs": '{"enable_thinking": false}', "temperature": 0}, "generate")
    assert gen.chat_template_kwargs == {"enable_thinking": False} and gen.temperature == 0
    serve = config_from_options(ServeConfig, {"engine": "vllm", "heads": "h", "vllm_args": ["--enforce-eager"]}, "serve")
    assert serve.vllm_args == ("--enforce-eager",)
    with pytest.raises(ConfigError, match=r"^serve option vllm_args: expected a list of str \(or comma-separated text\), got 3$"):
        config_from_options(ServeConfig, {"engine": "vllm", "heads": "h", "vllm_args": 3}, "serve")


def test_serve_and_bench_hold_one_engine_config_built_from_their_flat_options():
    """The engine's settings live in EngineConfig alone: serve's and bench's configs nest one (``decoding``), built
    from the same flat keys as before, with each stage's own defaults where they differ from EngineConfig's."""
    from dataclasses import fields

    from distill.bench.config import BenchConfig
    from distill.engine.config import EngineConfig
    from distill.serve.config import ServeConfig

    engine_fields = {f.name for f in fields(EngineConfig)}
    for cls in (ServeConfig, BenchConfig):
        assert not engine_fields & {f.name for f in fields(cls)}, cls  # nothing re-declared
    serve = config_from_options(ServeConfig, stage_options("serve", None, ["typical_epsilon=0.2", "max-batch=3"],
                                                           {"tree": "3,2", "dtype": "float32", "adaptive": False}), "serve")
    assert isinstance(serve.decoding, EngineConfig)
    d = serve.decoding
    assert (d.typical_epsilon, d.max_batch, d.tree, d.dtype, d.adaptive) == (0.2, 3, "3,2", "float32", False)
    assert config_from_options(ServeConfig, {}, "serve").decoding.adaptive  # serve's default: the adaptive policy
    vllm = config_from_options(ServeConfig, {"engine": "vllm", "heads": "h", "max_batch": 5}, "serve")
    assert vllm.vllm_max_num_seqs == 5 and config_from_options(ServeConfig, {"engine": "vllm", "heads": "h"},
                                                               "serve").vllm_max_num_seqs is None  # vLLM's own
    bench = config_from_options(BenchConfig, {"heads": "lookup", "lookup_nodes": 4, "full_tree": True, "device": "cpu",
                                              "typical_delta": 0.5}, "bench")
    d = bench.decoding
    assert (d.lookup_nodes, d.speculate_max_batch, d.device, d.typical_delta, d.max_batch) == (4, 1, "cpu", 0.5, 1)
    assert bench.full_tree and not config_from_options(BenchConfig, {"heads": "h"}, "bench").full_tree
    assert bench.to_dict()["decoding"]["lookup_nodes"] == 4  # bench.json records the nested config
    for cls, stage in ((ServeConfig, "serve"), (BenchConfig, "bench")):
        with pytest.raises(ConfigError, match=f"^unknown {stage} option\\(s\\): speculate_max_batch$"):
            config_from_options(cls, {"heads": "h", "speculate_max_batch": 2}, stage)  # not one of the stage's keys
        with pytest.raises(ConfigError, match=f"^{stage} option typical_epsilon: expected float, got 'big'$"):
            config_from_options(cls, {"heads": "h", "typical_epsilon": "big"}, stage)


@pytest.mark.parametrize("path", sorted((REPO / "pipelines").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_pipeline_file_passes_the_type_check(path):
    from distill.bench.config import BenchConfig
    from distill.generate.config import GenerateConfig
    from distill.train.config import CalibrateConfig, TrainConfig

    doc = yaml.safe_load(path.read_text())
    classes = {"generate": GenerateConfig, "train": TrainConfig, "calibrate": CalibrateConfig, "bench": BenchConfig}
    checked = 0
    for stage, cls in classes.items():
        if stage in doc:
            section = {k: v for k, v in stage_section(path, stage).items() if not (stage == "bench" and k == "lookup")}
            check_types(cls, section, stage)  # raises on a mismatch
            checked += 1
    assert checked


# -- 2. `distill run` checks every section before its first stage --------------------------------------------
@pytest.mark.parametrize("sections, line", [
    ({"train": {"stepz": 5}}, "error: unknown train option(s): stepz"),
    ({"bench": {"limit": "many"}}, "error: bench option limit: expected int or null, got 'many'"),
    ({"calibrate": {"nodes": 0}}, "error: --nodes must be >= 1; got 0"),
    ({"split": {"eval_frac": 0.2}}, "error: unknown split option(s): eval_frac"),
    ({"split": {"eval_fraction": 1.5}}, "error: split: eval_fraction must be in (0, 1); got 1.5"),
    ({"validate": {"checksums": False}}, None),
])
def test_a_pipeline_with_a_bad_section_fails_before_generate_starts(tmp_path, sections, line):
    """No generate section: a run would start the default generate (500 conversations) before reaching the bad one."""
    out = tmp_path / "out"
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(yaml.safe_dump({"run": {"out": str(out)}, **sections}))
    got = one_line_error(run_distill(["run", pipeline]))
    assert got == line if line else "the validate stage takes no options" in got
    assert not out.exists()


def test_a_refused_pipeline_leaves_an_earlier_run_untouched(tmp_path):
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    (out / "pipeline.json").write_text(json.dumps({"format": "distill-pipeline/v1", "stages": {}}))
    (out / "data" / "manifest.json").write_text("{}")
    before = snapshot(out)
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(yaml.safe_dump({"run": {"out": str(out)}, "generate": {"limit": 4}, "train": {"lr": "fast"}}))
    assert one_line_error(run_distill(["run", pipeline])) == "error: train option lr: expected float, got 'fast'"
    assert snapshot(out) == before and sorted(p.name for p in out.iterdir()) == ["data", "pipeline.json"]


def test_the_quickstart_pipeline_passes_the_check(tmp_path):
    from distill.pipeline import Pipeline, PipelineConfig

    Pipeline(PipelineConfig.from_yaml(REPO / "pipelines" / "quickstart.yaml", {"out": str(tmp_path / "q")})).check()
    assert not (tmp_path / "q").exists()


# -- 3. a damaged shard is named, with the way out, before training or calibration start ---------------------
def test_train_heads_names_a_truncated_shard_and_suggests_repair(dataset, tmp_path, weightless_model):
    shard = dataset / "shard-00001.parquet"
    shard.write_bytes(shard.read_bytes()[:-100])
    before = snapshot(dataset)
    out = tmp_path / "heads-out"
    line = one_line_error(run_distill(["train-heads", "--data", dataset, "--out", out, "--model", weightless_model, "-q"]))
    assert line.startswith(f"error: {shard}: ") and f"run `distill data repair {dataset}`" in line, line
    assert not out.exists() and snapshot(dataset) == before


def test_calibrate_names_a_truncated_shard_and_suggests_repair(dataset, tmp_path, heads_folder, weightless_model):
    shard = dataset / "shard-00000.parquet"
    shard.write_bytes(shard.read_bytes()[:1000])
    before, heads_before = snapshot(dataset), snapshot(heads_folder)
    out = tmp_path / "calibrate-out"
    line = one_line_error(run_distill(["calibrate", "-q", "--heads", heads_folder, "--data", dataset, "--out", out,
                                       "--model", weightless_model]))
    assert line.startswith(f"error: {shard}: ") and f"run `distill data repair {dataset}`" in line, line
    assert not out.exists() and snapshot(dataset) == before and snapshot(heads_folder) == heads_before


def test_a_damaged_page_behind_a_whole_footer_is_named_when_read(dataset):
    """The early check reads footers only; a damaged page (same size, footer intact) is named by the reader that meets it."""
    from distill.train.data import iter_examples

    shard = dataset / "shard-00001.parquet"
    raw = bytearray(shard.read_bytes())
    raw[4:1004] = bytes(1000)  # the first pages, after the magic bytes
    shard.write_bytes(bytes(raw))
    with pytest.raises(StoreError, match=rf"^{shard}: not readable Parquet \(.*\); run `distill data repair {dataset}`"):
        list(iter_examples(dataset, max_len=64))


# -- 4. push with the Hub unreachable ------------------------------------------------------------------------
def test_push_to_an_unreachable_hub_is_one_line_and_uploads_nothing(dataset, tmp_path, cli_env):
    """A subprocess: huggingface_hub reads HF_ENDPOINT once, when it is imported."""
    port = closed_port()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(cli_env, HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_TOKEN="hf_distillTestToken0123456789abcdef",
               HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1", TMPDIR=str(scratch))
    before = snapshot(dataset)
    r = subprocess.run([DISTILL, "push", str(dataset), "--repo", "someone/data"], capture_output=True, text=True, env=env,
                       timeout=300)
    line = one_line_error(r)
    assert line.startswith(f"error: cannot reach the Hub (http://127.0.0.1:{port}): ") and "nothing was uploaded" in line, line
    assert "hf_distillTestToken" not in r.stdout + r.stderr
    assert snapshot(dataset) == before and not list(scratch.iterdir())  # not even staged


# -- 5. serve checks its port and its heads folder, bench and calibrate their heads folder, before loading -----
@pytest.fixture()
def held_port():
    """A port a listening socket holds for the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_serve_on_a_port_in_use_is_one_line_before_the_model_loads(held_port, weightless_model):
    line = one_line_error(run_distill(["serve", "--model", weightless_model, "--port", held_port]))
    assert line == (f"error: cannot serve on 127.0.0.1:{held_port}: another process listens there: stop it, or choose "
                    "another --port (0: any free port)")


def test_serve_with_vllm_on_a_port_in_use_is_one_line_before_vllm_starts(held_port, weightless_model, cli_env):
    """A subprocess: were the check missing, this process would become vLLM's server (exec)."""
    r = subprocess.run([DISTILL, "serve", "--engine", "vllm", "--heads", "lookup", "--model", str(weightless_model),
                        "--port", str(held_port)], capture_output=True, text=True, env=cli_env, timeout=300)
    assert one_line_error(r).startswith(f"error: cannot serve on 127.0.0.1:{held_port}: another process listens there")


@pytest.mark.parametrize("command", ["serve", "bench", "calibrate"])
def test_heads_that_are_not_a_heads_folder_are_one_line_before_the_model_loads(command, tmp_path, weightless_model, dataset):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    args = {"serve": ["serve", "--port", "0"], "bench": ["bench", "-q", "--out", out],
            "calibrate": ["calibrate", "-q", "--data", dataset, "--out", out]}[command]
    line = one_line_error(run_distill([*args, "--heads", empty, "--model", weightless_model]))
    assert line == (f"error: {empty} is not a heads folder (it has no config.json and no model.safetensors): "
                    "give the folder written by `distill train-heads`")
    assert not out.exists() and not list(empty.iterdir())
    missing = tmp_path / "missing"
    line = one_line_error(run_distill([*args, "--heads", missing, "--model", weightless_model]))
    assert line.startswith(f"error: {missing} is not a heads folder: no such folder") and not missing.exists()


def test_a_training_folder_without_its_heads_yet_points_to_resume(tmp_path, weightless_model):
    heads = tmp_path / "heads"
    (heads / "checkpoints" / "step-5").mkdir(parents=True)
    line = one_line_error(run_distill(["serve", "--heads", heads, "--model", weightless_model, "--port", "0"]))
    assert line.endswith("continue it with `distill train-heads --resume`")
