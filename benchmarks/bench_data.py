"""Benchmark `distill data stats` and `distill data validate`: throughput and peak memory vs dataset size.

Datasets of N generated tokens are synthesized by repeating the rows of a real shard
folder (ids made unique with a ``#r<n>`` suffix; every copy's token and candidate ids
shifted by its own offset modulo the vocabulary, which keeps every invariant but stops
zstd from compressing the copies away), written as ordinary shards with a manifest. Each measurement runs in a fresh Python process so its peak RSS
is its own; it first runs the command once on the small source folder (lazy imports,
allocator warm-up), then RSS is sampled every 5 ms during the work (psutil) and compared with
the RSS right before it, and Arrow's memory-pool peak is reported too, so growth
with dataset size is visible. Memory must not grow with the dataset: both
commands stream record batches.

    .venv/bin/distill generate --seed sharegpt --limit 16 --shard-size 6 --max-new-tokens 64 --out /tmp/real
    .venv/bin/python benchmarks/bench_data.py --src /tmp/real --tokens 1000000 4000000 --json benchmarks/results/data.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = r"""
import json, resource, sys, threading, time
import psutil
import pyarrow as pa
from distill.data.stats import compute_stats
from distill.data.validate import validate_dataset
what, root, warm = sys.argv[1], sys.argv[2], sys.argv[3]
(validate_dataset if what == "validate" else compute_stats)(warm)  # warm-up on the small source: lazy imports, allocator
proc = psutil.Process()
rss0 = proc.memory_info().rss
peak = [rss0]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
t = time.perf_counter()
if what == "validate":
    r = validate_dataset(root)
    assert r.ok, [str(p) for p in r.problems[:5]]
    tokens, rows = r.tokens, r.rows
else:
    s = compute_stats(root)
    tokens, rows = s.tokens, s.conversations
dt = time.perf_counter() - t
done.set()
peak[0] = max(peak[0], proc.memory_info().rss)
print(json.dumps({"seconds": dt, "tokens": tokens, "rows": rows, "rss_before_mb": rss0 / 2**20,
                  "peak_rss_mb": peak[0] / 2**20, "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "arrow_pool_peak_mb": pa.default_memory_pool().max_memory() / 2**20}))
"""


def synthesize(src: Path, out: Path, target_generated: int, shard_rows: int) -> dict:
    """Repeat ``src``'s rows until ``target_generated`` generated tokens; write them as a new dataset folder."""
    from distill.data.dataset import Dataset
    from distill.data.write import ShardWriter, derived_meta

    d = Dataset.open(src)
    rows = list(d.iter_rows())
    vocab = int(d.meta["model"]["vocab_size"])
    meta = derived_meta(d.meta, "bench-repeat", source=str(src))
    generated = rep = 0
    with ShardWriter(out, meta, d.id_dtype, shard_rows) as w:
        while generated < target_generated:
            shift = (rep * 7919) % vocab  # every copy gets its own token ids, so zstd cannot just squeeze repeats
            for row in rows:
                w.add(dict(row, id=f"{row['id']}#r{rep}",
                           input_ids=((np.asarray(row["input_ids"], np.int64) + shift) % vocab).tolist(),
                           teacher_ids=((np.asarray(row["teacher_ids"], np.int64) + shift) % vocab).tolist()))
                generated += row["n_generated_tokens"]
            rep += 1
        w.close()
    return {"rows": w.count, "generated_tokens": generated, "bytes": sum(p.stat().st_size for p in out.glob("*.parquet"))}


def measure(what: str, root: Path, warm: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    r = subprocess.run([sys.executable, "-c", CHILD, what, str(root), str(warm)], capture_output=True, text=True, env=env, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, required=True, help="a real shard folder (from distill generate)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1_000_000, 4_000_000], help="generated tokens per synthetic dataset")
    ap.add_argument("--shard-size", type=int, default=1000, help="rows per synthetic shard")
    ap.add_argument("--work", type=Path, default=None, help="folder for the synthetic datasets (default: a temp folder)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of throughput and peak RSS vs size here")
    args = ap.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="bench-data-"))
    results = {"machine": f"{platform.machine()} {os.cpu_count()} CPU, {platform.python_version()}",
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "src": str(args.src), "runs": []}
    for n in args.tokens:
        root = work / f"synth-{n}"
        t = time.perf_counter()
        info = synthesize(args.src, root, n, args.shard_size) if not root.exists() else None
        if info:
            print(f"synthesized {root}: {info['rows']:,} rows, {info['generated_tokens']:,} generated tokens, "
                  f"{info['bytes'] / 1e6:.1f} MB in {time.perf_counter() - t:.1f}s", flush=True)
        for what in ("validate", "stats"):
            m = measure(what, root, args.src)
            run = {"command": what, "target_generated_tokens": n, **m, "tokens_per_s": m["tokens"] / m["seconds"],
                   "rows_per_s": m["rows"] / m["seconds"], "growth_mb": m["peak_rss_mb"] - m["rss_before_mb"]}
            results["runs"].append(run)
            print(f"{what:8s} {n:>10,} gen tokens ({m['tokens']:,} total): {m['seconds']:6.2f}s "
                  f"{run['tokens_per_s']:>12,.0f} tok/s, peak RSS {m['peak_rss_mb']:.1f} MB "
                  f"(before {m['rss_before_mb']:.1f} MB, +{run['growth_mb']:.1f} MB; Arrow pool peak {m['arrow_pool_peak_mb']:.1f} MB)",
                  flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        plot(results, args.plot)


def plot(results: dict, out: Path) -> None:
    import matplotlib

    from distill.store.atomic import atomic_write_figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for what, colour in (("validate", "#C44E52"), ("stats", "#4C72B0")):
        runs = [r for r in results["runs"] if r["command"] == what]
        x = [r["target_generated_tokens"] / 1e6 for r in runs]
        a.plot(x, [r["tokens_per_s"] / 1e6 for r in runs], "o-", color=colour, label=what)
        b.plot(x, [r["peak_rss_mb"] for r in runs], "o-", color=colour, label=f"{what}: peak RSS")
        b.plot(x, [r["rss_before_mb"] for r in runs], "o--", color=colour, alpha=0.5, label=f"{what}: RSS before")
    a.set(xlabel="generated tokens (millions)", ylabel="million tokens / s", title="throughput", ylim=(0, None))
    b.set(xlabel="generated tokens (millions)", ylabel="MB", title="memory (flat = streamed)", ylim=(0, None))
    sizes = sorted({r["target_generated_tokens"] / 1e6 for r in results["runs"]})
    for ax in (a, b):
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{v:g}" for v in sizes])
        ax.minorticks_off()
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"distill data validate / stats — {results['machine']}, {results['date']}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_figure(out, fig, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
