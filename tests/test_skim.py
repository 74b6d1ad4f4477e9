"""Skim, then read (issue 66): the window's votes a compressed prefill records, their mapping to
prompt positions in a rolled read, the per-document scores and rankings, and DocumentQA's skim route."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_engine

from snapkv_rag.compression import SnapKV
from snapkv_rag.compression.runtime import WindowVotes, recording_window_votes
from snapkv_rag.rag import DocumentQA, DocumentStore, Embedder
from snapkv_rag.rag.kept import document_spans
from snapkv_rag.rag.skim import SkimResult, document_scores, middle_layers, skim
from snapkv_rag.rag.store import StoredChunk
from snapkv_rag.rag.stuffing import StuffedContext, build_messages

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec romeo sierra tango".split()
TEXT = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(90))
WINDOW = 8


def votes_of(engine, prompt: str, policy: str) -> WindowVotes:
    with recording_window_votes() as recorded:
        engine.generate(prompt, max_new_tokens=1, compression=policy, chat=False, prefix_cache=False)
    assert len(recorded) == 1
    return recorded[0]


def test_a_whole_prefill_records_the_window_mass_of_every_compressed_layer(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    n = len(engine.tokenizer(TEXT)["input_ids"])
    votes = votes_of(engine, TEXT, f"snapkv:budget=24,window={WINDOW},kernel=3")
    heads = engine.model.config.num_attention_heads
    assert votes.prompt_length == n
    assert sorted(votes.layers) == list(range(engine.model.config.num_hidden_layers))
    for mass in votes.layers.values():
        assert mass.shape == (heads, n)
        # each window query's softmax sums to one over the keys: the window's whole mass, nothing lost or doubled
        torch.testing.assert_close(mass.sum(dim=1), torch.full((heads,), float(WINDOW)), rtol=1e-4, atol=1e-4)
    with recording_window_votes() as recorded:
        engine.generate(TEXT, max_new_tokens=1, chat=False)  # the full cache selects nothing, so votes nothing
    assert recorded == []


def test_nothing_is_recorded_unless_asked(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    seen = []
    original = WindowVotes.__init__

    def spy(self, *args, **kwargs):
        seen.append(1)
        original(self, *args, **kwargs)

    WindowVotes.__init__ = spy
    try:
        engine.generate(TEXT, max_new_tokens=1, compression=f"snapkv:budget=24,window={WINDOW},kernel=3", chat=False)
        engine.generate(TEXT, max_new_tokens=1, compression=f"snapkv:budget=24,window={WINDOW},kernel=3,rolling=32", chat=False)
    finally:
        WindowVotes.__init__ = original
    assert seen == []


def test_a_rolled_read_scores_each_position_in_the_forward_that_read_it(tokenizer):
    """With a budget that evicts nothing, the second rolled chunk's forward sees the first chunk,
    itself and the window: the same keys as a whole prefill of those tokens. Its votes must land
    on the second chunk's own prompt positions."""
    engine = tiny_engine("llama", tokenizer)
    ids = engine.tokenizer(TEXT)["input_ids"]

    def shorter_text(chunk: int) -> str | None:
        """The first two chunks with the window (the prompt's last tokens) right after them, as a
        text that tokenizes back to exactly those ids (None where a chunk ends inside a word)."""
        text = engine.tokenizer.decode(ids[: 2 * chunk]) + engine.tokenizer.decode(ids[-WINDOW:])
        return text if engine.tokenizer(text)["input_ids"] == ids[: 2 * chunk] + ids[-WINDOW:] else None

    chunk = next(c for c in range(32, 60) if shorter_text(c) is not None)
    shorter = shorter_text(chunk)
    rolled = votes_of(engine, TEXT, f"snapkv:budget=512,window={WINDOW},kernel=1,rolling={chunk}")
    whole = votes_of(engine, shorter, f"snapkv:budget=512,window={WINDOW},kernel=1")
    assert rolled.prompt_length == len(ids)
    for layer, mass in rolled.layers.items():
        torch.testing.assert_close(mass[:, chunk : 2 * chunk], whole.layers[layer][:, chunk : 2 * chunk], rtol=1e-3, atol=1e-5)
        assert bool((mass[:, : len(ids) - WINDOW] > 0).all())  # every body position scored


def chunk(i: int, text: str = "text") -> StoredChunk:
    return StoredChunk(id=f"c{i}", text=f"{text} {i}", source=f"doc{i}.md", title=f"Doc {i}", position=0, tokens=0)


def test_document_scores_sum_the_middle_layers_over_each_document(tokenizer):
    engine = tiny_engine("llama", tokenizer)
    chunks = [chunk(i) for i in range(3)]
    messages, question_text = build_messages("Which one?", chunks)
    context = StuffedContext("Which one?", question_text, chunks, messages, 100, 30, 60, 3, 0, 0, "retrieval")
    spans = document_spans(engine.tokenizer, context)
    n = spans[-1][1] + 10
    layers = {}
    for layer in range(8):
        mass = torch.zeros(2, n)
        a, b = spans[layer % 3]
        mass[0, a:b] = float(layer + 1)  # head 0 of layer l attends to document l % 3 only, more in higher layers
        layers[layer] = mass  # head 1 attends to no document (the prompt's first token, the question)
    assert middle_layers(list(range(8))) == [2, 3, 4, 5]
    scores = document_scores(engine.tokenizer, context, WindowVotes(n, layers))
    # the band's 8 heads: document 2 takes all of layers 2 and 5's head 0, documents 0 and 1 one each;
    # a head's share counts, not how much it attends, and a head on no document adds nothing
    assert scores == pytest.approx([1 / 8, 1 / 8, 2 / 8])
    ranked = SkimResult(context, scores, 0.0, 60).ranking("attention")
    assert [c.id for c in ranked] == ["c2", "c0", "c1"]
    assert document_scores(engine.tokenizer, context, WindowVotes(n, layers), heads=[(7, 0)]) == pytest.approx([0.0, 1.0, 0.0])
    with pytest.raises(ValueError, match="heads name layers"):
        document_scores(engine.tokenizer, context, WindowVotes(n, layers), heads=[(9, 0)])
    with pytest.raises(ValueError, match="layer band"):
        middle_layers([0, 1], (0.8, 0.2))
    with pytest.raises(ValueError, match="fusion"):
        SkimResult(context, scores, 0.0, 60).ranking("votes")


def test_rrf_keeps_a_document_both_rankings_like_above_one_only_the_skim_likes():
    chunks = [chunk(i) for i in range(4)]
    context = StuffedContext("q", "Question: q", chunks, [], 100, 40, 60, 4, 0, 0, "retrieval")
    # retrieval order c0 c1 c2 c3; the skim ranks c3 first, c1 second, c2 third: c1 is second in both
    result = SkimResult(context, [0.2, 0.5, 0.3, 0.9], 0.0, 60)
    assert [c.id for c in result.ranking("attention")] == ["c3", "c1", "c2", "c0"]
    assert [c.id for c in result.ranking("rrf")] == ["c1", "c0", "c3", "c2"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("skim") / "docs"
    folder.mkdir()
    for i, topic in enumerate(("ferry", "library", "museum", "tram", "garden", "bakery")):
        body = " ".join(f"The {topic} record {k} says the code is {topic[:3].upper()}-{i}{k}." for k in range(14))
        (folder / f"{topic}.md").write_text(f"# The {topic}\n\n{body}\n")
    store = DocumentStore("skim-docs", path=folder.parent / "chroma", embedder=Embedder())
    store.ingest([folder], chunk_tokens=48, overlap=8)
    return store


def test_document_qa_answers_from_the_skims_best_documents(tokenizer, store):
    engine = tiny_engine("llama", tokenizer, context=4096)
    policy = SnapKV(window_size="question", max_capacity_prompt=128)
    qa = DocumentQA(engine, store, compression=None, context_tokens=200, max_new_tokens=4, skim_tokens=900, skim_compression=policy)
    question = "What is the code of the museum record 3?"
    wide = qa.skim_retriever.retrieve(question)
    skimmed = skim(engine, wide, policy)
    assert len(skimmed.scores) == len(wide.chunks) > 6
    context = qa.retrieve(question)
    best = [c.id for c in skimmed.ranking()]
    assert [c.id for c in context.chunks] == best[: len(context.chunks)]  # the skim's order, cut to the read's budget
    assert context.document_tokens <= 200 < wide.document_tokens
    assert context.settings["skim"]["skimmed_documents"] == len(wide.chunks)
    answer = qa.ask(question)
    assert answer.context.settings["skim"]["fusion"] == "attention"


def test_the_early_exit_scores_as_the_whole_forward_does_and_runs_fewer_layers(tokenizer, store, monkeypatch):
    from snapkv_rag.compression import recording_window_votes
    from snapkv_rag.compression.runtime import exiting_after_layer

    engine = tiny_engine("llama", tokenizer, context=4096)
    policy = SnapKV(window_size="question", max_capacity_prompt=128)
    qa = DocumentQA(engine, store, compression=None, context_tokens=200, skim_tokens=900)
    wide = qa.skim_retriever.retrieve("What is the code of the museum record 3?")
    heads = [(0, 0), (0, 3)]  # layer 0 of 2: the exit skips layer 1
    reads = []
    read_prompt = engine.read_prompt
    monkeypatch.setattr(engine, "read_prompt", lambda *a, **k: reads.append(read_prompt(*a, **k)) or reads[-1])
    whole = skim(engine, wide, policy, heads=heads, early_exit=False)
    early = skim(engine, wide, policy, heads=heads)
    assert early.scores == whole.scores and [c.id for c in early.ranking()] == [c.id for c in whole.ranking()]
    assert [r.layers_run for r in reads] == [2, 1]
    with pytest.raises(ValueError, match="exit_after_layer"):
        engine.read_prompt("hello", exit_after_layer=2)
    chunked = tiny_engine("llama", tokenizer, context=4096)
    chunked.invariant, chunked.invariant_chunk_tokens = True, 64  # a prefill in several forwards
    policy_whole = SnapKV(window_size="question", max_capacity_prompt=128)
    with recording_window_votes() as exact:
        chunked.read_prompt(wide.messages, compression=policy_whole, question=wide.question_text)
    with recording_window_votes() as exited:
        read = chunked.read_prompt(wide.messages, compression=policy_whole, question=wide.question_text, exit_after_layer=0)
    assert read.layers_run == 1 and torch.equal(exited[-1].layers[0], exact[-1].layers[0])
    with exiting_after_layer(0), pytest.raises(RuntimeError, match="read_prompt"):
        engine.generate("hello", max_new_tokens=2)
    assert engine.generate("hello", max_new_tokens=2).usage.completion_tokens >= 1  # the engine is fine afterwards


def test_the_skim_from_stored_keys_scores_each_group_as_its_own_read(tokenizer, store, tmp_path):
    """With every token recomputed, each group's votes are a full read of that group's prompt (the
    reference, read here through generate); with none, the chunks' K/V come from the store: computed
    once, then reused, only under the same salt, and the early exit changes nothing."""
    import dataclasses

    from snapkv_rag.compression import recording_window_votes
    from snapkv_rag.rag.kept import document_spans
    from snapkv_rag.rag.skim import combined_scores, skim_groups, skim_stored
    from snapkv_rag.rag.stuffing import build_messages
    from snapkv_rag.reuse.segment_store import SegmentKVStore

    engine = tiny_engine("llama", tokenizer, context=4096)
    policy = SnapKV(window_size="question", max_capacity_prompt=128)
    qa = DocumentQA(engine, store, compression=None, context_tokens=200, skim_tokens=900)
    wide = qa.skim_retriever.retrieve("What is the code of the museum record 3?")
    heads = [(0, 1), (1, 2), (1, 3)]
    groups = skim_groups(engine, wide.chunks, group_tokens=300)
    assert len(groups) > 1 and sorted(i for g in groups for i in g) == list(range(len(wide.chunks)))
    masses = [[0.0] * len(wide.chunks) for _ in heads]
    for group in groups:
        chunks = [wide.chunks[i] for i in group]
        messages, question_text = build_messages(wide.question, chunks)
        part = StuffedContext(wide.question, question_text, chunks, messages, 0, 0, 0, len(chunks), 0, 0, "group")
        with recording_window_votes() as recorded:
            engine.generate(messages, compression=policy, question=question_text, max_new_tokens=1, prefix_cache=False)
        for h, (layer, head) in enumerate(heads):
            for i, (a, b) in zip(group, document_spans(engine.tokenizer, part), strict=True):
                masses[h][i] = float(recorded[-1].layers[layer][head, a:b].sum())
    kv = SegmentKVStore(tmp_path / "kv")
    exact = skim_stored(engine, wide, policy, kv, heads=heads, group_tokens=300, recompute=1.0)
    assert exact.scores == pytest.approx(combined_scores(masses), rel=1e-4)

    stored = SegmentKVStore(tmp_path / "stored")
    first = skim_stored(engine, wide, policy, stored, heads=heads, group_tokens=300, cache_salt="tenant-a")
    again = skim_stored(engine, wide, policy, stored, heads=heads, group_tokens=300, cache_salt="tenant-a")
    other = skim_stored(engine, wide, policy, stored, heads=heads, group_tokens=300, cache_salt="tenant-b")
    whole = skim_stored(engine, wide, policy, stored, heads=heads, group_tokens=300, cache_salt="tenant-a", early_exit=False)
    assert first.stored_misses == other.stored_misses == len(wide.chunks) and again.stored_misses == whole.stored_misses == 0
    assert again.reused_tokens == first.reused_tokens > 30 * len(wide.chunks)  # the chunks (about 48 tokens each) placed, not computed
    assert again.scores == pytest.approx(first.scores, rel=1e-5) and whole.scores == pytest.approx(again.scores, rel=1e-5)
    rolled = skim_stored(engine, wide, policy.with_rolling(256), stored, heads=heads, group_tokens=300, cache_salt="tenant-a")
    assert rolled.scores == pytest.approx(again.scores, rel=1e-5)  # a group is read in one window: rolling= is dropped

    calibrated = skim_stored(engine, wide, policy, stored, heads=heads, group_tokens=300, calibrate=True)
    content_free = skim_stored(engine, dataclasses.replace(wide, question="N/A"), policy, stored, heads=heads, group_tokens=300)
    plain = skim_stored(engine, wide, policy, stored, heads=heads, group_tokens=300)
    assert calibrated.scores == pytest.approx([p - c for p, c in zip(plain.scores, content_free.scores, strict=True)], abs=1e-6)


def test_document_qa_skims_from_stored_keys(tokenizer, store):
    engine = tiny_engine("llama", tokenizer, context=4096)
    policy = SnapKV(window_size="question", max_capacity_prompt=128)
    qa = DocumentQA(engine, store, compression=None, context_tokens=200, skim_tokens=900, skim_compression=policy, skim_stored=True, kv_reuse="off")
    context = qa.retrieve("What is the code of the museum record 3?")
    skim = context.settings["skim"]
    assert skim["from"] == "stored keys" and skim["reused_tokens"] > 0 and context.document_tokens <= 200
    assert qa.retrieve("What is the code of the museum record 3?").settings["skim"]["chunks_computed"] == 0
    with pytest.raises(ValueError, match="skim_stored"):
        DocumentQA(engine, store, skim_tokens=900, skim_stored="yes")


def test_bad_skim_settings_are_one_clear_error(tokenizer, store):
    engine = tiny_engine("llama", tokenizer, context=4096)
    for bad in (0, -5, True, "900"):
        with pytest.raises(ValueError, match="skim_tokens"):
            DocumentQA(engine, store, compression=None, skim_tokens=bad)
    with pytest.raises(ValueError, match="skim_fusion"):
        DocumentQA(engine, store, compression=None, skim_tokens=900, skim_fusion="best")
    with pytest.raises(ValueError, match="whole_collection"):
        DocumentQA(engine, store, compression=None, skim_tokens=900, whole_collection=True)
    qa = DocumentQA(engine, store, compression=None, context_tokens=200, skim_tokens=900, skim_compression=None)
    with pytest.raises(ValueError, match="observation window"):
        qa.retrieve("What is the code of the museum record 3?")


def test_calibration_chooses_heads_that_ship_for_those_weights_only(tokenizer, tmp_path, monkeypatch, store):
    from snapkv_rag.harness.skim_head_reads import calibration_reads
    from snapkv_rag.rag import skim_heads as module

    engine = tiny_engine("llama", tokenizer, context=2048)
    reads = calibration_reads(3, tokens=300, count_tokens=lambda text: len(engine.tokenizer(text)["input_ids"]))
    heads = module.choose_heads(engine, reads, SnapKV(window_size="question", max_capacity_prompt=128))
    layers, query_heads = engine.model.config.num_hidden_layers, engine.model.config.num_attention_heads
    assert 1 <= len(heads.heads) <= module.TOP_HEADS and len(set(heads.heads)) == len(heads.heads)
    assert all(0 <= layer < layers and 0 <= head < query_heads for layer, head in heads.heads)
    assert 0 < heads.mrr <= 1 and 0 < heads.band_mrr <= 1 and heads.reads == 3
    assert module.SkimHeads.from_json(heads.to_json()) == heads
    monkeypatch.setattr(module, "SHIPPED", tmp_path)
    assert module.shipped_heads(engine) is None
    (tmp_path / "tiny.json").write_text(heads.to_json())
    assert module.shipped_heads(engine) == heads
    other = tiny_engine("qwen2", tokenizer)
    assert module.shipped_heads(other) is None  # another model's weights: its heads are not these
    engine.model.snapkv_adapter = "/runs/some-adapter"  # an adapter merged: the base's heads serve it until its own are chosen
    assert module.model_key(engine) == f"{engine.name}+some-adapter" and module.shipped_heads(engine) == heads
    own = module.SkimHeads(**{**heads.__dict__, "model": module.model_key(engine), "heads": heads.heads[:1]})
    (tmp_path / "tuned.json").write_text(own.to_json())
    assert module.shipped_heads(engine) == own
    del engine.model.snapkv_adapter
    assert DocumentQA(engine, store, compression=None, context_tokens=200, skim_tokens=900).skim_heads == heads.heads
    assert DocumentQA(engine, store, compression=None, context_tokens=200, skim_tokens=900, skim_heads=None).skim_heads is None
