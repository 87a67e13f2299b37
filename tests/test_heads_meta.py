"""distill-heads.json names no absolute path: paths relative to the heads folder in its tree, a folder's name and
content hash beyond it; the base model is found again from it (calibrate without --model), after a move, an export,
and from folders written with absolute paths. A shared-LM-head folder keeps its one copy of the LM head for vLLM."""

from __future__ import annotations

import json
import shutil

import pytest

from distill.errors import ConfigError
from distill.heads.model import base_model_location, portable_meta, relocated_meta
from distill.models import BUNDLED_HUB_ID


def _train(data, out):
    from distill.train import TrainConfig, train

    train(TrainConfig(data=str(data), out=str(out), heads=2, share_lm_head=True, max_len=32, batch_size=2, steps=1,
                      progress=False))


def test_trained_heads_record_their_data_and_model_without_absolute_paths(plain_shards, tmp_path):
    from distill.heads.export import export_heads
    from distill.models import convert_bundled, resolve_model
    from distill.train.calibrate import CalibrateConfig, calibrate

    root = tmp_path / "project"
    shutil.copytree(plain_shards, root / "data")
    _train(root / "data", root / "out" / "heads")
    text = (root / "out" / "heads" / "distill-heads.json").read_text()
    assert str(tmp_path) not in text
    meta = json.loads(text)
    assert meta["dataset"]["path"] == meta["train_config"]["data"] == "../../data" and meta["train_config"]["out"] == "."
    assert meta["base_model"]["id"] == BUNDLED_HUB_ID and "path" not in meta["base_model"]  # found again by its id

    moved = tmp_path / "moved"
    shutil.move(root, moved)  # the whole tree moves: the relative path still finds the data
    heads = moved / "out" / "heads"
    assert (heads / meta["dataset"]["path"] / "manifest.json").is_file()
    assert resolve_model(base_model_location(meta, heads)).path == convert_bundled()
    result = calibrate(CalibrateConfig(heads=str(heads), data=str(moved / "data"), out=str(tmp_path / "cal"), nodes=3,
                                       max_len=32, max_tokens=40, plots=False))  # no --model: the recorded base model
    assert result.nodes == 3

    near, far = moved / "exports" / "vllm", tmp_path / "a" / "b" / "c" / "vllm"
    export_heads(heads, near, "vllm")
    assert json.loads((near / "distill-heads.json").read_text())["dataset"]["path"] == "../../data"  # from the copy
    export_heads(heads, far, "vllm")
    exported = json.loads((far / "distill-heads.json").read_text())["dataset"]
    assert "path" not in exported and exported["name"] == "data"  # out of the copy's tree: its name and content hash
    from distill.store.atomic import sha256_file

    assert exported["manifest_sha256"] == sha256_file(moved / "data" / "manifest.json")


def test_folders_written_with_absolute_paths_still_find_their_model(tmp_path):
    model = tmp_path / "models" / "my-chat"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    heads = tmp_path / "elsewhere" / "far" / "away" / "heads"
    old = {"base_model": {"id": str(model), "revision": "files:0123456789abcdef", "path": str(model)}}
    assert base_model_location(old, heads) == str(model)  # an absolute path that still exists
    bundled = {"base_model": {"id": BUNDLED_HUB_ID, "revision": "sha256:0123456789abcdef", "path": "/gone/models/smol"}}
    assert base_model_location(bundled, heads) == BUNDLED_HUB_ID  # the bundled model moved with $DISTILL_HOME
    hub = {"base_model": {"id": "Qwen/Qwen3-0.6B", "revision": "c1899de289a04d12100db370d81485cdf75e47ca", "path": "/gone"}}
    assert base_model_location(hub, heads) == "Qwen/Qwen3-0.6B"

    new = portable_meta(old, heads)  # too far from the heads: the folder's name, its revision the content hash
    assert new["base_model"] == {"id": "my-chat", "revision": "files:0123456789abcdef"}
    with pytest.raises(ConfigError, match="local model folder 'my-chat' .*pass --model"):
        base_model_location(new, heads)
    near = portable_meta(old, tmp_path / "heads")
    assert near["base_model"]["path"] == "../models/my-chat" and base_model_location(near, tmp_path / "heads") == str(model)
    assert relocated_meta(near, tmp_path / "heads", heads)["base_model"] == new["base_model"]


def test_a_shared_lm_head_folder_keeps_one_copy_of_the_base_lm_head_for_vllm(plain_shards, tmp_path, hf_model):
    """vLLM's Medusa builds its own LM head for ``original_lm_head`` and fills it only from ``lm_heads.0.weight`` (it never
    takes the target's): the folder keeps that one copy, and no per-head copies."""
    from safetensors import safe_open

    _train(plain_shards, tmp_path / "heads")
    with safe_open(str(tmp_path / "heads" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        lm = f.get_tensor("lm_heads.0.weight")
    assert {n for n in names if n.startswith("lm_heads.")} == {"lm_heads.0.weight"}
    assert json.loads((tmp_path / "heads" / "config.json").read_text())["original_lm_head"] is True
    assert lm.equal(hf_model.get_output_embeddings().weight.detach().cpu().to(lm.dtype))
