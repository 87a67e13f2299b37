"""The policy's step costs measured at start: the curve's fit, the choices it changes, and the engine measuring it.

A CPU forward's cost is not the line 1 + r·(m − 1): it stays near one row's cost for a few rows and then climbs
(engine.costs). The engine times forwards of the rows its trees can take when it starts on a CPU, and the policy
prices trees with that curve (distill.engine.policy.StepCosts). The curve is kept per machine, model shapes and
kernels ($DISTILL_HOME/step-costs) and timed again only where one of them changed.
"""

from __future__ import annotations

import json

import pytest

from distill.engine import Engine, EngineConfig
import distill.engine.costs as costs_module
from distill.engine.costs import cost_key, measure_step_costs, step_costs
from distill.engine.proposers.lookup import DEFAULT_TAUS, Lookup
from distill.engine.policy import AdaptivePolicy, StepCosts, StepTimes, TokenBudget, choose_tree_size, step_cost


def test_step_times_keep_each_key_s_last_window_after_its_skipped_first_steps_and_give_their_median():
    times = StepTimes(window=3, skip=1)
    assert times.add((1, 0), 9.0) is None  # the first step of a key: not kept
    assert times.count((1, 0)) == 0 and times.seen() == [(1, 0)]
    assert [times.add((1, 0), s) for s in (1.0, 5.0, 3.0)] == [1.0, 3.0, 3.0]
    assert times.add((1, 0), 7.0) == 5.0  # 1.0 left the window: the median of 5, 3, 7
    assert times.count((1, 0)) == 3
    assert times.add((2, 4), 2.0) is None and times.add((2, 4), 4.0) == 4.0  # each key skips its own first step
    assert times.seen() == [(1, 0), (2, 4)]
    assert StepTimes(window=2).add("k", 6.0) == 6.0  # skip 0: every step kept


def test_the_curve_is_made_non_decreasing_and_is_linear_between_its_points_and_beyond_them():
    c = StepCosts({1: 1.0, 2: 1.09, 3: 1.01, 5: 0.98, 9: 1.07, 17: 1.25, 33: 1.85})
    # 1.09 / 1.01 / 0.98 (noise: a forward of more rows is never cheaper) pool to their mean, 1.0 clamped first
    assert c.points[2] == c.points[3] == c.points[5] == pytest.approx((1.09 + 1.01 + 1.0) / 3)
    assert c.points[9] == 1.07 and c(1) == c(0) == 1.0
    assert c(13) == pytest.approx(1.07 + (1.25 - 1.07) / 2)  # halfway between 9 and 17 rows
    assert c(65) == pytest.approx(1.85 + (1.85 - 1.25) / 16 * 32)  # the last slope goes on
    assert all(c(m) <= c(m + 1) for m in range(1, 80))
    assert StepCosts({1: 1.0, 3: 0.5}).points == {1: 1.0, 3: 1.0}
    assert json.loads(json.dumps(c.to_dict()))["17"] == 1.25
    with pytest.raises(ValueError, match="1-row point"):
        StepCosts({2: 1.1})


def test_a_flat_curve_lets_the_policy_draft_the_tree_that_the_line_priced_out():
    taus = {n: t for n, t in DEFAULT_TAUS.items() if n <= 8}  # the lookup proposer's starting table
    # the old CPU default, r = 0.08: an 8-node step "costs" 1.64 plain ones, so 2 nodes win (1.53 / 1.16)
    assert choose_tree_size(1, taus, 0.08) == 2
    flat = StepCosts({1: 1.0, 2: 1.0, 3: 1.01, 5: 1.02, 9: 1.05, 17: 1.25, 33: 1.85, 65: 3.3})  # a 2-core EPYC's shape
    assert step_cost(1, 8, flat) == 1.05 and step_cost(2, 8, flat) == pytest.approx(1.25 + 0.6 / 16)  # 18 rows
    assert choose_tree_size(1, taus, flat) == 8
    sizes = [choose_tree_size(b, taus, flat) for b in (1, 2, 4, 8, 16)]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] == 0  # bigger batches: smaller trees, then none
    policy = AdaptivePolicy(taus, flat)  # the adaptive policy starts from the same prices
    assert policy.best(1) == 8 and policy.model_cost(1, 4) == pytest.approx(1.02)


def test_the_node_budget_keeps_the_batch_s_most_valuable_nodes_while_they_pay_for_the_step():
    # free up to 6 tokens, then each token costs a tenth of a one-token step
    budget = TokenBudget(StepCosts({1: 1.0, 6: 1.0, 16: 2.0}), adaptive=False)
    # two rows: the free tokens (4 nodes) take the four best nodes, whatever row they are in; beyond them a node must be
    # worth a tenth of the step's expected tokens, which row 1's 0.2 is not, and row 0's 0.6 is
    assert budget.lengths(2, [[0.9, 0.85, 0.8, 0.1], [0.3, 0.2]]) == [3, 1]
    assert budget.lengths(2, [[0.9, 0.85, 0.8, 0.7, 0.6, 0.5], [0.3, 0.2]]) == [5, 0]
    # a row's deeper node never goes without its parent, even where it is worth as much
    assert budget.lengths(2, [[0.5, 0.5, 0.5], []]) == [3, 0]
    # sixteen rows on the line 1 + 0.5 (m - 1): a node must beat half a row's token, and none here does: plain
    line = TokenBudget(0.5, adaptive=False)
    assert line.lengths(16, [[0.4, 0.3]] * 16) == [0] * 16
    assert line.lengths(16, [[0.99, 0.98]] + [[0.1]] * 15)[0] == 2
    assert line.lengths(3, []) == [] and line.speculates(3)
    # sixteen rows kept nothing 8 steps in a row: only every 8th step drafts until one keeps a node again
    for _ in range(8):
        assert line.speculates(16) and line.lengths(16, [[0.4]] * 16) == [0] * 16
    clock = []
    for _ in range(16):
        clock.append(line.speculates(16))
        if clock[-1]:
            assert line.lengths(16, [[0.4]] * 16) == [0] * 16
    assert clock.count(True) == 2 and clock[7] and clock[15]
    assert line.lengths(16, [[0.99, 0.98]] + [[0.1]] * 15)[0] == 2 and line.speculates(16) and line.speculates(16)


def test_the_node_budget_prices_by_measured_steps_once_there_are_some_and_probes_plain_decoding():
    budget = TokenBudget(StepCosts({1: 1.0, 6: 1.0, 16: 2.0}), adaptive=True, plain_probe_every=4)
    assert not budget.speculates(2)  # plain decoding's cost at 2 rows first
    budget.observe(2, 2, 0.010)
    assert budget.cost(2, 2) == 0.010 and budget.cost(2, 4) == pytest.approx(0.010)  # scaled by the curve: flat
    assert budget.cost(2, 11) == pytest.approx(0.015)  # c(11) / c(2) = 1.5
    budget.observe(2, 4, 0.014)  # measured: each token past 2 costs a fifth of a plain step here
    assert budget.cost(2, 4) == 0.014 and budget.cost(2, 3) == pytest.approx(0.012)  # the line between the two
    assert budget.cost(2, 8) == pytest.approx(0.022)  # above them the measured slope goes on (the curve: flat)
    assert budget.cost(2, 16) == pytest.approx(0.038) and budget.cost(2, 1) == 0.010
    # 2.9 tokens for 1.2x and 3.75 for 1.4x beat plain decoding by more than 3%; 4.05 for 1.6x loses to 3.75 for 1.4x
    assert budget.lengths(2, [[0.9, 0.85], [0.3]]) == [2, 0]
    assert budget.lengths(2, [[0.99, 0.98, 0.97], [0.99, 0.98, 0.97]]) == [3, 3]  # nearly sure nodes still pay
    clock = [budget.speculates(2) for _ in range(8)]
    assert clock.count(False) == 2 and not clock[2] and not clock[6]  # every 4th step at 2 rows is plain
    budget.observe(2, 4, 0.030)  # the median of the pair's last steps
    budget.observe(2, 4, 0.020)
    assert budget.cost(2, 4) == 0.020
    assert budget.cost(3, 9) == pytest.approx(budget.model_cost(9))  # nothing measured at 3 rows: the curve


def test_the_node_budget_pools_a_slow_plain_step_with_the_cheaper_drafting_steps_measured_beside_it():
    budget = TokenBudget(StepCosts({1: 1.0, 6: 1.0, 16: 2.0}), adaptive=True)
    budget.observe(4, 4, 0.040)  # the one plain step so far, slowed by something else on the machine
    for _ in range(3):
        budget.observe(4, 6, 0.030)
        budget.observe(4, 8, 0.036)
    # more tokens never cost less: the plain median pools with the 6-token steps' (weights 1 and 3); 8 stay above
    assert budget.cost(4, 4) == pytest.approx(0.0325) and budget.cost(4, 6) == pytest.approx(0.0325)
    assert budget.cost(4, 8) == 0.036 and budget.cost(4, 7) == pytest.approx(0.03425)
    # unpooled, the 40 ms plain step priced every token up to 9 as free and all five nodes would go; pooled, the two
    # best (the first two extra tokens cost nothing on the pooled prices, the next ones 0.875 ms each)
    assert budget.lengths(4, [[0.3, 0.2], [0.3], [0.2], [0.1]]) == [1, 1, 0, 0]
    for _ in range(8):  # plain steps measured again: the fit follows the medians, and plain decoding wins
        budget.observe(4, 4, 0.018)
    assert budget.cost(4, 4) == 0.018 and budget.cost(4, 6) == 0.030
    assert budget.lengths(4, [[0.9, 0.8], [0.9], [0.2], [0.1]]) == [0, 0, 0, 0]


def test_the_engine_measures_the_curve_on_a_cpu_unless_given_a_line(hf_model, tokenizer):
    target = Engine(hf_model, tokenizer, None, EngineConfig(max_batch=1, dtype="float32", device="cpu")).target
    costs = measure_step_costs(target, max_nodes=8, max_batch=4, repeats=1)
    # rows n + 1 for the candidate sizes 8 / 4 / 2 / 1, and 2^k + 1 up to a batch of 4 nine-row trees
    assert sorted(costs.points) == [1, 2, 3, 5, 9, 17, 33]
    assert costs(33) > 1.2  # 33 rows cost more than one on any CPU; a measurement that could not tell would fail here
    # trees: the policy picks a size by the curve; chains: each step's nodes are priced by it, up to the budget
    engine = Engine(hf_model, tokenizer, Lookup(max_nodes=8, chains=False),
                    EngineConfig(max_batch=1, dtype="float32", device="cpu"))
    assert engine.step_costs is not None and sorted(engine.step_costs.points) == [1, 2, 3, 5, 9]
    assert engine.tree_size_for(1) == choose_tree_size(1, engine.pricing.taus, engine.step_costs)
    chains = Engine(hf_model, tokenizer, Lookup(max_nodes=8, chains=True),
                    EngineConfig(max_batch=1, dtype="float32", device="cpu"))
    assert chains.pricing.budget.cost_ratio is chains.step_costs and chains.tree_size_for(1) == 8
    line = Engine(hf_model, tokenizer, Lookup(max_nodes=8, chains=False),
                  EngineConfig(max_batch=1, device="cpu", step_cost_ratio=0.08))
    assert line.step_costs is None and line.tree_size_for(1) == 2  # the given line, as before
    off = Engine(hf_model, tokenizer, Lookup(max_nodes=8), EngineConfig(max_batch=1, device="cpu", measured_costs=False))
    assert off.step_costs is None
    assert Engine(hf_model, tokenizer, None, EngineConfig(max_batch=1, device="cpu")).step_costs is None  # no proposer


def test_a_curve_is_timed_once_per_machine_model_and_rows_and_read_back_after(hf_model, tokenizer, tmp_path, monkeypatch):
    cache = tmp_path / "step-costs"
    target = Engine(hf_model, tokenizer, None, EngineConfig(max_batch=1, dtype="float32", device="cpu")).target
    first = step_costs(target, max_nodes=2, max_batch=1, setup={"kernels": "a"}, cache=cache, repeats=1)
    assert first.source is None and sorted(first.points) == [1, 2, 3]  # timed now
    kept = list(cache.glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["key"] == json.loads(json.dumps(
        cost_key(hf_model, 2, 1, {"kernels": "a"}, repeats=1)))

    timed = []
    real = costs_module.target_step_rounds
    monkeypatch.setattr(costs_module, "target_step_rounds", lambda *a, **k: timed.append(a[2]) or real(*a, **k))
    again = step_costs(target, max_nodes=2, max_batch=1, setup={"kernels": "a"}, cache=cache, repeats=1)
    assert not timed and again.source == str(kept[0]) and again.points == first.points  # read back, nothing timed
    # another kernel set-up, more rows (a larger batch) or chains: another key, timed anew
    assert step_costs(target, 2, 1, {"kernels": "b"}, cache=cache, repeats=1).source is None and len(timed) == 1
    assert step_costs(target, 2, 4, {"kernels": "a"}, cache=cache, repeats=1).source is None and len(timed) == 2
    assert step_costs(target, 2, 1, {"kernels": "a"}, cache=cache, chains=True, repeats=1).source is None
    assert timed == [False, False, True]
    assert cost_key(hf_model, 2, 1)["rows"] == [1, 2, 3] and cost_key(hf_model, 2, 4)["rows"] == [1, 2, 3, 5, 9]
    assert len(list(cache.glob("*.json"))) == 4
    # a damaged file is timed again and replaced, not an error
    kept[0].write_text("{not json")
    assert step_costs(target, 2, 1, {"kernels": "a"}, cache=cache, repeats=1).source is None and len(timed) == 4
    assert step_costs(target, 2, 1, {"kernels": "a"}, cache=cache, repeats=1).source == str(kept[0]) and len(timed) == 4
    assert step_costs(target, 2, 1, cache=None, repeats=1).source is None and len(timed) == 5  # no folder: always timed

    # the engine keeps its curve in $DISTILL_HOME/step-costs: a second engine on this machine reads it
    monkeypatch.setenv("DISTILL_HOME", str(tmp_path / "home"))
    config = EngineConfig(max_batch=1, dtype="float32", device="cpu")
    one = Engine(hf_model, tokenizer, Lookup(max_nodes=4), config)
    two = Engine(hf_model, tokenizer, Lookup(max_nodes=4), config)
    assert one.step_costs.source is None and two.step_costs.source.startswith(str(tmp_path / "home" / "step-costs"))
    assert two.step_costs.points == one.step_costs.points and len(timed) == 6
    fresh = Engine(hf_model, tokenizer, Lookup(max_nodes=4), EngineConfig(max_batch=1, dtype="float32", device="cpu",
                                                                            cached_costs=False))
    assert fresh.step_costs.source is None and len(timed) == 7
