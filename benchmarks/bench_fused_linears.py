"""Linears fed one input, fused or not: the model's forward with and without the groups, side by side.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_fused_linears.py --rounds 300 --out benchmarks/results/fused_linears.json
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_fused_linears.py --compare kind --rounds 150 --out benchmarks/results/packed_kind.json
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_fused_linears.py --compare norms --rounds 150 --out benchmarks/results/norms.json
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_fused_linears.py --compare rotary --rounds 150 --out benchmarks/results/rotary.json

``--compare norms`` compares the RMS normalisations on vLLM's kernel (the engine's default,
``distill.engine.cpu.norms``) with the modules' own forwards, everything else prepared alike.
``--compare rotary``: attention with the rotation on vLLM's kernel (``distill.engine.cpu.rotary``, the engine's
default) against transformers' own attention modules, everything else prepared alike.

``--compare kind`` instead compares the two packed kinds, both engines fused: vLLM's CPU matmul
for every weight against torch's oneDNN copy for every weight (why the engine does not let its
start-up probe choose between them: ``distill.engine.cpu.linears.choose_kernels``).

Two engines over the bundled model in one process: one prepared as the engine does by default
(attention's q/k/v and the MLP's gate/up each one product, ``distill.engine.cpu.linears``), one with
every linear its own product (no example forward, so no groups). Both keep the same packed kind
for every weight (vLLM's CPU matmul where it loads, else torch's), so only the fusion differs: the
start-up probe picks a kind per weight shape, and on a noisy machine its pick alone moves a forward
by more than the fusion does. Each round times one forward of each (order alternating per round)
over the same token ids, no cache, for 1 row, 8 rows (a batch-8 plain step's shape) and 17 rows
(a 16-node tree at batch 1): medians and minima in milliseconds, and the paired difference
(separate - fused, round by round) as mean ± standard error (``saved_ms_*``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from distill.engine import Engine, EngineConfig, weights
from distill.engine.cpu.norms import restore_norms
from distill.engine.cpu.rotary import restore_rotary
from distill.engine.target import Target
from distill.runtime import machine
from distill.store.atomic import atomic_write_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--compare", choices=("fusion", "kind", "norms", "rotary"), default="fusion")
    ap.add_argument("--out", default="benchmarks/results/fused_linears.json")
    args = ap.parse_args()
    def only(kind: str):  # the probe's single-row choice pinned to the packed copy, so only the compared thing differs
        weights.probe = lambda ws, copies: {k: (0.5 if k == f"{kind}@1" else 1.0) for k in weights.probe_keys(copies)}

    def loaded_kind() -> str:  # vLLM's matmul where it loads, else torch's copies, pinned for every engine compared
        kind = weights.VLLM if weights.vllm_kernels() == "" else weights.ONEDNN
        only(kind)
        return kind

    if args.compare == "kind":
        if weights.vllm_kernels():
            raise SystemExit(f"--compare kind needs vLLM's CPU matmul: {weights.vllm_kernels()}")
        kind = "vllm vs onednn"
        only(weights.VLLM)
        first = Engine.from_pretrained(None, None, EngineConfig(max_batch=8))
        load = weights.vllm_kernels
        weights.vllm_kernels = lambda: "compared here"  # torch's copies for every weight
        only(weights.ONEDNN)
        try:
            second = Engine.from_pretrained(None, None, EngineConfig(max_batch=8))
        finally:
            weights.vllm_kernels = load
        engines = {"vllm": first, "onednn": second}
    elif args.compare == "norms":
        kind = loaded_kind()
        kernel = Engine.from_pretrained(None, None, EngineConfig(max_batch=8))
        own = Engine.from_pretrained(None, None, EngineConfig(max_batch=8))
        if not kernel.linear_prep.get("rms_norms_vllm") or restore_norms(own.model) != kernel.linear_prep["rms_norms_vllm"]:
            raise SystemExit("--compare norms needs vLLM's CPU kernels (no norm was swapped)")
        engines = {"kernel": kernel, "own": own}
    elif args.compare == "rotary":
        kind = loaded_kind()
        kernel = Engine.from_pretrained(None, None, EngineConfig(max_batch=8))
        own = Engine.from_pretrained(None, None, EngineConfig(max_batch=8))
        if not kernel.linear_prep.get("rotary_vllm") or restore_rotary(own.model) != kernel.linear_prep["rotary_vllm"]:
            raise SystemExit("--compare rotary needs vLLM's CPU kernels (no attention was replaced)")
        engines = {"kernel": kernel, "own": own}
    else:
        kind = loaded_kind()
        fused = Engine.from_pretrained(None, None, EngineConfig(max_batch=8))
        example = Target._example
        Target._example = lambda self: None  # the same preparation without the example forward: no groups
        try:
            separate = Engine.from_pretrained(None, None, EngineConfig(max_batch=8))
        finally:
            Target._example = example
        engines = {"fused": fused, "separate": separate}
    result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "threads": torch.get_num_threads(), "kind": kind, "prep": {k: e.linear_prep for k, e in engines.items()}, "shapes": {}}
    torch.manual_seed(0)
    with torch.inference_mode():
        for batch, tokens in [(1, 1), (8, 1), (1, 17)]:
            ids = torch.randint(0, 1000, (batch, tokens))
            positions = torch.arange(tokens)[None].expand(batch, tokens)  # per row, as the engine passes them

            def forward(name):
                engines[name].model(input_ids=ids, position_ids=positions, use_cache=False)

            for name in engines:
                forward(name)  # warm-up
            times: dict[str, list[float]] = {k: [] for k in engines}
            for r in range(args.rounds):
                for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                    t0 = time.perf_counter()
                    forward(name)
                    times[name].append(time.perf_counter() - t0)
            row = {f"{k}_ms_median": 1000 * statistics.median(v) for k, v in times.items()}
            row |= {f"{k}_ms_min": 1000 * min(v) for k, v in times.items()}
            a, b = list(engines)
            diff = 1000 * (np.array(times[b]) - np.array(times[a]))  # what the second costs more than the first
            row["saved_ms_mean"], row["saved_ms_stderr"] = float(diff.mean()), float(diff.std(ddof=1) / len(diff) ** 0.5)
            result["shapes"][f"{batch}x{tokens}"] = row
            print(f"{batch} x {tokens} tokens", {k: round(v, 2) for k, v in row.items()}, flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, (json.dumps(result, indent=1, default=str) + "\n").encode())
    print("wrote", out)


if __name__ == "__main__":
    main()
