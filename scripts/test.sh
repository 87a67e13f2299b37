#!/usr/bin/env bash
# The test suite, with its own set-up: real model, real vLLM (CPU) engine, real files.
#
# Two pytest-xdist workers, each with half the cores' threads: a single worker leaves the CPUs idle for
# part of the time (process start-ups, imports, servers coming up), which a second worker fills; more
# threads than cores (two workers with two threads each on two cores) spin OpenMP threads against each
# other, and a third worker on two cores is slower than two. DISTILL_TEST_WORKERS=0 runs it in one process
# with every core's threads.
# Measured: BENCHMARKS.md, "The test suite".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
cores="$(nproc)"
workers="${DISTILL_TEST_WORKERS:-$(( cores >= 2 ? 2 : 0 ))}"
threads=$(( workers > 0 ? cores / workers : cores ))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}" VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
# Bytecode is written as Python writes it by default (scripts/setup.sh wrote it for what distill imports;
# the tests' own imports and the rest are compiled once, not once per process).
unset PYTHONDONTWRITEBYTECODE
xdist=()
if [ "$workers" -gt 0 ]; then xdist=(-n "$workers" --dist loadgroup --no-loadscope-reorder); fi  # tests/conftest.py orders
exec "${DISTILL_VENV:-.venv}/bin/python" -m pytest -q --durations=30 "${xdist[@]}" "$@"
