"""Request and response bodies of the OpenAI-compatible API, with vLLM's extra request fields.

Every request field vLLM's OpenAI server (the installed version's ``ChatCompletionRequest`` and
``CompletionRequest``) accepts is in :data:`FIELDS`, with what this server does with it:

honoured
    declared on the request models below and applied (``stop_token_ids``, ``ignore_eos``,
    ``chat_template_kwargs``, ...).
engine
    passed to :class:`distill.engine.SamplingParams` under its own name when given (vLLM's
    sampling fields: ``top_k``, ``min_p``, the penalties, ``logit_bias``, ``min_tokens``), which
    applies them at every tree node so speculation stays lossless.
refused
    answered with HTTP 400 naming the field, unless absent or set to one of its neutral
    values (``top_k`` -1 or 0, ``min_p`` 0, ``repetition_penalty`` 1, ``logprobs`` false, ...),
    which change nothing and are accepted.
ignored
    accepted with no effect, as vLLM itself does (``user``), or because it only matters
    together with a refused field (``truncation_side`` without ``truncate_prompt_tokens``).

A key that is no vLLM field either is ignored (logged at debug level), as vLLM's server
does (its request models allow extra fields and drop them): clients written against a
newer OpenAI API keep working.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

log = logging.getLogger("distill.serve")

MAX_STOP_STRINGS = 16
#: most alternatives a token's logprobs may list (vLLM's default --max-logprobs is 20; OpenAI's top_logprobs allows 20)
MAX_LOGPROBS = 20
#: ``seed``: a signed 64-bit integer, as OpenAI's API has it; choice i of ``n`` uses seed + i,
#: which stays within the engine's generator range (-2**63 .. 2**64 - 1).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: below this a temperature or top_p underflows the engine's float32 sampling (NaN
#: probabilities): 0 < value < 1e-5 is refused (temperature 0 means greedy).
MIN_SAMPLING_VALUE = 1e-5

HONOURED, ENGINE, REFUSED, IGNORED = "honoured", "engine", "refused", "ignored"


@dataclass(frozen=True)
class Rule:
    """What the server does with one request field (terms in the module docstring)."""

    support: str
    neutral: tuple = (None,)  # refused: the values accepted as no-ops (None = absent)
    only: str | None = None  # "chat" or "completions": the field exists on that endpoint only


def _refused(*neutral, only: str | None = None) -> Rule:
    return Rule(REFUSED, (None, *neutral), only)


_DONE, _IGNORED, _ENGINE = Rule(HONOURED), Rule(IGNORED), Rule(ENGINE)
_CHAT, _COMPLETIONS = "chat", "completions"

#: Every field of vLLM's chat and text completion requests (and OpenAI's ``best_of``): the one table.
FIELDS: dict[str, Rule] = {
    # -- OpenAI's fields
    "model": _DONE, "messages": Rule(HONOURED, only=_CHAT), "prompt": Rule(HONOURED, only=_COMPLETIONS),
    "max_tokens": _DONE, "max_completion_tokens": Rule(HONOURED, only=_CHAT), "n": _DONE, "seed": _DONE,
    "stop": _DONE, "stream": _DONE, "stream_options": _DONE, "temperature": _DONE, "top_p": _DONE,
    "user": _IGNORED,  # vLLM ignores it too
    "frequency_penalty": _ENGINE, "presence_penalty": _ENGINE, "logit_bias": _ENGINE,
    "logprobs": _DONE,  # chat: a bool; completions: an int (0 asks for the sampled token's logprob only)
    "top_logprobs": Rule(HONOURED, only=_CHAT),
    "response_format": _refused({"type": "text"}),
    "tools": _refused([], only=_CHAT), "tool_choice": _refused("none", only=_CHAT),
    "parallel_tool_calls": Rule(IGNORED, only=_CHAT),  # no tools are taken, so there are none to call in parallel
    "echo": _refused(False),  # chat (prepend the last message): refused; completions declare it (prompt text + logprobs)
    "suffix": _refused("", only=_COMPLETIONS), "best_of": _refused(1, only=_COMPLETIONS),
    # -- vLLM's sampling fields
    "top_k": _ENGINE, "min_p": _ENGINE, "repetition_penalty": _ENGINE,
    "min_tokens": _ENGINE, "use_beam_search": _refused(False), "length_penalty": _refused(1),
    "watermarking": _refused(False), "prompt_logprobs": _refused(), "logprob_token_ids": _refused([]),
    "allowed_token_ids": _refused(), "bad_words": _refused([]), "truncate_prompt_tokens": _refused(),
    "truncation_side": _IGNORED,  # only with truncate_prompt_tokens
    "return_tokens_as_token_ids": _refused(False),  # only with logprobs
    "stop_token_ids": _DONE, "ignore_eos": _DONE, "include_stop_str_in_output": _DONE, "skip_special_tokens": _DONE,
    "spaces_between_special_tokens": _refused(True),
    "thinking_token_budget": _refused(), "repetition_detection": _refused(), "structured_outputs": _refused(),
    "stream_interval": _refused(1),
    # -- vLLM's chat template and prompt fields
    "add_special_tokens": _DONE, "chat_template_kwargs": Rule(HONOURED, only=_CHAT),
    "add_generation_prompt": Rule(HONOURED, only=_CHAT), "continue_final_message": Rule(HONOURED, only=_CHAT),
    "documents": Rule(HONOURED, only=_CHAT), "reasoning_effort": Rule(HONOURED, only=_CHAT),
    "chat_template": _refused(only=_CHAT),  # vLLM too refuses it unless started with --trust-request-chat-template
    "include_reasoning": _refused(True, only=_CHAT),  # no reasoning parser: the reasoning is in the content
    "prompt_embeds": _refused(only=_COMPLETIONS),
    "media_io_kwargs": _refused({}, only=_CHAT), "mm_processor_kwargs": _refused({}, only=_CHAT),
    # -- vLLM's serving fields
    "request_id": _DONE, "session_id": _IGNORED,  # a routing key: one server, nothing to route
    "priority": _refused(0), "return_token_ids": _refused(False), "return_prompt_text": _refused(False, only=_CHAT),
    "cache_salt": _IGNORED,  # salts a prefix cache: there is none to share between requests here
    "kv_transfer_params": _refused(), "ec_transfer_params": _refused(), "vllm_xargs": _refused({}),
    "routed_experts_prompt_start": _refused(0),
    "return_token_offsets": _IGNORED, "mm_payload": _IGNORED, "return_mm_kwargs": _IGNORED,  # vLLM's render endpoints only
}


@functools.cache
def fields_of(endpoint: str) -> dict[str, Rule]:
    """The table's rows that apply to ``endpoint`` ("chat" or "completions")."""
    return {name: rule for name, rule in FIELDS.items() if rule.only in (None, endpoint)}


def is_neutral(rule: Rule, value: Any) -> bool:
    """Whether ``value`` is one of the rule's no-op values (a bool matches bools only: ``true`` is not 1)."""
    return any(value is None if n is None else (isinstance(value, bool) == isinstance(n, bool) and value == n)
               for n in rule.neutral)


def refused(extras: dict[str, Any], endpoint: str) -> list[str]:
    """The fields among a request's ``extras`` the table refuses on ``endpoint`` and that are set to a non-neutral value."""
    rules = fields_of(endpoint)
    return [name for name, value in extras.items()
            if name in rules and rules[name].support == REFUSED and not is_neutral(rules[name], value)]


#: generation_config.json keys that are request defaults (the ones vLLM reads), and the request field each sets.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                          "frequency_penalty": "frequency_penalty", "max_new_tokens": "max_tokens"}


def request_defaults(generation_config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model's generation config -> (the request defaults this server applies, the ones it cannot honour).

    Applied: the sampling fields the server or the engine honours, and ``max_new_tokens`` as the
    default ``max_tokens``. Not honoured: a refused field set to other than its neutral value
    (e.g. ``top_k: 50``); requests that omit it decode without it (the caller says so once).
    """
    applied, unhonoured = {}, {}
    for key, name in GENERATION_CONFIG_KEYS.items():
        value = generation_config.get(key)
        if value is None:
            continue
        rule = FIELDS[name]
        if rule.support in (HONOURED, ENGINE):
            applied[name] = value
        elif not is_neutral(rule, value):
            unhonoured[name] = value
    return applied, unhonoured


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status (raised by the request handlers)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidText(ValueError):
    """A request string UTF-8 cannot encode (a lone surrogate, which JSON's ``\\ud800`` escape can carry): no tokenizer
    takes it, so it is a 400 naming the field (``param``), not a failure deep in tokenizing or in writing the answer."""

    def __init__(self, param: str):
        super().__init__(f"{param}: not valid Unicode text (it holds a lone surrogate, which UTF-8 cannot encode)")
        self.param = param


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _first_invalid_text(value: Any) -> str | None:
    """The dotted path (as the other 400s name fields) of the first string in ``value``, a key or a value, that UTF-8
    cannot encode, or None. Walked with a stack, not recursion: a body nested as deep as JSON allows is no 500."""
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, str):
            if not _encodes(item):
                return path or "body"
        elif isinstance(item, (dict, list, tuple)):
            pairs = list(item.items() if isinstance(item, dict) else enumerate(item))
            for key, _ in pairs:  # a bad key is named by the object that holds it (the key cannot be echoed)
                if isinstance(key, str) and not _encodes(key):
                    return path or "body"
            todo += [(f"{path}.{key}" if path else str(key), child) for key, child in reversed(pairs)]  # popped in order
    return None


class _Request(BaseModel):
    """A request body: every string in it, keys included, must be valid Unicode (see :class:`InvalidText`)."""

    @model_validator(mode="before")
    @classmethod
    def _check_text(cls, data):
        if (bad := _first_invalid_text(data)) is not None:
            raise InvalidText(bad)
        return data


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (refused when true)


class _Sampling(_Request):
    """Fields shared by chat and text completions (the honoured ones; the rest of :data:`FIELDS` arrive as extras)."""

    model_config = ConfigDict(extra="allow")
    endpoint: ClassVar[str] = ""
    model: Optional[str] = None  # None: the served model (as vLLM)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)  # None: the server's default (generation config, else 1)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop_token_ids: Optional[list[int]] = None  # besides the model's EOS ids (only these with ignore_eos)
    ignore_eos: bool = False  # the model's EOS ids do not end the answer (stop_token_ids and stop strings still do)
    include_stop_str_in_output: bool = False  # the stop string that ended the answer stays in its text
    skip_special_tokens: bool = True  # special tokens' text is left out of the answer
    request_id: Optional[str] = Field(default=None, min_length=1, max_length=256)  # the response's id is <prefix>-<request_id>

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, v):
        if v is not None and 0 < v < MIN_SAMPLING_VALUE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_SAMPLING_VALUE}")
        return v

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, v):
        if v is not None and v < MIN_SAMPLING_VALUE:
            raise ValueError(f"top_p must be at least {MIN_SAMPLING_VALUE}")
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @model_validator(mode="after")
    def _log_unknown(self):
        unknown = sorted(set(self.model_extra or {}) - set(fields_of(self.endpoint)))
        if unknown:
            log.debug("request fields ignored (neither OpenAI's nor vLLM's): %s", ", ".join(unknown))
        return self

    def unsupported(self) -> list[str]:
        """Names of given fields this server cannot honour (set to something other than a neutral value)."""
        bad = refused(self.model_extra or {}, self.endpoint)
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            bad.append("stream_options.continuous_usage_stats")
        return bad

    def engine_fields(self) -> dict[str, Any]:
        """The given fields the table marks ``engine``: passed to SamplingParams as they are (the engine checks them),
        and the logprobs asked for (:meth:`logprob_fields`)."""
        rules = fields_of(self.endpoint)
        given = {name: value for name, value in (self.model_extra or {}).items()
                 if name in rules and rules[name].support == ENGINE and value is not None}
        return {**given, **self.logprob_fields()}

    def logprob_fields(self) -> dict[str, Any]:
        return {}

    def stop_strings(self) -> list[str]:
        return list(self.stop or [])


def _settle_generation_prompt(req) -> None:
    """vLLM's rule: ``continue_final_message`` leaves the last turn open, so no generation prompt (both true is an error)."""
    if req.continue_final_message:
        if req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        req.add_generation_prompt = False


class ChatCompletionRequest(_Sampling):
    endpoint: ClassVar[str] = _CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False  # each answer token's logprob (choice.logprobs.content)
    top_logprobs: int = Field(default=0, ge=0, le=MAX_LOGPROBS)  # and this many most likely alternatives
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    add_special_tokens: bool = False  # on top of what the chat template writes (vLLM's default for chat)
    chat_template_kwargs: Optional[dict[str, Any]] = None  # extra variables for the chat template (e.g. enable_thinking)
    documents: Optional[list[dict[str, str]]] = None  # the chat template's `documents` (RAG templates)
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None

    @model_validator(mode="after")
    def _check_generation_prompt(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        _settle_generation_prompt(self)
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables: ``chat_template_kwargs``, under the request's own fields (as vLLM merges them)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        if self.documents is not None:
            kwargs["documents"] = self.documents
        kwargs["add_generation_prompt"] = self.add_generation_prompt
        kwargs["continue_final_message"] = self.continue_final_message
        return kwargs

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_fields(self) -> dict[str, Any]:
        return {"logprobs": self.top_logprobs} if self.logprobs else {}


class CompletionRequest(_Sampling):
    endpoint: ClassVar[str] = _COMPLETIONS
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(default=16, ge=1)  # OpenAI's and vLLM's default for completions
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)  # each token's logprob and this many alternatives
    echo: bool = False  # the prompt's text before the answer (and, with logprobs, its tokens' logprobs: lm-eval's log-likelihood)

    def logprob_fields(self) -> dict[str, Any]:
        if self.logprobs is None:
            return {}
        return {"logprobs": self.logprobs, **({"prompt_logprobs": self.logprobs} if self.echo else {})}
    add_special_tokens: bool = True  # e.g. BOS before a text prompt, as the tokenizer adds it (vLLM's default)

    def token_limit(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(_Request):
    """``POST /tokenize``: a text ``prompt``, or chat ``messages`` rendered by the chat template (vLLM's two forms)."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        _settle_generation_prompt(self)
        return self

    def template_kwargs(self) -> dict[str, Any]:
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    def unsupported(self) -> list[str]:
        """vLLM's other /tokenize fields (``tools``, ``chat_template``, ...): refused as on /v1/chat/completions."""
        return refused(self.model_extra or {}, _CHAT)


class DetokenizeRequest(_Request):
    """``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    tokens: list[int]


# -- responses ----------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
