"""Engine smoke benchmark: plain vs Medusa decoding speed at batch 1 (and the policy's step cost ratio).

    .venv/bin/python benchmarks/bench_engine_smoke.py --heads HEADS_DIR --prompts 3 --max-tokens 64
    .venv/bin/python benchmarks/bench_engine_smoke.py --cost          # forward time vs tokens per forward

Without --heads, random-residual heads (LM-head init + small random W1) are used: they test speed
mechanics only (acceptance will be near 1 token/step). Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def measure_cost(engine, context: int = 128, sizes=(1, 2, 4, 8, 16, 32, 64), repeats: int = 3) -> dict:
    """Seconds of one forward over m new tokens after `context` cached tokens; r = slope / c(1)."""
    import torch

    from distill.engine import cache as kv

    dev = engine.device
    out = {}
    with torch.inference_mode():
        for m in sizes:
            best = float("inf")
            for _ in range(repeats):
                cache = kv.SlotCache(engine.kv_shape, 1, context + m)
                ids = torch.randint(0, 1000, (1, context), device=dev)
                slots = torch.arange(context, device=dev)[None]
                cache.prepare(slots, context)
                engine.target.forward(ids, slots, kv.attention_bias(kv.prefill_allowed(context, dev), engine.dtype), cache, keep=1)
                tree = torch.ones(m, m, dtype=torch.bool, device=dev).tril()
                step_ids = torch.randint(0, 1000, (1, m), device=dev)
                step_pos = context + torch.arange(m, device=dev)[None]
                t0 = time.perf_counter()
                cache.prepare(step_pos, context + m)
                bias = kv.attention_bias(kv.step_allowed(torch.tensor([context], device=dev), tree, context + m), engine.dtype)
                engine.target.forward(step_ids, step_pos, bias, cache)
                best = min(best, time.perf_counter() - t0)
            out[m] = best
    # least-squares slope over the tree-sized forwards (m <= 32), relative to the one-token forward
    pts = [(m, t) for m, t in out.items() if m <= 32]
    mx = sum(m for m, _ in pts) / len(pts)
    my = sum(t for _, t in pts) / len(pts)
    slope = sum((m - mx) * (t - my) for m, t in pts) / sum((m - mx) ** 2 for m, _ in pts)
    return {"seconds": out, "step_cost_ratio": slope / out[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--heads", default=None)
    ap.add_argument("--tree", default=None)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cost", action="store_true", help="measure forward time vs tokens per forward")
    ap.add_argument("--out", default="benchmarks/results/engine_smoke.json")
    args = ap.parse_args()

    import torch

    from distill.engine import Engine, EngineConfig, SamplingParams
    from distill.heads import HeadsConfig, MedusaHeads
    from distill.heads.model import TRAINED_FC_BIAS
    from distill.seeds import load_seed

    cfg = EngineConfig(tree=args.tree, max_batch=max(args.batch, 1))
    engine = Engine.from_pretrained(args.model, args.heads, cfg)
    result: dict = {"model": engine.model_name, "heads": args.heads, "tree": args.tree}
    if args.cost:
        result["cost"] = measure_cost(engine)
        print(json.dumps(result["cost"], indent=1))
    else:
        if engine.heads is None:
            torch.manual_seed(0)
            lm = engine.model.get_output_embeddings().weight
            heads = MedusaHeads(HeadsConfig(lm.shape[1], lm.shape[0], num_heads=4, bias=TRAINED_FC_BIAS), lm_head_weight=lm.detach())
            engine = Engine(engine.model, engine.tokenizer, heads, cfg)
        questions = []
        for conv in load_seed("mt-bench"):
            if hasattr(conv, "messages"):
                questions.append({"role": "user", "content": [m for m in conv.messages if m.role == "user"][0].content})
            if len(questions) >= args.prompts:
                break
        prompts = [list(engine.tokenizer.apply_chat_template([q], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]) for q in questions]
        sp = SamplingParams(max_tokens=args.max_tokens)
        rows = []
        for spec in (False, True):
            t0 = time.perf_counter()
            res, st = engine.generate(prompts, [sp] * len(prompts), speculative=spec)
            wall = time.perf_counter() - t0
            rows.append({"speculative": spec, "seconds": wall, "tokens": st.tokens, "steps": st.steps,
                         "tokens_per_step": statistics.mean(a for r in res for a in r.accepted),
                         "step_ms": 1000 * statistics.mean(st.step_seconds), "tokens_per_s": st.tokens / wall,
                         "tree_nodes": st.tree_nodes})
            print(rows[-1])
        result["runs"] = rows
        result["speedup"] = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
        print("speedup", round(result["speedup"], 3))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
