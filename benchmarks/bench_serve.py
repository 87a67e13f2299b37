"""Serving throughput at concurrency 1, 4, 16: plain vs a drafter through the real `distill serve` HTTP server.

Two `distill serve` processes run side by side (plain: no heads; drafter: --heads DIR, Medusa heads,
an EAGLE-3 drafter or ``lookup``; older result files call it "medusa");
for each concurrency C the two are measured one after the other (alternating which goes
first), C client threads of the official `openai` client each send `--rounds` greedy chat
requests (MT-Bench first turns, `--max-tokens` each). Throughput = completion tokens
/ wall-clock seconds of the whole wave; latency = mean request seconds.

    .venv/bin/python benchmarks/bench_serve.py --heads out/heads --max-tokens 64 --rounds 2 --out benchmarks/results/serve.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

REPO = Path(__file__).resolve().parents[1]
DISTILL = str(Path(sys.executable).with_name("distill"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([DISTILL, "serve", "--port", str(port), "--log-level", "warning", *args],
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"distill serve exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("distill serve did not start")


def wave(url: str, prompts: list[str], concurrency: int, rounds: int, max_tokens: int) -> dict:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=3600, max_retries=0)
    model = client.models.list().data[0].id

    def worker(w: int) -> list[tuple[int, float]]:
        out = []
        for r in range(rounds):
            q = prompts[(w * rounds + r) % len(prompts)]
            t0 = time.perf_counter()
            resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}], temperature=0, max_tokens=max_tokens)
            out.append((resp.usage.completion_tokens, time.perf_counter() - t0))
        return out

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        done = [x for xs in pool.map(worker, range(concurrency)) for x in xs]
    wall = time.perf_counter() - t0
    tokens = sum(t for t, _ in done)
    return {"concurrency": concurrency, "requests": len(done), "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall, "mean_latency_s": sum(s for _, s in done) / len(done)}


def metric(url: str, name: str) -> float:
    """The samples named ``name`` on ``url``'s /metrics, summed over their label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return sum(s.value for family in families for s in family.samples if s.name == name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tree", default=None)
    ap.add_argument("--lookup", action="store_true", help="with --heads FOLDER: the drafter server merges the lookup proposer's "
                    "trees into the drafter's (--lookup)")
    ap.add_argument("--lookup-nodes", type=int, default=None, help="the drafter server's --lookup-nodes")
    ap.add_argument("--lookup-data", default=None, help="with --heads lookup or --lookup: the drafter server's datastore (--lookup-data)")
    ap.add_argument("--lookup-history", type=int, default=0,
                    help="with --heads lookup or --lookup: the drafter server's --lookup-history (default 0: the waves repeat the "
                         "same prompts, whose earlier replies a history would replay; bench_eagle.py measures it)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client thread")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/serve.json")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from distill.bench import load_prompts
    from distill.runtime import machine

    prompts = [p.messages[-1]["content"] for p in load_prompts("mt-bench")]
    levels = [int(c) for c in args.concurrency.split(",")]
    common = ["--max-batch", str(max(levels)), "--queue-size", str(4 * max(levels) * args.rounds)]
    if args.model:
        common += ["--model", args.model]
    engines = {"plain": common, "drafter": common + ["--heads", args.heads] + (["--tree", args.tree] if args.tree else [])
               + (["--lookup-data", args.lookup_data] if args.lookup_data else [])
               + (["--lookup"] if args.lookup else [])
               + (["--lookup-nodes", str(args.lookup_nodes)] if args.lookup_nodes else [])
               + (["--lookup-history", str(args.lookup_history)] if args.heads == "lookup" or args.lookup else [])}
    # Both servers stay up and the waves alternate (plain, drafter, drafter, plain, ...), so a
    # shared machine's load drifts hit both alike; an idle server costs memory, not CPU.
    servers = {name: start(extra, Path(f"/tmp/bench_serve_{name}.log")) for name, extra in engines.items()}
    results: dict[str, list[dict]] = {name: [] for name in engines}
    try:
        for name, (_, url) in servers.items():
            wave(url, prompts, 1, 2, 8)  # warm-up: the first requests pay for lazy init and allocations
        for i, c in enumerate(levels):
            order = list(servers) if i % 2 == 0 else list(reversed(servers))
            for name in order:
                url = servers[name][1]
                steps0, tok0 = metric(url, "distill_tokens_per_step_count"), metric(url, "distill_tokens_per_step_sum")
                row = wave(url, prompts, c, args.rounds, args.max_tokens)
                steps, tok = metric(url, "distill_tokens_per_step_count") - steps0, metric(url, "distill_tokens_per_step_sum") - tok0
                row["tokens_per_step"] = tok / steps if steps else None
                results[name].append(row)
                print(f"{name:7s} c={c:3d} {row['tokens_per_s']:8.1f} tok/s  latency {row['mean_latency_s']:.2f}s  "
                      f"tokens/step {row['tokens_per_step'] or 0:.2f}", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers.values():
            proc.wait(timeout=120)
    table = ["| concurrency | plain tok/s | drafter tok/s | drafter / plain | drafter tokens/step |", "| ---: | ---: | ---: | ---: | ---: |"]
    for p, m in zip(results["plain"], results["drafter"]):
        table.append(f"| {p['concurrency']} | {p['tokens_per_s']:.1f} | {m['tokens_per_s']:.1f} | {m['tokens_per_s'] / p['tokens_per_s']:.2f}x | "
                     f"{m['tokens_per_step'] or 0:.2f} |")
    print("\n".join(table))
    doc = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "args": vars(args), "cpus": os.cpu_count(),
           "machine": machine(),
           "results": results, "table": table}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
