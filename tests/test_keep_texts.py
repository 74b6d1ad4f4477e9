"""keep_texts (issue 30): prompt texts, such as document labels, that every compressed layer and head keeps."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_engine

from snapkv_rag.compression import recording_kept_indices
from snapkv_rag.compression.base import keep_adaptive, keep_recent_and_top
from snapkv_rag.engine.prompts import text_token_spans
from snapkv_rag.errors import InvalidGenerationParameterError

FILLER = "The quick brown fox jumps over the lazy dog. "
TEXT = "Ledger"  # in the middle of the prompt, where neither sinks nor recent windows reach
LONG = FILLER * 3 + TEXT + ". " + FILLER * 3 + "What is the number?"
POLICIES = [
    "snapkv:budget=24,window=8,kernel=3",
    "snapkv:budget=24,window=8,kernel=3,chunk=4",
    "snapkv:budget=24,window=8,kernel=3,heads=adaptive",
    "snapkv:budget=24,window=8,kernel=3,layers=pyramid,beta=2",  # the top layer keeps 8 voted entries: room for the text
    "h2o:budget=24",
    "streamingllm:budget=24,sinks=8",  # only the sink slots are chosen by score: room for the text
    "random:budget=24,recent=8",
]


def test_protected_positions_rank_above_every_score_and_the_earliest_win_when_they_do_not_fit():
    scores = torch.arange(20, dtype=torch.float32).expand(1, 2, 20)  # later positions vote higher
    protected = torch.zeros(1, 24, dtype=torch.bool)
    protected[0, [0, 1, 2]] = True
    kept = keep_recent_and_top(scores, 24, 8, None, protected)  # 4 recent + 4 voted
    assert kept[0, 0].tolist() == [0, 1, 2, 19, 20, 21, 22, 23]
    protected[0, :10] = True
    assert keep_recent_and_top(scores, 24, 8, None, protected)[0, 1].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    adaptive = keep_adaptive(scores, 24, 8, 0.0, protected)
    assert [h[:2].tolist() for h in adaptive] == [[0, 1], [0, 1]]  # both heads keep the earliest protected ones


def kept_positions(kept, layer, head):
    indices = kept.layers[layer]
    return set((indices[head] if isinstance(indices, tuple) else indices[0, head]).tolist())


@pytest.mark.parametrize("policy", POLICIES)
def test_every_layer_and_head_keeps_the_texts(policy, tokenizer):
    engine = tiny_engine("llama", tokenizer)
    row = engine.tokenizer(LONG)["input_ids"]
    start, end = text_token_spans(engine.tokenizer, LONG, [TEXT], len(row), chat=False)[0]
    wanted = set(range(start, end))
    assert wanted
    with recording_kept_indices() as plain:
        engine.generate(LONG, max_new_tokens=2, compression=policy, chat=False)
    with recording_kept_indices() as kept:
        result = engine.generate(LONG, max_new_tokens=2, compression=policy, chat=False, keep_texts=[TEXT])
    pairs = [(layer, head) for layer in kept[-1].layers for head in range(2)]
    assert all(wanted <= kept_positions(kept[-1], layer, head) for layer, head in pairs)
    # without keep_texts some layer or head drops them, so the check above can fail
    assert not all(wanted <= kept_positions(plain[-1], layer, head) for layer, head in pairs)
    assert result.stats.kept_tokens_per_layer == engine.generate(LONG, max_new_tokens=2, compression=policy, chat=False).stats.kept_tokens_per_layer


def test_the_prefix_cache_and_a_second_call_keep_them_too(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    first = engine.generate(LONG, max_new_tokens=4, compression=POLICIES[0], chat=False, keep_texts=[TEXT])
    engine.generate(LONG, max_new_tokens=4, compression=POLICIES[0], chat=False, keep_texts=[TEXT])  # a repeat is stored ...
    with recording_kept_indices() as kept:  # ... and reused from the third read
        again = engine.generate(LONG, max_new_tokens=4, compression=POLICIES[0], chat=False, keep_texts=[TEXT])
    assert again.stats.reused_prompt_tokens > 0
    assert again.token_ids == first.token_ids
    row = engine.tokenizer(LONG)["input_ids"]
    start, end = text_token_spans(engine.tokenizer, LONG, [TEXT], len(row), chat=False)[0]
    assert set(range(start, end)) <= kept_positions(kept[-1], 1, 0)


def test_bad_keep_texts_are_one_clear_error(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    for bad in ("quick", [], [""], ["not in the prompt at all"]):
        with pytest.raises(InvalidGenerationParameterError, match="keep_texts"):
            engine.generate(LONG, max_new_tokens=2, compression=POLICIES[0], chat=False, keep_texts=bad)
    with pytest.raises(InvalidGenerationParameterError, match="one prompt"):
        engine.generate_batch([LONG, LONG], max_new_tokens=2, compression=POLICIES[0], chat=False, keep_texts=[TEXT])
    # the full cache keeps everything anyway
    full = engine.generate(LONG, max_new_tokens=2, chat=False, keep_texts=[TEXT])
    assert full.stats.compression is None and full.stats.protected_prompt_tokens == 0
    kept = engine.generate(LONG, max_new_tokens=2, compression=POLICIES[0], chat=False, keep_texts=[TEXT])
    assert kept.stats.protected_prompt_tokens == len(engine.tokenizer(TEXT, add_special_tokens=False)["input_ids"])


def test_document_qa_keeps_the_document_labels_when_asked(tokenizer, tmp_path):
    from snapkv_rag.rag import DocumentQA, DocumentStore
    from snapkv_rag.rag.embeddings import Embedder

    folder = tmp_path / "docs"
    folder.mkdir()
    for i, topic in enumerate(("harbour ferry", "glass museum", "river bridge")):
        (folder / f"doc{i}.md").write_text(f"# {topic.title()}\n\n" + f"The {topic} opens at {i + 7} o'clock. " * 8)
    store = DocumentStore("labels", path=tmp_path / "chroma", embedder=Embedder())
    store.ingest([folder], chunk_tokens=64, overlap=8)
    engine = tiny_engine("llama", tokenizer, context=2048)
    policy = "snapkv:budget=24,window=8,kernel=3"
    qa = DocumentQA(engine, store, compression=policy, context_tokens=300, max_new_tokens=4, keep_labels=True)
    context = qa.retrieve("When does the ferry open?")
    labels = context.labels()
    assert labels and all(label.startswith(f"[{i}]") for i, label in enumerate(labels, start=1))
    assert all(label in context.messages[-1]["content"] for label in labels)
    assert qa.generation_kwargs(context, compression=policy)["keep_texts"] == labels
    assert "keep_texts" not in DocumentQA(engine, store, compression=policy, context_tokens=300).generation_kwargs(context, compression=policy)
    assert "keep_texts" not in qa.generation_kwargs(context, compression=None)  # the full cache keeps everything
    with recording_kept_indices() as kept:
        answer = qa.answer_context(context)
    assert answer.result.stats.compression["method"] == "snapkv"
    assert kept and all(len(indices[0, 0]) == 24 for indices in kept[-1].layers.values())
