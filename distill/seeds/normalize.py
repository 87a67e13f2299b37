"""One function turns a seed row's raw ``(role, content)`` pairs into the Conversation contract.

Terms
-----
raw pair
    ``(role, content)`` exactly as a seed format spells them (``("human", "Hi")``,
    ``("gpt", "Hello!")``); nothing is mapped or checked yet.
run
    consecutive messages with the same role. A run is *repaired* by merging its
    contents with ``"\\n\\n"``; ``meta["merged"]`` counts the messages merged away.
user runs
    formats that are lists of questions (MT-Bench) keep consecutive user messages
    apart: each is a turn to replay, not a message split in two.
problem
    why a row could not be normalized: a :class:`Problem` with a reason code from
    :data:`REASONS` and a sentence; it becomes a :class:`~distill.conversation.Rejection`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from distill.conversation import Conversation, Message, Rejection

#: Reason codes of seed rejections (stable strings) -> what each means.
REASONS: dict[str, str] = {
    "malformed_json": "a JSONL line that is not valid JSON (or nests deeper than the parser allows)",
    "row_too_large": "a JSON Lines row longer than 16 MiB (rejected unparsed)",
    "invalid_utf8": "text that is not valid UTF-8 (bad bytes, or lone surrogates such as a '\\ud800' escape)",
    "malformed_row": "a row that is not an object, lacks its format's key, or has a field of the wrong type",
    "unknown_role": "a message role that no seed format defines",
    "unsupported_content": "message content that is not text (an image or audio part, ...)",
    "empty_text": "a message whose text is empty or only whitespace",
    "non_alternating": "a system message after the first message, or an assistant message before any user message",
    "no_user_turn": "a conversation without any user message",
    "duplicate_id": "a row whose id was already used by an earlier row (the first occurrence wins)",
}

#: Seed role spellings -> Conversation roles. Anything else is ``unknown_role``.
ROLE_MAP: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
}

_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Problem:
    """Why a row cannot be normalized: ``reason`` is a code from :data:`REASONS`, ``detail`` a sentence."""

    reason: str
    detail: str

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"unknown seed rejection reason {self.reason!r}")

    def reject(self, id: str, source: str) -> Rejection:
        return Rejection(id=id, source=source, reason=self.reason, detail=self.detail, stage="seed")


def has_surrogate(text: str) -> bool:
    """True when ``text`` holds a lone surrogate: it came from invalid UTF-8 or a bad ``\\ud800`` escape."""
    return _SURROGATE.search(text) is not None


def find_surrogate(value: object, path: str = "row") -> str | None:
    """The path (``row.conversations[2].value``) of the first string in ``value`` with a lone surrogate, else None."""
    if isinstance(value, str):
        return path if has_surrogate(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and has_surrogate(key):
                return f"{path} (a key)"
            found = find_surrogate(item, f"{path}.{key}")
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = find_surrogate(item, f"{path}[{i}]")
            if found:
                return found
    return None


def normalize(
    pairs: Sequence[tuple[object, object]],
    *,
    id: str,
    source: str,
    meta: dict | None = None,
    user_runs: bool = False,
) -> Conversation | Rejection:
    """Map a row's raw pairs to a :class:`Conversation`, or a :class:`Rejection` saying why not.

    Checks, in order (the first failure is the reason): each role is known, each
    content is a non-empty string of valid text, a system message comes only
    first, some message is from the user, the first non-system message is the
    user's. Then runs are merged (user runs are kept apart when ``user_runs``).
    Non-empty content is never altered.
    """
    mapped: list[tuple[str, str]] = []
    for i, (raw_role, content) in enumerate(pairs):
        role = ROLE_MAP.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            known = ", ".join(ROLE_MAP)
            return Problem("unknown_role", f"message {i} has role {raw_role!r}; known roles: {known}").reject(id, source)
        if not isinstance(content, str):
            return Problem("malformed_row", f"message {i} content is {type(content).__name__}, not a string").reject(id, source)
        if has_surrogate(content):
            return Problem("invalid_utf8", f"message {i} text is not valid UTF-8 (it holds a lone surrogate)").reject(id, source)
        if not content.strip():
            return Problem("empty_text", f"message {i} ({role}) has no text").reject(id, source)
        if role == "system" and i != 0:
            return Problem("non_alternating", f"message {i} is a system message; a system message may only come first").reject(id, source)
        mapped.append((role, content))

    body = mapped[1:] if mapped and mapped[0][0] == "system" else mapped
    if not any(role == "user" for role, _ in body):
        return Problem("no_user_turn", f"none of the {len(mapped)} messages is from the user").reject(id, source)
    if body[0][0] == "assistant":
        return Problem("non_alternating", "an assistant message comes before the first user message").reject(id, source)

    merged = 0
    out: list[Message] = [Message("system", mapped[0][1])] if len(body) < len(mapped) else []
    for role, content in body:
        last = out[-1] if out else None
        if last is not None and last.role == role and not (user_runs and role == "user"):
            out[-1] = Message(last.role, f"{last.content}\n\n{content}")
            merged += 1
        else:
            out.append(Message(role, content))  # type: ignore[arg-type]  # role is one of ROLES
    meta = dict(meta or {})
    if merged:
        meta["merged"] = merged
    return Conversation(id=id, source=source, messages=tuple(out), meta=meta)
