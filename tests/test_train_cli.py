"""The command line (the console script's main(), run in-process: conftest.run_distill): train-heads from a pipeline
file with CLI overrides, calibrate, export."""

from __future__ import annotations

import json

from conftest import REPO, run_distill


def test_train_heads_calibrate_and_export_from_the_command_line(real_shards, tmp_path, cli_env):
    out = tmp_path / "heads"
    run = run_distill(["train-heads", "--config", str(REPO / "pipelines" / "medusa1.yaml"), "--data", str(real_shards), "--out", str(out),
                       "--num-heads", "2", "--share-lm-head", "--max-len", "32", "--context", "8", "--batch-size", "2", "--grad-accum", "1",
                       "--steps", "2", "--warmup-steps", "0", "-q"], env=cli_env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "2 steps" in run.stdout and "head top-1" in run.stdout
    meta = json.loads((out / "distill-heads.json").read_text())
    assert meta["train_config"]["epochs"] == 2 and meta["train_config"]["max_len"] == 32  # YAML value + CLI override
    assert meta["train_config"]["context"] == 8

    cal = run_distill(["calibrate", "--heads", str(out), "--data", str(real_shards), "--nodes", "5", "--max-len", "32", "--eval-tokens",
                       "300", "--no-plots"], env=cli_env)
    assert cal.returncode == 0, cal.stderr[-2000:]
    assert "5 nodes" in cal.stdout and json.loads((out / "tree.json").read_text())["nodes"] == 5

    exp = run_distill(["export", "--heads", str(out), "--out", str(tmp_path / "repo"), "--format", "medusa-repo"], env=cli_env)
    assert exp.returncode == 0, exp.stderr[-2000:]
    conf = json.loads((tmp_path / "repo" / "config.json").read_text())
    assert conf["medusa_num_heads"] == 2 and conf["medusa_num_layers"] == 1
    assert conf["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    from safetensors.torch import load_file

    from distill.heads.model import MedusaHeads

    sd = load_file(str(tmp_path / "repo" / "medusa_lm_head.safetensors"))
    heads = MedusaHeads.load(out)
    assert set(sd) == {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight", "1.0.linear.weight", "1.0.linear.bias", "1.1.weight"}
    assert (sd["1.0.linear.weight"] == heads.blocks[1].layers[0].weight).all()
    assert (sd["1.1.weight"] == heads.lm_heads[0].weight).all()  # the shared LM head, written once per head

    bad = run_distill(["train-heads", "--data", str(real_shards), "--medusa-mode", "medusa3"], env=cli_env)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --medusa-mode must be one of")
