"""Checkpoints are trusted only when checked: SHA-256 per file and finite tensors at --resume; a run whose loss turns NaN
stops with an error and writes nothing from it; unfinished saves left by a kill are removed on the next start."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from conftest import run_distill
from distill.errors import ConfigError
from distill.train import TrainConfig, train
from distill.train.checkpoint import CHECKSUMS, checkpoints, load_checkpoint, verify_checkpoint

ARGS = ["--num-heads", "2", "--share-lm-head", "--max-len", "32", "--batch-size", "2", "--steps", "3", "--save-every", "1",
        "--report-to", "none", "-q"]
TINY = dict(heads=2, share_lm_head=True, max_len=32, batch_size=2, steps=3, save_every=1, report_to="none", progress=False)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture()
def stopped(plain_shards, tmp_path, cli_env) -> Path:
    """A run stopped after its first step: OUT with checkpoints/step-000001."""
    out = tmp_path / "run"
    r = run_distill(["train-heads", "--data", plain_shards, "--out", out, *ARGS, "--stop-after", "1"], env=cli_env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert [p.name for p in checkpoints(out)] == ["step-000001"]
    return out


def test_two_changed_bytes_in_a_checkpoint_refuse_the_resume_in_one_line_and_write_nothing(stopped, plain_shards, cli_env):
    weights = stopped / "checkpoints" / "step-000001" / "trainable.safetensors"
    raw = bytearray(weights.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    for i in (header + 100, header + 101):  # inside the tensor data: the file still reads, its values differ
        raw[i] ^= 0xFF
    weights.write_bytes(bytes(raw))
    before = snapshot(stopped)
    r = run_distill(["train-heads", "--data", plain_shards, "--out", stopped, *ARGS, "--resume"], env=cli_env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: checkpoint {weights} does not match the SHA-256 written when it was saved"), r.stderr
    assert snapshot(stopped) == before and not (stopped / "model.safetensors").exists()


def test_a_checkpoint_holding_nan_with_matching_checksums_is_refused(stopped):
    folder = stopped / "checkpoints" / "step-000001"
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "trainable.safetensors"))
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = float("nan")  # a run that diverged and was saved so, checksums and all
    save_file(tensors, str(folder / "trainable.safetensors"))
    sums = json.loads((folder / CHECKSUMS).read_text())
    sums["sha256"]["trainable.safetensors"] = hashlib.sha256((folder / "trainable.safetensors").read_bytes()).hexdigest()
    (folder / CHECKSUMS).write_text(json.dumps(sums))
    verify_checkpoint(folder)  # the files are as saved
    with pytest.raises(ConfigError, match=f"trainable.safetensors: {name} holds non-finite values"):
        load_checkpoint(folder)
    (folder / CHECKSUMS).unlink()
    with pytest.raises(ConfigError, match=f"has no {CHECKSUMS}"):
        verify_checkpoint(folder)


def test_a_loss_that_turns_nan_stops_the_run_with_an_error_and_saves_nothing_from_it(plain_shards, tmp_path, cli_env, monkeypatch):
    from distill.train.trainer import HeadsTrainModule

    forward = HeadsTrainModule.forward

    def poisoned(self, batch, step):  # from the second step on, as a diverging run's loss turns
        loss, stats = forward(self, batch, step)
        return (loss * float("nan") if step >= 1 else loss), stats

    monkeypatch.setattr(HeadsTrainModule, "forward", poisoned)
    out = tmp_path / "run"
    r = run_distill(["train-heads", "--data", plain_shards, "--out", out, *ARGS], env=cli_env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: training diverged at step 2: the loss is nan; nothing was saved from it"), r.stderr
    assert [p.name for p in checkpoints(out)] == ["step-000001"] and not (out / "model.safetensors").exists()
    trainable, _, _ = load_checkpoint(checkpoints(out)[0])  # what was saved before is whole and finite
    assert all(bool(torch.isfinite(t).all()) for t in trainable.values())


def test_unfinished_checkpoint_saves_are_removed_on_the_next_start_with_one_log_line(plain_shards, tmp_path, caplog):
    out = tmp_path / "run"
    train(TrainConfig(data=str(plain_shards), out=str(out), stop_after=1, **TINY))
    stale = out / "checkpoints" / ".step-000002.k1ll3d.partial"  # a kill during the save of step 2
    stale.mkdir()
    (stale / "trainable.safetensors").write_bytes(b"half a file")
    with caplog.at_level("WARNING", logger="distill.train"):
        s = train(TrainConfig(data=str(plain_shards), out=str(out), resume=True, **TINY))
    lines = [r.getMessage() for r in caplog.records if "unfinished checkpoint" in r.getMessage()]
    assert lines == [f"removed 1 unfinished checkpoint save(s) left by an interrupted run in {out / 'checkpoints'}: {stale.name}"]
    assert s.steps == 3 and not stale.exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000003"]


def test_initial_weights_holding_nan_are_refused_before_the_first_step(plain_shards, tmp_path, cli_env, monkeypatch):
    import distill.train.trainer as trainer

    build = trainer.build_heads

    def damaged(backbone, cfg):  # as if the model's LM head, which the heads start from, held a NaN
        heads = build(backbone, cfg)
        with torch.no_grad():
            heads.blocks[1].layers[0].weight[0, 0] = float("inf")
        return heads

    monkeypatch.setattr(trainer, "build_heads", damaged)
    out = tmp_path / "run"
    r = run_distill(["train-heads", "--data", plain_shards, "--out", out, *ARGS], env=cli_env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: the weights training starts from hold non-finite values (NaN or inf) in heads.blocks.1."), r.stderr
    assert not checkpoints(out) and not (out / "metrics.jsonl").exists() and not (out / "model.safetensors").exists()
