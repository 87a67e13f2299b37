"""The teacher top-k encoding: compact, exact ids, bounded logprob error.

Terms
-----
generated position
    an index ``t`` of ``input_ids`` whose token the teacher sampled
    (``loss_mask[t]`` is true).
teacher top-k at t
    the K most likely ids of the distribution the teacher sampled ``input_ids[t]``
    from (the model's output at position t-1), with their log-probabilities under
    the *unmodified* distribution (before temperature / top-p), sorted by
    decreasing logprob (rank order).

Encoding ``rankgap-u16`` (version 1)
-----------------------------------
Per row, two flat list columns hold ``n_generated * K`` values in position-major,
rank-minor order:

``teacher_ids``
    the candidate ids as ``uint16`` when the vocabulary fits in 16 bits, else
    ``uint32`` (recorded as ``id_dtype``). Exact.
``teacher_lp``
    ``uint16`` codes. Each logprob is quantized to ``q = round(-logprob * SCALE)``
    (clipped to ``0..65535``, i.e. logprobs below ``-65535/SCALE`` ≈ -64 nats are
    stored as that floor). Because candidates are in rank order, ``q`` never
    decreases along a position, so the first code is ``q_0`` and each later code is
    the gap ``q_i - q_{i-1}`` (always ≥ 0 and mostly < 256). Decoding is a cumulative
    sum, so gaps never accumulate error: every logprob is within ``1 / (2*SCALE)``
    nats (0.49 mnat) of the original.

Why: ids are incompressible at ~15 bits and must be exact, so they take 2 bytes;
the logprob gaps have a near-zero high byte that zstd squeezes to almost nothing,
so a (token, candidate) pair costs ~2.5 bytes on disk instead of the 6 of a naive
int32 id + fp16 logprob, at 40x better precision than fp16 has near -20.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

ENCODING_NAME = "rankgap-u16"
ENCODING_VERSION = 1
SCALE = 1024.0  # quantization steps per nat
_QMAX = np.iinfo(np.uint16).max


@dataclass(frozen=True)
class TeacherEncoding:
    """What a reader needs to decode the teacher columns (stored in file metadata)."""

    k: int
    id_dtype: str  # "uint16" | "uint32"
    name: str = ENCODING_NAME
    version: int = ENCODING_VERSION
    scale: float = SCALE
    logprob_mode: str = "raw"  # the logprobs are the unmodified model distribution's (before temperature / top-p)

    @classmethod
    def for_vocab(cls, k: int, vocab_size: int) -> "TeacherEncoding":
        return cls(k=k, id_dtype="uint16" if vocab_size <= 1 << 16 else "uint32")

    @classmethod
    def from_dict(cls, d: dict) -> "TeacherEncoding":
        enc = cls(**d)
        if enc.logprob_mode != "raw":
            raise ValueError(f"teacher logprob mode {enc.logprob_mode!r}: this distill reads raw (unmodified) logprobs only")
        if enc.name != ENCODING_NAME or enc.version != ENCODING_VERSION:
            raise ValueError(f"unknown teacher encoding {enc.name} v{enc.version}; this distill reads {ENCODING_NAME} v{ENCODING_VERSION}")
        return enc

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def max_error(self) -> float:
        """Largest absolute logprob error of a stored value above the floor, in nats."""
        return 0.5 / self.scale


def encode_topk(ids: np.ndarray, logprobs: np.ndarray, enc: TeacherEncoding) -> tuple[np.ndarray, np.ndarray]:
    """Encode one row's teacher top-k.

    ids, logprobs: (N, K) for N generated positions, candidates in rank order
    (logprobs non-increasing along K). Returns the flat ``teacher_ids`` and
    ``teacher_lp`` arrays, each (N*K,).
    """
    ids = np.asarray(ids)
    logprobs = np.asarray(logprobs)
    if ids.shape != logprobs.shape or ids.ndim != 2 or ids.shape[1] != enc.k:
        raise ValueError(f"teacher top-k must be (N, {enc.k}); got ids {ids.shape}, logprobs {logprobs.shape}")
    # Scaled by a power of two, float32 logprobs stay exact in float32: the codes are those float64 gives, at half
    # the memory traffic. Other dtypes, or another scale, go through float64.
    if logprobs.dtype != np.float32 or math.frexp(enc.scale)[0] != 0.5:
        logprobs = logprobs.astype(np.float64)
    q = np.rint(logprobs * -enc.scale)  # (N, K)
    np.clip(q, 0, _QMAX, out=q)
    q = q.astype(np.int32)
    codes = np.empty_like(q)  # (N, K): the first code, then the gaps
    codes[:, :1] = q[:, :1]
    np.subtract(q[:, 1:], q[:, :-1], out=codes[:, 1:])
    if (codes[:, 1:] < 0).any():
        raise ValueError("teacher candidates must be in rank order (non-increasing logprob)")
    return ids.astype(enc.id_dtype).reshape(-1), codes.astype(np.uint16).reshape(-1)


def decode_topk(teacher_ids, teacher_lp, enc: TeacherEncoding) -> tuple[np.ndarray, np.ndarray]:
    """The one decode function: flat stored columns -> (ids (N, K) int64, logprobs (N, K) float32)."""
    ids = np.asarray(teacher_ids, dtype=np.int64)
    codes = np.asarray(teacher_lp, dtype=np.int64)
    if ids.shape != codes.shape or ids.size % enc.k:
        raise ValueError(f"teacher columns have {ids.size} ids and {codes.size} codes; both must be a multiple of k={enc.k}")
    ids = ids.reshape(-1, enc.k)  # (N, K)
    q = np.cumsum(codes.reshape(-1, enc.k), axis=1)  # (N, K)
    return ids, (-q / enc.scale).astype(np.float32)


def decode_row_dense(input_ids, loss_mask, teacher_ids, teacher_lp, enc: TeacherEncoding) -> tuple[np.ndarray, np.ndarray]:
    """Teacher top-k aligned 1:1 with ``input_ids``: (T, K) ids and logprobs.

    Row t holds the candidates for token ``input_ids[t]``; positions the teacher
    did not generate have ids -1 and logprobs -inf.
    """
    mask = np.asarray(loss_mask, dtype=bool)
    ids, lps = decode_topk(teacher_ids, teacher_lp, enc)
    if len(mask) != len(input_ids) or ids.shape[0] != int(mask.sum()):
        raise ValueError(
            f"teacher columns hold {ids.shape[0]} positions but loss_mask marks {int(mask.sum())} of {len(input_ids)} tokens"
        )
    dense_ids = np.full((len(mask), enc.k), -1, dtype=np.int64)
    dense_lp = np.full((len(mask), enc.k), -np.inf, dtype=np.float32)
    dense_ids[mask] = ids
    dense_lp[mask] = lps
    return dense_ids, dense_lp


def manifest_encoding(meta: dict) -> TeacherEncoding | None:
    """The teacher encoding a dataset's ``meta`` records; ``None`` for a dataset without a teacher.

    Datasets made by ``distill data convert --format shards`` from seed text have
    ``meta.teacher = null`` and empty teacher columns: they train with hard targets only.
    """
    teacher = meta.get("teacher")
    if not teacher or not teacher.get("k"):
        return None
    try:
        return TeacherEncoding.from_dict(teacher)
    except (TypeError, ValueError) as exc:
        from distill.errors import StoreError

        raise StoreError(f"manifest meta.teacher cannot be read ({exc}); this dataset was written by another tool") from None
