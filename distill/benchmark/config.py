"""The benchmark stage's one config (``distill bench``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from distill.configs import check_lookup_options
from distill.errors import ConfigError
from distill.models import chat_template_kwargs, load_chat_template

MODES = ("greedy", "typical")
DEFAULT_SWEEP_NODES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class BenchConfig:
    """Plain vs Medusa decoding on the same prompts, and optionally the tree-size sweep.

    modes
        ``greedy`` (temperature 0: Medusa's output must equal plain decoding's) and/or
        ``typical`` (``temperature`` > 0, typical acceptance, a fixed seed per prompt).
    limit
        at most this many prompts, taken round-robin over the categories so a small
        limit still covers every category (None: all).
    full_tree
        verify the whole tree at every Medusa step (the engine's speculation policy off),
        which measures the tree itself; by default the policy may shrink the tree or
        decode plainly when its cost model says speculation does not pay.
    vllm
        also decode the greedy prompts with bare vLLM (:mod:`distill.benchmark.baseline`), the
        runs interleaved with ours per prompt, and report plain and speculative tokens/s
        against it: the comparison a user makes with ``vllm serve``.
    sweep_nodes / sweep_context / sweep_repeats
        the ``--sweep-tree`` grid: tree sizes, the context length a verification
        forward is timed at, and timed repeats per size (the median is kept).
    """

    heads: str
    model: str | None = None
    prompts: str = "mt-bench"
    limit: int | None = None
    max_tokens: int = 128
    modes: tuple[str, ...] = MODES
    temperature: float = 0.7  # for the typical mode
    tree: str | None = None
    draft_nodes: int | None = None  # EAGLE or lookup: node budget of the dynamic tree (None: the proposer's default)
    lookup_data: str | None = None  # lookup: a self-distilled dataset of this model as its datastore (engine.datastore)
    lookup_history: int | None = None  # lookup: tokens of earlier replies it drafts from (None: the default; cleared per pass)
    lookup: bool = False  # with heads FOLDER: the lookup proposer's trees merged into the heads' or drafter's (engine.union)
    lookup_nodes: int | None = None  # the lookup proposer's node budget, alone or merged (None: --draft-nodes / its default)
    vllm: bool = False  # also bare vLLM on the greedy prompts (the yardstick); needs the greedy mode
    full_tree: bool = False  # always verify the whole tree (policy off); default: the engine's policy decides per step
    compile: bool = False  # torch.compile the engine's single-token forwards (plain and speculative runs alike)
    cuda_graphs: bool | None = None  # decoding steps as CUDA graphs (EngineConfig.cuda_graphs); None: on with CUDA
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    dtype: str = "auto"  # auto: the heads' teacher dtype, else distill.runtime's rule
    device: str = "auto"  # auto: CUDA when available, else CPU
    seed: int = 0
    out: str = "out/bench"
    sweep_tree: bool = False
    sweep_nodes: tuple[int, ...] = DEFAULT_SWEEP_NODES
    sweep_context: int = 256
    sweep_repeats: int = 10
    warmup: int = 1  # untimed generate calls before measuring
    chat_template: str | None = None  # a Jinja file, or the template itself; None: the model's own
    chat_template_kwargs: dict | None = None  # the template's extra variables (JSON object or mapping), e.g. enable_thinking
    extra: dict = field(default_factory=dict)  # free-form notes stored with the results

    def __post_init__(self) -> None:
        if isinstance(self.modes, str):  # the command line's and a YAML file's "greedy,typical"
            self.modes = tuple(m.strip() for m in self.modes.split(",") if m.strip())
        if isinstance(self.sweep_nodes, (str, int)):
            try:
                self.sweep_nodes = tuple(int(x) for x in str(self.sweep_nodes).split(",") if x.strip())
            except ValueError:
                raise ConfigError(f"--sweep-nodes is comma-separated integers like 1,4,16; got '{self.sweep_nodes}'") from None
        self.modes = tuple(self.modes)
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ConfigError(f"--modes must be a comma-separated subset of {', '.join(MODES)}; got {', '.join(self.modes) or 'nothing'}")
        if self.vllm and "greedy" not in self.modes:
            raise ConfigError("--vllm compares greedy decoding with bare vLLM's: add greedy to --modes")
        check_lookup_options(self.heads, self.lookup_data, self.lookup_history, lookup=self.lookup, lookup_nodes=self.lookup_nodes)
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be at least 1; got {self.limit}")
        if self.max_tokens < 1:
            raise ConfigError(f"--max-tokens must be at least 1; got {self.max_tokens}")
        if "typical" in self.modes and not 0 < self.temperature <= 2:
            raise ConfigError(f"the typical mode samples: --temperature must be in (0, 2]; got {self.temperature}")
        self.sweep_nodes = tuple(sorted({int(n) for n in self.sweep_nodes}))
        if any(n < 1 for n in self.sweep_nodes) or not self.sweep_nodes:
            raise ConfigError(f"--sweep-nodes must be positive integers; got {list(self.sweep_nodes)}")
        if self.sweep_context < 1 or self.sweep_repeats < 1 or self.warmup < 0:
            raise ConfigError("--sweep-context and --sweep-repeats must be >= 1, --warmup >= 0")
        load_chat_template(self.chat_template)  # a missing file is an error now, not after the engine loaded
        self.chat_template_kwargs = chat_template_kwargs(self.chat_template_kwargs)

    def to_dict(self) -> dict:
        return asdict(self)
