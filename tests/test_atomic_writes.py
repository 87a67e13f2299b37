"""Writers leave the old state, the whole new one, or (a heads save killed while moving its files in) a folder every reader
refuses; what they move into view is on disk first."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_distill
from distill.errors import ModelError
from distill.heads.eagle import is_eagle3_folder
from distill.heads.model import DISTILL_HEADS_FILE, HeadsConfig, MedusaHeads, read_distill_meta
from distill.store.atomic import COMMIT_INCOMPLETE, StagedFolder


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


def _write_died(self, folder, extra=None):
    (folder / "model.safetensors").write_bytes(b"half a file")
    raise Died()


#: Where a save of new heads over old ones dies: while writing the staged files, at the k-th rename into the
#: folder (model.safetensors, config.json, distill-heads.json), while removing the commit-in-progress file, or not.
KILL_POINTS = ["writing", 0, 1, 2, "unmark", None]


@pytest.mark.parametrize("die_at", KILL_POINTS)
def test_a_heads_save_over_old_heads_never_leaves_a_mix(tmp_path, monkeypatch, die_at):
    folder = tmp_path / "heads"
    old, new = _heads(0), _heads(1)
    old.save(folder, extra={"run": "old"})
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "keep.txt").write_text("training state")

    real_replace, real_unlink, seen = os.replace, Path.unlink, []

    def dying_replace(src, dst):
        if os.path.basename(os.path.dirname(os.fspath(src))).startswith(".staged."):
            if len(seen) == die_at:
                raise Died()
            seen.append(os.path.basename(os.fspath(dst)))
        real_replace(src, dst)

    def dying_unlink(self, *args, **kwargs):
        if self.name == COMMIT_INCOMPLETE and die_at == "unmark":
            raise Died()
        real_unlink(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", dying_replace)
        m.setattr(Path, "unlink", dying_unlink)
        if die_at == "writing":
            m.setattr(MedusaHeads, "write_files", _write_died)
        try:
            new.save(folder, extra={"run": "new"})
            finished = True
        except Died:
            finished = False

    assert finished == (die_at is None)
    assert (folder / "checkpoints" / "keep.txt").read_text() == "training state"  # other entries untouched
    if die_at is None:
        assert seen == ["model.safetensors", "config.json", DISTILL_HEADS_FILE]  # the markers go in last
    if die_at in (None, "writing"):  # the old set or the new one, whole, with its own metadata
        assert _same(MedusaHeads.load(folder), new if finished else old)
        assert read_distill_meta(folder) == {"run": "new" if finished else "old"}
        assert not (folder / COMMIT_INCOMPLETE).exists()
    else:  # interrupted while moving the set in: every reader refuses the folder, naming it
        for read in (MedusaHeads.load, read_distill_meta, is_eagle3_folder):
            with pytest.raises(ModelError, match=f"^{folder}: the save of its heads did not complete .* --resume"):
                read(folder)
        # what a reader that does not check (vLLM) finds: no config.json, or the new weights under it
        bare = tmp_path / "bare"
        shutil.copytree(folder, bare, ignore=shutil.ignore_patterns(COMMIT_INCOMPLETE, "checkpoints", ".staged.*"))
        if (bare / "config.json").exists():
            assert _same(MedusaHeads.load(bare), new)
        else:
            with pytest.raises(ModelError, match="not a heads folder"):
                MedusaHeads.load(bare)

    new.save(folder, extra={"run": "again"})  # the next save completes: the new set, readable again
    assert _same(MedusaHeads.load(folder), new) and read_distill_meta(folder) == {"run": "again"}
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoints", "config.json", DISTILL_HEADS_FILE, "model.safetensors"]


def test_heads_saved_without_distill_metadata_load_with_none(tmp_path):
    heads = _heads(2)
    heads.save(tmp_path / "foreign")  # vLLM's files only, as another tool writes them
    assert sorted(p.name for p in (tmp_path / "foreign").iterdir()) == ["config.json", "model.safetensors"]
    assert _same(MedusaHeads.load(tmp_path / "foreign"), heads) and read_distill_meta(tmp_path / "foreign") == {}


def test_a_staged_folder_is_on_disk_before_its_rename_and_its_new_name_after(tmp_path, monkeypatch):
    synced, real_fsync = [], os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))  # what the descriptor names at the time
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    with StagedFolder(tmp_path / "out") as stage:
        (stage.path / "sub").mkdir()
        (stage.path / "a.txt").write_text("a")
        (stage.path / "sub" / "b.txt").write_text("b")
        staged = stage.path
    assert sorted(synced[:-1]) == sorted(str(p) for p in (staged, staged / "a.txt", staged / "sub", staged / "sub" / "b.txt"))
    assert synced[-1] == str(tmp_path) and (tmp_path / "out" / "sub" / "b.txt").read_text() == "b"


def test_a_train_heads_run_killed_while_saving_leaves_no_mix_and_resumes_to_the_same_heads(real_shards, tmp_path, cli_env):
    args = ["train-heads", "--data", str(real_shards), "--num-heads", "2", "--share-lm-head", "--max-len", "32", "--context", "8",
            "--batch-size", "2", "--steps", "2", "--warmup-steps", "0", "--save-every", "1", "-q"]
    script = str(REPO / "tests" / "scripts" / "kill_at_rename.py")

    ref = tmp_path / "ref"  # the uninterrupted runs need no process of their own (conftest.run_distill)
    done = run_distill([*args, "--out", str(ref)], env=cli_env)
    assert done.returncode == 0, done.stderr[-2000:]
    reference = MedusaHeads.load(ref)

    for die_at in (1, 2):  # after the weights moved in (markers gone); before the last marker
        out = tmp_path / f"killed-{die_at}"
        run = subprocess.run([sys.executable, script, str(die_at), *args, "--out", str(out)],
                             capture_output=True, text=True, env=cli_env, timeout=900)
        assert run.returncode == -9, run.stderr[-2000:]
        with pytest.raises(ModelError, match="the save of its heads did not complete"):
            MedusaHeads.load(out)
        if die_at == 2:  # new weights and config, the metadata not yet in: the commands refuse it too, in one line
            export = run_distill(["export", "--heads", str(out), "--out", str(tmp_path / "export")], env=cli_env)
            assert export.returncode == 2 and not (tmp_path / "export").exists()
            assert export.stderr.strip().count("\n") == 0 and "the save of its heads did not complete" in export.stderr
        again = run_distill([*args, "--out", str(out), "--resume"], env=cli_env)
        assert again.returncode == 0, again.stderr[-2000:]
        assert _same(MedusaHeads.load(out), reference)
        assert json.loads((out / DISTILL_HEADS_FILE).read_text())["metrics"]["steps"] == 2
        assert not list(out.glob(".staged.*")) and not (out / COMMIT_INCOMPLETE).exists()  # the interrupted save is cleared
