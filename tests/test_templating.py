"""ChatFormat's tokenizer calls: the Rust tokenizer called directly gives exactly the ids and texts the transformers
tokenizer's own calls give, and a tokenizer whose class handles text its own way is called as it is."""

from __future__ import annotations

import copy
import random

import pytest

import distill.templating as templating
from distill.models import stop_token_ids
from distill.templating import ChatFormat, rust_tokenizer

TEXTS = ["", "\n", " ", "  \n\t", "Hello, World!", "a\u00e9\u4e2d\U0001F600b", "<|im_start|>user\nHi<|im_end|>\n",
         "<|im_end|><|im_end|>x", "<|im_start", "   leading and trailing   ", "123 4567 89.0e-3"]


def _own_encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"]) if text else []


def _random_replies(tok, stops, n: int = 300) -> list[list[int]]:
    rng = random.Random(0)
    special = sorted(tok.all_special_ids)
    replies = []
    for _ in range(n):  # any ids: broken UTF-8 sequences, special tokens inside, a stop token or none at the end
        ids = [rng.choice(special) if rng.random() < 0.05 else rng.randrange(len(tok)) for _ in range(rng.randint(0, 40))]
        replies.append(ids + [rng.choice(sorted(stops))] if rng.random() < 0.6 else ids)
    return replies


def test_direct_calls_give_the_tokenizers_own_ids_and_texts(tokenizer, model_dir, monkeypatch):
    monkeypatch.setattr(templating, "ENCODED_CACHE_CHARS", 64)  # the cache is emptied many times on the way
    stops = frozenset(stop_token_ids(tokenizer, model_dir))
    fmt = ChatFormat(tokenizer, stops)
    assert fmt._rust is tokenizer.backend_tokenizer  # the bundled model's tokenizer takes the direct route
    rng = random.Random(1)
    alphabet = [*"ab c\n\t.,é中😀", "<|im_end|>", "<|im_start|>", "assistant", " the"]
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(200)]
    for text in texts + texts:  # the second time from the cache
        assert fmt.encode(text) == _own_encode(tokenizer, text), repr(text)
    assert sum(map(len, fmt._encoded)) <= 64
    first = fmt.encode("<|im_start|>user\nHi")
    first.append(-1)  # the caller's list is its own
    assert fmt.encode("<|im_start|>user\nHi") == _own_encode(tokenizer, "<|im_start|>user\nHi")
    for ids in _random_replies(tokenizer, stops):
        assert fmt.generated_text(ids) == tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        reply = ids[:-1] if ids and ids[-1] in stops else ids
        assert fmt.decode_reply(ids) == tokenizer.decode(reply, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if ids and ids[-1] in stops:
            stop_text = tokenizer.decode([ids[-1]], skip_special_tokens=False)
            want = fmt.assistant_suffix[len(stop_text):] if fmt.assistant_suffix.startswith(stop_text) else fmt.assistant_suffix
            assert fmt.closing(ids) == want


def test_a_truncation_set_on_the_tokenizer_is_turned_off_as_its_own_call_does(tokenizer, model_dir):
    tok = copy.deepcopy(tokenizer)
    fmt = ChatFormat(tok, frozenset(stop_token_ids(tok, model_dir)))
    want = _own_encode(tok, "one two three four five six seven")
    tok.backend_tokenizer.enable_truncation(max_length=3)
    assert fmt.encode("one two three four five six seven") == want and len(want) > 3
    assert tok.backend_tokenizer.truncation is None


def test_a_tokenizer_class_with_its_own_text_handling_is_called_as_it_is(tokenizer, model_dir):
    stops = frozenset(stop_token_ids(tokenizer, model_dir))

    class ShoutingDecoder(type(tokenizer)):
        def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kwargs):
            return super()._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces, **kwargs).upper()

    class CountingCaller(type(tokenizer)):
        calls = 0

        def __call__(self, *args, **kwargs):
            CountingCaller.calls += 1
            return super().__call__(*args, **kwargs)

    for cls in (ShoutingDecoder, CountingCaller):
        tok = copy.copy(tokenizer)
        tok.__class__ = cls
        assert rust_tokenizer(tok) is None
    tok = copy.copy(tokenizer)
    tok.__class__ = ShoutingDecoder
    ids = tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    assert ChatFormat(tok, stops).generated_text(ids) == "HELLO THERE"
    tok.__class__ = CountingCaller
    assert ChatFormat(tok, stops).encode("Hello there") == ids and CountingCaller.calls == 1


def test_vllms_pooled_tokenizer_takes_the_direct_route(tokenizer, model_dir):
    """vLLM hands out its tokenizer wrapped in a pool of copies of itself (its class overrides the calls to borrow one)."""
    hf = pytest.importorskip("vllm.tokenizers.hf")
    pooled = hf.maybe_make_thread_pool(hf.get_cached_tokenizer(copy.copy(tokenizer)), 2)
    assert type(pooled).__name__.startswith("TokenizerPool")
    stops = frozenset(stop_token_ids(tokenizer, model_dir))
    fmt = ChatFormat(pooled, stops)
    assert fmt._rust is pooled.backend_tokenizer
    for text in TEXTS:
        assert fmt.encode(text) == _own_encode(pooled, text)
    for ids in _random_replies(tokenizer, stops, 50):
        assert fmt.generated_text(ids) == pooled.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
