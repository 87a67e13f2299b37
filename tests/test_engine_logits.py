"""vLLM's sampling options in the engine: penalties, bias, min_tokens, top_k, min_p, logprobs, all lossless.

Two references that share no code with the engine: the exact continuation distribution of the tiny
random model (vocabulary 8), enumerated with the options applied by a plain re-statement of vLLM's
rules below, against which speculative and plain samples are chi-square tested; and transformers'
own ``generate`` with ``repetition_penalty`` on the bundled model, which speculative greedy decoding
must reproduce token for token. Logprobs are checked against a transformers forward.
"""

from __future__ import annotations

import pytest
import torch

from distill.engine import Engine, EngineConfig, SamplingParams
from distill.engine.proposers.lookup import Lookup
from helpers import ALPHA, CONT, SAMPLES, VOCAB, chi2_pvalue, make_heads, tiny_medusa, tiny_medusa_engine

OPTIONS = dict(temperature=0.9, top_k=5, min_p=0.05, repetition_penalty=1.8, frequency_penalty=0.4, presence_penalty=0.3,
               logit_bias={3: 1.5}, min_tokens=0)


def reference_probs(logits: torch.Tensor, prompt: list[int], output: list[int], o: dict) -> torch.Tensor:
    """vLLM's rules for one position, written out: logits (V,) -> probabilities (V,)."""
    x = logits.double().clone()
    for tok, b in (o.get("logit_bias") or {}).items():
        x[tok] += b
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.numel()).double() if output else torch.zeros_like(x)
    r = o.get("repetition_penalty", 1.0)
    for tok in set(prompt) | set(output):
        x[tok] = x[tok] / r if x[tok] > 0 else x[tok] * r
    x -= o.get("frequency_penalty", 0.0) * counts + o.get("presence_penalty", 0.0) * (counts > 0).double()
    p = torch.softmax(x / o["temperature"], -1)
    p = torch.where(p < o.get("min_p", 0.0) * p.max(), 0.0, p)
    p = p / p.sum()
    k = o.get("top_k", 0)
    if 0 < k < p.numel():
        p = torch.where(p < p.sort(descending=True).values[k - 1], 0.0, p)
    return p / p.sum()


def exact_with_options(model, prompt: list[int], o: dict) -> torch.Tensor:
    """P(x1 x2 x3 | prompt) under the options, for all VOCAB^3 continuations (lexicographic): (VOCAB^3,)."""
    probs, prefixes = torch.ones(1, dtype=torch.float64), [()]
    with torch.inference_mode():
        for _ in range(CONT):
            logits = model(torch.tensor([prompt + list(q) for q in prefixes])).logits[:, -1].float()  # (N, V)
            step = torch.stack([reference_probs(logits[i], prompt, list(q), o) for i, q in enumerate(prefixes)])
            probs = (probs[:, None] * step).reshape(-1)
            prefixes = [q + (x,) for q in prefixes for x in range(VOCAB)]
    return probs


@pytest.mark.usefixtures("one_torch_thread")
def test_penalties_top_k_min_p_and_bias_under_rejection_sampling_are_lossless():
    tiny = tiny_medusa()
    prompt = [1, 5, 2, 5]
    exact = exact_with_options(tiny[0], prompt, OPTIONS)
    engine = tiny_medusa_engine(tiny, "rejection")
    for speculative, seed0 in ((True, 0), (False, 10**6)):
        params = [SamplingParams(max_tokens=CONT, seed=seed0 + i, **OPTIONS) for i in range(SAMPLES)]
        results, _ = engine.generate([prompt] * SAMPLES, params, speculative=speculative)
        if speculative:
            assert max(a for r in results for a in r.accepted) >= 2  # the tree did accept candidates
        assert chi2_pvalue([r.token_ids for r in results], exact) > ALPHA
    # the test can fail: the same samples against the distribution without the penalties
    plain_exact = exact_with_options(tiny[0], prompt, dict(OPTIONS, repetition_penalty=1.0, frequency_penalty=0.0,
                                                           presence_penalty=0.0))
    assert chi2_pvalue([r.token_ids for r in results], plain_exact) < ALPHA


@pytest.fixture(scope="module")
def engines(hf_model, tokenizer):
    """Plain, Medusa (random heads: a mix of accepted and rejected candidates) and lookup engines on one model."""
    return {"plain": Engine(hf_model, tokenizer, None, EngineConfig()),
            "medusa": Engine(hf_model, tokenizer, make_heads(hf_model, random_w1=False), EngineConfig(tree="sparse-24")),
            "lookup": Engine(hf_model, tokenizer, Lookup(), EngineConfig())}


def test_greedy_with_repetition_penalty_equals_transformers_generate_plain_and_speculative(engines, hf_model, mt_prompts):
    batch = mt_prompts
    want = []
    for p in batch:
        out = hf_model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, repetition_penalty=1.3,
                                eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    params = SamplingParams(max_tokens=24, repetition_penalty=1.3, ignore_eos=True)
    unpenalised = engines["plain"].generate(batch, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert [r.token_ids for r in unpenalised] != want  # the penalty changes these answers
    for name, engine in engines.items():
        results, _ = engine.generate(batch, params)
        assert [r.token_ids[: len(w)] for r, w in zip(results, want)] == want, name
        if name == "medusa":
            assert max(a for r in results for a in r.accepted) >= 2, "no candidate was accepted: the tree went untested"


def test_logprobs_are_the_raw_model_s_and_equal_plain_decoding_s(engines, hf_model, mt_prompts):
    batch = mt_prompts[:2]
    params = SamplingParams(max_tokens=16, logprobs=3, prompt_logprobs=2, frequency_penalty=0.5)
    got = {name: e.generate(batch, params)[0] for name, e in engines.items()}
    for b, p in enumerate(batch):
        plain = got["plain"][b]
        ids = torch.tensor([p + plain.token_ids])
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(ids).logits[0].float(), -1)  # (T, V): an lm-eval style forward
        assert plain.prompt_logprobs[0] is None and len(plain.prompt_logprobs) == len(p)
        for t in range(1, len(p)):
            entry = plain.prompt_logprobs[t]
            assert entry.token_id == p[t] and abs(entry.logprob - float(ref[t - 1, p[t]])) < 1e-3
            assert [i for i, _ in entry.top] == ref[t - 1].topk(2).indices.tolist()
        assert len(plain.logprobs) == len(plain.token_ids)
        for k, (tok, entry) in enumerate(zip(plain.token_ids, plain.logprobs)):
            pos = len(p) + k - 1
            assert entry.token_id == tok and abs(entry.logprob - float(ref[pos, tok])) < 1e-3
            assert [i for i, _ in entry.top] == ref[pos].topk(3).indices.tolist()
        for name in ("medusa", "lookup"):
            other = got[name][b]
            assert other.token_ids == plain.token_ids, name
            assert max(abs(x.logprob - y.logprob) for x, y in zip(other.logprobs, plain.logprobs)) < 1e-3, name


def test_min_tokens_ignore_eos_logit_bias_and_top_k_one(engines, tokenizer, mt_prompts):
    short = tokenizer.apply_chat_template([{"role": "user", "content": "Reply with the single word: yes"}],
                                          add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    free = engines["plain"].generate([short], SamplingParams(max_tokens=64))[0][0]
    n = len(free.token_ids)
    assert free.finish_reason == "stop" and n < 48
    for name, engine in engines.items():
        held = engine.generate([short], SamplingParams(max_tokens=n + 16, min_tokens=n + 4))[0][0]
        assert len(held.token_ids) >= n + 4 and held.token_ids[:n] == free.token_ids, name
        run_on = engine.generate([short], SamplingParams(max_tokens=n + 8, ignore_eos=True))[0][0]
        assert run_on.finish_reason == "length" and len(run_on.token_ids) == n + 8, name
    forced = engines["lookup"].generate([mt_prompts[0]], SamplingParams(max_tokens=6, logit_bias={504: 100}))[0][0]
    assert forced.token_ids == [504] * 6
    greedy = engines["medusa"].generate([mt_prompts[1]], SamplingParams(max_tokens=16))[0][0]
    top1 = engines["medusa"].generate([mt_prompts[1]], SamplingParams(max_tokens=16, temperature=1.3, top_k=1, seed=3))[0][0]
    assert top1.token_ids == greedy.token_ids


def test_bad_options_are_refused():
    from distill.errors import ConfigError

    nan, inf = float("nan"), float("inf")
    for bad in (dict(top_k=-2), dict(top_k=2**31), dict(top_k="5"), dict(min_p=1.5), dict(min_p=nan), dict(repetition_penalty=0),
                dict(repetition_penalty=nan), dict(repetition_penalty=inf), dict(presence_penalty=3), dict(presence_penalty=nan),
                dict(frequency_penalty=-inf), dict(temperature=inf), dict(min_tokens=9), dict(logprobs=-1),
                dict(stop_token_ids=(2**63,)), dict(stop_token_ids=(-1,)), dict(logit_bias={3: nan}), dict(logit_bias={3: inf}),
                dict(logit_bias={2**40: 1.0})):
        with pytest.raises(ConfigError, match=f"^{next(iter(bad))} "):
            SamplingParams(max_tokens=8, **bad)
