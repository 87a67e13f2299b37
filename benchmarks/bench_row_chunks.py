"""The attention over row chunks against one call over every row's keys, one layer's shapes of the bundled model.

    OMP_NUM_THREADS=2 PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/bench_row_chunks.py --out benchmarks/results/row-chunks.json

``distill.engine.attention.sdpa_gqa`` with and without the plan of ``plan_row_chunks`` on the same random
queries, keys and values (9 query heads, 3 key/value heads of 64, float32): a plain step (one query per row)
of 16 rows whose lengths are MT-Bench first turns (questions 0-15, and 40-55 with their long prompts, in
seed order and sorted longest first, as a prefill now puts them) with 0 and 64 tokens generated, and the
prefill of questions 40-55. Each layer reads its own keys (30 layers' storage, cycled), so the cache is as
cold as in a forward. Microseconds per layer call (median of ``--rounds`` alternating timings of ``--calls``
calls), and how far the outputs part (row chunks leave out masked keys only: the same softmax, another
summation order). Also the cost of one more call: 16 one-row calls against one 16-row call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batching import mt_bench_prompts  # noqa: E402
from bench_engine_step import cpu_description  # noqa: E402

from distill.engine.attention import CHUNK_OVERHEAD, plan_row_chunks, sdpa_gqa  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30


def mt_bench_lengths(n: int) -> list[int]:
    """The token lengths of the first ``n`` MT-Bench first turns under the bundled model's chat template (seed order)."""
    from transformers import AutoTokenizer

    from distill.models import resolve_model

    return [len(p) for p in mt_bench_prompts(AutoTokenizer.from_pretrained(resolve_model(None).path), n)]


def timed(fn, calls: int, rounds: int) -> list[float]:
    for _ in range(5):
        fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return out


def compare(name: str, queries: list[int], keys: list[int], T: int, causal: bool, store, args) -> dict:
    B, W = len(keys), max(keys)
    if causal:  # a prefill: query t sees slots 0..t
        allowed = (torch.arange(W)[None, :] <= torch.arange(T)[:, None])[None, None]
    else:  # a plain step: row b's query sees its first keys[b] slots
        allowed = (torch.arange(W)[None] < torch.tensor(keys)[:, None])[:, None, None]
    bias = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    q = torch.randn(B, HEADS, T, DIM)
    plan = plan_row_chunks(queries, keys)
    K, V = store
    layer = [0]

    def call(chunks):
        i = layer[0] = (layer[0] + 1) % LAYERS
        return sdpa_gqa(None, q, K[i, :B, :, :W], V[i, :B, :, :W], bias, row_chunks=chunks)[0]

    layer[0] = -1
    whole = call(None)
    layer[0] = -1
    split = call(plan)
    diff = max(float((whole[b, :n] - split[b, :n]).abs().max()) for b, n in enumerate(queries))
    whole_us, split_us = [], []
    for r in range(args.rounds):  # alternating
        pair = [("whole", None), ("split", plan)]
        for label, chunks in pair if r % 2 == 0 else pair[::-1]:
            (whole_us if label == "whole" else split_us).extend(timed(lambda: call(chunks), args.calls, 1))
    row = {"case": name, "rows": B, "queries": T, "window": W, "chunks": [list(c) for c in plan] if plan else None,
           "whole_us": round(statistics.median(whole_us), 1), "chunked_us": round(statistics.median(split_us), 1),
           "max_abs_diff": diff}
    row["ratio"] = round(row["chunked_us"] / row["whole_us"], 3)
    print(f"{name:34s} chunks {len(plan) if plan else 1:2d}  whole {row['whole_us']:8.1f} us  chunked {row['chunked_us']:8.1f} us"
          f"  x{row['ratio']:.3f}  max diff {diff:.1e}")
    return row


def call_cost(store, args) -> dict:
    """One 16-row call against 16 one-row calls over the same keys (equal lengths): what one more call costs."""
    B, W = 16, 200
    K, V = store
    q = torch.randn(B, HEADS, 1, DIM)
    bias = torch.zeros(B, 1, 1, W)
    rows = [(b, b + 1, 1, W) for b in range(B)]
    one = statistics.median(timed(lambda: sdpa_gqa(None, q, K[0, :, :, :W], V[0, :, :, :W], bias)[0], args.calls, args.rounds))
    many = statistics.median(timed(lambda: sdpa_gqa(None, q, K[0, :, :, :W], V[0, :, :, :W], bias, row_chunks=rows)[0],
                                   args.calls, args.rounds))
    extra = (many - one) / (B - 1)
    pair = one / (B * W)
    print(f"one call {one:.1f} us, 16 calls {many:.1f} us: one more call {extra:.1f} us = {extra / pair:.0f} query-key pairs "
          f"(CHUNK_OVERHEAD {CHUNK_OVERHEAD})")
    return {"one_call_us": round(one, 1), "sixteen_calls_us": round(many, 1), "extra_call_us": round(extra, 1),
            "extra_call_pairs": round(extra / pair), "chunk_overhead": CHUNK_OVERHEAD}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()
    lengths = mt_bench_lengths(56)
    FIRST_16, TAIL_16 = lengths[:16], lengths[40:56]
    torch.manual_seed(0)
    slots = max(TAIL_16) + 64 + 1
    store = (torch.randn(LAYERS, 16, KV_HEADS, slots, DIM), torch.randn(LAYERS, 16, KV_HEADS, slots, DIM))
    rows = []
    for label, lengths in (("questions 0-15", FIRST_16), ("questions 40-55", TAIL_16),
                           ("questions 40-55, longest first", sorted(TAIL_16, reverse=True))):
        for generated in (0, 64):
            keys = [n + generated + 1 for n in lengths]
            rows.append(compare(f"step, {label}, +{generated}", [1] * 16, keys, 1, False, store, args))
    tail = sorted(TAIL_16, reverse=True)
    rows.append(compare("prefill, questions 40-55", tail, tail, max(tail), True, store,
                        argparse.Namespace(rounds=max(3, args.rounds // 3), calls=max(3, args.calls // 20))))
    result = {"cpu": cpu_description(), "cases": rows, "call_cost": call_cost(store, args)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print("wrote", args.out)


if __name__ == "__main__":
    main()
