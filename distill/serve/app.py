"""The FastAPI app: OpenAI-compatible endpoints over a :class:`~distill.serve.scheduler.Scheduler`.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with
``stream: true`` as server-sent events ending in ``data: [DONE]``), ``GET /v1/models``,
``POST /tokenize`` and ``POST /detokenize`` (vLLM's), ``GET /health`` and ``GET /metrics``
(Prometheus text format). With an API key, every route but ``/health`` and ``/metrics`` needs
``Authorization: Bearer KEY`` (401 otherwise): ``/v1/*`` as on vLLM's server, and also
``/tokenize``, ``/detokenize`` and ``/openapi.json``, which vLLM leaves open (they tell anyone
the model's tokenizer and the server's API); the two probes stay open for load balancers and
scrapers, as on vLLM. Errors are answered in OpenAI's
shape ``{"error": {"message", "type", "param", "code"}}``: 400 bad input,
401 bad key, 404 unknown model, 413 body over ``max_body_bytes`` (refused before it
is read), 500 a failure of this request in the engine, 503 queue full or shutting down.

Prompts are rendered and tokenized on a worker thread, not on the event loop, so a
large prompt never stalls other requests or ``/health``. A non-streaming request whose
client disconnects is cancelled at once (a task waits for the disconnect); a streaming
one when its response stream is closed. A request that fails after its stream started
gets an error event and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from distill.models import TEMPLATE_PARAMS
from distill.serve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from distill.serve.protocol import (ENGINE, FIELDS, APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   InvalidText, TokenizeRequest, new_id, now, usage)
from distill.serve.scheduler import Delta, Done, Failed, Job, QueueFull, Scheduler, Sequence, ShuttingDown
from distill.engine.logits import TokenLogprob
from distill.serve.text import StreamDecoder

log = logging.getLogger("distill.serve")
MIN_BODY_BYTES = 4 << 20  # the default body limit is the larger of this and BODY_BYTES_PER_TOKEN * the context
BODY_BYTES_PER_TOKEN = 64  # generous: a token's text, JSON-escaped, is rarely over 30 bytes


@dataclass
class AppSettings:
    """What the app needs besides the engine (derived from :class:`~distill.serve.config.ServeConfig`)."""

    model_name: str
    max_model_len: int
    stop_token_ids: tuple[int, ...]  # the model's EOS ids (distill.models.stop_token_ids)
    queue_size: int = 64
    max_batch: int = 8
    default_max_tokens: int | None = None  # max_tokens of requests that give none; None: the rest of the context
    api_key: str | None = None
    speculative: bool = False
    max_body_bytes: int | None = None  # None: default_body_limit(max_model_len)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # request fields' defaults (protocol.request_defaults)
    chat_template: str | None = None  # None: the tokenizer's own
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # defaults under each request's chat_template_kwargs
    model_root: str | None = None  # the model's folder, /v1/models' "root"

    def __post_init__(self) -> None:
        if self.max_body_bytes is None:
            self.max_body_bytes = default_body_limit(self.max_model_len)


def default_body_limit(max_model_len: int) -> int:
    """Request bodies up to this many bytes are read: a few MB, more for a context so long that
    a prompt filling it could need more."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


class _ChatShape:
    """The response schema of ``/v1/chat/completions`` (a message per choice; streamed as deltas after a role chunk)."""

    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def choice(index: int, text: str, finish_reason: str, logprobs: dict | None = None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": finish_reason}

    @staticmethod
    def opening(indices: list[int]) -> list[dict] | None:
        """The role chunk, sent with the first token (as vLLM does: a client timing the first chunk measures the prefill)."""
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None} for i in indices]

    @staticmethod
    def delta(index: int, text: str, logprobs: dict | None = None) -> dict:
        return {"index": index, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}

    @staticmethod
    def finish(index: int, finish_reason: str) -> dict:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason}

    @staticmethod
    def logprobs(tokenizer, entries: list, offset: int = 0) -> dict:
        """OpenAI's chat logprobs: per answer token its text, logprob, UTF-8 bytes and the top alternatives."""
        def one(token_id: int, logprob: float) -> dict:
            text = _token_text(tokenizer, token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]}


class _CompletionShape:
    """The response schema of ``/v1/completions`` (text per choice; streamed as text pieces, no opening chunk)."""

    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    @staticmethod
    def choice(index: int, text: str, finish_reason: str, logprobs: dict | None = None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    @staticmethod
    def opening(indices: list[int]) -> list[dict] | None:
        return None

    @staticmethod
    def delta(index: int, text: str, logprobs: dict | None = None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}

    @staticmethod
    def finish(index: int, finish_reason: str) -> dict:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason}

    @staticmethod
    def logprobs(tokenizer, entries: list, offset: int = 0) -> dict:
        """OpenAI's legacy completion logprobs: parallel lists over the tokens (with echo the prompt's first, whose
        first token has no logprob), ``text_offset`` counting characters of the returned text from ``offset``."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            text = _token_text(tokenizer, e.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append({_token_text(tokenizer, t): lp for t, lp in e.top} if e.logprob is not None else None)
            out["text_offset"].append(offset)
            offset += len(text)
        return out


class _Answer:
    """One choice's text and token logprobs not yet sent (streamed piece by piece, or taken whole at the end)."""

    def __init__(self, prompt_ids: list[int], echo: str):
        self.prompt_ids = prompt_ids
        self.parts: list[str] = [echo] if echo else []
        self.entries: list[TokenLogprob] = []
        self.offset = 0  # characters of token text already sent (completions' text_offset)

    def add(self, ev: Delta) -> None:
        self.parts.append(ev.text)
        if ev.prompt_logprobs is not None:  # the prompt's first token: nothing predicted it
            self.entries += [TokenLogprob(self.prompt_ids[0], None)] + list(ev.prompt_logprobs[1:])
        self.entries += ev.logprobs or []

    def pending(self) -> bool:
        return bool(self.parts or self.entries)

    def take(self) -> tuple[str, list[TokenLogprob]]:
        text, entries = "".join(self.parts), self.entries
        self.parts, self.entries = [], []
        return text, entries


class _Service:
    """What the endpoints do, over one scheduler: validate, tokenize, queue a job, answer it whole or streamed."""

    def __init__(self, engine, settings: AppSettings, metrics: ServerMetrics, scheduler: Scheduler):
        self.settings, self.metrics, self.scheduler = settings, metrics, scheduler
        self.tokenizer = engine.tokenizer
        self.vocab_size = len(engine.tokenizer)

    # -- a request becomes a job --------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        name = self.settings.model_name
        if model is not None and model != name:
            raise APIError(404, f"model '{model}' is not served here; this server serves '{name}'",
                           param="model", code="model_not_found")

    def check_common(self, req) -> None:
        self.check_model(req.model)
        bad = req.unsupported()
        if bad:
            raise APIError(400, f"not supported by this server: {', '.join(bad)}", param=bad[0])

    def make_params(self, req, prompt_len: int, index: int):
        from distill.engine import SamplingParams

        context = self.settings.max_model_len
        limit = req.token_limit()
        room = context - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is {context} tokens",
                           param="messages" if isinstance(req, ChatCompletionRequest) else "prompt", code="context_length_exceeded")
        defaults = self.settings.sampling_defaults
        if limit is None:  # vLLM's rule: the rest of the context, or less where the server sets a default
            fallback = self.settings.default_max_tokens or defaults.get("max_tokens")
            limit = min(fallback, room) if fallback else room
        elif limit > room:
            raise APIError(400, f"max_tokens={limit} plus the prompt's {prompt_len} tokens exceed this model's context of "
                           f"{context} tokens", param="max_tokens", code="context_length_exceeded")
        seed = None if req.seed is None else req.seed + index
        stop_ids = tuple(req.stop_token_ids or ()) + (() if req.ignore_eos else self.settings.stop_token_ids)
        extra = {**{k: v for k, v in defaults.items() if FIELDS[k].support == ENGINE}, **req.engine_fields()}
        if any(not (isinstance(t, int) and 0 <= t < self.vocab_size) for t in req.stop_token_ids or ()):
            raise APIError(400, f"stop_token_ids must be token ids in 0..{self.vocab_size - 1}", param="stop_token_ids")
        bias = extra.get("logit_bias") or {}
        if not isinstance(bias, dict) or any(not (isinstance(k, str) and k.lstrip("-").isdigit() and 0 <= int(k) < self.vocab_size)
                                             for k in bias):
            raise APIError(400, f"logit_bias keys must be token ids in 0..{self.vocab_size - 1}", param="logit_bias")
        try:
            return SamplingParams(max_tokens=limit, temperature=_given(req.temperature, defaults.get("temperature"), 1.0),
                                  top_p=_given(req.top_p, defaults.get("top_p"), 1.0), seed=seed, stop_token_ids=stop_ids,
                                  ignore_eos=req.ignore_eos, **extra)
        except (TypeError, ValueError) as exc:  # the engine's own check of a value (its message starts with the field's name)
            name = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=name if name in ("temperature", "top_p", *extra) else None) from None

    def make_job(self, req, prompts: list[list[int]]) -> Job:
        queue = self.settings.queue_size
        if len(prompts) * req.n > queue:
            raise APIError(400, f"{len(prompts) * req.n} choices exceed the server's queue of {queue}", param="n")
        seqs = []
        for p, ids in enumerate(prompts):
            for c in range(req.n):
                index = p * req.n + c
                decoder = StreamDecoder(self.tokenizer, req.stop_strings(), include_stop=req.include_stop_str_in_output,
                                        skip_special_tokens=req.skip_special_tokens)
                seqs.append(Sequence(index, ids, self.make_params(req, len(ids), index), decoder, n=req.n))
        job = Job(seqs, asyncio.get_running_loop(), prompt_tokens=sum(len(ids) for ids in prompts))
        try:
            self.scheduler.submit(job)
        except QueueFull as exc:
            self.metrics.rejected.inc()
            self.metrics.vllm.queue_full.inc()
            raise APIError(503, str(exc), type="server_overloaded", code="queue_full") from None
        except ShuttingDown as exc:
            raise APIError(503, str(exc), type="server_unavailable", code="shutting_down") from None
        return job

    async def tokenize(self, fn, *args):
        """``fn(*args)`` on a worker thread, off the event loop: prompts may take seconds to tokenize."""
        self.metrics.tokenizing.inc()
        try:
            return await asyncio.to_thread(fn, *args)
        finally:
            self.metrics.tokenizing.dec()

    # -- the endpoints ----------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, request: Request):
        self.check_common(req)
        ids = await self.tokenize(_chat_ids, _messages(req.messages), self.tokenizer, self.settings.chat_template,
                                  {**self.settings.chat_template_kwargs, **req.template_kwargs()}, req.add_special_tokens)
        return await self.respond(self.make_job(req, [ids]), req, request, _ChatShape)

    async def complete(self, req: CompletionRequest, request: Request):
        self.check_common(req)
        prompts = await self.tokenize(_prompt_ids, req.prompt, self.tokenizer, self.vocab_size, req.add_special_tokens)
        echo = None
        if req.echo:  # the prompt as given (text), or its ids' text
            given = [req.prompt] if isinstance(req.prompt, str) else req.prompt if isinstance(req.prompt[0], str) else None
            texts = given or [self.tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]
            echo = {p * req.n + c: texts[p] for p in range(len(prompts)) for c in range(req.n)}
        return await self.respond(self.make_job(req, prompts), req, request, _CompletionShape, echo)

    async def tokens(self, req: TokenizeRequest) -> dict:
        """vLLM's ``/tokenize``: a prompt's or a chat's token ids, as a generation request would see them."""
        self.check_model(req.model)
        bad = req.unsupported()
        if bad:
            raise APIError(400, f"not supported by this server: {', '.join(bad)}", param=bad[0])
        if req.messages is not None:
            ids = await self.tokenize(_chat_ids, _messages(req.messages), self.tokenizer, self.settings.chat_template,
                                      {**self.settings.chat_template_kwargs, **req.template_kwargs()},
                                      bool(req.add_special_tokens))
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await self.tokenize(lambda: list(self.tokenizer(req.prompt, add_special_tokens=add)["input_ids"]))
        out = {"count": len(ids), "max_model_len": self.settings.max_model_len, "tokens": ids, "token_strs": None}
        if req.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return out

    async def text(self, req: DetokenizeRequest) -> dict:
        """vLLM's ``/detokenize``: token ids back to text (special tokens kept: the text the ids stand for)."""
        self.check_model(req.model)
        if any(not 0 <= t < self.vocab_size for t in req.tokens):
            raise APIError(400, f"token ids must be in 0..{self.vocab_size - 1}", param="tokens")
        return {"prompt": await self.tokenize(lambda: self.tokenizer.decode(req.tokens))}

    # -- answering a job ----------------------------------------------------------------------
    async def respond(self, job: Job, req, request: Request, shape, echo: dict[int, str] | None = None):
        """``echo``: per choice index, the prompt text its answer starts with (completions' ``echo``)."""
        rid = f"{shape.id_prefix}-{req.request_id}" if req.request_id else new_id(shape.id_prefix)
        created = now()
        answers = {s.index: _Answer(s.prompt_ids, (echo or {}).get(s.index, "")) for s in job.sequences}
        with_logprobs = bool(req.logprob_fields())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self.sse(job, rid, created, shape, include_usage, answers, with_logprobs),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        done: dict[int, Done] = {}
        gone = asyncio.create_task(_disconnected(request))  # the client hanging up cancels the job at once
        gone.add_done_callback(lambda task: task.cancelled() or job.cancel())
        try:
            while len(done) < len(job.sequences):
                ev = await job.events.get()
                if isinstance(ev, Delta):
                    answers[ev.index].add(ev)
                elif isinstance(ev, Done):
                    done[ev.index] = ev
                elif isinstance(ev, Failed):
                    raise _failed_error(ev)
        finally:
            gone.cancel()
            if len(done) < len(job.sequences):
                job.cancel()
        if job.cancelled.is_set():
            return Response(status_code=499)  # nobody is listening (nginx's "client closed request")
        self.record(job)
        choices = []
        for i in sorted(done):
            a = answers[i]
            text, entries = a.take()
            choices.append(shape.choice(i, text, done[i].finish_reason,
                                        shape.logprobs(self.tokenizer, entries) if with_logprobs else None))
        return {"id": rid, "object": shape.object, "created": created, "model": self.settings.model_name, "choices": choices,
                "usage": usage(job.prompt_tokens, sum(d.completion_tokens for d in done.values()))}

    async def sse(self, job: Job, rid: str, created: int, shape, include_usage: bool, answers: dict[int, "_Answer"],
                  with_logprobs: bool) -> AsyncIterator[str]:
        n = len(job.sequences)
        done: dict[int, Done] = {}

        def chunk(choices: list[dict], **extra) -> str:
            body = {"id": rid, "object": shape.chunk_object, "created": created, "model": self.settings.model_name,
                    "choices": choices, **extra}
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        def delta(index: int) -> str:
            a = answers[index]
            start = a.offset
            text, entries = a.take()
            lp = shape.logprobs(self.tokenizer, entries, start) if with_logprobs else None
            a.offset += sum(len(_token_text(self.tokenizer, e.token_id)) for e in entries)
            return chunk([shape.delta(index, text, lp)])

        try:
            opening = shape.opening([s.index for s in job.sequences])
            while len(done) < n:
                ev = await job.events.get()
                if opening is not None and not isinstance(ev, Failed):
                    yield chunk(opening)
                    opening = None
                if isinstance(ev, Delta):
                    answers[ev.index].add(ev)
                    yield delta(ev.index)
                elif isinstance(ev, Done):
                    done[ev.index] = ev
                    if answers[ev.index].pending():  # an echo whose answer has no token
                        yield delta(ev.index)
                    yield chunk([shape.finish(ev.index, ev.finish_reason)])
                elif isinstance(ev, Failed):
                    yield f"data: {json.dumps(_failed_error(ev).body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
            self.record(job)
            if include_usage:
                yield chunk([], usage=usage(job.prompt_tokens, sum(d.completion_tokens for d in done.values())))
            yield "data: [DONE]\n\n"
        finally:  # client disconnect cancels the generator: cancel the job's sequences too
            if len(done) < n:
                job.cancel()

    def record(self, job: Job) -> None:
        self.metrics.request_latency.observe(time.monotonic() - job.arrived)
        self.metrics.prompt_tokens.inc(job.prompt_tokens)


def create_app(engine, settings: AppSettings, worker_thread: bool = True) -> FastAPI:
    """An app serving ``engine``: the routes, error handlers and middleware around a :class:`_Service`.

    ``worker_thread``: the app's lifespan starts the scheduler's worker on a thread of its
    own; False leaves it to the caller (``app.state.scheduler.run()``, as ``distill serve``
    does on the main thread). Either way the lifespan's end stops it.
    """
    metrics = ServerMetrics(settings.model_name, settings.speculative, settings.max_model_len)
    proposer = getattr(engine, "proposer", None)
    metrics.proposer.labels(proposer.name if proposer is not None and settings.speculative else "none").set(1)
    store = getattr(proposer, "datastore", None)
    metrics.datastore_tokens.set(store.generated_tokens if store is not None else 0)
    history = getattr(proposer, "history", None)
    if history is not None and settings.speculative:  # read at each scrape: the worker thread adds replies
        metrics.history_tokens.set_function(lambda: history.tokens)
    scheduler = Scheduler(engine, queue_size=settings.queue_size, max_batch=settings.max_batch,
                          speculative=settings.speculative, metrics=metrics)
    service = _Service(engine, settings, metrics, scheduler)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if worker_thread:
            scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="distill serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.settings = settings

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """Starlette's own errors (a body that is not UTF-8 JSON, an unknown route or method) in the same error shape."""
        message = BODY_UNREADABLE if exc.detail == "There was an error parsing the body" else str(exc.detail)
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if isinstance(bad := (first.get("ctx") or {}).get("error"), InvalidText):  # a whole-body check: names its field
            return JSONResponse(APIError(400, str(bad), param=bad.param).body(), status_code=400)
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = first.get("msg", "invalid request")
        return JSONResponse(APIError(400, f"{loc}: {msg}" if loc else msg, param=loc or None).body(), status_code=400)

    app.add_middleware(_Gate, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes, metrics=metrics)

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            detail = scheduler.error or ("draining: finishing admitted requests" if scheduler.draining else "shutting down")
            return JSONResponse({"status": "error", "detail": detail}, status_code=503)
        return {"status": "ok", "model": settings.model_name, "speculative": settings.speculative}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        permission = {"id": f"modelperm-{settings.model_name}", "object": "model_permission", "created": _STARTED,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                      "group": None, "is_blocking": False}
        card = {"id": settings.model_name, "object": "model", "created": _STARTED, "owned_by": "distill",
                "root": settings.model_root or settings.model_name, "parent": None, "max_model_len": settings.max_model_len,
                "permission": [permission]}
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        return await service.tokens(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return await service.text(req)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await service.chat(req, request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await service.complete(req, request)

    return app


class _Gate:
    """Pure ASGI middleware (a ``BaseHTTPMiddleware`` would hide client disconnects from streaming responses):
    checks the bearer key on every route but :data:`OPEN_ROUTES`, refuses a body over ``max_body_bytes``
    with 413 before it is read or parsed (by its Content-Length, or while reading a body sent without
    one), and counts requests by endpoint and status."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics):
        self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in _ENDPOINTS else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        headers = dict(scope["headers"])
        if self.api_key is not None and path not in OPEN_ROUTES:
            header = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                err = APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                               type="authentication_error", code="invalid_api_key")
                return await JSONResponse(err.body(), status_code=401)(scope, receive, counting_send)
        length = headers.get(b"content-length")
        too_big = length is not None and length.isdigit() and int(length) > self.max_body_bytes
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):
            messages = await _read_body(receive, self.max_body_bytes)
            too_big = messages is None
            receive = _replay(messages or [], receive)
        if too_big:
            err = APIError(413, f"the request body exceeds this server's limit of {self.max_body_bytes} bytes (--max-body-bytes)",
                           code="request_too_large")
            return await JSONResponse(err.body(), status_code=413, headers={"Connection": "close"})(scope, receive, counting_send)
        await self.app(scope, receive, counting_send)


async def _read_body(receive, limit: int) -> list[dict] | None:
    """The body's messages, read to the end; None as soon as they exceed ``limit`` bytes."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages
        size += len(message.get("body", b""))
        if size > limit:
            return None
        if not message.get("more_body", False):
            return messages


def _replay(messages: list[dict], receive):
    """A receive that gives ``messages`` first, then what ``receive`` gives (e.g. the disconnect)."""
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()

    return replayed


async def _disconnected(request: Request) -> None:
    """Returns when the client has disconnected (the request body already read), or the connection failed."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a broken connection is a gone client too
        pass


def _failed_error(ev: Failed) -> APIError:
    if ev.status == 503:
        return APIError(503, ev.message, type="server_unavailable", code="shutting_down")
    return APIError(ev.status, ev.message, type="server_error" if ev.status >= 500 else "invalid_request_error")


_STARTED = now()
_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health", "/metrics"}
#: The routes answered without the API key (the module docstring says why).
OPEN_ROUTES = frozenset({"/health", "/metrics"})
#: What a request whose body FastAPI could not parse (bytes that are not UTF-8, say) is told.
BODY_UNREADABLE = "the request body could not be read: send JSON encoded as UTF-8"


def _given(*values):
    """The first value that is not None."""
    return next(v for v in values if v is not None)


def _messages(messages) -> list[dict]:
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


def _chat_ids(messages: list[dict], tokenizer, template: str | None, kwargs: dict, add_special_tokens: bool) -> list[int]:
    """Messages -> prompt token ids through the chat template (``template``, else the model's), with the
    template's extra variables ``kwargs`` (400 when the template refuses them)."""
    clash = sorted(TEMPLATE_PARAMS & set(kwargs))
    if clash:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(clash)}", param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the template's own complaint (e.g. roles must alternate)
        raise APIError(400, f"the model's chat template rejects these messages: {exc}", param="messages") from None
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _prompt_ids(prompt: Any, tokenizer, vocab_size: int, add_special_tokens: bool = True) -> list[list[int]]:
    """A completions ``prompt`` (str, list of str, token ids, list of token id lists) -> token id lists."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        prompts = [list(prompt)]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt is empty", param="prompt")
    out = []
    for p in prompts:
        ids = list(tokenizer(p, add_special_tokens=add_special_tokens)["input_ids"]) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "prompt is empty", param="prompt")
        if any(not 0 <= t < vocab_size for t in ids):
            raise APIError(400, f"prompt token ids must be in 0..{vocab_size - 1}", param="prompt")
        out.append(ids)
    return out
