#!/usr/bin/env bash
# The main job on the bundled defaults: regenerate the bundled ShareGPT seed with
# SmolLM2-135M-Instruct into self-distilled shards (resumable: run it again to continue).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}" VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
exec "${DISTILL_VENV:-.venv}/bin/distill" generate --config pipelines/sharegpt-medusa.yaml "$@"
