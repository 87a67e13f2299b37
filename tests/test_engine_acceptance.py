"""Acceptance rules and the speculation policy as pure functions on tiny synthetic tensors."""

from __future__ import annotations

import pytest
import torch

from distill.engine.acceptance import (
    greedy_accept,
    rejection_accept,
    typical_accept,
    typical_threshold,
)
from distill.engine.policy import AdaptivePolicy, candidate_sizes, choose_tree_size, taus_for
from distill.engine.tree import build_buffers, default_accuracy, resolve_tree
from distill.sampling import warp
from helpers import chi2_sf

# root=0, (0,)=1, (1,)=2, (0,0)=3, (0,1)=4, (1,0)=5, (0,0,0)=6
HAND = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
V = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _peaked_logits(targets: list[int]) -> torch.Tensor:
    """(1, T, V) logits whose argmax after tree position i is targets[i]."""
    logits = torch.zeros(1, len(targets), V)
    for i, t in enumerate(targets):
        logits[0, i, t] = 5.0
    return logits


def test_greedy_accepts_the_longest_correct_path():
    b = build_buffers(HAND)
    tokens = torch.tensor([[7, 1, 2, 3, 4, 5, 6]])
    # model says: after root -> 2 (node (1,) correct), after node 2 -> 5 (node (1,0) correct), after 5 -> 0
    logits = _peaked_logits([2, 0, 5, 0, 0, 0, 0])
    acc = greedy_accept(tokens, logits, b)
    assert acc.length.tolist() == [2] and acc.path[0, :3].tolist() == [0, 2, 5]
    assert acc.last.tolist() == [5] and acc.next_token.tolist() == [0]
    # nothing right: the root's own next token
    acc = greedy_accept(tokens, _peaked_logits([0, 0, 0, 0, 0, 0, 0]), b)
    assert acc.length.tolist() == [0] and acc.last.tolist() == [0] and acc.next_token.tolist() == [0]
    # the deepest path all correct
    acc = greedy_accept(tokens, _peaked_logits([1, 3, 0, 6, 0, 0, 2]), b)
    assert acc.length.tolist() == [3] and acc.path[0].tolist() == [0, 1, 3, 6] and acc.next_token.tolist() == [2]


def test_typical_at_temperature_zero_equals_greedy_on_random_trees():
    g = torch.Generator().manual_seed(0)
    b = resolve_tree("3,2,2", 3).paths
    buf = build_buffers(b)
    T = buf.size
    for _ in range(200):
        logits = torch.randn(4, T, V, generator=g) * 3  # (B, T, V)
        # heads' top-I tables: distinct tokens per depth (as top-i ranks are), laid out as the tree
        table = torch.stack([torch.stack([torch.randperm(V, generator=g)[: buf.max_rank] for _ in range(buf.num_heads_used)])
                             for _ in range(4)])  # (B, D, I)
        tokens = table.flatten(1)[:, buf.cand_index]  # (B, T)
        probs = warp(logits, torch.zeros(4), torch.ones(4))
        gens = [torch.Generator().manual_seed(i) for i in range(4)]
        t = typical_accept(tokens, probs, buf, gens)
        r = rejection_accept(tokens, probs, buf, gens)
        ref = greedy_accept(tokens, logits, buf)
        for a in (t, r):
            assert torch.equal(a.length, ref.length) and torch.equal(a.next_token, ref.next_token)
            assert torch.equal(a.last, ref.last)


def test_typical_threshold_follows_the_formula():
    p = torch.stack([torch.tensor([0.7, 0.2, 0.1] + [0.0] * 5), torch.full((8,), 1 / 8)])
    thr = typical_threshold(p, 0.09, 0.3)
    assert float(thr[0]) == pytest.approx(0.09)  # low entropy: epsilon binds
    assert float(thr[1]) == pytest.approx(0.3 / 8)  # uniform over 8: delta * exp(-ln 8)


def test_typical_accepts_plausible_tokens_that_greedy_rejects():
    b = build_buffers([(0,), (0, 0)])
    # after root: p = [0.5, 0.4, ...]; candidate 1 is plausible (0.4 > threshold) but not the argmax
    probs = torch.full((1, 3, V), 0.1 / (V - 2))
    probs[0, 0, :2] = torch.tensor([0.5, 0.4])
    probs[0, 1] = torch.full((V,), 1 / V)  # high entropy: threshold 0.3/8 < 1/8, every token plausible
    probs[0, 2] = torch.full((V,), 1 / V)
    tokens = torch.tensor([[3, 1, 5]])
    acc = typical_accept(tokens, probs, b, [torch.Generator().manual_seed(0)])
    assert acc.length.tolist() == [2]
    assert greedy_accept(tokens, probs.log(), b).length.tolist() == [0]


def test_warp_temperature_and_top_p():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    p = warp(logits, torch.tensor([1.0]), torch.tensor([0.8]))
    assert torch.allclose(p[0, 0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = warp(logits, torch.tensor([1.0]), torch.tensor([0.81]))
    assert torch.allclose(p[0, 0], torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    p = warp(logits, torch.tensor([0.0]), torch.tensor([1.0]))
    assert p[0, 0].tolist() == [1.0, 0.0, 0.0, 0.0]
    p = warp(logits, torch.tensor([2.0]), torch.tensor([1.0]))
    q = torch.tensor([0.5, 0.3, 0.15, 0.05]).sqrt()
    assert torch.allclose(p[0, 0], q / q.sum())


def test_chi2_sf_matches_known_quantiles():
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-3)
    assert chi2_sf(18.307, 10) == pytest.approx(0.05, abs=1e-3)


def test_rejection_first_token_is_distributed_as_the_model():
    """Two levels, fixed distributions: the first emitted token (accepted child or residual draw) ~ p_root.

    200,000 draws, chi-square goodness of fit at the 0.1% level; also the second token given an
    accepted first child ~ that child's distribution.
    """
    b = build_buffers([(0,), (1,), (2,), (0, 0)])  # root children: ranks 0,1,2; (0,) has one child
    p_root = torch.tensor([0.05, 0.30, 0.25, 0.10, 0.05, 0.05, 0.15, 0.05])
    p_kid = torch.tensor([0.40, 0.05, 0.05, 0.05, 0.05, 0.20, 0.10, 0.10])
    n = 200_000
    probs = torch.stack([p_root, p_kid, p_kid, p_kid, p_kid])[None].expand(n, -1, -1)  # (n, T, V)
    tokens = torch.tensor([[0, 1, 6, 2, 0]]).expand(n, -1)  # children of root: 1, 6, 2; child of (0,): 0
    gens = [None] * n
    torch.manual_seed(1234)
    acc = rejection_accept(tokens, probs, b, gens)
    first = torch.where(acc.length >= 1, tokens.gather(1, acc.path[:, 1:2]).squeeze(1), acc.next_token)
    counts = torch.bincount(first, minlength=V).double()
    exp = p_root.double() * n
    stat = float(((counts - exp) ** 2 / exp).sum())
    assert chi2_sf(stat, V - 1) > 1e-3, (counts / n, p_root)
    # given the first child (token 1, node 1) accepted, the next emitted token ~ p_kid
    sel = (acc.length >= 1) & (acc.path[:, 1] == 1)
    second = torch.where(acc.length[sel] >= 2, tokens[sel].gather(1, acc.path[sel][:, 2:3]).squeeze(1), acc.next_token[sel])
    counts = torch.bincount(second, minlength=V).double()
    exp = p_kid.double() * int(sel.sum())
    stat = float(((counts - exp) ** 2 / exp).sum())
    assert chi2_sf(stat, V - 1) > 1e-3


def test_policy_turns_speculation_off_for_large_batches():
    taus = taus_for(resolve_tree("sparse-24", 4).paths, default_accuracy(4))
    assert sorted(taus) == [1, 3, 6, 12, 24] and candidate_sizes(24) == [24, 12, 6, 3, 1, 0]
    assert all(taus[a] <= taus[b] for a, b in zip(sorted(taus), sorted(taus)[1:]))
    assert choose_tree_size(1, taus, cost_ratio=0.0) == 24  # free extra tokens: the whole tree
    sizes = [choose_tree_size(bs, taus, cost_ratio=0.02) for bs in (1, 2, 4, 8, 16, 32, 64)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 0 and sizes[-1] == 0
    assert choose_tree_size(4, taus, cost_ratio=0.0, speculate_max_batch=3) == 0
    assert choose_tree_size(3, taus, cost_ratio=0.0, speculate_max_batch=3) == 24


ADAPT_TAUS = {4: 2.0, 2: 1.6, 1: 1.4}


def test_adaptive_policy_starts_as_the_static_one():
    taus = taus_for(resolve_tree("sparse-24", 4).paths, default_accuracy(4))
    h = {n: 0.01 * n for n in taus}
    policy = AdaptivePolicy(taus, 0.02, h)
    for b in (1, 2, 3, 4, 8, 16, 32, 64):
        assert policy.best(b) == choose_tree_size(b, taus, 0.02, None, h) == policy.best(b, measured=False)
    assert policy.acceptance_ratio == 1.0


def test_adaptive_policy_turns_the_tree_off_when_acceptance_is_below_calibration_and_probes_it():
    policy = AdaptivePolicy(ADAPT_TAUS, 0.05, probe_every=8)
    assert policy.best(1) == 4  # calibrated: 2.0 tokens for 1.2x the cost
    for _ in range(200):  # the traffic accepts nothing: rho falls towards 0
        n = policy.next_size(1)
        policy.observe(1, n, 0.100 * policy.model_cost(1, n), [0] if n else [])  # step times as the cost model predicts
        if policy.best(1) == 0:
            break
    # off once the 1-node tree's 1 + 0.4 rho tokens no longer beat its 1.05x cost by the 3% margin: rho < 0.204
    assert policy.acceptance_ratio < 0.21 and policy.best(1) == 0
    choices = [policy.next_size(1) for _ in range(32)]
    assert choices.count(4) == 4 and choices.count(0) == 28  # a probe of the calibrated choice every 8th step


def test_a_tree_step_measured_cheaper_than_a_plain_step_counts_as_its_cost():
    policy = AdaptivePolicy({1: 1.5}, 0.0, prior=1.0, halflife=4)
    for _ in range(40):
        policy.observe(1, 0, 0.100, [])
        policy.observe(1, 1, 0.097, [0])  # noise: the 1-node step measured 3% cheaper, and it accepts nothing
    assert policy.cost(1, 1) == pytest.approx(0.100) and policy.acceptance_ratio < 0.01
    assert policy.best(1) == 0  # a gain within the measurements' noise, at no less cost: plain
    assert 1.0 < policy.tau(1) < 1.0 + policy.min_gain


def test_a_tree_is_kept_only_against_a_plain_step_measured_at_the_same_batch_size():
    """The cost model calls the 4-node tree 1.05x a plain step; here it costs 1.7x (a drafter's passes, a busy server).
    Measured against a plain step the model only predicts, the tree would look as good as calibrated forever; the
    policy measures plain decoding first, finds it gives more tokens a second, and from then on probes."""
    policy = AdaptivePolicy({4: 1.5}, 0.0125, probe_every=32, plain_probe_every=128)
    assert policy.best(1) == 4
    real = {0: 0.100, 4: 0.170}
    sizes = []
    for _ in range(160):
        n = policy.next_size(1)
        sizes.append(n)
        policy.observe(1, n, real[n], [sizes.count(4) % 2] if n else [])  # as calibrated: 0.5 candidates a tree step
    assert sizes[:2] == [0, 0] and policy.cost(1, 0) == pytest.approx(0.100)  # measured before any tree
    assert policy.best(1) == 0 and abs(policy.acceptance_ratio - 1.0) < 0.2
    assert sizes[32:].count(4) == 4  # after the switch, only the calibrated choice's probe every 32nd step


def test_adaptive_policy_follows_measured_step_times_and_recovers():
    policy = AdaptivePolicy({4: 2.0}, 0.0, prior=1.0, halflife=16)  # the cost model calls extra tokens free
    for _ in range(5):  # acceptance as calibrated (2 of 3 at n=4 -> 1.0 accepted per step, tau 2.0)
        policy.observe(1, 0, 0.100, [])
        policy.observe(1, 4, 0.300, [1])
    assert abs(policy.acceptance_ratio - 1.0) < 1e-9
    assert policy.cost(1, 4) == pytest.approx(0.300) and policy.best(1) == 0  # 2 tokens in 3x the time: plain wins
    for _ in range(30):
        policy.observe(1, 4, 0.150, [1])  # the tree step gets cheaper (the median of the recent steps)
    assert policy.best(1) == 4  # 2 tokens in 1.5x the time
    for _ in range(60):
        policy.observe(1, 4, 0.150, [0])  # acceptance collapses: rho -> 0 (half-life 16)
    assert policy.acceptance_ratio < 0.2 and policy.best(1) == 0
    for _ in range(60):
        policy.observe(1, 4, 0.150, [2])  # and recovers above calibration
    assert policy.acceptance_ratio > 1.5 and policy.best(1) == 4
