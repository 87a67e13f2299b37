"""`distill data stats`: the numbers match an independent pass over the real shards; charts are written."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from conftest import run_distill
from distill.data.stats import Histogram, compute_stats, teacher_position_stats
from distill.store import TeacherEncoding, decode_row_dense, iter_rows, load_manifest


def test_position_stats_on_a_known_distribution():
    enc = TeacherEncoding(k=2, id_dtype="uint16")
    q = np.rint(-np.log([[0.5, 0.25], [1.0, 1e-30]]) * enc.scale).clip(0, 65535).astype(np.int64)  # (2, 2)
    codes = np.concatenate([q[:, :1], np.diff(q, axis=1)], axis=1).astype(np.uint16).reshape(-1)
    top1, entropy, coverage = teacher_position_stats(codes, enc)
    assert coverage[0] == pytest.approx(0.75, abs=1e-3)
    assert top1[0] == pytest.approx(0.5, abs=1e-3)
    # K candidates plus one tail bucket of 0.25: -(0.5 ln 0.5 + 0.25 ln 0.25 + 0.25 ln 0.25)
    assert entropy[0] == pytest.approx(-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)), abs=2e-3)
    assert top1[1] == pytest.approx(1.0) and entropy[1] == pytest.approx(0.0, abs=1e-3)


def test_histogram_quantiles_interpolate_inside_bins():
    h = Histogram(0, 100, 10)
    h.add(np.arange(100, dtype=float))
    assert h.total == 100
    assert h.quantile(0.5) == pytest.approx(50, abs=1)
    h.add(np.array([-5.0, 1e9]))  # clipped into the end bins
    assert h.counts[0] == 11 and h.counts[-1] == 11


@pytest.mark.vllm
def test_stats_match_an_independent_pass_over_real_shards(real_shards):
    st = compute_stats(real_shards)
    manifest = load_manifest(real_shards)
    totals = manifest["totals"]
    assert (st.rows, st.conversations, st.continued_rows, st.shards) == (16, 16, 0, 3)
    assert (st.prompt_tokens, st.generated_tokens) == (totals["prompt_tokens"], totals["generated_tokens"])
    enc = TeacherEncoding.from_dict(manifest["meta"]["teacher"])
    top1, cover, turns, finishes = [], [], 0, {}
    for row in iter_rows(real_shards):
        _, lp = decode_row_dense(row["input_ids"], row["loss_mask"], row["teacher_ids"], row["teacher_lp"], enc)
        p = np.exp(lp[np.asarray(row["loss_mask"])])  # (N, K)
        top1 += p[:, 0].tolist()
        cover += p.sum(1).tolist()
        for t in row["turns"]:
            if t["role"] == "assistant":
                turns += 1
                finishes[t["finish_reason"]] = finishes.get(t["finish_reason"], 0) + 1
    t = st.teacher
    assert t.k == enc.k and t.positions == st.generated_tokens == len(top1)
    assert t.top1.mean == pytest.approx(np.mean(top1), rel=1e-6)
    assert t.coverage.mean == pytest.approx(np.mean(cover), rel=1e-6)
    assert 0 < t.coverage.min and t.coverage.max <= 1.01
    assert 0 <= t.entropy.min and t.entropy.max <= math.log(enc.k + 1) + 1e-6
    assert st.assistant_turns == turns and st.finish_reasons == finishes
    assert sum(st.stop_reasons.values()) == 16
    assert st.turn_len.count == turns and st.turn_len.total == st.generated_tokens
    assert 0 < t.sampled_rank1 <= t.sampled_in_topk <= t.positions


@pytest.mark.vllm
def test_stats_cli_writes_json_and_png_charts(real_shards, tmp_path, cli_env):
    plots = tmp_path / "plots"
    r = run_distill(["data", "stats", str(real_shards), "--json", "--plot", str(plots)], env=cli_env)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["conversations"] == 16 and summary["teacher"]["k"] == 20
    assert summary["teacher"]["topk_coverage"]["mean"] <= 1.0
    assert json.loads((plots / "stats.json").read_text()) == summary
    for name in ("lengths.png", "teacher.png"):
        data = (plots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    table = run_distill(["data", "stats", str(real_shards)], env=cli_env)
    assert table.returncode == 0 and "top-k coverage" in table.stdout
