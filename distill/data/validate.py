"""``distill data validate``: every check a dataset folder must pass, streamed by record batch.

Checks (the ``check`` code of a :class:`Problem`)
-------------------------------------------------
manifest
    ``manifest.json`` exists, is JSON of this format, and its totals add up.
shard_missing / shard_unlisted
    a listed shard file is absent / a ``shard-*.parquet`` in the folder is not listed.
size / checksum / row_count / token_count
    a shard's bytes, SHA-256, rows and token sums differ from its manifest entry
    (a truncated or altered file is named, never skipped).
unreadable
    the file is not Parquet any more (truncated footer, corrupt pages).
schema / metadata
    columns and types differ from :func:`distill.store.shard_schema`; the file's
    ``distill`` metadata is missing or its teacher encoding differs from the manifest's.
id
    empty or duplicated ``id`` (across all shards).
alignment
    ``loss_mask`` not as long as ``input_ids``; ``teacher_ids``/``teacher_lp`` not
    ``k`` values per generated token (empty for a teacher-less dataset);
    ``n_generated_tokens``/``n_prompt_tokens`` disagreeing with the mask.
messages
    roles must be an optional first ``system`` then ``user``/``assistant``
    alternating from ``user``; no message may be empty or whitespace.
turns
    ``turns`` spans tile ``input_ids`` exactly, their roles follow the non-system
    messages, and each assistant turn's ``n_tokens`` equals the masked tokens in it. A row
    that continues a conversation (``<id>#t<turn>``: its chat template re-renders the history)
    holds the earlier messages inside its first user turn: its turns follow the last messages.
teacher
    the teacher columns decode: candidate ids below the vocabulary size and
    distinct per position, and the stored probabilities sum to at most 1 (+ the
    quantisation tolerance).
rejects
    ``rejects.jsonl`` is JSON lines with an id and a reason, as many per reason as the
    manifest's ``totals.rejects_by_reason`` counts (a deleted or cut-short file is found).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from distill.conversation import conversation_id
from distill.data.dataset import BATCH_ROWS
from distill.store.location import Folder, open_folder
from distill.store.shards import FORMAT, MANIFEST, META_KEY, REJECTS, SHARD_RE, shard_entry_problem, shard_schema
from distill.store.teacher import TeacherEncoding, manifest_encoding

MAX_LISTED = 10  # problems listed per (file, check); the rest are counted
COVERAGE_TOL = 0.01  # stored probabilities may sum to 1 + this (quantisation error is < 0.05% per value)
ROW_COLUMNS = ["id", "messages", "input_ids", "loss_mask", "teacher_ids", "teacher_lp", "turns",
               "n_prompt_tokens", "n_generated_tokens"]


@dataclass
class Problem:
    file: str  # the shard file, manifest.json or rejects.jsonl
    check: str
    detail: str
    row: str | None = None  # the row id, when one row is at fault

    def __str__(self) -> str:
        return f"{self.file}: [{self.check}] " + (f"row {self.row!r}: " if self.row is not None else "") + self.detail


@dataclass
class ValidationReport:
    root: str
    shards: int = 0
    rows: int = 0
    tokens: int = 0
    problems: list[Problem] = field(default_factory=list)  # at most MAX_LISTED per (file, check)
    unlisted: dict[str, int] = field(default_factory=dict)  # "file [check]" -> problems not listed

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def count(self) -> int:
        return len(self.problems) + sum(self.unlisted.values())

    def to_dict(self) -> dict:
        return {"root": self.root, "ok": self.ok, "shards": self.shards, "rows": self.rows, "tokens": self.tokens,
                "problem_count": self.count, "problems": [asdict(p) for p in self.problems], "unlisted": self.unlisted}


class _Collector:
    def __init__(self, report: ValidationReport):
        self.report = report
        self.per_key: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, file: str, check: str, detail: str, row: str | None = None) -> None:
        key = (file, check)
        self.per_key[key] += 1
        if self.per_key[key] <= MAX_LISTED:
            self.report.problems.append(Problem(file, check, detail, row))
        else:
            k = f"{file} [{check}]"
            self.report.unlisted[k] = self.report.unlisted.get(k, 0) + 1


def _offsets(arr: pa.Array) -> np.ndarray:
    """List offsets of a (non-chunked) list array, relative to its first value: (rows + 1,)."""
    off = arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    return off - off[0]


def _values(arr: pa.Array) -> np.ndarray:
    return pc.list_flatten(arr).to_numpy(zero_copy_only=False)


def _row_ids(idx: np.ndarray) -> np.ndarray:
    """For each flattened value, the index of its row: (values,) from offsets (rows + 1,)."""
    return np.repeat(np.arange(idx.size - 1), np.diff(idx))


class _RowChecker:
    """Per-row invariants, vectorized over one record batch."""

    def __init__(self, enc: TeacherEncoding | None, vocab_size: int | None, out: _Collector):
        self.enc = enc
        self.vocab = vocab_size
        self.out = out
        self.seen: dict[str, str] = {}  # id -> file it was first seen in

    def check(self, file: str, b: pa.RecordBatch) -> int:
        """Check one batch; returns its token count."""
        ids = b.column("id").to_pylist()

        def bad(flags: np.ndarray) -> np.ndarray:
            return np.flatnonzero(flags)

        def add(check: str, rows: np.ndarray, detail) -> None:
            for i in rows:
                self.out.add(file, check, detail(i), ids[i])

        for i, rid in enumerate(ids):
            if not rid:
                self.out.add(file, "id", f"row {i} of the batch has an empty id")
            elif rid in self.seen:
                self.out.add(file, "id", f"duplicate id (first seen in {self.seen[rid]})", rid)
            else:
                self.seen[rid] = file

        tok_off = _offsets(b.column("input_ids"))  # (R+1,)
        n_tok = np.diff(tok_off)
        mask_off = _offsets(b.column("loss_mask"))
        n_mask = np.diff(mask_off)
        add("alignment", bad(n_mask != n_tok), lambda i: f"loss_mask has {n_mask[i]} values, input_ids {n_tok[i]}")
        aligned = n_mask == n_tok
        mask = _values(b.column("loss_mask")).astype(bool)
        cs = np.concatenate([[0], np.cumsum(mask)])  # (M+1,) generated tokens before each flat position
        n_gen = cs[mask_off[1:]] - cs[mask_off[:-1]]  # (R,)
        col_gen = b.column("n_generated_tokens").to_numpy(zero_copy_only=False)
        col_prompt = b.column("n_prompt_tokens").to_numpy(zero_copy_only=False)
        add("alignment", bad(aligned & (col_gen != n_gen)), lambda i: f"n_generated_tokens is {col_gen[i]}, loss_mask marks {n_gen[i]}")
        add("alignment", bad(aligned & (col_prompt != n_tok - n_gen)),
            lambda i: f"n_prompt_tokens is {col_prompt[i]}, expected {n_tok[i] - n_gen[i]}")

        # teacher columns
        n_tid = np.diff(_offsets(b.column("teacher_ids")))
        n_tlp = np.diff(_offsets(b.column("teacher_lp")))
        k = self.enc.k if self.enc else 0
        want = n_gen * k
        t_ok = (n_tid == want) & (n_tlp == want)
        what = f"k={k} values per generated token" if k else "empty (teacher-less dataset)"
        add("alignment", bad(~t_ok),
            lambda i: f"teacher_ids has {n_tid[i]} values and teacher_lp {n_tlp[i]}; {n_gen[i]} generated tokens need {want[i]} ({what})")
        if self.enc is not None and t_ok.any():
            self._check_teacher(b, t_ok, n_gen, n_tid, n_tlp, ids, file)

        self._check_messages(b, ids, file)
        self._check_turns(b, ids, file, tok_off, n_tok, cs, mask_off, aligned)
        return int(n_tok.sum())

    def _check_teacher(self, b: pa.RecordBatch, t_ok: np.ndarray, n_gen: np.ndarray, n_tid: np.ndarray, n_tlp: np.ndarray,
                       ids: list, file: str) -> None:
        """Decode the teacher columns of the well-aligned rows (``t_ok``) and check what they hold."""
        k = self.enc.k
        cand = _values(b.column("teacher_ids")).astype(np.int64)
        codes = _values(b.column("teacher_lp")).astype(np.int64)
        pos_row = np.repeat(np.arange(len(ids)), np.where(t_ok, n_gen, 0))  # (N,) row of each position kept
        cand = cand[np.repeat(t_ok, n_tid)].reshape(-1, k)  # (N, K)
        q = np.cumsum(codes[np.repeat(t_ok, n_tlp)].reshape(-1, k), axis=1)  # (N, K) quantized -logprob
        flagged: dict[int, str] = {}
        if self.vocab:
            for p in np.flatnonzero((cand >= self.vocab).any(axis=1)):
                flagged.setdefault(pos_row[p], f"a candidate id ({cand[p].max()}) is outside the vocabulary ({self.vocab})")
        srt = np.sort(cand, axis=1)
        for p in np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1)):
            dup = srt[p, 1:][srt[p, 1:] == srt[p, :-1]][0]
            flagged.setdefault(pos_row[p], f"candidate id {dup} appears twice at one position: the top-k is not k distinct tokens")
        cov = np.exp(-q / self.enc.scale).sum(axis=1)  # (N,)
        for p in np.flatnonzero(cov > 1 + COVERAGE_TOL):
            flagged.setdefault(pos_row[p], f"stored probabilities of one position sum to {cov[p]:.3f} > 1")
        for r, detail in sorted(flagged.items()):
            self.out.add(file, "teacher", detail, ids[r])

    def _check_messages(self, b: pa.RecordBatch, ids: list, file: str) -> None:
        msgs = b.column("messages")
        off = _offsets(msgs)
        flat = pc.list_flatten(msgs)
        roles = flat.field("role").to_numpy(zero_copy_only=False).astype(str)  # (M,)
        content = flat.field("content")
        empty = pc.fill_null(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(content)), 0), True).to_numpy(zero_copy_only=False)
        row = _row_ids(off)  # (M,)
        n = np.diff(off)
        for r in np.flatnonzero(n == 0):
            self.out.add(file, "messages", "no messages", ids[r])
        has_sys = np.zeros(len(ids), bool)
        firsts = off[:-1][n > 0]
        has_sys[n > 0] = roles[firsts] == "system"
        j = np.arange(roles.size) - off[row] - has_sys[row]  # index after the optional system message
        expected = np.where(j % 2 == 0, "user", "assistant")
        wrong = (roles != expected) & (j >= 0)
        reported = set()
        for m in np.flatnonzero(wrong):
            if row[m] not in reported:
                reported.add(row[m])
                self.out.add(file, "messages", f"message {m - off[row[m]]} has role {roles[m]!r}, expected {expected[m]!r} "
                             "(roles must alternate user/assistant after an optional system message)", ids[row[m]])
        for m in np.flatnonzero(empty):
            if row[m] not in reported:
                reported.add(row[m])
                self.out.add(file, "messages", f"message {m - off[row[m]]} ({roles[m]}) is empty", ids[row[m]])

    def _check_turns(self, b, ids, file, tok_off, n_tok, cs, mask_off, aligned) -> None:
        turns = b.column("turns")
        off = _offsets(turns)
        flat = pc.list_flatten(turns)
        role = flat.field("role").to_numpy(zero_copy_only=False).astype(str)
        start = flat.field("start").to_numpy(zero_copy_only=False).astype(np.int64)
        end = flat.field("end").to_numpy(zero_copy_only=False).astype(np.int64)
        n_tokens = flat.field("n_tokens").to_numpy(zero_copy_only=False).astype(np.int64)
        row = _row_ids(off)
        n = np.diff(off)
        first = np.zeros(role.size, bool)
        first[off[:-1][n > 0]] = True
        prev_end = np.concatenate([[0], end[:-1]])
        prev_end[first] = 0
        broken = (start != prev_end) | (end < start)
        last_end = np.full(len(ids), 0)
        last_end[n > 0] = end[off[1:][n > 0] - 1]
        # masked tokens inside each turn (only meaningful where the mask is aligned and the span is in bounds)
        in_bounds = (start >= 0) & (end <= n_tok[row]) & (end >= start)
        g0 = mask_off[row] + np.clip(start, 0, None)
        g1 = mask_off[row] + np.clip(end, 0, None)
        ok_idx = in_bounds & aligned[row]
        masked = np.zeros(role.size, np.int64)
        masked[ok_idx] = cs[g1[ok_idx]] - cs[g0[ok_idx]]
        wrong_n = ok_idx & np.where(role == "assistant", masked != n_tokens, masked != 0)

        msgs = b.column("messages")
        m_off = _offsets(msgs)
        m_roles = pc.list_flatten(msgs).field("role").to_numpy(zero_copy_only=False).astype(str)
        reported = set()

        def flag(r: int, detail: str) -> None:
            if r not in reported:
                reported.add(r)
                self.out.add(file, "turns", detail, ids[r])

        for t in np.flatnonzero(broken | ~in_bounds):
            flag(row[t], f"turn {t - off[row[t]]} spans [{start[t]}, {end[t]}) which does not continue the previous turn "
                 f"inside the {n_tok[row[t]]} tokens")
        for r in np.flatnonzero((last_end != n_tok) & (n > 0)):
            flag(r, f"turns end at token {last_end[r]}, input_ids has {n_tok[r]}")
        for t in np.flatnonzero(wrong_n):
            flag(row[t], f"turn {t - off[row[t]]} ({role[t]}) says n_tokens={n_tokens[t]} but loss_mask marks {masked[t]} tokens in its span")
        for r in range(len(ids)):
            if r in reported:
                continue
            want = [x for x in m_roles[m_off[r]:m_off[r + 1]] if x != "system"]
            have = list(role[off[r]:off[r + 1]])
            if conversation_id(ids[r]) != ids[r] and have and have[0] == "user" and len(have) < len(want):
                want = want[len(want) - len(have):]  # the earlier messages are history inside the first user turn
            if want != have:
                flag(r, f"turn roles {have} do not follow the messages' roles {want}")


def _check_schema(name: str, pf: pq.ParquetFile, id_dtype: str, out: _Collector) -> bool:
    actual = pf.schema_arrow
    expected = shard_schema(id_dtype)
    ok = True
    for f in expected:
        idx = actual.get_field_index(f.name)
        if idx < 0:
            out.add(name, "schema", f"column {f.name!r} is missing")
            ok = False
        elif not actual.field(idx).type.equals(f.type):
            out.add(name, "schema", f"column {f.name!r} is {actual.field(idx).type}, expected {f.type}")
            ok = False
    extra = sorted(set(actual.names) - set(expected.names))
    if extra:
        out.add(name, "schema", f"unexpected column(s) {', '.join(extra)}")
    return ok


def validate_dataset(root: Path | str, checksums: bool = True) -> ValidationReport:
    """Run every check on the dataset folder ``root`` (local or an object-store URL) and return the report
    (never raises on bad data)."""
    folder = open_folder(root)
    report = ValidationReport(root=str(folder))
    out = _Collector(report)
    if not folder.is_file(MANIFEST):
        out.add(MANIFEST, "manifest", f"{folder} has no {MANIFEST}: not a distill dataset folder")
        return report
    try:
        manifest = json.loads(folder.read_bytes(MANIFEST))
    except (ValueError, UnicodeDecodeError) as exc:
        out.add(MANIFEST, "manifest", f"not valid JSON ({exc})")
        return report
    if not isinstance(manifest, dict) or not isinstance(manifest.get("shards", []), list):
        out.add(MANIFEST, "manifest", "not a distill manifest (no list of shards)")
        return report
    if manifest.get("format") != FORMAT:
        out.add(MANIFEST, "manifest", f"format is {manifest.get('format')!r}, expected {FORMAT!r}")
        return report
    unsafe = [p for i, entry in enumerate(manifest.get("shards", [])) if (p := shard_entry_problem(i, entry))]
    for problem in unsafe:  # nothing such an entry names is opened: it may lie outside the folder
        out.add(MANIFEST, "manifest", problem)
    if unsafe:
        return report
    meta = manifest.get("meta") or {}
    try:
        enc = manifest_encoding(meta)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        out.add(MANIFEST, "manifest", str(exc))
        return report
    id_dtype = enc.id_dtype if enc else "uint16"
    vocab = (meta.get("model") or {}).get("vocab_size")
    entries = [s for s in manifest.get("shards", []) if s.get("file")]
    listed = {s["file"] for s in entries}
    for name in folder.list("shard-*.parquet"):
        if SHARD_RE.match(name) and name not in listed:
            out.add(name, "shard_unlisted", "shard file is in the folder but not in the manifest")
    totals = manifest.get("totals") or {}
    for key, value in (("rows", sum(s.get("rows", 0) for s in entries)), ("shards", len(entries)),
                       ("prompt_tokens", sum(s.get("prompt_tokens", 0) for s in entries)),
                       ("generated_tokens", sum(s.get("generated_tokens", 0) for s in entries))):
        if key in totals and totals[key] != value:
            out.add(MANIFEST, "manifest", f"totals.{key} is {totals[key]}, the shard entries add up to {value}")

    rows = _RowChecker(enc, vocab, out)
    for entry in entries:
        name = entry["file"]
        report.shards += 1
        if not folder.is_file(name):
            out.add(name, "shard_missing", "listed in the manifest but missing from the folder")
            continue
        size = folder.size(name)
        if size != entry.get("bytes"):
            out.add(name, "size", f"{size} bytes, manifest says {entry.get('bytes')} (truncated or altered)")
        if checksums and folder.sha256(name) != entry.get("sha256"):
            out.add(name, "checksum", "SHA-256 differs from the manifest (the file was altered or damaged)")
        _check_shard(folder, name, entry, enc, id_dtype, rows, out, report)

    _check_rejects(folder, totals, out)
    return report


def _check_shard(folder: Folder, name: str, entry, enc, id_dtype, rows: _RowChecker, out: _Collector,
                 report: ValidationReport) -> None:
    try:
        pf = folder.parquet(name)
    except Exception as exc:  # noqa: BLE001 - any failure to open is the finding
        out.add(name, "unreadable", f"not a readable Parquet file ({exc})")
        return
    md = pf.schema_arrow.metadata or {}
    if META_KEY not in md:
        out.add(name, "metadata", "no 'distill' file metadata: not a distill shard")
    else:
        try:
            file_teacher = manifest_encoding(json.loads(md[META_KEY]))
            if file_teacher != enc:
                out.add(name, "metadata", f"teacher encoding {file_teacher} differs from the manifest's {enc}")
        except Exception as exc:  # noqa: BLE001
            out.add(name, "metadata", f"file metadata cannot be read ({exc})")
    if pf.metadata.num_rows != entry.get("rows"):
        out.add(name, "row_count", f"{pf.metadata.num_rows} rows, manifest says {entry.get('rows')}")
    if not _check_schema(name, pf, id_dtype, out):
        return
    n_rows = prompt = generated = 0
    batches = pf.iter_batches(batch_size=BATCH_ROWS, columns=ROW_COLUMNS)
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:  # noqa: BLE001 - a corrupt page is the finding
            out.add(name, "unreadable", f"reading failed after {n_rows} rows ({type(exc).__name__}: {exc})")
            report.rows += n_rows
            return
        if batch is None:
            break
        report.tokens += rows.check(name, batch)
        n_rows += batch.num_rows
        prompt += int(pc.sum(batch.column("n_prompt_tokens")).as_py() or 0)
        generated += int(pc.sum(batch.column("n_generated_tokens")).as_py() or 0)
    report.rows += n_rows
    if prompt != entry.get("prompt_tokens") or generated != entry.get("generated_tokens"):
        out.add(name, "token_count", f"rows hold {prompt} prompt + {generated} generated tokens, manifest says "
                f"{entry.get('prompt_tokens')} + {entry.get('generated_tokens')}")


def _check_rejects(folder: Folder, totals: dict, out: _Collector) -> None:
    """rejects.jsonl: JSON lines with an id and a reason, as many per reason as the manifest counted."""
    want = totals.get("rejects_by_reason")
    found: dict[str, int] = {}
    if not folder.is_file(REJECTS):
        if want:
            out.add(REJECTS, "rejects", f"missing, but the manifest counts {sum(want.values())} rejected rows")
        return
    with folder.open(REJECTS) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                if not isinstance(r, dict) or "id" not in r or "reason" not in r:
                    raise ValueError("needs 'id' and 'reason'")
            except ValueError as exc:
                out.add(REJECTS, "rejects", f"line {n} is not a reject record ({exc})")
                continue
            found[str(r["reason"])] = found.get(str(r["reason"]), 0) + 1
    if want is not None and found != want:
        diff = sorted(k for k in set(want) | set(found) if want.get(k, 0) != found.get(k, 0))
        out.add(REJECTS, "rejects", f"holds {sum(found.values())} records, the manifest counts {sum(want.values())} "
                f"(differs for: {', '.join(f'{k} {found.get(k, 0)} vs {want.get(k, 0)}' for k in diff)})")
