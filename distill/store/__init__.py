"""Shard store: Parquet rows with teacher top-k, manifest, resume (see docs/architecture.md)."""

from distill.store.shards import (
    MANIFEST,
    REJECTS,
    ShardInfo,
    ShardStore,
    iter_rows,
    iter_token_rows,
    load_manifest,
    read_shard_meta,
    shard_files,
    shard_schema,
)
from distill.store.teacher import TeacherEncoding, decode_row_dense, decode_topk, encode_topk, manifest_encoding

__all__ = [
    "MANIFEST", "REJECTS", "ShardInfo", "ShardStore", "TeacherEncoding", "decode_row_dense", "decode_topk",
    "encode_topk", "iter_rows", "iter_token_rows", "manifest_encoding", "load_manifest", "read_shard_meta", "shard_files", "shard_schema",
]
