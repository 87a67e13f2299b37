"""What a hostile or unlucky user does to `distill generate`: a kill past a shard, a lock file removed mid-run, a full
disk, a read-only folder, an `--out` that is no folder, a seed row of endless turns. Real model (the vLLM engine and
the transformers backend), real files."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pytest

from conftest import DISTILL, assert_same_rows, run_distill
from distill.errors import StoreError
from distill.generate import GenerateConfig, Generator
from distill.generate.config import DEFAULT_MULTITURN_TURNS
from distill.store import iter_rows, load_manifest
from distill.store.lock import LOCK_FILE, FolderLock

pytestmark = pytest.mark.slow


def _seed(path: Path, turns: list[int]) -> Path:
    """A seed file of one conversation per entry of ``turns``, with that many user turns each."""
    colours = ["red", "green", "yellow", "blue"]
    rows = []
    for i, n in enumerate(turns):
        messages = []
        for t in range(n):
            messages += [{"role": "user", "content": f"Chat {i}, question {t}: name a {colours[t % 4]} fruit."},
                         {"role": "assistant", "content": "A fruit."}]
        rows.append({"id": str(i), "messages": messages})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != LOCK_FILE}


class Killed(Exception):
    """Stands for a SIGKILL: raised from the progress callback, it leaves the shards, the manifest and the journal as
    the kill would (every journal entry is fsynced when appended); on the way out only the lock is released."""


# -- a kill past a shard, then a resume ----------------------------------------------------------------------
@pytest.mark.parametrize("backend_fixture", [pytest.param("vllm_backend", marks=pytest.mark.vllm), "hf_backend"])
def test_a_run_resumed_after_a_kill_past_a_shard_equals_an_uninterrupted_run_within_one_step(request, backend_fixture,
                                                                                             tmp_path):
    """The conversations of the interrupted chunk that the journal holds are not generated again, so the rest of
    that chunk is batched without them: the documented bound (docs/generate.md, "What a resume reproduces") is the
    same tokens, messages and candidates, each logprob within one quantization step."""
    backend = request.getfixturevalue(backend_fixture)
    seed = _seed(tmp_path / "seed.jsonl", [1, 2, 3, 2, 1, 3, 2, 3])  # chunk 2 = rows 4-7; row 4 ends after one turn

    def cfg(out: Path) -> GenerateConfig:
        return GenerateConfig(seed=str(seed), out=str(out), shard_size=4, max_new_tokens=12, temperature=0.7,
                              dtype="float32")

    reference = tmp_path / "reference"
    assert Generator(cfg(reference), backend=backend).run().generated == 8

    out = tmp_path / "out"

    def kill_past_a_shard(conversations, tokens, total=None):
        if (out / "journal.arrow").exists() and any(s["file"] for s in load_manifest(out)["shards"]):
            raise Killed

    with pytest.raises(Killed):
        Generator(cfg(out), backend=backend, progress=kill_past_a_shard).run()
    assert [s["file"] for s in load_manifest(out)["shards"]] == ["shard-00000.parquet"]
    with pa.ipc.open_stream(out / "journal.arrow") as reader:
        assert reader.read_all().column("id").to_pylist() == ["seed:4"]  # finished before the kill: not generated again

    summary = Generator(cfg(out), backend=backend).run()
    assert summary.generated == 8 and summary.new_conversations == 3
    assert_same_rows(out, reference)
    assert [s["rows"] for s in load_manifest(out)["shards"]] == [s["rows"] for s in load_manifest(reference)["shards"]]


# -- a lock file removed by hand while its run goes on ----------------------------------------------------------
def _lock_pid(folder: Path) -> int | None:
    try:
        return json.loads((folder / LOCK_FILE).read_text() or "{}").get("pid")
    except (OSError, ValueError):
        return None


def test_a_second_run_refuses_when_the_first_runs_lock_file_was_removed(tmp_path, cli_env):
    """`rm OUT/.distill.lock` while a run writes OUT, then a second run: it refuses with one line naming the first's
    pid (from the lock the first holds on the folder itself) and writes nothing; the first then finishes a valid
    dataset with no shard beside the listed ones."""
    out = tmp_path / "out"
    args = ["generate", "--backend", "hf", "--limit", "2", "--max-tokens", "8", "--shard-size", "1", "--out", str(out), "-q"]
    log = tmp_path / "first.log"
    with open(log, "w") as err:
        first = subprocess.Popen([DISTILL, *args], env=cli_env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while _lock_pid(out) != first.pid:  # the record is written once both locks are held
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGSTOP)  # so that it surely still runs while the second starts
        (out / LOCK_FILE).unlink()
        before = _files(out)
        r = run_distill(args, env=cli_env)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and f"pid {first.pid}" in lines[0] and "removed by hand" in lines[0], r.stderr
        assert _files(out) == before and not (out / LOCK_FILE).exists()
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=600) == 0, log.read_text()[-2000:]
    manifest = load_manifest(out)
    assert manifest["totals"]["complete"] is True and manifest["totals"]["rows"] == 2
    assert sorted(p.name for p in out.glob("shard-*")) == sorted(s["file"] for s in manifest["shards"] if s["file"])
    r = run_distill(["data", "validate", str(out)], env=cli_env)
    assert r.returncode == 0 and r.stdout.strip().endswith(": OK"), r.stdout + r.stderr


def test_without_a_lock_on_the_folder_a_run_whose_lock_file_another_run_took_stops_before_its_manifest(tmp_path, monkeypatch):
    """Where a folder cannot be locked (NFS), the lock file alone holds: once another run holds a new lock file at the
    path, the first run's check before each manifest commit refuses; a lock file merely removed does not stop it."""
    monkeypatch.setattr(FolderLock, "_lock_folder", lambda self: None)
    first = FolderLock(tmp_path).acquire()
    (tmp_path / LOCK_FILE).unlink()
    first.verify()  # gone, nobody else: this run stays the writer
    second = FolderLock(tmp_path).acquire()
    with pytest.raises(StoreError, match=f"no longer this run's lock .*pid {os.getpid()}"):
        first.verify()
    second.verify()
    first.release()
    assert _lock_pid(tmp_path) == os.getpid()  # the second's file is its own: the first's release leaves it
    second.release()
    assert not (tmp_path / LOCK_FILE).exists()


# -- one line instead of a traceback: --out that is no folder, a read-only folder, a full disk -------------------
@pytest.mark.parametrize("kind", ["file", "dangling link", "below a file"])
def test_an_out_that_is_no_folder_is_one_line_and_left_as_it_was(tmp_path, cli_env, kind):
    target = tmp_path / "afile"
    target.write_bytes(b"keep me")
    out = {"file": target, "dangling link": tmp_path / "link", "below a file": target / "sub"}[kind]
    if kind == "dangling link":
        out.symlink_to(tmp_path / "missing")
    r = run_distill(["generate", "--backend", "hf", "--limit", "1", "--max-tokens", "4", "--out", str(out), "-q"], env=cli_env)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    expected = {"file": "is a file, not a folder", "dangling link": "which does not exist",
                "below a file": "a part of its path is a file"}[kind]
    assert len(lines) == 1 and lines[0].startswith(f"error: {out}") and expected in lines[0], r.stderr
    assert target.read_bytes() == b"keep me" and not (tmp_path / "missing").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["afile"] + (["link"] if kind == "dangling link" else []))


SMALL = dict(seed="mt-bench", mode="single-turn", limit=3, shard_size=1, max_new_tokens=4, temperature=0.0, dtype="float32")
SMALL_ARGS = ["generate", "--backend", "hf", "--seed", "mt-bench", "--mode", "single-turn", "--limit", "3", "--shard-size",
              "1", "--max-tokens", "4", "--temperature", "0", "--dtype", "float32", "-q"]


@pytest.fixture()
def finished(tmp_path, hf_backend) -> Path:
    out = tmp_path / "finished"
    assert Generator(GenerateConfig(out=str(out), **SMALL), backend=hf_backend).run().generated == 3
    return out


def _read_only(monkeypatch, folder: Path) -> None:
    """Every way distill writes or removes a file, refused inside ``folder`` with EROFS as a read-only mount refuses
    it (as root, chmod does not stop a write, and mounting needs privileges a test does not have)."""
    folder = str(folder.resolve())
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def inside(path) -> bool:
        return isinstance(path, (str, Path)) and os.path.abspath(path).startswith(folder)

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    real_open, real_mkdir = os.open, os.mkdir

    def open_(path, flags, *args, **kwargs):
        if inside(path) and flags & writes:
            refuse(path)
        return real_open(path, flags, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if inside(path):
            refuse(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "mkdir", mkdir)
    for name in ("replace", "rename", "unlink", "remove", "rmdir"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, **kw: refuse(a[0]) if inside(a[0]) else _real(*a, **kw))


@pytest.mark.parametrize("how", ["read-only file system", "chmod"])
def test_a_finished_folder_that_cannot_be_written_is_one_line_for_generate_and_repair(finished, cli_env, monkeypatch, how):
    before = _files(finished)
    if how == "chmod":
        finished.chmod(0o555)
        if os.access(finished, os.W_OK):  # root writes through it
            finished.chmod(0o755)
            pytest.skip("this user writes through chmod 0555 (root): the read-only file system case covers it")
        expected = "permission denied"
    else:
        _read_only(monkeypatch, finished)
        expected = "the file system is read-only"
    try:
        for args in (SMALL_ARGS + ["--out", str(finished)], ["data", "repair", str(finished)]):
            r = run_distill(args, env=cli_env)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {finished}"), r.stderr
            assert expected in lines[0] and "taking the folder's lock" in lines[0], r.stderr
    finally:
        finished.chmod(0o755)
    monkeypatch.undo()
    assert _files(finished) == before


def _full_disk_once(monkeypatch, out: Path, where: str) -> None:
    """ENOSPC from the writes of ``where`` once the first shard is committed: the journal's next append, the next
    shard (as pyarrow raises it), or the manifest that would list the second shard."""
    import pyarrow.parquet as pq

    def full():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "shard":
        real = pq.write_table
        monkeypatch.setattr(pq, "write_table", lambda *a, **kw: full() if (out / "shard-00000.parquet").exists() else real(*a, **kw))
        return
    real_fsync = os.fsync
    after = out / ("shard-00001.parquet" if where == "manifest" else "shard-00000.parquet")

    def fsync(fd):
        name = os.readlink(f"/proc/self/fd/{fd}")
        if after.exists() and Path(name).parent == out.resolve():
            if (where == "journal" and name.endswith("journal.arrow")) or (where == "manifest" and ".manifest.json." in name):
                full()
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize(("where", "named"), [("journal", "journal.arrow"), ("shard", "shard-00001.parquet"),
                                              ("manifest", "manifest.json")])
def test_a_full_disk_is_one_line_naming_the_file_and_the_rerun_completes_what_was_kept(hf_backend, tmp_path, monkeypatch,
                                                                                       where, named):
    reference = tmp_path / "reference"
    Generator(GenerateConfig(out=str(reference), **SMALL), backend=hf_backend).run()
    out = tmp_path / "out"
    _full_disk_once(monkeypatch, out, where)
    with pytest.raises(StoreError) as exc:
        Generator(GenerateConfig(out=str(out), **SMALL), backend=hf_backend).run()
    message = str(exc.value)
    assert "\n" not in message and message.startswith(f"{out / named}: no space left on the device"), message
    assert "run the same command again" in message
    monkeypatch.undo()
    kept = load_manifest(out)["shards"][0]  # the shard committed before the disk filled: listed and whole
    assert kept["file"] == "shard-00000.parquet" and kept["rows"] == 1
    assert not list(out.glob(".*.tmp")) and not (out / LOCK_FILE).exists()
    summary = Generator(GenerateConfig(out=str(out), **SMALL), backend=hf_backend).run()
    assert summary.generated == 3 and summary.balanced
    assert_same_rows(out, reference)
    r = run_distill(["data", "validate", str(out)])
    assert r.returncode == 0 and r.stdout.strip().endswith(": OK"), r.stdout + r.stderr


def test_a_full_disk_during_generate_is_one_line_on_the_command_line(tmp_path, cli_env, monkeypatch):
    out = tmp_path / "out"
    _full_disk_once(monkeypatch, out, "journal")
    r = run_distill(SMALL_ARGS + ["--out", str(out)], env=cli_env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {out / 'journal.arrow'}: no space left on the device"), r.stderr
    assert [s["file"] for s in load_manifest(out)["shards"]] == ["shard-00000.parquet"]


# -- a bound on one conversation's work ------------------------------------------------------------------------
LONG = DEFAULT_MULTITURN_TURNS + 1


def _long_seed(tmp_path: Path) -> Path:
    """One seed row of more user turns than the default bound."""
    seed = tmp_path / "long.jsonl"
    messages = [m for t in range(LONG) for m in ({"role": "user", "content": f"Q{t}?"}, {"role": "assistant", "content": "A."})]
    seed.write_text(json.dumps({"id": "long", "messages": messages}) + "\n")
    return seed


def _user_turns(row) -> int:
    return sum(t["role"] == "user" for t in row["turns"])


@pytest.mark.vllm
def test_a_seed_row_of_many_turns_stops_at_the_default_bound_and_the_row_says_so(vllm_backend, tmp_path):
    """Each turn is one engine call after another (vLLM, whose prefix cache keeps each call small): the row holds the
    first 64 user turns and ends as truncated_turns; the bound is in the dataset's metadata and resume key."""
    cut = tmp_path / "cut"
    cfg = GenerateConfig(seed=str(_long_seed(tmp_path)), out=str(cut), max_new_tokens=2, temperature=0.0, dtype="float32")
    assert Generator(cfg, backend=vllm_backend).run().generated == 1
    (row,) = list(iter_rows(cut))
    assert row["stop_reason"] == "truncated_turns" and _user_turns(row) == DEFAULT_MULTITURN_TURNS
    assert [m["content"] for m in row["messages"] if m["role"] == "user"][-1] == f"Q{DEFAULT_MULTITURN_TURNS - 1}?"
    manifest = load_manifest(cut)
    assert manifest["meta"]["generation"]["turns"] == manifest["config_key"]["turns"] == DEFAULT_MULTITURN_TURNS
    r = run_distill(["data", "validate", str(cut)])
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(("turns", "replayed", "stop_reason"), [(None, DEFAULT_MULTITURN_TURNS, "truncated_turns"),
                                                                (0, LONG, "completed"), (LONG + 10, LONG, "completed"),
                                                                (3, 3, "truncated_turns")])
def test_turns_raises_or_lowers_the_bound(tmp_path, tokenizer, model_dir, turns, replayed, stop_reason):
    """The same long seed row through the conversation state and the real chat template, with a fixed reply standing
    for the model's (the engine's part is the test above): --turns 0 or a larger N replays every turn."""
    import numpy as np

    from distill.generate.backends import Completion
    from distill.generate.runner import ConversationState
    from distill.models import stop_token_ids
    from distill.seeds import load_seed
    from distill.store import TeacherEncoding
    from distill.templating import ChatFormat

    seed = _long_seed(tmp_path)
    cfg = GenerateConfig(seed=str(seed), out=str(tmp_path / "out"), turns=turns, max_new_tokens=2)
    (conv,) = list(load_seed(str(seed)))
    stops = stop_token_ids(tokenizer, model_dir)
    fmt = ChatFormat(tokenizer, stops)
    reply_ids = tokenizer.encode("A.") + [min(stops)]
    k = cfg.topk
    reply = Completion(reply_ids, "stop", np.tile(np.arange(k), (len(reply_ids), 1)),
                       np.tile(-np.arange(k, dtype=np.float32), (len(reply_ids), 1)))
    state, limit = ConversationState(conv, cfg), 1 << 16
    while state.open_turn(fmt, cfg, limit):
        state.add_reply(reply, fmt, cfg)
    (row,), reject = state.result(TeacherEncoding.for_vocab(k, len(tokenizer)), cfg, limit)
    assert reject is None and _user_turns(row) == replayed and row["stop_reason"] == stop_reason
