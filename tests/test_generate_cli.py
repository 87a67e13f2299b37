"""The real `distill generate` console script: crash safety, resume, config files, one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq

from conftest import DISTILL, REPO, run_distill
from distill.store.atomic import sha256_file


def _cli(args, env, timeout=600, check=True, process=True):
    """``distill ARGS`` as the console script, or (``process=False``) in this test's process (:func:`conftest.run_distill`)."""
    if process:
        proc = subprocess.run([DISTILL, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    else:
        proc = run_distill(args, env=env, cwd=REPO, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"distill {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return proc


def _assert_consistent(out: Path, seed_ids_expected: int):
    manifest = json.loads((out / "manifest.json").read_text())
    listed = [s for s in manifest["shards"] if s["file"]]
    on_disk = sorted(p.name for p in out.glob("shard-*.parquet"))
    assert sorted(s["file"] for s in listed) == on_disk
    ids = []
    for s in listed:
        path = out / s["file"]
        table = pq.read_table(path)  # every shard reads back whole
        assert table.num_rows == s["rows"] and path.stat().st_size == s["bytes"] and sha256_file(path) == s["sha256"]
        ids += table["id"].to_pylist()
    assert len(ids) == len(set(ids)) == seed_ids_expected
    assert manifest["totals"]["rows"] == len(ids)
    return manifest, ids


def test_sigkill_midway_then_rerun_finishes_with_every_id_once(tmp_path, cli_env):
    out = tmp_path / "out"
    # 6 shards of 2 conversations, each of at most 2 replayed turns: a shard every few seconds, so the kill (at the
    # second) lands midway, and the runs stay short (a ShareGPT conversation replayed whole has up to a dozen turns)
    args = ["generate", "--backend", "vllm", "--seed", "sharegpt", "--limit", "12", "--shard-size", "2", "--turns", "2",
            "--max-tokens", "16", "--temperature", "0", "--dtype", "float32", "--out", str(out), "--quiet"]
    proc = subprocess.Popen([DISTILL, *args], env=cli_env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline:
            manifest = out / "manifest.json"
            if manifest.exists() and len(json.loads(manifest.read_text())["shards"]) >= 2:
                break
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.2)
        else:
            raise AssertionError("no shard written in time")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole process group, engine included
        proc.wait()
    killed_shards = len(json.loads((out / "manifest.json").read_text())["shards"])
    assert 2 <= killed_shards < 6, "the kill must land midway"

    first = _cli(args, cli_env)
    manifest, ids = _assert_consistent(out, 12)
    assert manifest["totals"]["complete"] is True
    assert "12 generated + 0 rejected + 488 skipped = 500 seed rows" in first.stdout
    assert not list(out.glob(".*.tmp"))

    # A finished run does nothing: no engine start, no file touched.
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = _cli(args, cli_env)
    assert "this run: 0 conversations" in again.stdout
    assert "Loading safetensors" not in again.stderr and "engine" not in again.stderr.lower()  # no engine started
    shard_mtimes = {k: v for k, v in before.items() if k.startswith("shard-")}
    assert shard_mtimes == {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.parquet")}


def test_pipeline_file_with_cli_overrides_and_a_larger_limit_continues(tmp_path, cli_env):
    out = tmp_path / "out"
    base = ["generate", "--config", "pipelines/sharegpt-medusa.yaml", "--backend", "hf", "--max-tokens", "8",
            "--out", str(out), "--quiet"]
    _cli(base + ["--limit", "2"], cli_env, process=False)  # the transformers backend: no engine of its own to start
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config_key"]["temperature"] == 0.7  # from the YAML
    assert manifest["config_key"]["max_new_tokens"] == 8  # from the CLI
    done = _cli(base + ["--limit", "3"], cli_env, process=False)
    _assert_consistent(out, 3)
    assert "this run: 1 conversations" in done.stdout


def test_a_different_config_into_the_same_folder_is_refused_and_nothing_is_lost(tmp_path, cli_env):
    out = tmp_path / "out"
    base = ["generate", "--seed", "mt-bench", "--backend", "hf", "--max-tokens", "8", "--limit", "1", "--out", str(out), "-q"]
    _cli(base, cli_env, process=False)
    before = {p.name: sha256_file(p) for p in out.iterdir()}
    proc = _cli(base + ["--temperature", "0.2"], cli_env, check=False, process=False)
    assert proc.returncode == 2
    assert "different config" in proc.stderr and "temperature" in proc.stderr and "Traceback" not in proc.stderr
    assert before == {p.name: sha256_file(p) for p in out.iterdir()}


def test_bad_input_gets_one_line_errors(tmp_path, cli_env):
    cases = [
        (["--seed", "no-such-seed"], "no-such-seed"),
        (["--seed", "sharegpt", "--mode", "sideways"], "--mode"),
        (["--seed", "sharegpt", "--teacher-topk", "0"], "--teacher-topk"),
        (["--seed", "sharegpt", "--config", str(tmp_path / "missing.yaml")], "not found"),
        (["--seed", "sharegpt", "--dtype", "float99"], "--dtype"),
    ]
    for extra, needle in cases:
        proc = _cli(["generate", "--backend", "hf", "--out", str(tmp_path / "o"), *extra], cli_env, check=False)
        assert proc.returncode == 2, proc.stderr
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], proc.stderr
        assert not (tmp_path / "o").exists(), extra  # refused before the output folder is made

    env = dict(cli_env, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_CACHE=str(tmp_path / "hub"))
    proc = _cli(["generate", "--model", "someone/some-model", "--backend", "hf", "--out", str(tmp_path / "o")], env, check=False)
    assert proc.returncode == 2 and "unreachable" in proc.stderr and "Traceback" not in proc.stderr
