#!/usr/bin/env bash
# The test suite, with its own set-up: real model, real vLLM (CPU) engine, real files.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}" VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
exec "${DISTILL_VENV:-.venv}/bin/python" -m pytest -q --durations=30 "$@"
