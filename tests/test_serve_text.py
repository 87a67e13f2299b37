"""StreamDecoder: incremental detokenization and stop strings, with the bundled model's real tokenizer."""

from __future__ import annotations

import pytest

from distill.serve.text import StreamDecoder, _partial_stop_len


def feed(dec: StreamDecoder, ids: list[int], chunk: int) -> tuple[str, bool]:
    out, stopped = [], False
    for i in range(0, len(ids), chunk):
        d = dec.add(ids[i : i + chunk])
        out.append(d.text)
        if d.stopped:
            stopped = True
            break
    out.append(dec.finish())
    return "".join(out), stopped


class SlowTokenizer:
    """The tokenizer without its ``tokenizers`` backend (as a slow tokenizer has none): the windowed decode path."""

    def __init__(self, fast):
        self.decode = fast.decode


@pytest.mark.parametrize("chunk,slow", [(1, False), (3, False), (1, True)])
def test_streamed_text_equals_decoding_everything_at_once_including_multibyte(tokenizer, chunk, slow):
    text = "Grüße aus Zürich: 你好, мир! 🙂 done."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    dec = StreamDecoder(SlowTokenizer(tokenizer) if slow else tokenizer)
    assert (dec._stream is None) == slow
    pieces = [dec.add(ids[i : i + chunk]).text for i in range(0, len(ids), chunk)] + [dec.finish()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # half characters are held back, never sent


def test_stop_string_spanning_tokens_is_cut_and_never_half_sent(tokenizer):
    text = "The answer is forty-two. Next question please."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    dec = StreamDecoder(tokenizer, stops=["forty-two"])
    sent = []
    for tok in ids:
        d = dec.add([tok])
        sent.append(d.text)
        assert "forty" not in "".join(sent)  # a prefix of the stop string is held back
        if d.stopped:
            break
    assert "".join(sent) == "The answer is "
    assert dec.stopped and dec.finish() == ""
    # the token count ends at the token that completed the stop string
    assert tokenizer.decode(ids[: d.n_tokens]).startswith("The answer is forty-two")
    assert "forty-two" not in tokenizer.decode(ids[: d.n_tokens - 1])


def test_held_back_stop_prefix_is_released_when_the_stop_string_does_not_follow(tokenizer):
    text = "forty-one and forty-three"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    got, stopped = feed(StreamDecoder(tokenizer, stops=["forty-two"]), ids, 1)
    assert got == text and not stopped


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer("alpha beta gamma delta", add_special_tokens=False)["input_ids"]
    got, stopped = feed(StreamDecoder(tokenizer, stops=["delta", " gamma"]), ids, 4)
    assert got == "alpha beta" and stopped


def test_special_tokens_are_not_part_of_the_text(tokenizer):
    ids = tokenizer("hi", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    got, _ = feed(StreamDecoder(tokenizer), ids, 1)
    assert got == "hi"


def test_include_stop_keeps_the_first_stop_string_in_the_text(tokenizer):
    """vLLM's include_stop_str_in_output: the text ends right after the stop string, not before it."""
    ids = tokenizer("alpha beta gamma delta", add_special_tokens=False)["input_ids"]
    got, stopped = feed(StreamDecoder(tokenizer, stops=["delta", " gamma"], include_stop=True), ids, 1)
    assert got == "alpha beta gamma" and stopped


def test_special_tokens_stay_in_the_text_when_not_skipped(tokenizer):
    ids = tokenizer("hi", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    got, _ = feed(StreamDecoder(tokenizer, skip_special_tokens=False), ids, 1)
    assert got == "hi" + tokenizer.eos_token


@pytest.mark.parametrize(("text", "stops", "n"), [("abc", ["cde"], 1), ("abcd", ["cde"], 2), ("abc", ["xyz"], 0), ("ab", ["abc", "b"], 2)])
def test_partial_stop_length_is_the_longest_suffix_that_starts_a_stop(text, stops, n):
    assert _partial_stop_len(text, stops) == n
