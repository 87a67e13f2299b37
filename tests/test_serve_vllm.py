"""`distill serve --engine vllm`: the vLLM OpenAI-server command with the heads as its Medusa speculator."""

from __future__ import annotations

import json
import os

import pytest

from conftest import run_distill
from distill.errors import ConfigError
from distill.serve import ServeConfig, vllm_command, vllm_env


@pytest.fixture()
def heads_dir(tmp_path, model_dir):
    from distill.heads import HeadsConfig, MedusaHeads

    cfg = json.loads((model_dir / "config.json").read_text())
    MedusaHeads(HeadsConfig(cfg["hidden_size"], cfg["vocab_size"], num_heads=3)).save(tmp_path / "heads")
    return tmp_path / "heads"


def test_vllm_command_passes_the_heads_as_a_medusa_speculative_config(heads_dir, model_dir):
    cfg = ServeConfig.from_options(engine="vllm", heads=str(heads_dir), port=9123, max_batch=4, api_key="s3cret", served_model_name="smol")
    cmd = vllm_command(cfg, python="/py")
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    opt = {cmd[i]: cmd[i + 1] for i in range(3, len(cmd) - 1, 2)}
    assert json.loads(opt["--speculative-config"]) == {"method": "medusa", "model": str(heads_dir.resolve()), "num_speculative_tokens": 3}
    assert opt["--model"] == str(model_dir) and opt["--served-model-name"] == "smol"
    assert opt["--host"] == "127.0.0.1" and opt["--port"] == "9123" and opt["--max-num-seqs"] == "4"
    assert "s3cret" not in " ".join(cmd)  # the key travels in the environment, not on the command line
    assert vllm_env(cfg)["VLLM_API_KEY"] == "s3cret"


def test_on_a_cpu_vllms_worker_runs_inside_its_engine_core_unless_the_user_says_otherwise(heads_dir, monkeypatch):
    from distill.runtime import resolve_device

    if resolve_device("auto") != "cpu":
        pytest.skip("GPUs keep vLLM's own process layout")
    cfg = ServeConfig.from_options(engine="vllm", heads=str(heads_dir))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert vllm_env(cfg)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert vllm_env(cfg)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_vllm_command_uses_fewer_heads_when_asked_and_refuses_more(heads_dir):
    cmd = vllm_command(ServeConfig.from_options(engine="vllm", heads=str(heads_dir), num_speculative_tokens=2))
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == 2
    with pytest.raises(ConfigError, match="exceeds the 3 heads"):
        vllm_command(ServeConfig.from_options(engine="vllm", heads=str(heads_dir), num_speculative_tokens=5))


@pytest.mark.parametrize(("options", "message"), [
    ({"engine": "vllm"}, "pass --heads"),
    ({"engine": "vllm", "heads": "h", "tree": "3,2"}, "single chain"),
    ({"engine": "tgi"}, "--engine must be one of"),
    ({"queue_size": 0}, "--queue-size must be at least 1"),
    ({"host": "not a host"}, "--host must be an IP address"),
    ({"api_key": "  "}, "--api-key must not be empty"),
    ({"shutdown_grace": -1}, "--shutdown-grace must be >= 0"),
    ({"max_body_bytes": 100}, "--max-body-bytes must be at least 1024"),
])
def test_serve_config_rejects_bad_options(options, message):
    with pytest.raises(ConfigError, match=message):
        ServeConfig.from_options(**options)


def test_serve_cli_reports_a_bad_option_in_one_line(tmp_path):
    r = run_distill(["serve", "--engine", "vllm"])
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["error: --engine vllm serves the model with Medusa heads or an EAGLE-3 drafter: pass --heads DIR"]
    r = run_distill(["serve", "--help"])
    assert "single" in r.stdout and "chain" in r.stdout and "127.0.0.1" in r.stdout
    assert "DISTILL_API_KEY" in r.stdout and "(ps)" in r.stdout  # the key's safe way in, and why


@pytest.mark.parametrize(("options", "warns"), [
    ({"host": "0.0.0.0"}, True),
    ({"host": "192.168.1.7"}, True),
    ({"host": "::"}, True),
    ({"host": "0.0.0.0", "api_key": "k"}, False),
    ({"host": "127.0.0.1"}, False),
    ({"host": "::1"}, False),
    ({"host": "localhost"}, False),
])
def test_binding_beyond_loopback_without_a_key_warns(options, warns):
    from distill.serve.server import bind_warning

    warning = bind_warning(ServeConfig.from_options(**options))
    assert (warning is not None) == warns
    if warns:
        assert options["host"] in warning and "DISTILL_API_KEY" in warning


def test_vllm_command_keeps_vllm_defaults_and_appends_what_follows_the_double_dash(heads_dir):
    cfg = ServeConfig.from_options(engine="vllm", heads=str(heads_dir), vllm_args=("--tensor-parallel-size", "2", "--enforce-eager"))
    cmd = vllm_command(cfg)
    assert "--max-num-seqs" not in cmd  # vLLM's own default unless --max-batch is given
    assert cmd[-3:] == ["--tensor-parallel-size", "2", "--enforce-eager"]
    assert cmd[cmd.index("--dtype") + 1] == "float32"  # the bundled model's dtype, never "auto"
    with pytest.raises(ConfigError, match="need --engine vllm"):
        ServeConfig.from_options(heads=str(heads_dir), vllm_args=("--enforce-eager",))


def test_vllm_command_passes_chat_template_and_generation_config_under_vllms_own_names(heads_dir):
    cmd = vllm_command(ServeConfig.from_options(engine="vllm", heads=str(heads_dir), chat_template="t.jinja", generation_config="none"))
    assert cmd[cmd.index("--chat-template") + 1] == "t.jinja"
    assert cmd[cmd.index("--generation-config") + 1] == "vllm"  # vLLM's name for neutral defaults
    assert "--generation-config" not in vllm_command(ServeConfig.from_options(engine="vllm", heads=str(heads_dir)))  # auto: vLLM's default
    cmd = vllm_command(ServeConfig.from_options(engine="vllm", heads=str(heads_dir), chat_template_kwargs='{"enable_thinking": false}'))
    assert json.loads(cmd[cmd.index("--default-chat-template-kwargs") + 1]) == {"enable_thinking": False}


def test_vllm_command_runs_the_heads_teacher_dtype(heads_dir, monkeypatch):
    from distill import runtime

    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: True)
    (heads_dir / "distill-heads.json").write_text(json.dumps({"teacher_dtype": "bfloat16"}))
    cmd = vllm_command(ServeConfig.from_options(engine="vllm", heads=str(heads_dir)))
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"


def test_serve_cli_passes_arguments_after_the_double_dash_to_vllm(heads_dir):
    r = run_distill(["serve", "--engine", "vllm", "--heads", str(heads_dir), "--print-command", "--", "--gpu-memory-utilization", "0.85",
                     "--tensor-parallel-size", "1"])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    cmd = doc["command"]
    assert cmd[-4:] == ["--gpu-memory-utilization", "0.85", "--tensor-parallel-size", "1"]
    assert cmd[cmd.index("--dtype") + 1] == "float32" and "--max-num-seqs" not in cmd
    assert "VLLM_API_KEY" not in doc["env"] and "TORCH_COMPILE_DISABLE" not in doc["env"]  # vLLM compiles its model
    r = run_distill(["serve", "--engine", "vllm", "--heads", str(heads_dir), "--print-command", "--", "--enforce-eager"],
                     env={k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_DISABLE"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["env"]["TORCH_COMPILE_DISABLE"] == "1"  # eager: no inductor build for a sampler helper
    r = run_distill(["serve", "--heads", str(heads_dir), "--print-command", "--", "--enforce-eager"])
    assert r.returncode == 2 and "need --engine vllm" in r.stderr


def test_vllm_command_for_lookup_is_vllm_s_ngram_prompt_lookup_with_the_same_ngram_range():
    from distill.engine.proposers.lookup import DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM

    cmd = vllm_command(ServeConfig.from_options(engine="vllm", heads="lookup", num_speculative_tokens=3))
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": DEFAULT_MAX_NGRAM,
                    "prompt_lookup_min": DEFAULT_MIN_NGRAM}
    assert cmd[cmd.index("--dtype") + 1] == "float32"
