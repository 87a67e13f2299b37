"""Sampling with the tiny random model of tests/helpers.py (vocabulary 8): rejection is lossless, typical accepts more.

Losslessness: 6,000 three-token continuations of one prompt, drawn with Medusa + tree rejection
sampling and with plain sampling, are compared with the exact continuation distribution
(enumerated with the model: 8^3 = 512 outcomes) by a chi-square goodness-of-fit test at the
0.1% significance level (bins with an expected count below 5 pooled). The same test rejects
typical acceptance (not lossless) on the same draws, so it has the power to notice a biased sampler.
Seeds are fixed, so the outcome is reproducible.
"""

from __future__ import annotations


import pytest
import torch

from distill.engine import Engine, SamplingParams
from helpers import ALPHA, CONT, SAMPLES, VOCAB, chi2_pvalue, exact_distribution, tiny_medusa, tiny_medusa_engine


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny():
    return tiny_medusa()


def draw(engine: Engine, prompt: list[int], temperature: float, top_p: float, speculative: bool, seed0: int):
    params = [SamplingParams(max_tokens=CONT, temperature=temperature, top_p=top_p, seed=seed0 + i) for i in range(SAMPLES)]
    results, stats = engine.generate([prompt] * SAMPLES, params, speculative=speculative)
    assert all(len(r.token_ids) == CONT and r.finish_reason == "length" for r in results)
    return [r.token_ids for r in results], results


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_rejection_sampling_is_lossless(tiny, temperature, top_p):
    prompt = [1, 5, 2]
    exact = exact_distribution(tiny[0], prompt, temperature, top_p)
    medusa, results = draw(tiny_medusa_engine(tiny, "rejection"), prompt, temperature, top_p, True, seed0=0)
    assert max(a for r in results for a in r.accepted) >= 2  # the tree did accept candidates
    assert chi2_pvalue(medusa, exact) > ALPHA
    plain, _ = draw(tiny_medusa_engine(tiny, "rejection"), prompt, temperature, top_p, False, seed0=10**6)
    assert chi2_pvalue(plain, exact) > ALPHA
    # the test can fail: typical acceptance is not lossless and is caught on the same prompt
    typical, _ = draw(tiny_medusa_engine(tiny, "typical"), prompt, temperature, top_p, True, seed0=0)
    assert chi2_pvalue(typical, exact) < ALPHA


def test_typical_accepts_at_least_as_much_as_rejection(tiny):
    prompts = [[1, 5, 2], [3, 3, 7, 0, 1], [6], [2, 4, 6, 1, 0, 7, 3]]
    means = {}
    for mode in ("typical", "rejection"):
        engine = tiny_medusa_engine(tiny, mode, tree="3,2,2")
        params = [SamplingParams(max_tokens=24, temperature=1.0, seed=i) for i in range(len(prompts))]
        results, _ = engine.generate(prompts, params)
        means[mode] = sum(sum(r.accepted) for r in results) / sum(len(r.accepted) for r in results)
    assert means["typical"] >= means["rejection"] > 1.0


def test_temperature_zero_requests_decode_greedily_in_every_mode(tiny):
    prompts = [[1, 5, 2], [3, 3, 7, 0, 1]]
    greedy, _ = tiny_medusa_engine(tiny, "greedy").generate(prompts, [SamplingParams(max_tokens=16)] * 2, speculative=False)
    for mode in ("typical", "rejection"):
        out, _ = tiny_medusa_engine(tiny, mode).generate(prompts, [SamplingParams(max_tokens=16, temperature=0.0)] * 2)
        assert [r.token_ids for r in out] == [r.token_ids for r in greedy]


def test_tiny_batched_greedy_equals_batch_one(tiny):
    """Many acceptance-length patterns per step (a small vocabulary makes candidates often right)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 4, 9, 2, 6, 3, 12, 5)]
    engine = tiny_medusa_engine(tiny, "greedy", tree="3,2,2")
    engine.config.max_batch = 8
    sp = SamplingParams(max_tokens=20)
    batched, _ = engine.generate(prompts, [sp] * len(prompts))
    accepted = set()
    for p, many in zip(prompts, batched):
        one, _ = engine.generate([p], [sp])
        plain, _ = engine.generate([p], [sp], speculative=False)
        assert many.token_ids == one[0].token_ids == plain[0].token_ids
        accepted.update(many.accepted)
    assert len(accepted) >= 3  # sequences advanced by different amounts in the same step


def test_mixed_batch_of_greedy_and_sampled_requests(tiny):
    """Mixed batch: greedy and sampled requests side by side keep their own semantics."""
    prompts = [[1, 5, 2], [1, 5, 2]]
    engine = tiny_medusa_engine(tiny, "rejection")
    greedy, _ = engine.generate([prompts[0]], [SamplingParams(max_tokens=8)])
    mixed, _ = engine.generate(prompts, [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=1.0, seed=7)])
    again, _ = engine.generate([prompts[1]], [SamplingParams(max_tokens=8, temperature=1.0, seed=7)])
    assert mixed[0].token_ids == greedy[0].token_ids
    assert mixed[1].token_ids == again[0].token_ids  # with the same tree, a request's seed fixes its output
