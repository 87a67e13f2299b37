"""Benchmark statistics as dataclasses (kept apart from the code that runs, prints or plots them).

Terms (docs/architecture.md, "Terms")
-----
run
    one prompt decoded once in one mode (plain or Medusa) under one acceptance
    (greedy or typical): tokens, decoding steps, summed step seconds, prefill and
    wall-clock seconds of the ``generate`` call.
acceleration rate
    tokens emitted per decoding step, ``Σ tokens emitted in steps / Σ steps``
    (the prefill's first token is excluded; plain decoding is 1).
step overhead
    mean Medusa step latency / mean plain step latency on the same prompts.
speedup
    Medusa tokens/s / plain tokens/s, tokens/s being generated tokens over the
    wall-clock time of the whole ``generate`` call (prefill included).
against vLLM (``--vllm``, greedy only)
    plain or Medusa tokens/s / bare vLLM's tokens/s on the same prompts (``vllm.LLM``,
    the whole ``generate`` call of one prompt), the decoding a user would run instead.
predicted speedup
    acceleration rate / step overhead (the sweep: expected acceptance length of the
    tree under the calibrated accuracies / measured overhead of its forward).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Run:
    prompt_id: str
    category: str
    mode: str  # plain | medusa | vllm (bare vLLM, greedy: distill.bench.baseline)
    acceptance: str  # greedy | typical
    prompt_tokens: int
    tokens: int
    step_tokens: int  # tokens emitted by decoding steps (tokens minus the prefill's)
    steps: int
    step_seconds: float
    prefill_seconds: float
    wall_seconds: float
    finish_reason: str
    token_ids: list[int] = field(default_factory=list, repr=False)


@dataclass
class Group:
    """Plain vs Medusa over one set of prompts (a category, or all)."""

    acceptance: str
    category: str
    prompts: int
    plain_tokens: int
    medusa_tokens: int
    plain_tokens_per_s: float
    medusa_tokens_per_s: float
    acceleration_rate: float
    plain_step_ms: float
    medusa_step_ms: float
    step_overhead: float
    speedup: float
    identical: int | None = None  # greedy: prompts whose Medusa output equals plain decoding's
    vllm_tokens_per_s: float | None = None  # bare vLLM on the same prompts (--vllm; greedy)
    plain_vs_vllm: float | None = None
    medusa_vs_vllm: float | None = None
    vllm_identical: int | None = None  # prompts whose vLLM output equals our plain decoding's

    @classmethod
    def of(cls, acceptance: str, category: str, plain: list[Run], medusa: list[Run], vllm: list[Run] = ()) -> "Group":
        def rate(runs: list[Run]) -> float:
            secs = sum(r.wall_seconds for r in runs)
            return sum(r.tokens for r in runs) / secs if secs else 0.0

        def step_ms(runs: list[Run]) -> float:
            steps = sum(r.steps for r in runs)
            return 1000 * sum(r.step_seconds for r in runs) / steps if steps else 0.0

        m_steps = sum(r.steps for r in medusa)
        accel = sum(r.step_tokens for r in medusa) / m_steps if m_steps else 0.0
        p_ms, m_ms = step_ms(plain), step_ms(medusa)
        p_rate, m_rate = rate(plain), rate(medusa)
        identical = None
        plain_ids = {r.prompt_id: r.token_ids for r in plain}
        if acceptance == "greedy":
            identical = sum(1 for r in medusa if plain_ids.get(r.prompt_id) == r.token_ids)
        against = {}
        if vllm:
            v_rate = rate(list(vllm))
            against = dict(vllm_tokens_per_s=v_rate, plain_vs_vllm=p_rate / v_rate if v_rate else 0.0,
                           medusa_vs_vllm=m_rate / v_rate if v_rate else 0.0,
                           vllm_identical=sum(1 for r in vllm if plain_ids.get(r.prompt_id) == r.token_ids))
        return cls(
            acceptance=acceptance, category=category, prompts=len(medusa),
            plain_tokens=sum(r.tokens for r in plain), medusa_tokens=sum(r.tokens for r in medusa),
            plain_tokens_per_s=p_rate, medusa_tokens_per_s=m_rate, acceleration_rate=accel,
            plain_step_ms=p_ms, medusa_step_ms=m_ms, step_overhead=m_ms / p_ms if p_ms else 0.0,
            speedup=m_rate / p_rate if p_rate else 0.0, identical=identical, **against,
        )


@dataclass
class SweepPoint:
    nodes: int  # tree nodes N (0 = plain decoding: the 1-token step)
    tokens: int  # tokens in the verification forward (N + 1)
    seconds: float  # median wall-clock of one step (forward + heads' proposal)
    overhead: float  # seconds / plain seconds
    expected_acceptance_length: float  # tau(N) under the accuracy table
    predicted_speedup: float  # tau(N) / overhead(N)


@dataclass
class Sweep:
    context: int
    repeats: int
    accuracy_source: str  # where the accuracy table came from
    accuracy: list[list[float]]
    points: list[SweepPoint]
    best_nodes: int
    best_predicted_speedup: float
    step_cost_ratio: float  # least-squares r of overhead(N) = 1 + r * N (EngineConfig.step_cost_ratio)
    device: str


@dataclass
class BenchResult:
    config: dict
    machine: str
    date: str
    model: str
    heads: str
    tree: dict  # nodes, source
    groups: list[Group]
    runs: list[Run]
    sweep: Sweep | None = None

    def to_dict(self, with_token_ids: bool = False) -> dict:
        d = asdict(self)
        if not with_token_ids:
            for r in d["runs"]:
                r.pop("token_ids", None)
        return d

    def overall(self, acceptance: str) -> Group | None:
        return next((g for g in self.groups if g.acceptance == acceptance and g.category == "all"), None)
