"""``distill data merge | dedupe | split``: new shard folders from existing ones (inputs untouched).

Terms
-----
user text key
    what dedupe compares: the user turns of a conversation, in order. ``exact``
    compares them as stored; ``normalized`` first lowercases them (Unicode
    casefold) and collapses every run of whitespace to one space, trimming the ends.
samples
    rows ``<seed id>#s0``, ``#s1``, ... regenerated from one seed conversation
    (``distill generate --samples N``). They are one conversation for both tools: dedupe
    never drops a sample of the conversation it keeps, and a split keeps them together.
continued rows
    ``<conversation id>#t<turn>``: the later part of a conversation whose chat template
    re-renders its history (:func:`distill.conversation.turn_row_id`). Dedupe keys a
    conversation by its last row (the highest turn: the one with every user turn) and keeps
    or drops all of its rows together.
split key
    what decides a row's side. ``id`` (default): the seed conversation's id: the row id without
    the ``#t<turn>`` of a row that continues a conversation (:func:`distill.conversation.conversation_id`)
    and then without its sample suffix (:func:`distill.conversation.seed_conversation_id`), so a
    conversation's rows and every sample of a seed conversation stay on one side. ``first-turn``: the
    conversation's first user turn, normalized as above, so conversations that open
    alike (a seed set with repeated prompts, replies regenerated at temperature > 0,
    self-talk from one opener) all land on the same side and the eval split never
    holds a prompt the heads were trained on. With few distinct openers a side can
    come out empty: the split refuses that rather than write it.
split by key hash
    a row goes to ``eval`` when ``sha256(key)`` read as a fraction in [0, 1) is below
    ``eval_fraction``: deterministic, independent of row order and shard layout,
    and stable when rows are added (a row never changes side).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from distill.conversation import continued_turn, conversation_id, seed_conversation_id
from distill.data.dataset import Dataset
from distill.data.write import DEFAULT_SHARD_ROWS, ShardWriter, check_new_output, derived_meta
from distill.errors import ConfigError, check_choice

DEDUPE_MODES = ("exact", "normalized")
SPLIT_KEYS = ("id", "first-turn")


@dataclass
class TransformSummary:
    """What a merge / dedupe / split wrote."""

    op: str
    out: dict[str, str]  # split name (or "out") -> folder
    rows_in: int = 0
    rows_out: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> rows not written

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def _input_record(ds: Dataset) -> dict:
    m = ds.meta
    return {"path": Path(ds.root).resolve().name, "rows": ds.rows,  # a name, not a local path (datasets are shared) "model": (m.get("model") or {}).get("id"),
            "seed": (m.get("seed") or {}).get("spec"), "sampling": m.get("sampling"), "derived": m.get("derived")}


def merge(inputs: list[Path | str], out: Path | str, skip_duplicate_ids: bool = False,
          shard_rows: int = DEFAULT_SHARD_ROWS) -> TransformSummary:
    """Concatenate datasets made by the same model with the same teacher encoding.

    A row id seen in an earlier input is an error unless ``skip_duplicate_ids``
    (then the first is kept and the others counted as ``duplicate_id``).
    """
    if len(inputs) < 2:
        raise ConfigError("merge needs at least two input folders")
    sets = [Dataset.open(p) for p in inputs]
    check_new_output(out, [d.root for d in sets])
    first = sets[0]
    key = lambda d: ((d.meta.get("model") or {}).get("id"), (d.meta.get("model") or {}).get("revision"))  # noqa: E731
    for d in sets[1:]:
        if d.encoding != first.encoding:
            raise ConfigError(f"{d.root} stores the teacher as {d.encoding}, {first.root} as {first.encoding}: they cannot be merged")
        if key(d) != key(first):
            raise ConfigError(f"{d.root} was made by model {key(d)}, {first.root} by {key(first)}: merge datasets of one model")
    meta = derived_meta(first.meta, "merge", inputs=[_input_record(d) for d in sets])
    summary = TransformSummary("merge", {"out": str(out)})
    seen: set[str] = set()
    with ShardWriter(Path(out), meta, first.id_dtype, shard_rows) as w:
        for d in sets:
            w.rejects.extend(d.rejects())
            for row in d.iter_rows():
                summary.rows_in += 1
                if row["id"] in seen:
                    if not skip_duplicate_ids:
                        raise ConfigError(f"id {row['id']!r} of {d.root} is already in an earlier input; "
                                          "pass --skip-duplicate-ids to keep the first")
                    summary.dropped["duplicate_id"] = summary.dropped.get("duplicate_id", 0) + 1
                    continue
                seen.add(row["id"])
                w.add(row)
        w.close(derived_rows_in=summary.rows_in)
        summary.rows_out["out"] = w.count
    return summary


def normalize(text: str) -> str:
    """Casefolded, every run of whitespace one space, ends trimmed (``normalized`` in the module's terms)."""
    return " ".join(text.split()).casefold()


def user_text_key(messages: list[dict], mode: str) -> bytes:
    """Digest of a conversation's user turns (see the module's terms)."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    if mode == "normalized":
        users = [normalize(u) for u in users]
    return hashlib.blake2b("\x1e".join(users).encode("utf-8", "surrogatepass"), digest_size=16).digest()


def dedupe(inp: Path | str, out: Path | str, mode: str = "normalized", shard_rows: int = DEFAULT_SHARD_ROWS) -> TransformSummary:
    """Keep the first conversation of each user text key (and the other samples of it); dropped rows go to the
    new rejects.jsonl.

    In ``normalized`` mode the drops are counted apart: ``duplicate_exact`` (the same
    text as stored as an earlier row) and ``duplicate_normalized`` (the same only after
    normalization), so ``duplicate_exact`` equals what ``exact`` mode would drop.
    """
    check_choice("--match", mode, DEDUPE_MODES, repr_value=True)
    d = Dataset.open(inp)
    check_new_output(out, [d.root])
    summary = TransformSummary("dedupe", {"out": str(out)})
    # pass 1: each conversation's keys (exact, compared), from its last row
    last: dict[str, tuple[int, bytes, bytes]] = {}
    for row in d.iter_rows(columns=["id", "messages"]):
        conv, turn = conversation_id(row["id"]), continued_turn(row["id"])
        if turn >= last.get(conv, (-1,))[0]:
            exact = user_text_key(row["messages"], "exact")
            last[conv] = (turn, exact, exact if mode == "exact" else user_text_key(row["messages"], "normalized"))
    # pass 2: in row order, a conversation is kept or dropped when its first row comes, and its other rows follow
    first_of: dict[bytes, str] = {}  # key -> the conversation kept for it
    exact_seen: set[bytes] = set()
    dropped: dict[str, tuple[str, str]] = {}  # conversation -> (reason, the conversation it repeats)
    decided: set[str] = set()
    meta = derived_meta(d.meta, "dedupe", mode=mode, inputs=[_input_record(d)])
    with ShardWriter(Path(out), meta, d.id_dtype, shard_rows) as w:
        w.rejects.extend(d.rejects())
        for row in d.iter_rows():
            summary.rows_in += 1
            conv = conversation_id(row["id"])
            if conv not in decided:
                decided.add(conv)
                _, exact, k = last[conv]
                is_exact = exact in exact_seen
                exact_seen.add(exact)
                if k in first_of and seed_conversation_id(first_of[k]) != seed_conversation_id(conv):
                    dropped[conv] = ("duplicate_exact" if mode == "exact" or is_exact else "duplicate_normalized", first_of[k])
                else:
                    first_of.setdefault(k, conv)
            if conv in dropped:
                reason, kept = dropped[conv]
                summary.dropped[reason] = summary.dropped.get(reason, 0) + 1
                w.rejects.append({"id": row["id"], "source": row["source"], "stage": "dedupe", "reason": reason,
                                  "detail": f"same user turns ({mode}) as {kept}"})
                continue
            w.add(row)
        w.close(derived_rows_in=summary.rows_in, dedupe_dropped=summary.dropped)
        summary.rows_out["out"] = w.count
    return summary


def eval_side(key: str, eval_fraction: float) -> bool:
    """True when a row of split key ``key`` belongs to the eval split (see the module's terms)."""
    h = int.from_bytes(hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    return h / 2**64 < eval_fraction


def split_key(row: dict, by: str = "id") -> str:
    """The split key of a row (see the module's terms)."""
    if by == "id":
        return seed_conversation_id(conversation_id(row["id"]))
    return normalize(next((m["content"] for m in row["messages"] if m["role"] == "user"), ""))


def split(inp: Path | str, out: Path | str, eval_fraction: float = 0.05, shard_rows: int = DEFAULT_SHARD_ROWS,
          by: str = "id") -> TransformSummary:
    """Write ``out/train`` and ``out/eval`` (both dataset folders) by the hash of each row's split key."""
    if not 0 < eval_fraction < 1:
        raise ConfigError(f"--eval-fraction must be in (0, 1); got {eval_fraction}")
    check_choice("--by", by, SPLIT_KEYS)
    d = Dataset.open(inp)
    check_new_output(out, [d.root])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = TransformSummary("split", {"train": str(out / "train"), "eval": str(out / "eval")})
    writers = {
        name: ShardWriter(out / name, derived_meta(d.meta, "split", split=name, eval_fraction=eval_fraction, by=by,
                                                   inputs=[_input_record(d)]), d.id_dtype, shard_rows)
        for name in ("train", "eval")
    }
    try:
        writers["train"].rejects.extend(d.rejects())
        for row in d.iter_rows():
            summary.rows_in += 1
            writers["eval" if eval_side(split_key(row, by), eval_fraction) else "train"].add(row)
        empty = [name for name, w in writers.items() if w.count == 0]
        if by == "first-turn" and summary.rows_in >= 2 and empty:
            raise ConfigError(f"split --by first-turn left '{empty[0]}' empty ({summary.rows_in} rows, too few distinct "
                              f"opening turns for --eval-fraction {eval_fraction}); raise the fraction or use --by id")
        for name, w in writers.items():
            w.close(derived_rows_in=summary.rows_in)
            summary.rows_out[name] = w.count
    except BaseException:
        for w in writers.values():
            w.abort()
        if not any(out.iterdir()):
            out.rmdir()
        raise
    return summary
