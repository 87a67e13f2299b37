"""`distill data inspect`: one real conversation with the teacher's view of each generated token."""

from __future__ import annotations

import json

import pytest

from conftest import run_distill
from distill.data.inspect import conversation_view, render_conversation
from distill.store import iter_rows

pytestmark = pytest.mark.vllm


def test_view_pairs_every_generated_token_with_teacher_probabilities(real_shards):
    from transformers import AutoTokenizer

    from distill.models import resolve_model

    row = list(iter_rows(real_shards))[4]
    view = conversation_view(real_shards, row_id=row["id"])
    assert view.index == 4 and view.teacher_k == 20
    assert [t.role for t in view.turns] == [t["role"] for t in row["turns"]]
    assert [t.role for t in view.turns][:2] == ["user", "assistant"]
    tok = AutoTokenizer.from_pretrained(resolve_model(None).path)
    for turn, msg in zip(view.turns, [m for m in row["messages"] if m["role"] != "system"]):
        assert turn.content == msg["content"]
        gen = [t for t in turn.tokens if t.generated]
        assert len(gen) == turn.n_tokens
        if turn.role == "assistant":
            assert tok.decode([t.id for t in gen], skip_special_tokens=True) == msg["content"]
        for t in gen:
            assert 0 < t.top1_p <= 1 and len(t.top) == 5
            if t.sampled_rank is not None:
                assert t.sampled_p <= t.top1_p + 1e-6
                if t.sampled_rank == 1:
                    assert t.sampled_p == t.top1_p
    assert sum(len(t.tokens) for t in view.turns) == len(row["input_ids"])


def test_inspect_cli_prints_json_and_names_a_missing_id(real_shards, cli_env):
    r = run_distill(["data", "inspect", str(real_shards), "--index", "2", "--json"], env=cli_env)
    assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)
    assert view["index"] == 2 and view["turns"][1]["role"] == "assistant"
    assert any(t["top1_p"] is not None for t in view["turns"][1]["tokens"])
    r = run_distill(["data", "inspect", str(real_shards), "--id", "nope:0"], env=cli_env)
    assert r.returncode == 2 and "no row with id 'nope:0'" in r.stderr


def test_terminal_view_shows_roles_and_colours_tokens_by_confidence(real_shards):
    from rich.console import Console

    view = conversation_view(real_shards, index=1)
    console = Console(record=True, width=100, force_terminal=True, color_system="truecolor")
    console.print(render_conversation(view))
    text = console.export_text(clear=False)
    assert view.id in text and "user" in text and "assistant" in text and "top-1 probability" in text
    assert view.turns[0].content in text
    styles = console.export_html(inline_styles=True)
    assert styles.count("color: #") > 10  # generated tokens carry confidence colours
