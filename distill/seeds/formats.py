"""Seed formats: how each row shape becomes raw ``(role, content)`` pairs.

Terms
-----
row
    one seed record as a Python ``dict`` (a JSONL line, a JSON list element or
    object value, a Parquet / ``datasets`` row).
format
    the shape of the rows of a source (:data:`SEED_FORMATS`). It is detected from
    the first rows that are objects (:func:`detect_format`) or forced by the user.
parts
    what a format extracts from a row (:class:`Parts`): the raw pairs for
    :func:`~distill.seeds.normalize.normalize`, extra ``meta``, and whether
    consecutive user messages are separate turns (``user_runs``).

A format never maps roles or checks text itself: that is ``normalize``'s job, the
same for every format. It only reports rows it cannot take apart (``malformed_row``,
``unsupported_content``, ``empty_text`` inside a ChitChat turn, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from distill.seeds.normalize import Problem


@dataclass(frozen=True)
class Parts:
    """A row taken apart: raw ``(role, content)`` pairs plus what ``normalize`` needs besides."""

    pairs: list[tuple[object, object]]
    meta: dict = field(default_factory=dict)
    user_runs: bool = False


@dataclass(frozen=True)
class SeedFormat:
    """One row shape: ``key`` is the field every row of the format has; ``parse`` takes a row apart."""

    name: str
    key: str
    description: str
    parse: Callable[[dict], Parts | Problem]


def _missing(row: dict, key: str, fmt: str) -> Problem:
    keys = ", ".join(map(str, row)) or "none"
    return Problem("malformed_row", f"row has no {key!r} field (format {fmt}); its fields: {keys}")


def _typed(value: object, kind: type, what: str) -> Problem | None:
    if isinstance(value, kind):
        return None
    return Problem("malformed_row", f"{what} is {type(value).__name__}, not {kind.__name__}")


# -- ShareGPT -----------------------------------------------------------------------------------
def parse_sharegpt(row: dict) -> Parts | Problem:
    """``{"conversations": [{"from", "value"}], "system"?: str}``; a top-level ``system`` string comes first."""
    if "conversations" not in row:
        return _missing(row, "conversations", "sharegpt")
    conv = row["conversations"]
    if bad := _typed(conv, list, "'conversations'"):
        return bad
    pairs: list[tuple[object, object]] = []
    if row.get("system") is not None:
        pairs.append(("system", row["system"]))
    for i, msg in enumerate(conv):
        if bad := _typed(msg, dict, f"conversations[{i}]"):
            return bad
        if "from" not in msg or "value" not in msg:
            return Problem("malformed_row", f"conversations[{i}] lacks 'from' or 'value'")
        pairs.append((msg["from"], msg["value"]))
    return Parts(pairs)


# -- OpenAI messages (also UltraChat's ``messages``) --------------------------------------------
def _content_text(content: object, i: int) -> object:
    """A message content: a string, or a list of ``{"type": "text", "text"}`` parts joined with "\\n"."""
    if not isinstance(content, list):
        return content  # a string, or a wrong type that normalize reports
    texts: list[str] = []
    for j, part in enumerate(content):
        if bad := _typed(part, dict, f"messages[{i}].content[{j}]"):
            return bad
        kind = part.get("type")
        if kind != "text":
            return Problem("unsupported_content", f"messages[{i}].content[{j}] is a {kind!r} part; only text parts are supported")
        if not isinstance(part.get("text"), str):
            return Problem("malformed_row", f"messages[{i}].content[{j}] is a text part without a 'text' string")
        texts.append(part["text"])
    return "\n".join(texts)


def _parse_messages(row: dict, fmt: str) -> Parts | Problem:
    if "messages" not in row:
        return _missing(row, "messages", fmt)
    msgs = row["messages"]
    if bad := _typed(msgs, list, "'messages'"):
        return bad
    pairs: list[tuple[object, object]] = []
    for i, msg in enumerate(msgs):
        if bad := _typed(msg, dict, f"messages[{i}]"):
            return bad
        if "role" not in msg or "content" not in msg:
            return Problem("malformed_row", f"messages[{i}] lacks 'role' or 'content'")
        content = _content_text(msg["content"], i)
        if isinstance(content, Problem):
            return content
        pairs.append((msg["role"], content))
    return Parts(pairs)


def parse_openai(row: dict) -> Parts | Problem:
    """``{"messages": [{"role", "content"}]}``; content is a string or a list of text parts."""
    return _parse_messages(row, "openai")


# -- UltraChat ----------------------------------------------------------------------------------
def parse_ultrachat(row: dict) -> Parts | Problem:
    """``{"data": [user, assistant, user, ...]}`` (strings, user first) or ``{"messages": [{"role", "content"}]}``."""
    if "data" in row:
        data = row["data"]
        if bad := _typed(data, list, "'data'"):
            return bad
        return Parts([("user" if i % 2 == 0 else "assistant", text) for i, text in enumerate(data)])
    if "messages" in row:
        return _parse_messages(row, "ultrachat")
    return _missing(row, "data' or 'messages", "ultrachat")


# -- MT-Bench -----------------------------------------------------------------------------------
def parse_mt_bench(row: dict) -> Parts | Problem:
    """``{"question_id", "category", "turns": [q1, q2, ...]}``: user turns only, kept apart (turns to replay).

    ``category`` goes to ``meta``; ``reference`` (the judge's answer key) is not a conversation turn.
    """
    if "turns" not in row:
        return _missing(row, "turns", "mt-bench")
    turns = row["turns"]
    if bad := _typed(turns, list, "'turns'"):
        return bad
    meta = {"category": row["category"]} if row.get("category") is not None else {}
    return Parts([("user", q) for q in turns], meta=meta, user_runs=True)


# -- ChitChat -----------------------------------------------------------------------------------
def parse_chitchat(row: dict) -> Parts | Problem:
    """``{"messages": [[{"text", "timestamp", "sender"}, ...], ...]}``: each inner list is one turn by one sender.

    A turn's utterances are joined with "\\n". The first turn's sender is the user,
    the other sender the assistant; a third sender rejects the row. Blank utterances
    are dropped from their turn (a turn left with no text is rejected as ``empty_text``
    by normalization).
    """
    if "messages" not in row:
        return _missing(row, "messages", "chitchat")
    turns = row["messages"]
    if bad := _typed(turns, list, "'messages'"):
        return bad
    roles: dict[object, str] = {}
    pairs: list[tuple[object, object]] = []
    for i, turn in enumerate(turns):
        if bad := _typed(turn, list, f"messages[{i}]"):
            return bad
        if not turn:
            return Problem("malformed_row", f"messages[{i}] is an empty turn")
        texts: list[str] = []
        senders: set[object] = set()
        for j, utt in enumerate(turn):
            if bad := _typed(utt, dict, f"messages[{i}][{j}]"):
                return bad
            if bad := _typed(utt.get("text"), str, f"messages[{i}][{j}].text"):
                return bad
            if utt["text"].strip():
                texts.append(utt["text"])
            senders.add(utt.get("sender"))
        if len(senders) != 1:
            return Problem("malformed_row", f"messages[{i}] mixes {len(senders)} senders in one turn")
        sender = senders.pop()
        if sender not in roles:
            if len(roles) == 2:
                return Problem("unknown_role", f"messages[{i}] is from a third sender {sender!r}")
            roles[sender] = "user" if not roles else "assistant"
        pairs.append((roles[sender], "\n".join(texts)))
    return Parts(pairs)


#: Every format, by the name ``format=`` accepts.
FORMATS: dict[str, SeedFormat] = {
    f.name: f
    for f in (
        SeedFormat("sharegpt", "conversations", "ShareGPT: conversations [{from, value}]", parse_sharegpt),
        SeedFormat("ultrachat", "data", "UltraChat: data [u, a, ...] or messages [{role, content}] with prompt_id", parse_ultrachat),
        SeedFormat("openai", "messages", "OpenAI messages [{role, content}] (content: text or text parts)", parse_openai),
        SeedFormat("mt-bench", "turns", "MT-Bench questions: turns [q1, q2] (user turns only)", parse_mt_bench),
        SeedFormat("chitchat", "messages", "ChitChat: messages [[{text, sender}, ...], ...] (one list per turn)", parse_chitchat),
    )
}
SEED_FORMATS: tuple[str, ...] = tuple(FORMATS)


def detect_format(row: object) -> str | None:
    """The format a single row has (None if it has none of the formats' keys)."""
    if not isinstance(row, dict):
        return None
    if "conversations" in row:
        return "sharegpt"
    if "turns" in row:
        return "mt-bench"
    if "data" in row:
        return "ultrachat"
    if "messages" in row:
        msgs = row["messages"]
        if isinstance(msgs, list) and msgs and isinstance(msgs[0], list):
            return "chitchat"
        return "ultrachat" if "prompt_id" in row else "openai"
    return None
