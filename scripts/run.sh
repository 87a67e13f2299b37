#!/usr/bin/env bash
# The main job on the bundled defaults: the whole loop of pipelines/quickstart.yaml —
# self-distilled ShareGPT data from SmolLM2-135M-Instruct -> validate -> split -> an EAGLE-3
# drafter -> its accuracy calibrated on held-out data -> plain vs EAGLE-3 and vs the lookup
# proposer on MT-Bench (resumable: run it again to continue; finished stages are skipped).
# Extra arguments go to `distill run`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}" VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
exec "${DISTILL_VENV:-.venv}/bin/distill" run pipelines/quickstart.yaml "$@"
