"""What a careless or hostile user does to a dataset folder, on real shards: no rerun blesses a bad dataset."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import DISTILL, run_distill
from distill.errors import StoreError
from distill.store import ShardStore, load_manifest
from distill.store.lock import LOCK_FILE, FolderLock

HOLD_LOCK = "import sys, time; from distill.store.lock import FolderLock; FolderLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(600)"


def _hold(folder):
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _folder(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_a_second_run_into_a_folder_a_run_writes_refuses_naming_it_and_the_first_ends_valid(tmp_path, cli_env):
    """Two `distill generate` runs into one folder: the second, started while the first holds the lock
    (paused there with SIGSTOP, so that it surely still does), exits 2 with one line naming the first's
    pid and writes nothing; the first then finishes and `distill data validate` passes its dataset."""
    out = tmp_path / "out"
    args = [DISTILL, "generate", "--backend", "hf", "--limit", "2", "--max-tokens", "8", "--out", str(out), "-q"]
    log = tmp_path / "first.log"
    with open(log, "w") as err:
        first = subprocess.Popen(args, env=cli_env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while _lock_pid(out) != first.pid:
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)
        before = _folder(out)
        r = run_distill(args[1:], env=cli_env)  # the second run in this test's process: the lock is the first's all the same
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and f"pid {first.pid}" in lines[0] and "being written by another run" in lines[0], r.stderr
        assert _folder(out) == before
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=600) == 0, log.read_text()[-2000:]
    assert load_manifest(out)["totals"]["complete"] is True
    r = run_distill(["data", "validate", str(out)], env=cli_env)
    assert r.returncode == 0 and r.stdout.strip().endswith(": OK"), r.stdout + r.stderr


def _lock_pid(folder) -> int | None:
    try:
        return json.loads((folder / LOCK_FILE).read_text() or "{}").get("pid")
    except (OSError, ValueError):
        return None


def test_the_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path, caplog):
    holder = _hold(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid  # its record is left behind
    with caplog.at_level("WARNING", logger="distill.store"):
        lock = FolderLock(tmp_path).acquire()
    assert f"pid {holder.pid}" in caplog.text and "took over" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()  # released: no lock file left, nothing to take over next time


def test_a_run_that_locks_the_file_its_holder_just_removed_starts_over_on_the_path(tmp_path, monkeypatch):
    """The holder ends between a second run's open and its flock: the second run locks an unlinked file, sees that
    the path no longer names it and locks the file there, so a third run is refused rather than writing alongside."""
    import fcntl

    first = FolderLock(tmp_path).acquire()
    flock, attempts = fcntl.flock, []

    def flock_after_the_holder_ended(fd, op):
        if op & fcntl.LOCK_EX:
            attempts.append(fd)
            if len(attempts) == 1:
                first.release()
        return flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_the_holder_ended)
    second = FolderLock(tmp_path).acquire()
    monkeypatch.undo()
    assert len(attempts) == 2  # the first try locked the file its holder then removed; the second, the file now there
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    with pytest.raises(StoreError, match="being written by another run"):
        FolderLock(tmp_path).acquire()
    second.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_record_the_disk_has_no_room_for_is_one_line_and_leaves_no_lock_file(tmp_path, monkeypatch):
    """A full disk while the lock records its holder: a one-line error, and no empty lock file left behind to pass for
    a run that was killed."""
    import errno

    real_write = os.write

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path / LOCK_FILE):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(StoreError) as exc:
        FolderLock(tmp_path).acquire()
    monkeypatch.undo()
    assert "\n" not in str(exc.value) and "no space left on the device while taking the folder's lock" in str(exc.value)
    assert list(tmp_path.iterdir()) == []
    FolderLock(tmp_path).acquire().release()  # the folder is free, with no warning to take over


@pytest.fixture()
def shards_copy(tmp_path, real_shards):
    out = tmp_path / "data"
    shutil.copytree(real_shards, out)
    (out / LOCK_FILE).unlink(missing_ok=True)
    return out


def _rerun(folder, backend):
    from distill.generate import GenerateConfig, Generator

    cfg = GenerateConfig(seed="sharegpt", out=str(folder), limit=16, shard_size=6, max_new_tokens=64, temperature=0.7,
                         dtype="float32", sampling_seed=0)  # the real_shards fixture's config
    return Generator(cfg, backend=backend).run()


def _flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_rerun_of_a_finished_folder_leaves_every_file_as_it_was(shards_copy, vllm_backend):
    """Nothing to do: no file is rewritten (same inode, same modification time), so a rerun does nothing at all."""
    def files():
        return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in shards_copy.iterdir() if p.is_file()}

    before = files()
    summary = _rerun(shards_copy, vllm_backend)
    assert summary.new_conversations == 0 and summary.balanced
    assert files() == before


def test_a_flipped_byte_is_refused_by_a_rerun_and_repair_lets_the_rerun_redo_the_shard(shards_copy, vllm_backend):
    from distill.data.repair import repair
    from distill.data.validate import validate_dataset

    shard = shards_copy / "shard-00001.parquet"
    _flip_byte(shard, 200)  # inside the data pages: the size is unchanged
    with pytest.raises(StoreError, match="shard-00001.parquet: SHA-256 differs") as err:
        _rerun(shards_copy, vllm_backend)
    assert "distill data repair" in str(err.value)
    report = repair(shards_copy)
    assert list(report.set_aside) == ["shard-00001.parquet"] and report.rows_dropped == 6
    assert (shards_copy / "shard-00001.parquet.corrupt").exists()
    summary = _rerun(shards_copy, vllm_backend)
    assert summary.generated == 16 and summary.balanced and summary.new_conversations == 6
    assert validate_dataset(shards_copy).ok


def test_a_flipped_byte_in_a_parquet_footer_is_refused_by_a_rerun_naming_the_shard(shards_copy, vllm_backend):
    from distill.data.repair import repair
    from distill.data.validate import validate_dataset

    shard = shards_copy / "shard-00001.parquet"
    data = shard.read_bytes()
    footer = int.from_bytes(data[-8:-4], "little")  # the footer's length, before the closing "PAR1"
    _flip_byte(shard, len(data) - 8 - footer // 2)  # inside the footer's file metadata
    with pytest.raises(StoreError, match="shard-00001.parquet: SHA-256 differs") as err:
        _rerun(shards_copy, vllm_backend)
    assert "distill data repair" in str(err.value)
    report = validate_dataset(shards_copy)
    assert not report.ok and any("shard-00001.parquet" in str(p) for p in report.problems), report.problems
    assert list(repair(shards_copy).set_aside) == ["shard-00001.parquet"]


def test_an_edited_row_count_is_refused_and_a_stray_shard_copy_is_set_aside(shards_copy, vllm_backend):
    manifest = load_manifest(shards_copy)
    edited = json.loads(json.dumps(manifest))
    edited["shards"][0]["rows"] += 1
    (shards_copy / "manifest.json").write_text(json.dumps(edited))
    with pytest.raises(StoreError, match="rows, the manifest says"):
        _rerun(shards_copy, vllm_backend)
    (shards_copy / "manifest.json").write_text(json.dumps(manifest))
    shutil.copy(shards_copy / "shard-00000.parquet", shards_copy / "shard-00007.parquet")  # a stray copy: duplicate ids
    summary = _rerun(shards_copy, vllm_backend)
    assert summary.generated == 16 and summary.new_conversations == 0
    assert (shards_copy / "shard-00007.parquet.corrupt").exists()
    assert load_manifest(shards_copy)["totals"]["rows"] == 16


def test_two_listed_shards_that_share_ids_are_refused_and_the_dataset_is_left_incomplete(shards_copy, vllm_backend):
    """A manifest that lists a copy of a shard, its size and SHA-256 right: the rerun's summary counts
    each id's rows and refuses (nothing to generate, so only the summary can find it)."""
    shutil.copy(shards_copy / "shard-00000.parquet", shards_copy / "shard-00007.parquet")
    manifest = load_manifest(shards_copy)
    manifest["shards"].append(dict(manifest["shards"][0], file="shard-00007.parquet"))
    (shards_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"holds 6 rows with an id that another row has too: run `distill data validate"):
        _rerun(shards_copy, vllm_backend)
    assert load_manifest(shards_copy)["totals"]["complete"] is False


def test_a_folder_without_rows_may_be_reused_with_another_config(tmp_path):
    key = {"model_id": "m", "topk": 2}
    with ShardStore(tmp_path, {"config_key": key}, key, "uint16") as store:
        store.commit()
    other = {"model_id": "m", "topk": 3}
    with ShardStore(tmp_path, {"config_key": other}, other, "uint16") as store:
        store.commit()
    assert load_manifest(tmp_path)["config_key"] == other


@pytest.fixture()
def converted_with_rejects(tmp_path):
    seed = tmp_path / "seed.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    rows = [good, {"messages": [{"role": "user", "content": ""}]}, {"messages": [{"role": "wizard", "content": "x"}]}, good]
    seed.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    out = tmp_path / "shards"
    r = run_distill(["data", "convert", str(seed), "--format", "shards", "--out", str(out)])
    assert r.returncode == 0, r.stderr
    return seed, out


def test_validate_cross_checks_rejects_against_the_manifest(converted_with_rejects):
    from distill.data.validate import validate_dataset

    _, out = converted_with_rejects
    counted = load_manifest(out)["totals"]["rejects_by_reason"]
    assert sum(counted.values()) >= 3 and validate_dataset(out).ok
    lines = (out / "rejects.jsonl").read_text().splitlines()
    (out / "rejects.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # cut short
    report = validate_dataset(out)
    assert not report.ok and any(p.check == "rejects" and "the manifest counts" in p.detail for p in report.problems)
    (out / "rejects.jsonl").unlink()
    report = validate_dataset(out)
    assert not report.ok and any(p.check == "rejects" and "missing" in p.detail for p in report.problems)


def _preview_without_local_paths(out, tmp_path):
    """`distill push --dry-run` of ``out``: the preview folder, checked to hold no byte of a local path."""
    preview = tmp_path / "preview"
    r = run_distill(["push", str(out), "--repo", "me/x", "--dry-run", str(preview)])
    assert r.returncode == 0, r.stderr
    local = str(tmp_path)
    files = [p for p in preview.rglob("*") if p.is_file()]
    assert len(files) >= 3
    for p in files:
        assert local.encode() not in p.read_bytes(), f"{p.relative_to(preview)} holds a local path"
    return preview


def test_a_pushed_dataset_holds_no_local_path(converted_with_rejects, tmp_path):
    seed, out = converted_with_rejects
    preview = _preview_without_local_paths(out, tmp_path)
    seed_meta = json.loads((preview / "data" / "train" / "manifest.json").read_text())["meta"]["seed"]
    assert seed_meta["spec"] == "seed.jsonl" and len(seed_meta["sha256"]) == 64


def test_an_hf_seed_of_a_local_folder_is_stored_and_pushed_as_its_name_and_hash(tmp_path):
    from distill.hub.push import public

    folder = tmp_path / "local_ds"
    folder.mkdir()
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (folder / "train.jsonl").write_text(json.dumps(row) + "\n")
    out = tmp_path / "shards"
    r = run_distill(["data", "convert", f"hf:{folder}", "--format", "shards", "--out", str(out)])
    assert r.returncode == 0, r.stderr
    seed_meta = load_manifest(out)["meta"]["seed"]
    assert seed_meta["spec"] == "hf:local_ds:train" and len(seed_meta["sha256"]) == 64
    _preview_without_local_paths(out, tmp_path)
    # a dataset whose metadata holds such a spec whole (made before it was cut to a name) is cut when pushed
    assert public({"seed": {"spec": f"hf:{folder}:train"}}) == {"seed": {"spec": "hf:local_ds:train"}}


def test_pathological_json_becomes_a_rejection_or_a_one_line_error(tmp_path):
    deep = 100_000
    jsonl = tmp_path / "deep.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * (17 << 20)}]})
    jsonl.write_text('{"messages": [{"role": "user", "content": ' + "[" * deep + "]" * deep + "}]}\n" + huge + "\n" + good + "\n")
    out = tmp_path / "out"
    r = run_distill(["data", "convert", str(jsonl), "--format", "shards", "--out", str(out)])
    assert r.returncode == 0, r.stderr
    reasons = [json.loads(line)["reason"] for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert reasons == ["malformed_json", "row_too_large"]
    doc = tmp_path / "deep.json"
    doc.write_text("[" * deep + "]" * deep)
    r = run_distill(["data", "convert", str(doc), "--format", "shards", "--out", str(tmp_path / "o2")])
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: seed file '{doc}' nests JSON deeper than Python's parser allows: not a list of conversations"]


def _victim(tmp_path):
    """A shard-like file outside every dataset folder, and a snapshot of the folder that holds it."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "f.parquet").write_bytes(b"not yours to touch\n")
    return victim, lambda: {p.name: p.read_bytes() for p in victim.iterdir()}


@pytest.mark.parametrize("escape", ["../victim/f.parquet", "ABSOLUTE"])
def test_a_manifest_entry_naming_a_file_outside_the_folder_is_refused_by_every_command(plain_shards, tmp_path, escape):
    """A shard entry whose ``file`` leaves the dataset folder: repair, convert and push --dry-run refuse with one
    line naming the entry, validate lists it as a problem (exit 1), and the file outside stays as it was."""
    victim, snapshot = _victim(tmp_path)
    before = snapshot()
    ds = tmp_path / "ds"
    shutil.copytree(plain_shards, ds)
    name = str(victim / "f.parquet") if escape == "ABSOLUTE" else escape
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["shards"][0]["file"] = name
    (ds / "manifest.json").write_text(json.dumps(manifest))
    runs = {
        "repair": ["data", "repair", ds],
        "convert": ["data", "convert", ds, "--format", "openai", "--out", tmp_path / "o.jsonl"],
        "push": ["push", ds, "--repo", "me/x", "--dry-run", tmp_path / "preview"],
    }
    for what, args in runs.items():
        r = run_distill(args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and "shards[0].file" in lines[0] and repr(name) in lines[0], (what, r.stderr)
        assert snapshot() == before, what
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "preview" / "data").exists()
    r = run_distill(["data", "validate", ds])
    assert r.returncode == 1 and "shards[0].file" in r.stdout + r.stderr, r.stdout + r.stderr
    with pytest.raises(StoreError, match=r"shards\[0\]\.file"):
        load_manifest(ds)
    assert snapshot() == before


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_kept(plain_shards, tmp_path):
    victim, snapshot = _victim(tmp_path)
    before = snapshot()
    ds = tmp_path / "ds"
    shutil.copytree(plain_shards, ds)
    (ds / LOCK_FILE).symlink_to("../victim/f.parquet")
    with pytest.raises(StoreError, match="symbolic link"):
        FolderLock(ds).acquire()
    r = run_distill(["data", "repair", ds])  # a command that takes the folder's lock
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and LOCK_FILE in lines[0] and "symbolic link" in lines[0], r.stderr
    (ds / LOCK_FILE).unlink()
    (ds / LOCK_FILE).symlink_to("../victim/new")  # dangling: O_CREAT would make the target
    with pytest.raises(StoreError, match="symbolic link"):
        FolderLock(ds).acquire()
    assert snapshot() == before and (ds / LOCK_FILE).is_symlink()


@pytest.mark.parametrize("target", ["f.parquet", "new"])
def test_a_journal_that_is_a_symlink_is_refused_and_its_target_kept(tmp_path, target):
    from conftest import tiny_row, tiny_store
    from distill.store.journal import JOURNAL

    victim, snapshot = _victim(tmp_path)
    before = snapshot()
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / JOURNAL).symlink_to(f"../victim/{target}")
    with pytest.raises(StoreError, match="symbolic link"):
        tiny_store(ds)
    assert snapshot() == before and (ds / JOURNAL).is_symlink()
    (ds / JOURNAL).unlink()
    store = tiny_store(ds)  # a link made while a run holds the folder: the next journal file is not written through it
    (ds / JOURNAL).symlink_to(f"../victim/{target}")
    with pytest.raises(StoreError, match="symbolic link"):
        store.append([tiny_row(0)])
    store.close()
    assert snapshot() == before


def test_a_shard_file_that_is_a_symlink_is_refused_and_its_target_kept(plain_shards, tmp_path):
    """A listed shard replaced by a link to a file elsewhere: reading the manifest refuses it, and so do the commands
    that would read, rename or copy it; the file the link points to stays as it was."""
    victim, snapshot = _victim(tmp_path)
    before = snapshot()
    ds = tmp_path / "ds"
    shutil.copytree(plain_shards, ds)
    first = json.loads((ds / "manifest.json").read_text())["shards"][0]["file"]
    (ds / first).unlink()
    (ds / first).symlink_to(victim / "f.parquet")
    with pytest.raises(StoreError, match="symbolic link"):
        load_manifest(ds)
    for args in (["data", "repair", ds], ["data", "convert", ds, "--format", "openai", "--out", tmp_path / "o.jsonl"]):
        r = run_distill(args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and "symbolic link" in lines[0], (args, r.stderr)
    assert snapshot() == before and not (tmp_path / "o.jsonl").exists()
