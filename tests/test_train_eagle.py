"""EAGLE-3 drafter training: the drafter on a tiny random Llama, the TTT unroll, draft-vocabulary maps and losses,
then real training on the self-distilled shards (loss goes down, resume is exact, the folder is vLLM's layout)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from distill.errors import ConfigError, ModelError
from distill.heads.eagle import DrafterConfig, EagleDrafter, parse_aux_layers
from distill.heads.vocab import DraftVocab
from distill.train import TrainConfig, read_metrics, train
from distill.train.draft_vocab import choose_draft_vocab
from distill.train.eagle import step0_keep, ttt_keep_mask, unroll
from distill.train.losses import Term, chunked_term_losses, soft_ce, teacher_buckets
from helpers import tiny_llama_config

H, V, LAYERS = 32, 50, 4
V_MODEL = 49152  # the bundled model's vocabulary


def _tiny_target():
    return tiny_llama_config(hidden=H, intermediate=64, heads=4, kv_heads=2, layers=LAYERS, vocab=V, positions=128)


def _tiny_drafter(vocab: DraftVocab | None = None, dtype=torch.float64) -> EagleDrafter:
    torch.manual_seed(0)
    vocab = vocab or DraftVocab.from_target_ids(range(0, V, 2), V)
    conf = DrafterConfig.for_target(_tiny_target().to_dict(), [1, 2, 3], vocab.size)
    return EagleDrafter(conf, vocab).to(dtype)


# -- the drafter -------------------------------------------------------------------------------
def test_drafter_reads_2h_into_qkv_fuses_three_layers_and_scores_the_draft_vocabulary():
    d = _tiny_drafter()
    attn = d.midlayer.self_attn
    assert d.fc.weight.shape == (H, 3 * H)
    assert attn.q_proj.weight.shape == (4 * 8, 2 * H) and attn.k_proj.weight.shape == (2 * 8, 2 * H)
    assert attn.v_proj.weight.shape == (2 * 8, 2 * H) and attn.o_proj.weight.shape == (H, 4 * 8)
    assert d.lm_head.weight.shape == (V // 2, H)
    B, T = 2, 5
    feature = d.fuse(torch.randn(B, T, 3 * H, dtype=torch.float64))  # (B, T, H)
    out = d(torch.randn(B, T, H, dtype=torch.float64), feature, torch.arange(T).expand(B, T))
    assert out.shape == (B, T, H) and d.logits(out).shape == (B, T, V // 2)
    assert set(d.state_dict_vllm()) == {
        "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
        *(f"midlayer.self_attn.{n}_proj.weight" for n in "qkvo"), *(f"midlayer.mlp.{n}_proj.weight" for n in ("gate", "up", "down")),
        "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
    }


def test_a_fresh_drafter_starts_as_the_targets_tempered_logit_lens_at_its_highest_aux_layer():
    from distill.heads.eagle import INIT_LENS_TEMPERATURE
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    target = LlamaForCausalLM(_tiny_target()).double().eval()
    vocab = DraftVocab.from_target_ids([3, 4, 9, 30], V)
    d = EagleDrafter(DrafterConfig.for_target(target.config.to_dict(), [1, 2, 3], vocab.size), vocab).double()
    d.init_from_target(target.get_output_embeddings().weight, target.model.norm.weight)
    ids = torch.randint(0, V, (2, 6))
    with torch.no_grad():
        hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i] for i in (1, 2, 3)], -1)
        out = d(target.model.embed_tokens(ids), d.fuse(aux), torch.arange(6).expand(2, 6))
        lens = target.lm_head(target.model.norm(hs[3]))[..., vocab.target_ids] / INIT_LENS_TEMPERATURE
    assert torch.allclose(d.logits(out), lens, atol=1e-10)


def test_drafter_output_is_causal_in_its_positions():
    d = _tiny_drafter()
    B, T = 1, 6
    e, g = torch.randn(B, T, H, dtype=torch.float64), torch.randn(B, T, H, dtype=torch.float64)
    pos = torch.arange(T)[None]
    out = d(e, g, pos)
    e2 = e.clone()
    e2[:, 4:] += 1.0  # change the future
    out2 = d(e2, g, pos)
    assert torch.allclose(out[:, :4], out2[:, :4]) and not torch.allclose(out[:, 4:], out2[:, 4:])


def test_drafter_folder_is_vllm_eagle3_config_and_round_trips(tmp_path):
    d = _tiny_drafter(dtype=torch.float32)
    d.save(tmp_path / "d", extra={"arch": "eagle3"})
    conf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["model_type"] == "llama"
    assert conf["num_hidden_layers"] == 1 and conf["draft_vocab_size"] == V // 2 and conf["vocab_size"] == V
    assert conf["target_hidden_size"] == H and conf["tie_word_embeddings"] is False
    assert conf["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}
    assert "arch" not in conf  # our fields stay in distill-heads.json
    back = EagleDrafter.load(tmp_path / "d")
    a, b = d.state_dict(), back.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert back.vocab.target_ids.tolist() == list(range(0, V, 2))


def test_a_full_vocabulary_drafter_stores_no_d2t(tmp_path):
    d = _tiny_drafter(DraftVocab.full(V), dtype=torch.float32)
    assert "d2t" not in d.state_dict_vllm() and "t2d" not in d.state_dict_vllm()
    d.save(tmp_path / "d")
    assert EagleDrafter.load(tmp_path / "d").vocab.is_full


def test_aux_layers_default_to_vllms_choice_and_bad_ids_are_config_errors():
    assert parse_aux_layers("auto", 30) == [2, 15, 27]
    assert parse_aux_layers("1,3", 4) == [1, 3]
    for bad in ("3,1", "1,4", "x", "2,2"):
        with pytest.raises(ConfigError, match="--aux-layers"):
            parse_aux_layers(bad, 4)
    with pytest.raises(ConfigError, match="--aux-layers"):
        parse_aux_layers("auto", 4)
    with pytest.raises(ConfigError, match="Llama-architecture"):
        DrafterConfig.for_target({**_tiny_target().to_dict(), "model_type": "qwen2"}, [1], V)


# -- training-time test --------------------------------------------------------------------------
def test_ttt_mask_sees_step0_causally_inside_the_window_and_its_own_chain():
    att = torch.tensor([[1, 1, 1, 1, 0]])
    seg = torch.tensor([[0, 0, 1, 1, -1]])
    keep0 = step0_keep(att, seg)[0]
    assert keep0.tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],  # a new window: not its predecessor's keys
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],  # padding keeps only itself (no empty softmax row)
    ]
    m = ttt_keep_mask(keep0[None], 2)[0, 0]  # (T, 3T)
    assert m.shape == (5, 15)
    assert torch.equal(m[:, :5], keep0) and torch.equal(m[:, 5:10], torch.eye(5, dtype=torch.bool))
    assert torch.equal(m[:, 10:], torch.eye(5, dtype=torch.bool))


def test_ttt_unroll_equals_step_by_step_drafting_with_a_kv_cache():
    """Step j of the unroll at position t is what an engine drafts at depth j+1 from t: prefill the drafter cache on
    the target features of 0..t, then feed its own output back one token at a time (positions t+1, t+2, ...)."""
    from transformers import DynamicCache

    d = _tiny_drafter()
    B, T, steps = 2, 8, 3
    emb = torch.randn(B, T, H, dtype=torch.float64)  # target embedding of token x_t at t
    feature = d.fuse(torch.randn(B, T, 3 * H, dtype=torch.float64))
    pos = torch.arange(T).expand(B, T)
    outs = unroll(d, feature, emb, pos, step0_keep(torch.ones(B, T, dtype=torch.long)), steps)
    for t in (0, 3, 4):
        cache = DynamicCache()
        prefill = d(emb[:, 1 : t + 2], feature[:, : t + 1], pos[:, : t + 1], None, cache)  # (B, t+1, H)
        assert torch.allclose(prefill[:, t], outs[0][:, t], atol=1e-12)
        g = prefill[:, t : t + 1]
        for j in range(1, steps):
            mask = torch.ones(B, 1, 1, cache.get_seq_length() + 1, dtype=torch.bool)
            g = d(emb[:, t + 1 + j : t + 2 + j], g, pos[:, t : t + 1] + j, mask, cache)  # depth j+1
            assert torch.allclose(g[:, 0], outs[j][:, t], atol=1e-12), (t, j)
    # a later step depends on the earlier step's output, not on the target feature at that position alone
    moved = unroll(d, feature + 0.5 * torch.randn_like(feature) * (torch.arange(T) == 3)[None, :, None], emb, pos,
                   step0_keep(torch.ones(B, T, dtype=torch.long)), steps)
    assert not torch.allclose(moved[1][:, 3], outs[1][:, 3]) and torch.allclose(moved[1][:, 2], outs[1][:, 2])


def test_packed_rows_unroll_like_their_windows_alone():
    d = _tiny_drafter()
    a, b = torch.randn(1, 4, H, dtype=torch.float64), torch.randn(1, 3, H, dtype=torch.float64)
    fa, fb = torch.randn(1, 4, H, dtype=torch.float64), torch.randn(1, 3, H, dtype=torch.float64)
    packed = unroll(d, torch.cat([fa, fb], 1), torch.cat([a, b], 1), torch.tensor([[0, 1, 2, 3, 0, 1, 2]]),
                    step0_keep(torch.ones(1, 7, dtype=torch.long), torch.tensor([[0, 0, 0, 0, 1, 1, 1]])), 2)
    alone = unroll(d, fa, a, torch.arange(4)[None], step0_keep(torch.ones(1, 4, dtype=torch.long)), 2)
    # step j at t reads token t+1+j: positions whose inputs stay inside the window match
    assert torch.allclose(packed[0][:, :3], alone[0][:, :3], atol=1e-12)
    assert torch.allclose(packed[1][:, :2], alone[1][:, :2], atol=1e-12)


# -- draft vocabulary ---------------------------------------------------------------------------
def test_draft_vocab_maps_round_trip():
    ids = [7, 0, 3, 42, 19]
    v = DraftVocab.from_target_ids(ids, V)
    d2t, t2d = v.d2t(), v.t2d()
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (V,) and int(t2d.sum()) == 5
    draft = torch.arange(v.size)
    assert (draft + d2t).tolist() == sorted(ids)  # vLLM: target_id = draft_id + d2t[draft_id]
    assert torch.equal(v.to_draft(v.to_target(draft)), draft)
    assert v.to_draft(torch.tensor([1, 42])).tolist() == [-1, 4]
    back = DraftVocab.from_maps(d2t, t2d)
    assert torch.equal(back.target_ids, v.target_ids) and back.vocab_size == V
    with pytest.raises(ModelError, match="same draft vocabulary"):
        DraftVocab.from_maps(d2t, t2d.roll(1))
    with pytest.raises(ModelError, match="repeat"):
        DraftVocab.from_target_ids([1, 1], V)


def test_draft_vocab_auto_is_the_smallest_n_covering_99_percent_plus_the_specials():
    counts = np.zeros(V, dtype=np.int64)
    counts[[5, 6, 7, 8]] = [900, 60, 30, 10]  # 1000 generated tokens: 5,6,7 cover 99.0%
    vocab, rep = choose_draft_vocab(counts, "auto", special_ids=[0, 2, 5])
    assert rep.frequent == 3 and vocab.target_ids.tolist() == [0, 2, 5, 6, 7]
    assert rep.special_added == 2 and rep.coverage == pytest.approx(0.99) and rep.size == 5
    vocab, rep = choose_draft_vocab(counts, "2", special_ids=[])
    assert vocab.target_ids.tolist() == [5, 6] and rep.coverage == pytest.approx(0.96)
    vocab, rep = choose_draft_vocab(counts, "100", special_ids=[])  # more than were generated: all of them
    assert vocab.target_ids.tolist() == [5, 6, 7, 8] and rep.coverage == 1.0
    vocab, rep = choose_draft_vocab(counts, "0", special_ids=[])
    assert vocab.is_full and rep.size == V
    with pytest.raises(ConfigError, match="--draft-vocab"):
        choose_draft_vocab(counts, "-1", special_ids=[])


# -- losses over a draft vocabulary -------------------------------------------------------------
def test_soft_targets_over_a_draft_vocabulary_renormalize_the_kept_teacher_candidates():
    # teacher: ids 3 (0.5), 9 (0.3), 4 (0.1), tail 0.1; the draft vocabulary lacks 9 -> q = [0.5, 0.1, tail 0.1] / 0.7
    logits = torch.randn(1, 6, dtype=torch.float64)  # over 6 draft ids
    draft_ids = torch.tensor([[1, -1, 2]])  # 3 -> draft 1, 9 -> none, 4 -> draft 2
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.1]], dtype=torch.float64))
    s = torch.log_softmax(logits[0], -1)
    tail = torch.logsumexp(s[[0, 3, 4, 5]], 0)
    expected = -(0.5 * s[1] + 0.1 * s[2] + 0.1 * tail) / 0.7
    assert torch.allclose(soft_ce(logits, draft_ids, lp)[0], expected, atol=1e-12)
    # every candidate kept: the plain bucketed CE (the Medusa loss, unchanged)
    full = soft_ce(logits, torch.tensor([[1, 0, 2]]), lp)[0]
    q = teacher_buckets(lp)[0]
    assert torch.allclose(full, -(q[0] * s[1] + q[1] * s[0] + q[2] * s[2] + q[3] * torch.logsumexp(s[3:], 0)), atol=1e-12)


def test_hard_targets_outside_the_draft_vocabulary_are_excluded_and_counted():
    vocab = DraftVocab.from_target_ids([1, 2, 3], 6)
    ids = torch.tensor([[0, 1, 2, 5, 3]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    hidden = torch.randn(1, 5, 4, dtype=torch.float64)
    W = torch.randn(3, 4, dtype=torch.float64)
    loss, st = chunked_term_losses(hidden, [Term(lambda h: h @ W.T, 2)], ids, mask, vocab_map=vocab.draft_index())
    # offset 2: targets of t = 0, 1, 2 are ids 2, 5, 3 -> draft 1, none, 2
    assert st[0].count == 2 and st[0].excluded == 1
    ref = torch.stack([-torch.log_softmax(hidden[0, 0] @ W.T, -1)[1], -torch.log_softmax(hidden[0, 2] @ W.T, -1)[2]]).mean()
    assert torch.allclose(loss[0], ref, atol=1e-12)


# -- options ------------------------------------------------------------------------------------
def test_options_of_the_other_architecture_are_config_errors():
    with pytest.raises(ConfigError, match="--arch must be one of"):
        TrainConfig(data="x", arch="eagle2")
    with pytest.raises(ConfigError, match="--ttt-steps, --draft-vocab only apply to --arch eagle3"):
        TrainConfig(data="x", ttt_steps=2, draft_vocab="100")
    with pytest.raises(ConfigError, match="--num-heads only applies to --arch medusa"):
        TrainConfig(data="x", arch="eagle3", heads=2)
    with pytest.raises(ConfigError, match="--medusa-mode only applies"):
        TrainConfig(data="x", arch="eagle3", mode="medusa2")
    cfg = TrainConfig(data="x", arch="eagle3", draft_vocab=32000, aux_layers=[2, 15, 27])
    assert cfg.draft_vocab == "32000" and cfg.aux_layers == "2,15,27"
    assert cfg.run_key()["arch"] == "eagle3"
    with pytest.raises(ConfigError, match="--ttt-steps"):
        TrainConfig(data="x", arch="eagle3", ttt_steps=9, max_len=10)


# -- real training on self-distilled shards -------------------------------------------------------
EAGLE_OPTIONS = dict(arch="eagle3", max_len=64, batch_size=4, lr=3e-3, warmup_steps=2, seed=0, progress=False)


@pytest.fixture(scope="module")
def trained_drafter(tmp_path_factory, real_shards):
    out = tmp_path_factory.mktemp("trained-drafter") / "drafter"
    summary = train(TrainConfig(data=str(real_shards), out=str(out), steps=12, **EAGLE_OPTIONS))
    assert summary.steps == 12 and not summary.stopped_early
    return out, summary


def test_eagle3_training_lowers_the_drafters_loss_and_raises_its_top1(trained_drafter, real_shards, hf_model):
    """First ~1000 training tokens, teacher-forced, before (fresh drafter, seeded) and after 12 steps."""
    from distill.train.draft_vocab import choose_draft_vocab, generated_token_counts, special_token_ids
    from distill.train.eagle import build_eagle_module, drafter_accuracy
    from distill.models import resolve_model

    out, _ = trained_drafter
    cfg = TrainConfig(data=str(real_shards), **EAGLE_OPTIONS)
    vocab, report = choose_draft_vocab(generated_token_counts(real_shards, V_MODEL), "auto", special_token_ids(resolve_model(None).path))
    torch.manual_seed(0)
    fresh = build_eagle_module(hf_model, cfg, vocab, report).drafter
    before = drafter_accuracy(hf_model, fresh, real_shards, max_len=64, ranks=5, max_tokens=1000)
    after = drafter_accuracy(hf_model, EagleDrafter.load(out), real_shards, max_len=64, ranks=5, max_tokens=1000)
    assert after.loss[0] < before.loss[0] - 1.0, (before.loss, after.loss)
    assert after.topk(1)[0] >= before.topk(1)[0] + 0.05, (before.topk(1), after.topk(1))
    assert after.loss[2] < before.loss[2]


def test_eagle3_metrics_and_folder(trained_drafter):
    out, summary = trained_drafter
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 13))
    for r in rows:
        for j in (1, 2, 3):
            assert 0 <= r[f"step{j}_top1"] <= r[f"step{j}_top5"] <= 1 and math.isfinite(r[f"step{j}_loss"])
    assert rows[-1]["loss"] < rows[0]["loss"]
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    vocab_doc = json.loads((out / "draft-vocab.json").read_text())
    assert vocab_doc["coverage"] >= 0.99 and vocab_doc["size"] == conf["draft_vocab_size"] < V_MODEL
    assert set(vocab_doc["special_ids"]) <= set(EagleDrafter.load(out).vocab.target_ids.tolist())
    assert summary.draft_vocab["coverage"] == vocab_doc["coverage"]
    meta = json.loads((out / "distill-heads.json").read_text())
    assert meta["arch"] == "eagle3" and meta["train_config"]["arch"] == "eagle3" and meta["draft_vocab"]["size"] == vocab_doc["size"]
    suffixes = {p.suffix for p in out.rglob("*") if p.is_file()}
    assert not suffixes & {".pt", ".pth", ".bin", ".pkl", ".pickle"}, suffixes


def test_eagle3_resume_from_a_checkpoint_reproduces_the_uninterrupted_run(real_shards, tmp_path):
    opts = dict(data=str(real_shards), steps=4, targets="soft", feature_loss=0.1, pack=True, **{**EAGLE_OPTIONS, "max_len": 48})
    straight = train(TrainConfig(out=str(tmp_path / "straight"), **opts))
    first = train(TrainConfig(out=str(tmp_path / "resumed"), stop_after=2, **opts))
    assert first.stopped_early and first.steps == 2 and not (tmp_path / "resumed" / "model.safetensors").exists()
    second = train(TrainConfig(out=str(tmp_path / "resumed"), resume=True, **opts))
    assert straight.steps == second.steps == 4
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-6 * max(1.0, abs(ra["loss"])), (ra["step"], ra["loss"], rb["loss"])
        assert ra["feature_loss"] > 0 and abs(ra["step3_top1"] - rb["step3_top1"]) < 1e-9
    wa = EagleDrafter.load(tmp_path / "straight").state_dict()
    wb = EagleDrafter.load(tmp_path / "resumed").state_dict()
    assert set(wa) == set(wb) and all(torch.allclose(wa[k].float(), wb[k].float(), atol=1e-6) for k in wa)
    with pytest.raises(ConfigError, match="different options.*arch"):
        train(TrainConfig(out=str(tmp_path / "resumed"), resume=True, data=str(real_shards), steps=4, max_len=48, progress=False))
