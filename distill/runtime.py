"""Where and in what precision each stage runs: the one device/dtype rule, and vLLM's CPU settings.

Terms
-----
device
    ``auto`` is CUDA when torch sees a GPU, else the CPU; an explicit torch device
    (``cpu``, ``cuda``, ``cuda:1``) is taken as given.
native bf16
    the CPU executes bfloat16 matmuls in hardware: AMX (``amx_bf16``) or AVX512-BF16
    (``avx512_bf16``) on x86, the ``bf16`` feature on Arm. Without it torch emulates
    bf16 and a matmul is two orders of magnitude slower than float32 (on a CPU with
    AVX2 only). When the flags cannot be read the
    answer comes from a tiny timed matmul (:func:`bf16_matmul_is_fast`).
model dtype
    the ``dtype`` (or legacy ``torch_dtype``) a model folder's ``config.json`` declares:
    the precision its weights are stored in.
dtype ``auto`` (:func:`resolve_dtype`)
    CUDA: the model dtype. CPU: bfloat16 for a bfloat16 model on a CPU with native
    bf16; float32 otherwise (a float32 model is never rounded down, an fp16 or bf16
    model is widened where bf16 is not native). The rule never depends on which stage
    asks, so data, heads, calibration, benchmark and server agree on one machine.
teacher dtype
    the dtype a dataset was generated in (``manifest.meta.backend.dtype``), carried into
    the heads trained on it. Later stages default to it (:func:`stage_dtype`): the heads
    are trained on, and verified against, the same model. Scoring a bfloat16 teacher in
    float32 changes the top-k set at many positions (:data:`MISMATCH_COST`), so a
    mismatch is reported, never silent.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from distill.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
#: What a mismatched teacher costs, as the warnings quote it: the bundled model's vLLM bf16 data re-scored in float32.
MISMATCH_COST = "bf16 data scored in float32 kept the top-20 set at only 67% of positions (median |Δ logprob| 0.14 nats)"


def canonical_dtype(name: str) -> str:
    """'bf16' / 'bfloat16' / 'torch.bfloat16' -> 'bfloat16'; 'auto' stays; anything else is an error."""
    key = str(name).strip().lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key != "auto" and key not in DTYPES:
        raise ConfigError(f"--dtype must be auto or one of {', '.join(DTYPES)}; got '{name}'")
    return key


def torch_dtype(name: str):
    """A resolved dtype name -> the torch dtype."""
    import torch

    key = canonical_dtype(name)
    if key == "auto":
        raise ConfigError("dtype 'auto' must be resolved first (distill.runtime.resolve_dtype)")
    return getattr(torch, key)


# -- the CPU -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CpuInfo:
    model: str  # the model name from /proc/cpuinfo (or platform.processor()), with parse_cpuinfo's family/model numbers
    cores: int  # CPUs this process may run on
    flags: frozenset[str]  # /proc/cpuinfo "flags" (x86) or "Features" (Arm); empty when unreadable
    arch: str  # platform.machine()

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags

    @property
    def amx(self) -> bool:
        return "amx_tile" in self.flags

    @property
    def native_bf16(self) -> bool | None:
        """True/False from the flags; None when the flags could not be read."""
        if not self.flags:
            return None
        return bool({"amx_bf16", "avx512_bf16", "bf16"} & self.flags)


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """/proc/cpuinfo text -> (model name, flags of the first CPU).

    The name carries the x86 family/model numbers (``<name> (family F, model M)``): a virtual
    machine often reports only the vendor's product line, and the numbers tell one generation
    of it from the next (kept kernel and step-cost timings are keyed by this name).
    """
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        key = key.strip().lower()
        if not sep:
            if fields:  # the first processor's block is enough
                break
            continue
        fields.setdefault(key, value.strip())
    model = fields.get("model name") or fields.get("cpu model") or fields.get("hardware") or ""
    if model and fields.get("cpu family") and fields.get("model", "").isdigit():
        model = f"{model} (family {fields['cpu family']}, model {fields['model']})"
    flags = frozenset((fields.get("flags") or fields.get("features") or "").split())
    return model, flags


@functools.lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    text = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pass
    model, flags = parse_cpuinfo(text)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return CpuInfo(model=model or platform.processor() or "unknown CPU", cores=cores, flags=flags, arch=platform.machine())


@functools.lru_cache(maxsize=1)
def bf16_matmul_is_fast(size: int = 256, repeats: int = 5) -> bool:
    """A tiny timed matmul: is bfloat16 at least as fast as float32 on this CPU? (a few ms)"""
    import torch

    def best(dtype) -> float:
        a = torch.randn(size, size).to(dtype)
        a @ a
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(torch.bfloat16) <= best(torch.float32)


def cpu_has_native_bf16() -> bool:
    """Native bf16 from the CPU flags; the timed matmul only when the flags are unreadable."""
    flag = cpu_info().native_bf16
    return bf16_matmul_is_fast() if flag is None else flag


# -- the rule ------------------------------------------------------------------------------------
def resolve_device(requested: str | None = "auto") -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; explicit devices are checked and kept."""
    import torch

    requested = (requested or "auto").strip()
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(requested)
    except RuntimeError:
        raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N; got '{requested}'") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {requested}: torch sees no CUDA GPU here; use --device auto or cpu")
    return requested


def resolve_dtype(requested: str, device_type: str, model_dtype: str | None, native_bf16: bool) -> str:
    """The dtype rule as a pure function (see the module docstring, "dtype auto").

    requested: ``auto`` or a dtype name; device_type: ``cpu`` / ``cuda`` / ...; model_dtype:
    the model folder's declared dtype (None: unknown, taken as float32); native_bf16: the CPU's.
    """
    requested = canonical_dtype(requested)
    if requested != "auto":
        return requested
    model = canonical_dtype(model_dtype) if model_dtype else "float32"
    model = "float32" if model == "auto" else model
    if device_type != "cpu":
        return model
    return "bfloat16" if model == "bfloat16" and native_bf16 else "float32"


def model_dtype(model_path: Path | str) -> str | None:
    """The dtype a model folder's config.json declares (text config of a multimodal one), or None."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for scope in (cfg, cfg.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = scope.get(key)
            if isinstance(value, str):
                try:
                    return canonical_dtype(value)
                except ConfigError:
                    return None
    return None


@dataclass(frozen=True)
class Placement:
    """A resolved (device, dtype) pair, and why the dtype was chosen."""

    device: str  # "cpu", "cuda", "cuda:1"
    dtype: str  # "float32" | "bfloat16" | "float16"
    reason: str  # one line: where the dtype came from

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    def torch_dtype(self):
        return torch_dtype(self.dtype)


def placement(model_path: Path | str | None, device: str | None = "auto", dtype: str | None = "auto") -> Placement:
    """Resolve ``--device`` and ``--dtype`` for a model folder with the one rule."""
    dev = resolve_device(device)
    requested = canonical_dtype(dtype or "auto")
    if requested != "auto":
        return Placement(dev, requested, "--dtype")
    declared = model_dtype(model_path) if model_path is not None else None
    dev_type = dev.split(":")[0]
    native = cpu_has_native_bf16() if dev_type == "cpu" and declared in ("bfloat16", "float16") else False
    chosen = resolve_dtype("auto", dev_type, declared, native)
    if dev_type != "cpu":
        why = f"the model's dtype ({declared or 'undeclared: float32'})"
    elif chosen == "bfloat16":
        why = "bfloat16 model on a CPU with native bf16"
    elif declared in ("bfloat16", "float16"):
        why = f"{declared} model widened: this CPU has no native bf16"
    else:
        why = f"the model's dtype ({declared or 'undeclared: float32'})"
    return Placement(dev, chosen, why)


def stage_dtype(model_path: Path | str | None, device: str | None, dtype: str | None, teacher: str | None,
                what: str, warn=None, option: str = "--dtype",
                effect: str = "the drafter is verified against another model than its teacher") -> Placement:
    """The placement of a stage that runs on a teacher's data or heads (train, calibrate, bench, serve).

    ``auto`` takes the teacher dtype when this device runs it natively (bfloat16 on a CPU
    without native bf16 is widened to float32, with a warning); an explicit ``--dtype``
    different from the teacher's is kept, with a warning naming what the mismatch costs (``option``: the
    flag the user set, ``effect``: what the mismatch means for this stage).
    ``teacher`` None (data or heads from before the dtype was recorded): the plain rule.
    """
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr, flush=True))
    teacher = canonical_dtype(teacher) if teacher and teacher != "auto" else None
    requested = canonical_dtype(dtype or "auto")
    if requested == "auto" and teacher is not None:
        dev = resolve_device(device)
        runnable = not (dev.split(":")[0] == "cpu" and teacher == "bfloat16" and not cpu_has_native_bf16())
        if runnable:
            return Placement(dev, teacher, f"the teacher's dtype ({what})")
        chosen = placement(model_path, dev, "float32")
        warn(f"{what} was made in bfloat16 but this CPU has no native bf16: running float32 ({MISMATCH_COST}; "
             "`distill data validate --rescore N` measures your data)")
        return Placement(chosen.device, chosen.dtype, "float32: no native bf16 for the bfloat16 teacher")
    chosen = placement(model_path, device, requested)
    if teacher is not None and chosen.dtype != teacher:
        warn(f"{option} {chosen.dtype} differs from the {teacher} that made {what}: {effect} "
             f"({MISMATCH_COST}; `distill data validate --rescore N` measures yours)")
    return chosen


# -- vLLM on CPUs ----------------------------------------------------------------------------------
def vllm_cpu_env() -> dict[str, str]:
    """vLLM settings for a CPU machine, chosen by measurement (one place for all of them).

    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, offline and for the server. Offline (``vllm.LLM``, distill generate): the
    engine core runs in this process. In its own process it busy-polls for work; on a machine with
    few cores that poller takes a core from the model, and generation in-process is several times
    faster. The OpenAI server (``distill serve --engine vllm``) keeps its
    engine-core process (vLLM's async client needs one), but with the variable set vLLM runs the
    model's worker inside that process (its one-device ``uni`` executor) instead of in a third
    process that the engine core feeds through shared memory and spins on while the model
    computes; the core it had reserved for the engine core goes to the model's threads. The
    tokens are the same; on a few cores it answers faster, one request at a time or several,
    starts sooner and spends no CPU idle. Giving that reserved core to the model while the worker
    stays a process of its own (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``) is several times slower
    instead.
    ``VLLM_CPU_KVCACHE_SPACE``: 2 GiB of KV cache, plenty for the models a CPU serves.
    Variables the user already set are kept.
    Measured: BENCHMARKS.md, "Generation".
    Measured: BENCHMARKS.md, "Serving".
    """
    return {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def configure_vllm(device_type: str) -> dict[str, str]:
    """Apply :func:`vllm_cpu_env` to ``os.environ`` (CPU only; GPU keeps vLLM's defaults); -> what was set."""
    if device_type != "cpu":
        return {}
    applied = {}
    for key, value in vllm_cpu_env().items():
        if key not in os.environ:
            os.environ[key] = value
            applied[key] = value
    return applied


# -- naming the machine ----------------------------------------------------------------------------
def memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def cpu_flags_summary(cpu: CpuInfo | None = None) -> str:
    """'AVX2, AVX-512, AVX512-BF16' style list of the features the dtype rule and kernels care about."""
    cpu = cpu or cpu_info()
    if not cpu.flags:
        return "flags unreadable"
    named = [("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_tile", "AMX"),
             ("amx_bf16", "AMX-BF16"), ("bf16", "BF16"), ("asimd", "NEON"), ("sve", "SVE")]
    have = [label for flag, label in named if flag in cpu.flags]
    return ", ".join(have) or "no AVX2"


def machine(device: str = "cpu") -> str:
    """One line naming the hardware a figure was measured on (recorded with every benchmark)."""
    mem = memory_gib()
    mem_s = f", {mem:.0f} GiB" if mem else ""
    if device.startswith("cuda"):
        import torch

        idx = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(idx)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB), {torch.cuda.device_count()} GPU(s)"
    cpu = cpu_info()
    return f"{cpu.model} ({cpu.cores} cores, {cpu.arch}, {cpu_flags_summary(cpu)}){mem_s}"


def dataset_dtype(meta: dict | None) -> str | None:
    """The dtype a dataset's teacher ran in (``manifest.meta.backend.dtype``); None when unrecorded."""
    value = ((meta or {}).get("backend") or {}).get("dtype")
    if not isinstance(value, str) or value == "auto":
        return None
    try:
        return canonical_dtype(value)
    except ConfigError:
        return None
