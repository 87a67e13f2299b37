"""The serving stage's one config (``distill serve``)."""

from __future__ import annotations

import ipaddress
from dataclasses import MISSING, asdict, dataclass, field, fields

from distill.configs import check_lookup_options, nested_hints
from distill.engine.config import EngineConfig
from distill.errors import ConfigError, check_choice
from distill.models import chat_template_kwargs

ENGINES = ("distill", "vllm")
#: serve's options that are its engine's settings (``ServeConfig.decoding``), under EngineConfig's names.
ENGINE_OPTIONS = ("max_batch", "tree", "draft_nodes", "lookup_data", "lookup_history", "lookup", "lookup_nodes", "acceptance",
                  "typical_epsilon", "typical_delta", "dtype", "device", "step_cost_ratio", "adaptive", "compile", "cuda_graphs")
#: serve's defaults where EngineConfig's differ: the adaptive policy on (max_batch keeps EngineConfig's 8 for the distill
#: engine; with --engine vllm it becomes vLLM's --max-num-seqs, vLLM's own when not given).
ENGINE_DEFAULTS = {"adaptive": True}


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
    with vLLM's ``--default-chat-template-kwargs``. ``decoding``: the distill engine's settings (and the dtype and
    device for either engine); :meth:`from_options` builds the config from the command's flat options.
    """

    model: str | None = None  # None = the bundled SmolLM2
    heads: str | None = None  # None = plain decoding only
    engine: str = "distill"  # distill | vllm
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None  # default: the engine's model name
    queue_size: int = 64
    vllm_max_num_seqs: int | None = None  # --engine vllm: the max_batch option, vLLM's --max-num-seqs (None: vLLM's own)
    default_max_tokens: int | None = None
    generation_config: str = "auto"  # auto | vllm | none | a folder with generation_config.json
    chat_template: str | None = None  # a file, or the template text; None: the model's own
    chat_template_kwargs: dict | None = None  # JSON object or mapping: defaults under each request's chat_template_kwargs
    max_model_len: int | None = None  # default: the model's context length
    shutdown_grace: float = 10.0  # seconds admitted requests get to finish after SIGTERM
    max_body_bytes: int | None = None  # request bodies over this get 413 unread; None: max(4 MiB, 64 bytes x the context)
    num_speculative_tokens: int | None = None  # vllm engine: default = the heads' num_heads
    vllm_args: tuple[str, ...] = ()  # --engine vllm: passed to vLLM's server unchanged (what follows `--`)
    decoding: EngineConfig = field(default_factory=lambda: EngineConfig(**ENGINE_DEFAULTS))

    @classmethod
    def option_hints(cls) -> dict[str, object]:
        """serve's option keys and their annotations (:func:`distill.configs.option_hints`)."""
        return nested_hints(cls, "decoding", ENGINE_OPTIONS, leave_out=("vllm_max_num_seqs",)) | {"max_batch": int | None}

    @classmethod
    def option_defaults(cls) -> dict:
        """serve's options' defaults, as ``--help`` shows them (max_batch none: it depends on --engine)."""
        engine = EngineConfig(**ENGINE_DEFAULTS)
        own = {f.name: f.default for f in fields(cls) if f.default is not MISSING and f.name != "vllm_max_num_seqs"}
        return own | {k: getattr(engine, k) for k in ENGINE_OPTIONS if k != "max_batch"}

    @classmethod
    def from_options(cls, **options) -> "ServeConfig":
        """The config from serve's flat options (the flags', the file's and ``--set``'s keys): the engine's settings
        into ``decoding`` over serve's defaults; ``max_batch`` is vLLM's --max-num-seqs with ``engine: vllm``."""
        engine = {k: options.pop(k) for k in ENGINE_OPTIONS if k in options}
        check_lookup_options(options.get("heads"), engine.get("lookup_data"), engine.get("lookup_history"),
                             options.get("engine", "distill"), engine.get("lookup", False), engine.get("lookup_nodes"))
        batch = engine.pop("max_batch", None)
        if options.get("engine") == "vllm":
            options["vllm_max_num_seqs"] = batch
        elif batch is not None:
            engine["max_batch"] = batch
        return cls(**options, decoding=EngineConfig(**(ENGINE_DEFAULTS | engine)))

    def __post_init__(self) -> None:
        check_choice("--engine", self.engine, ENGINES)
        d = self.decoding
        check_lookup_options(self.heads, d.lookup_data, d.lookup_history, self.engine, d.lookup, d.lookup_nodes)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in 0..65535; got {self.port}")
        if self.host not in ("localhost",):
            try:
                ipaddress.ip_address(self.host)
            except ValueError:
                raise ConfigError(f"--host must be an IP address (e.g. 127.0.0.1 or 0.0.0.0) or localhost; got '{self.host}'") from None
        self.chat_template_kwargs = chat_template_kwargs(self.chat_template_kwargs)
        self.vllm_args = tuple(self.vllm_args)
        if d.compile and self.engine != "distill":
            raise ConfigError("--compile compiles the distill engine's forwards: vLLM compiles its own (see its -O levels)")
        if d.cuda_graphs is not None and self.engine != "distill":
            raise ConfigError("--cuda-graphs sets the distill engine's CUDA graphs: vLLM captures its own (--enforce-eager turns them off)")
        if self.vllm_args and self.engine != "vllm":
            raise ConfigError(f"arguments after -- go to vLLM's server: they need --engine vllm (got {' '.join(self.vllm_args)})")
        if self.vllm_max_num_seqs is not None and self.engine != "vllm":
            raise ConfigError("vllm_max_num_seqs is --engine vllm's --max-num-seqs: the distill engine's is decoding.max_batch")
        for name in ("queue_size", "default_max_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1; got {getattr(self, name)}")
        if self.vllm_max_num_seqs is not None and self.vllm_max_num_seqs < 1:
            raise ConfigError(f"--max-batch must be at least 1; got {self.vllm_max_num_seqs}")
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
            if d.tree is not None:
                raise ConfigError("--engine vllm verifies a single chain of head top-1 guesses; --tree applies to the distill engine only")
        if not self.generation_config:
            raise ConfigError("--generation-config must be auto, vllm, none or a folder holding generation_config.json")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 1:
            raise ConfigError(f"--num-speculative-tokens must be at least 1; got {self.num_speculative_tokens}")

    @property
    def exposed_without_key(self) -> bool:
        """Bound to an address other machines can reach, with no API key."""
        return self.api_key is None and self.host != "localhost" and not ipaddress.ip_address(self.host).is_loopback

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["api_key"] is not None:
            d["api_key"] = "***"
        return d
