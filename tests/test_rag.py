"""The RAG core: loaders, chunking, the Chroma store, token-budget stuffing, citations, DocumentQA."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port, tiny_engine

from snapkv_rag.compression import SnapKV
from snapkv_rag.errors import EmptyPromptError
from snapkv_rag.rag import (
    ChunkingError,
    ContextBudgetError,
    DocumentQA,
    DocumentStore,
    Embedder,
    EmptyCollectionError,
    EvidenceAttributor,
    SourceText,
    StoreError,
    StuffingRetriever,
    chunk_document,
    load_file,
)
from snapkv_rag.rag.loaders import Skipped
from snapkv_rag.rag.ordering import StuffedOrders, orders_for, reuse_order
from snapkv_rag.rag.stuffing import format_document

TOPICS = ["ferry", "library", "museum", "tram", "garden", "bakery", "observatory", "harbour", "bridge", "school"]


def topic_text(topic: str, i: int, sentences: int = 12) -> str:
    body = " ".join(f"The {topic} of Marrowick fact {k}: its code is {topic[:3].upper()}-{i}{k} and it opened in {1900 + 7 * k + i}." for k in range(sentences))
    return f"# The {topic}\n\n{body}\n"


@pytest.fixture(scope="session")
def embedder():
    return Embedder()


@pytest.fixture()
def corpus(tmp_path) -> Path:
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    for i, topic in enumerate(TOPICS):
        (folder / ("sub" if i % 3 == 0 else "") / f"{topic}.md").write_text(topic_text(topic, i))
    return folder


def make_store(tmp_path, embedder, name="docs") -> DocumentStore:
    return DocumentStore(name, path=tmp_path / "chroma", embedder=embedder)


# ----------------------------------------------------------------------------- loaders
def test_loaders_read_every_supported_type(tmp_path):
    (tmp_path / "a.txt").write_text("Title line\nbody text")
    (tmp_path / "b.html").write_text(
        "<html><head><title>Page T</title><style>p{}</style><script>var x=1;</script></head><body><h1>Head</h1><p>Para &amp; one.</p><p>Two</p></body></html>"
    )
    (tmp_path / "c.jsonl").write_text('{"text": "first record", "title": "R1"}\n\n{"text": "second"}\n{"other": 1}\n')
    (tmp_path / "d.json").write_text(json.dumps([{"text": "json one"}, {"text": ""}]))
    txt = load_file(tmp_path / "a.txt")
    assert txt[0].title == "Title line" and "body text" in txt[0].text
    (html,) = load_file(tmp_path / "b.html")
    assert html.title == "Page T"
    assert "Para & one." in html.text and "Two" in html.text and "var x" not in html.text and "p{}" not in html.text
    records = load_file(tmp_path / "c.jsonl")
    assert [r.text for r in records] == ["first record", "second"] and records[0].title == "R1"
    assert records[1].source.endswith("c.jsonl#1")
    assert [r.text for r in load_file(tmp_path / "d.json")] == ["json one"]


def minimal_pdf(text: str) -> bytes:
    """A one-page PDF with ``text`` in Helvetica, offsets computed so readers accept it."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def test_pdf_text_is_extracted(tmp_path):
    (tmp_path / "p.pdf").write_bytes(minimal_pdf("The ferry leaves at 6:40 every weekday."))
    (doc,) = load_file(tmp_path / "p.pdf")
    assert "The ferry leaves at 6:40 every weekday." in doc.text
    assert doc.title == "p"


@pytest.mark.parametrize(
    "name, content, reason",
    [
        ("empty.md", b"", "empty file"),
        ("blank.txt", b"  \n\t\n", "no text"),
        ("binary.txt", b"abc\x00\x01\x02", "binary"),
        ("noencoding.md", bytes(range(128, 256)) * 3, "not valid UTF-8"),  # Latin-1 is decoded now (test_ingest_ask_defects)
        ("bad.json", b"{not json", "invalid JSON"),
        ("nofield.jsonl", b'{"body": "x"}\n', "no record"),
        ("broken.pdf", b"%PDF-1.4 garbage", "PDF"),
        ("image.png", b"\x89PNG....", "unsupported"),
    ],
)
def test_bad_files_are_skipped_with_a_reason(tmp_path, name, content, reason):
    path = tmp_path / name
    path.write_bytes(content)
    skipped = load_file(path)
    assert isinstance(skipped, Skipped)
    assert reason in skipped.reason


def test_oversized_and_unreadable_files(tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("x" * 2000)
    assert "too large" in load_file(big, max_bytes=1000).reason
    locked = tmp_path / "locked.txt"
    locked.write_text("secret")
    locked.chmod(0)
    if os.geteuid() != 0:  # root reads anything
        assert "unreadable" in load_file(locked).reason


# ----------------------------------------------------------------------------- chunking
def test_chunks_are_spans_within_the_limit_with_overlap(embedder):
    doc = SourceText("/x.md", "X", topic_text("ferry", 1, sentences=40))
    chunks = chunk_document(doc, embedder.tokenizer, chunk_tokens=64, overlap=16)
    assert len(chunks) > 3
    for a, b in zip(chunks, chunks[1:]):
        assert b.start < a.end  # consecutive chunks overlap
        assert b.start > a.start
    for c in chunks:
        assert doc.text[c.start : c.end] == c.text
        assert c.tokens <= 64
        assert len(embedder.tokenizer(c.text, add_special_tokens=False)["input_ids"]) <= 64
        assert c.start == 0 or doc.text[c.start - 1].isspace()  # starts on a word boundary
    assert chunks[-1].end == len(doc.text.rstrip())
    assert len({c.id for c in chunks}) == len(chunks)
    again = chunk_document(doc, embedder.tokenizer, chunk_tokens=64, overlap=16)
    assert [c.id for c in again] == [c.id for c in chunks]  # ids derive from content
    with pytest.raises(ChunkingError):
        chunk_document(doc, embedder.tokenizer, chunk_tokens=64, overlap=40)


# ----------------------------------------------------------------------------- store
def test_ingest_is_idempotent_and_replaces_changed_files(tmp_path, corpus, embedder):
    store = make_store(tmp_path, embedder)
    (corpus / "empty.md").write_text("")
    (corpus / "bin.txt").write_bytes(b"\x00\x00")
    first = store.ingest([corpus], chunk_tokens=64, overlap=8)
    assert first.files == len(TOPICS) and first.chunks_added == first.chunks == store.count()
    assert sorted(Path(s.source).name for s in first.skipped) == ["bin.txt", "empty.md"]
    again = store.ingest([corpus], chunk_tokens=64, overlap=8)
    assert again.chunks_added == 0 and again.files_unchanged == len(TOPICS) and store.count() == first.chunks
    # A changed file replaces its chunks; the others stay.
    (corpus / "library.md").write_text("# Library\n\nThe library now opens at 7:30 and has a rooftop reading room.")
    changed = store.ingest([corpus], chunk_tokens=64, overlap=8)
    assert changed.files_changed == 1 and changed.chunks_removed > 0
    library = [c for c in store.all_chunks() if c.file.endswith("library.md")]
    assert [c.text for c in library] == ["# Library\n\nThe library now opens at 7:30 and has a rooftop reading room."]
    # A reopened store sees the same collection.
    assert DocumentStore("docs", path=tmp_path / "chroma", embedder=embedder).count() == store.count()


def test_ingest_reports_each_file_before_reading_it(tmp_path, corpus, embedder):
    calls = []
    store = make_store(tmp_path, embedder)
    (corpus / "empty.txt").write_text("")
    report = store.ingest([corpus], on_file=lambda index, total, path: calls.append((index, total, Path(path).name)))
    files = sorted(p.name for p in corpus.rglob("*") if p.is_file())
    assert [c[0] for c in calls] == list(range(len(files))) and {c[1] for c in calls} == {len(files)}
    assert sorted(c[2] for c in calls) == files  # the skipped empty file is announced too
    assert any(Path(s.source).name == "empty.txt" for s in report.skipped)


def test_search_ranks_the_matching_document_first(tmp_path, corpus, embedder):
    store = make_store(tmp_path, embedder)
    store.ingest([corpus], chunk_tokens=64, overlap=8)
    hits = store.search("When did the observatory open? code OBS", 5)
    assert Path(hits[0].file).name == "observatory.md"
    assert hits[0].score >= hits[-1].score
    only = store.search("observatory", 50, where={"file": str(corpus / "bakery.md")})
    assert only and {Path(c.file).name for c in only} == {"bakery.md"}


def test_half_written_versions_are_never_served(tmp_path, corpus, embedder, monkeypatch):
    store = make_store(tmp_path, embedder)
    store.ingest([corpus], chunk_tokens=32, overlap=4)
    before = {c.id for c in store.all_chunks()}
    target = corpus / "museum.md"
    target.write_text(topic_text("museum", 99, sentences=30))
    # Crash after the first batch of the new version: the old version keeps serving.
    real_upsert = store.collection.upsert

    def flaky_upsert(**kwargs):
        real_upsert(**{k: v[:2] for k, v in kwargs.items()})  # only part of the new version lands
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(store.collection, "upsert", flaky_upsert)
    with pytest.raises(KeyboardInterrupt):
        store.ingest([target], chunk_tokens=32, overlap=4)
    assert {c.id for c in store.all_chunks()} == before
    assert all("-99" not in c.text for c in store.search("museum code MUS-99", 30))
    monkeypatch.undo()
    # Crash after the new version is whole but before the old one is deleted: the new one serves.
    store = make_store(tmp_path, embedder)
    monkeypatch.setattr(store.collection, "delete", lambda **kw: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        store.ingest([target], chunk_tokens=32, overlap=4)
    museum = [c for c in store.all_chunks() if c.file == str(target)]
    assert museum and all("MUS-99" in c.text or "museum" in c.text.lower() for c in museum)
    assert any("MUS-99" in c.text for c in museum)
    monkeypatch.undo()
    report = make_store(tmp_path, embedder).ingest([corpus], chunk_tokens=32, overlap=4)
    assert report.chunks_removed > 0
    assert store.count() == report.chunks


KILL_SCRIPT = """
import sys
from snapkv_rag.rag import DocumentStore
store = DocumentStore("killed", path=sys.argv[1])
ingest_file = store._ingest_file
def traced(*args):
    ingest_file(*args)
    print("file done", flush=True)
store._ingest_file = traced
store.ingest([sys.argv[2]], chunk_tokens=64, overlap=8)
"""


def test_kill_9_during_ingest_then_rerun_completes(tmp_path, embedder):
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(30):
        (folder / f"doc{i:02d}.md").write_text(topic_text(TOPICS[i % len(TOPICS)], i, sentences=8))
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(tmp_path / "killed"), str(folder)], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(3):  # let a few files land, then kill it in the middle of the next
            assert proc.stdout.readline() == "file done\n", "ingest ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    partial = DocumentStore("killed", path=tmp_path / "killed", embedder=embedder)
    served = partial.all_chunks()
    assert 0 < len(served) <= partial.count()
    assert len({c.file for c in served}) < 30
    rerun = partial.ingest([folder], chunk_tokens=64, overlap=8)
    clean = DocumentStore("clean", path=tmp_path / "clean", embedder=embedder).ingest([folder], chunk_tokens=64, overlap=8)
    assert partial.count() == clean.chunks == rerun.chunks
    assert {c.text for c in partial.all_chunks()} == {c.text for c in DocumentStore("clean", path=tmp_path / "clean", embedder=embedder).all_chunks()}


def test_collection_names_and_embedder_mismatch(tmp_path, embedder):
    with pytest.raises(StoreError, match="not valid"):
        DocumentStore("a", path=tmp_path / "c", embedder=embedder)
    with pytest.raises(StoreError, match="no collection"):
        DocumentStore("missing", path=tmp_path / "c", embedder=embedder, create=False)
    DocumentStore("named", path=tmp_path / "c", embedder=embedder)
    from snapkv_rag.rag.embeddings import default_embedder_path

    with pytest.raises(StoreError, match="embedded with"):
        DocumentStore("named", path=tmp_path / "c", embedder=Embedder(default_embedder_path()))


# ----------------------------------------------------------------------------- chroma server
def test_chroma_server_mode(tmp_path, corpus, embedder, chroma_server):
    store = DocumentStore("served", url=chroma_server, embedder=embedder)
    report = store.ingest([corpus], chunk_tokens=64, overlap=8)
    assert report.chunks_added == store.count() > 0
    assert store.ingest([corpus], chunk_tokens=64, overlap=8).chunks_added == 0
    hits = DocumentStore("served", url=chroma_server, embedder=embedder, create=False).search("bakery code BAK", 3)
    assert Path(hits[0].file).name == "bakery.md"


def test_unreachable_server_is_one_clear_error(embedder):
    from snapkv_rag.rag import StoreUnavailableError

    with pytest.raises(StoreUnavailableError, match="cannot reach"):
        DocumentStore("x12", url=f"http://127.0.0.1:{free_port()}", embedder=embedder)


# ----------------------------------------------------------------------------- stuffing
@pytest.fixture(scope="module")
def long_engine(tokenizer):
    return tiny_engine("llama", tokenizer, context=4096)


@pytest.fixture(scope="module")
def filled_store(tmp_path_factory, embedder):
    tmp_path = tmp_path_factory.mktemp("filled")
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(30):
        (folder / f"d{i:02d}.md").write_text(topic_text(TOPICS[i % len(TOPICS)], i, sentences=10))
    store = make_store(tmp_path, embedder)
    store.ingest([folder], chunk_tokens=48, overlap=8)
    return store


@pytest.mark.parametrize("budget", [300, 1000, 2500])
def test_packing_fills_the_budget_and_never_overflows(filled_store, long_engine, budget):
    ctx = StuffingRetriever(filled_store, long_engine, context_tokens=budget, max_new_tokens=16).retrieve("ferry code FER")
    empty = long_engine.count_tokens(StuffingRetriever(filled_store, long_engine).retrieve("x").messages[:1] + [ctx.messages[1]])
    assert ctx.prompt_tokens == long_engine.count_tokens(ctx.messages) == empty
    assert ctx.document_tokens <= budget
    if budget >= 1000:
        assert ctx.fill >= 0.95
    # Greedy packing skips what does not fit and goes on: no left-out chunk would still fit.
    retriever = StuffingRetriever(filled_store, long_engine)
    packed = {c.id for c in ctx.chunks}
    left = [c for c in filled_store.search("ferry code FER", 200) if c.id not in packed]
    room = budget - ctx.document_tokens
    assert all(retriever._count("\n\n" + format_document(len(ctx.chunks) + 1, c)) > room for c in left)
    assert ctx.left_out > 0 and ctx.left_out_tokens > 0
    assert ctx.prompt_tokens + 16 <= long_engine.context_length
    assert ctx.messages[-1]["content"].endswith("Question: ferry code FER")
    for i, chunk in enumerate(ctx.chunks, start=1):
        assert f"[{i}] {chunk.title}\n{chunk.text.strip()}" in ctx.messages[-1]["content"]


def test_default_budget_is_the_context_minus_output_and_prompt(filled_store, long_engine):
    ctx = StuffingRetriever(filled_store, long_engine, max_new_tokens=100).retrieve("tram")
    assert ctx.prompt_tokens + 100 <= long_engine.context_length
    assert ctx.prompt_tokens + 100 >= 0.95 * long_engine.context_length
    with pytest.raises(ContextBudgetError, match="does not fit"):
        StuffingRetriever(filled_store, long_engine, context_tokens=4000, max_new_tokens=100).retrieve("tram")
    with pytest.raises(ContextBudgetError):
        StuffingRetriever(filled_store, long_engine, max_new_tokens=4096).retrieve("tram")
    with pytest.raises(EmptyPromptError):
        StuffingRetriever(filled_store, long_engine).retrieve("  ")


def test_order_top_k_min_score_and_filters(filled_store, long_engine):
    by_score = StuffingRetriever(filled_store, long_engine, context_tokens=1500).retrieve("bakery code BAK")
    scores = [c.score for c in by_score.chunks]
    assert scores == sorted(scores, reverse=True)
    by_source = StuffingRetriever(filled_store, long_engine, context_tokens=1500, order="source").retrieve("bakery code BAK")
    assert {c.id for c in by_source.chunks} == {c.id for c in by_score.chunks}
    keys = [(c.file, c.position) for c in by_source.chunks]
    assert keys == sorted(keys)
    assert len(StuffingRetriever(filled_store, long_engine, top_k=3).retrieve("bakery").chunks) == 3
    threshold = StuffingRetriever(filled_store, long_engine, min_score=0.5).retrieve("bakery code BAK")
    assert all(c.score >= 0.5 for c in threshold.chunks)
    target = filled_store.all_chunks()[0].file
    filtered = StuffingRetriever(filled_store, long_engine, where={"file": target}).retrieve("anything")
    assert filtered.chunks and {c.file for c in filtered.chunks} == {target}
    with pytest.raises(ContextBudgetError):
        StuffingRetriever(filled_store, long_engine, order="random")


def test_reuse_order_leads_with_a_remembered_head_and_keeps_the_chosen_chunks():
    orders = StuffedOrders(remembered=2)
    cost = {"a": 10, "b": 10, "c": 50, "d": 5, "e": 5}.__getitem__
    assert reuse_order(["c", "a", "b"], orders, "sys", cost) == (["c", "a", "b"], 0)  # nothing remembered: score order
    orders.record(["a", "b", "x"], "sys")
    orders.record(["c", "y"], "sys")
    # both heads are in the selection; c's (50 tokens) beats a, b (20 tokens) though a, b is longer
    assert reuse_order(["a", "b", "c", "d"], orders, "sys", cost) == (["c", "a", "b", "d"], 1)
    assert reuse_order(["b", "a", "d"], orders, "sys", cost) == (["a", "b", "d"], 2)
    assert reuse_order(["b", "a", "d"], orders, "other system prompt", cost) == (["b", "a", "d"], 0)
    orders.record(["e"], "sys")  # remembers two: the oldest, a, b, x, is forgotten
    assert reuse_order(["b", "a"], orders, "sys", cost) == (["b", "a"], 0)
    with pytest.raises(ValueError, match="remembered"):
        StuffedOrders(remembered=0)


def test_cache_order_stuffs_the_score_selection_so_the_next_prompt_reuses_its_head(filled_store, long_engine):
    questions = ["bakery code BAK opened", "When did the bakery open?", "bakery fact 3", "the code of the bakery", "Marrowick bakery 1907"]
    by_score = {q: StuffingRetriever(filled_store, long_engine, context_tokens=600).retrieve(q) for q in questions}
    ids = {q: [c.id for c in ctx.chunks] for q, ctx in by_score.items()}
    # a pair where the first prompt's top chunk is stuffed for the second question too, but not first
    first_q, second_q = next((a, b) for a in questions for b in questions if a != b and ids[a][0] in ids[b][1:])
    retriever = StuffingRetriever(filled_store, long_engine, context_tokens=600, order="cache")
    assert retriever.orders is orders_for(long_engine)  # one per engine: retrievers made per call share it
    retriever.orders.clear()
    first = retriever.retrieve(first_q)
    assert [c.id for c in first.chunks] == [c.id for c in by_score[first_q].chunks] and first.settings["reused_head"] == 0
    second = retriever.retrieve(second_q)
    assert {c.id for c in second.chunks} == {c.id for c in by_score[second_q].chunks}  # the same chunks, other places
    head = second.settings["reused_head"]
    assert head >= 1 and [c.id for c in second.chunks][:head] == [c.id for c in first.chunks][:head]
    rest = second.chunks[head:]
    assert [c.score for c in rest] == sorted((c.score for c in rest), reverse=True)
    # the engine's prefix cache reuses the shared head's K/V, which score order would prefill again
    long_engine.prefix_cache.clear()
    long_engine.generate(first.messages, max_new_tokens=1)
    reused = {}
    for name, context in (("score", by_score[second_q]), ("cache", second)):
        reused[name] = long_engine.generate(context.messages, max_new_tokens=1).stats.reused_prompt_tokens
    assert reused["cache"] > reused["score"] + 50


def test_whole_collection_is_stable_and_refuses_to_truncate(filled_store, long_engine):
    small = StuffingRetriever(filled_store, long_engine, whole_collection=True, where={"file": filled_store.all_chunks()[0].file})
    a, b = small.retrieve("first question?"), small.retrieve("another question?")
    assert [c.id for c in a.chunks] == [c.id for c in b.chunks]
    shared = a.messages[-1]["content"].split("Question:")[0]
    assert b.messages[-1]["content"].startswith(shared)
    with pytest.raises(ContextBudgetError, match="whole collection"):
        StuffingRetriever(filled_store, long_engine, whole_collection=True, context_tokens=500).retrieve("q")


def test_the_same_text_under_two_paths_is_stuffed_once(tmp_path, embedder, long_engine):
    for copy in ("checkout-a", "checkout-b"):
        folder = tmp_path / copy
        folder.mkdir()
        for i in range(3):
            (folder / f"d{i}.md").write_text(topic_text(TOPICS[i], i, sentences=10))
    store = make_store(tmp_path, embedder)
    store.ingest([tmp_path / "checkout-a", tmp_path / "checkout-b"], chunk_tokens=48, overlap=8)
    everything = store.all_chunks()
    unique_texts = {c.text for c in everything}
    assert len(everything) == 2 * len(unique_texts)
    for whole in (False, True):
        ctx = StuffingRetriever(store, long_engine, whole_collection=whole).retrieve("ferry code FER")
        texts = [c.text for c in ctx.chunks]
        assert len(texts) == len(set(texts)) == len(unique_texts)
        assert ctx.duplicates == len(unique_texts) and ctx.to_dict()["duplicates"] == ctx.duplicates
        assert ctx.left_out == 0


def test_top_k_counts_distinct_chunks_when_copies_take_places_in_the_ranking(tmp_path, embedder, long_engine):
    for copy in ("checkout-a", "checkout-b", "checkout-c"):
        folder = tmp_path / copy
        folder.mkdir()
        for i in range(3):
            (folder / f"d{i}.md").write_text(topic_text(TOPICS[i], i, sentences=10))
    store = make_store(tmp_path, embedder)
    store.ingest([tmp_path / name for name in ("checkout-a", "checkout-b", "checkout-c")], chunk_tokens=48, overlap=8)
    distinct = len({c.text for c in store.all_chunks()})
    for top_k in (2, 5, distinct, distinct + 4):
        ctx = StuffingRetriever(store, long_engine, top_k=top_k).retrieve("ferry code FER")
        texts = [c.text for c in ctx.chunks]
        assert len(texts) == len(set(texts)) == min(top_k, distinct)
        # The best-ranked distinct texts, in order: what a store without the copies would give.
        ranked = []
        for chunk in store.search("ferry code FER", store.count()):
            if chunk.text not in ranked:
                ranked.append(chunk.text)
        assert texts == ranked[: min(top_k, distinct)]
        assert 0 < ctx.duplicates <= 2 * len(texts)


def test_empty_collection_is_a_clear_error(tmp_path, embedder, long_engine):
    store = DocumentStore("nothing", path=tmp_path / "c", embedder=embedder)
    with pytest.raises(EmptyCollectionError, match="ingest"):
        DocumentQA(long_engine, store).ask("anything?")


# ----------------------------------------------------------------------------- citations and QA
def test_attribution_cites_the_supporting_chunk(embedder):
    chunks = [
        "The ferry leaves Marrowick harbour at 6:40 on weekdays.",
        "The library opens at 9:00 and holds 40,000 books.",
        "The glassworks museum charges 4 crowns for entry.",
    ]
    attributor = EvidenceAttributor(embedder)
    support = attributor.attribute("How many books does the library hold?", "The library holds 40,000 books.", chunks)
    assert [s.numbers for s in support] == [(2,)]
    two = attributor.attribute("q", "The ferry leaves at 6:40. Entry to the museum costs 4 crowns.", chunks)
    assert [s.numbers[0] for s in two] == [1, 3]
    assert attributor.attribute("q", "I do not know.", chunks)[0].numbers == ()


class ScriptedEngine:
    """Wraps a real engine and forces the answer text, to test citation mapping exactly."""

    def __init__(self, engine, text):
        self._engine, self._text = engine, text

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, prompt, **kwargs):
        import dataclasses

        result = self._engine.generate(prompt, **{**kwargs, "max_new_tokens": 1})
        return dataclasses.replace(result, text=self._text)


def test_generated_citations_map_to_chunks_and_invalid_ones_are_reported(filled_store, long_engine):
    qa = DocumentQA(ScriptedEngine(long_engine, "It opened in 1900 [2][1]. See also [99] and [0]."), filled_store, context_tokens=600)
    answer = qa.ask("When did the ferry open?")
    assert answer.cited("generated") == [2, 1]
    assert answer.invalid_citations == [99, 0]
    generated = [c for c in answer.citations if c.route == "generated"]
    assert [c.chunk.id for c in generated] == [answer.context.chunks[1].id, answer.context.chunks[0].id]
    as_dict = answer.to_dict()
    assert as_dict["cited"]["generated"] == [2, 1]
    assert as_dict["citations"][0]["source"] == answer.context.chunks[1].source
    json.dumps(as_dict)


def test_document_qa_runs_the_engine_path_with_the_aligned_window(filled_store, long_engine):
    qa = DocumentQA(long_engine, filled_store, context_tokens=1500, compression=SnapKV(window_size="question", max_capacity_prompt=256))
    answer = qa.ask("When did the garden open?", max_new_tokens=4)
    stats = answer.result.stats
    assert answer.context.prompt_tokens == answer.result.usage.prompt_tokens
    assert stats.kept_tokens_per_layer == [256, 256]
    window = stats.compression["resolved_window_sizes"][0]
    assert window == len(long_engine.tokenizer(answer.context.question_text + "<|end|><|assistant|>", add_special_tokens=False)["input_ids"])
    stream = qa.stream("When did the garden open?", max_new_tokens=4)
    assert "".join(stream) == stream.answer.text == answer.text
    full = qa.ask("When did the garden open?", compression=None, max_new_tokens=4)
    assert full.result.stats.compression is None


def test_document_qa_drafts_greedy_answers_by_default(filled_store, long_engine):
    from snapkv_rag.rag.qa import DEFAULT_LOOKUP_TOKENS

    qa = DocumentQA(long_engine, filled_store, context_tokens=800)
    answer = qa.ask("When did the garden open?", max_new_tokens=12)
    assert answer.result.stats.drafts["prompt_lookup_num_tokens"] == DEFAULT_LOOKUP_TOKENS
    off = DocumentQA(long_engine, filled_store, context_tokens=800, prompt_lookup_num_tokens=0).ask("When did the garden open?", max_new_tokens=12)
    assert off.result.stats.drafts is None and off.text == answer.text
    sampled = qa.ask("When did the garden open?", max_new_tokens=4, temperature=0.7, seed=1)
    assert sampled.result.stats.drafts is None  # drafts are for greedy answers


def test_document_qa_records_attention_for_the_attention_route(filled_store, long_engine):
    from snapkv_rag.rag.qa import ROUTES

    qa = DocumentQA(long_engine, filled_store, context_tokens=800, routes=ROUTES)
    answer = qa.ask("When did the garden open?", max_new_tokens=6)
    assert answer.result.stats.span_attention == f"recorded ({len(answer.context.chunks)} spans)"
    assert len(answer.result.span_attention[0]) == len(answer.context.chunks)
    assert set(answer.to_dict()["cited"]) == {"generated", "attributed", "attention"}
    by_default = DocumentQA(long_engine, filled_store, context_tokens=800).ask("When did the garden open?", max_new_tokens=6)
    assert by_default.result.span_attention is None and by_default.text == answer.text
    assert set(by_default.to_dict()["cited"]) == {"generated", "attributed"}


def test_document_qa_async(filled_store, long_engine):
    import asyncio

    qa = DocumentQA(long_engine, filled_store, context_tokens=800)
    sync = qa.ask("bakery?", max_new_tokens=4)

    async def run():
        answer = await qa.aask("bakery?", max_new_tokens=4)
        items = [item async for item in qa.astream("bakery?", max_new_tokens=4)]
        return answer, items

    answer, items = asyncio.run(run())
    assert answer.text == sync.text
    assert "".join(items[:-1]) == items[-1].text == sync.text


def test_32k_token_prompt_with_snapkv_keeps_one_full_layer_at_most(tmp_path, embedder, tokenizer):
    engine = tiny_engine("llama", tokenizer, context=40_000)
    folder = tmp_path / "big"
    folder.mkdir()
    for i in range(60):
        (folder / f"b{i:02d}.md").write_text(topic_text(TOPICS[i % len(TOPICS)], i, sentences=30))
    store = make_store(tmp_path, embedder, name="big")
    store.ingest([folder], chunk_tokens=200, overlap=20)
    qa = DocumentQA(engine, store, context_tokens=33_000, compression=SnapKV(window_size="question", max_capacity_prompt=512))
    full_layers: list[int] = []

    def before_attention(module, args, kwargs):
        cache = kwargs["cache"]
        sizes = [layer.keys.shape[2] for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]
        full_layers.append(sum(size > 512 for size in sizes))

    hooks = [layer.self_attn.register_forward_pre_hook(before_attention, with_kwargs=True) for layer in engine.model.model.layers]
    try:
        answer = qa.ask("When did the observatory open?", max_new_tokens=2)
    finally:
        for h in hooks:
            h.remove()
    assert answer.result.usage.prompt_tokens >= 32_000
    assert answer.context.fill >= 0.95
    assert answer.result.stats.kept_tokens_per_layer == [512, 512]
    assert max(full_layers) <= 1 and full_layers[0] == 0


def test_document_qa_reuses_chunk_kv_stored_beside_the_store(filled_store, long_engine, tmp_path):
    from snapkv_rag.rag.kv_reuse import default_kv_dir

    kv_dir = tmp_path / "kv"
    qa = DocumentQA(long_engine, filled_store, context_tokens=600, max_new_tokens=2, kv_dir=str(kv_dir))
    assert default_kv_dir(filled_store) == Path(filled_store.location) / "kv-segments"
    first = qa.ask("When did the ferry open?")
    stats = first.result.stats
    assert stats.segment_reuse == "blended" and stats.segment_hits + stats.segment_misses == len(first.context.chunks) > 1
    assert len(list(kv_dir.glob("*/*.safetensors"))) == stats.segment_hits + stats.segment_misses
    # a second DocumentQA on the same directory, the same chunks at other positions
    reordered = DocumentQA(long_engine, filled_store, context_tokens=600, max_new_tokens=2, kv_dir=str(kv_dir), recompute=0.0, system_prompt="Answer briefly.")
    again = reordered.ask("When did the ferry open?")
    assert sorted(c.id for c in again.context.chunks) == sorted(c.id for c in first.context.chunks)
    assert (again.result.stats.segment_hits, again.result.stats.segment_misses, again.result.stats.recomputed_prompt_tokens) == (
        len(again.context.chunks),
        0,
        0,
    )
    assert again.result.stats.reused_prompt_tokens > again.result.usage.prompt_tokens // 2
    for mode in ("prefix", "off"):
        other = DocumentQA(long_engine, filled_store, context_tokens=600, max_new_tokens=2, kv_reuse=mode).ask("When did the ferry open?")
        assert other.result.stats.segment_reuse is None and other.result.stats.segment_hits == 0
    with pytest.raises(ValueError, match="kv_reuse"):
        DocumentQA(long_engine, filled_store, kv_reuse="always")


def test_precompute_kv_stores_every_chunk_once(filled_store, long_engine, tmp_path):
    qa = DocumentQA(long_engine, filled_store, context_tokens=600, max_new_tokens=2, kv_dir=str(tmp_path / "kv"))
    computed, stored = qa.precompute_kv()
    assert (computed, stored) == (filled_store.count(), 0)
    assert qa.precompute_kv() == (0, filled_store.count())
    answer = qa.ask("When did the museum open?")
    assert answer.result.stats.segment_misses == 0 and answer.result.stats.segment_hits == len(answer.context.chunks)
    with pytest.raises(ValueError, match="chunks"):
        DocumentQA(long_engine, filled_store, kv_reuse="prefix").precompute_kv()


def test_document_qa_runs_the_embedder_on_the_engines_thread(tmp_path, corpus):
    """A second thread doing torch work slowed the engine's CPU decode 2-3x (issue 25), so
    DocumentQA (through its StuffingRetriever) hands the store's embedder the engine's worker for loading and encoding."""
    import threading

    from snapkv_rag.rag import DocumentQA

    engine = tiny_engine("llama")
    store = DocumentStore("thread-probe", path=tmp_path / "chroma", embedder=Embedder())
    DocumentQA(engine, store)
    assert store.embedder.runner == engine.run_on_model
    seen = []
    encode = store.embedder.model.encode

    def recording(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    store.embedder.model.encode = recording
    store.ingest([corpus])
    store.search("When did the observatory open?", 3)
    assert seen and set(seen) == {"snapkv-rag-model"}
    other = DocumentStore("thread-probe", path=tmp_path / "chroma", embedder=store.embedder)
    DocumentQA(tiny_engine("llama"), other)
    assert other.embedder.runner == engine.run_on_model  # a runner already set is kept


def test_document_qa_stuffs_past_the_window_and_rolls_by_itself(filled_store, tokenizer):
    """context_tokens beyond the model's window: the sparse default policy reads the prompt with a
    rolling prefill (named on the stats line); the full cache cannot, and says how to."""
    from snapkv_rag.rag.cli import _rolling_note
    from snapkv_rag.rag.stuffing import ContextBudgetError

    short = tiny_engine("llama", tokenizer, context=512)
    qa = DocumentQA(short, filled_store, context_tokens=1500, compression=SnapKV(window_size="question", max_capacity_prompt=128, max_window=32))
    answer = qa.ask("When did the garden open?", max_new_tokens=4)
    assert answer.result.usage.prompt_tokens > 1500 > short.context_length
    stats = answer.result.stats
    assert stats.compression["rolling"] == 512 - 128 - 32 - 4 and stats.policy_stats["rolled_chunks"] >= 4
    assert stats.kept_tokens_per_layer == [128, 128]
    assert "past the window: read in" in _rolling_note(stats)
    small = qa.ask("When did the garden open?", max_new_tokens=4, compression=SnapKV(max_capacity_prompt=128, window_size=16, rolling=256))
    assert small.result.stats.policy_stats["rolled_chunks"] >= 6
    with pytest.raises(ContextBudgetError, match="rolling="):
        DocumentQA(short, filled_store, context_tokens=1500, compression=None).ask("When did the garden open?", max_new_tokens=4)


def test_choosing_chunk_reuse_against_the_models_recommendation_gets_a_note():
    from types import SimpleNamespace

    from snapkv_rag.rag.kv_reuse import kv_reuse_note

    embedded = SimpleNamespace(recommended_kv_reuse="prefix")
    assert "recommended --kv-reuse is prefix" in kv_reuse_note(embedded, "chunks") and "lost 13 of its 19" in kv_reuse_note(embedded, "chunks")
    assert kv_reuse_note(embedded, None) is None and kv_reuse_note(embedded, "prefix") is None and kv_reuse_note(embedded, "off") is None
    larger = SimpleNamespace(recommended_kv_reuse="chunks")
    assert kv_reuse_note(larger, "chunks") is None and "reuses less" in kv_reuse_note(larger, "prefix")


def test_follow_ups_read_the_same_documents_from_one_kept_context(filled_store, long_engine):
    long_engine.kept_contexts.clear()
    qa = DocumentQA(long_engine, filled_store, context_tokens=1500, compression="expected:budget=256")
    first = qa.ask("When did the garden open?", max_new_tokens=4)
    second = qa.follow_up("Who tends the garden?", first, max_new_tokens=4)
    third = qa.follow_up("How large is the garden?", second, max_new_tokens=4)
    assert [c.id for c in third.context.chunks] == [c.id for c in first.context.chunks]
    assert (second.result.stats.context_reuse, third.result.stats.context_reuse) == ("stored", "reused")
    assert third.result.stats.prefilled_prompt_tokens < 30  # the question and the template's tail
    assert third.context.question == "How large is the garden?" and third.context.messages[-1]["content"].endswith("How large is the garden?")
