"""Chat templates joined at the token level.

Terms
-----
token stream
    the ``input_ids`` of one conversation: the first prompt, then for each turn the
    tokens the teacher generated, the template tokens that close the assistant turn,
    and the template tokens of the next user turn plus the assistant header.
delta
    the text the chat template adds between two renderings: render(history + new
    user message, generation prompt) minus render(history). Only deltas are
    tokenized; tokens already in the stream are never re-tokenized, so the stored
    ids are exactly what the teacher saw.
assistant suffix
    the text the template puts after an assistant message's content (ChatML:
    ``<|im_end|>\\n``). When the teacher stopped on a stop token whose text begins
    the suffix, only the rest (``\\n``) is appended; a turn cut by the length limit
    gets the whole suffix (marked not-generated).
"""

from __future__ import annotations


from distill.errors import TemplateError

_SENTINEL_USER = "\u2063distill-user\u2063"
_SENTINEL_ASSISTANT = "\u2063distill-assistant\u2063"


class ChatFormat:
    """Token-level chat templating for one tokenizer."""

    def __init__(self, tokenizer, stop_ids: frozenset[int], chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise TemplateError("the model's tokenizer has no chat template; pass a model with one (chat models ship it)")
        self.stop_ids = stop_ids
        rendered = self.render([{"role": "user", "content": _SENTINEL_USER}, {"role": "assistant", "content": _SENTINEL_ASSISTANT}], False)
        if _SENTINEL_ASSISTANT not in rendered:
            raise TemplateError("the chat template drops assistant messages; cannot build multi-turn token streams")
        self.assistant_suffix = rendered.split(_SENTINEL_ASSISTANT, 1)[1]

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=self.template
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def first_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of the first prompt (system + first user message + assistant header)."""
        return self.encode(self.render(messages, True))

    def next_user(self, history: list[dict], user: str) -> list[int]:
        """Token ids that follow a closed assistant turn: the user message and the assistant header."""
        before = self.render(history, False)
        after = self.render(history + [{"role": "user", "content": user}], True)
        if not after.startswith(before):
            raise TemplateError(
                "the chat template renders earlier turns differently once a new turn is added; "
                "distill cannot join its turns at the token level"
            )
        return self.encode(after[len(before):])

    def close_assistant(self, generated: list[int]) -> list[int]:
        """Template tokens to append after a generated assistant turn so the stream matches the template."""
        if generated and generated[-1] in self.stop_ids:
            stop_text = self.tokenizer.decode([generated[-1]])
            if self.assistant_suffix.startswith(stop_text):
                rest = self.assistant_suffix[len(stop_text):]
                return self.encode(rest) if rest else []
            return self.encode(self.assistant_suffix)
        return self.encode(self.assistant_suffix)

    def decode_reply(self, generated: list[int]) -> str:
        """The text of a generated turn (stop token and special tokens dropped)."""
        ids = generated[:-1] if generated and generated[-1] in self.stop_ids else generated
        return self.tokenizer.decode(ids, skip_special_tokens=True)
