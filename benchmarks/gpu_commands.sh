#!/usr/bin/env bash
# The user's commands on a CUDA GPU, device and dtype left to auto: env, bench (lookup), train-heads (Medusa, EAGLE-3),
# calibrate, bench (EAGLE-3 graphed, Medusa eager). BENCHMARKS.md, "On a GPU".
#   bash benchmarks/gpu_commands.sh MODEL_DIR TRAIN_DATA EVAL_DATA OUT
# MODEL_DIR: config and tokenizer of the model; it is run with random weights saved in bf16 (config dtype bfloat16), for a
# GPU machine the weights cannot travel to. Wheels in .whl/ are installed to /tmp/site first (see benchmarks/gpu_engine_step.sh).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
src=${1:?model folder}; train=${2:?training shards}; eval=${3:?held-out shards}; out=${4:?output folder}
PY=${PY:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
M=$(SRC=$src $PY -c "import os, torch; from bench_engine_step import random_weights_model
print(random_weights_model(os.environ['SRC'], torch.bfloat16))" 2>/dev/null | tail -1)
[ -f "$M/config.json" ] || { echo "no random-weights model made from $src"; exit 1; }
D="$PY -m distill.cli"
work=$(mktemp -d)
step() { echo "== $*"; local t0=$SECONDS; timeout 150 "$@" > "$work/step.log" 2>&1; local rc=$?
         grep -v -E 'Loading weights|Writing model|it/s\]$' "$work/step.log" | tail -14; echo "rc=$rc $((SECONDS - t0))s"; }
step $D env
step $D bench --model "$M" --heads lookup --limit 3 --max-tokens 32 --modes greedy --out "$out/bench-lookup"
step $D train-heads --model "$M" --data "$train" --out "$work/medusa" --steps 4 --max-len 256 --batch-size 4
step $D train-heads --arch eagle3 --model "$M" --data "$train" --out "$work/eagle" --steps 4 --max-len 256 --batch-size 4 --draft-vocab auto
step $D calibrate --heads "$work/eagle" --data "$eval" --model "$M" --max-tokens 2000
step $D bench --model "$M" --heads "$work/eagle" --limit 3 --max-tokens 32 --modes greedy --out "$out/bench-eagle"
step $D bench --model "$M" --heads "$work/medusa" --limit 3 --max-tokens 32 --modes greedy --no-cuda-graphs --out "$out/bench-medusa-eager"
