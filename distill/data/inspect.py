"""``distill data inspect``: one conversation with the teacher's view of every generated token.

Terms
-----
top-1 probability
    the teacher's probability of its most likely candidate at a generated position:
    how sure the model was of *some* token there (high = easy to predict, the
    positions Medusa heads get right).
sampled probability / rank
    the teacher's probability of the token actually in ``input_ids`` and its rank
    among the K stored candidates (``None`` when it is not among them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from distill.data.dataset import Dataset
from distill.errors import ConfigError, ModelError
from distill.store.teacher import decode_row_dense

TOP_SHOWN = 5  # candidates listed per token in the JSON view


@dataclass
class TokenView:
    id: int
    text: str
    generated: bool
    top1_p: float | None = None
    sampled_p: float | None = None
    sampled_rank: int | None = None  # 1-based rank among the K candidates
    top: list[tuple[str, float]] = field(default_factory=list)  # (text, probability), best first


@dataclass
class TurnView:
    role: str
    content: str
    n_tokens: int
    finish_reason: str | None
    tokens: list[TokenView]


@dataclass
class ConversationView:
    id: str
    source: str
    index: int  # row index in the dataset (manifest order)
    stop_reason: str
    system: str | None
    teacher_k: int  # 0 for a teacher-less dataset
    turns: list[TurnView]

    def to_dict(self) -> dict:
        return asdict(self)


def find_row(ds: Dataset, row_id: str | None = None, index: int | None = None) -> tuple[int, dict]:
    """Stream to the row with ``row_id`` (or at ``index``) and return (index, row)."""
    if (row_id is None) == (index is None):
        raise ConfigError("give exactly one of --id or --index")
    if index is not None and index < 0:
        raise ConfigError(f"--index must be >= 0; got {index}")
    seen = 0
    for batch in ds.iter_batches():
        if row_id is not None:
            pos = pc.index(batch.column("id"), row_id).as_py()
            if pos >= 0:
                return seen + pos, batch.slice(pos, 1).to_pylist()[0]
        elif index < seen + batch.num_rows:
            return index, batch.slice(index - seen, 1).to_pylist()[0]
        seen += batch.num_rows
    if row_id is not None:
        raise ConfigError(f"no row with id {row_id!r} in {ds.root}")
    raise ConfigError(f"--index {index} is out of range: {ds.root} has {seen} rows")


def load_tokenizer(ds: Dataset, model: str | None):
    """The tokenizer of ``model`` (default: the model recorded in the manifest), checked against the recorded hash.

    Inspect only decodes token ids, which the folder's ``tokenizer.json`` defines whole: where it has one,
    transformers' fast tokenizer is built from that file alone. ``AutoTokenizer`` would import the model
    classes and torch as well, several times the command's own work.
    """
    from transformers import PreTrainedTokenizerFast  # not AutoTokenizer here: even its import loads the model classes

    from distill.models import resolve_model, sha256_file

    recorded = ds.meta.get("model") or {}
    name = model or recorded.get("id")
    if not name:
        raise ConfigError(f"{ds.root} records no model; pass --model to decode its tokens")
    try:
        resolved = resolve_model(name)
    except ModelError as exc:
        raise ModelError(f"cannot load the tokenizer of {name!r} ({exc}); pass --model with a local folder") from None
    want = recorded.get("tokenizer_sha256")
    tok_file = resolved.path / "tokenizer.json"
    if want and tok_file.is_file() and sha256_file(tok_file)[:16] != want:
        raise ConfigError(f"the tokenizer of {name!r} differs from the one {ds.root} was made with; pass the right --model")
    if tok_file.is_file():
        return PreTrainedTokenizerFast(tokenizer_file=str(tok_file))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolved.path)


def conversation_view(root: Path | str, row_id: str | None = None, index: int | None = None, model: str | None = None,
                      tokenizer=None) -> ConversationView:
    """Find one row and pair every token with the teacher's probabilities (decoded by the one decode function)."""
    ds = Dataset.open(root)
    idx, row = find_row(ds, row_id, index)
    tok = tokenizer or load_tokenizer(ds, model)
    enc = ds.encoding
    input_ids = np.asarray(row["input_ids"], dtype=np.int64)  # (T,)
    mask = np.asarray(row["loss_mask"], dtype=bool)  # (T,)
    if enc is not None:
        cand, lp = decode_row_dense(row["input_ids"], row["loss_mask"], row["teacher_ids"], row["teacher_lp"], enc)  # (T, K)
        probs = np.exp(lp)  # (T, K); 0 where not generated
    texts = [tok.decode([int(t)]) for t in input_ids]
    cand_text: dict[int, str] = {}

    def text_of(t: int) -> str:
        if t not in cand_text:
            cand_text[t] = tok.decode([t])
        return cand_text[t]

    messages = [m for m in row["messages"] if m["role"] != "system"]
    system = next((m["content"] for m in row["messages"] if m["role"] == "system"), None)
    turns = []
    for n, t in enumerate(row["turns"]):
        tokens = []
        for pos in range(t["start"], t["end"]):
            tv = TokenView(int(input_ids[pos]), texts[pos], bool(mask[pos]))
            if enc is not None and mask[pos]:
                hit = np.flatnonzero(cand[pos] == input_ids[pos])
                tv.top1_p = round(float(probs[pos, 0]), 4)
                tv.sampled_p = round(float(probs[pos, hit[0]]), 4) if hit.size else None
                tv.sampled_rank = int(hit[0]) + 1 if hit.size else None
                tv.top = [(text_of(int(c)), round(float(p), 4)) for c, p in zip(cand[pos, :TOP_SHOWN], probs[pos, :TOP_SHOWN])]
            tokens.append(tv)
        # a row that continues a conversation (<id>#t<turn>) holds the earlier messages inside its first user turn
        shift = max(0, len(messages) - len(row["turns"]))
        content = messages[shift + n]["content"] if shift + n < len(messages) else ""
        turns.append(TurnView(t["role"], content, t["n_tokens"], t["finish_reason"], tokens))
    return ConversationView(row["id"], row["source"], idx, row["stop_reason"], system, enc.k if enc else 0, turns)


# -- terminal rendering (rich) ----------------------------------------------------------------
CONFIDENCE = ((0.8, "bold green"), (0.5, "green"), (0.3, "yellow"), (0.15, "dark_orange"), (0.0, "bold red"))


def _style(p: float) -> str:
    return next(style for lo, style in CONFIDENCE if p >= lo)


def render_conversation(view: ConversationView):
    """A rich renderable: one panel per turn; generated tokens coloured by the teacher's top-1 probability."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    parts = [Text.assemble(("id ", "bold"), view.id, ("  row ", "bold"), str(view.index), ("  stop ", "bold"),
                           view.stop_reason, ("  teacher k ", "bold"), str(view.teacher_k or "none"))]
    if view.teacher_k:
        legend = Text("top-1 probability: ")
        for lo, style in CONFIDENCE:
            legend.append(f" ≥{lo:.2f} ", style=style)
        legend.append("  underlined: sampled token is not the teacher's top-1", style="underline")
        parts.append(legend)
    if view.system:
        parts.append(Panel(Text(view.system), title="system", title_align="left", border_style="magenta"))
    for turn in view.turns:
        if turn.role == "user":
            parts.append(Panel(Text(turn.content), title="user", title_align="left", border_style="blue"))
            continue
        body = Text()
        gen = [t for t in turn.tokens if t.generated]
        for t in turn.tokens:
            if not t.generated:
                continue
            if t.top1_p is None:
                body.append(t.text, style="cyan")
            else:
                body.append(t.text, style=_style(t.top1_p) + ("" if t.sampled_rank == 1 else " underline"))
        subtitle = f"{turn.n_tokens} tokens, finish: {turn.finish_reason}"
        if gen and gen[0].top1_p is not None:
            mean = float(np.mean([t.top1_p for t in gen]))
            subtitle += f", mean top-1 p {mean:.2f}"
        parts.append(Panel(body, title="assistant", title_align="left", subtitle=subtitle, subtitle_align="right",
                           border_style="green"))
    return Group(*parts)
