"""vLLM's OpenAI server on a CPU: its own process layout against the one `distill serve --engine vllm` sets.

    python benchmarks/bench_vllm_server_layout.py --repeats 2 --json benchmarks/results/vllm-server-layout-intel.json

Two layouts of the same server (``python -m vllm.entrypoints.openai.api_server``, the bundled model, float32,
``--enforce-eager``, 2 GiB of KV cache, the thread variables of this shell):

* ``vllm default``: API server, engine-core process and a worker process; vLLM binds the worker's threads to
  all cores but one and reserves that one for the engine core, which waits for the worker's results by
  spinning on shared memory;
* ``worker in engine core``: the same with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (what
  :func:`distill.runtime.vllm_cpu_env` sets): the API server keeps its engine-core process, and vLLM runs the
  worker inside it (its one-device ``uni`` executor).

Per start: seconds until ``/v1/models`` answers (polled every second) and the CPU seconds the server's processes took by then; then
``--requests`` completions one at a time and ``--concurrent-requests`` at ``--concurrency`` in flight (greedy,
``ignore_eos``, 20 logprobs a token, as the openai backend asks for them), each phase timed with the CPU the
server's processes used in it; then the CPU used over ``--idle`` seconds with nothing to do. The layouts
alternate (reversed every other repeat); every server must return the same texts as the first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_generate_server import server_cpu
from bench_serve import free_port
from bench_vs_vllm import Server
from distill.models import resolve_model
from distill.runtime import cpu_info, vllm_cpu_env
from distill.store.atomic import atomic_write_bytes

LAYOUTS = {"vllm default": {}, "worker in engine core": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


def cpu_seconds(server: Server) -> float:
    """CPU seconds so far of all of the server's processes (API server, engine core, worker if any)."""
    return sum(server_cpu([server]).values())


def complete(url: str, model: str, prompt: str, max_tokens: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 20}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["choices"][0]["text"]


def measure(layout: str, args, log_dir: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": vllm_cpu_env()["VLLM_CPU_KVCACHE_SPACE"], "TORCH_COMPILE_DISABLE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(LAYOUTS[layout])
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model(None).path),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
           "--max-logprobs", "20", "--enforce-eager"]
    start = time.perf_counter()
    server = Server(cmd, env, log_dir / f"{layout.replace(' ', '-')}-{port}.log")
    try:
        model = server.wait_ready(url, timeout=900)
        row = {"layout": layout, "start_s": round(time.perf_counter() - start, 2), "start_cpu_s": round(cpu_seconds(server), 2)}
        prompts = [f"Tell me a story, number {i}." for i in range(args.requests)]
        cpu0, t0 = cpu_seconds(server), time.perf_counter()
        texts = [complete(url, model, p, args.max_tokens) for p in prompts]
        seconds = time.perf_counter() - t0
        row["one_at_a_time"] = {"tokens": args.requests * args.max_tokens, "seconds": round(seconds, 2),
                                "tokens_per_s": round(args.requests * args.max_tokens / seconds, 2),
                                "cpu_s": round(cpu_seconds(server) - cpu0, 2)}
        more = [f"Write a short poem about the number {i}." for i in range(args.concurrent_requests)]
        cpu0, t0 = cpu_seconds(server), time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            texts += list(pool.map(lambda p: complete(url, model, p, args.max_tokens), more))
        seconds = time.perf_counter() - t0
        row["concurrent"] = {"concurrency": args.concurrency, "tokens": args.concurrent_requests * args.max_tokens,
                             "seconds": round(seconds, 2),
                             "tokens_per_s": round(args.concurrent_requests * args.max_tokens / seconds, 2),
                             "cpu_s": round(cpu_seconds(server) - cpu0, 2)}
        cpu0 = cpu_seconds(server)
        time.sleep(args.idle)
        row["idle"] = {"seconds": args.idle, "cpu_s": round(cpu_seconds(server) - cpu0, 2)}
        row["texts"] = texts
        return row
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8, help="completions sent one at a time")
    ap.add_argument("--concurrent-requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--idle", type=float, default=3.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            order = list(LAYOUTS) if rep % 2 == 0 else list(LAYOUTS)[::-1]
            for layout in order:
                row = measure(layout, args, Path(tmp))
                row["repeat"] = rep
                runs.append(row)
                print(f"{layout:22s} start {row['start_s']:5.1f} s ({row['start_cpu_s']:5.1f} CPU-s) | one at a time "
                      f"{row['one_at_a_time']['tokens_per_s']:6.1f} tok/s ({row['one_at_a_time']['cpu_s']:5.1f} CPU-s) | "
                      f"{args.concurrency} at a time {row['concurrent']['tokens_per_s']:6.1f} tok/s "
                      f"({row['concurrent']['cpu_s']:5.1f} CPU-s) | idle {row['idle']['cpu_s']:.2f} CPU-s", flush=True)
    same = all(r["texts"] == runs[0]["texts"] for r in runs)
    summary = {}
    for layout in LAYOUTS:
        rows = [r for r in runs if r["layout"] == layout]
        summary[layout] = {
            "start_s": round(sum(r["start_s"] for r in rows) / len(rows), 2),
            "one_at_a_time_tokens_per_s": round(sum(r["one_at_a_time"]["tokens"] for r in rows)
                                                / sum(r["one_at_a_time"]["seconds"] for r in rows), 2),
            "concurrent_tokens_per_s": round(sum(r["concurrent"]["tokens"] for r in rows)
                                             / sum(r["concurrent"]["seconds"] for r in rows), 2),
            "cpu_s_per_token": round(sum(r["one_at_a_time"]["cpu_s"] + r["concurrent"]["cpu_s"] for r in rows)
                                     / sum(r["one_at_a_time"]["tokens"] + r["concurrent"]["tokens"] for r in rows), 4),
        }
    a, b = summary["worker in engine core"], summary["vllm default"]
    ratios = {"one_at_a_time": round(a["one_at_a_time_tokens_per_s"] / b["one_at_a_time_tokens_per_s"], 2),
              "concurrent": round(a["concurrent_tokens_per_s"] / b["concurrent_tokens_per_s"], 2)}
    print(f"worker in engine core / vllm default: one at a time {ratios['one_at_a_time']}x, "
          f"{args.concurrency} at a time {ratios['concurrent']}x; same texts: {same}")
    if args.json:
        cpu = cpu_info()
        doc = {"args": vars(args) | {"json": str(args.json)}, "cpu": {"model": cpu.model, "cores": cpu.cores},
               "threads": {k: os.environ.get(k) for k in ("OMP_NUM_THREADS",)}, "summary": summary, "ratios": ratios,
               "same_texts": same, "runs": [{k: v for k, v in r.items() if k != "texts"} for r in runs]}
        atomic_write_bytes(args.json, (json.dumps(doc, indent=1) + "\n").encode())
    if not same:
        raise SystemExit("the layouts returned different texts")


if __name__ == "__main__":
    main()
