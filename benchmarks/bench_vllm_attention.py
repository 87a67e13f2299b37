"""A plain step's attention: the engine's SDPA (in row chunks) against vLLM's CPU kernel reading a cache of the slot cache's shape.

    OMP_NUM_THREADS=2 PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/bench_vllm_attention.py --out benchmarks/results/vllm-attention.json

The slot cache keeps each layer's keys and values as (rows, kv_heads, slots, head_dim). vLLM's
``_C::cpu_attention_with_kv_cache`` reads paged caches of (blocks, kv_heads, block_size, head_dim):
one block per row (block table ``[[b]]``, block size = the slots) is the slot cache's shape. Its values
are laid out as ours; its keys are written by ``_C::cpu_attn_reshape_and_cache`` in an order of its own
(what the script checks and reports), so the kernel reads a copy written through that op. One query per
row (a plain step) of 16 rows whose lengths are MT-Bench first turns (questions 0-15 and 40-55) with 32
tokens generated, the bundled model's shapes (9 query heads, 3 key/value heads of 64, float32), 30
layers' storage cycled. Microseconds per layer call (median of rounds), and the largest difference of the
outputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine_step import cpu_description  # noqa: E402
from bench_row_chunks import DIM, HEADS, KV_HEADS, LAYERS, mt_bench_lengths, timed  # noqa: E402

from distill.engine.attention import plan_row_chunks, sdpa_gqa  # noqa: E402

GENERATED = 32


def per_layer_us(fn, calls: int, rounds: int) -> float:
    """Median microseconds of ``fn(layer)``, the layers' storage cycled call by call."""
    layer = iter(range(10**9))
    return statistics.median(timed(lambda: fn(next(layer) % LAYERS), calls, rounds))


def compare(name: str, lengths: list[int], args) -> dict:
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    B = len(lengths)
    ends = [n + GENERATED for n in lengths]
    S = -(-(max(ends) + 1) // 64) * 64  # the slot cache's capacity: a multiple of 64 (engine.batch.SLOT_ROUND)
    keys, values = torch.randn(LAYERS, B, KV_HEADS, S, DIM), torch.randn(LAYERS, B, KV_HEADS, S, DIM)
    query = torch.randn(B, HEADS, 1, DIM)
    W = max(ends) + 1
    allowed = (torch.arange(W)[None] < torch.tensor(ends)[:, None] + 1)[:, None, None]
    bias = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    plan = plan_row_chunks([1] * B, [e + 1 for e in ends])

    def sdpa(i: int) -> torch.Tensor:
        return sdpa_gqa(None, query, keys[i, :, :, :W], values[i, :, :, :W], bias, row_chunks=plan)[0][:, 0]

    # vLLM's copy of the keys, written through its own op; its values are ours
    isa = _get_attn_isa(torch.float32, S, DIM)
    theirs = torch.zeros_like(keys)
    slots = (torch.arange(B)[:, None] * S + torch.arange(S)[None]).reshape(-1)
    for i in range(LAYERS):
        flat_k = keys[i].permute(0, 2, 1, 3).reshape(B * S, KV_HEADS, DIM).contiguous()
        flat_v = values[i].permute(0, 2, 1, 3).reshape(B * S, KV_HEADS, DIM).contiguous()
        written_v = torch.zeros_like(values[i])
        ops.cpu_attn_reshape_and_cache(flat_k, flat_v, theirs[i], written_v, slots, isa)
        if i == 0:
            same_values = torch.equal(written_v, values[i])
            same_keys = torch.equal(theirs[i], keys[i])
    seq_lens = torch.tensor([e + 1 for e in ends], dtype=torch.int32)
    starts = torch.arange(B + 1, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=B, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
                                               seq_lens=seq_lens, dtype=torch.float32, query_start_loc=starts, causal=True,
                                               sliding_window_size=-1, isa=isa, enable_kv_split=False)
    table = torch.arange(B, dtype=torch.int32)[:, None]
    out = torch.empty(B, HEADS, DIM)
    q_rows = query[:, :, 0].contiguous()

    def kernel(i: int) -> torch.Tensor:
        ops.cpu_attention_with_kv_cache(q_rows, theirs[i], values[i], out, starts, seq_lens, DIM ** -0.5, True, None, -1,
                                        table, 0.0, meta, None)
        return out

    diff = float((sdpa(0) - kernel(0)).abs().max())
    row = {"case": name, "rows": B, "slots": S, "isa": isa, "values_as_ours": same_values, "keys_as_ours": same_keys,
           "sdpa_row_chunks_us": round(per_layer_us(sdpa, args.calls, args.rounds), 1),
           "vllm_kernel_us": round(per_layer_us(kernel, args.calls, args.rounds), 1), "max_abs_diff": diff}
    row["ratio"] = round(row["vllm_kernel_us"] / row["sdpa_row_chunks_us"], 3)
    print(json.dumps(row))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    lengths = mt_bench_lengths(56)
    rows = [compare("questions 0-15", lengths[:16], args), compare("questions 40-55", lengths[40:56], args)]
    if args.out:
        Path(args.out).write_text(json.dumps({"cpu": cpu_description(), "cases": rows}, indent=1) + "\n")
        print("wrote", args.out)


if __name__ == "__main__":
    main()
