"""The ``openai`` backend: generation on running vLLM OpenAI servers, over HTTP, asynchronously.

Prompts go as token ids to ``POST /v1/completions`` (built by our templating, exactly as for
the in-process backends), with ``logprobs=K``, ``return_tokens_as_token_ids`` (candidates
come back as ``"token_id:N"``, never as text to re-tokenize) and ``return_token_ids`` (the
sampled ids). Every sampling parameter is sent explicitly, so the server's defaults (a
model's ``generation_config.json``) never change the distribution.

Terms
-----
server pool
    the ``--server`` URLs. A request goes to the healthy server with the fewest
    outstanding requests (least outstanding requests).
retry
    a request that fails with a connection error, a timeout, 429 or a 5xx is sent again
    after a backoff (``backoff`` seconds doubled per attempt, capped, with jitter), to the
    best server then; the server that failed is set aside for that backoff, so a dead
    server's conversations go to the others. Any other status (a 400: a bad option, a
    prompt too long) is an error at once.
teacher checks
    at start, on every server: it serves one model and tokenizes like ours (``/tokenize``),
    and it returns raw logprobs (``--logprobs-mode raw_logprobs``, vLLM's default): the
    mode the server reports (``/server_info``, vLLM's dev mode) when it reports one, and
    always a probe: one prompt's top-k at temperature 1 and at temperature 0.5 must be the
    same normalized log-probabilities (processed logprobs would change with temperature;
    logits are not normalized). On every response: one top-k per sampled token, the
    sampled ids equal the ids of the logprobs, and the k best distinct candidates are kept
    as the in-process vLLM backend keeps them (:func:`distill.generate.backends.best_distinct_rows`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from distill.errors import BackendError, ConfigError
from distill.generate.backends import BackendOptions, Completion, Request, best_distinct_rows
from distill.models import ModelFacts, model_facts

log = logging.getLogger("distill.generate")

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
PROBE_TEXT = "The capital of France is"
PROBE_TOL = 1e-3  # nats: the same distribution read twice (batching noise is far below this)


@dataclass(frozen=True)
class ServerOptions:
    """How the openai backend talks to its servers."""

    servers: tuple[str, ...]
    concurrency: int = 64  # conversations in flight (each has at most one request outstanding)
    api_key: str | None = None
    retries: int = 8  # attempts after the first, per request
    backoff: float = 0.5  # seconds before the first retry; doubled per attempt
    backoff_max: float = 20.0
    timeout: float = 3600.0  # seconds one request may take (a long generation on a busy server)
    connect_timeout: float = 10.0

    def __post_init__(self) -> None:
        if not self.servers:
            raise ConfigError("--backend openai needs --server URL[,URL...] (a vLLM OpenAI server, e.g. http://127.0.0.1:8000)")
        for url in self.servers:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"--server {url!r} must be an http:// or https:// URL")
        if self.concurrency < 1:
            raise ConfigError(f"--concurrency must be >= 1; got {self.concurrency}")


def parse_servers(spec: str | None) -> tuple[str, ...]:
    """``URL[,URL...]`` -> base URLs without a trailing slash or ``/v1``."""
    urls = [u.strip().rstrip("/") for u in (spec or "").split(",") if u.strip()]
    return tuple(u[: -len("/v1")] if u.endswith("/v1") else u for u in urls)


@dataclass
class Server:
    url: str
    model: str = ""  # the served model name to put in requests
    outstanding: int = 0
    down_until: float = 0.0
    failures: int = 0  # consecutive
    info: dict = field(default_factory=dict)  # what the server reported at start


class TransientError(Exception):
    """A failure worth retrying (connection, timeout, 429, 5xx)."""


class OpenAIBackend:
    """Generation on vLLM OpenAI servers; see the module docstring."""

    name = "openai"

    def __init__(self, model_path: Path, opts: BackendOptions, server: ServerOptions, facts: ModelFacts | None = None):
        """``facts``: the model's, as the caller resolved them (None: read from ``model_path``)."""
        from transformers import AutoTokenizer

        self.opts = opts
        self.server_opts = server
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.facts = facts or model_facts(model_path, self.tokenizer)
        self.stop_ids, self.vocab_size = self.facts.stop_ids, self.facts.vocab_size
        self.model_path = Path(model_path)
        self.servers = [Server(url) for url in server.servers]
        self._headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
        self._client = None
        for s in self.servers:
            self._check_server(s)
        infos = [s.info for s in self.servers]
        self.max_model_len = min(i["max_model_len"] for i in infos)
        self.version = sorted({i["version"] for i in infos})[0] if len({i["version"] for i in infos}) == 1 else \
            " / ".join(sorted({i["version"] for i in infos}))
        dtypes = {i.get("dtype") for i in infos} - {None}
        if len(dtypes) > 1:
            raise BackendError(f"the servers run different dtypes ({', '.join(sorted(dtypes))}): one teacher, one dtype")
        reported = dtypes.pop() if dtypes else None
        if reported and opts.dtype not in ("auto", reported):
            raise BackendError(f"--dtype {opts.dtype} but the servers run {reported}")
        self.dtype = reported or opts.dtype
        if self.dtype == "auto":
            raise ConfigError("the servers do not report their dtype (vLLM reports it in dev mode, VLLM_SERVER_DEV_MODE=1): "
                              "pass --dtype with the dtype they run the model in (recorded as the teacher dtype)")
        devices = {i.get("device") for i in infos} - {None}
        self.device = devices.pop() if len(devices) == 1 else "server"

    # -- start-up checks (synchronous) -------------------------------------------------------
    def _get(self, client, server: Server, path: str, **kw):
        import httpx

        try:
            return client.request(kw.pop("method", "GET"), server.url + path, headers=self._headers, **kw)
        except httpx.HTTPError as exc:
            raise BackendError(f"server {server.url} is not reachable ({type(exc).__name__}: {exc}); start it or fix --server") from None

    def _check_server(self, server: Server) -> None:
        import httpx

        from distill.runtime import canonical_dtype

        with httpx.Client(timeout=httpx.Timeout(120.0, connect=self.server_opts.connect_timeout)) as client:
            r = self._get(client, server, "/v1/models")
            if r.status_code in (401, 403):
                raise BackendError(f"server {server.url} refused the API key ({r.status_code}): set --api-key-env to the "
                                   "variable that holds its key")
            _raise_for(r, server, "/v1/models")
            models = r.json().get("data") or []
            if len(models) != 1:
                raise BackendError(f"server {server.url} serves {len(models)} models ({', '.join(m.get('id', '?') for m in models)}); "
                                   "the openai backend needs a server with exactly one")
            server.model = models[0]["id"]
            info: dict = {"max_model_len": int(models[0].get("max_model_len") or self.facts.context_limit)}
            r = self._get(client, server, "/version")
            info["version"] = f"vllm {r.json().get('version')} (server)" if r.status_code == 200 else "unknown (server)"
            r = self._get(client, server, "/server_info", params={"config_format": "json"})
            if r.status_code == 200:  # vLLM's dev mode: the whole config
                config = r.json().get("vllm_config") or {}
                model_cfg = config.get("model_config") or {}
                mode = model_cfg.get("logprobs_mode")
                if mode is not None and mode != "raw_logprobs":
                    raise BackendError(f"server {server.url} returns {mode}; the teacher's top-k must be the unmodified "
                                       "distribution: restart it with --logprobs-mode raw_logprobs")
                info["logprobs_mode"] = mode
                if model_cfg.get("dtype"):
                    info["dtype"] = canonical_dtype(str(model_cfg["dtype"]).removeprefix("torch."))
                device = (config.get("device_config") or {}).get("device_type") or (config.get("device_config") or {}).get("device")
                if isinstance(device, str):
                    info["device"] = device
            server.info = info
            self._check_tokenizer(client, server)
            self._probe_logprobs(client, server)

    def _probe_text(self) -> str:
        return self.tokenizer.apply_chat_template([{"role": "user", "content": PROBE_TEXT}], tokenize=False,
                                                  add_generation_prompt=True)

    def _probe_ids(self) -> list[int]:
        return list(self.tokenizer(self._probe_text(), add_special_tokens=False)["input_ids"])

    def _check_tokenizer(self, client, server: Server) -> None:
        text, ours = self._probe_text(), self._probe_ids()
        r = self._get(client, server, "/tokenize", method="POST",
                      json={"model": server.model, "prompt": text, "add_special_tokens": False})
        if r.status_code == 404:
            log.warning("server %s has no /tokenize: its tokenizer was not checked against the model's", server.url)
            return
        _raise_for(r, server, "/tokenize")
        if r.json().get("tokens") != ours:
            raise BackendError(f"server {server.url} tokenizes differently from the model given with --model "
                               f"({server.model!r} on the server): point --model at the model the server serves")

    def _probe_logprobs(self, client, server: Server) -> None:
        """The top-k at temperature 1 and 0.5 must be one normalized distribution (raw logprobs)."""
        ids = self._probe_ids()
        k = 5
        tops = []
        for temperature in (1.0, 0.5):
            body = self._body(Request(ids, 1, seed=0, topk=k, temperature=temperature), server)
            r = self._get(client, server, "/v1/completions", method="POST", json=body)
            _raise_for(r, server, "/v1/completions")
            comp = self._completion(r.json(), k, server)
            tops.append(dict(zip(comp.topk_ids[0].tolist(), comp.topk_logprobs[0].tolist())))
        a, b = tops
        shared = set(a) & set(b)
        normalized = max(a.values()) <= 1e-4 and math.fsum(math.exp(v) for v in a.values()) <= 1 + 1e-3
        same = len(shared) >= k - 1 and all(abs(a[t] - b[t]) <= PROBE_TOL for t in shared)
        if not (normalized and same):
            raise BackendError(f"server {server.url} does not return raw logprobs (the top-k changes with the temperature or "
                               "is not normalized): restart it with --logprobs-mode raw_logprobs")

    # -- requests ------------------------------------------------------------------------------
    def _body(self, r: Request, server: Server) -> dict:
        body = {
            "model": server.model,
            "prompt": list(r.prompt_ids),
            "max_tokens": r.max_new_tokens,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_k": r.top_k,
            "min_p": r.min_p,
            "repetition_penalty": r.repetition_penalty,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "seed": r.seed,
            "stop_token_ids": sorted(self.stop_ids),
            "return_token_ids": True,
            "add_special_tokens": False,
            "stream": False,
        }
        if r.topk:
            body.update(logprobs=r.topk, return_tokens_as_token_ids=True)
        return body

    def _completion(self, doc: dict, k: int, server: Server) -> Completion:
        """One response -> a Completion, with the teacher checks of the module docstring."""
        try:
            choice = doc["choices"][0]
            token_ids = [int(t) for t in choice["token_ids"]]
            reason = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise BackendError(f"server {server.url} sent a completion without token ids ({exc}); it must be a vLLM "
                               "OpenAI server (return_token_ids)") from None
        if reason not in ("stop", "length"):  # aborted or failed on the server: send it again
            raise TransientError(f"finish_reason {reason!r}")
        if reason == "stop" and (not token_ids or token_ids[-1] not in self.stop_ids):
            raise BackendError(f"server {server.url} stopped a turn without a stop token (finish_reason 'stop', last "
                               f"token {token_ids[-1:]}); start it without stop strings")
        finish = reason
        if not k:
            return Completion(token_ids, finish)
        lp = choice.get("logprobs") or {}
        tops, tokens = lp.get("top_logprobs") or [], lp.get("tokens") or []
        if len(tops) != len(token_ids) or len(tokens) != len(token_ids):
            raise BackendError(f"server {server.url} sent {len(tops)} top-k lists for {len(token_ids)} tokens")
        if [_token_id(t) for t in tokens] != token_ids:
            raise BackendError(f"server {server.url}: the logprobs' tokens are not the sampled ids")
        widths = np.fromiter((len(top) for top in tops), dtype=np.int64, count=len(tops))  # (N,)
        if len(widths) and widths.min() < k:
            raise BackendError(f"server {server.url} sent {widths[widths < k][0]} candidates where {k} were asked for")
        # Every position's candidates in one (N, M) block (narrower ones padded), kept in one pass
        valid = np.arange(max(int(widths.max(initial=0)), k)) < widths[:, None]  # (N, M)
        cand = np.zeros(valid.shape, dtype=np.int64)  # (N, M)
        vals = np.zeros(valid.shape, dtype=np.float32)  # (N, M)
        total = int(widths.sum())
        cand[valid] = np.fromiter((_token_id(t) for top in tops for t in top), dtype=np.int64, count=total)
        vals[valid] = np.fromiter((v for top in tops for v in top.values()), dtype=np.float32, count=total)
        ids, lps = best_distinct_rows(cand, vals, k, valid)  # (N, K), (N, K)
        if ids.max(initial=0) >= self.vocab_size:
            raise BackendError(f"server {server.url} sent token ids beyond the model's vocabulary ({self.vocab_size})")
        return Completion(token_ids, finish, ids, lps)

    @asynccontextmanager
    async def session(self):
        """The HTTP client of one run (connections kept alive across requests)."""
        import httpx

        o = self.server_opts
        limits = httpx.Limits(max_connections=o.concurrency + 8, max_keepalive_connections=o.concurrency + 8)
        timeout = httpx.Timeout(o.timeout, connect=o.connect_timeout)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=self._headers) as client:
            self._client = client
            try:
                yield self
            finally:
                self._client = None

    def _pick(self) -> Server | None:
        now = time.monotonic()
        up = [s for s in self.servers if s.down_until <= now]
        return min(up, key=lambda s: s.outstanding) if up else None

    async def agenerate(self, request: Request) -> Completion:
        """One request, on the least busy healthy server, retried on transient failures (see the module docstring)."""
        import httpx

        o = self.server_opts
        errors: list[str] = []
        for attempt in range(o.retries + 1):
            server = self._pick()
            while server is None:  # every server is backing off: wait for the first to come back
                await asyncio.sleep(max(0.05, min(s.down_until for s in self.servers) - time.monotonic()))
                server = self._pick()
            server.outstanding += 1
            try:
                r = await self._client.post(server.url + "/v1/completions", json=self._body(request, server))
                if r.status_code in RETRY_STATUS:
                    raise TransientError(f"{r.status_code} {r.text[:200]}")
                _raise_for(r, server, "/v1/completions")
                comp = self._completion(r.json(), request.topk, server)
            except (TransientError, httpx.TransportError) as exc:
                server.failures += 1
                delay = min(o.backoff_max, o.backoff * 2 ** (server.failures - 1)) * (0.5 + random.random() / 2)
                server.down_until = time.monotonic() + delay
                errors.append(f"{server.url}: {type(exc).__name__}: {exc}")
                log.warning("server %s failed (%s); retrying in %.1fs (attempt %d of %d)", server.url,
                            errors[-1], delay, attempt + 1, o.retries + 1)
                continue
            finally:
                server.outstanding -= 1
            server.failures = 0
            return comp
        raise BackendError(f"a request failed {o.retries + 1} times, on every server; last: {errors[-1]}")

    def generate(self, requests: list[Request]) -> list[Completion]:
        """The synchronous batch interface: all requests at once, up to ``concurrency`` in flight."""
        async def run() -> list[Completion]:
            gate = asyncio.Semaphore(self.server_opts.concurrency)

            async def one(r: Request) -> Completion:
                async with gate:
                    return await self.agenerate(r)

            async with self.session():
                return list(await asyncio.gather(*(one(r) for r in requests)))

        return asyncio.run(run()) if requests else []

    def close(self) -> None:
        self._client = None


def _token_id(token: str) -> int:
    """``"token_id:N"`` (vLLM's ``return_tokens_as_token_ids``) -> N."""
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise BackendError(f"the server sent token {token!r}, not 'token_id:N': it must honour return_tokens_as_token_ids")
    return int(token[len("token_id:"):])


def _raise_for(r, server: Server, path: str) -> None:
    if r.status_code == 200:
        return
    try:
        detail = r.json()
        detail = (detail.get("error") or {}).get("message") or detail.get("message") or json.dumps(detail)
    except ValueError:
        detail = r.text[:300]
    raise BackendError(f"server {server.url}{path} answered {r.status_code}: {detail}")

