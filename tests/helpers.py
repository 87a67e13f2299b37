"""Code the test modules share (test modules import from here and from conftest, never from each other).

Tiny random Llamas and the Medusa and EAGLE engines on them; the chi-square test of sampled continuations
against the exact continuation distribution; heads and drafters for the bundled model; `distill serve` as a process.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import openai
import torch

from conftest import DISTILL, free_port
from distill.engine import Engine, EngineConfig, SamplingParams
from distill.engine.proposers.eagle import Eagle
from distill.heads import HeadsConfig, MedusaHeads
from distill.heads.eagle import DrafterConfig, EagleDrafter, default_aux_layers
from distill.heads.vocab import DraftVocab
from distill.sampling import warp


# -- tiny random Llamas ----------------------------------------------------------------------------------
def tiny_sizes(*, vocab: int = 64, hidden: int = 16, intermediate: int = 32, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, positions: int = 64) -> dict:
    """The size arguments of a transformers config, under the names Llama's config (and Mistral's) take."""
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions)


def tiny_llama_config(*, tied: bool = False, special_tokens: bool = True, vocab: int = 64, hidden: int = 16,
                      intermediate: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2, positions: int = 64,
                      **more):
    """A small LlamaConfig: ``tied`` ties the LM head to the embeddings; ``special_tokens=False`` leaves out the
    BOS, EOS and padding tokens (no sequence ends before its token budget); ``more`` goes to LlamaConfig as it is."""
    from transformers import LlamaConfig

    if not special_tokens:
        more = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None, **more)
    sizes = tiny_sizes(vocab=vocab, hidden=hidden, intermediate=intermediate, layers=layers, heads=heads, kv_heads=kv_heads,
                       positions=positions)
    return LlamaConfig(**sizes, tie_word_embeddings=tied, **more)


def tiny_llama(*, seed: int = 0, **config):
    """A random LlamaForCausalLM (eval mode) of ``tiny_llama_config(**config)``, its weights drawn after torch.manual_seed(seed)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_llama_config(**config)
    model = LlamaForCausalLM(cfg).eval()
    if cfg.eos_token_id is None:
        model.generation_config.eos_token_id = None
    return model


# -- the tiny Medusa and EAGLE engines, and the losslessness test ------------------------------------------
VOCAB = 8  # the sampling tests' vocabulary: small enough to enumerate every continuation, and drafts are often right
ALPHA = 1e-3  # the chi-square tests' significance level
SAMPLES = 6000  # continuations drawn per distribution
CONT = 3  # tokens per continuation: VOCAB ** CONT = 512 outcomes


def tiny_medusa():
    """A 1-layer random Llama (hidden 32, vocabulary 8) and 3 random heads (LM-head init + random residuals)."""
    model = tiny_llama(vocab=VOCAB, hidden=32, intermediate=64, layers=1, heads=2, kv_heads=1, positions=128,
                       initializer_range=0.25, special_tokens=False)
    heads = MedusaHeads(HeadsConfig(32, VOCAB, num_heads=3), lm_head_weight=model.lm_head.weight.detach())
    with torch.no_grad():
        for block in heads.blocks:
            for layer in block.layers:
                layer.weight.normal_(0, 0.3)
    return model, heads.eval()


def tiny_medusa_engine(tiny, acceptance: str, tree: str = "2,2,2") -> Engine:
    """An engine of ``tiny_medusa()``'s model and heads taking SAMPLES rows at once."""
    model, heads = tiny
    cfg = EngineConfig(acceptance=acceptance, tree=tree, max_batch=SAMPLES, speculate_max_batch=SAMPLES)
    return Engine(model, None, heads, cfg, model_name="tiny")


def tiny_eagle():
    """A 3-layer random Llama (hidden 32, vocabulary 8) and a random EAGLE-3 drafter fusing its layers 0, 1, 2."""
    model = tiny_llama(vocab=VOCAB, hidden=32, intermediate=64, layers=3, heads=2, kv_heads=1, positions=256,
                       initializer_range=0.25, special_tokens=False)
    vocab = DraftVocab.full(VOCAB)
    drafter = EagleDrafter(DrafterConfig.for_target(model.config.to_dict(), [0, 1, 2], VOCAB), vocab)
    drafter.init_from_target(model.lm_head.weight.detach(), model.model.norm.weight.detach())
    with torch.no_grad():  # a drafter that is partly right: the lens plus random residual branches
        drafter.midlayer.self_attn.o_proj.weight.normal_(0, 0.05)
        drafter.midlayer.mlp.down_proj.weight.normal_(0, 0.05)
        drafter.norm.weight.mul_(5.0)
    return model, drafter.eval()


def exact_distribution(model, prompt: list[int], temperature: float, top_p: float) -> torch.Tensor:
    """P(x1 x2 x3 | prompt) for all VOCAB^3 continuations, flattened in lexicographic order: (VOCAB^3,)."""
    probs = torch.ones(1)
    prefixes: list[tuple[int, ...]] = [()]
    with torch.inference_mode():
        for _ in range(CONT):
            ids = torch.tensor([prompt + list(p) for p in prefixes])
            logits = model(ids).logits[:, -1:]  # (N, 1, V)
            n = len(prefixes)
            p = warp(logits, torch.full((n,), temperature), torch.full((n,), top_p))[:, 0]  # (N, V)
            probs = (probs[:, None] * p).reshape(-1)
            prefixes = [q + (x,) for q in prefixes for x in range(VOCAB)]
    return probs.double()


def chi2_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square distribution: Q(dof/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_pvalue(samples: list[list[int]], exact: torch.Tensor) -> float:
    """Chi-square goodness of fit of continuations to ``exact``, bins with expected < 5 pooled."""
    codes = torch.tensor([sum(t * VOCAB ** (CONT - 1 - i) for i, t in enumerate(s)) for s in samples])
    counts = torch.bincount(codes, minlength=VOCAB**CONT).double()
    expected = exact * len(samples)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return chi2_sf(stat, int(keep.sum()) - 1)


# -- EAGLE decoding checks ---------------------------------------------------------------------------------
def joining_rows_decode_as_plain(engine, prompts, plain) -> None:
    """Continuous batching: rows join a running batch three at a time and leave as they finish (the draft state moves
    with them); each row's tokens equal its plain greedy ones."""
    run = engine.running_batch()
    done = {}
    for k in range(0, len(prompts), 3):
        done.update(run.add(prompts[k : k + 3], [SamplingParams(max_tokens=8 + 2 * k)] * len(prompts[k : k + 3]),
                            list(range(k, min(k + 3, len(prompts))))))
        for _ in range(2):
            done.update(run.step())
    while len(run):
        done.update(run.step())
    for k, p in enumerate(prompts):
        assert done[k].token_ids == plain[k][: 8 + 2 * (k - k % 3)]


def generate_watching_drafts(engine: Engine, eagle: Eagle, prompts, params):
    """Generate, keeping each tree ``eagle`` drafts with its root's draft log-probabilities, and counting the drafter's
    passes: (token ids per prompt, [(tree tokens, logp)], passes, stats)."""
    drafts, passes = [], []

    def spy(state, *args, **kwargs):
        out = Eagle.propose(eagle, state, *args, **kwargs)  # catches up on the deferred steps first
        drafts.append((out.tokens.clone(), state.logp.clone()))
        return out

    eagle.propose = spy
    hook = eagle.drafter.register_forward_hook(lambda *a: passes.append(1))
    try:
        results, stats = engine.generate(prompts, params)
    finally:
        hook.remove()
        del eagle.propose
    return [r.token_ids for r in results], drafts, len(passes), stats


# -- heads and drafters for the bundled model ---------------------------------------------------------------
def make_heads(model, random_w1: bool, seed: int = 0, num_heads: int = 4, scale: float = 0.05) -> MedusaHeads:
    """Heads initialised from the LM head; random_w1 adds random residual weights (std ``scale``) so heads disagree with it."""
    lm = model.get_output_embeddings().weight.detach()
    heads = MedusaHeads(HeadsConfig(lm.shape[1], lm.shape[0], num_heads=num_heads), lm_head_weight=lm)
    if random_w1:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for block in heads.blocks:
                for layer in block.layers:
                    layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * scale)
    return heads.eval()


def bundled_drafter(model, kind: str) -> EagleDrafter:
    """``fresh``: init_from_target (the logit lens); ``random``: Llama-initialised weights (a wrong drafter)."""
    conf = model.config.to_dict()
    torch.manual_seed(1)
    vocab = DraftVocab.from_target_ids(range(0, model.config.vocab_size, 2), model.config.vocab_size)
    d = EagleDrafter(DrafterConfig.for_target(conf, default_aux_layers(model.config.num_hidden_layers), vocab.size), vocab)
    if kind == "fresh":
        d.init_from_target(model.get_output_embeddings().weight.detach(), model.model.norm.weight.detach())
    return d.eval()


# -- `distill serve` as a process ----------------------------------------------------------------------------
API_KEY = "test-key-123"
START_TIMEOUT_S = 300  # model load on a busy 2-core machine


class Server:
    def __init__(self, args: list[str], log: Path, log_level: str = "warning"):
        self.port = free_port()
        self.log = log
        # OMP_NUM_THREADS as the worker has it (conftest.py, scripts/test.sh): more threads than cores spin
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen([DISTILL, "serve", "--port", str(self.port), "--log-level", log_level, *args],
                                     stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"distill serve exited with {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"distill serve did not become healthy in {START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)

    def client(self, key: str = API_KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, timeout=300, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def plain_answers(model_dir, max_tokens: int):
    """The engine's plain greedy decoding (no heads), batch 1, of ``messages`` (chat-templated) or a raw ``prompt``:
    answer(messages=None, prompt=None, max_tokens=max_tokens) -> (text, tokens), the reference a server's greedy
    answers must equal."""
    engine = Engine.from_pretrained(str(model_dir), None, EngineConfig(max_batch=1))
    tok = engine.tokenizer
    default_tokens = max_tokens

    def answer(messages=None, prompt=None, max_tokens=default_tokens) -> tuple[str, int]:
        if messages is not None:
            ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
        else:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
        (res,), _ = engine.generate([ids], [SamplingParams(max_tokens=max_tokens, temperature=0.0)], speculative=False)
        return tok.decode(res.token_ids, skip_special_tokens=True), len(res.token_ids)

    return answer


def chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]
