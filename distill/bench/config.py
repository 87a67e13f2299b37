"""The benchmark stage's one config (``distill bench``)."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields

from distill.configs import check_lookup_options, nested_hints
from distill.engine.config import EngineConfig
from distill.errors import ConfigError
from distill.models import chat_template_kwargs, load_chat_template

MODES = ("greedy", "typical")
DEFAULT_SWEEP_NODES = (1, 2, 4, 8, 16, 32, 64)
#: bench's options that are its engine's settings (``BenchConfig.decoding``), under EngineConfig's names.
ENGINE_OPTIONS = ("tree", "draft_nodes", "lookup_data", "lookup_history", "lookup", "lookup_nodes", "compile", "cuda_graphs",
                  "typical_epsilon", "typical_delta", "dtype", "device")
#: bench's defaults where EngineConfig's differ: one prompt at a time (the timings are batch-1 decoding's), and the
#: adaptive policy as ``distill serve`` runs it, so that what bench measures is what serving does.
ENGINE_DEFAULTS = {"max_batch": 1, "adaptive": True}


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
        (an option: ``decoding.speculate_max_batch`` 1) verify the whole tree at every Medusa step (the
        engine's speculation policy off), which measures the tree itself; by default the policy may shrink
        the tree or decode plainly when its cost model says speculation does not pay.
    tree_acceptance
        with the policy deciding the tree (not ``full_tree``): also decode the greedy prompts once with the whole tree,
        untimed, after the timed passes, and report its tokens per step: what the tree accepts on these prompts,
        which the policy weighs against this machine's break-even (``BenchResult.tree["full_tree_tokens_per_step"]``).
    vllm
        also decode the greedy prompts with bare vLLM (:mod:`distill.bench.baseline`), the
        runs interleaved with ours per prompt, and report plain and speculative tokens/s
        against it: the comparison a user makes with ``vllm serve``.
    sweep_nodes / sweep_context / sweep_repeats
        the ``--sweep-tree`` grid: tree sizes, the context length a verification
        forward is timed at, and timed repeats per size (the median is kept).
    decoding
        the engine's settings (:meth:`from_options` builds the config from the command's flat options).
    """

    heads: str
    model: str | None = None
    prompts: str = "mt-bench"
    limit: int | None = None
    max_tokens: int = 128
    modes: tuple[str, ...] = MODES
    temperature: float = 0.7  # for the typical mode
    vllm: bool = False  # also bare vLLM on the greedy prompts (the yardstick); needs the greedy mode
    tree_acceptance: bool = False  # also one untimed greedy pass with the full tree: what the tree accepts
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
    decoding: EngineConfig = field(default_factory=lambda: EngineConfig(**ENGINE_DEFAULTS))

    @classmethod
    def option_hints(cls) -> dict[str, object]:
        """bench's option keys and their annotations (:func:`distill.configs.option_hints`)."""
        return nested_hints(cls, "decoding", ENGINE_OPTIONS) | {"full_tree": bool}

    @classmethod
    def option_defaults(cls) -> dict:
        """bench's options' defaults, as ``--help`` shows them."""
        engine = EngineConfig(**ENGINE_DEFAULTS)
        own = {f.name: f.default for f in fields(cls) if f.default is not MISSING}
        return own | {k: getattr(engine, k) for k in ENGINE_OPTIONS} | {"full_tree": False}

    @classmethod
    def from_options(cls, **options) -> "BenchConfig":
        """The config from bench's flat options (the flags', the file's and ``--set``'s keys): the engine's settings
        into ``decoding`` over bench's defaults; ``full_tree`` is the full tree up to batch 1 (speculate_max_batch)."""
        engine = {k: options.pop(k) for k in ENGINE_OPTIONS if k in options}
        check_lookup_options(options.get("heads"), engine.get("lookup_data"), engine.get("lookup_history"),
                             lookup=engine.get("lookup", False), lookup_nodes=engine.get("lookup_nodes"))
        if options.pop("full_tree", False):
            engine["speculate_max_batch"] = 1
        return cls(**options, decoding=EngineConfig(**(ENGINE_DEFAULTS | engine)))

    @property
    def full_tree(self) -> bool:
        """The whole tree verified at every step: the engine's speculation policy off."""
        return self.decoding.speculate_max_batch is not None

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
        d = self.decoding
        check_lookup_options(self.heads, d.lookup_data, d.lookup_history, lookup=d.lookup, lookup_nodes=d.lookup_nodes)
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
