"""The engine's one config, :class:`EngineConfig`, and the constants its defaults come from.

Torch-free: the serving and benchmark configs nest an ``EngineConfig``, and ``--help`` reads their defaults
without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from distill.errors import ConfigError, check_choice
from distill.runtime import canonical_dtype, stage_dtype, torch_dtype

#: Typical acceptance's ε and δ (:func:`distill.engine.acceptance.typical_accept`): Medusa's defaults.
TYPICAL_EPSILON = 0.09
TYPICAL_DELTA = 0.3
ACCEPTANCE_MODES = ("greedy", "typical", "rejection")
WEIGHT_LAYOUTS = ("auto", "as-loaded")
ATTENTIONS = ("auto", "sdpa")


#: The heads value that selects the lookup proposer (nothing trained): ``--heads lookup``.
LOOKUP = "lookup"

@dataclass
class EngineConfig:
    """Engine settings (see docs/architecture.md)."""

    acceptance: str = "typical"  # what sampled (temperature > 0) requests use; temperature 0 always uses greedy
    typical_epsilon: float = TYPICAL_EPSILON
    typical_delta: float = TYPICAL_DELTA
    tree: str | None = None  # Medusa: tree.json path, chain[-K], sparse-N, Cartesian "3,2,2,1"; None = heads' tree.json or sparse-24
    draft_nodes: int | None = None  # EAGLE / lookup: node budget N of the dynamic tree (None: the proposer's default)
    lookup_data: str | None = None  # lookup: a self-distilled dataset of this model, indexed as its datastore
    lookup_history: int | None = None  # lookup: tokens of this engine's earlier replies it drafts from (None: the
    # proposer's DEFAULT_HISTORY_TOKENS; 0: none)
    lookup: bool = False  # with Medusa heads or an EAGLE drafter: the lookup proposer's tree merged into theirs every step
    # (engine.proposers.union; draft_nodes stays the drafter's)
    lookup_nodes: int | None = None  # the lookup proposer's node budget, alone or merged (None: draft_nodes with heads
    # "lookup", else its DEFAULT_NODES)
    draft_depth: int | None = None  # EAGLE: depth D of the dynamic tree (None: the proposer's DEFAULT_DEPTH)
    draft_topk: int | None = None  # EAGLE: K, nodes expanded per depth and children per expanded node (None: its DEFAULT_TOPK)
    sample_drafts: bool = True  # rejection mode, EAGLE: sampled rows' drafts drawn from q (multi-round speculative sampling); False: top-K point masses
    max_batch: int = 8  # largest batch generate() runs at once
    speculate_max_batch: int | None = None  # set: the full tree up to this batch size, plain above; None: the cost model decides
    dtype: str = "auto"  # auto: the heads' teacher dtype, else distill.runtime's rule
    device: str = "auto"  # auto: CUDA when available, else CPU
    step_cost_ratio: float | None = None  # r of the policy's cost model, a line (None: measured_costs, else DEFAULT_COST_RATIO)
    measured_costs: bool | None = None  # time forwards of 1, 2, 3, 5, 9, ... rows at start: the policy's step-cost curve
    # (engine.costs; seconds of the first start); None: on a CPU when step_cost_ratio is not given (CUDA: the line, corrected
    # by the adaptive policy's measured step times)
    cached_costs: bool = True  # a curve and single-row kernel times timed before for the same machine, shapes and
    # kernels are reused ($DISTILL_HOME/step-costs and kernels, engine.kept); False: timed at every start
    adaptive: bool = False  # correct the policy with measured acceptance and step times (policy.AdaptivePolicy)
    weight_layout: str = "auto"  # "auto": CPU float32 linears re-laid out and packed (engine.cpu.linears), RMSNorms and
    # the rotary embedding on vLLM's CPU kernels where they load (engine.cpu.norms, engine.cpu.rotary); "as-loaded": as they came
    attention: str = "auto"  # "auto": on a CPU with weight_layout "auto" and eager steps, vLLM's attention kernel where
    # it passes its check (engine.cpu.paged), SDPA elsewhere; "sdpa": SDPA (in row chunks) everywhere
    compile: bool = False  # torch.compile the decoding steps' forwards (on a CPU single-token steps only; Target.forward)
    cuda_graphs: bool | None = None  # decoding steps replayed as CUDA graphs (engine.graphs), compiled or not; None: on for CUDA

    def __post_init__(self) -> None:
        check_choice("acceptance", self.acceptance, ACCEPTANCE_MODES)
        if not (0 < self.typical_epsilon < 1 and self.typical_delta > 0):
            raise ConfigError("typical acceptance needs 0 < epsilon < 1 and delta > 0")
        if self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.speculate_max_batch is not None and self.speculate_max_batch < 0:
            raise ConfigError(f"speculate_max_batch must be >= 0, got {self.speculate_max_batch}")
        self.dtype = canonical_dtype(self.dtype)
        check_choice("weight_layout", self.weight_layout, WEIGHT_LAYOUTS)
        check_choice("attention", self.attention, ATTENTIONS)
        if self.step_cost_ratio is not None and self.step_cost_ratio < 0:
            raise ConfigError(f"step_cost_ratio must be >= 0, got {self.step_cost_ratio}")
        if self.lookup_history is not None and self.lookup_history < 0:
            raise ConfigError(f"lookup_history must be >= 0 tokens; got {self.lookup_history}")
        if self.lookup_nodes is not None and self.lookup_nodes < 1:
            raise ConfigError(f"lookup_nodes must be >= 1; got {self.lookup_nodes}")
        if min(1 if n is None else n for n in (self.draft_nodes, self.draft_depth, self.draft_topk)) < 1:
            raise ConfigError(f"draft_nodes, draft_depth and draft_topk must be >= 1; got {self.draft_nodes}, "
                              f"{self.draft_depth}, {self.draft_topk}")

    @property
    def torch_dtype(self):  # -> torch.dtype
        return torch_dtype(self.dtype)


def resolve_placement(config: EngineConfig, model_path: Path | str | None, heads: str | Path | None):
    """The device and dtype the model runs in with ``heads``, for the distill engine and for ``serve --engine vllm``
    alike: :func:`distill.runtime.stage_dtype` with the heads' teacher dtype (none for plain decoding and the
    lookup proposer). Returns a :class:`distill.runtime.Placement`."""
    from distill.heads.model import read_distill_meta

    teacher = read_distill_meta(Path(heads)).get("teacher_dtype") if heads is not None and str(heads) != LOOKUP else None
    return stage_dtype(model_path, config.device, config.dtype, teacher, what=f"the heads in {heads}")
