"""The lookup proposer's global store: a suffix index over the model's own text in a self-distilled dataset.

A row's context often has no earlier occurrence of its last few tokens, most of all early in
a reply. The model's replies in its self-distilled data do: they are the same model writing
the same phrases, chat-template markers and openings (retrieval-based drafting, He et al. 2023,
"REST", with a datastore of the model's own generations instead of a corpus). Drafts stay
point masses checked by the engine's verification, so the output is the model's whatever the
datastore holds; what it holds decides only how often a draft lands.

Terms
-----
document
    one generated span of a row (``loss_mask`` runs) with the up to ``max_ngram`` tokens
    before it (the chat template's assistant header, the end of the user's turn), so that
    the span's opening tokens are indexed after what preceded them.
position
    an index p into a document whose token was generated and which has at least one token
    before it; its n-gram is the n tokens before p and its continuation the up to ``depth``
    tokens from p on, within the document.
index
    the positions sorted by their preceding tokens read backwards (the token before p first,
    then the one before it, ...; up to ``max_ngram``). The suffixes of a context, read
    backwards, are prefixes of one another, so one narrowing pass over the sorted columns
    finds, for every n up to the longest suffix that occurred, the range of the positions
    its last n tokens preceded: the levels SuffixDecoding scores
    (:mod:`distill.engine.proposers.suffix`). Keys are 2 bytes a token for vocabularies up to
    65,535 ids (4 above), positions 4 bytes: ``2 * max_ngram + 8`` bytes an indexed token.
occurrences
    at most this many positions of a level's range, evenly spaced over it (the range is sorted
    by what came before, so this samples the contexts the n-gram appeared in); the level's
    probabilities are the sample's shares, its size the whole range's.
history
    the replies the engine itself produced (:class:`History`), newest last, up to a budget of
    tokens, oldest dropped first: the same index over them, rebuilt as they accumulate
    (SuffixDecoding's global tree of earlier responses, Oliaro et al. 2024, in this index's
    form). A server's later requests then draft from what it answered before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from distill.engine.proposers.suffix import PAD, Level
from distill.errors import ConfigError

_SEP = PAD  # between documents: never a continuation token
#: The longest suffix a store matches (its key length), and the longest continuation it returns.
DEFAULT_STORE_NGRAM, DEFAULT_STORE_DEPTH = 8, 16


class Datastore:
    """The n-gram index of a list of documents (see the module docstring)."""

    def __init__(self, documents: Iterable[tuple[Sequence[int], int]], max_ngram: int = DEFAULT_STORE_NGRAM,
                 depth: int = DEFAULT_STORE_DEPTH, source: str = ""):
        """documents: (tokens, first) pairs: the document's token ids, and the index of its first generated token
        (the tokens before it are context only, never a continuation)."""
        if max_ngram < 1 or depth < 1:
            raise ConfigError("a datastore needs max_ngram >= 1 and depth >= 1")
        self.max_ngram, self.depth, self.source = max_ngram, depth, source
        parts, starts, firsts, lengths, total = [], [], [], [], 0
        for tokens, first in documents:
            arr = np.asarray(tokens, dtype=np.int64)
            if arr.size == 0:
                continue
            if arr.min() < 0:
                raise ConfigError(f"negative token id in the datastore's documents ({source or 'given'})")
            parts += [arr, np.array([_SEP])]
            starts.append(total)
            firsts.append(total + max(first, 1))
            lengths.append(arr.size + 1)
            total += arr.size + 1
        self.documents = len(starts)
        # int32: ids of any vocabulary; the tail: continuations may read past the last document
        self.tokens = np.concatenate(parts + [np.full(depth, _SEP)]).astype(np.int32)
        # per token: its document's start and first generated position (separators are never positions; the tail
        # belongs to a sentinel document whose first generated position is past the end)
        doc = np.concatenate([np.repeat(np.arange(len(starts)), lengths), np.full(depth, len(starts))])
        start = np.asarray(starts + [0], dtype=np.int64)[doc]
        first = np.asarray(firsts + [self.tokens.size], dtype=np.int64)[doc]
        p = np.arange(self.tokens.size)
        keep = (self.tokens != _SEP) & (p >= first)
        pos, start = p[keep], start[keep]
        # column j: the token j + 1 places before each position, + 1 (0: before the document's start)
        key_type = np.uint16 if self.tokens.max(initial=0) < np.iinfo(np.uint16).max else np.int32
        cols = np.zeros((max_ngram, pos.size), dtype=key_type)
        for j in range(max_ngram):
            q = pos - 1 - j
            ok = q >= start
            cols[j, ok] = self.tokens[q[ok]] + 1
        order = np.lexsort(cols[::-1])  # stable: within a key, positions stay in order (the newest last)
        self.keys = np.ascontiguousarray(cols[:, order])
        self.positions = pos[order].astype(np.int32 if self.tokens.size < 2**31 else np.int64)
        self.generated_tokens = int(pos.size)

    @classmethod
    def from_dataset(cls, data: Path | str, vocab_size: int, tokenizer_sha256: str | None = None,
                     max_ngram: int = DEFAULT_STORE_NGRAM, depth: int = DEFAULT_STORE_DEPTH) -> "Datastore":
        """The generated spans of a self-distilled dataset's shards (``input_ids``, ``loss_mask``); ``tokenizer_sha256``:
        the serving model's (``distill.models.model_record``), checked against the one the dataset records."""
        from distill.data.dataset import Dataset
        from distill.store.shards import iter_token_rows

        recorded = (Dataset.open(data).meta.get("model") or {})
        made_with = recorded.get("tokenizer_sha256")
        if tokenizer_sha256 and made_with and made_with != tokenizer_sha256:
            raise ConfigError(f"{data} was made with another tokenizer ({recorded.get('id') or 'unknown model'}) than the "
                              "model served: its n-grams would never match; use a dataset this model generated")

        def documents():
            for ids, mask in iter_token_rows(data, vocab_size, "its datastore"):
                edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
                for a, b in zip(edges[::2], edges[1::2]):
                    lo = max(0, a - max_ngram)
                    yield ids[lo:b], a - lo

        store = cls(documents(), max_ngram, depth, source=str(data))
        if not store.generated_tokens:
            raise ConfigError(f"{data} has no generated tokens (loss_mask) to index")
        return store

    def ranges(self, context: Sequence[int], min_ngram: int = 1) -> list[tuple[int, int, int]]:
        """(n, lo, hi) for each n from ``min_ngram`` up to the longest suffix of ``context`` (at most ``max_ngram``
        tokens) that precedes an indexed position: its occurrences are ``positions[lo:hi]``. Empty when none."""
        lo, hi, out = 0, self.positions.size, []
        top = np.iinfo(self.keys.dtype).max
        for j in range(min(self.max_ngram, len(context))):
            tok = int(context[-1 - j]) + 1
            if not 0 < tok <= top:
                break  # a token the store's documents never hold
            key = self.keys.dtype.type(tok)  # the keys' own dtype: another one would convert the whole row first
            row = self.keys[j, lo:hi]
            a, b = np.searchsorted(row, key, "left"), np.searchsorted(row, key, "right")
            if a == b:
                break
            lo, hi = lo + int(a), lo + int(b)
            if j + 1 >= min_ngram:
                out.append((j + 1, lo, hi))
        return out

    def levels(self, context: Sequence[int], depth: int, occurrences: int, min_ngram: int = 1) -> list[Level]:
        """The occurrences of ``context``'s suffixes, one :class:`~distill.engine.proposers.suffix.Level` per match
        length (ascending): up to ``occurrences`` positions evenly spread over each range, newest first, with what
        followed them within their document (at most ``depth`` tokens)."""
        ranges = self.ranges(context, min_ngram)
        if not ranges:
            return []
        picks = [lo + (np.arange(min(occurrences, hi - lo)) * (hi - lo)) // min(occurrences, hi - lo)
                 for _, lo, hi in ranges]
        at = np.sort(self.positions[np.concatenate(picks)].astype(np.int64).reshape(-1))  # one gather for all levels
        d = min(depth, self.depth)
        rows = self.tokens[at[:, None] + np.arange(d)].tolist()  # (K, d): the tail keeps reads past the end in bounds
        index = {int(p): i for i, p in enumerate(at.tolist())}
        out = []
        for (n, lo, hi), pick in zip(ranges, picks):
            conts = []
            for p in sorted(self.positions[pick].tolist(), reverse=True):  # newest first
                row = rows[index[p]]
                conts.append(row[: row.index(_SEP)] if _SEP in row else row)
            out.append(Level(n, conts, hi - lo))
        return out

    def memory_bytes(self) -> int:
        """Bytes of the index's arrays (tokens, keys, positions)."""
        return self.tokens.nbytes + self.keys.nbytes + self.positions.nbytes

    def describe(self) -> str:
        return (f"{self.generated_tokens:,} generated tokens of {self.documents:,} replies"
                + (f" in {self.source}" if self.source else "") + f", n-grams up to {self.max_ngram}")


class History:
    """The engine's own replies, newest last, as a :class:`Datastore` (see "history" in the module docstring).

    ``add`` queues a finished reply; the index is rebuilt once the queued tokens reach
    ``1 / REBUILD_SHARE`` of those indexed (at once while it is small), so the rebuilds cost a
    constant share per generated token; a queued reply
    drafts for later requests from the next rebuild on (at once while the history is small). Replies past ``max_tokens``
    are dropped oldest first; one longer than that keeps its last ``max_tokens`` tokens.
    """

    REBUILD_SHARE = 16

    def __init__(self, max_tokens: int, max_ngram: int = DEFAULT_STORE_NGRAM, depth: int = DEFAULT_STORE_DEPTH):
        if max_tokens < 0:
            raise ConfigError(f"the lookup history's budget must be >= 0 tokens; got {max_tokens}")
        self.max_tokens, self.max_ngram, self.depth = max_tokens, max_ngram, depth
        self.clear()

    def clear(self) -> None:
        """Forget every reply (a benchmark's next pass starts from none)."""
        self._replies: deque[tuple[np.ndarray, int]] = deque()
        self._held = self._queued = 0  # tokens of the replies held; of those added since the last rebuild
        self.index: Datastore | None = None
        self.rebuilds = 0

    @property
    def tokens(self) -> int:
        """Tokens of the replies held (indexed or queued)."""
        return self._held

    def add(self, tokens: Sequence[int], first: int) -> None:
        """A finished reply: ``tokens`` with its generated part from index ``first`` on (the tokens before it are context)."""
        if not self.max_tokens or len(tokens) <= first:
            return
        arr = np.asarray(tokens[-self.max_tokens:], dtype=np.int32)
        first = max(0, first - (len(tokens) - arr.size))
        self._replies.append((arr, first))
        self._held += arr.size
        self._queued += arr.size
        while self._held > self.max_tokens:
            self._held -= self._replies.popleft()[0].size
        indexed = self.index.generated_tokens if self.index is not None else 0
        if self._queued * self.REBUILD_SHARE >= indexed:
            self.index = Datastore(self._replies, self.max_ngram, self.depth, source="this engine's replies")
            self._queued = 0
            self.rebuilds += 1

    def levels(self, context: Sequence[int], depth: int, occurrences: int, min_ngram: int = 1) -> list[Level]:
        """As :meth:`Datastore.levels`, over the replies indexed so far."""
        return self.index.levels(context, depth, occurrences, min_ngram) if self.index is not None else []

    def describe(self) -> str:
        return f"up to {self.max_tokens:,} tokens of this engine's replies (holding {self._held:,})"


__all__ = ["Datastore", "History"]
