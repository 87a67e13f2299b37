#!/usr/bin/env bash
# The engine on a CUDA GPU: the CUDA tests, then bench_engine_step.py eager and graphed, bf16.
#   bash benchmarks/gpu_engine_step.sh MODEL_DIR OUT_JSON
# MODEL_DIR: a model folder; its config and tokenizer are used with random weights (--random-weights), so a folder
# without weight files will do. Wheels in .whl/ (e.g. the transformers version this repo pins) are installed to
# /tmp/site first, for a GPU machine whose Python lacks them (BENCHMARKS.md, "On a GPU").
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
model=${1:?model folder}
out=${2:?results JSON}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_engine_graphs.py 2>&1 | tail -15
for graphs in off on; do
  timeout 170 python3 benchmarks/bench_engine_step.py --model "$model" --random-weights --no-vllm --device cuda --dtype bfloat16 \
    --cuda-graphs $graphs --eagle-nodes 8 24 64 --label "gpu-bfloat16-graphs-$graphs" --out "$out" 2>&1 | grep -v -E 'Loading|Writing'
done
