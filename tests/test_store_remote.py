"""Datasets in an object store: the store, `distill generate --out s3://...` and the readers against a real
S3 server (moto's, started on 127.0.0.1 by this module), compared with the same runs into local folders."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import REPO, TRAINED_HEADS_OPTIONS, assert_same_rows, free_port, run_distill, tiny_row as _row, tiny_store as _store
from distill.errors import StoreError
from distill.generate import GenerateConfig, Generator
from distill.store import ShardStore, iter_rows, load_manifest
from distill.store.location import open_folder
from distill.store.lock import LOCK_FILE, ObjectLock

MOTO = Path(sys.executable).with_name("moto_server")
SCRIPT = REPO / "tests" / "scripts" / "generate_reporting.py"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server in its own process on 127.0.0.1, and the S3 client environment pointing at it."""
    import httpx

    port = free_port()
    log_path = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(MOTO), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(endpoint, timeout=2)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start:\n{log_path.read_text()[-2000:]}") from None
                time.sleep(0.2)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("AWS_ENDPOINT_URL_S3", endpoint)
            mp.setenv("AWS_ACCESS_KEY_ID", "testing")
            mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
            mp.delenv("AWS_PROFILE", raising=False)
            yield endpoint
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


@pytest.fixture()
def bucket(s3) -> str:
    """A new empty bucket for one test -> its s3:// URL."""
    import fsspec

    name = f"t-{uuid.uuid4().hex[:12]}"
    fs, _ = fsspec.core.url_to_fs(f"s3://{name}", use_listings_cache=False)
    fs.mkdir(name)
    return f"s3://{name}"


def _fs():
    import fsspec

    return fsspec.core.url_to_fs("s3://x", use_listings_cache=False)[0]


def _key(url: str) -> str:
    return url.removeprefix("s3://")




def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _leave_lock_of_a_killed_run(url: str, host: str | None = None) -> int:
    """What a run killed while it held ``url`` leaves: its lock object (a process that is gone)."""
    pid = _dead_pid()
    record = {"pid": pid, "host": host or socket.gethostname(), "started": "2026-01-01T00:00:00+0000", "token": "gone"}
    _fs().pipe_file(f"{_key(url)}/{LOCK_FILE}", json.dumps(record).encode())
    return pid


# -- the store ----------------------------------------------------------------------------------
def test_shards_in_s3_are_the_bytes_a_local_folder_gets_and_the_manifest_commits_them(bucket, tmp_path):
    url = f"{bucket}/ds"
    for root in (url, tmp_path):
        store = _store(root)
        for i in range(5):
            store.append([_row(i)])
            if store.pending == 3:
                store.flush()
        store.flush()
        store.commit(complete=True)
        store.close()
    remote, local = load_manifest(url), load_manifest(tmp_path)
    assert remote["shards"] == local["shards"] and [s["rows"] for s in remote["shards"]] == [3, 2]
    for s in remote["shards"]:  # byte for byte: the same SHA-256 and size as the local file
        assert _fs().cat_file(f"{_key(url)}/{s['file']}") == (tmp_path / s["file"]).read_bytes()
    assert list(iter_rows(url)) == list(iter_rows(tmp_path))
    names = sorted(p.rsplit("/", 1)[-1] for p in _fs().ls(_key(url), detail=False))
    assert names == ["manifest.json", "rejects.jsonl", "shard-00000.parquet", "shard-00001.parquet"]  # no journal, no lock left


def test_journal_entries_in_s3_survive_a_killed_run_and_a_damaged_one_is_dropped(bucket, caplog):
    url = f"{bucket}/ds"
    store = _store(url)
    for i in range(4):
        store.append([_row(i)])
    entries = sorted(p for p in _fs().ls(_key(url), detail=False) if "/journal-" in p)
    assert len(entries) == 4 and not [p for p in _fs().ls(_key(url), detail=False) if "shard-" in p]
    store._lock._token = None  # the run is killed: it never flushes, closes or releases anything ...
    dead = _leave_lock_of_a_killed_run(url)  # ... and its lock object stays behind
    damaged = bytearray(_fs().cat_file(entries[1]))
    damaged[-40] ^= 0xFF  # one entry damaged in the store: its checksum no longer matches
    _fs().pipe_file(entries[1], bytes(damaged))

    with caplog.at_level("WARNING", logger="distill.store"):
        again = _store(url)
    assert f"pid {dead}" in caplog.text and "took over" in caplog.text
    assert f"{entries[1].rsplit('/', 1)[-1]}: it" in caplog.text and "dropped, its conversations are generated again" in caplog.text
    assert again.done_ids() == {"s:0", "s:2", "s:3"}  # s:1 is generated again
    again.append([_row(1)])
    info = again.flush(order={f"s:{i}": i for i in range(4)})
    assert info.rows == 4 and [r["id"] for r in iter_rows(url)] == ["s:0", "s:1", "s:2", "s:3"]
    assert not [p for p in _fs().ls(_key(url), detail=False) if "/journal-" in p]  # compacted: entries deleted
    again.close()
    assert not _fs().exists(f"{_key(url)}/{LOCK_FILE}")


def test_an_unlisted_shard_is_adopted_or_set_aside_and_a_damaged_listed_one_is_refused_then_repaired(bucket, tmp_path):
    from distill.data.repair import repair

    url = f"{bucket}/ds"
    store = _store(url)
    store.write_shard([_row(0), _row(1)])
    store.close()
    # A crash between a shard's upload and the manifest's: the object is there, unlisted.
    local = _store(tmp_path)
    local.write_shard([_row(2)])
    local.close()
    _fs().put_file(str(tmp_path / "shard-00000.parquet"), f"{_key(url)}/shard-00001.parquet")
    _fs().pipe_file(f"{_key(url)}/shard-00002.parquet", b"PAR1 not a shard")
    again = _store(url)
    assert again.done_ids() == {"s:0", "s:1", "s:2"}
    assert [s["file"] for s in load_manifest(url)["shards"]] == ["shard-00000.parquet", "shard-00001.parquet"]
    assert _fs().exists(f"{_key(url)}/shard-00002.parquet.corrupt") and not _fs().exists(f"{_key(url)}/shard-00002.parquet")
    again.write_shard([_row(3)])
    assert load_manifest(url)["shards"][-1]["file"] == "shard-00003.parquet"  # never reuses a set-aside name
    again.close()

    _fs().pipe_file(f"{_key(url)}/shard-00001.parquet", b"replaced by something else")
    with pytest.raises(StoreError, match=r"shard-00001\.parquet: .*bytes, the manifest says .*distill data repair"):
        _store(url)
    report = repair(url)
    assert list(report.set_aside) == ["shard-00001.parquet"] and report.rows_dropped == 1
    assert _store(url).done_ids() == {"s:0", "s:1", "s:3"}  # s:2 is generated again


def test_one_writer_per_prefix_the_lock_is_a_conditional_create(bucket):
    url = f"{bucket}/ds"
    first = _store(url)
    with pytest.raises(StoreError, match=rf"being written by another run \(pid {os.getpid()} on "):
        _store(url)  # a live process of this host holds it: the server refused the second create
    first.close()
    _store(url).close()  # released: the next run takes it

    _leave_lock_of_a_killed_run(url, host="node-7")
    with pytest.raises(StoreError, match=rf"on node-7, .*remove {url}/{LOCK_FILE} and run again"):
        _store(url)  # another host's run: only a person knows it is over

    _fs().rm_file(f"{_key(url)}/{LOCK_FILE}")
    store = _store(url)
    store.write_shard([_row(0)])
    _fs().rm_file(f"{_key(url)}/{LOCK_FILE}")  # removed by hand while the run writes, and another run starts
    other = ObjectLock(open_folder(url)).acquire()
    with pytest.raises(StoreError, match="no longer holds this run's lock"):
        store.write_shard([_row(1)])
    assert [s["file"] for s in load_manifest(url)["shards"]] == ["shard-00000.parquet"]  # the manifest was not overwritten
    other.release()
    with pytest.raises(StoreError, match=r"shard-00001\.parquet exists already: another run writes"):
        with open_folder(url).new_file("shard-00001.parquet") as tmp:  # a shard object is never replaced
            tmp.write_bytes(b"another run's shard")


def test_bad_locations_are_one_line_errors(bucket, tmp_path):
    with pytest.raises(StoreError, match="create the bucket first"):
        _store(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/ds")
    with pytest.raises(StoreError, match=r"ftp:// is not a supported dataset location; use a local folder, file:///PATH, s3://"):
        open_folder("ftp://host/ds")
    with pytest.raises(StoreError, match=r"names this machine's files"):
        open_folder("file://elsewhere/ds")
    folder = open_folder(f"file://{tmp_path}/ds")
    assert folder.root == tmp_path / "ds" and not folder.remote


# -- distill generate into s3:// -----------------------------------------------------------------
def _gen_config(out, **extra) -> dict:
    return {**dict(backend="hf", seed="sharegpt", limit=4, shard_size=2, max_new_tokens=8, temperature=0.0, dtype="float32",
                   out=str(out)), **extra}


def test_generate_into_s3_writes_the_shards_a_local_run_writes(bucket, tmp_path, hf_backend):
    local = tmp_path / "local"
    ref = Generator(GenerateConfig(**_gen_config(f"file://{local}")), backend=hf_backend).run()  # file:// is the local folder
    url = f"{bucket}/sharegpt"
    got = Generator(GenerateConfig(**_gen_config(url)), backend=hf_backend).run()
    assert got.out == url and got.generated == ref.generated == 4 and got.balanced
    remote_manifest, local_manifest = load_manifest(url), load_manifest(local)
    assert remote_manifest["shards"] == local_manifest["shards"]  # names, sizes, SHA-256, counts
    for s in remote_manifest["shards"]:
        assert _fs().cat_file(f"{_key(url)}/{s['file']}") == (local / s["file"]).read_bytes()
    assert remote_manifest["totals"] == local_manifest["totals"]
    again = Generator(GenerateConfig(**_gen_config(url)), backend=hf_backend).run()  # resume: nothing left to do
    assert again.new_conversations == 0 and load_manifest(url)["shards"] == remote_manifest["shards"]


def test_a_generate_run_into_s3_killed_at_random_points_resumes_to_the_uninterrupted_result(bucket, tmp_path):
    options = _gen_config("", batch_size=1, limit=5)  # one sequence per call: tokens do not depend on what else is in flight
    reference = tmp_path / "reference"
    assert Generator(GenerateConfig(**{**options, "out": str(reference)})).run().generated == 5  # its own backend, batch 1
    url = f"{bucket}/killed"
    config = json.dumps({**options, "out": url})
    env = dict(os.environ, PYTHONPATH=str(REPO))
    rng = random.Random(6)
    durable: set[str] = set()
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, str(SCRIPT), config], env=env, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        first = proc.stdout.readline()  # a conversation is in the journal (an entry object)
        assert first.strip() == "FINISHED", first
        time.sleep(rng.uniform(0.0, 0.3))  # then a random point: mid-generation, mid-upload or mid-manifest
        os.killpg(proc.pid, signal.SIGKILL)
        rest = proc.stdout.read()
        proc.wait()
        assert "DONE" not in rest, "the kill came too late"
        finished = 1 + rest.count("FINISHED")
        gen = Generator(GenerateConfig(**{**options, "out": url}))  # the metadata the killed run wrote (no engine started)
        with ShardStore(url, gen.meta(), gen.config_key(), gen.enc.id_dtype) as store:  # takes the killed run's lock over
            after = store.done_ids()
        assert len(after) >= len(durable) + finished and durable <= after  # nothing reported finished was lost
        durable = after
    summary = Generator(GenerateConfig(**{**options, "out": url})).run()
    assert summary.generated == 5 and summary.new_conversations == 5 - len(durable)
    assert_same_rows(url, reference)
    assert not [p for p in _fs().ls(_key(url), detail=False) if "/journal-" in p or p.endswith(LOCK_FILE)]


# -- the readers ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def s3_dataset(s3, tmp_path_factory, hf_backend):
    """The same small dataset in a local folder and in a bucket: (URL, local path)."""
    import fsspec

    name = f"t-{uuid.uuid4().hex[:12]}"
    fsspec.core.url_to_fs(f"s3://{name}")[0].mkdir(name)
    local = tmp_path_factory.mktemp("readers") / "local"
    url = f"s3://{name}/sharegpt"
    for out in (local, url):
        assert Generator(GenerateConfig(**_gen_config(out)), backend=hf_backend).run().generated == 4
    return url, local


def _distill(*args, cwd=None) -> subprocess.CompletedProcess:
    """The command line, with the S3 client environment of the module's server (conftest.run_distill, in this process)."""
    return run_distill(args, cwd=cwd or REPO)


def test_validate_stats_convert_and_push_read_an_s3_dataset_as_they_read_the_local_one(s3_dataset, tmp_path):
    url, local = s3_dataset
    r = _distill("data", "validate", url)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr
    views = [_distill("data", "inspect", str(where), "--index", "1", "--json") for where in (url, local)]
    assert views[0].returncode == 0 and json.loads(views[0].stdout) == json.loads(views[1].stdout), views[0].stderr
    stats = {}
    for where in (url, local):
        r = _distill("data", "stats", str(where), "--json")
        assert r.returncode == 0, r.stderr
        stats[str(where)] = json.loads(r.stdout)
    assert stats[url]["path"] == url and {**stats[url], "path": ""} == {**stats[str(local)], "path": ""}
    for where, out in ((url, tmp_path / "remote.jsonl"), (local, tmp_path / "local.jsonl")):
        assert _distill("data", "convert", str(where), "--format", "openai", "--out", str(out)).returncode == 0
    assert (tmp_path / "remote.jsonl").read_bytes() == (tmp_path / "local.jsonl").read_bytes()
    for where, out in ((url, tmp_path / "push-remote"), (local, tmp_path / "push-local")):
        r = _distill("push", str(where), "--repo", "me/data", "--dry-run", str(out))
        assert r.returncode == 0, r.stderr
    files = sorted(p.relative_to(tmp_path / "push-local") for p in (tmp_path / "push-local").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "push-remote") for p in (tmp_path / "push-remote").rglob("*") if p.is_file())
    for f in files:  # the same repo, byte for byte (card included: it records no location)
        assert (tmp_path / "push-remote" / f).read_bytes() == (tmp_path / "push-local" / f).read_bytes(), f


def test_a_damaged_s3_dataset_fails_validate_and_writers_refuse_an_s3_out(s3_dataset, bucket, tmp_path):
    url, _ = s3_dataset
    copy = f"{bucket}/copy"
    _fs().copy(_key(url), _key(copy), recursive=True)
    manifest = load_manifest(copy)
    shard = f"{_key(copy)}/{manifest['shards'][0]['file']}"
    data = bytearray(_fs().cat_file(shard))
    data[len(data) // 2] ^= 0x01
    _fs().pipe_file(shard, bytes(data))  # same size, one bit flipped
    r = _distill("data", "validate", copy)
    assert r.returncode == 1 and "[checksum]" in r.stdout and "INVALID" in r.stdout
    r = _distill("data", "merge", url, copy, "--out", f"{bucket}/merged")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: --out {bucket}/merged: this command writes a local folder or file; only `distill generate --out` "
        "writes to an object store (the inputs may be URLs)"]
    r = _distill("data", "stats", "gs://bucket/ds")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "needs the gcsfs package" in r.stderr


def test_train_heads_and_calibrate_read_their_data_from_s3(s3_dataset, tmp_path):
    from distill.train import TrainConfig, train
    from distill.train.calibrate import CalibrateConfig, calibrate

    url, local = s3_dataset
    summary = train(TrainConfig(data=url, out=str(tmp_path / "heads"), **{**TRAINED_HEADS_OPTIONS, "steps": 2}))
    assert summary.steps == 2 and summary.tokens > 0
    record = json.loads((tmp_path / "heads" / "distill-heads.json").read_text())
    assert record["dataset"]["path"] == url and record["dataset"]["rows"] == 4
    trees = {}
    for where in (url, local):
        out = tmp_path / f"cal-{len(trees)}"
        calibrate(CalibrateConfig(heads=str(tmp_path / "heads"), data=str(where), out=str(out), nodes=3, max_len=64, plots=False))
        trees[str(where)] = json.loads((out / "tree.json").read_text())
    assert trees[url]["accuracy"] == trees[str(local)]["accuracy"] and trees[url]["paths"] == trees[str(local)]["paths"]
