"""`distill serve` against vLLM's best configuration on the same machine, measured by vLLM's own benchmark client.

    .venv/bin/python benchmarks/bench_vs_vllm.py --drafter lookup --drafter out/quickstart/heads \\
        --vllm-spec eagle3=out/quickstart/heads --prompts-per-level 16,24,40 --concurrency 1,4,16 --repeats 1

Servers (``--servers``, a subset of ``abcdv``), each started on 127.0.0.1 by this script, measured at
every concurrency, then stopped, one at a time, all in the same dtype (:func:`distill.runtime.placement`):

a  ``vllm serve MODEL``: ``python -m vllm.entrypoints.openai.api_server --model DIR --dtype D``, vLLM's
   defaults otherwise (on a CPU its KV cache size from :func:`distill.runtime.vllm_cpu_env`; its process layout
   is vLLM's own: engine core and worker processes, one core reserved for the engine core).
v  vLLM in its fastest layout here (on a CPU the worker inside the engine core, every setting of
   :func:`distill.runtime.vllm_cpu_env`), once per ``--vllm-spec``: plain (``none``), ``ngram`` and ``eagle3``
   with the settings of vLLM's own examples, ``suffix`` (SuffixDecoding; needs ``arctic-inference`` importable by
   ``--vllm-python``) with vLLM's defaults. A spec that cannot start is a row that says why.
b  ``distill serve``: plain decoding.
c  ``distill serve --heads H``: our engine with drafter H, once per ``--drafter`` (a Medusa or EAGLE-3 folder,
   or ``lookup``: n-gram matches in the context, nothing trained; the default when no drafter is given). The
   lookup servers run without their history of earlier replies (each concurrency level resends the prompts);
   ``--lookup-history N`` adds a twin of each with it (``c:lookup+history``), measured in one pass.
d  ``distill serve --engine vllm --heads H``: vLLM with H as its speculator (``lookup``: vLLM's ``ngram``).

``distill serve`` gets ``--max-batch`` = the largest concurrency (its default, 8, would queue requests at
concurrency 16 that vLLM runs); ``--vllm-arg`` options go to the vLLM servers (a, d, v) only.

The request set: the first user turn of each bundled MT-Bench question (the first ``--limit``, seed
order), written as the JSONL of vLLM's ``--dataset-name custom`` and sent unshuffled through
``--backend openai-chat`` with ``--skip-chat-template``, so every server applies the model's chat template
itself; greedy (``--temperature 0``), ``--max-tokens`` output tokens each, forced with ``--ignore-eos`` (both
engines honour ``ignore_eos``); ``--max-concurrency C`` at an unbounded request rate, after ``--warmups``
untimed requests per server start. ``--repeats R`` starts every server R times, the order reversed every
other repeat (a b c d, d c b a, ...), so a drift in the machine's load hits all alike.

``--prompts-per-level N1,N2,...`` gives each concurrency level a slice of its own of the prompts (the first N1 at the
first level, the next N2 at the second, ...), so that every server sees each prompt once: then the lookup servers keep
their history of earlier replies and vLLM's ``suffix`` its global tree, as in serving, without replaying a reply to
the same prompt. The warm-ups are then this script's own (``--warmups`` chat requests of a prompt outside the set)
and the client's ready-check request is skipped. Without it every level resends the same prompts, so the lookup
servers run without a history (``--lookup-history 0``) and ``suffix`` without its global tree
(``suffix_decoding_max_cached_requests: 0``).

Each level of a distill server also records the engine's own figures from its ``/metrics`` (``engine``: the scrape
after the level less the one before): decoding steps, their mean wall time, rows a step, drafted and accepted tokens
a row-step, prefill seconds. A server whose tokens per second moved between runs at the same acceptance thus says
whether its steps were slower (the machine) or drafted more (the policy).

Figures (per server and concurrency, all repeats pooled; vLLM's own definitions):

output tok/s
    output tokens of the successful requests / wall seconds of the run (vLLM's ``output_throughput``).
TTFT
    seconds from sending a request to its first streamed token.
ITL
    seconds between consecutive streamed chunks of a request. A speculating server may stream several
    tokens in one chunk, so its ITL is per chunk; TPOT is per token.
TPOT
    (latency - TTFT) / (output tokens - 1) of each request.
vs a
    output tok/s / server a's at the same concurrency, measured in the same run.
vs best vLLM
    output tok/s / that of the fastest vLLM server (a, d or v) at the same concurrency in the same run.
same as a
    fraction of requests whose text equals server a's (or, without a, vLLM's plain v:none) for the same prompt
    and concurrency (greedy: equal up to the engines' numerics; a low value means the servers did not do the
    same work).

The JSON (``--out``, default ``benchmarks/results/vs-vllm-<cpu>.json``) names the machine and holds the
summary, the table, every run's vLLM result (per-request lists left out) and the server commands.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench_serve import free_port
from distill.store.atomic import atomic_write_bytes

REPO = Path(__file__).resolve().parents[1]
DISTILL = str(Path(sys.executable).with_name("distill"))
SERVERS = "abcdv"
#: vLLM's speculation as its own examples configure it (server v); ``suffix`` takes vLLM's defaults.
VLLM_SPECS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix"},
}
#: Drafts per step for ``--vllm-spec eagle3=DIR`` / ``medusa=DIR`` (the count vLLM's EAGLE examples use).
VLLM_DRAFTER_TOKENS = 3
#: A warm-up prompt outside the measured set (``--prompts-per-level``), so that no history holds a measured reply.
WARMUP_PROMPT = "List three uses of a paperclip, one line each."
PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
               "generated_texts", "errors")


# -- servers -----------------------------------------------------------------------------------------
class Server:
    """A server command on 127.0.0.1 in its own process group (vLLM's engine core is a child process)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path):
        self.cmd, self.log = cmd, log
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, url: str, timeout: float) -> str:
        """Poll ``/v1/models`` until it answers; -> the served model id."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited ({self.proc.returncode}); {self.log}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                    return json.loads(r.read())["data"][0]["id"]
            except OSError:
                time.sleep(1)
        self.stop()
        raise RuntimeError(f"not ready in {timeout:.0f} s; {self.log}:\n{self.log.read_text()[-3000:]}")

    def stop(self, grace: float = 60) -> None:
        """SIGTERM to the server, which stops its children in order; then SIGKILL to what is left of the group
        (a SIGTERM to the whole group kills vLLM's engine core under its API server, which logs an EngineDeadError)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core, if the API server left it behind
        except ProcessLookupError:
            pass
        self.proc.wait()


def vllm_spec(text: str, history: bool) -> tuple[str, dict | None]:
    """``--vllm-spec`` -> (server key, vLLM's --speculative-config or None): a name of :data:`VLLM_SPECS`,
    ``eagle3=DIR`` / ``medusa=DIR``, or a JSON object. Without a history (every level resends the prompts) suffix
    decoding keeps no global tree of earlier replies."""
    if text in VLLM_SPECS:
        key, spec = text, (dict(VLLM_SPECS[text]) if VLLM_SPECS[text] else None)
    elif text.split("=", 1)[0] in ("eagle3", "medusa") and "=" in text:
        method, folder = text.split("=", 1)
        key, spec = f"{method}:{folder}", {"method": method, "model": str(Path(folder).resolve()),
                                           "num_speculative_tokens": VLLM_DRAFTER_TOKENS}
    else:
        try:
            spec = json.loads(text)
        except ValueError:
            raise SystemExit(f"--vllm-spec {text!r}: give one of {', '.join(VLLM_SPECS)}, eagle3=DIR, medusa=DIR "
                             "or a JSON object of vLLM's --speculative-config") from None
        if not isinstance(spec, dict) or "method" not in spec:
            raise SystemExit(f"--vllm-spec {text!r}: a JSON spec needs a 'method'")
        key = spec["method"] + ":" + ",".join(f"{k}={v}" for k, v in spec.items() if k != "method")
    if spec and spec["method"] == "suffix" and not history:
        spec.setdefault("suffix_decoding_max_cached_requests", 0)
    return f"v:{key}", spec


def server_commands(args, model_dir: Path, dtype: str, max_batch: int) -> dict[str, list[str]]:
    """Server key ('a', 'b', 'c:lookup', 'd:out/heads', 'v:ngram', ...) -> its command, without ``--port``."""
    vllm_extra = list(args.vllm_arg)
    distill = [DISTILL, "serve", "--model", str(model_dir), "--dtype", dtype, "--log-level", "warning",
               "--max-batch", str(max_batch), "--queue-size", str(max(64, 2 * max_batch))]
    cmds = {}
    if "a" in args.servers:
        cmds["a"] = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                     "--host", "127.0.0.1", "--dtype", dtype, *vllm_extra]
    if "b" in args.servers:
        cmds["b"] = distill
    for text in args.vllm_spec if "v" in args.servers else []:
        key, spec = vllm_spec(text, history=bool(args.prompts_per_level))
        cmds[key] = [args.vllm_python or sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                     "--model", str(model_dir), "--host", "127.0.0.1", "--dtype", dtype,
                     *(["--speculative-config", json.dumps(spec)] if spec else []), *vllm_extra]
    # the lookup servers' history of earlier replies (--lookup-history): off when every concurrency level and
    # the client's warm-ups send the same prompts, whose replies a history would replay (with --prompts-per-level
    # each prompt is sent once: the history stays, as served); --lookup-history N adds a twin of each with it
    lookups = {}
    for h in args.drafter:
        if "c" in args.servers:
            cmds[f"c:{h}"] = [*distill, "--heads", h]
            if h == "lookup":
                lookups[f"c:{h}"] = cmds[f"c:{h}"]
    for data in args.lookup_data:  # the lookup proposer with a self-distilled dataset as its datastore
        if "c" in args.servers:
            cmds[f"c:lookup+{Path(data).name}"] = lookups[f"c:lookup+{Path(data).name}"] = [
                *distill, "--heads", "lookup", "--lookup-data", data]
    for key, cmd in lookups.items():
        if not args.prompts_per_level:
            cmds[key] = [*cmd, "--lookup-history", "0"]
        if args.lookup_history:
            cmds[f"{key}+history"] = [*cmd, "--lookup-history", str(args.lookup_history)]
    for h in args.drafter:
        if "d" in args.servers:
            cmds[f"d:{h}"] = [DISTILL, "serve", "--engine", "vllm", "--model", str(model_dir), "--heads", h,
                              "--dtype", dtype, *(["--", *vllm_extra] if vllm_extra else [])]
    return cmds


def server_env(name: str) -> dict[str, str]:
    """The environment of server ``name``: on a CPU, the KV cache size of :func:`distill.runtime.vllm_cpu_env`
    (vLLM's own default does not fit a small machine), and for the v servers every other setting of it too (the
    worker inside the engine core, as ``distill serve --engine vllm`` starts vLLM, which sets them itself): server
    a is vLLM's own process layout, as ``vllm serve`` starts it."""
    from distill.runtime import resolve_device, vllm_cpu_env

    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    if resolve_device("auto") == "cpu":
        cpu = vllm_cpu_env()
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", cpu["VLLM_CPU_KVCACHE_SPACE"])
        if name.startswith("v:"):
            for key, value in cpu.items():
                env.setdefault(key, value)
    return env


def with_port(cmd: list[str], port: int) -> list[str]:
    """The port goes before a ``--`` (what follows it is vLLM's)."""
    i = cmd.index("--") if "--" in cmd else len(cmd)
    return [*cmd[:i], "--port", str(port), *cmd[i:]]


# -- the request set and the client --------------------------------------------------------------------
def mt_bench_prompts() -> list[str]:
    """MT-Bench first user turns, in the seed's order."""
    from distill.seeds import load_seed

    return [next(m.content for m in conv.messages if m.role == "user") for conv in load_seed("mt-bench")]


def write_prompts(path: Path, prompts: list[str]) -> int:
    """Prompts -> JSONL ``{"prompt": ...}`` lines (vLLM's custom dataset); -> how many."""
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return len(prompts)


def level_prompts(prompts: list[str], levels: list[int], per_level: list[int] | None, limit: int | None) -> dict[int, list[str]]:
    """Concurrency level -> its prompts: consecutive slices of their own (``--prompts-per-level``), or the first
    ``limit`` at every level."""
    if not per_level:
        return {c: prompts[:limit] if limit else prompts for c in levels}
    if len(per_level) != len(levels) or sum(per_level) > len(prompts):
        raise SystemExit(f"--prompts-per-level needs one count per concurrency level ({len(levels)}) summing to at most "
                         f"{len(prompts)}; got {per_level}")
    starts = np.cumsum([0, *per_level])
    return {c: prompts[starts[i]:starts[i + 1]] for i, c in enumerate(levels)}


def warm_up(url: str, model_id: str, n: int, max_tokens: int) -> None:
    """``n`` greedy chat requests of :data:`WARMUP_PROMPT`, one at a time."""
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": WARMUP_PROMPT}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    for _ in range(n):
        req = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()


def scrape(url: str) -> dict[str, float]:
    """``/metrics`` -> each sample's name -> its value summed over labels (empty where none answers)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def engine_figures(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """A distill server's engine over one level (module docstring); None for a server without its metrics."""
    d = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    steps = d("distill_step_latency_seconds_count")
    if "distill_step_latency_seconds_count" not in after or not steps:
        return None
    row_steps = d("distill_batch_size_sum")
    return {"steps": int(steps), "step_ms": 1000 * d("distill_step_latency_seconds_sum") / steps,
            "rows_per_step": row_steps / steps,
            "drafted_per_row_step": d("vllm:spec_decode_num_draft_tokens_total") / row_steps if row_steps else None,
            "accepted_per_row_step": d("vllm:spec_decode_num_accepted_tokens_total") / row_steps if row_steps else None,
            "prefill_s": d("distill_prefill_seconds_sum")}


def client_argv(url: str, model_id: str, tokenizer: Path, dataset: Path, n: int, max_tokens: int, concurrency: int,
                warmups: int, ignore_eos: bool) -> list[str]:
    return ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", url, "--model", model_id,
            "--tokenizer", str(tokenizer), "--dataset-name", "custom", "--dataset-path", str(dataset),
            "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(n), "--custom-output-len", str(max_tokens),
            "--temperature", "0", *(["--ignore-eos"] if ignore_eos else []), "--max-concurrency", str(concurrency),
            "--num-warmups", str(warmups), "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
            "--save-detailed", "--disable-tqdm"]


# -- figures ---------------------------------------------------------------------------------------------
def summarize(runs: list[dict]) -> dict:
    """vLLM result dicts (``--save-detailed``) of one server and concurrency, pooled over repeats."""
    ok = [[not e for e in r["errors"]] for r in runs]
    pick = lambda key: [x for r, m in zip(runs, ok) for x, good in zip(r[key], m) if good]  # noqa: E731
    ttft = np.array(pick("ttfts")) * 1000
    itl = np.array([x for xs in pick("itls") for x in xs]) * 1000
    tpot = np.array([(lat - t) / (n - 1) for lat, t, n in zip(pick("latencies"), pick("ttfts"), pick("output_lens")) if n > 1]) * 1000
    q = lambda a, p: float(np.percentile(a, p)) if a.size else None  # noqa: E731
    accept = [r["spec_decode_acceptance_length"] for r in runs if "spec_decode_acceptance_length" in r]
    return {
        "completed": sum(r["completed"] for r in runs), "failed": sum(r["failed"] for r in runs),
        "output_tokens": sum(r["total_output_tokens"] for r in runs), "seconds": sum(r["duration"] for r in runs),
        "output_tok_s": sum(r["total_output_tokens"] for r in runs) / sum(r["duration"] for r in runs),
        "median_ttft_ms": q(ttft, 50), "p99_ttft_ms": q(ttft, 99), "median_itl_ms": q(itl, 50), "p99_itl_ms": q(itl, 99),
        "median_tpot_ms": q(tpot, 50), "p99_tpot_ms": q(tpot, 99),
        "output_lens": sorted(set(pick("output_lens"))),
        "acceptance_length": float(np.mean(accept)) if accept else None,
        "engine": [r["engine"] for r in runs if r.get("engine")] or None,
        "errors": sorted({e for r in runs for e in r["errors"] if e})[:5],
    }


def same_text(runs: list[dict], reference: list[dict]) -> float | None:
    """Fraction of requests whose text equals the reference's for the same prompt (repeats paired in order)."""
    pairs = [(x, y) for r, s in zip(runs, reference) for x, y, ex, ey in
             zip(r["generated_texts"], s["generated_texts"], r["errors"], s["errors"]) if not ex and not ey]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else None


def table(summary: dict[str, dict[int, dict]], levels: list[int]) -> list[str]:
    def f(v, spec: str = ".1f", suffix: str = "") -> str:
        return "-" if v is None else f"{v:{spec}}{suffix}"

    rows = ["| conc | server | out tok/s | vs a | vs best vLLM | TTFT med / p99 ms | ITL med / p99 ms | TPOT med ms | accept len | "
            "same as a | failed |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in levels:
        for name, per_c in summary.items():
            if c in per_c:
                s = per_c[c]
                rows.append(f"| {c} | {name} | {f(s['output_tok_s'])} | {f(s['vs_a'], '.2f', 'x')} | "
                            f"{f(s.get('vs_best_vllm'), '.2f', 'x')} | "
                            f"{f(s['median_ttft_ms'])} / {f(s['p99_ttft_ms'])} | {f(s['median_itl_ms'])} / {f(s['p99_itl_ms'])} | "
                            f"{f(s['median_tpot_ms'])} | {f(s['acceptance_length'], '.2f')} | {f(s['same_as_a'], '.2f')} | {s['failed']} |")
    return rows


def best_vllm_rows(summary: dict[str, dict[int, dict]], levels: list[int]) -> dict[int, str]:
    """Concurrency level -> the vLLM server (a, d or v) with the most output tokens a second there."""
    best = {}
    for c in levels:
        rows = [(per_c[c]["output_tok_s"], name) for name, per_c in summary.items()
                if name[0] in "adv" and c in per_c and per_c[c]["completed"]]
        if rows:
            best[c] = max(rows)[1]
    return best


def cpu_slug() -> str:
    """The CPU's model name as a file-name part: 'AMD EPYC 7B13' -> 'amd-epyc-7b13'."""
    from distill.runtime import cpu_info

    name = re.sub(r"\((r|tm)\)", "", cpu_info().model.lower())
    return re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "cpu"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model name, folder or Hub id (default: the bundled one)")
    ap.add_argument("--drafter", action="append", default=[], metavar="H",
                    help="drafter of servers c and d: a heads folder or `lookup` (repeatable; default: lookup)")
    ap.add_argument("--lookup-history", type=int, default=0, metavar="TOKENS",
                    help="also each lookup server with --lookup-history TOKENS (keys ...+history); needs one concurrency "
                         "level and --warmups 0, and skips the client's ready-check request, so that every prompt is "
                         "sent once (the lookup servers otherwise run with no history)")
    ap.add_argument("--lookup-data", action="append", default=[], metavar="DATA",
                    help="also (c) `distill serve --heads lookup --lookup-data DATA` (repeatable)")
    ap.add_argument("--servers", default=SERVERS, help=f"which servers, e.g. ab or abcv (default: {SERVERS})")
    ap.add_argument("--vllm-spec", action="append", default=[], metavar="SPEC",
                    help=f"a server v: {', '.join(VLLM_SPECS)}, eagle3=DIR, medusa=DIR or a JSON --speculative-config "
                         "(repeatable; default: none, ngram, suffix)")
    ap.add_argument("--vllm-python", default=None,
                    help="the Python that runs the v servers (one where arctic-inference imports, for suffix)")
    ap.add_argument("--limit", type=int, default=None, help="the first N MT-Bench first turns (default: all 80)")
    ap.add_argument("--prompts-per-level", default=None, metavar="N1,N2,...",
                    help="a slice of its own of the prompts per concurrency level, each prompt sent once per server")
    ap.add_argument("--first", type=int, default=0, help="the prompts start at this MT-Bench question (40: the c = 16 level "
                    "of --prompts-per-level 16,24,40 on its own)")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated client concurrencies")
    ap.add_argument("--repeats", type=int, default=2, help="server starts each, the order reversed every other repeat")
    ap.add_argument("--warmups", type=int, default=2, help="untimed requests after each server start")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="let requests end at EOS")
    ap.add_argument("--dtype", default="auto", help="all servers' dtype (auto: distill.runtime's rule for the model)")
    ap.add_argument("--max-batch", type=int, default=None, help="distill serve's --max-batch (default: the largest concurrency)")
    ap.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                    help="an argument for the vLLM servers (a, d), e.g. --vllm-arg=--enforce-eager (repeatable)")
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/vs-vllm-<cpu>.json)")
    args = ap.parse_args()
    args.drafter = args.drafter or ["lookup"]
    args.vllm_spec = args.vllm_spec or ["none", "ngram", "suffix"]
    if not set(args.servers) <= set(SERVERS) or not args.servers:
        ap.error(f"--servers takes letters of {SERVERS}; got {args.servers!r}")
    levels = [int(c) for c in args.concurrency.split(",")]
    args.prompts_per_level = [int(n) for n in args.prompts_per_level.split(",")] if args.prompts_per_level else None
    if args.lookup_history and not args.prompts_per_level and (len(levels) != 1 or args.warmups):
        ap.error("--lookup-history measures one pass over the prompts: give one --concurrency and --warmups 0, "
                 "or --prompts-per-level")

    import vllm

    import distill
    from distill.models import resolve_model
    from distill.runtime import machine, placement

    sys.path.insert(0, str(REPO / "benchmarks"))
    from vllm_bench_serve import run as vllm_bench

    resolved = resolve_model(args.model)
    dtype = placement(resolved.path, "auto", args.dtype).dtype
    cmds = server_commands(args, resolved.path, dtype, args.max_batch or max(levels))
    work = Path(tempfile.mkdtemp(prefix="bench_vs_vllm-"))
    per_level = level_prompts(mt_bench_prompts()[args.first :], levels, args.prompts_per_level, args.limit)
    datasets = {c: work / f"mt-bench-first-turns-c{c}.jsonl" for c in levels}
    counts = {c: write_prompts(datasets[c], per_level[c]) for c in levels}
    n = sum(counts.values()) if args.prompts_per_level else counts[levels[0]]
    print(f"{machine()}; {resolved.name} {dtype}; prompts per level {counts} x {args.max_tokens} tokens; "
          f"servers {', '.join(cmds)}; logs in {work}", flush=True)

    runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in levels} for name in cmds}
    failures: dict[str, list[str]] = {}
    for r in range(args.repeats):
        for name in (list(cmds) if r % 2 == 0 else list(cmds)[::-1]):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            t0 = time.monotonic()
            log = work / f"{re.sub(r'[^A-Za-z0-9_.:=-]+', '_', name)}-{r}.log"
            server = Server(with_port(cmds[name], port), server_env(name), log)
            try:
                model_id = server.wait_ready(url, args.start_timeout)
                print(f"[{r + 1}/{args.repeats}] {name}: up in {time.monotonic() - t0:.0f} s", flush=True)
                one_pass = bool(args.prompts_per_level or args.lookup_history)
                if args.prompts_per_level:
                    warm_up(url, model_id, args.warmups, args.max_tokens)
                for i, c in enumerate(levels):
                    argv = client_argv(url, model_id, resolved.path, datasets[c], counts[c], args.max_tokens, c,
                                       0 if args.prompts_per_level or i else args.warmups, args.ignore_eos)
                    if one_pass:  # its ready check sends the first prompt once more: skipped for every server
                        argv += ["--ready-check-timeout-sec", "0"]
                    before = scrape(url)
                    res = vllm_bench(argv)
                    res["engine"] = engine_figures(before, scrape(url))
                    runs[name][c].append(res)
                    print(f"[{r + 1}/{args.repeats}] {name} c={c}: {res['output_throughput']:.1f} tok/s, "
                          f"{res['failed']} failed", flush=True)
            except (RuntimeError, ValueError, OSError) as exc:  # a server that does not start or answer: the others still run
                failures.setdefault(name, []).append(f"repeat {r + 1}: {exc}")
                print(f"[{r + 1}/{args.repeats}] {name}: FAILED: {str(exc)[-1500:]}", flush=True)
            finally:
                server.stop()

    summary: dict[str, dict[int, dict]] = {}
    for name, per_c in runs.items():
        summary[name] = {}
        for c, rs in per_c.items():
            if not rs:
                continue
            s = summarize(rs)
            ref = runs.get("a", {}).get(c) or runs.get("v:none", {}).get(c) or []
            s["same_as_a"] = same_text(rs, ref) if ref else None
            s["vs_a"] = None
            if runs.get("a", {}).get(c):
                s["vs_a"] = s["output_tok_s"] / summarize(runs["a"][c])["output_tok_s"]
            if args.ignore_eos and s["output_lens"] not in ([], [args.max_tokens]):
                print(f"warning: {name} c={c}: output lengths {s['output_lens']} with ignore_eos, not all {args.max_tokens}")
            summary[name][c] = s
    best_vllm = best_vllm_rows(summary, levels)
    for per_c in summary.values():
        for c, s in per_c.items():
            s["vs_best_vllm"] = s["output_tok_s"] / summary[best_vllm[c]][c]["output_tok_s"] if c in best_vllm else None
    rows = table(summary, levels)
    print("\n".join(rows))
    for c, name in best_vllm.items():
        print(f"c={c}: the best vLLM row is {name} ({summary[name][c]['output_tok_s']:.1f} tok/s)")
    for name, errs in failures.items():
        print(f"{name} failed: {errs[0][:300]}")

    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"vs-vllm-{cpu_slug()}.json"
    doc = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
        "model": resolved.name, "model_path": str(resolved.path), "dtype": dtype, "prompts": n,
        "versions": {"vllm": vllm.__version__, "distill": distill.__version__},
        "args": vars(args), "servers": cmds, "prompts_per_level": counts, "best_vllm": best_vllm,
        "summary": {name: {str(c): s for c, s in per_c.items()} for name, per_c in summary.items()},
        "table": rows, "failures": failures, "logs": str(work),
        "runs": {name: {str(c): [{k: v for k, v in res.items() if k not in PER_REQUEST} for res in rs] for c, rs in per_c.items()}
                 for name, per_c in runs.items()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, (json.dumps(doc, indent=1, default=str) + "\n").encode())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
