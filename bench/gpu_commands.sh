#!/usr/bin/env bash
# The user's commands on a CUDA GPU, device and dtype left to auto: env, bench (lookup), train-heads (Medusa, EAGLE-3),
# calibrate, bench (EAGLE-3 graphed, Medusa eager). BENCHMARKS.md, issue 19, "The user's commands on the GPU".
#   bash bench/gpu_commands.sh MODEL_DIR TRAIN_DATA EVAL_DATA OUT
# MODEL_DIR: config and tokenizer of the model; it is run with random weights saved in bf16 (config dtype bfloat16), for a
# GPU machine the weights cannot travel to. Wheels in .whl/ are installed to /tmp/site first (see bench/gpu_engine_step.sh).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
src=${1:?model folder}; train=${2:?training shards}; eval=${3:?held-out shards}; out=${4:?output folder}
PY=${PY:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
M=$(mktemp -d)/model-bf16
SRC=$src DST=$M $PY - <<'PY' || exit 1
import os, shutil, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = Path(os.environ["SRC"]), Path(os.environ["DST"])
dst.mkdir(parents=True)
for f in src.iterdir():
    if f.is_file() and not f.name.endswith((".safetensors", ".bin")):
        shutil.copy(f, dst / f.name)
torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(src)
cfg.dtype = torch.bfloat16
AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(dst)
PY
D="$PY -m distill.cli"
work=$(dirname "$M")
step() { echo "== $*"; local t0=$SECONDS; timeout 150 "$@" > "$work/step.log" 2>&1; local rc=$?
         grep -v -E 'Loading weights|Writing model|it/s\]$' "$work/step.log" | tail -14; echo "rc=$rc $((SECONDS - t0))s"; }
step $D env
step $D bench --model "$M" --heads lookup --limit 3 --max-tokens 32 --modes greedy --out "$out/bench-lookup"
step $D train-heads --model "$M" --data "$train" --out "$work/medusa" --steps 4 --max-len 256 --batch-size 4
step $D train-heads --arch eagle3 --model "$M" --data "$train" --out "$work/eagle" --steps 4 --max-len 256 --batch-size 4 --draft-vocab auto
step $D calibrate --heads "$work/eagle" --data "$eval" --model "$M" --max-tokens 2000
step $D bench --model "$M" --heads "$work/eagle" --limit 3 --max-tokens 32 --modes greedy --out "$out/bench-eagle"
step $D bench --model "$M" --heads "$work/medusa" --limit 3 --max-tokens 32 --modes greedy --no-cuda-graphs --out "$out/bench-medusa-eager"
