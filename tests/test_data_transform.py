"""`distill data merge | dedupe | split` on real shards: new valid folders, inputs untouched, counts reported."""

from __future__ import annotations

import hashlib
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_distill
from distill.data.dataset import Dataset
from distill.data.transform import dedupe, eval_side, merge, split, split_key, user_text_key
from distill.data.validate import validate_dataset
from distill.errors import ConfigError
from distill.store import iter_rows
from distill.store.atomic import sha256_file

pytestmark = pytest.mark.vllm


def folder_digest(root):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def ids(root):
    return [r["id"] for r in iter_rows(root, columns=["id"])]


def test_split_is_deterministic_by_id_hash_and_leaves_the_input_alone(real_shards, tmp_path, cli_env):
    before = folder_digest(real_shards)
    r = run_distill(["data", "split", str(real_shards), "--eval-fraction", "0.3", "--out", str(tmp_path / "a"), "--shard-size", "4"],
                     env=cli_env)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    train, evals = ids(tmp_path / "a" / "train"), ids(tmp_path / "a" / "eval")
    assert summary["rows_out"] == {"train": len(train), "eval": len(evals)} and len(train) + len(evals) == 16
    assert not set(train) & set(evals)
    assert all(eval_side(i, 0.3) for i in evals) and not any(eval_side(i, 0.3) for i in train)
    for side in ("train", "eval"):
        report = validate_dataset(tmp_path / "a" / side)
        assert report.ok, [str(p) for p in report.problems]
    again = split(real_shards, tmp_path / "b", eval_fraction=0.3, shard_rows=100, by="id")
    assert ids(tmp_path / "b" / "eval") == evals and again.rows_out["train"] == len(train)
    assert folder_digest(real_shards) == before
    r = run_distill(["data", "split", str(real_shards), "--out", str(tmp_path / "a")], env=cli_env)
    assert r.returncode == 2 and "already exists" in r.stderr


def test_split_by_first_turn_keeps_conversations_that_open_alike_on_one_side(real_shards, tmp_path):
    """The default key: a repeated opening prompt (differently spaced / cased) never straddles train and eval."""
    source = Dataset.open(real_shards)
    rows = list(source.iter_rows())
    twins = []
    for i, row in enumerate(rows[:6]):  # six more rows opening like the first six, reworded only in case and spacing
        msgs = [dict(m) for m in row["messages"]]
        first = next(m for m in msgs if m["role"] == "user")
        first["content"] = "  " + first["content"].upper().replace(" ", "   ") + "\n"
        twins.append({**row, "id": f"{row['id']}-twin", "messages": msgs})
    from distill.data.write import ShardWriter

    w = ShardWriter(tmp_path / "with-twins", source.meta, source.id_dtype, 100)
    for row in rows + twins:
        w.add(row)
    w.close()
    keys = {split_key(r, "first-turn") for r in rows}
    fraction = next(f / 20 for f in range(1, 20) if len({eval_side(k, f / 20) for k in keys}) == 2)  # both sides used
    split(tmp_path / "with-twins", tmp_path / "s", eval_fraction=fraction, by="first-turn")
    side = {i: name for name in ("train", "eval") for i in ids(tmp_path / "s" / name)}
    assert len(side) == len(rows) + len(twins) and set(side.values()) == {"train", "eval"}
    for row in rows[:6]:
        assert side[row["id"]] == side[f"{row['id']}-twin"] == ("eval" if eval_side(split_key(row, "first-turn"), fraction) else "train")
    assert json.loads((tmp_path / "s" / "eval" / "manifest.json").read_text())["meta"]["derived"]["by"] == "first-turn"
    with pytest.raises(ConfigError, match="--by"):
        split(real_shards, tmp_path / "bad", by="length")
    low = min(f / 100 for f in range(1, 100) if any(eval_side(k, f / 100) for k in keys)) - 0.01  # no key below it
    with pytest.raises(ConfigError, match="left 'eval' empty"):
        split(real_shards, tmp_path / "empty", eval_fraction=low, by="first-turn")
    assert not (tmp_path / "empty").exists()  # nothing written


def test_merge_of_a_split_restores_every_row(real_shards, tmp_path):
    split(real_shards, tmp_path / "s", eval_fraction=0.4)
    summary = merge([tmp_path / "s" / "train", tmp_path / "s" / "eval"], tmp_path / "m", shard_rows=5)
    assert summary.rows_out == {"out": 16}
    assert sorted(ids(tmp_path / "m")) == sorted(ids(real_shards))
    assert validate_dataset(tmp_path / "m").ok
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert manifest["meta"]["derived"]["op"] == "merge" and manifest["totals"]["shards"] == 4
    assert manifest["meta"]["teacher"] == json.loads((real_shards / "manifest.json").read_text())["meta"]["teacher"]


def test_merge_refuses_repeated_ids_unless_told_to_skip(real_shards, tmp_path):
    with pytest.raises(ConfigError, match="already in an earlier input"):
        merge([real_shards, real_shards], tmp_path / "m")
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m.*"))  # nothing half-written is left
    summary = merge([real_shards, real_shards], tmp_path / "m2", skip_duplicate_ids=True)
    assert summary.rows_out == {"out": 16} and summary.dropped == {"duplicate_id": 16}


def test_dedupe_keeps_the_first_of_each_user_text(real_shards, tmp_path):
    rows = list(iter_rows(real_shards, columns=["id", "messages"]))
    expected, seen = [], set()
    for r in rows:
        key = tuple(m["content"] for m in r["messages"] if m["role"] == "user")
        if key not in seen:
            seen.add(key)
            expected.append(r["id"])
    assert len(expected) < 16  # the bundled ShareGPT seed repeats some user turns

    summary = dedupe(real_shards, tmp_path / "d", mode="exact")
    assert ids(tmp_path / "d") == expected
    assert summary.dropped == {"duplicate_exact": 16 - len(expected)}
    rejects = [json.loads(line) for line in (tmp_path / "d" / "rejects.jsonl").read_text().splitlines()]
    assert {r["id"] for r in rejects if r["stage"] == "dedupe"} == set(ids(real_shards)) - set(expected)
    assert validate_dataset(tmp_path / "d").ok


def test_dedupe_normalized_folds_case_and_whitespace(real_shards, tmp_path):
    ds = shutil.copytree(real_shards, tmp_path / "ds")
    original = next(iter_rows(real_shards))
    users = [m["content"] for m in original["messages"] if m["role"] == "user"]
    path = ds / "shard-00002.parquet"
    table = pq.read_table(path)
    rows = table.to_pylist()
    victim = rows[0]
    assert sum(m["role"] == "user" for m in victim["messages"]) == len(users)
    shouted = iter(users)
    for m in victim["messages"]:  # the first conversation's user turns, upper-cased and spaced out
        if m["role"] == "user":
            m["content"] = "  " + "   ".join(next(shouted).upper().split()) + "\n"
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path, compression="zstd")
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["shards"][2].update(bytes=path.stat().st_size, sha256=sha256_file(path))
    (ds / "manifest.json").write_text(json.dumps(manifest))
    assert validate_dataset(ds).ok

    assert user_text_key(victim["messages"], "normalized") == user_text_key(original["messages"], "normalized")
    assert user_text_key(victim["messages"], "exact") != user_text_key(original["messages"], "exact")
    exact = dedupe(ds, tmp_path / "e", mode="exact")
    norm = dedupe(ds, tmp_path / "n", mode="normalized")
    assert victim["id"] in ids(tmp_path / "e") and victim["id"] not in ids(tmp_path / "n")
    assert norm.dropped["duplicate_normalized"] >= 1
    assert norm.dropped.get("duplicate_exact", 0) == exact.dropped.get("duplicate_exact", 0)
    assert sum(norm.dropped.values()) + norm.rows_out["out"] == 16
    rejects = [json.loads(line) for line in (tmp_path / "n" / "rejects.jsonl").read_text().splitlines()]
    assert {"id": victim["id"], "reason": "duplicate_normalized"}.items() <= next(r for r in rejects if r["id"] == victim["id"]).items()
    assert validate_dataset(tmp_path / "n").ok


def test_dedupe_keeps_or_drops_a_continued_conversation_whole(real_shards, tmp_path):
    """A conversation split into rows (``#t<turn>``: a template that re-renders history) is keyed by its last row:
    one whose first row repeats another conversation but whose later turns do not is kept whole; one whose last
    row repeats another conversation is dropped whole."""
    from dataclasses import asdict

    from distill.store.shards import ShardInfo

    ds = shutil.copytree(real_shards, tmp_path / "ds")
    path = ds / "shard-00000.parquet"
    table = pq.read_table(path)
    rows = table.to_pylist()
    everything = list(iter_rows(real_shards))
    keys = [user_text_key(r["messages"], "exact") for r in everything]
    unique = [r for r, k in zip(everything, keys) if keys.count(k) == 1]
    first, a, b = rows[0], unique[-2], unique[-1]
    assert first["id"] not in (a["id"], b["id"])
    # x:kept opens as the dataset's first conversation, then continues with a's (unique) user turns
    # x:dropped opens with b's user turns, then its last row repeats the first conversation
    extra = [dict(first, id="x:kept"), dict(a, id="x:kept#t1"), dict(b, id="x:dropped"), dict(first, id="x:dropped#t1")]
    pq.write_table(pa.Table.from_pylist(rows + extra, schema=table.schema), path, compression="zstd")
    manifest = json.loads((ds / "manifest.json").read_text())
    entry = manifest["shards"][0]
    manifest["shards"][0] = asdict(ShardInfo.of_file(path, rejects=entry["rejects"])) | {"ids_first": entry["ids_first"]}
    (ds / "manifest.json").write_text(json.dumps(manifest))

    summary = dedupe(ds, tmp_path / "d", mode="exact")
    kept = ids(tmp_path / "d")
    assert {"x:kept", "x:kept#t1"} <= set(kept) and not {"x:dropped", "x:dropped#t1"} & set(kept)
    # a's conversation comes after x:kept, which now holds its user turns: a goes; b's turns are nobody's key but its own
    assert a["id"] not in kept and b["id"] in kept
    plain = dedupe(real_shards, tmp_path / "p", mode="exact")
    assert summary.dropped["duplicate_exact"] == plain.dropped["duplicate_exact"] + 3  # x:dropped's two rows and a
    rejects = {r["id"]: r for r in map(json.loads, (tmp_path / "d" / "rejects.jsonl").read_text().splitlines())}
    assert rejects[a["id"]]["detail"] == "same user turns (exact) as x:kept"
    assert rejects["x:dropped"]["detail"] == rejects["x:dropped#t1"]["detail"] == f"same user turns (exact) as {first['id']}"
