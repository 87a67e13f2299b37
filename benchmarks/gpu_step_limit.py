"""A 7B-shaped decoding step on a GPU against the hardware's limit (BENCHMARKS.md, "On a GPU").

    python3 benchmarks/gpu_step_limit.py --model SMOLLM2_FOLDER --out RESULTS.json

Llama-2-7B's shape with random bf16 weights built on the GPU (``bench_engine_step.shaped_engine``: the folder gives the
tokenizer and vocabulary), in one process:

copy bandwidth
    a device-to-device copy of 2 GiB, (bytes read + bytes written) / seconds: the memory's practical ceiling.
weight read
    every linear of the model multiplied by one row (``F.linear``, the library's products), all recorded as one CUDA
    graph and replayed: the floor a step built on these products cannot beat; its bytes over the copy bandwidth and
    over the datasheet bandwidth (``--datasheet-tb-s``) are the two limits a step is compared with.
engine steps
    per variant (``--variants``: ``graphs``, CUDA graphs of eager forwards; ``graphs+compile``, of compiled forwards),
    one engine with 4 random Medusa heads and a fixed 16-node proposal (only verification is timed,
    ``bench_engine_step.fixed_proposal``): the plain step at batch 1 (median step seconds), tok/s at batch 1 and 8,
    the 16-node verification step and its ratio to the plain step, and the seconds the first steps took (recording,
    compiling); with ``--eagle``, an EAGLE-3 step with a random drafter (24 nodes, depth 5).
kernels
    torch.profiler over plain batch-1 steps run without graphs (the same kernels the graph replays): kernels per step
    and GPU microseconds per step by kind (products, attention, fused by the compiler, normalisation and other
    elementwise work, copies and cache writes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_engine_step import fixed_proposal, random_drafter, random_heads, shaped_engine, step_costs
from distill.engine import Engine, EngineConfig, SamplingParams
from distill.engine.graphs import Graphs

QUESTIONS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
             "Explain how a refrigerator works to a ten-year-old.",
             "Give me three tips for learning a new language as an adult, with an example for each.",
             "Compare Python lists and tuples, and say when to use which.",
             "Draft a polite email asking a colleague to review my pull request by Friday.",
             "What are the main causes of inflation? Answer in a few paragraphs.",
             "Plan a three-day trip to Lisbon for someone who loves food and history.",
             "Summarise the plot of Romeo and Juliet in five sentences."]
KINDS = (("attention", ("fmha", "flash", "attention", "efficient", "softmax")),
         ("products", ("gemv", "gemm", "cutlass", "sm90", "nvjet", "cublas", "splitk", "matmul")),
         ("compiled (fused)", ("triton",)),
         ("copies and cache writes", ("copy", "cat", "index", "scatter", "gather", "memcpy", "memset", "fill")),
         ("normalisation and elementwise", ("",)))


def kind(name: str) -> str:
    low = name.lower()
    return next(k for k, keys in KINDS if any(s in low for s in keys))


def cuda_seconds(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` by CUDA events, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1000)
    return statistics.median(times)


def copy_bandwidth() -> dict:
    x = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    y = torch.empty_like(x)
    s = cuda_seconds(lambda: y.copy_(x), 10)
    del x, y
    return {"bytes": 2 * 2**31, "seconds": s, "tb_s": 2 * 2**31 / s / 1e12}


def weight_read(model) -> dict:
    """Every linear times one row, recorded as one CUDA graph: the products alone."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    p = linears[0].weight
    rows = {m.in_features: torch.randn(1, m.in_features, dtype=p.dtype, device=p.device) for m in linears}

    def products():
        for m in linears:
            F.linear(rows[m.in_features], m.weight)

    products()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        products()
    s = cuda_seconds(graph.replay, 20)
    nbytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    return {"linears": len(linears), "bytes": nbytes, "seconds": s, "tb_s": nbytes / s / 1e12}


def prompts_of(tokenizer, n: int) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]) for q in (QUESTIONS * n)[:n]]


def tok_s(engine: Engine, prompts: list[list[int]], max_tokens: int, rounds: int) -> float:
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        results, _ = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), speculative=False)
        rates.append(sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0))
    return statistics.median(rates)


def kernel_profile(engine: Engine, prompt: list[int], steps: int) -> dict:
    """Kernels of plain batch-1 steps, run without graphs: per step, by kind."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine.graphs
    engine.use_graphs(None)
    sp = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    engine.generate([prompt], sp, speculative=False)  # warm
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, st = engine.generate([prompt], sp, speculative=False)
    engine.use_graphs(graphs)
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    names: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.device_time_total <= 0:
            continue
        k = kind(ev.name)
        by_kind[k][0] += 1
        by_kind[k][1] += ev.device_time_total
        names[ev.name][0] += 1
        names[ev.name][1] += ev.device_time_total
    n = st.steps + 1  # the prefill's kernels are in the count too: a per-step figure a little high, the same for all
    top = sorted(names.items(), key=lambda kv: -kv[1][1])[:12]
    return {"steps": n, "kernels_per_step": sum(c for c, _ in by_kind.values()) / n,
            "gpu_us_per_step": sum(t for _, t in by_kind.values()) / n,
            "by_kind": {k: {"kernels": c / n, "us": t / n} for k, (c, t) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
            "top": [{"name": name[:120], "per_step": c / n, "us": t / n} for name, (c, t) in top]}


def variant(model, tokenizer, heads, compile: bool, prompts: list[list[int]], args) -> dict:
    config = EngineConfig(tree="sparse-16", speculate_max_batch=1, max_batch=8, cuda_graphs=args.cuda, compile=compile)
    engine = Engine(model, tokenizer, heads, config, model_name="llama-2-7b shape, random")
    fixed_proposal(engine)
    out: dict = {"compile": engine.compile}
    t0 = time.perf_counter()
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), speculative=False)
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), speculative=True)
    out["first_steps_seconds"] = time.perf_counter() - t0  # plain and tree buckets recorded (and compiled)
    secs = step_costs({0: engine, 16: engine}, prompts[0], args.steps, args.rounds)
    out["plain_step_ms"], out["verify16_step_ms"] = 1000 * secs[0], 1000 * secs[16]
    out["verify16_ratio"] = secs[16] / secs[0]
    out["tok_s_batch_1"] = tok_s(engine, prompts[:1], args.max_tokens, args.rounds)
    t0 = time.perf_counter()
    engine.generate(prompts[:8], SamplingParams(max_tokens=4, ignore_eos=True), speculative=False)
    out["batch_8_first_seconds"] = time.perf_counter() - t0
    out["tok_s_batch_8"] = tok_s(engine, prompts[:8], args.max_tokens, args.rounds)
    out["graphs"] = {"recorded": engine.graphs.recorded, "replays": engine.graphs.replays} if engine.graphs else None
    out["compiled_forwards"] = engine.compiled_forwards
    out["kernels"] = kernel_profile(engine, prompts[0], args.profile_steps)
    print(json.dumps({k: v for k, v in out.items() if k != "kernels"}), flush=True)
    print(json.dumps(out["kernels"]["by_kind"]), flush=True)
    return out


def eagle_variant(model, tokenizer, compile: bool, prompts: list[list[int]], args) -> dict:
    drafter = random_drafter(model)
    config = EngineConfig(draft_nodes=24, draft_depth=5, speculate_max_batch=1, max_batch=1, cuda_graphs=args.cuda,
                          compile=compile)
    engine = Engine(model, tokenizer, drafter, config, model_name="llama-2-7b shape, random")
    t0 = time.perf_counter()
    engine.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), speculative=True)
    first = time.perf_counter() - t0
    secs = step_costs({0: engine, 24: engine}, prompts[0], args.steps, args.rounds, tree_nodes=False)
    out = {"compile": engine.compile, "first_steps_seconds": first, "plain_step_ms": 1000 * secs[0],
           "eagle24_step_ms": 1000 * secs[24], "eagle24_ratio": secs[24] / secs[0]}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model folder: its tokenizer and vocabulary (weights not read)")
    ap.add_argument("--variants", nargs="+", default=["graphs", "graphs+compile"], choices=["graphs", "graphs+compile"])
    ap.add_argument("--eagle", action="store_true", help="also an EAGLE-3 step per variant (random drafter)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--datasheet-tb-s", type=float, default=4.8, help="the memory bandwidth of the GPU's datasheet")
    ap.add_argument("--layers", type=int, help="decoder layers (fewer: a check of the script on a CPU, --device cpu)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.cuda = args.device == "cuda"
    result: dict = {"gpu": torch.cuda.get_device_name() if args.cuda else None, "torch": torch.__version__, "args": vars(args)}
    import transformers

    result["transformers"] = transformers.__version__
    result["copy"] = copy_bandwidth() if args.cuda else {"tb_s": args.datasheet_tb_s}
    print("copy", json.dumps(result["copy"]), flush=True)
    dtype = "bfloat16" if args.cuda else "float32"
    base = shaped_engine(args.model, "llama-2-7b", EngineConfig(device=args.device, dtype=dtype, cuda_graphs=False, compile=False),
                         args.layers)
    model, tokenizer = base.model, base.tokenizer
    del base
    read = weight_read(model) if args.cuda else {"seconds": 1.0, "bytes": 1}
    read["limit_ms_at_copy_bandwidth"] = 1000 * read["bytes"] / (result["copy"]["tb_s"] * 1e12)
    read["limit_ms_at_datasheet"] = 1000 * read["bytes"] / (args.datasheet_tb_s * 1e12)
    result["weight_read"] = read
    print("weight read", json.dumps(read), flush=True)
    prompts = prompts_of(tokenizer, 8)
    heads = random_heads(model)
    result["variants"] = {}
    for name in args.variants:
        try:
            result["variants"][name] = variant(model, tokenizer, heads, name.endswith("compile"), prompts, args)
            r = result["variants"][name]
            r["plain_vs_weight_read"] = r["plain_step_ms"] / (1000 * read["seconds"])
            r["plain_vs_datasheet_limit"] = r["plain_step_ms"] / read["limit_ms_at_datasheet"]
            print(name, "plain step / datasheet limit", round(r["plain_vs_datasheet_limit"], 3), flush=True)
        except Exception as exc:  # one variant's failure is a result too; the others still run
            result["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(name, "failed:", result["variants"][name]["error"], flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    if args.eagle:
        result["eagle"] = {}
        for name in args.variants:
            try:
                result["eagle"][name] = eagle_variant(model, tokenizer, name.endswith("compile"), prompts, args)
            except Exception as exc:
                result["eagle"][name] = {"error": f"{type(exc).__name__}: {exc}"}
                print(name, "EAGLE failed:", result["eagle"][name]["error"], flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    result["peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20 if args.cuda else None
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
