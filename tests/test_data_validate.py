"""`distill data validate` on real generated shards: clean data passes, each kind of damage is named."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distill.data.validate import validate_dataset
from distill.store.atomic import sha256_file
from conftest import run_distill

pytestmark = pytest.mark.vllm


@pytest.fixture()
def ds(tmp_path, real_shards):
    """A private copy of the real shards that a test may damage."""
    return shutil.copytree(real_shards, tmp_path / "ds")


def rewrite_shard(root, name, edit_rows):
    """Rewrite one shard with edited rows (same schema and metadata) and fix its manifest entry,
    so only the row-level checks can notice the edit."""
    path = root / name
    table = pq.read_table(path)
    rows = edit_rows(table.to_pylist())
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path, compression="zstd")
    manifest = json.loads((root / "manifest.json").read_text())
    for s in manifest["shards"]:
        if s["file"] == name:
            s.update(bytes=path.stat().st_size, sha256=sha256_file(path))
    (root / "manifest.json").write_text(json.dumps(manifest))


def checks(report, file=None):
    return {p.check for p in report.problems if file is None or p.file == file}


def test_real_generated_shards_are_valid(real_shards):
    report = validate_dataset(real_shards)
    assert report.ok, [str(p) for p in report.problems]
    manifest = json.loads((real_shards / "manifest.json").read_text())
    assert report.shards == 3 and report.rows == 16 == manifest["totals"]["rows"]
    assert report.tokens == manifest["totals"]["prompt_tokens"] + manifest["totals"]["generated_tokens"]


def test_truncated_shard_is_named_with_nonzero_exit(ds, cli_env):
    path = ds / "shard-00001.parquet"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    report = validate_dataset(ds)
    assert {"size", "checksum", "unreadable"} <= checks(report, "shard-00001.parquet")
    assert checks(report) == checks(report, "shard-00001.parquet")  # nothing else blamed
    r = run_distill(["data", "validate", str(ds)], env=cli_env)
    assert r.returncode == 1
    assert "shard-00001.parquet: [unreadable]" in r.stdout and "INVALID" in r.stdout
    # the rows of the intact shards were still checked
    assert report.rows == 6 + 4


def test_flipped_byte_fails_the_checksum(ds):
    path = ds / "shard-00000.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    report = validate_dataset(ds)
    assert not report.ok
    assert "checksum" in checks(report, "shard-00000.parquet")
    assert "size" not in checks(report)


def test_missing_shard_is_reported(ds):
    (ds / "shard-00002.parquet").unlink()
    report = validate_dataset(ds)
    assert [(p.file, p.check) for p in report.problems] == [("shard-00002.parquet", "shard_missing")]


def test_unlisted_shard_is_reported(ds):
    shutil.copy(ds / "shard-00000.parquet", ds / "shard-00007.parquet")
    report = validate_dataset(ds)
    assert checks(report, "shard-00007.parquet") == {"shard_unlisted"}


def test_duplicated_id_is_named(ds):
    first_id = pq.read_table(ds / "shard-00000.parquet", columns=["id"])["id"][0].as_py()

    def dup(rows):
        rows[1]["id"] = first_id
        return rows

    rewrite_shard(ds, "shard-00002.parquet", dup)
    report = validate_dataset(ds)
    assert [(p.file, p.check, p.row) for p in report.problems] == [("shard-00002.parquet", "id", first_id)]
    assert "shard-00000.parquet" in report.problems[0].detail


def test_misaligned_teacher_column_is_named(ds):
    k = json.loads((ds / "manifest.json").read_text())["meta"]["teacher"]["k"]
    victim = {}

    def drop_last_position(rows):
        victim["id"] = rows[2]["id"]
        rows[2]["teacher_ids"] = rows[2]["teacher_ids"][:-k]
        rows[2]["teacher_lp"] = rows[2]["teacher_lp"][:-k]
        return rows

    rewrite_shard(ds, "shard-00001.parquet", drop_last_position)
    report = validate_dataset(ds)
    assert [(p.file, p.check, p.row) for p in report.problems] == [("shard-00001.parquet", "alignment", victim["id"])]
    assert f"k={k}" in report.problems[0].detail


def test_mask_and_turn_damage_is_named(ds):
    victims = {}

    def damage(rows):
        victims["mask"] = rows[0]["id"]
        rows[0]["loss_mask"] = rows[0]["loss_mask"][:-1]
        victims["roles"] = rows[1]["id"]
        rows[1]["messages"][1]["role"] = "user"
        victims["empty"] = rows[2]["id"]
        rows[2]["messages"][0]["content"] = "   "
        return rows

    rewrite_shard(ds, "shard-00000.parquet", damage)
    report = validate_dataset(ds)
    found = {(p.check, p.row) for p in report.problems}
    assert ("alignment", victims["mask"]) in found
    assert ("messages", victims["roles"]) in found
    assert ("messages", victims["empty"]) in found
    assert all(p.file == "shard-00000.parquet" for p in report.problems)


def test_undecodable_teacher_values_are_named(ds):
    victim = {}

    def corrupt(rows):
        victim["id"] = rows[0]["id"]
        lp = rows[0]["teacher_lp"]
        lp[0] = 0  # first candidate at probability 1 ...
        lp[1] = 0  # ... and the second too: the stored mass exceeds 1
        return rows

    rewrite_shard(ds, "shard-00002.parquet", corrupt)
    report = validate_dataset(ds)
    assert [(p.check, p.row) for p in report.problems] == [("teacher", victim["id"])]


def test_manifest_row_count_mismatch_is_named(ds):
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["shards"][0]["rows"] += 1
    (ds / "manifest.json").write_text(json.dumps(manifest))
    report = validate_dataset(ds)
    assert ("shard-00000.parquet", "row_count") in {(p.file, p.check) for p in report.problems}
    assert ("manifest.json", "manifest") in {(p.file, p.check) for p in report.problems}  # totals no longer add up
