"""The shard store on real Parquet: atomic commits, crash leftovers, damaged shards."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest

from distill.errors import StoreError
from distill.store import iter_rows, load_manifest
from conftest import TINY_KEY as KEY, tiny_row as _row, tiny_store as _store




def test_shards_and_manifest_are_committed_together_and_stream_back(tmp_path):
    store = _store(tmp_path)
    store.write_shard([_row(0), _row(1)])
    store.write_shard([], chunk_rejects=[{"id": "s:2", "source": "s", "stage": "generate", "reason": "context_length", "detail": ""}])
    store.write_shard([_row(3)])
    manifest = load_manifest(tmp_path)
    assert [s["rows"] for s in manifest["shards"]] == [2, 0, 1]
    assert manifest["totals"]["rows"] == 3 and manifest["totals"]["generated_tokens"] == 6
    assert [r["id"] for r in iter_rows(tmp_path)] == ["s:0", "s:1", "s:3"]
    store.close()
    again = _store(tmp_path)
    assert again.done_ids() == {"s:0", "s:1", "s:2", "s:3"}
    again.close()
    assert [json.loads(line)["id"] for line in open(tmp_path / "rejects.jsonl")] == ["s:2"]
    assert [p.name for p in tmp_path.glob(".*")] == []  # no temporary file left, and a run that ended leaves no lock file


def test_a_shard_renamed_in_before_the_crash_is_adopted_and_a_torn_one_set_aside(tmp_path, caplog):
    store = _store(tmp_path)
    store.write_shard([_row(0)])
    # A crash after the shard rename but before the manifest: simulate by dropping it from the manifest.
    store.write_shard([_row(1)])
    store.close()
    manifest = load_manifest(tmp_path)
    manifest["shards"] = manifest["shards"][:1]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    # A torn file that somehow got a shard name, and a temp file left mid-write.
    good = (tmp_path / "shard-00000.parquet").read_bytes()
    (tmp_path / "shard-00002.parquet").write_bytes(good[: len(good) // 2])
    (tmp_path / ".shard-00003.parquet.x.tmp").write_bytes(b"partial")

    with caplog.at_level("WARNING", logger="distill"):
        reopened = _store(tmp_path)
    assert reopened.done_ids() == {"s:0", "s:1"}
    assert (tmp_path / "shard-00002.parquet.corrupt").exists() and not list(tmp_path.glob(".*.tmp"))
    set_aside = [r.getMessage() for r in caplog.records if ".corrupt" in r.getMessage()]
    assert len(set_aside) == 1 and set_aside[0].startswith(f"{tmp_path}: set shard-00002.parquet aside as shard-00002.parquet.corrupt: ")
    assert "Parquet magic bytes not found" in set_aside[0]  # the reason: pyarrow's own words for the torn file
    assert [s["file"] for s in load_manifest(tmp_path)["shards"]] == ["shard-00000.parquet", "shard-00001.parquet"]
    reopened.write_shard([_row(4)])
    assert load_manifest(tmp_path)["shards"][-1]["file"] == "shard-00003.parquet"  # never reuses a set-aside name


def test_a_damaged_listed_shard_or_another_config_is_a_clear_error(tmp_path):
    store = _store(tmp_path)
    store.write_shard([_row(0)])
    store.close()
    with pytest.raises(StoreError, match="differs in: topk"):
        _store(tmp_path, {"model_id": "m", "topk": 3})
    path = tmp_path / "shard-00000.parquet"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 10)
    with pytest.raises(StoreError, match="damaged"):
        _store(tmp_path)
    os.unlink(path)
    with pytest.raises(StoreError, match="missing"):
        _store(tmp_path)


def test_file_metadata_is_in_every_shard(tmp_path):
    store = _store(tmp_path)
    store.write_shard([_row(0)])
    meta = json.loads(pq.read_schema(tmp_path / "shard-00000.parquet").metadata[b"distill"])
    assert meta["teacher"]["name"] == "rankgap-u16" and meta["config_key"] == KEY
