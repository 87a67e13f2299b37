"""The one config of ``distill generate``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

from distill.configs import config_from_options
from distill.errors import ConfigError, check_choice
from distill.models import chat_template_kwargs, load_chat_template
from distill.runtime import canonical_dtype
from distill.templating import REASONING

MODES = ("multi-turn", "self-talk", "single-turn")
PROMPTS_DIR = Path(__file__).resolve().parents[2] / "prompts"
DEFAULT_USER_PROMPT = "selftalk_user.md"
DEFAULT_SELFTALK_TURNS = 4
#: multi-turn: user turns replayed per conversation unless --turns says otherwise. A bound on one conversation's work
#: (each turn is one more engine call after the others of its chunk ended); a seed row with more is cut there and
#: ends as ``truncated_turns``. High enough that ordinary chat data is seldom cut; --turns 0 replays all.
DEFAULT_MULTITURN_TURNS = 64


#: The most teacher candidates stored per token (the vLLM backend asks its engine for this many).
MAX_TOPK = 64


@dataclass
class GenerateConfig:
    """Everything ``distill generate`` does is decided here (stored in every shard's metadata).

    ``seed`` is the seed *data* source (NAME | PATH | hf:ID[:split]); the random
    seed of sampling is ``sampling_seed``.
    """

    seed: str = "sharegpt"
    out: str = "out/sharegpt"
    seed_format: str | None = None
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    backend: str = "auto"  # auto | vllm | hf | openai
    mode: str = "multi-turn"
    turns: int | None = None  # self-talk: at most this many assistant turns (default 4); multi-turn: at most N user turns (default 64; 0 = all)
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0  # sampling: only the K most likely tokens (0: all); not --teacher-topk, the teacher candidates stored
    min_p: float = 0.0  # sampling: drop tokens less likely than min_p x the most likely one (0: none)
    repetition_penalty: float = 1.0  # vLLM's: logits of tokens already in the conversation / (or x) this (1: none)
    samples: int = 1  # independent completions per seed conversation (ids <seed id>#s0..#s{N-1} when N > 1)
    max_new_tokens: int = 512  # per assistant turn (and per simulated user turn)
    max_model_len: int | None = None  # context-length guard; None: the model's
    topk: int = 20
    sampling_seed: int = 0
    system_prompt: str | None = None  # used when the seed row has no system message
    user_prompt: str = DEFAULT_USER_PROMPT  # self-talk user-simulator prompt (file in prompts/ or a path)
    end_marker: str = "[END]"  # the simulated user ends the conversation by writing this
    shard_size: int = 1000
    limit: int | None = None  # only the first N seed rows
    dtype: str = "auto"  # auto: distill.runtime's rule (the model's dtype; bf16 on CPUs only where native)
    batch_size: int = 16  # hf backend: sequences per generate call
    enforce_eager: bool | None = None
    tensor_parallel_size: int = 1
    part: str | None = None  # "I/N": only seed rows with index % N == I (data parallelism: one process per GPU)
    server: str | None = None  # openai: URL[,URL...] of running vLLM OpenAI servers
    concurrency: int = 64  # openai: conversations in flight
    api_key_env: str | None = None  # openai: the environment variable that holds the servers' API key
    retries: int = 8  # openai: attempts after the first per request (connection errors, 429, 5xx)
    chat_template: str | None = None  # a Jinja file, or the template itself; None: the model's own
    chat_template_kwargs: dict | None = None  # the template's extra variables (JSON object or mapping), e.g. enable_thinking
    reasoning: str = "keep"  # keep | strip | both: the think blocks the stored messages keep (templating.reasoning_view)

    def __post_init__(self) -> None:
        check_choice("--mode", self.mode, MODES)
        if not 1 <= self.topk <= MAX_TOPK:
            raise ConfigError(f"--teacher-topk must be between 1 and {MAX_TOPK}; got {self.topk}")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0; got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0 (0: no top-k sampling); got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"--min-p must be in [0, 1]; got {self.min_p}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise ConfigError(f"--repetition-penalty must be > 0 (1: none); got {self.repetition_penalty}")
        if self.samples < 1:
            raise ConfigError(f"--samples must be >= 1; got {self.samples}")
        if self.samples > 1 and self.temperature == 0:
            raise ConfigError(f"--samples {self.samples} needs --temperature > 0: greedy decoding gives {self.samples} identical completions")
        for name in ("max_new_tokens", "shard_size", "batch_size", "tensor_parallel_size", "concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(self, name)}")
        if self.turns is None:
            self.turns = {"self-talk": DEFAULT_SELFTALK_TURNS, "multi-turn": DEFAULT_MULTITURN_TURNS}.get(self.mode, 0)
        if self.turns < 0 or (self.mode == "self-talk" and self.turns < 1):
            raise ConfigError(f"--turns must be >= 1 in self-talk mode (>= 0 otherwise); got {self.turns}")
        if self.limit is not None and self.limit < 0:
            raise ConfigError(f"--limit must be >= 0; got {self.limit}")
        if self.part is not None:
            self.part_slot  # validates I/N
        if self.retries < 0:
            raise ConfigError(f"--retries must be >= 0; got {self.retries}")
        if self.backend == "openai" and not self.server:
            raise ConfigError("--backend openai needs --server URL[,URL...] (running vLLM OpenAI servers)")
        if self.server and self.backend != "openai":
            raise ConfigError(f"--server is for --backend openai (got --backend {self.backend})")
        self.dtype = canonical_dtype(self.dtype)
        load_chat_template(self.chat_template)  # a missing file is an error now, not after the engine loaded
        self.chat_template_kwargs = chat_template_kwargs(self.chat_template_kwargs)
        check_choice("--reasoning", self.reasoning, REASONING)
        if self.max_model_len is not None and self.max_model_len <= self.max_new_tokens:
            raise ConfigError(f"--max-model-len ({self.max_model_len}) must exceed --max-tokens ({self.max_new_tokens})")

    @cached_property
    def part_slot(self) -> tuple[int, int]:
        """``--part I/N`` as (I, N), parsed once; (0, 1) without --part."""
        if self.part is None:
            return 0, 1
        i, slash, n = str(self.part).partition("/")
        try:
            index, count = int(i), int(n)
        except ValueError:
            index = count = -1
        if not slash or count < 1 or not 0 <= index < count:
            raise ConfigError(f"--part takes I/N with 0 <= I < N (e.g. 0/4); got '{self.part}'")
        return index, count

    def in_part(self, index: int) -> bool:
        """Whether seed row ``index`` belongs to this process's part (always, without --part)."""
        i, n = self.part_slot
        return index % n == i

    @property
    def user_prompt_path(self) -> Path:
        p = Path(self.user_prompt)
        if not p.is_absolute() and not p.exists():
            p = PROMPTS_DIR / self.user_prompt
        if not p.is_file():
            raise ConfigError(f"user-simulator prompt '{self.user_prompt}' not found (looked in {PROMPTS_DIR})")
        return p

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GenerateConfig":
        return config_from_options(cls, data, "generate")
