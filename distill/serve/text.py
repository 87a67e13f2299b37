"""Incremental detokenization with stop strings.

Terms
-----
emitted text
    the part of a sequence's text already sent to the client; it never changes.
held-back text
    text decoded but not yet emitted: a tail that could still be the start of a stop
    string (an incomplete UTF-8 character is held by the decoder itself).
    A stop string that spans two decoding steps is thus never half-sent.
stop string
    a request's ``stop``: when it appears in the text, the text is cut right
    before it (after it with ``include_stop``) and the sequence ends with finish
    reason ``stop``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

REPLACEMENT = "\ufffd"


@dataclass
class TextDelta:
    text: str  # newly emitted text (may be empty)
    stopped: bool  # a stop string was found: the sequence must end now
    n_tokens: int  # tokens consumed so far, up to and including the one that completed the stop string


def _partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


@dataclass
class StreamDecoder:
    """Turns a growing list of token ids into emitted text deltas, honouring stop strings.

    The text comes from ``tokenizers``' own incremental decoder (:class:`tokenizers.decoders.DecodeStream`:
    a token completing no character yields nothing until one that does); what this class adds is the
    stop strings and the hold-back. A tokenizer without a ``tokenizers`` backend (a slow one) decodes a
    window of the last tokens instead.
    """

    tokenizer: object
    stops: Sequence[str] = ()
    include_stop: bool = False  # the stop string found stays in the text (vLLM's include_stop_str_in_output)
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    text: str = ""  # the sequence's text so far (complete characters only)
    emitted: int = 0  # chars of ``text`` already emitted
    stopped: bool = False
    _stream: object = None  # DecodeStream, or None for a slow tokenizer
    _prefix: int = 0  # slow tokenizers: the decode window is ids[_prefix:]
    _read: int = 0

    def __post_init__(self) -> None:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)

    def _step(self, tok: int) -> str:
        """The text token ``tok`` completes (maybe none yet)."""
        if self._stream is not None:
            return self._stream.step(self._backend, tok) or ""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,  # noqa: E731
                                                   clean_up_tokenization_spaces=False)
        before, after = decode(self.ids[self._prefix:self._read]), decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before):]
        return ""

    def add(self, new_ids: Sequence[int]) -> TextDelta:
        """Feed the new token ids of one step; returns what may be emitted now."""
        if self.stopped:
            return TextDelta("", True, len(self.ids))
        for tok in new_ids:  # token by token, so a stop string ends at the right token count
            self.ids.append(int(tok))
            self.text += self._step(int(tok))
            if self.stops:
                cut = self._find_stop()
                if cut is not None:
                    self.text = self.text[:cut]
                    self.stopped = True
                    return TextDelta(self._take(len(self.text)), True, len(self.ids))
        return TextDelta(self._take(self._safe_end()), False, len(self.ids))

    def finish(self) -> str:
        """The sequence ended (length, stop token, cancel): emit everything still held back."""
        if self.stopped:
            return ""
        return self._take(len(self.text))

    def _find_stop(self) -> int | None:
        """Where the text ends at the first stop string: before it, or after it with ``include_stop``."""
        # Only text not yet emitted (plus the longest stop's length before it) can hold a new match.
        start = max(0, self.emitted - max(len(s) for s in self.stops))
        hits = [(i, i + len(s) if self.include_stop else i) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        return min(hits)[1] if hits else None

    def _safe_end(self) -> int:
        end = len(self.text)
        if self.stops:
            end -= _partial_stop_len(self.text, self.stops)
        return max(end, self.emitted)

    def _take(self, end: int) -> str:
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out
