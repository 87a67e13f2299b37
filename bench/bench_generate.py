"""Benchmark `distill generate` against a bare `vllm.LLM.generate`, and measure teacher storage.

One process, one engine: the same first-turn prompts (token ids), the same sampling
(temperature, top-p, per-request seeds), the same top-k logprobs. Runs alternate
(bare, distill, bare, distill, ...) and each side's median throughput is kept.

    python bench/bench_generate.py --conversations 64 --max-new-tokens 128 --repeats 3 --json out/bench-generate.json

Teacher storage is read from the Parquet footers of the shards distill wrote:
compressed bytes of the teacher columns per generated token, plus the largest
logprob error against the raw values vLLM returned for the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--topk", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import pyarrow.parquet as pq
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from distill.generate import GenerateConfig, Generator
    from distill.generate.backends import BackendOptions, VLLMBackend
    from distill.generate.runner import ConversationState, _request_seed
    from distill.generate.templating import ChatFormat
    from distill.models import resolve_model
    from distill.seeds import load_seed
    from distill.store import TeacherEncoding, decode_topk, iter_rows, load_manifest

    model = resolve_model(None)
    backend = VLLMBackend(model.path, BackendOptions(dtype=args.dtype, max_model_len=2048))
    fmt = ChatFormat(backend.tokenizer, backend.stop_ids)
    base_cfg = dict(seed="sharegpt", mode="single-turn", limit=args.conversations, max_new_tokens=args.max_new_tokens,
                    topk=args.topk, temperature=args.temperature, shard_size=args.conversations, dtype=args.dtype)
    convs = [c for c in load_seed("sharegpt") if hasattr(c, "messages")][: args.conversations]
    prompts, params = [], []
    for c in convs:
        s = ConversationState(c, GenerateConfig(**base_cfg))
        prompts.append(TokensPrompt(prompt_token_ids=fmt.first_prompt(s.messages + [{"role": "user", "content": s.pending_users[0]}])))
        params.append(SamplingParams(temperature=args.temperature, top_p=1.0, max_tokens=args.max_new_tokens, logprobs=args.topk,
                                     seed=_request_seed(0, c.id, 0, "assistant"), stop_token_ids=sorted(backend.stop_ids)))

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
    enc = TeacherEncoding.from_dict({k: v for k, v in manifest["meta"]["teacher"].items() if k != "logprob_mode"})
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
        "machine": f"{os.cpu_count()} CPU cores",
        "engine": backend.version,
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
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    backend.close()


if __name__ == "__main__":
    main()
