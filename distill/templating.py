"""Chat templates joined at the token level.

Terms
-----
token stream
    the ``input_ids`` of one row: the first prompt, then for each turn the tokens the
    teacher generated, the template tokens that close the assistant turn, and the
    template tokens of the next user turn plus the assistant header.
stream text
    the text a token stream stands for: the rendered prompt, each generated turn decoded
    with its special tokens (the stop token included), the closing text and the deltas.
delta
    what the chat template adds after the stream text: render(history + new user
    message, generation prompt) minus the stream text, when the stream text is a prefix
    of that rendering. Only deltas are tokenized; tokens already in the stream are never
    re-tokenized, so the stored ids are exactly what the teacher saw.
re-rendered history
    a template that renders earlier turns differently from how the model saw and wrote
    them: a Qwen3-style template drops the ``<think>`` blocks of earlier replies; a reply
    that ended on a stop token other than the template's end of turn reads differently
    too. Then the stream text is no prefix of the next prompt and there is no delta
    (:meth:`ChatFormat.delta` returns None): the next turn's prompt is the whole rendering,
    tokenized, and starts a new row (``distill.generate.runner``).
assistant suffix
    the text the template puts after an assistant message's content (ChatML:
    ``<|im_end|>\\n``). When the teacher stopped on a stop token whose text begins
    the suffix, only the rest (``\\n``) is appended; a turn cut by the length limit
    gets the whole suffix (marked not-generated).
reply prefix
    text the generation prompt puts into the assistant's turn beyond the header the
    template writes for an assistant message in history: Qwen3's empty
    ``<think>\\n\\n</think>\\n\\n`` with ``enable_thinking: false``, or the ``<think>\\n``
    of templates that open the think block for the model. It is in the prompt tokens (not
    generated) and begins the reply's message content, so the content is the whole turn.
think block
    ``<think>`` ... ``</think>``: a reasoning model's reasoning inside its reply
    (:func:`strip_reasoning` removes it).
"""

from __future__ import annotations

from distill.errors import TemplateError, check_choice

_SENTINEL_USER = "\u2063distill-user\u2063"
_SENTINEL_ASSISTANT = "\u2063distill-assistant\u2063"
_SENTINEL_NEXT = "\u2063distill-next\u2063"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: ``--reasoning``: what the stored ``messages`` keep of think blocks (see :func:`reasoning_view`).
REASONING = ("keep", "strip", "both")


def strip_reasoning(text: str) -> str:
    """``text`` without its think blocks (and the line breaks after them).

    A reply whose think block the template opened in the prompt has only the closing
    tag: everything up to it is reasoning. A think block that never closes (the reply was
    cut by the length limit while reasoning) is all reasoning: when nothing else is left,
    the text is returned as it is, so that no message becomes empty.
    """
    if THINK_OPEN not in text and THINK_CLOSE not in text:
        return text
    out, rest = [], text
    while True:
        close = rest.find(THINK_CLOSE)
        open_ = rest.find(THINK_OPEN)
        if close < 0:  # no (further) block closes: an unclosed one is cut off, the rest kept
            out.append(rest[:open_] if open_ >= 0 else rest)
            break
        if 0 <= open_ < close:
            out.append(rest[:open_])
        rest = rest[close + len(THINK_CLOSE):].lstrip("\n")
    stripped = "".join(out).strip()
    return stripped if stripped else text


def reasoning_view(messages: list[dict], policy: str, own_from: int = 0) -> list[dict]:
    """The ``messages`` a row stores under ``--reasoning policy``.

    ``keep``: every reply as the model wrote it, think blocks included (the chat template
    renders them back into the row's ``input_ids``). ``strip``: every reply without them.
    ``both``: the replies the row trains (assistant messages from number ``own_from`` on)
    keep them; the earlier ones, which the row holds only as history, lose them.
    """
    check_choice("reasoning policy", policy, REASONING, repr_value=True, error=ValueError)
    out, n = [], 0
    for m in messages:
        if m["role"] == "assistant":
            if policy == "strip" or (policy == "both" and n < own_from):
                m = {"role": "assistant", "content": strip_reasoning(m["content"])}
            n += 1
        out.append(m)
    return out


#: Text whose token ids :class:`ChatFormat` keeps (the samples of a conversation share their prompts), in characters.
ENCODED_CACHE_CHARS = 1 << 22


def _library_tokenizer_class(tokenizer) -> type:
    """The class whose methods run a call to ``tokenizer``.

    vLLM hands out its tokenizer wrapped in a pool (``vllm.tokenizers.hf.maybe_make_thread_pool``): each
    call runs on a deep copy of the same tokenizer, so what counts is the class the pool wraps.
    """
    cls = type(tokenizer)
    while cls.__module__ == "vllm.tokenizers.hf" and cls.__name__.startswith("TokenizerPool") and cls.__bases__:
        cls = cls.__bases__[0]
    return cls


def rust_tokenizer(tokenizer):
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` when calling it gives what the tokenizer's own calls give;
    None otherwise.

    A transformers tokenizer built on the Rust library whose class keeps the library's ``__call__``, ``decode``,
    ``_encode_plus`` and ``_decode`` hands the text or the ids to the Rust tokenizer and returns what it returns (with
    no truncation, no padding, special tokens not split and no clean-up of spaces, as :class:`ChatFormat` asks); its
    own layers around that call (argument checks, batching, ``BatchEncoding``, a pass over every id to convert it)
    cost several times the Rust call on short texts. A class that overrides any of them (another model's own text
    handling) is called as it is.
    """
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if not isinstance(tokenizer, TokenizersBackend):
        return None
    cls = _library_tokenizer_class(tokenizer)
    for name, base in (("__call__", PreTrainedTokenizerBase), ("decode", PreTrainedTokenizerBase),
                       ("_encode_plus", TokenizersBackend), ("_decode", TokenizersBackend)):
        if getattr(cls, name, None) is not getattr(base, name):
            return None
    if getattr(tokenizer, "split_special_tokens", False):
        return None
    return tokenizer.backend_tokenizer


class ChatFormat:
    """Token-level chat templating for one tokenizer, one template and its extra variables."""

    def __init__(self, tokenizer, stop_ids: frozenset[int], chat_template: str | None = None,
                 template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise TemplateError("the model's tokenizer has no chat template; pass a model with one (chat models ship it) "
                                "or --chat-template")
        self.kwargs = dict(template_kwargs or {})
        self.stop_ids = stop_ids
        self._rust = rust_tokenizer(tokenizer)
        self._encoded: dict[str, tuple[int, ...]] = {}  # text -> its ids: a prompt is encoded once for all samples
        self._encoded_chars = 0
        self._stop_texts: dict[int, str] = {}
        user = {"role": "user", "content": _SENTINEL_USER}
        reply = {"role": "assistant", "content": _SENTINEL_ASSISTANT}
        rendered = self.render([user, reply], False)
        if _SENTINEL_ASSISTANT not in rendered:
            raise TemplateError("the chat template drops assistant messages; cannot build multi-turn token streams")
        self.assistant_suffix = rendered.split(_SENTINEL_ASSISTANT, 1)[1]
        self.reply_prefix = self._reply_prefix(user, reply)

    def _reply_prefix(self, user: dict, reply: dict) -> str:
        head = self.render([user], False)
        history = self.render([user, reply, {"role": "user", "content": _SENTINEL_NEXT}], False)
        prompt = self.render([user], True)
        if not (history.startswith(head) and prompt.startswith(head)):
            return ""
        header = history[len(head):].split(_SENTINEL_ASSISTANT, 1)[0]  # an assistant message's opening, in history
        generation = prompt[len(head):]  # what the generation prompt adds
        return generation[len(header):] if generation.startswith(header) else ""

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError as JinjaError

        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=self.template,
                **self.kwargs,
            )
        except JinjaError as exc:
            raise TemplateError(f"the chat template fails to render: {exc}") from None

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        ids = self._encoded.get(text)
        if ids is None:
            rust = self._rust
            # The tokenizer's own call first turns off a truncation or padding someone set on it: it does that here
            if rust is not None and rust.truncation is None and rust.padding is None and not rust.encode_special_tokens:
                ids = tuple(rust.encode(text, add_special_tokens=False).ids)
            else:
                ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if self._encoded_chars + len(text) > ENCODED_CACHE_CHARS:
                self._encoded.clear()
                self._encoded_chars = 0
            self._encoded[text] = ids
            self._encoded_chars += len(text)
        return list(ids)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        if self._rust is not None:
            return self._rust.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def prompt(self, messages: list[dict]) -> str:
        """The text of the prompt that asks for the next assistant turn after ``messages``."""
        return self.render(messages, True)

    def first_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of a whole prompt (system + user messages + assistant header)."""
        return self.encode(self.prompt(messages))

    @staticmethod
    def delta(stream_text: str, prompt: str) -> str | None:
        """What ``prompt`` adds after a token stream whose text is ``stream_text``; None when it does not
        continue that stream (re-rendered history)."""
        return prompt[len(stream_text):] if prompt.startswith(stream_text) else None

    def generated_text(self, generated: list[int]) -> str:
        """The stream text of a generated turn: every token, special ones (the stop token) included."""
        return self._decode(generated, False)

    def closing(self, generated: list[int]) -> str:
        """Template text to append after a generated assistant turn so the stream matches the template."""
        if generated and generated[-1] in self.stop_ids:
            stop_text = self._stop_texts.get(generated[-1])
            if stop_text is None:
                stop_text = self._stop_texts[generated[-1]] = self.tokenizer.decode([generated[-1]], skip_special_tokens=False)
            if self.assistant_suffix.startswith(stop_text):
                return self.assistant_suffix[len(stop_text):]
        return self.assistant_suffix

    def decode_reply(self, generated: list[int]) -> str:
        """The text of a generated turn (stop token and special tokens dropped)."""
        ids = generated[:-1] if generated and generated[-1] in self.stop_ids else generated
        return self._decode(ids, True)

    def reply_content(self, generated: list[int]) -> str:
        """An assistant message's content: the reply prefix the prompt gave it, then what the model generated."""
        return self.reply_prefix + self.decode_reply(generated)
