"""The lookup's chains under the node budget against the adaptive policy's tree size and plain decoding, in one process.

    OMP_NUM_THREADS=2 PYTHONPATH=. .venv/bin/python benchmarks/bench_node_budget.py --rows 4 --first 16 --prompts 24 \\
        --order plain,policy,budget,budget,policy,plain --out benchmarks/results/node-budget-c4-zen4.json

One engine (the bundled model, the lookup proposer with its history, ``adaptive`` as ``distill serve`` runs it) decodes
``--prompts`` MT-Bench first turns from question ``--first`` on, ``--max-tokens`` each with EOS ignored, ``--rows`` at
a time in its running batch (a finished row's place goes to the next prompt, which joins in the running step), once
per mode of ``--order``, so that the modes alternate on the same machine state:

- ``plain``: no drafting (``speculate_max_batch`` 0);
- ``policy``: the adaptive policy picks one tree size a step for every row (:class:`distill.engine.policy.AdaptivePolicy`);
- ``budget``: the node budget prices each row's nodes (:class:`distill.engine.policy.TokenBudget`), the engine's default
  where the lookup drafts chains.

Each pass starts with the lookup's history cleared and a fresh policy or budget; the chains' odds carry over. Reported
per pass: tok/s (prefills included), steps, the rows' tokens per step.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import time
from pathlib import Path

from distill.engine import Engine, EngineConfig, SamplingParams
from distill.engine.policy import AdaptivePolicy, TokenBudget
from distill.seeds import load_seed
from distill.store.atomic import atomic_write_bytes

MODES = ("plain", "policy", "budget")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--first", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--order", default="plain,policy,budget,budget,policy,plain")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    order = args.order.split(",")
    if bad := [m for m in order if m not in MODES]:
        ap.error(f"modes are {', '.join(MODES)}; got {', '.join(bad)}")

    from bench_engine_step import cpu_description

    texts = [next(m.content for m in c.messages if m.role == "user") for c in load_seed("mt-bench")]
    texts = texts[args.first : args.first + args.prompts]
    engine = Engine.from_pretrained(None, "lookup", EngineConfig(max_batch=args.rows, adaptive=True))
    if engine.pricing.budget is None:
        raise SystemExit("this target verifies trees, not chains: there is no node budget to compare")
    tok, pricing, lookup = engine.tokenizer, engine.pricing, engine.proposer
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for t in texts]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    def use(mode: str) -> None:
        engine.config.speculate_max_batch = 0 if mode == "plain" else None
        pricing.policy = AdaptivePolicy(pricing.taus, pricing.cost, pricing.proposal) if mode == "policy" else None
        pricing.budget = TokenBudget(pricing.cost, adaptive=True) if mode == "budget" else None
        lookup.use_budget(pricing.budget.lengths if mode == "budget" else None)

    runs = []
    for mode in order:
        use(mode)
        lookup.forget()
        warm = engine.running_batch(True, None)
        warm.add([prompts[-1]], [params], [0])
        while len(warm):
            warm.step()
        lookup.forget()
        run = engine.running_batch(True, None)
        waiting, done = list(range(len(prompts))), 0
        t0 = time.perf_counter()
        while done < len(prompts):
            free = args.rows - len(run)
            if free and waiting:
                take, waiting = waiting[:free], waiting[free:]
                done += len(run.step([prompts[i] for i in take], [params] * len(take), take))
            else:
                done += len(run.step())
        wall = time.perf_counter() - t0
        st = run.stats
        row_steps = sum(len(a) for a in st.accepted_per_step)
        tokens = len(prompts) * args.max_tokens
        runs.append({"mode": mode, "tok_per_s": round(tokens / wall, 1), "seconds": round(wall, 2), "steps": st.steps,
                     "tokens_per_row_step": round(sum(len(a) + sum(a) for a in st.accepted_per_step) / row_steps, 3)})
        print(json.dumps(runs[-1]), flush=True)
    summary = {m: [r["tok_per_s"] for r in runs if r["mode"] == m] for m in MODES if m in order}
    print("tok/s:", json.dumps(summary), flush=True)
    if args.out:
        doc = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_description(),
               "args": vars(args), "runs": runs, "tok_per_s": summary}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(Path(args.out), (json.dumps(doc, indent=1) + "\n").encode())


if __name__ == "__main__":
    main()
