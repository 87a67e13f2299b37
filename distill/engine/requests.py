"""What a request asks of the engine and what it gets back: :class:`SamplingParams`, :class:`GenerationResult`,
:class:`StepStats`, and the running :class:`Sequence` of one request."""

from __future__ import annotations

import math
import numbers
import secrets
from dataclasses import dataclass, field
from typing import Callable

import torch

from distill.engine.logits import RowContext, TokenLogprob
from distill.errors import ConfigError

#: The largest token id, count (top_k, max_tokens, logprobs) SamplingParams takes: int32's, far beyond any vocabulary.
MAX_TOKEN_ID = 2**31 - 1


@dataclass
class SamplingParams:
    """Per request. The fields and their meanings are vLLM's (:mod:`distill.engine.logits` for the order they
    apply in); every one of them keeps speculative decoding lossless."""

    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # per-request torch.Generator seed (None: a random one)
    stop_token_ids: tuple[int, ...] = ()  # the engine always also stops at the tokenizer's eos (unless ignore_eos)
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages every token of the prompt and the output so far
    frequency_penalty: float = 0.0  # minus this times the token's count in the output so far
    presence_penalty: float = 0.0  # minus this once the token is in the output
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to +-100)
    min_tokens: int = 0  # stop tokens are held back until this many tokens are out
    ignore_eos: bool = False  # eos does not stop (stop_token_ids still do)
    logprobs: int | None = None  # each emitted token's raw logprob and this many top alternatives (0: the token's only)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (GenerationResult.prompt_logprobs)

    def __post_init__(self) -> None:
        """Every field's type and range (each error names its field): nothing that reaches the engine can
        overflow its tensors or turn its logits into NaN."""
        _integer("max_tokens", self.max_tokens, 1, MAX_TOKEN_ID)
        _number("temperature", self.temperature, 0.0, math.inf)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _integer("top_k", self.top_k, -1, MAX_TOKEN_ID, f"-1 or 0 (all tokens) or a count up to {MAX_TOKEN_ID}")
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _integer("min_tokens", self.min_tokens, 0, self.max_tokens, f"in [0, max_tokens={self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _integer(name, getattr(self, name), 0, MAX_TOKEN_ID)
        try:
            self.stop_token_ids = tuple(self.stop_token_ids)
        except TypeError:
            raise ConfigError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r:.80}") from None
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t, 0, MAX_TOKEN_ID, f"token ids in [0, {MAX_TOKEN_ID}]")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (AttributeError, TypeError, ValueError):
                raise ConfigError(f"logit_bias maps token ids to numbers, got {self.logit_bias!r:.80}") from None
            for k, v in self.logit_bias.items():
                _integer("logit_bias", k, 0, MAX_TOKEN_ID, f"keyed by token ids in [0, {MAX_TOKEN_ID}]")
                if not math.isfinite(v):
                    raise ConfigError(f"logit_bias values must be finite numbers, got {v!r} for token {k}")


def _integer(name: str, value, low: int, high: int, what: str | None = None) -> None:
    """Raises ConfigError naming ``name`` unless ``value`` is an integer (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise ConfigError(f"{name} must be {what or f'an integer in [{low}, {high}]'}, got {value!r:.80}")


def _number(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    """Raises ConfigError naming ``name`` unless ``value`` is a finite number (not a bool) in [low, high]
    (``(low, high]`` with ``low_open``)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or not low <= value <= high or (low_open and value == low)):
        if math.isinf(high):
            bounds = f"a finite number {'>' if low_open else '>='} {low:g}"
        else:
            bounds = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"
        raise ConfigError(f"{name} must be {bounds}, got {value!r:.80}")


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens only (no prompt, no stop token)
    finish_reason: str  # "stop" (eos / stop token), "length", or "cancelled"
    steps: int  # decoding steps (forward passes after the prefill) this sequence took part in
    accepted: list[int]  # tokens emitted per step (acceleration rate = mean)
    logprobs: list[TokenLogprob] | None = None  # per token of token_ids (SamplingParams.logprobs set)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token, None for the first (prompt_logprobs set)


@dataclass
class StepStats:
    """Per generate() call."""

    steps: int = 0  # forward passes after the prefill(s)
    tokens: int = 0  # tokens emitted in all (all sequences)
    step_seconds: list[float] = field(default_factory=list)
    prefill_seconds: float = 0.0
    batch_size: int = 0  # largest batch run at once
    tree_nodes: int = 0  # largest tree used (0: plain decoding throughout)
    tree_nodes_per_step: list[int] = field(default_factory=list)
    accepted_per_step: list[list[int]] = field(default_factory=list)  # per step, each row's accepted speculated nodes
    drafted_per_step: list[list[int]] = field(default_factory=list)  # per step, each row's drafted nodes (a chain's own)
    joined_per_step: list[int] = field(default_factory=list)  # per step, the prompt tokens it prefilled and their first tokens
    prefill_tokens: list[int] = field(default_factory=list)  # per prefill forward, its prompts' tokens and first tokens
    kv_bytes: int = 0  # largest KV cache (slot cache storage) held at once


class Sequence:
    """One request's progress: its tokens so far, its logprobs, its generator, why it finished."""

    def __init__(self, index: int, params: SamplingParams, stop: set[int], device: torch.device, prompt: list[int]):
        self.index = index
        self.params = params
        self.prompt = prompt
        self.stop = (set() if params.ignore_eos else stop) | set(params.stop_token_ids)
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.accepted: list[int] = []
        self.steps = 0
        self.finish: str | None = None
        self.generator: torch.Generator | None = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))

    def emit(self, new: list[int], on_tokens: Callable[..., bool] | None, logprobs: list[TokenLogprob] | None = None) -> None:
        """Append ``new`` up to a stop token or max_tokens; tell the callback; set finish.

        ``logprobs``: one per token of ``new`` (when the params ask for them); the callback gets
        those of the tokens taken as ``logprobs=``, and with the first tokens the prompt's as
        ``prompt_logprobs=`` (when asked for).
        """
        taken: list[int] = []
        for tok in new:
            if tok in self.stop:
                self.finish = "stop"
                break
            taken.append(tok)
            if len(self.tokens) + len(taken) >= self.params.max_tokens:
                self.finish = "length"
                break
        self.tokens.extend(taken)
        extra = {}
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.extend(logprobs[: len(taken)])
            extra["logprobs"] = logprobs[: len(taken)]
        if self.prompt_logprobs is not None and len(self.tokens) == len(taken):  # the first tokens: the prompt's too
            extra["prompt_logprobs"] = self.prompt_logprobs
        if taken and on_tokens is not None and on_tokens(self.index, taken, **extra) is False:
            self.finish = "cancelled"

    def context(self) -> RowContext:
        return RowContext(self.params, self.prompt, self.tokens, self.stop)

    def result(self) -> GenerationResult:
        return GenerationResult(list(self.tokens), self.finish or "length", self.steps, list(self.accepted),
                                self.logprobs, self.prompt_logprobs)


__all__ = ["MAX_TOKEN_ID", "GenerationResult", "SamplingParams", "Sequence", "StepStats"]
