"""Evaluation while training: the held-out figure train-heads logs is calibrate's, the best weights are kept in OUT/best,
and the metrics reach accelerate's trackers (TensorBoard event files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_distill
from distill.errors import ConfigError
from distill.train import TrainConfig, read_metrics, train


@pytest.fixture(scope="module")
def split_shards(tmp_path_factory, real_shards):
    """``real_shards`` split by conversation into train/ and eval/ (``distill data split``), read-only."""
    from distill.data import split

    out = tmp_path_factory.mktemp("split") / "sharegpt-split"
    summary = split(real_shards, out, eval_fraction=0.25)
    assert summary.rows_out["eval"] >= 2 and summary.rows_out["train"] >= 8, summary.rows_out
    return out


EVAL = dict(max_len=48, batch_size=2, eval_tokens=400, eval_nodes=8)  # what calibrate is given below, to read the same rows


def calibrated(heads, data, out, cli_env) -> dict:
    r = run_distill(["calibrate", "--heads", heads, "--data", data, "--out", out, "--nodes", EVAL["eval_nodes"], "--max-len",
                     EVAL["max_len"], "--batch-size", EVAL["batch_size"], "--eval-tokens", EVAL["eval_tokens"], "--no-plots", "-q"],
                    env=cli_env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads((out / "calibration.json").read_text())


def test_eval_while_training_logs_calibrates_figure_keeps_the_best_and_writes_tensorboard(split_shards, tmp_path, cli_env):
    out = tmp_path / "heads"
    run = run_distill(["train-heads", "--data", split_shards, "--out", out, "--num-heads", "2", "--share-lm-head", "--steps", "6",
                       "--lr", "3e-3", "--eval-every", "2", "--max-len", EVAL["max_len"], "--batch-size", EVAL["batch_size"],
                       "--eval-tokens", EVAL["eval_tokens"], "--eval-nodes", EVAL["eval_nodes"], "--report-to", "tensorboard", "-q"],
                      env=cli_env)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = read_metrics(out)
    evals = {r["step"]: r for r in rows if "eval_tree_acceptance" in r}
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and sorted(evals) == [2, 4, 6]  # at the interval, the end among them
    for r in evals.values():
        assert r["eval_tree_acceptance"] >= r["eval_chain_acceptance"] >= 1.0 and 0 < r["eval_tokens"] <= 400 + 2 * 48
        assert 0 <= r["eval_depth2_top1"] <= r["eval_depth2_top5"] <= 1 and "eval_depth3_top1" not in r
    figures = {s: r["eval_tree_acceptance"] for s, r in evals.items()}
    best = max(figures, key=lambda s: (figures[s], -s))  # the highest figure, the earliest on a tie

    meta = json.loads((out / "best" / "distill-heads.json").read_text())
    assert meta["metrics"]["best_eval"]["step"] == best and meta["metrics"]["steps"] == best
    from distill.store.atomic import sha256_file

    assert meta["dataset"]["name"] == "train"  # a split folder trains on its train side
    assert meta["dataset"]["manifest_sha256"] == sha256_file(split_shards / "train" / "manifest.json")
    final = json.loads((out / "distill-heads.json").read_text())["metrics"]
    assert final["best_eval"]["step"] == best and final["last_eval"]["step"] == 6
    line = next(line for line in run.stdout.splitlines() if "held-out expected tokens/step" in line)
    assert f"last step 6 {figures[6]:.3f}" in line and f"best step {best} {figures[best]:.3f}" in line and str(out / "best") in line

    # calibrate, on the same checkpoints and the same held-out rows, gives the figures that were logged
    for heads, step in ((out / "best", best), (out, 6)):
        doc = calibrated(heads, split_shards / "eval", tmp_path / f"calibrate-{step}", cli_env)
        assert doc["expected_acceptance_length"] == evals[step]["eval_tree_acceptance"], (step, doc["expected_acceptance_length"])
        assert doc["chain_expected_acceptance_length"] == evals[step]["eval_chain_acceptance"]
        assert doc["tokens"] == evals[step]["eval_tokens"] and doc["top1"][0] == evals[step]["eval_depth1_top1"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [e.step for e in logged.Scalars("eval_tree_acceptance")] == [2, 4, 6]
    assert [e.step for e in logged.Scalars("loss")] == [1, 2, 3, 4, 5, 6]
    assert logged.Scalars("eval_tree_acceptance")[-1].value == pytest.approx(figures[6])


def test_eagle3_is_evaluated_over_calibrates_depths_and_its_best_drafter_loads(split_shards, tmp_path):
    from distill.heads.eagle import EagleDrafter
    from distill.train.calibrate import EAGLE_CALIBRATED_DEPTHS

    out = tmp_path / "drafter"
    s = train(TrainConfig(data=str(split_shards / "train"), eval_data=str(split_shards), out=str(out), arch="eagle3", steps=2,
                          eval_every=0, report_to="none", lr=3e-3, seed=0, progress=False, **EVAL))
    rows = read_metrics(out)
    assert [r["step"] for r in rows if "eval_tree_acceptance" in r] == [2]  # --eval-every 0: at the end only
    assert f"eval_depth{EAGLE_CALIBRATED_DEPTHS}_top1" in rows[-1] and f"eval_depth{EAGLE_CALIBRATED_DEPTHS + 1}_top1" not in rows[-1]
    assert s.best_eval == s.last_eval == {"step": 2, "tree": rows[-1]["eval_tree_acceptance"], "chain": rows[-1]["eval_chain_acceptance"]}
    assert s.best == str(out / "best") and EagleDrafter.load(out / "best").vocab.size == EagleDrafter.load(out).vocab.size
    assert not (out / "tensorboard").exists()  # --report-to none: metrics.jsonl only
    for folder in (out, out / "best"):  # the held-out folder is recorded as --data is: near the folder, or by its name
        config = json.loads((folder / "distill-heads.json").read_text())["train_config"]
        assert str(split_shards) not in json.dumps(config) and Path(config["eval_data"]).name == split_shards.name


def test_eval_needs_a_tree_its_depths_can_hold_and_stays_off_where_asked(split_shards, tmp_path):
    opts = dict(data=str(split_shards), heads=1, steps=1, progress=False, **{**EVAL, "eval_nodes": 11})
    with pytest.raises(ConfigError, match="--eval-nodes 11 exceeds the 10 paths of 1 heads x top-10"):
        train(TrainConfig(out=str(tmp_path / "a"), **opts))
    assert not (tmp_path / "a").exists()  # refused before anything is written
    s = train(TrainConfig(out=str(tmp_path / "b"), eval_data="none", report_to="none", **opts))
    assert s.steps == 1 and not s.last_eval and not (tmp_path / "b" / "best").exists()
    assert "eval_tree_acceptance" not in read_metrics(tmp_path / "b")[-1]


def test_report_to_wandb_without_wandb_is_one_line_before_the_model_loads(split_shards, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="--report-to wandb needs the wandb package"):
        train(TrainConfig(data=str(split_shards), out=str(tmp_path / "w"), report_to="wandb", progress=False))
    assert not (tmp_path / "w").exists()
    with pytest.raises(ConfigError, match="--report-to must be one of tensorboard, wandb, none"):
        TrainConfig(data="d", report_to="mlflow")


def test_a_resumed_run_evaluates_and_picks_its_best_as_the_uninterrupted_run(plain_shards, tmp_path):
    """The best so far travels in the checkpoint: a run stopped and resumed logs the same figures and keeps the same best."""
    opts = dict(data=str(plain_shards), eval_data=str(plain_shards), heads=2, share_lm_head=True, steps=4, eval_every=2,
                lr=1e-2, report_to="none", seed=0, progress=False, **{**EVAL, "max_len": 32})
    straight = train(TrainConfig(out=str(tmp_path / "straight"), **opts))
    first = train(TrainConfig(out=str(tmp_path / "resumed"), stop_after=2, **opts))
    assert first.stopped_early and first.last_eval["step"] == 2
    from distill.train.checkpoint import latest_checkpoint, load_checkpoint

    assert load_checkpoint(latest_checkpoint(tmp_path / "resumed"))[2]["best_eval"] == first.best_eval == first.last_eval
    second = train(TrainConfig(out=str(tmp_path / "resumed"), resume=True, **opts))
    figures = [[(r["step"], r["eval_tree_acceptance"]) for r in read_metrics(tmp_path / run) if "eval_tree_acceptance" in r]
               for run in ("straight", "resumed")]
    assert figures[0] == figures[1] and [s for s, _ in figures[0]] == [2, 4]
    assert second.best_eval == straight.best_eval and second.last_eval == straight.last_eval
    best = json.loads((tmp_path / "resumed" / "best" / "distill-heads.json").read_text())["metrics"]["best_eval"]
    assert best == straight.best_eval
