"""Model resolution: the bundled conversion (hash-checked, rebuilt if broken), local folders, Hub ids."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from distill import models
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
    # Two first runs at once (parallel `generate --part` runs): one converts, the other waits and reuses it.
    conversions = []
    real = models._convert_bundled
    monkeypatch.setattr(models, "_convert_bundled", lambda target: conversions.append(target) or real(target))
    with ThreadPoolExecutor(2) as pool:
        rebuilt, again = pool.map(lambda _: resolve_model(None), range(2))
    assert conversions == [folder] and again.path == rebuilt.path == folder
    record = json.loads((rebuilt.path / CONVERSION_FILE).read_text())
    assert sha256_file(rebuilt.path / "model.safetensors") == record["files"]["model.safetensors"]
    assert rebuilt.revision == again.revision == reused.revision  # the conversion is deterministic


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


def test_context_limit_is_the_models_context_less_the_trees_nodes_bounded_by_a_sliding_window():
    from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

    from distill.models import context_limit

    assert context_limit(LlamaConfig(max_position_embeddings=2048)) == 2048
    assert context_limit(LlamaConfig(max_position_embeddings=2048), tree_nodes=24) == 2024
    # a sliding window shorter than the context bounds it (the engine's cache keeps every token)
    assert context_limit(MistralConfig(sliding_window=4096, max_position_embeddings=32768), tree_nodes=24) == 4072
    # a window the layers do not use does not
    assert context_limit(Qwen2Config(use_sliding_window=False, sliding_window=4096, max_position_embeddings=32768)) == 32768
    some_sliding = Qwen2Config(use_sliding_window=True, sliding_window=4096, max_position_embeddings=32768,
                               num_hidden_layers=4, max_window_layers=2)
    assert context_limit(some_sliding) == 4096
    with pytest.raises(ModelError, match="--max-model-len"):
        context_limit(PretrainedConfig())  # no silent default
    with pytest.raises(ModelError, match="no room"):
        context_limit(LlamaConfig(max_position_embeddings=16), tree_nodes=15)


def test_the_engine_refuses_what_its_context_limit_refuses(hf_model, model_dir):
    """The engine's check uses the one rule: prompt + max_tokens up to the limit run, one more is refused."""
    from transformers import AutoTokenizer

    from distill.engine import Engine, EngineConfig, SamplingParams
    from distill.errors import ConfigError
    from distill.models import context_limit

    engine = Engine(hf_model, AutoTokenizer.from_pretrained(model_dir), None, EngineConfig(max_batch=1, weight_layout="as-loaded"))
    assert engine.max_len == context_limit(hf_model.config) == hf_model.config.max_position_embeddings
    with pytest.raises(ConfigError, match="exceed the engine's limit"):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=engine.max_len - 2))


def test_a_generate_run_reads_the_models_facts_once_and_hands_them_to_its_backend(model_dir, tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoTokenizer

    from distill import models
    from distill.generate import GenerateConfig, Generator, backends, runner

    read = []
    monkeypatch.setattr(runner, "model_facts", lambda *a: read.append(a[0]) or models.model_facts(*a))
    monkeypatch.setattr(backends, "model_facts", lambda *a: read.append(a[0]) or models.model_facts(*a))
    cfg = GenerateConfig(seed="sharegpt", mode="single-turn", out=str(tmp_path / "out"), backend="hf", limit=1,
                         max_new_tokens=4, dtype="float32", topk=5)
    gen = Generator(cfg)
    assert gen.run().generated == 1
    assert read == [model_dir]  # the generator's one reading; the backend it built was handed those facts
    config = AutoConfig.from_pretrained(model_dir)
    assert gen.facts == models.ModelFacts(config.vocab_size, models.context_limit(config),
                                          models.stop_token_ids(AutoTokenizer.from_pretrained(model_dir), model_dir))
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["meta"]["model"]["vocab_size"] == config.vocab_size
