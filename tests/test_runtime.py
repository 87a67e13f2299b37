"""The one device/dtype rule (distill.runtime), `distill env`, and the teacher-dtype defaults of later stages."""

from __future__ import annotations

import json
import os

import pytest

from conftest import run_distill
from distill import runtime
from distill.errors import ConfigError
from distill.runtime import CpuInfo, parse_cpuinfo, resolve_dtype

ZEN3 = "fpu sse sse2 avx f16c fma avx2 bmi2 sha_ni vaes"  # AMD EPYC Zen 3: AVX2, no AVX-512, no AMX
ZEN4 = ZEN3 + " avx512f avx512bw avx512_vnni avx512_bf16"  # AVX512-BF16
SAPPHIRE_RAPIDS = ZEN3 + " avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"
GRAVITON3 = "fp asimd sve bf16 i8mm"  # Arm features line


def native(flags: str) -> bool | None:
    return CpuInfo(model="x", cores=2, flags=frozenset(flags.split()), arch="x86_64").native_bf16


@pytest.mark.parametrize(("flags", "expected"), [(ZEN3, False), (ZEN4, True), (SAPPHIRE_RAPIDS, True), (GRAVITON3, True), ("", None)])
def test_native_bf16_is_read_from_the_cpu_flags(flags, expected):
    assert native(flags) is expected


@pytest.mark.parametrize(("device", "model", "flags", "expected"), [
    # CPUs: a bf16 model runs bf16 only where bf16 is native; float32 models are never rounded down
    ("cpu", "bfloat16", ZEN3, "float32"),
    ("cpu", "bfloat16", ZEN4, "bfloat16"),
    ("cpu", "bfloat16", SAPPHIRE_RAPIDS, "bfloat16"),
    ("cpu", "bfloat16", GRAVITON3, "bfloat16"),
    ("cpu", "float16", ZEN4, "float32"),
    ("cpu", "float32", ZEN3, "float32"),
    ("cpu", "float32", SAPPHIRE_RAPIDS, "float32"),
    ("cpu", None, ZEN4, "float32"),
    # GPUs: the model's own dtype
    ("cuda", "bfloat16", "", "bfloat16"),
    ("cuda", "float16", "", "float16"),
    ("cuda", "float32", "", "float32"),
])
def test_auto_dtype_follows_the_device_the_model_and_the_cpu(device, model, flags, expected):
    assert resolve_dtype("auto", device, model, bool(native(flags))) == expected


def test_an_explicit_dtype_is_kept_and_aliases_are_canonical():
    assert resolve_dtype("bf16", "cpu", "float32", False) == "bfloat16"
    assert resolve_dtype("float32", "cuda", "bfloat16", True) == "float32"
    assert resolve_dtype("torch.float16", "cpu", None, False) == "float16"
    with pytest.raises(ConfigError, match="--dtype must be auto or one of"):
        resolve_dtype("float99", "cpu", None, False)


def test_cpuinfo_is_parsed_with_family_and_model_numbers():
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC 7B13\n" \
          f"flags\t\t: {ZEN3}\n\nprocessor\t: 1\nmodel name\t: other\nflags\t\t: none\n"
    name, flags = parse_cpuinfo(x86)
    assert name == "AMD EPYC 7B13 (family 25, model 1)"
    assert "avx2" in flags and "avx512_bf16" not in flags and "none" not in flags
    arm = f"processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: {GRAVITON3}\nCPU implementer\t: 0x41\n"
    assert parse_cpuinfo(arm)[1] == frozenset(GRAVITON3.split())


def test_model_dtype_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert runtime.model_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"dtype": "float16"}}))
    assert runtime.model_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text("{}")
    assert runtime.model_dtype(tmp_path) is None


@pytest.fixture()
def bf16_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    return tmp_path


def test_a_stage_takes_the_teacher_dtype_and_warns_on_an_override(bf16_model, monkeypatch):
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: True)
    said: list[str] = []
    got = runtime.stage_dtype(bf16_model, "cpu", "auto", "bfloat16", what="the heads", warn=said.append)
    assert (got.device, got.dtype, said) == ("cpu", "bfloat16", [])
    got = runtime.stage_dtype(bf16_model, "cpu", "float32", "bfloat16", what="the heads", warn=said.append)
    assert got.dtype == "float32"
    assert len(said) == 1 and "differs from the bfloat16 that made the heads" in said[0] and "67%" in said[0]
    assert said[0].startswith("--dtype float32 ") and "verified against another model" in said[0]
    # train-heads names its own flag and what the mismatch means for training
    runtime.stage_dtype(bf16_model, "cpu", "float32", "bfloat16", what="the data", warn=said.append,
                        option="--precision fp32:", effect="the features come from another dtype")
    assert said[1].startswith("--precision fp32: float32 differs from the bfloat16 that made the data: the features come")


def test_a_bf16_teacher_runs_float32_with_a_warning_where_bf16_is_not_native(bf16_model, monkeypatch):
    monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda: False)
    said: list[str] = []
    got = runtime.stage_dtype(bf16_model, "cpu", "auto", "bfloat16", what="the data", warn=said.append)
    assert got.dtype == "float32" and len(said) == 1 and "no native bf16" in said[0]
    # no teacher recorded: the plain rule, silently
    said.clear()
    assert runtime.stage_dtype(bf16_model, "cpu", "auto", None, what="the data", warn=said.append).dtype == "float32"
    assert said == []


def test_dataset_dtype_ignores_unresolved_records():
    assert runtime.dataset_dtype({"backend": {"dtype": "bfloat16"}}) == "bfloat16"
    assert runtime.dataset_dtype({"backend": {"dtype": "auto"}}) is None  # datasets made before the dtype was resolved
    assert runtime.dataset_dtype({"backend": None}) is None


def test_vllm_on_cpu_runs_without_its_worker_process_and_gpus_keep_vllms_defaults(monkeypatch):
    # offline: the engine core in this process; the server: its worker inside the engine-core process
    assert runtime.vllm_cpu_env() == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert runtime.configure_vllm("cuda") == {}  # GPUs keep vLLM's defaults
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "5")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert runtime.configure_vllm("cpu") == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # what the user set is kept
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "5"


def test_distill_env_names_the_cpu_and_each_stage_dtype(tmp_path):
    from distill.models import distill_home, resolve_model

    resolve_model(None)  # converted in the suite's home, which this one links to
    home = tmp_path / "home"
    (home / "step-costs").mkdir(parents=True)
    (home / "models").symlink_to(distill_home() / "models", target_is_directory=True)
    for name in ("a.json", "b.json"):  # the engine's kept step-cost curves are counted
        (home / "step-costs" / name).write_text("{}")
    r = run_distill(["env"], env=dict(os.environ, DISTILL_HOME=str(home)))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert f"- DISTILL_HOME: {home} (2 step-cost curves kept in step-costs/" in r.stdout
    cpu = runtime.cpu_info()
    assert any(line.startswith("- CPU: ") and cpu.model in line for line in lines)
    # the bundled model is float32: every stage picks float32, on any CPU (and on a GPU)
    device = runtime.resolve_device("auto")
    for stage in ("generate (vLLM)", "train-heads", "calibrate", "bench", "serve"):
        assert any(line.startswith(f"- {stage}: {device}, float32") for line in lines), stage
    if device == "cpu":
        assert any("in-process" in line for line in lines if line.startswith("- generate"))
    from distill.engine.cpu.linears import vllm_kernels

    linears = [line for line in lines if line.startswith("- Engine's float32 CPU linears: ")]
    assert len(linears) == 1 and linears[0].startswith("- Engine's float32 CPU linears: vLLM's CPU matmul" if vllm_kernels() == ""
                                                     else "- Engine's float32 CPU linears: torch's oneDNN"), linears
    assert linears[0].endswith("RMS norms and the rotary embedding on vLLM's CPU kernels where they reproduce the model's") \
        == (vllm_kernels() == "")  # distill.engine.cpu.norms and .rotary use the same library
    r = run_distill(["env", "--json"])
    doc = json.loads(r.stdout)
    assert doc["versions"]["torch"] and doc["stages"]["serve"]["dtype"] == "float32"
    assert doc["cpu"]["native_bf16"] in (True, False)
