"""The opt-in record of which prompt positions a compressed prefill kept."""

from __future__ import annotations

import threading

import torch

from snapkv_rag.compression import SnapKV, StreamingLLM, recording_kept_indices

PROMPT = " ".join(f"fact {i}: the code is {1000 + i}." for i in range(12)) + "\n\nWhat is the code of fact 7?"


def test_records_what_snapkv_kept(engine):
    policy = SnapKV(window_size=8, max_capacity_prompt=48, kernel_size=3)
    with recording_kept_indices() as kept:
        stream = engine.stream(PROMPT, compression=policy, max_new_tokens=3)
    for _ in stream:
        pass
    result = stream.result
    (record,) = kept
    n = result.usage.prompt_tokens
    assert record.prompt_length == n > 48
    assert sorted(record.layers) == list(range(engine.info().num_layers))
    for layer, indices in record.layers.items():
        assert indices.shape == (1, engine.info().num_kv_heads, 48)
        assert result.stats.kept_tokens_per_layer[layer] == 48
        assert int(indices.min()) >= 0 and int(indices.max()) < n
    share = record.share()
    assert share.shape == (n,)
    assert abs(float(share.sum()) - 48) < 1e-9  # entries kept per layer and head
    assert torch.all(share[-8:] == 1.0)  # the observation window is always kept
    assert float(share.min()) >= 0.0 and float(share.max()) <= 1.0


def test_nothing_recorded_for_full_cache_or_outside_the_block(engine):
    with recording_kept_indices() as kept:
        engine.generate(PROMPT, max_new_tokens=2)
    assert kept == []
    with recording_kept_indices() as kept:
        pass
    engine.generate(PROMPT, compression=StreamingLLM(sink_tokens=2, max_capacity_prompt=32), max_new_tokens=2)
    assert kept == []


def test_budget_above_the_prompt_keeps_every_position(engine):
    with recording_kept_indices() as kept:
        engine.generate("short question?", compression=SnapKV(window_size=4, max_capacity_prompt=512), max_new_tokens=2)
    (record,) = kept
    assert torch.all(record.share() == 1.0)


def test_other_threads_do_not_record_into_this_block(engine):
    policy = StreamingLLM(sink_tokens=2, max_capacity_prompt=32)
    other: list = []

    def elsewhere():
        engine.generate(PROMPT, compression=policy, max_new_tokens=2)
        other.append(True)

    with recording_kept_indices() as kept:
        worker = threading.Thread(target=elsewhere)
        worker.start()
        worker.join()
        engine.generate(PROMPT, compression=policy, max_new_tokens=2)
    assert other == [True]
    assert len(kept) == 1
    share = kept[0].share()
    assert torch.all(share[:2] == 1.0) and torch.all(share[-30:] == 1.0)
    assert float(share.sum()) == 32


def test_kept_per_stuffed_document(engine):
    from snapkv_rag.engine.prompts import render_prompt
    from snapkv_rag.rag.kept import document_spans, kept_per_document
    from snapkv_rag.rag.store import StoredChunk
    from snapkv_rag.rag.stuffing import StuffedContext, build_messages, format_document

    chunks = [
        StoredChunk(id=str(i), text=f"Fact {i}: the code is {1000 + 7 * i}. " * 3, source=f"f{i}.md", title=f"Doc {i}", position=0, tokens=9) for i in range(4)
    ]
    messages, question_text = build_messages("What is the code of fact 2?", chunks)
    context = StuffedContext("What is the code of fact 2?", question_text, chunks, messages, 400, 0, 0, 4, 0, 0, "retrieval")
    ids = render_prompt(engine.tokenizer, messages)
    spans = document_spans(engine.tokenizer, context)
    assert [engine.tokenizer.decode(ids[s:e]).strip() for s, e in spans] == [format_document(i + 1, c) for i, c in enumerate(chunks)]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))

    full = kept_per_document(engine.tokenizer, context, None)
    assert [(d.number, d.tokens, d.kept) for d in full] == [(i + 1, e - s, float(e - s)) for i, (s, e) in enumerate(spans)]
    with recording_kept_indices() as kept:
        engine.generate(messages, compression=SnapKV(window_size=8, max_capacity_prompt=64, kernel_size=3), max_new_tokens=2)
    docs = kept_per_document(engine.tokenizer, context, kept[-1])
    share = kept[-1].share()
    assert [round(d.kept, 9) for d in docs] == [round(float(share[s:e].sum()), 9) for s, e in spans]
    assert all(0 <= d.share <= 1 for d in docs) and sum(d.kept for d in docs) < 64
