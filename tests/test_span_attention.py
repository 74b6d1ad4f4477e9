"""Attention over prompt spans recorded during decoding (``attend_to``), and the attention citation route."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_engine

from snapkv_rag.compression.span_attention import sentence_attention, sentence_shares
from snapkv_rag.errors import InvalidGenerationParameterError

DOCS = ["The quick brown fox jumps over the lazy dog.", "Numbers like 1234 and 5678 appear in passkeys."]
PROMPT = "Documents:\n" + "\n".join(DOCS) + "\nLong documents need compressed caches. What is the number?"


def test_sentence_shares_average_the_rows_that_predicted_each_sentence():
    rows = [[0.2, 0.2], [0.6, 0.2], [0.1, 0.3]]  # forwards that read tokens 0, 1, 2 (predicting 1, 2, 3)
    ends = [3, 7, 10, 14]  # tokens 0-1 are sentence A (0..7), tokens 2-3 sentence B (8..14)
    shares = sentence_shares(rows, ends, [(0, 7), (8, 14)])
    assert shares[0] == pytest.approx([0.5, 0.5])  # token 1 only (token 0 has no row): [0.2, 0.2]
    assert shares[1] == pytest.approx([0.7 / 1.2, 0.5 / 1.2])  # tokens 2, 3: mean [0.35, 0.25]
    assert sentence_shares(rows, ends, [(20, 30)]) == [[0.0, 0.0]]


def test_sentence_attention_finds_sentences_in_the_decoded_tokens(tokenizer):
    ids = tokenizer("Paris is big. Rome is old.")["input_ids"]
    rows = [[float(i), 1.0] for i in range(len(ids) - 1)]
    shares = sentence_attention(tokenizer, ids, rows, ["Paris is big.", "Rome is old.", "absent."])
    assert len(shares) == 3 and shares[2] == [0.0, 0.0]
    assert shares[1][0] > shares[0][0]  # later rows weigh the first span more


def reference_shares(engine, ids, generated, spans):
    """Every layer's eager attention weights over the whole sequence: per forward that read a
    generated token, the share of each span, mean over heads then layers."""
    from transformers import AutoModelForCausalLM

    eager = AutoModelForCausalLM.from_config(engine.model.config, attn_implementation="eager").eval()
    eager.load_state_dict(engine.model.state_dict())
    sequence = torch.tensor([ids + generated])
    with torch.inference_mode():
        attentions = eager(input_ids=sequence, output_attentions=True).attentions
    rows = []
    for j in range(len(generated) - 1):
        position = len(ids) + j
        per_layer = [layer[0, :, position].mean(dim=0) for layer in attentions]  # [T] mean over heads
        rows.append([float(sum(w[a:b].sum() for w in per_layer) / len(per_layer)) for a, b in spans])
    return rows


def test_recorded_shares_equal_the_eager_attention_weights(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    result = engine.generate(PROMPT, max_new_tokens=6, ignore_eos=True, attend_to=DOCS, chat=False)
    assert result.stats.span_attention == "recorded (2 spans)"
    ids = engine.tokenizer(PROMPT)["input_ids"]
    from snapkv_rag.engine.prompts import text_token_spans

    spans = text_token_spans(engine.tokenizer, PROMPT, DOCS, len(ids), chat=False)
    assert all(b > a for a, b in spans)
    assert len(result.span_attention) == len(result.token_ids) - 1
    expected = reference_shares(engine, ids, result.token_ids, spans)
    assert torch.allclose(torch.tensor(result.span_attention), torch.tensor(expected), atol=1e-4)
    assert not torch.allclose(torch.tensor(result.span_attention).flip(1), torch.tensor(expected), atol=1e-4)


def test_under_compression_an_evicted_span_gets_no_attention(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    # StreamingLLM keeps the first 4 tokens and the last ones: the first document lies between
    result = engine.generate(PROMPT, max_new_tokens=5, ignore_eos=True, attend_to=DOCS, chat=False, compression="streamingllm:budget=20,sinks=4")
    rows = torch.tensor(result.span_attention)
    assert rows.shape == (4, 2)
    assert torch.all(rows[:, 0] == 0)
    full = engine.generate(PROMPT, max_new_tokens=5, ignore_eos=True, attend_to=DOCS, chat=False)
    assert torch.all(torch.tensor(full.span_attention)[:, 0] > 0)


def test_pyramid_and_snapkv_runs_record(tokenizer):
    engine = tiny_engine("qwen3", tokenizer)
    for policy in ("snapkv:budget=24,window=8", "snapkv:budget=24,window=8,layers=pyramid"):
        result = engine.generate(PROMPT, max_new_tokens=4, ignore_eos=True, attend_to=DOCS, chat=False, compression=policy)
        assert result.stats.span_attention == "recorded (2 spans)"
        assert all(0.0 <= x <= 1.0 for row in result.span_attention for x in row)


def test_what_is_not_recorded_says_why(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    missing = engine.generate(PROMPT, max_new_tokens=3, attend_to=["nowhere in the prompt"], chat=False)
    assert missing.span_attention is None and "none of the attend_to texts" in missing.stats.span_attention
    cut = engine.generate(PROMPT, max_new_tokens=3, attend_to=DOCS, chat=False, compression="snapkv:budget=24,window=8,decode_budget=20")
    assert cut.span_attention is None and "decode-time" in cut.stats.span_attention
    plain = engine.generate(PROMPT, max_new_tokens=3, chat=False)
    assert plain.span_attention is None and plain.stats.span_attention is None


@pytest.mark.parametrize("bad", ["one string", [], [""], [1, 2]])
def test_bad_attend_to_is_one_clear_error(tokenizer, bad):
    engine = tiny_engine("llama", tokenizer)
    with pytest.raises(InvalidGenerationParameterError, match="attend_to"):
        engine.generate(PROMPT, max_new_tokens=2, attend_to=bad, chat=False)
    with pytest.raises(InvalidGenerationParameterError, match="attend_to"):
        engine.generate_batch([PROMPT, PROMPT], max_new_tokens=2, attend_to=DOCS, chat=False)
