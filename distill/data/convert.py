"""``distill data convert``: shards to other formats, and seed data to (teacher-less) shards.

Exports (``to``)
----------------
``sharegpt``
    one JSON array of ``{"id", "conversations": [{"from": "system|human|gpt", "value"}]}``.
``openai``
    JSON lines of ``{"id", "messages": [{"role", "content"}]}`` (OpenAI chat format; the
    extra ``id`` keeps the resume key and is read back by ``distill generate --seed``).
``hf``
    a ``datasets`` dataset saved with ``save_to_disk`` (every column, teacher included).
``trl``
    a folder of Parquet files (one per shard, ``datasets.load_dataset("parquet", data_dir=OUT)``)
    in the shape TRL's trainers read: ``messages`` (conversational), ``input_ids``,
    ``assistant_masks`` (1 where the model generated the token, TRL's name for the loss mask)
    and the teacher top-k decoded into plain nested lists aligned with ``input_ids``:
    ``teacher_topk_ids[t]`` / ``teacher_topk_logprobs[t]`` are the K candidates of the
    distribution token t was drawn from (empty lists where the token was not generated).
``specforge``
    JSON lines of ``{"id", "conversations": [{"role", "content"}]}``, the conversation
    format SpecForge's EAGLE-3 scripts read.

The message-only exports (``sharegpt``, ``openai``, ``specforge``) write one entry per
conversation: a conversation stored as several rows (a chat template that re-renders the
history, ``distill generate``) is its last row, whose messages hold all of it, under the
conversation's id. ``hf`` and ``trl`` keep every row (each is its own training sequence).

Import (``to="shards"``)
------------------------
Any seed the seed readers accept (registered name, file, ``hf:`` dataset) is
tokenized with the model's chat template at the token level (same joining as
``distill generate``) into shard rows whose ``loss_mask`` marks the assistant
tokens (their content and the end-of-turn token) and whose teacher columns are
empty (``meta.teacher`` null): the data trains with hard targets. The seed's own
assistant replies are kept; a trailing user turn with no reply is dropped (counted
as ``trailing_user_turns``), and a conversation with no assistant reply is rejected
(``no_assistant_turn``) into ``rejects.jsonl`` with the seed rejects. A chat template
that re-renders the history (a Qwen3-style template drops earlier ``<think>`` blocks)
gives one row per such turn, as in ``distill generate``: ``<id>#t<turn>`` starts from the
whole rendered prompt, so each row holds the tokens the model would be prompted with.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import distill
from distill.conversation import Rejection, conversation_id, turn_row_id
from distill.data.dataset import Dataset
from distill.data.write import DEFAULT_SHARD_ROWS, ShardWriter, check_new_output
from distill.store.atomic import StagedFolder, atomic_file
from distill.errors import check_choice

EXPORTS = ("sharegpt", "openai", "hf", "trl", "specforge")
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


@dataclass
class ConvertSummary:
    to: str
    out: str
    rows: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    trailing_user_turns: int = 0

    def to_dict(self) -> dict:
        return self.__dict__.copy()


def export(inp: Path | str, to: str, out: Path | str) -> ConvertSummary:
    """Write the dataset ``inp`` as ``to`` (see the module's exports) at ``out``, streaming row batches."""
    # the command line's --format also takes ``shards``, which it sends to seed_to_shards instead
    check_choice("--format", to, EXPORTS, listed=EXPORTS + ("shards",), repr_value=True)
    d = Dataset.open(inp)
    check_new_output(out, [d.root])
    out = Path(out)
    summary = ConvertSummary(to, str(out))
    if to == "hf":
        return _export_hf(d, out, summary)
    if to == "trl":
        return _export_trl(d, out, summary)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        if to == "sharegpt":
            f.write("[\n")
        for row in d.iter_rows(["id", "messages", "stop_reason"]):
            if row["stop_reason"] == "continued":  # a later row of the conversation holds all of its messages
                continue
            row["id"] = conversation_id(row["id"])
            if to == "sharegpt":
                conv = [{"from": SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in row["messages"]]
                f.write((",\n" if summary.rows else "") + json.dumps({"id": row["id"], "conversations": conv}, ensure_ascii=False))
            elif to == "specforge":
                f.write(json.dumps({"id": row["id"], "conversations": row["messages"]}, ensure_ascii=False) + "\n")
            else:
                f.write(json.dumps({"id": row["id"], "messages": row["messages"]}, ensure_ascii=False) + "\n")
            summary.rows += 1
        if to == "sharegpt":
            f.write("\n]\n")
    return summary


def _export_trl(d: Dataset, out: Path, summary: ConvertSummary) -> ConvertSummary:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from distill.store.teacher import decode_row_dense

    enc = d.encoding
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    schema = pa.schema([("id", pa.string()), ("messages", pa.list_(message)), ("input_ids", pa.list_(pa.int32())),
                        ("assistant_masks", pa.list_(pa.int8())), ("teacher_topk_ids", pa.list_(pa.list_(pa.int32()))),
                        ("teacher_topk_logprobs", pa.list_(pa.list_(pa.float32())))])
    cols = ["id", "messages", "input_ids", "loss_mask", "teacher_ids", "teacher_lp"]
    with StagedFolder(out) as stage:
        for n, name in enumerate(d.shards):
            rows = []
            for batch in d.shard_batches(name, cols):
                for row in batch.to_pylist():
                    mask = np.asarray(row["loss_mask"], dtype=bool)  # (T,)
                    ids = lps = [[] for _ in mask]
                    if enc is not None:
                        dense_ids, dense_lp = decode_row_dense(row["input_ids"], row["loss_mask"], row["teacher_ids"],
                                                               row["teacher_lp"], enc)  # (T, K) each
                        ids = [r.tolist() if m else [] for r, m in zip(dense_ids, mask)]
                        lps = [r.tolist() if m else [] for r, m in zip(dense_lp, mask)]
                    rows.append({"id": row["id"], "messages": row["messages"], "input_ids": row["input_ids"],
                                 "assistant_masks": mask.astype(np.int8).tolist(), "teacher_topk_ids": ids,
                                 "teacher_topk_logprobs": lps})
            pq.write_table(pa.Table.from_pylist(rows, schema=schema), stage.path / f"train-{n:05d}.parquet", compression="zstd")
            summary.rows += len(rows)
    return summary


def _export_hf(d: Dataset, out: Path, summary: ConvertSummary) -> ConvertSummary:
    import datasets

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.hf-cache-", dir=out.parent) as cache:
        ds = datasets.Dataset.from_parquet([str(p) for p in d.files], cache_dir=cache)
        with StagedFolder(out) as stage:
            ds.save_to_disk(str(stage.path))
        summary.rows = ds.num_rows
    return summary


def seed_to_shards(seed: str, out: Path | str, model: str | None = None, seed_format: str | None = None,
                   limit: int | None = None, shard_rows: int = DEFAULT_SHARD_ROWS, chat_template: str | None = None,
                   chat_template_kwargs: dict | str | None = None) -> ConvertSummary:
    """Tokenize a seed's conversations (their own assistant replies) into teacher-less shards, with the chat template
    ``chat_template`` (a file or the template; None: the model's) and its extra variables ``chat_template_kwargs``."""
    from transformers import AutoConfig, AutoTokenizer

    from distill.templating import ChatFormat
    from distill.models import load_chat_template, model_record, resolve_model, stop_token_ids
    from distill.models import chat_template_kwargs as parse_kwargs
    from distill.seeds import load_seed

    template, kwargs = load_chat_template(chat_template), parse_kwargs(chat_template_kwargs)
    check_new_output(out)
    out = Path(out)
    resolved = resolve_model(model)
    source = load_seed(seed, seed_format)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    cfg = AutoConfig.from_pretrained(resolved.path)
    vocab = int(getattr(cfg, "vocab_size", 0) or cfg.get_text_config().vocab_size)
    fmt = ChatFormat(tokenizer, stop_token_ids(tokenizer, resolved.path), template, kwargs)
    meta = {
        "format": "distill-shards/v1",
        "tool": f"distill {distill.__version__}",
        "model": model_record(resolved, vocab, fmt.template),
        "sampling": None,
        "teacher": None,
        "backend": None,
        "seed": source.public_record(),
        "generation": {"mode": "seed-replies", "limit": limit,
                       "note": "assistant turns are the seed's own text, not generated",
                       "chat_template": template, "chat_template_kwargs": kwargs},
        "derived": {"op": "convert", "tool": f"distill {distill.__version__}", "from": None},
    }
    summary = ConvertSummary("shards", str(out))
    with ShardWriter(out, meta, "uint16", shard_rows) as w:
        for index, item in enumerate(source):
            if limit is not None and index >= limit:
                break
            if isinstance(item, Rejection):
                w.rejects.append(item.to_dict())
                summary.rejected[item.reason] = summary.rejected.get(item.reason, 0) + 1
                continue
            rows, dropped = conversation_rows(item, fmt)
            if not rows:
                w.rejects.append({"id": item.id, "source": item.source, "stage": "convert", "reason": "no_assistant_turn",
                                  "detail": "the seed conversation has no assistant reply to train on"})
                summary.rejected["no_assistant_turn"] = summary.rejected.get("no_assistant_turn", 0) + 1
                continue
            summary.trailing_user_turns += dropped
            for row in rows:
                w.add(row)
        w.close()
        summary.rows = w.count
    return summary


def conversation_rows(conv, fmt) -> tuple[list[dict], int]:
    """One seed conversation as teacher-less shard rows (one, or one per turn whose prompt re-renders the history),
    and the number of trailing user turns dropped."""
    msgs = [m.to_dict() for m in conv.messages]
    last_asst = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    if last_asst is None:
        return [], 0
    dropped = len(msgs) - 1 - last_asst
    msgs = msgs[: last_asst + 1]
    rows: list[dict] = []
    history: list[dict] = [msgs[0]] if msgs[0]["role"] == "system" else []
    ids: list[int] = []
    mask: list[bool] = []
    turns: list[dict] = []
    text = ""  # the stream text of ids (distill.templating's terms)
    n_assistant = row_start = 0
    for m in msgs[len(history):]:
        if m["role"] == "user":
            prompt = fmt.prompt(history + [m])
            delta = fmt.delta(text, prompt) if ids else None
            if ids and delta is None:  # the template re-renders the history: the next row starts here
                rows.append(_seed_row(conv, history, ids, mask, turns, row_start, "continued"))
                ids, mask, turns, text, row_start = [], [], [], "", n_assistant
            piece = prompt if delta is None else delta
            start = len(ids)
            ids += fmt.encode(piece)
            mask += [False] * (len(ids) - start)
            text += piece
            turns.append({"role": "user", "start": start, "end": len(ids), "n_tokens": 0, "finish_reason": None})
        else:
            start = len(ids)
            reply = fmt.encode(m["content"])
            closing = fmt.encode(fmt.assistant_suffix)
            # The end-of-turn token (the stop token that opens the suffix) is a target: the model must learn to stop.
            n_stop = 1 if closing and closing[0] in fmt.stop_ids else 0
            ids += reply + closing
            mask += [True] * (len(reply) + n_stop) + [False] * (len(closing) - n_stop)
            text += m["content"] + fmt.assistant_suffix
            turns.append({"role": "assistant", "start": start, "end": len(ids), "n_tokens": len(reply) + n_stop,
                          "finish_reason": "stop"})
            n_assistant += 1
        history.append(m)
    rows.append(_seed_row(conv, history, ids, mask, turns, row_start, "completed"))
    return rows, dropped


def _seed_row(conv, messages: list[dict], ids: list[int], mask: list[bool], turns: list[dict], row_start: int,
              stop_reason: str) -> dict:
    n_gen = sum(mask)
    return {"id": turn_row_id(conv.id, row_start), "source": conv.source, "messages": list(messages), "input_ids": ids,
            "loss_mask": mask, "teacher_ids": [], "teacher_lp": [], "turns": turns, "stop_reason": stop_reason,
            "n_prompt_tokens": len(ids) - n_gen, "n_generated_tokens": n_gen}
