"""Step overhead vs tree size for a 7B Llama-shaped model in bf16 on a GPU, combined with CPU-calibrated acceptance.

Latency does not depend on the weights' values, so the model and the heads are
randomly initialised (nothing can be downloaded on a lent GPU). The timing is
distill.bench.sweep (the same code `distill bench --sweep-tree` runs on the CPU):

1. prefill ``--context`` tokens into a DynamicCache;
2. per tree size N (0 = plain), time one decoding step: the heads' top-I proposal
   from one hidden state plus one forward of the N + 1 tree tokens with the tree
   attention mask, per-depth position ids and logits for every tree token; CUDA is
   synchronised around each step; sizes are interleaved, median of ``--repeats``;
3. overhead(N) = t(N) / t(0); tau(N) = expected acceptance length of the greedy
   sparse tree of N nodes under the accuracy table measured by `distill calibrate`
   on this project's self-distilled data (``--accuracy heads/tree.json``; the CPU
   run's calibration); predicted speedup(N) = tau(N) / overhead(N).

This predicts what those heads' acceptance would give on this GPU if a 7B model's
heads were as accurate as the small model's; the reference figures are Medusa-1
2.18x and Medusa-2 2.83x on Vicuna-7B (A100), and vLLM's Medusa ~1.2x at concurrency 1.

    python benchmarks/bench_gpu_tree_overhead.py --accuracy out/heads/tree.json --out benchmarks/results/gpu_tree_overhead.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def llama_7b_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       tie_word_embeddings=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--accuracy", default=None, help="tree.json with a calibrated 'accuracy' table (default: the engine's default table)")
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--nodes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (32 = Llama-2-7B)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="benchmarks/results/gpu_tree_overhead.json")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import torch
    from transformers import LlamaForCausalLM

    from distill.bench.report import plot_sweep, sweep_markdown
    from distill.bench.sweep import sweep_tree_sizes
    from distill.store.atomic import atomic_write_bytes
    from distill.engine.tree import default_accuracy
    from distill.heads import HeadsConfig, MedusaHeads
    from distill.heads.model import TRAINED_FC_BIAS
    from distill.heads.tree import load_tree

    if args.accuracy:
        doc = load_tree(Path(args.accuracy))
        if not doc.get("accuracy"):
            raise SystemExit(f"{args.accuracy} has no calibrated accuracy table (make it with `distill calibrate`)")
        acc = [list(map(float, row)) for row in doc["accuracy"]][: args.num_heads]
        source = f"calibrated on CPU ({args.accuracy})"
    else:
        acc, source = default_accuracy(args.num_heads), "default (distill.engine.tree.default_accuracy)"
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with device:
        model = LlamaForCausalLM(llama_7b_config(args.layers)).eval()
        heads = MedusaHeads(HeadsConfig(4096, 32000, num_heads=len(acc), bias=TRAINED_FC_BIAS)).eval()
    torch.set_default_dtype(torch.float32)
    for p in heads.parameters():
        p.data.normal_(0, 0.02)
    sweep = sweep_tree_sizes(model, heads, acc, [int(n) for n in args.nodes.split(",")], args.context, args.repeats, source)
    md = sweep_markdown(sweep)
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "args": vars(args),
           "model": f"Llama-shaped, {args.layers} layers, hidden 4096, random weights, {args.dtype}",
           "torch": torch.__version__, "sweep": asdict(sweep)}
    atomic_write_bytes(out, (json.dumps(doc, indent=1) + "\n").encode())
    atomic_write_bytes(out.with_suffix(".md"), (md + "\n").encode())
    plot_sweep(sweep, out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
