"""Incremental detokenization: held-back UTF-8 fragments and stop-string prefixes."""

from __future__ import annotations

from snapkv_rag.engine.detokenize import SequenceText


def feed(tokenizer, text, stop=(), eos=frozenset()):
    seq = SequenceText(tokenizer, tuple(stop), eos)
    pieces = [seq.add(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    return seq, pieces


def test_multibyte_character_is_never_split(tokenizer):
    ids = tokenizer("é", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 2, "byte-level tokenizer splits é into bytes"
    seq, pieces = feed(tokenizer, "café ok")
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + seq.finish_for_length() == "café ok" == seq.text


def test_stop_prefix_is_held_back_then_released(tokenizer):
    seq, pieces = feed(tokenizer, "hello wor", stop=["world"])
    assert "".join(pieces) == "hello " and not seq.finished
    assert seq.finish_for_length() == "wor" and seq.text == "hello wor" and seq.finish_reason == "length"


def test_stop_string_cuts_and_finishes(tokenizer):
    seq, pieces = feed(tokenizer, "hello world again", stop=["world"])
    assert "".join(pieces) == "hello " == seq.text and seq.finish_reason == "stop"


def test_eos_token_finishes_without_text(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|end|>")
    seq = SequenceText(tokenizer, (), frozenset({eos}))
    seq.add(tokenizer("hi", add_special_tokens=False)["input_ids"][0])
    seq.add(eos)
    assert seq.finish_reason == "stop" and seq.generated == 2 and eos not in seq.token_ids
    assert seq.add(5) == "" and seq.generated == 2
