"""The journal on real Arrow IPC files: durable appends, compaction into shards, damaged tails."""

from __future__ import annotations

import json
import logging

import pyarrow.parquet as pq
import pytest

from distill.errors import StoreError
from distill.store import iter_rows, load_manifest
from distill.store.journal import JOURNAL

from conftest import tiny_row as _row, tiny_store as _store

REJECT = {"id": "s:99", "source": "s", "stage": "generate", "reason": "context_length", "detail": "too long"}



def test_appended_rows_survive_a_crash_and_the_next_flush_compacts_them_into_one_shard(tmp_path):
    store = _store(tmp_path)
    for i in range(3):
        store.append([_row(i)])
    store.append([], [REJECT])
    assert store.pending == 4 and not list(tmp_path.glob("shard-*"))
    store._lock.release()  # a crash: no flush, no close; the journal file is all there is

    again = _store(tmp_path)
    assert again.pending == 4 and again.done_ids() == {"s:0", "s:1", "s:2", "s:99"}
    again.append([_row(3)])
    info = again.flush(order={"s:3": 0, "s:0": 1, "s:1": 2, "s:2": 3})
    assert info.rows == 4 and info.rejects == [REJECT]
    assert [r["id"] for r in iter_rows(tmp_path)] == ["s:3", "s:0", "s:1", "s:2"]  # the given order, one shard
    assert [r for r in iter_rows(tmp_path)][1] == _row(0) | {"teacher_ids": list(_row(0)["teacher_ids"]),
                                                          "teacher_lp": list(_row(0)["teacher_lp"])}
    assert not (tmp_path / JOURNAL).exists() and again.pending == 0
    manifest = load_manifest(tmp_path)
    assert manifest["totals"]["rows"] == 4 and manifest["totals"]["rejects"] == 1
    assert [json.loads(line)["id"] for line in open(tmp_path / "rejects.jsonl")] == ["s:99"]
    again.close()
    assert _store(tmp_path).done_ids() == {"s:0", "s:1", "s:2", "s:3", "s:99"}


@pytest.mark.parametrize("damage", ["torn", "zeros", "flipped"])
def test_a_damaged_tail_is_cut_off_with_a_warning_and_never_counted(tmp_path, caplog, damage):
    store = _store(tmp_path)
    store.append([_row(0)])
    store.append([_row(1), _row(2)])
    good = (tmp_path / JOURNAL).stat().st_size
    store.append([_row(3)])
    whole = (tmp_path / JOURNAL).read_bytes()
    store._lock.release()
    if damage == "torn":  # the process died while writing the last entry
        (tmp_path / JOURNAL).write_bytes(whole[: good + (len(whole) - good) // 2])
    elif damage == "zeros":  # the file grew but its last block never reached the disk
        (tmp_path / JOURNAL).write_bytes(whole[:good] + b"\0" * (len(whole) - good))
    else:  # a byte of the last entry's body changed
        data = bytearray(whole)
        pos = data.rfind(b"hi 3")
        data[pos + 3] = ord("X")
        (tmp_path / JOURNAL).write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="distill.store"):
        again = _store(tmp_path)
    assert again.done_ids() == {"s:0", "s:1", "s:2"}  # s:3 is generated again
    assert any("cut off" in r.message for r in caplog.records)
    assert (tmp_path / JOURNAL).stat().st_size == good  # rewritten without the bad tail
    again.append([_row(3)])
    again.flush()
    assert sorted(r["id"] for r in iter_rows(tmp_path)) == ["s:0", "s:1", "s:2", "s:3"]


def test_a_crash_between_the_shard_commit_and_the_journal_removal_counts_each_row_once(tmp_path):
    store = _store(tmp_path)
    store.append([_row(0), _row(1)])
    saved = (tmp_path / JOURNAL).read_bytes()
    store.flush()
    store._lock.release()
    (tmp_path / JOURNAL).write_bytes(saved)  # as if the process died before removing it
    again = _store(tmp_path)
    assert again.pending == 0 and not (tmp_path / JOURNAL).exists()
    assert load_manifest(tmp_path)["totals"]["rows"] == 2


def test_a_crash_after_the_shard_rename_before_the_manifest_adopts_the_shard_and_drops_the_journal_rows(tmp_path):
    store = _store(tmp_path)
    store.commit()  # as a run does when it starts
    store.append([_row(0), _row(1)])
    saved = (tmp_path / JOURNAL).read_bytes()
    manifest = (tmp_path / "manifest.json").read_bytes()
    store.flush()
    store._lock.release()
    (tmp_path / JOURNAL).write_bytes(saved)
    (tmp_path / "manifest.json").write_bytes(manifest)  # the shard is there, the manifest does not list it yet
    again = _store(tmp_path)
    assert again.pending == 0 and [s.rows for s in again.shards] == [2]
    assert sorted(r["id"] for r in iter_rows(tmp_path)) == ["s:0", "s:1"]


def test_a_journal_from_another_config_is_refused_and_kept(tmp_path):
    store = _store(tmp_path)
    store.append([_row(0)])
    store._lock.release()
    with pytest.raises(StoreError, match="generated with a different config"):
        _store(tmp_path, key={"model_id": "other", "topk": 2})
    assert _store(tmp_path).pending == 1  # nothing was lost


def test_shards_stay_large_whatever_the_appends(tmp_path):
    store = _store(tmp_path)
    for i in range(10):
        store.append([_row(i)])
        if store.pending >= 4:
            store.flush()
    store.flush()
    assert [pq.ParquetFile(p).metadata.num_rows for p in sorted(tmp_path.glob("shard-*.parquet"))] == [4, 4, 2]
