"""Model resolution: the bundled conversion (hash-checked, rebuilt if broken), local folders, Hub ids."""

from __future__ import annotations

import json
import shutil

import pytest

from distill.errors import HubUnreachableError, ModelError
from distill.models import CONVERSION_FILE, resolve_model, sha256_file


def test_bundled_conversion_is_reused_and_rebuilt_when_a_file_is_damaged(tmp_path, monkeypatch, model_dir):
    home = tmp_path / "home"
    shutil.copytree(model_dir, home / "models" / model_dir.name)
    monkeypatch.setenv("DISTILL_HOME", str(home))
    folder = home / "models" / model_dir.name
    reused = resolve_model(None)
    assert reused.path == folder and reused.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    weights.write_bytes(bytes(data))
    rebuilt = resolve_model(None)
    record = json.loads((rebuilt.path / CONVERSION_FILE).read_text())
    assert sha256_file(rebuilt.path / "model.safetensors") == record["files"]["model.safetensors"]
    assert rebuilt.revision == reused.revision  # the conversion is deterministic


def test_local_folder_and_bad_names(tmp_path, model_dir):
    local = resolve_model(str(model_dir))
    assert local.path == model_dir.resolve()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ModelError, match="neither"):
        resolve_model("not/a/hub/id")


def test_hub_id_without_network_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(HubUnreachableError, match="unreachable"):
        resolve_model("someone/some-model")
