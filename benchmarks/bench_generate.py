"""Benchmark `distill generate` as users run it, against bare vLLM; and its overhead and teacher storage in-process.

Part 1, as users run it (``--as-users-run``): whole processes, one after another, alternating
over ``--repeats``, on the same ShareGPT first-turn prompts (token ids), sampling and top-k:

* ``distill generate`` with its defaults (the CLI, nothing set in the environment);
* ``distill generate`` with other settings (``--dtype bfloat16`` where the CPU has native
  bf16; vLLM's engine core in its own process, the pre-fix behaviour);
* a bare ``vllm.LLM(model).generate`` script with vLLM's own defaults (dtype auto, engine
  core in its own process) and the same script in-process, float32.

Throughput is generated tokens over the process's wall clock (start-up included on every
side). The defaults are compared with bare vLLM's defaults and with the fastest setting.

Part 2, in-process (the overhead row): one process, one engine, the same prompts run
alternately as a bare ``llm.generate`` call and as a whole ``distill generate`` run (seed
reading, templating, teacher encoding, Parquet, manifest); plus the teacher storage read
from the Parquet footers and checked against the raw values vLLM returned.

    python benchmarks/bench_generate.py --conversations 64 --max-new-tokens 128 --repeats 2 --json benchmarks/results/generate.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DISTILL = str(Path(sys.executable).with_name("distill"))
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING",)}


def first_turn_requests(n: int, max_new_tokens: int, topk: int, temperature: float, tokenizer, stop_ids):
    """The token-id prompts and per-request sampling ``distill generate --mode single-turn`` sends."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from distill.generate import GenerateConfig
    from distill.generate.runner import ConversationState, _request_seed
    from distill.templating import ChatFormat
    from distill.seeds import load_seed

    fmt = ChatFormat(tokenizer, stop_ids)
    base = GenerateConfig(seed="sharegpt", mode="single-turn", limit=n, max_new_tokens=max_new_tokens, topk=topk,
                          temperature=temperature, shard_size=n)
    convs = [c for c in load_seed("sharegpt") if hasattr(c, "messages")][:n]
    prompts, params = [], []
    for c in convs:
        s = ConversationState(c, base)
        prompts.append(TokensPrompt(prompt_token_ids=fmt.first_prompt(s.messages + [{"role": "user", "content": s.pending_users[0]}])))
        params.append(SamplingParams(temperature=temperature, top_p=1.0, max_tokens=max_new_tokens, logprobs=topk,
                                     seed=_request_seed(0, c.id, 0, "assistant"), stop_token_ids=sorted(stop_ids)))
    return convs, prompts, params


def bare_child(args) -> None:
    """One bare vLLM process: LLM(model) with ``--child-dtype`` (vLLM's defaults unless given), then generate."""
    t0 = time.perf_counter()
    from vllm import LLM

    from distill.models import resolve_model, stop_token_ids

    model = resolve_model(None)
    kwargs = {"model": str(model.path), "max_model_len": 2048, "logprobs_mode": "raw_logprobs", "max_logprobs": args.topk}
    if args.child_dtype != "auto":
        kwargs["dtype"] = args.child_dtype
    llm = LLM(**kwargs)
    tok = llm.get_tokenizer()
    _, prompts, params = first_turn_requests(args.conversations, args.max_new_tokens, args.topk, args.temperature, tok,
                                             stop_token_ids(tok, model.path))
    t1 = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    gen = time.perf_counter() - t1
    print(json.dumps({"tokens": sum(len(o.outputs[0].token_ids) for o in out), "generate_s": gen, "startup_s": t1 - t0}))


def run_process(name: str, cmd: list[str], env: dict, out: Path | None) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if r.returncode != 0:  # recorded, not fatal: vLLM's own defaults may not start beside other processes
        errors = [line for line in r.stderr.splitlines() if "Error:" in line]
        return {"failed": (errors[-1] if errors else r.stderr.strip().splitlines()[-1])[-400:], "wall_s": wall}
    if out is not None:  # distill generate: tokens from the manifest it wrote
        tokens = json.loads((out / "manifest.json").read_text())["totals"]["generated_tokens"]
        return {"tokens": tokens, "wall_s": wall}
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    return dict(doc, wall_s=wall)


def as_users_run(args) -> dict:
    from distill.runtime import cpu_has_native_bf16, machine

    common = ["--seed", "sharegpt", "--mode", "single-turn", "--limit", str(args.conversations), "--max-new-tokens",
              str(args.max_new_tokens), "--temperature", str(args.temperature), "--topk", str(args.topk), "-q"]
    me = [sys.executable, str(Path(__file__).resolve()), "--child", "--conversations", str(args.conversations),
          "--max-new-tokens", str(args.max_new_tokens), "--topk", str(args.topk), "--temperature", str(args.temperature)]
    modes = {
        "distill generate (defaults)": ("distill", [], {}),
        "distill generate, vLLM engine core in its own process": ("distill", [], {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}),
        "bare vLLM, vLLM defaults": ("bare", ["--child-dtype", "auto"], {}),
        "bare vLLM, in-process, float32": ("bare", ["--child-dtype", "float32"], {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}),
    }
    if cpu_has_native_bf16():  # emulated bf16 is ~300x slower: not a setting anyone would pick
        modes["distill generate --dtype bfloat16"] = ("distill", ["--dtype", "bfloat16"], {})
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for name, (kind, extra, env_extra) in modes.items():
            env = dict(CLEAN_ENV, **env_extra)
            if kind == "distill":
                out = Path(tempfile.mkdtemp(prefix="bench-gen-")) / "data"
                runs[name].append(run_process(name, [DISTILL, "generate", *common, *extra, "--out", str(out)], env, out))
            else:
                runs[name].append(run_process(name, me + extra, env, None))
            r = runs[name][-1]
            print(f"[{rep + 1}/{args.repeats}] {name}: " + (f"failed: {r['failed']}" if "failed" in r else
                  f"{r['tokens']} tokens in {r['wall_s']:.1f}s ({r['tokens'] / r['wall_s']:.1f} tok/s wall)"), file=sys.stderr, flush=True)
    table = {}
    for name, rs in list(runs.items()):
        failed = [r["failed"] for r in rs if "failed" in r]
        rs = [r for r in rs if "failed" not in r]
        if not rs:
            table[name] = {"failed": failed[0], "median_wall_tok_s": None}
            continue
        tps = [r["tokens"] / r["wall_s"] for r in rs]
        table[name] = {"wall_tok_s": [round(x, 1) for x in tps], "median_wall_tok_s": round(statistics.median(tps), 1)}
        if "generate_s" in rs[0]:
            table[name]["median_generate_only_tok_s"] = round(statistics.median(r["tokens"] / r["generate_s"] for r in rs), 1)
    default = table["distill generate (defaults)"]["median_wall_tok_s"]
    fastest = max((n for n in table if table[n]["median_wall_tok_s"]), key=lambda n: table[n]["median_wall_tok_s"])
    bare = table["bare vLLM, vLLM defaults"]["median_wall_tok_s"]
    return {
        "machine": machine("cpu"),
        "conversations": args.conversations, "max_new_tokens": args.max_new_tokens, "topk": args.topk,
        "temperature": args.temperature, "repeats": args.repeats,
        "modes": table,
        "defaults_vs_bare_vllm_defaults": round(default / bare, 3) if bare else None,
        "fastest_setting": fastest,
        "defaults_vs_fastest": round(default / table[fastest]["median_wall_tok_s"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-dtype", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--skip-in-process", action="store_true", help="Only part 1.")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="Part 2's engine dtype.")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.child:
        bare_child(args)
        return
    result = {"as_users_run": as_users_run(args)}
    if not args.skip_in_process:
        result["in_process"] = in_process(args)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def in_process(args) -> dict:
    """Part 2 (see the module docstring): distill's own overhead on one engine, and the teacher storage."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import pyarrow.parquet as pq

    from distill.generate import GenerateConfig, Generator
    from distill.generate.backends import BackendOptions, VLLMBackend
    from distill.models import resolve_model
    from distill.runtime import machine
    from distill.store import TeacherEncoding, decode_topk, iter_rows, load_manifest

    model = resolve_model(None)
    backend = VLLMBackend(model.path, BackendOptions(dtype=args.dtype, max_model_len=2048))
    base_cfg = dict(seed="sharegpt", mode="single-turn", limit=args.conversations, max_new_tokens=args.max_new_tokens,
                    topk=args.topk, temperature=args.temperature, shard_size=args.conversations, dtype=args.dtype)
    convs, prompts, params = first_turn_requests(args.conversations, args.max_new_tokens, args.topk, args.temperature,
                                                 backend.tokenizer, backend.stop_ids)

    backend.llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    bare_tps, distill_tps, bare_out, out_dir = [], [], None, None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        bare_out = backend.llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        bare_tps.append(sum(len(o.outputs[0].token_ids) for o in bare_out) / dt)

        out_dir = Path(tempfile.mkdtemp(prefix="bench-distill-"))
        t0 = time.perf_counter()
        summary = Generator(GenerateConfig(out=str(out_dir), **base_cfg), backend=backend).run()
        dt = time.perf_counter() - t0
        distill_tps.append(summary.new_tokens / dt)

    # Same tokens on both sides (same per-request seeds)?
    rows = {r["id"]: r for r in iter_rows(out_dir)}
    same = sum(
        list(o.outputs[0].token_ids) == [t for t, m in zip(rows[c.id]["input_ids"], rows[c.id]["loss_mask"]) if m]
        for c, o in zip(convs, bare_out)
    )

    # Teacher storage: compressed bytes of the teacher columns per generated token.
    manifest = load_manifest(out_dir)
    enc = TeacherEncoding.from_dict(manifest["meta"]["teacher"])
    teacher_bytes = 0
    for s in manifest["shards"]:
        md = pq.ParquetFile(out_dir / s["file"]).metadata
        for rg in range(md.num_row_groups):
            for col in range(md.num_columns):
                chunk = md.row_group(rg).column(col)
                if chunk.path_in_schema.split(".")[0] in ("teacher_ids", "teacher_lp"):
                    teacher_bytes += chunk.total_compressed_size
    gen_tokens = manifest["totals"]["generated_tokens"]
    max_err, exact_ids, compared = 0.0, True, 0
    for c, o in zip(convs, bare_out):
        row = rows[c.id]
        if list(o.outputs[0].token_ids) != [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]:
            continue
        ids, lps = decode_topk(row["teacher_ids"], row["teacher_lp"], enc)
        for i, pos in enumerate(o.outputs[0].logprobs):
            top = sorted(((lp.logprob, tid) for tid, lp in pos.items()), reverse=True)[: args.topk]
            raw = {tid: lp for lp, tid in top}
            # Same ids, except where candidates tie with the k-th logprob (either side may keep either).
            every = {tid: lp.logprob for tid, lp in pos.items()}
            kth = top[-1][0]
            exact_ids &= all(abs(every[t] - kth) < 1e-6 for t in set(ids[i].tolist()) ^ set(raw))
            max_err = max(max_err, max(abs(float(lps[i][j]) - raw[int(t)]) for j, t in enumerate(ids[i]) if int(t) in raw))
            compared += 1

    result = {
        "machine": machine("cpu"),
        "engine": backend.version,
        "dtype": backend.dtype,
        "conversations": args.conversations,
        "max_new_tokens": args.max_new_tokens,
        "topk": args.topk,
        "temperature": args.temperature,
        "bare_vllm_tok_s": [round(x, 1) for x in bare_tps],
        "distill_tok_s": [round(x, 1) for x in distill_tps],
        "throughput_ratio_median": round(statistics.median(distill_tps) / statistics.median(bare_tps), 3),
        "identical_outputs": f"{same}/{len(convs)}",
        "generated_tokens": gen_tokens,
        "teacher_bytes_per_token": round(teacher_bytes / gen_tokens, 2),
        "teacher_bytes_per_candidate": round(teacher_bytes / gen_tokens / args.topk, 3),
        "naive_bytes_per_token": 6 * args.topk,
        "ids_exact": bool(exact_ids),
        "max_logprob_error_nats": round(max_err, 5),
        "positions_compared": compared,
    }
    backend.close()
    return result


if __name__ == "__main__":
    main()
