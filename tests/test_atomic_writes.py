"""Writers leave the old state or the whole new one: heads folders (StagedFiles) and a train-heads run killed while saving."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from distill.errors import ModelError
from distill.heads.model import DISTILL_HEADS_FILE, HeadsConfig, MedusaHeads


class Died(BaseException):
    """Stands for the process dying between two renames (nothing after it runs)."""


def _heads(seed: int) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(HeadsConfig(hidden_size=8, vocab_size=16, num_heads=2))
    for p in heads.parameters():
        torch.nn.init.normal_(p)
    return heads


def _same(a: MedusaHeads, b: MedusaHeads) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("die_at", range(4))
def test_a_heads_save_over_old_heads_never_leaves_a_mix(tmp_path, monkeypatch, die_at):
    folder = tmp_path / "heads"
    old, new = _heads(0), _heads(1)
    old.save(folder, extra={"run": "old"})
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "keep.txt").write_text("training state")

    real, seen = os.replace, []

    def dying_replace(src, dst):
        if os.path.basename(os.path.dirname(os.fspath(src))).startswith(".staged."):
            if len(seen) == die_at:
                raise Died()
            seen.append(os.path.basename(os.fspath(dst)))
        real(src, dst)

    monkeypatch.setattr(os, "replace", dying_replace)
    try:
        new.save(folder, extra={"run": "new"})
        finished = True
    except Died:
        finished = False
    monkeypatch.setattr(os, "replace", real)

    assert finished == (die_at >= 3)
    assert seen[-2:] == ["config.json", DISTILL_HEADS_FILE] if finished else True  # the markers go in last
    assert (folder / "checkpoints" / "keep.txt").read_text() == "training state"  # other entries untouched
    try:
        loaded = MedusaHeads.load(folder)
    except ModelError as exc:  # an interrupted save: no heads there, never the new weights under the old config
        assert "not a heads folder" in str(exc) and not finished
        return
    if die_at == 0:
        assert _same(loaded, old) and json.loads((folder / DISTILL_HEADS_FILE).read_text())["run"] == "old"
    else:
        assert _same(loaded, new)
    if (folder / DISTILL_HEADS_FILE).exists():
        assert json.loads((folder / DISTILL_HEADS_FILE).read_text())["run"] == ("old" if die_at == 0 else "new")


def test_a_train_heads_run_killed_while_saving_leaves_no_mix_and_resumes_to_the_same_heads(real_shards, tmp_path, cli_env):
    args = ["train-heads", "--data", str(real_shards), "--heads", "2", "--share-lm-head", "--max-len", "32", "--context", "8",
            "--batch-size", "2", "--steps", "2", "--warmup-steps", "0", "--save-every", "1", "-q"]
    script = str(REPO / "tests" / "scripts" / "kill_at_rename.py")

    ref = tmp_path / "ref"
    done = subprocess.run([sys.executable, script, "99", *args, "--out", str(ref)], capture_output=True, text=True, env=cli_env, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    reference = MedusaHeads.load(ref)

    for die_at in (1, 2):  # after the weights moved in (markers gone); before the last marker
        out = tmp_path / f"killed-{die_at}"
        run = subprocess.run([sys.executable, script, str(die_at), *args, "--out", str(out)],
                             capture_output=True, text=True, env=cli_env, timeout=900)
        assert run.returncode == -9, run.stderr[-2000:]
        if die_at == 1:
            with pytest.raises(ModelError, match="not a heads folder"):
                MedusaHeads.load(out)
        else:  # new weights and config, the metadata marker not yet in: the new set, never the old
            assert _same(MedusaHeads.load(out), reference) and not (out / DISTILL_HEADS_FILE).exists()
        again = subprocess.run([sys.executable, script, "99", *args, "--out", str(out), "--resume"],
                               capture_output=True, text=True, env=cli_env, timeout=900)
        assert again.returncode == 0, again.stderr[-2000:]
        assert _same(MedusaHeads.load(out), reference)
        assert json.loads((out / DISTILL_HEADS_FILE).read_text())["metrics"]["steps"] == 2
        assert not list(out.glob(".staged.*"))  # the interrupted staging folder is cleared
