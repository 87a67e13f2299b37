"""`distill run`: the whole loop end to end, skipping what is up to date, surviving a kill anywhere."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from safetensors.numpy import load_file

from conftest import DISTILL, REPO, run_distill
from distill.errors import ConfigError
from distill.pipeline import STAGES, PipelineConfig

pytestmark = pytest.mark.slow

# The quickstart's stages at CI size: transformers backend (no engine start), greedy, a few steps.
TINY = {
    "generate": {"seed": "sharegpt", "mode": "single-turn", "limit": 6, "temperature": 0.0, "max_new_tokens": 24,
                 "shard_size": 4, "backend": "hf", "dtype": "float32"},
    "split": {"eval_fraction": 0.3},
    "train": {"heads": 2, "share_lm_head": True, "max_len": 128, "batch_size": 2, "steps": 4, "save_every": 2, "lr": 0.003},
    "calibrate": {"nodes": 4, "max_len": 128},
    "bench": {"limit": 2, "max_tokens": 12, "modes": "greedy", "lookup": "data", "tree_acceptance": True},
}


def _write(tmp_path: Path, name: str, out: Path, **changes) -> Path:
    doc = {"run": {"out": str(out)}, **json.loads(json.dumps(TINY))}
    for stage, opts in changes.items():
        doc[stage].update(opts)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _run(pipeline: Path, env, *extra, process: bool = False) -> subprocess.CompletedProcess:
    """``distill run PIPELINE``: in this test's process (:func:`conftest.run_distill`), or as the console script."""
    if process:
        proc = subprocess.run([DISTILL, "run", str(pipeline), *extra], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    else:
        proc = run_distill(["run", str(pipeline), *extra], env=env, cwd=REPO)
    assert proc.returncode == 0, f"distill run failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc


def _status(stdout: str) -> dict[str, str]:
    rows = [line.split("|") for line in stdout.splitlines() if line.startswith("| ") and not line.startswith("| stage")]
    return {r[1].strip(): r[2].strip() for r in rows if r[1].strip() in STAGES}


def _artifacts(out: Path) -> dict:
    """What an interrupted run must reproduce exactly (timings aside)."""
    rows = []
    for s in json.loads((out / "data" / "manifest.json").read_text())["shards"]:
        t = pq.read_table(out / "data" / s["file"], columns=["id", "input_ids", "teacher_ids", "teacher_lp"])
        rows += t.to_pylist()
    split = {side: sorted(r["id"] for s in json.loads((out / "split" / side / "manifest.json").read_text())["shards"] if s["file"]
                          for r in pq.read_table(out / "split" / side / s["file"], columns=["id"]).to_pylist())
             for side in ("train", "eval")}
    heads = load_file(str(out / "heads" / "model.safetensors"))
    tree = json.loads((out / "calibrate" / "tree.json").read_text())
    return {"rows": sorted(rows, key=lambda r: r["id"]), "split": split, "heads": heads, "tree": tree["paths"]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One uninterrupted run of TINY: its folder (read only), its stdout, its wall seconds; shared by the tests below.

    A process, as the killed run below is one: its duration bounds the moment of the kill."""
    base = tmp_path_factory.mktemp("pipeline")
    env = dict(os.environ, HF_DATASETS_CACHE=str(base / "hf-datasets-cache"))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    start = time.monotonic()
    proc = _run(_write(base, "ref", base / "ref"), env, process=True)
    return base / "ref", proc.stdout, time.monotonic() - start


def test_pipeline_runs_every_stage_then_skips_them_and_reruns_only_what_a_changed_option_touches(tmp_path, cli_env,
                                                                                                  uninterrupted):
    ref, stdout, _ = uninterrupted
    assert _status(stdout) == {s: "ran" for s in STAGES}
    assert "tokens/step" in stdout and "speedup" in stdout
    bench = json.loads((ref / "bench" / "bench.json").read_text())
    assert bench["tree"]["nodes"] == 4  # the calibrated tree was the one benchmarked
    lookup = json.loads((ref / "bench" / "lookup" / "bench.json").read_text())  # and the lookup proposer beside it
    assert lookup["tree"]["proposer"] == "lookup" and "lookup + the data's n-grams (nothing trained), greedy:" in stdout
    # the trained drafter as the policy saw it: its full tree measured, the break-even, the nodes used, a GPU prediction
    from distill.bench.predict import step_ratio

    tau, even = bench["tree"]["full_tree_tokens_per_step"], bench["tree"]["break_even_at_batch_1"]["tokens_per_step"]
    used = bench["tree"]["nodes_used_at_batch_1"]
    assert 1.0 <= tau <= 5 and lookup["tree"]["full_tree_tokens_per_step"] is None  # the lookup row: as it was
    said = "the policy decoded plain at batch 1" if used == 0 else f"the policy used {used} node{'s' if used > 1 else ''} at batch 1"
    assert (f"\n  its full tree (4 nodes): {tau:.2f} tokens/step on these held-out prompts (greedy, untimed); this machine "
            f"breaks even at {even:.2f} tokens/step; {said}\n") in stdout
    ratio = step_ratio("medusa", 4)
    assert f"(a prediction, not measured): {tau:.2f} tokens/step / a step of {ratio:.2f}x = {tau / ratio:.2f}x" in stdout
    drafter = json.loads((ref / "pipeline.json").read_text())["stages"]["bench"]["summary"]["drafter"]
    assert drafter["full_tree_tokens_per_step"] == tau and drafter["gpu_prediction"]["speedup"] == tau / ratio
    assert lookup["config"]["decoding"]["lookup_data"].endswith("split/train") and "datastore" in lookup["tree"]["source"]
    assert json.loads((ref / "validate.json").read_text())["ok"] is True

    out = tmp_path / "a"
    shutil.copytree(ref, out)  # the finished run, moved: still up to date (paths inside it count relative to it)
    again = _run(_write(tmp_path, "a", out), cli_env)
    assert _status(again.stdout) == {s: "skipped" for s in STAGES}
    (tmp_path / "elsewhere").mkdir()  # and spelled another way
    spelled = _run(_write(tmp_path, "a", tmp_path / "elsewhere" / ".." / "a"), cli_env)
    assert _status(spelled.stdout) == {s: "skipped" for s in STAGES}

    # A calibrate option changes: calibrate runs again, its old output is kept aside, nothing before it reruns.
    changed = _run(_write(tmp_path, "a2", out, calibrate={"nodes": 3}), cli_env, "--stages", "generate,validate,split,train,calibrate")
    assert _status(changed.stdout) == {"generate": "skipped", "validate": "skipped", "split": "skipped", "train": "skipped",
                                       "calibrate": "ran"}
    assert json.loads((out / "calibrate" / "tree.json").read_text())["nodes"] == 3
    (stale,) = (out / "stale").iterdir()
    assert json.loads((stale / "tree.json").read_text())["nodes"] == 4


def test_pipeline_killed_at_a_random_point_resumes_to_the_uninterrupted_artifacts(tmp_path, cli_env, uninterrupted):
    ref_out, _, duration = uninterrupted
    out = tmp_path / "killed"

    seed = int(os.environ.get("DISTILL_KILL_SEED", random.randrange(1 << 30)))
    delay = random.Random(seed).uniform(3.0, 0.9 * duration)
    proc = subprocess.Popen([DISTILL, "run", str(_write(tmp_path, "killed", out))], env=cli_env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    state = json.loads((out / "pipeline.json").read_text())["stages"] if (out / "pipeline.json").exists() else {}
    killed_in = next((s for s in STAGES if not state.get(s, {}).get("complete")), "after the last stage")
    print(f"DISTILL_KILL_SEED={seed}: killed after {delay:.1f}s of {duration:.1f}s, in stage {killed_in}")

    resumed = _run(_write(tmp_path, "killed", out), cli_env)
    done_before = [s for s in STAGES if state.get(s, {}).get("complete")]
    assert all(_status(resumed.stdout)[s] == "skipped" for s in done_before)
    a, b = _artifacts(ref_out), _artifacts(out)
    assert b["rows"] == a["rows"], f"generated data differ (seed {seed}, killed in {killed_in})"
    assert b["split"] == a["split"] and b["tree"] == a["tree"]
    assert sorted(b["heads"]) == sorted(a["heads"])
    for name, tensor in a["heads"].items():
        assert abs(b["heads"][name] - tensor).max() <= 1e-5, f"{name} differs (seed {seed}, killed in {killed_in})"


def test_pipeline_files_with_unknown_sections_or_chained_paths_are_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"run": {"out": "x"}, "trian": {}}))
    with pytest.raises(ConfigError, match="unknown section"):
        PipelineConfig.from_yaml(bad)
    bad.write_text(yaml.safe_dump({"run": {"out": "x"}, "train": {"data": "elsewhere"}}))
    with pytest.raises(ConfigError, match="sets data"):
        PipelineConfig.from_yaml(bad)
    bad.write_text(yaml.safe_dump({"run": {"out": "x"}, "bench": {"lookup": "corpus"}}))
    with pytest.raises(ConfigError, match="lookup must be one of"):
        PipelineConfig.from_yaml(bad)
    cfg = PipelineConfig.from_yaml(REPO / "pipelines" / "quickstart.yaml", {"out": str(tmp_path / "q")})
    assert cfg.out == str(tmp_path / "q") and cfg.train["arch"] == "eagle3"


def test_set_overrides_one_option_per_stage_and_rejects_malformed_items(tmp_path):
    cfg = PipelineConfig.from_yaml(
        REPO / "pipelines" / "quickstart.yaml", {"out": str(tmp_path / "q")},
        sets=["train.steps=2", "generate.max-new-tokens=16", "bench.modes=greedy", "run.model=/m", "split.eval_fraction=0.5"],
    )
    assert cfg.train["steps"] == 2 and cfg.train["epochs"] == 2  # the file's other options stay
    assert cfg.generate["max_new_tokens"] == 16 and cfg.bench["modes"] == "greedy"
    assert cfg.model == "/m" and cfg.out == str(tmp_path / "q") and cfg.split["eval_fraction"] == 0.5
    for item, msg in [("train.steps", "STAGE.KEY=VALUE"), ("steps=2", "STAGE.KEY=VALUE"), ("trian.steps=2", "unknown section"),
                      ("train.steps=[1", "not valid YAML"), ("train.data=x", "sets data")]:
        with pytest.raises(ConfigError, match=msg):
            PipelineConfig.from_yaml(REPO / "pipelines" / "quickstart.yaml", sets=[item])
