"""`distill data validate --rescore N`: the stored teacher against the model that will serve it."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import run_distill
from distill.data.rescore import rescore
from helpers import tiny_llama


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, model_dir):
    """A random 2-layer Llama with the bundled tokenizer and chat template (cheap even where bf16 is emulated)."""
    import torch

    out = tmp_path_factory.mktemp("tiny-model")
    model = tiny_llama(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=49152, positions=1024, tied=True,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2)
    cfg = model.config
    with torch.no_grad():  # peaked enough that bf16 rounding moves logprobs by ~0.01 nats and reorders the tail
        model.get_input_embeddings().weight.mul_(8)
        model.get_input_embeddings().weight[cfg.eos_token_id] = 0  # (tied LM head) never ends a reply: no empty messages
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def float32_data(tmp_path_factory, tiny_model):
    from distill.generate import GenerateConfig, Generator

    out = tmp_path_factory.mktemp("rescore-data") / "f32"
    cfg = GenerateConfig(seed="sharegpt", mode="single-turn", out=str(out), model=str(tiny_model), backend="hf", limit=4,
                         max_new_tokens=24, temperature=0.7, dtype="auto", sampling_seed=0, topk=20)
    summary = Generator(cfg).run()
    assert summary.generated == 4
    return out


def test_the_manifest_records_the_resolved_dtype_never_auto(float32_data):
    backend = json.loads((float32_data / "manifest.json").read_text())["meta"]["backend"]
    assert backend["dtype"] == "float32" and backend["device"] in ("cpu", "cuda")


def test_rescoring_in_the_teacher_dtype_meets_the_fidelity_targets(float32_data):
    report = rescore(float32_data, 4)
    assert report.dtype == report.teacher_dtype == "float32"
    from distill.store import iter_rows

    assert report.rows == 4 and report.positions == sum(r["n_generated_tokens"] for r in iter_rows(float32_data))
    assert report.top1_agreement == 1.0 and report.topk_set_agreement >= 0.99
    assert report.logprob_error_p99 <= 0.002 and report.meets_targets


def test_rescoring_in_another_dtype_shows_the_agreement_drop(float32_data):
    same = rescore(float32_data, 4)
    other = rescore(float32_data, 4, dtype="bfloat16")
    assert other.dtype == "bfloat16" and other.teacher_dtype == "float32"
    assert other.logprob_error_median > 10 * same.logprob_error_median
    assert other.logprob_error_p99 > 10 * same.logprob_error_p99
    assert other.topk_set_agreement < 0.9 * same.topk_set_agreement and not other.meets_targets


def test_validate_cli_prints_the_rescore_report(float32_data):
    r = run_distill(["data", "validate", str(float32_data), "--rescore", "2", "--json"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["rescore"]["rows"] == 2 and doc["rescore"]["dtype"] == "float32" and doc["rescore"]["meets_targets"] is True
    r = run_distill(["data", "validate", str(float32_data), "--rescore", "2", "--rescore-dtype", "float99"])
    assert r.returncode == 2 and "--dtype must be auto or one of" in r.stderr
