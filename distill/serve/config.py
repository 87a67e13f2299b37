"""The serving stage's one config (``distill serve``)."""

from __future__ import annotations

import ipaddress
from dataclasses import asdict, dataclass

from distill.configs import check_lookup_options
from distill.errors import ConfigError, check_choice
from distill.models import chat_template_kwargs
from distill.runtime import canonical_dtype

ENGINES = ("distill", "vllm")
ACCEPTANCE = ("greedy", "typical", "rejection")
DEFAULT_MAX_BATCH = 8


@dataclass
class ServeConfig:
    """Everything ``distill serve`` needs; validated here, printed at start-up.

    ``queue_size`` bounds the requests waiting for the engine (not those it is
    running); a request that does not fit gets HTTP 503. ``max_batch`` is how many
    sequences decode together (waiting ones join between steps as rows free up).
    ``default_max_tokens`` applies when a request gives no ``max_tokens`` (None: the rest of the
    context, as vLLM, or the generation config's ``max_new_tokens``). ``generation_config``: where
    requests' sampling defaults come from, as vLLM's option: ``auto`` the model's
    ``generation_config.json``, ``vllm`` (or ``none``) neutral defaults, or a folder holding one.
    ``chat_template``: a Jinja template file, or the template itself; None: the tokenizer's.
    ``chat_template_kwargs``: the template's extra variables for every chat request (e.g.
    ``{"enable_thinking": false}``); a request's own ``chat_template_kwargs`` override them, as
    with vLLM's ``--default-chat-template-kwargs``.
    """

    model: str | None = None  # None = the bundled SmolLM2
    heads: str | None = None  # None = plain decoding only
    engine: str = "distill"  # distill | vllm
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the engine's model name
    queue_size: int = 64
    max_batch: int | None = None  # distill engine: None = 8; vllm: None = vLLM's own --max-num-seqs
    default_max_tokens: int | None = None
    generation_config: str = "auto"  # auto | vllm | none | a folder with generation_config.json
    chat_template: str | None = None  # a file, or the template text; None: the model's own
    chat_template_kwargs: dict | None = None  # JSON object or mapping: defaults under each request's chat_template_kwargs
    max_model_len: int | None = None  # default: the model's context length
    tree: str | None = None  # tree.json, a named default, or a Cartesian spec "3,2,2,1"
    draft_nodes: int | None = None  # EAGLE drafter or lookup: node budget of the dynamic tree (None: the proposer's default)
    lookup_data: str | None = None  # lookup: a self-distilled dataset of this model as its datastore (engine.datastore)
    lookup_history: int | None = None  # lookup: tokens of the server's earlier replies it drafts from (None: the default)
    lookup: bool = False  # with --heads FOLDER: the lookup proposer's trees merged into the heads' or drafter's (engine.union)
    lookup_nodes: int | None = None  # the lookup proposer's node budget, alone or merged (None: --draft-nodes / its default)
    acceptance: str = "typical"
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    dtype: str = "auto"  # auto: the heads' teacher dtype, else distill.runtime's rule
    device: str = "auto"  # auto: CUDA when available, else CPU
    shutdown_grace: float = 10.0  # seconds admitted requests get to finish after SIGTERM
    max_body_bytes: int | None = None  # request bodies over this get 413 unread; None: max(4 MiB, 64 bytes x the context)
    num_speculative_tokens: int | None = None  # vllm engine: default = the heads' num_heads
    step_cost_ratio: float | None = None  # engine cost model r (from `distill bench --sweep-tree`); None: the curve measured at start on a CPU, r = 0.002 on CUDA
    adaptive: bool = True  # tree size from measured acceptance and step times (distill.engine.policy.AdaptivePolicy)
    compile: bool = False  # distill engine: torch.compile its single-token forwards (EngineConfig.compile), compiled at start
    cuda_graphs: bool | None = None  # distill engine: decoding steps as CUDA graphs (EngineConfig.cuda_graphs); None: on with CUDA
    vllm_args: tuple[str, ...] = ()  # --engine vllm: passed to vLLM's server unchanged (what follows `--`)

    def __post_init__(self) -> None:
        check_choice("--engine", self.engine, ENGINES)
        check_choice("--acceptance", self.acceptance, ACCEPTANCE)
        check_lookup_options(self.heads, self.lookup_data, self.lookup_history, self.engine, self.lookup, self.lookup_nodes)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535; got {self.port}")
        if self.host not in ("localhost",):
            try:
                ipaddress.ip_address(self.host)
            except ValueError:
                raise ConfigError(f"--host must be an IP address (e.g. 127.0.0.1 or 0.0.0.0) or localhost; got '{self.host}'") from None
        self.dtype = canonical_dtype(self.dtype)
        self.chat_template_kwargs = chat_template_kwargs(self.chat_template_kwargs)
        self.vllm_args = tuple(self.vllm_args)
        if self.compile and self.engine != "distill":
            raise ConfigError("--compile compiles the distill engine's forwards: vLLM compiles its own (see its -O levels)")
        if self.cuda_graphs is not None and self.engine != "distill":
            raise ConfigError("--cuda-graphs sets the distill engine's CUDA graphs: vLLM captures its own (--enforce-eager turns them off)")
        if self.vllm_args and self.engine != "vllm":
            raise ConfigError(f"arguments after -- go to vLLM's server: they need --engine vllm (got {' '.join(self.vllm_args)})")
        for name in ("queue_size", "max_batch", "default_max_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1; got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"--max-model-len must be at least 2; got {self.max_model_len}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key must not be empty")
        if self.shutdown_grace < 0:
            raise ConfigError(f"--shutdown-grace must be >= 0; got {self.shutdown_grace}")
        if self.max_body_bytes is not None and self.max_body_bytes < 1024:
            raise ConfigError(f"--max-body-bytes must be at least 1024; got {self.max_body_bytes}")
        if self.engine == "vllm":
            if self.heads is None:
                raise ConfigError("--engine vllm serves the model with Medusa heads or an EAGLE-3 drafter: pass --heads DIR")
            if self.tree is not None:
                raise ConfigError("--engine vllm verifies a single chain of head top-1 guesses; --tree applies to the distill engine only")
        if not self.generation_config:
            raise ConfigError("--generation-config must be auto, vllm, none or a folder holding generation_config.json")
        if self.step_cost_ratio is not None and self.step_cost_ratio < 0:
            raise ConfigError(f"--step-cost-ratio must be >= 0; got {self.step_cost_ratio}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ConfigError(f"--num-speculative-tokens must be at least 1; got {self.num_speculative_tokens}")

    @property
    def exposed_without_key(self) -> bool:
        """Bound to an address other machines can reach, with no API key."""
        return self.api_key is None and self.host != "localhost" and not ipaddress.ip_address(self.host).is_loopback

    @property
    def engine_batch(self) -> int:
        """Sequences the distill engine decodes together."""
        return self.max_batch or DEFAULT_MAX_BATCH

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["api_key"] is not None:
            d["api_key"] = "***"
        return d
