"""`distill serve --engine vllm`: the vLLM OpenAI-server command with the heads as its Medusa speculator."""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import DISTILL
from distill.errors import ConfigError
from distill.serve import ServeConfig, vllm_command, vllm_env


@pytest.fixture()
def heads_dir(tmp_path, model_dir):
    from distill.heads import HeadsConfig, MedusaHeads

    cfg = json.loads((model_dir / "config.json").read_text())
    MedusaHeads(HeadsConfig(cfg["hidden_size"], cfg["vocab_size"], num_heads=3)).save(tmp_path / "heads")
    return tmp_path / "heads"


def test_vllm_command_passes_the_heads_as_a_medusa_speculative_config(heads_dir, model_dir):
    cfg = ServeConfig(engine="vllm", heads=str(heads_dir), port=9123, max_batch=4, api_key="s3cret", served_model_name="smol")
    cmd = vllm_command(cfg, python="/py")
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    opt = {cmd[i]: cmd[i + 1] for i in range(3, len(cmd) - 1, 2)}
    assert json.loads(opt["--speculative-config"]) == {"method": "medusa", "model": str(heads_dir.resolve()), "num_speculative_tokens": 3}
    assert opt["--model"] == str(model_dir) and opt["--served-model-name"] == "smol"
    assert opt["--host"] == "127.0.0.1" and opt["--port"] == "9123" and opt["--max-num-seqs"] == "4"
    assert "s3cret" not in " ".join(cmd)  # the key travels in the environment, not on the command line
    assert vllm_env(cfg)["VLLM_API_KEY"] == "s3cret"


def test_vllm_command_uses_fewer_heads_when_asked_and_refuses_more(heads_dir):
    cmd = vllm_command(ServeConfig(engine="vllm", heads=str(heads_dir), num_speculative_tokens=2))
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == 2
    with pytest.raises(ConfigError, match="exceeds the 3 heads"):
        vllm_command(ServeConfig(engine="vllm", heads=str(heads_dir), num_speculative_tokens=5))


@pytest.mark.parametrize(("options", "message"), [
    ({"engine": "vllm"}, "pass --heads"),
    ({"engine": "vllm", "heads": "h", "tree": "3,2"}, "single chain"),
    ({"engine": "tgi"}, "--engine must be one of"),
    ({"queue_size": 0}, "--queue-size must be at least 1"),
    ({"host": "not a host"}, "--host must be an IP address"),
    ({"api_key": "  "}, "--api-key must not be empty"),
])
def test_serve_config_rejects_bad_options(options, message):
    with pytest.raises(ConfigError, match=message):
        ServeConfig(**options)


def test_serve_cli_reports_a_bad_option_in_one_line(tmp_path):
    r = subprocess.run([DISTILL, "serve", "--engine", "vllm"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: --engine vllm serves the model with Medusa heads: pass --heads DIR"]
    r = subprocess.run([DISTILL, "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert "single" in r.stdout and "chain" in r.stdout and "127.0.0.1" in r.stdout
