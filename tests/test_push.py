"""`distill push`: the dry-run folder loads with `datasets` and its card parses; the upload reaches a real
HTTP server speaking the Hub API routes `huggingface_hub` uses (the Hub itself is unreachable here)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import DISTILL
from fakehub import TOKEN, FakeHub
from distill.data.transform import split
from distill.hub.card import CardOptions, reproduce_command, size_category
from distill.store import shard_schema

pytestmark = pytest.mark.vllm


def test_card_helpers():
    assert [size_category(n) for n in (0, 999, 1000, 250_000)] == ["n<1K", "n<1K", "1K<n<10K", "100K<n<1M"]
    with pytest.raises(ValueError, match="OWNER/NAME"):
        CardOptions("no-owner")
    meta = {"teacher": {"k": 4}, "config_key": {"model_id": "m/x", "seed": "sharegpt", "topk": 4, "temperature": 0.7},
            "derived": {"op": "split", "eval_fraction": 0.1, "from": {"op": "dedupe", "mode": "exact", "from": None}}}
    assert reproduce_command(meta).splitlines() == [
        "distill generate --model m/x --seed sharegpt --temperature 0.7 --teacher-topk 4 --out data",
        "distill data dedupe data --match exact --out data-deduped",
        "distill data split data --eval-fraction 0.1 --out data-split",
    ]


def test_the_reproduce_command_names_the_model_as_the_run_resolved_it():
    """The bundled conversion by its own name (not the Hub id its metadata records), a local folder by its name (not
    this machine's path), a Hub model by its id."""
    key = {"seed": "sharegpt", "topk": 4}
    bundled = {"teacher": {"k": 4}, "config_key": {**key, "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct"},
               "model": {"name": "smollm2-135m-instruct", "id": "HuggingFaceTB/SmolLM2-135M-Instruct",
                         "revision": "sha256:0123456789abcdef"}}
    assert reproduce_command(bundled) == ("distill generate --model smollm2-135m-instruct --seed sharegpt --teacher-topk 4 --out data"
                                          "  # --model: distill's bundled conversion of SmolLM2-135M-Instruct.Q4_1.gguf")
    local = {"teacher": {"k": 4}, "config_key": {**key, "model_id": "/home/me/models/my-chat"},
             "model": {"name": "/home/me/models/my-chat", "id": "/home/me/models/my-chat", "revision": "files:0123456789abcdef"}}
    assert reproduce_command(local) == ("distill generate --model my-chat --seed sharegpt --teacher-topk 4 --out data"
                                        "  # --model: a local folder, revision files:0123456789abcdef")
    hub = {"model": {"name": "Qwen/Qwen3-0.6B", "id": "Qwen/Qwen3-0.6B", "revision": "c1899de289a04d12100db370d81485cdf75e47ca"},
           "seed": {"spec": "sharegpt"}}
    assert reproduce_command(hub) == "distill data convert sharegpt --format shards --model Qwen/Qwen3-0.6B --out data"


def test_dry_run_folder_loads_as_a_dataset_with_a_valid_card(real_shards, tmp_path, cli_env):
    split(real_shards, tmp_path / "split", eval_fraction=0.3)
    out = tmp_path / "dry"
    r = subprocess.run([DISTILL, "push", str(tmp_path / "split"), "--repo", "someone/sharegpt-smol", "--dry-run", str(out),
                        "--license", "apache-2.0"], capture_output=True, text=True, env=cli_env, timeout=180)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    n_train, n_eval = summary["rows"]["train"], summary["rows"]["eval"]
    assert n_train + n_eval == 16 and n_eval > 0
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == summary["files"]
    assert {"README.md", "data/train/manifest.json", "data/eval/manifest.json", "data/train/rejects.jsonl"} <= set(files)

    from huggingface_hub import DatasetCard

    card = DatasetCard.load(out / "README.md")
    d = card.data
    assert d.license == "apache-2.0" and d.language == ["en"] and d.task_categories == ["text-generation"]
    assert d.size_categories == ["n<1K"]
    assert d.configs == [{"config_name": "default", "data_files": [{"split": "train", "path": "data/train/*.parquet"},
                                                                    {"split": "eval", "path": "data/eval/*.parquet"}]}]
    assert {s["name"]: s["num_examples"] for s in d.dataset_info["splits"]} == {"train": n_train, "eval": n_eval}
    text = card.text
    meta = json.loads((real_shards / "manifest.json").read_text())["meta"]
    for needle in (meta["model"]["id"], meta["model"]["revision"], "temperature 0.7", "distill generate ", "--eval-fraction 0.3",
                   "teacher_lp", "np.cumsum", "top-20"):
        assert needle in text, needle

    import datasets

    loaded = datasets.load_dataset(str(out), cache_dir=str(tmp_path / "cache"))
    assert set(loaded) == {"train", "eval"}
    assert (loaded["train"].num_rows, loaded["eval"].num_rows) == (n_train, n_eval)
    assert loaded["train"].features == datasets.Features.from_arrow_schema(shard_schema("uint16"))
    assert loaded["eval"][0]["messages"][0]["role"] == "user"


def test_push_refuses_an_invalid_dataset(real_shards, tmp_path, cli_env):
    import shutil

    ds = shutil.copytree(real_shards, tmp_path / "ds")
    (ds / "shard-00001.parquet").unlink()
    r = subprocess.run([DISTILL, "push", str(ds), "--repo", "a/b", "--dry-run", str(tmp_path / "dry")],
                       capture_output=True, text=True, env=cli_env, timeout=120)
    assert r.returncode == 2 and "shard-00001.parquet" in r.stderr and "not valid" in r.stderr


def test_push_uploads_through_huggingface_hub_to_a_local_endpoint(real_shards, tmp_path, cli_env):
    dry = tmp_path / "dry"
    env = dict(cli_env, HF_TOKEN=TOKEN, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1")
    r = subprocess.run([DISTILL, "push", str(real_shards), "--repo", "someone/smol-distill", "--dry-run", str(dry)],
                       capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    expected = {str(p.relative_to(dry)): p.read_bytes() for p in dry.rglob("*") if p.is_file()}

    with FakeHub() as hub:
        env["HF_ENDPOINT"] = hub.url
        cmd = [DISTILL, "push", str(real_shards), "--repo", "someone/smol-distill", "--private"]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        summary = json.loads(r.stdout)
        assert hub.created == [{"name": "smol-distill", "organization": "someone", "visibility": "private", "type": "dataset"}]
        assert len(hub.commits) >= 1 and all(c["path"] == "/api/datasets/someone/smol-distill/commit/main" for c in hub.commits)
        assert hub.commits[0]["summary"].startswith("distill push: 16 conversations")
        assert summary["commit_oid"] == hub.commits[-1]["oid"]
        assert hub.files == expected  # exactly the dry-run folder, byte for byte
        assert hub.validated and hub.validated[0]["content"] == expected["README.md"].decode()
        assert all(auth == f"Bearer {TOKEN}" for _, _, auth in hub.requests)
        for text in (r.stdout, r.stderr, hub.files["README.md"].decode()):
            assert TOKEN not in text and TOKEN[3:] not in text

        # Re-running resumes: every file is already there with the same content, so nothing is committed again.
        n_commits = len(hub.commits)
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        assert len(hub.commits) == n_commits
        assert TOKEN not in r.stdout + r.stderr

        # A wrong token is refused by the server and reported in one line, without echoing the token.
        bad = dict(env, HF_TOKEN="hf_wrongWrongWrong")
        r = subprocess.run(cmd, capture_output=True, text=True, env=bad, timeout=300)
        assert r.returncode == 2 and "HTTP 401" in r.stderr and "hf_wrongWrongWrong" not in r.stderr + r.stdout
    assert Path(real_shards / "manifest.json").is_file()
