"""Request and response bodies of the OpenAI-compatible API (the subset ``distill serve`` implements).

Fields the server cannot honour (tools, logprobs, penalties, logit bias, JSON
mode) are rejected with HTTP 400 naming the field, never silently ignored.
Unknown extra fields are ignored, as OpenAI's own server does for forward compatibility.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 16
#: ``seed``: a signed 64-bit integer, as OpenAI's API has it; choice i of ``n`` uses seed + i,
#: which stays within the engine's generator range (-2**63 .. 2**64 - 1).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: below this a temperature or top_p underflows the engine's float32 sampling (NaN
#: probabilities): 0 < value < 1e-5 is refused (temperature 0 means greedy).
MIN_SAMPLING_VALUE = 1e-5


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status (raised by the request handlers)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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


class _Sampling(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, v):
        if 0 < v < MIN_SAMPLING_VALUE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_SAMPLING_VALUE}")
        return v

    @field_validator("top_p")
    @classmethod
    def _check_top_p(cls, v):
        if v < MIN_SAMPLING_VALUE:
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

    def unsupported(self) -> list[str]:
        """Names of given fields this server cannot honour."""
        bad = []
        if self.presence_penalty:
            bad.append("presence_penalty")
        if self.frequency_penalty:
            bad.append("frequency_penalty")
        if self.logit_bias:
            bad.append("logit_bias")
        return bad

    def stop_strings(self) -> list[str]:
        return list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.logprobs:
            bad.append("logprobs")
        if self.top_logprobs:
            bad.append("top_logprobs")
        if self.tools:
            bad.append("tools")
        if self.tool_choice not in (None, "none"):
            bad.append("tool_choice")
        if self.response_format not in (None, {"type": "text"}):
            bad.append("response_format")
        return bad

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(default=16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.logprobs is not None:
            bad.append("logprobs")
        if self.suffix:
            bad.append("suffix")
        if self.best_of not in (None, 1):
            bad.append("best_of")
        if self.echo:
            bad.append("echo")
        return bad

    def token_limit(self) -> int | None:
        return self.max_tokens


# -- responses ----------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
