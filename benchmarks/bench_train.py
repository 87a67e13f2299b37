"""Benchmarks of `distill train-heads`.

1. throughput: training tokens/s and peak memory (K=4, --share-lm-head on/off), each config in its own process
2. accuracy:   per-head top-1 on a held-out split after a fixed token budget: hard vs soft targets,
               Medusa-1 vs Medusa-2 (K=4, shared LM head so a CPU run stays short)
3. loss memory: peak RSS of the chunked Medusa loss (forward + backward) vs sequence length T, chunked vs
               one chunk per head (the whole (B, T, V) of a head at once)

Usage: python benchmarks/bench_train.py --data DIR [--parts throughput,accuracy,memory] [--out benchmarks/results]
The dataset is split by shard: the last --heldout-shards shards are held out; or --heldout DIR
names a held-out dataset (e.g. the eval half of `distill data split`) and --data is all training data.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def split_dataset(data: Path, heldout_shards: int, work: Path) -> tuple[Path, Path]:
    """Two dataset folders sharing the shard files: train = all but the last N shards, heldout = those."""
    manifest = json.loads((data / "manifest.json").read_text())
    shards = [s for s in manifest["shards"] if s["file"]]
    parts = {"train": shards[:-heldout_shards], "heldout": shards[-heldout_shards:]}
    out = {}
    for name, subset in parts.items():
        folder = work / name
        folder.mkdir(parents=True, exist_ok=True)
        for s in subset:
            shutil.copy2(data / s["file"], folder / s["file"])
        doc = {**manifest, "shards": subset,
               "totals": {"rows": sum(s["rows"] for s in subset), "generated_tokens": sum(s["generated_tokens"] for s in subset),
                          "prompt_tokens": sum(s["prompt_tokens"] for s in subset)}}
        (folder / "manifest.json").write_text(json.dumps(doc))
        out[name] = folder
    return out["train"], out["heldout"]


TRAIN_CHILD = r"""
import json, sys
from distill.train import TrainConfig, train
s = train(TrainConfig.from_dict(json.loads(sys.argv[1])))
print("RESULT " + json.dumps({"tokens_per_s": s.tokens_per_s, "tokens": s.tokens, "seconds": s.seconds,
                              "peak_memory_mb": s.peak_memory_mb, "steps": s.steps, "final": s.final}))
"""


def run_child(code: str, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if p.returncode or not lines:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(lines[-1][7:])


def bench_throughput(train_dir: Path, work: Path, args) -> list[dict]:
    rows = []
    for share in (True, False):
        for precision in args.precisions.split(","):
            cfg = dict(data=str(train_dir), out=str(work / f"thr-{share}-{precision}"), heads=4, share_lm_head=share,
                       max_len=args.max_len, batch_size=args.batch_size, steps=args.throughput_steps, lr=1e-3, progress=False,
                       save_every=0, precision=precision, pack=args.pack)
            r = run_child(TRAIN_CHILD, json.dumps(cfg))
            rows.append({"share_lm_head": share, "precision": precision, "pack": args.pack,
                         **{k: r[k] for k in ("tokens_per_s", "tokens", "seconds", "peak_memory_mb", "steps")}})
        print(json.dumps(rows[-1]), flush=True)
    return rows


EVAL_CHILD = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM
from distill.heads.model import MedusaHeads
from distill.models import resolve_model
from distill.train.calibrate import head_accuracy
heads_dir, data, model, max_len, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
bb = AutoModelForCausalLM.from_pretrained(resolve_model(model or None).path, dtype=torch.float32).eval()
if heads_dir == "init":
    from distill.train import TrainConfig
    from distill.train.trainer import build_heads
    heads = build_heads(bb, TrainConfig(data="x", heads=4, share_lm_head=True))
else:
    heads = MedusaHeads.load(heads_dir)
a = head_accuracy(bb, heads, data, max_len=max_len, ranks=5, max_tokens=max_tokens)
print("RESULT " + json.dumps({"top1": a.topk(1), "top5": a.topk(5), "loss": a.loss, "positions": a.counts}))
"""


def bench_accuracy(train_dir: Path, heldout: Path, work: Path, args) -> list[dict]:
    variants = [("medusa1", "hard"), ("medusa1", "soft"), ("medusa2", "hard"), ("medusa2", "soft")]
    rows = []
    init = run_child(EVAL_CHILD, "init", str(heldout), "", str(args.max_len), str(args.eval_tokens))
    rows.append({"variant": "untrained (LM head copies)", **init})
    print(json.dumps(rows[-1]), flush=True)
    steps = max(1, args.token_budget // (args.batch_size * args.max_len))
    for mode, targets in variants:
        out = work / f"acc-{mode}-{targets}"
        cfg = dict(data=str(train_dir), out=str(out), heads=4, share_lm_head=True, mode=mode, targets=targets,
                   max_len=args.max_len, batch_size=args.batch_size, steps=steps, lr=args.lr, warmup_steps=2,
                   progress=False, lambda0=0.2, lambda0_schedule="sine", lambda0_warmup=max(1, steps // 4),
                   merge_adapter=mode == "medusa2", lora_r=32, lora_alpha=16, precision=args.precision, pack=args.pack)
        t = run_child(TRAIN_CHILD, json.dumps(cfg))
        model = str(out / "merged") if mode == "medusa2" else ""
        e = run_child(EVAL_CHILD, str(out), str(heldout), model, str(args.max_len), str(args.eval_tokens))
        rows.append({"variant": f"{mode} {targets}", "train_tokens": t["tokens"], "steps": t["steps"],
                     "train_seconds": t["seconds"], **e})
        print(json.dumps(rows[-1]), flush=True)
    return rows


MEM_CHILD = r"""
import resource, sys, torch
from distill.train.losses import Term, chunked_term_losses
T, chunk, V, K = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
H = 64
W = [torch.randn(V, H, requires_grad=True) for _ in range(K)]
hidden = torch.randn(1, T, H)
ids = torch.randint(0, V, (1, T))
mask = torch.ones(1, T, dtype=torch.bool)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
losses, _ = chunked_term_losses(hidden, [Term(lambda h, k=k: h @ W[k].T, k + 2) for k in range(K)], ids, mask, chunk=chunk)
losses.sum().backward()
print("RESULT %d" % ((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024))
"""


def bench_memory(args) -> list[dict]:
    rows = []
    env_before = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed logits go back to the OS: RSS peak = live-tensor peak
    try:
        for T in (256, 512, 1024, 2048, 4096):
            chunked = run_child(MEM_CHILD, str(T), "128", "49152", "4")
            whole = run_child(MEM_CHILD, str(T), str(T), "49152", "4")
            rows.append({"T": T, "chunked_128_mb": chunked / 2**20, "one_chunk_per_head_mb": whole / 2**20,
                         "dense_BTKV_logits_mb": T * 4 * 49152 * 4 / 2**20})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if env_before is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    return rows


def plot_memory(rows: list[dict], path: Path) -> None:
    import matplotlib

    from distill.store.atomic import atomic_write_figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = [r["T"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(T, [r["chunked_128_mb"] for r in rows], "o-", label="chunked loss (128 positions)")
    ax.plot(T, [r["one_chunk_per_head_mb"] for r in rows], "s-", label="one chunk per head (B, T, V)")
    ax.plot(T, [r["dense_BTKV_logits_mb"] for r in rows], "k--", label="size of dense (B, T, K, V) logits")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("peak memory increase (MiB)")
    ax.set_title("Medusa loss fwd+bwd, K=4, V=49152, B=1")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write_figure(Path(path), fig, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--parts", default="throughput,accuracy,memory")
    ap.add_argument("--heldout-shards", type=int, default=2)
    ap.add_argument("--heldout", type=Path, default=None, help="a held-out dataset folder (instead of --heldout-shards)")
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--throughput-steps", type=int, default=4)
    ap.add_argument("--token-budget", type=int, default=8192, help="input tokens per accuracy run")
    ap.add_argument("--eval-tokens", type=int, default=3000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--precision", default="fp32", help="accuracy runs: fp32 | bf16 (autocast; fast on CPUs with AVX512-BF16)")
    ap.add_argument("--precisions", default="fp32,bf16", help="throughput runs: the precisions compared")
    ap.add_argument("--pack", action="store_true", help="pack windows end to end (no padding compute)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "train.json")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": {k: str(v) for k, v in vars(args).items()}}
    try:
        if args.heldout is not None:
            train_dir, heldout = args.data, args.heldout
        else:
            train_dir, heldout = split_dataset(args.data, args.heldout_shards, work)
        if "memory" in parts:
            result["loss_memory"] = bench_memory(args)
        if "throughput" in parts:
            result["throughput"] = bench_throughput(train_dir, work, args)
        if "accuracy" in parts:
            result["accuracy"] = bench_accuracy(train_dir, heldout, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prev = json.loads(args.out.read_text()) if args.out.exists() else {}
    args.out.write_text(json.dumps({**prev, **result}, indent=1) + "\n")
    if "loss_memory" in result:
        plot_memory(result["loss_memory"], args.out.with_name("train-loss-memory.png"))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
