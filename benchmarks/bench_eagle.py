"""Drafters side by side: EAGLE-3 vs Medusa-1 trained on the same data and token budget, the lookup proposer, bare vLLM.

    OMP_NUM_THREADS=2 python benchmarks/bench_eagle.py --eagle out/eagle3 --medusa out/medusa --eval out/eagle-split/eval \\
        --out benchmarks/results/eagle.json

One process, one machine (named in the output), float32, greedy, the bundled model unless --model:

per-depth acceptance, held-out split
    teacher-forced top-1 per depth on ``--eval`` (``--eval-tokens`` input tokens): Medusa head k's
    top-1 is token t+k+1 from h_t alone; EAGLE depth k's top-1 is the drafter's guess at depth k
    when depths 1..k-1 were right (:func:`distill.train.eagle.drafter_accuracy`).
per-depth acceptance, MT-Bench (in the engine)
    with the full tree at every step, greedy, on the first ``--prompts`` MT-Bench first turns:
    the fraction of steps that accepted at least d drafted tokens, d = 1..depth.
tokens per step
    emitted tokens / decoding steps with the full tree (Medusa: its calibrated tree of
    ``--medusa-nodes``; EAGLE: the dynamic tree of ``--eagle-nodes`` nodes, depth, top-k).
wall-clock at batch 1
    tokens/s of plain decoding, each drafter with the engine's policy choosing the tree size,
    and each drafter with its full tree, over the same prompts, alternating the order per prompt;
    every greedy output must equal plain decoding's. ``--vllm`` adds bare vLLM plain decoding
    (in-process engine core, eager, as benchmarks/bench_engine_step.py times it; ``--vllm-compiled``: its forward
    compiled, as its server runs it) in the same rotation;
    ``--typical T`` adds a sampled pass (temperature T, typical acceptance) of every engine but vLLM,
    rows ``NAME@typical`` measured against plain decoding sampled the same way;
    ``--vllm-speculative JSON`` gives that vLLM a speculative config, its row then ``vllm:METHOD`` (its
    ``ngram`` prompt lookup, the counterpart of ``--lookup``; ``suffix`` where ``arctic-inference`` imports).
    One vLLM per process: a second ``vllm.LLM`` in the same process fails on a CPU (its kernel overrides
    register once), so each vLLM configuration is a run of its own beside the same distill rows.
    ``--adaptive`` runs the ``-policy`` rows as ``distill serve`` does (the adaptive policy);
    ``--prompt-set heldout`` takes the held-out chat prompts (``heldout-chat-prompts.json``, nine categories
    no drafter here was trained or tuned on) one category after the other instead of MT-Bench's.
the union (``--union``, with ``--eagle`` and ``--lookup``)
    rows ``eagle+NAME-policy / -full`` for every lookup row NAME: the EAGLE drafter's dynamic tree
    and that lookup proposer's tree merged per row every step (:mod:`distill.engine.proposers.union`), the
    full tree holding both full trees.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import itertools
import json
import os
import re
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from bench_engine_step import cpu_description, mt_bench_prompts, vllm, vllm_llm  # noqa: E402
from replay_lookup import HELDOUT  # noqa: E402
from distill.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from distill.engine.engine import LOOKUP, load_heads  # noqa: E402
from distill.engine.proposers.datastore import Datastore  # noqa: E402
from distill.engine.proposers.lookup import Lookup  # noqa: E402
from distill.engine.proposers.union import Union  # noqa: E402
from distill.store.atomic import atomic_write_bytes  # noqa: E402


def held_out_acceptance(model, eagle_dir: Path, medusa_dir: Path, data: Path, tokens: int, depth: int) -> dict:
    from distill.heads.eagle import EagleDrafter
    from distill.heads.model import MedusaHeads
    from distill.train.calibrate import head_accuracy
    from distill.train.eagle import drafter_accuracy

    e = drafter_accuracy(model, EagleDrafter.load(eagle_dir), data, max_len=512, ranks=5, max_tokens=tokens, steps=depth)
    out = {"eagle_top1": e.topk(1), "eagle_top5": e.topk(5), "eagle_positions": e.counts, "tokens": e.tokens}
    if medusa_dir is not None:
        m = head_accuracy(model, MedusaHeads.load(medusa_dir), data, max_len=512, ranks=5, max_tokens=tokens)
        out.update(medusa_top1=m.topk(1), medusa_top5=m.topk(5), medusa_positions=m.counts)
    return out


def run_record(res, st, seconds: float) -> dict:
    """One engine's run of one prompt: what the summary adds up."""
    return {"tokens": len(res.token_ids), "seconds": seconds, "steps": st.steps, "accepted": res.accepted,
            "step_seconds_median": statistics.median(st.step_seconds) if st.step_seconds else None,
            "nodes_per_step": st.tree_nodes_per_step}


def tok_s(runs: list[dict]) -> float:
    return sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)


def depth_acceptance(accepted: list[int], depth: int) -> list[float]:
    """Fraction of steps that accepted at least d drafted tokens (a step emits accepted + 1)."""
    return [sum(a - 1 >= d for a in accepted) / max(len(accepted), 1) for d in range(1, depth + 1)]


def heldout_prompts(tok, n: int) -> list[list[int]]:
    """The first ``n`` held-out chat prompts, one category after the other (round-robin), chat-templated."""
    categories = json.loads(HELDOUT.read_text())["categories"].values()
    texts = [t for t in itertools.chain.from_iterable(itertools.zip_longest(*categories)) if t is not None][:n]
    return [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]) for t in texts]


def forget_all(engines: dict) -> None:
    """Clear every lookup proposer's history of earlier replies (alone or in a union)."""
    for e in engines.values():
        if hasattr(e.proposer, "forget"):
            e.proposer.forget()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--eagle", type=Path, help="EAGLE-3 drafter folder (omit: no EAGLE rows)")
    ap.add_argument("--lookup", action="store_true", help="add the lookup proposer (n-gram matches in the context, nothing trained)")
    ap.add_argument("--lookup-nodes", type=int, default=8, help="the lookup proposer's node budget")
    ap.add_argument("--lookup-data", type=Path, action="append", default=[], metavar="DATA",
                    help="with --lookup: also the lookup proposer with this dataset as its datastore (rows "
                         "lookup+NAME-policy / -full, NAME the folder's name); repeatable")
    ap.add_argument("--lookup-history", type=int, default=0, metavar="TOKENS",
                    help="with --lookup: also each lookup row with a history of this many tokens of the replies before it "
                         "(rows NAME+history-policy / -full; cleared after the warm-up and before the typical pass; the "
                         "other lookup rows have none)")
    ap.add_argument("--union", action="store_true",
                    help="with --eagle and --lookup: also every lookup row merged with the EAGLE drafter (rows eagle+NAME-*)")
    ap.add_argument("--medusa", type=Path, help="Medusa heads trained on the same data and budget (omit: EAGLE vs plain only)")
    ap.add_argument("--eval", type=Path, help="held-out dataset folder for teacher-forced per-depth acceptance")
    ap.add_argument("--eval-tokens", type=int, default=4000)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--round-robin", action="store_true", help="prompts round-robin over the MT-Bench categories (default: the first ones, all writing)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--eagle-nodes", type=int, default=24)
    ap.add_argument("--eagle-depth", type=int, default=5)
    ap.add_argument("--eagle-topk", type=int, default=8)
    ap.add_argument("--medusa-nodes", type=int, default=24, help="Medusa's full tree: its calibrated tree cut to this many nodes")
    ap.add_argument("--typical", type=float, default=0.0, metavar="T",
                    help="also sample at temperature T (typical acceptance, a fixed seed per prompt): tokens/step and "
                         "tok/s of every engine but vLLM, in the same rotation after the greedy pass (0: greedy only)")
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--vllm-compiled", action="store_true",
                    help="vLLM's forward compiled, as its server runs it (default: eager, bare vLLM)")
    ap.add_argument("--vllm-speculative", type=json.loads, default=None, metavar="JSON",
                    help='vLLM\'s speculative_config for its row, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                         '"prompt_lookup_max": 6, "prompt_lookup_min": 1}\' (vLLM\'s own prompt lookup)')
    ap.add_argument("--adaptive", action="store_true", help="the -policy rows under the adaptive policy, as distill serve runs")
    ap.add_argument("--prompt-set", choices=("mt-bench", "heldout"), default="mt-bench",
                    help="MT-Bench first turns, or the held-out chat prompts (module docstring)")
    ap.add_argument("--only", default=None, metavar="REGEX",
                    help="keep the rows whose name matches (plain always runs), e.g. 'history' for the +history rows alone")
    ap.add_argument("--out", default="benchmarks/results/eagle.json")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distill.models import resolve_model

    resolved = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(resolved.path)
    result: dict = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu_description(),
                    "model": resolved.name, "args": {k: str(v) for k, v in vars(args).items()}}
    if args.eval and args.eagle:
        t0 = time.perf_counter()
        with torch.inference_mode():
            result["held_out"] = held_out_acceptance(model, args.eagle, args.medusa, args.eval, args.eval_tokens, args.eagle_depth)
        print("held-out acceptance", json.dumps(result["held_out"]), f"({time.perf_counter() - t0:.0f} s)", flush=True)

    eagle_tree = dict(draft_nodes=args.eagle_nodes, draft_depth=args.eagle_depth, draft_topk=args.eagle_topk)
    configs = {  # one model in memory; each engine wraps it with its own proposer and settings
        "plain": (None, EngineConfig(max_batch=1, dtype="float32", device="cpu")),
        "medusa-policy": (args.medusa, EngineConfig(max_batch=1, dtype="float32", device="cpu")),  # its calibrated tree.json, policy
        "eagle-policy": (args.eagle, EngineConfig(max_batch=1, dtype="float32", device="cpu", **eagle_tree)),
        # full trees every step: Medusa's greedy sparse tree of --medusa-nodes under its calibrated accuracy
        "medusa-full": (args.medusa, EngineConfig(max_batch=1, dtype="float32", device="cpu", tree=f"sparse-{args.medusa_nodes}", speculate_max_batch=1)),
        "eagle-full": (args.eagle, EngineConfig(max_batch=1, dtype="float32", device="cpu", speculate_max_batch=1, **eagle_tree)),
    }
    if args.lookup:
        configs["lookup-policy"] = (LOOKUP, EngineConfig(max_batch=1, dtype="float32", device="cpu"))
        configs["lookup-full"] = (LOOKUP, EngineConfig(max_batch=1, dtype="float32", device="cpu", speculate_max_batch=1))
        for data in args.lookup_data:  # the same proposer with a datastore (distill.engine.proposers.datastore)
            name = f"lookup+{data.name}"
            configs[f"{name}-policy"] = (data, EngineConfig(max_batch=1, dtype="float32", device="cpu"))
            configs[f"{name}-full"] = (data, EngineConfig(max_batch=1, dtype="float32", device="cpu", speculate_max_batch=1))
        if args.lookup_history:  # the same rows drafting from the replies to the prompts before theirs too
            for name in [k for k in configs if k.startswith("lookup")]:
                base, kind = name.rsplit("-", 1)
                configs[f"{base}+history-{kind}"] = configs[name]
    if args.union and args.eagle and args.lookup:  # the drafter's tree and each lookup row's, merged
        for name in [k for k in configs if k.startswith("lookup")]:
            base = configs[name][1]
            configs[f"eagle+{name}"] = (configs[name][0], EngineConfig(
                max_batch=1, dtype="float32", device="cpu", speculate_max_batch=base.speculate_max_batch, **eagle_tree))
    configs = {k: v for k, v in configs.items() if v[0] is not None or k == "plain"}  # drafters not given: no rows
    if args.only:
        configs = {k: v for k, v in configs.items() if k == "plain" or re.search(args.only, k)}
    if args.adaptive:
        configs = {k: (f, dataclasses.replace(c, adaptive=True) if k.endswith("-policy") else c) for k, (f, c) in configs.items()}
    engines, stores = {}, {}
    for name, (folder, cfg) in configs.items():
        history = args.lookup_history if "+history" in name else 0
        union = name.startswith("eagle+")
        if folder == LOOKUP:
            heads, tree = Lookup(max_nodes=args.lookup_nodes, history_tokens=history), None
        elif folder in args.lookup_data:
            stores.setdefault(folder, Datastore.from_dataset(folder, model.config.vocab_size))
            heads, tree = Lookup(max_nodes=args.lookup_nodes, datastore=stores[folder], history_tokens=history), None
            result.setdefault("datastores", {})[name] = stores[folder].describe()
        else:
            heads, tree = load_heads(folder, cfg) if folder is not None else (None, None)
        lookup = None
        if union:  # the lookup built above joins the drafter's proposer
            lookup, (heads, tree) = heads, load_heads(args.eagle, cfg)
        engines[name] = Engine(model, tok, heads, cfg, model_name=resolved.name, tree=tree, lookup=lookup)
    result["policy_nodes_at_batch_1"] = {k: e.tree_size_for(1) for k, e in engines.items() if k.endswith("policy")}
    result["step_costs"] = {k: e.step_costs.to_dict() for k, e in engines.items() if e.step_costs is not None}  # measured at start
    print("policy nodes at batch 1", result["policy_nodes_at_batch_1"], "step costs", result["step_costs"], flush=True)
    if args.prompt_set == "heldout":
        prompts = heldout_prompts(tok, args.prompts)
    elif args.round_robin:  # as `distill bench --limit` takes them: one category after the other
        from distill.bench import load_prompts
        from distill.bench.runner import chat_ids

        prompts = [chat_ids(tok, p.messages) for p in load_prompts("mt-bench", args.prompts)]
    else:
        prompts = mt_bench_prompts(tok, args.prompts)
    spec = args.vllm_speculative
    llm = vllm_llm(str(resolved.path), spec, eager=not args.vllm_compiled) if args.vllm else None
    vname = f"vllm:{spec['method']}" if spec else "vllm"  # its row
    stop = sorted(engines["plain"].stop_ids)
    sp = SamplingParams(max_tokens=args.max_tokens)
    names = list(engines) + ([vname] if llm else [])
    for name in names:  # warm-up, untimed
        if name == vname:
            vllm(llm, prompts[:1], 8, 1, stop)
        else:
            engines[name].generate(prompts[:1], SamplingParams(max_tokens=8))
    forget_all(engines)  # no prompt drafts from a warm-up reply
    runs: dict[str, list[dict]] = {n: [] for n in names}
    reference: list[list[int]] = []
    for i, p in enumerate(prompts):
        order = names if i % 2 == 0 else names[::-1]
        outs = {}
        for name in order:
            if name == vname:
                n, secs, o = vllm(llm, [p], args.max_tokens, 1, stop)
                outs[name] = o[0]
                runs[name].append({"tokens": n, "seconds": secs})
                continue
            t0 = time.perf_counter()
            (res,), st = engines[name].generate([p], sp)
            secs = time.perf_counter() - t0
            outs[name] = res.token_ids
            runs[name].append(run_record(res, st, secs))
        reference.append(outs["plain"])
        for name in engines:
            assert outs[name] == outs["plain"], f"{name}: greedy output differs from plain decoding on prompt {i}"
        if llm:  # how far vLLM's greedy tokens agree with ours (its replies also hold the stop token)
            result.setdefault("vllm_same_prefix", []).append(
                sum(1 for _ in itertools.takewhile(lambda ab: ab[0] == ab[1], zip(outs[vname], outs["plain"]))))
        print(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(
            f"{n} {runs[n][-1]['tokens'] / runs[n][-1]['seconds']:.1f} tok/s" for n in names), flush=True)
    if args.typical > 0:  # sampled outputs differ per engine; what counts is tokens/step and tok/s
        forget_all(engines)  # nor from its own greedy reply
        for i, p in enumerate(prompts):
            sp_t = SamplingParams(max_tokens=args.max_tokens, temperature=args.typical, seed=1000 + i)
            for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
                t0 = time.perf_counter()
                (res,), st = engines[name].generate([p], sp_t)
                runs.setdefault(f"{name}@typical", []).append(run_record(res, st, time.perf_counter() - t0))
            print(f"typical, prompt {i + 1}/{len(prompts)} done", flush=True)
        names += [f"{n}@typical" for n in engines]
    summary = {}
    plain_tps = tok_s(runs["plain"])
    vllm_tps = tok_s(runs[vname]) if llm else None
    result["vllm_speculative"] = spec
    for name in names:
        rs = runs[name]
        tps = tok_s(rs)
        sampled = name.endswith("@typical")  # against plain decoding sampled the same way; vLLM ran greedy only
        row = {"tok_s": tps, "vs_plain": tps / tok_s(runs["plain@typical" if sampled else "plain"]),
               "vs_vllm": tps / vllm_tps if vllm_tps and not sampled else None}
        if name != vname:
            acc = [a for r in rs for a in r["accepted"]]
            row.update(tokens_per_step=sum(acc) / len(acc), steps=len(acc),
                       step_ms_median=1000 * statistics.median(r["step_seconds_median"] for r in rs),
                       depth_acceptance=depth_acceptance(acc, args.eagle_depth if "eagle" in name else 6 if "lookup" in name else 5),
                       mean_nodes=statistics.mean(n for r in rs for n in r["nodes_per_step"]))
        summary[name] = row
    result["summary"] = summary
    result["unions"] = {k: {"acceptance_ratios": e.proposer.acceptance_ratios, "revision": e.proposer.revision,
                            "shares": {str(n): list(ks) for n, ks in e.proposer.shares.items()},
                            "policy_nodes_at_batch_1": e.tree_size_for(1)}
                        for k, e in engines.items() if isinstance(e.proposer, Union)}  # where the measured acceptance left them
    result["runs"] = runs
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(args.out), (json.dumps(result, indent=1) + "\n").encode())
    for name, row in summary.items():
        print(name, json.dumps(row))


if __name__ == "__main__":
    main()
