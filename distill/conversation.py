"""The Conversation contract (docs/architecture.md): a list of ``{role, content}`` messages.

Every seed format is normalized to :class:`Conversation` at the edge
(``distill.seeds``); a row that cannot be normalized becomes a
:class:`Rejection` with a reason, never a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["system", "user", "assistant"]
ROLES: tuple[str, ...] = ("system", "user", "assistant")
_SAMPLE_SUFFIX = re.compile(r"#s\d+$")


def sample_id(conv_id: str, index: int, samples: int) -> str:
    """The id of completion ``index`` of ``samples`` drawn from one seed conversation.

    One sample keeps the seed conversation's id; with more, ``#s<index>`` is appended
    (``sharegpt:42#s0`` .. ``sharegpt:42#s3``). Sample i's id does not depend on how many
    samples there are, so it stays stable when a rerun asks for more.
    """
    return conv_id if samples == 1 else f"{conv_id}#s{index}"


def seed_conversation_id(row_id: str) -> str:
    """The id of the seed conversation a row was drawn from: ``row_id`` without its ``#s<index>`` suffix."""
    return _SAMPLE_SUFFIX.sub("", row_id)


@dataclass(frozen=True)
class Message:
    role: Role
    content: str

    def to_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class Conversation:
    """One normalized seed conversation.

    ``id`` is stable across runs (``<source>:<seed id or row index>``) and is the
    resume key of ``distill generate``.
    """

    id: str
    source: str
    messages: tuple[Message, ...]
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def system(self) -> str | None:
        return self.messages[0].content if self.messages and self.messages[0].role == "system" else None

    @property
    def user_turns(self) -> list[str]:
        return [m.content for m in self.messages if m.role == "user"]


@dataclass(frozen=True)
class Rejection:
    """A seed row (or a conversation at generation time) that was not used, and why.

    ``reason`` is a short stable code (``empty_text``, ``unknown_role``, ...),
    ``detail`` a human sentence.
    """

    id: str
    source: str
    reason: str
    detail: str = ""
    stage: Literal["seed", "generate"] = "seed"

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "source": self.source, "stage": self.stage, "reason": self.reason, "detail": self.detail}


_TURN_ROW = re.compile(r"#t(\d+)$")


def turn_row_id(conv_id: str, turn: int) -> str:
    """The id of the row that continues conversation ``conv_id`` from its assistant turn ``turn`` (0-based).

    A conversation is one row while its chat template extends the token stream turn by
    turn; when the template re-renders the history (``distill.templating``), each
    later part is a row of its own, ``<conversation id>#t<turn>``; the first part keeps the
    conversation's id.
    """
    return conv_id if turn == 0 else f"{conv_id}#t{turn}"


def conversation_id(row_id: str) -> str:
    """The conversation a row belongs to: ``row_id`` without the ``#t<turn>`` of a continuing row."""
    return _TURN_ROW.sub("", row_id)


def continued_turn(row_id: str) -> int:
    """The assistant turn a row continues its conversation from: ``N`` of ``#t<N>``, 0 for a conversation's first row."""
    m = _TURN_ROW.search(row_id)
    return int(m.group(1)) if m else 0
