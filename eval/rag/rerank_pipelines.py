"""The attention reranker in a LlamaIndex query engine and a LangChain chain (issue 75, item 4): answers right with it and without.

For each question of the sample corpus (examples/sample_corpus, 40 questions), four pipelines
answer on the embedded model (one ``Engine.default()`` under both frameworks' wrappers; greedy,
32 new tokens, the full cache, no K/V reuse: as long_reads' ``full:1K``):

- ``llamaindex``: the corpus in a ``VectorStoreIndex`` (SimpleDirectoryReader, file metadata
  hidden, SentenceSplitter chunks of 200 of the LLM's tokens overlapping 40 as the core's
  DocumentStore cuts them, the connector's default embed model), ``as_query_engine`` with
  ``similarity_top_k=40`` and a ``TokenBudgetPostprocessor(context_tokens=1000)``, answered by
  ``SnapKVLLM(compression=None)`` through LlamaIndex's default prompt;
- ``llamaindex+rerank``: the same query engine, its nodes packed to 4,000 tokens of candidates
  instead, then ``SnapKVAttentionReranker(budget_tokens=1000)`` (the candidates read, rolled; ``--skim
  stored``: from stored keys; ``--fusion rrf``: fused with the retriever's order);
- ``langchain``: an LCEL chain ``SnapKVStuffingRetriever(context_tokens=1000)`` (the connector's
  retriever over the core's DocumentStore) -> ``cited_prompt`` (the core's numbered-documents
  prompt) -> ``ChatSnapKV(compression=None)`` -> ``StrOutputParser``;
- ``langchain+rerank``: the retriever packs 4,000 tokens of candidates, then
  ``SnapKVAttentionReranker(budget_tokens=1000)``, then the same prompt and model.

With ``--skim stored`` both rerankers skim from the engine's stored keys (its segment store): a
passage seen for an earlier question is placed from its K/V instead of read again. Records (appended as they are
made; a rerun skips what is there) hold the answer, whether it is right (``answer_correct``),
whether the gold document is among the stuffed ones (and, with the reranker, among its
candidates), the stuffed documents' tokens, the wall-clock seconds of the whole question
(retrieval, rerank, answer) and the reranker's read. The table gives per pipeline the answers
right of N, the gold document stuffed of N and the median seconds.

    .venv/bin/python -m eval rerank_pipelines --questions 2 --out /tmp/rerank_try
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval.common.corpora import load_corpus
from eval.common.results_io import append_record, read_records, write_table
from snapkv_rag import Engine
from snapkv_rag.harness.rag_citation import answer_correct, is_gold_file
from snapkv_rag.rag import DocumentStore

RESULTS = Path(__file__).resolve().parent / "results"
PIPELINES = ("llamaindex", "llamaindex+rerank", "langchain", "langchain+rerank")
MAX_NEW_TOKENS = 32
CONTEXT_TOKENS = 1000  # what is stuffed for the answer, with the reranker or without
CANDIDATE_TOKENS = 4000  # what the reranker ranks
SIMILARITY_TOP_K = 40  # LlamaIndex's retriever: more nodes than 4,000 tokens hold (200-token chunks)
CHUNK_TOKENS, CHUNK_OVERLAP = 200, 40  # the core DocumentStore's chunking, for LlamaIndex's splitter


@dataclass
class Answered:
    """One pipeline's answer to one question and what it stuffed."""

    text: str
    files: list[str]  # the stuffed documents' files, in prompt order
    texts: list[str]  # their texts as the model reads them
    rerank_seconds: float | None = None
    rerank_prompt_tokens: int | None = None


@dataclass
class Pipeline:
    """A question in, an :class:`Answered` out; ``candidates``: the files the reranker ranks (None without one)."""

    answer: Callable[[str], Answered]
    candidates: Callable[[str], list[str]] | None = None


def llamaindex_pipelines(engine: Engine, folder: Path, rerank: dict) -> dict[str, Pipeline]:
    """``llamaindex`` and ``llamaindex+rerank``: a VectorStoreIndex query engine, as the connector's README builds one."""
    from llama_index.core import Settings, SimpleDirectoryReader, VectorStoreIndex
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.schema import MetadataMode
    from llama_index.llms.snapkv import SnapKVAttentionReranker, SnapKVLLM, TokenBudgetPostprocessor, default_embed_model, hide_file_metadata

    llm = SnapKVLLM(engine, compression=None, max_new_tokens=MAX_NEW_TOKENS, kv_reuse="off")
    embed_model = default_embed_model()
    Settings.llm, Settings.embed_model = llm, embed_model  # nothing falls back to OpenAI
    Settings.tokenizer = llm.tokenize  # LlamaIndex counts in the LLM's own tokens
    documents = hide_file_metadata(SimpleDirectoryReader(str(folder)).load_data())
    splitter = SentenceSplitter(chunk_size=CHUNK_TOKENS, chunk_overlap=CHUNK_OVERLAP, tokenizer=llm.tokenize)
    index = VectorStoreIndex.from_documents(documents, embed_model=embed_model, transformations=[splitter])
    plain = index.as_query_engine(
        llm=llm, similarity_top_k=SIMILARITY_TOP_K, node_postprocessors=[TokenBudgetPostprocessor(llm=llm, context_tokens=CONTEXT_TOKENS)]
    )
    reranker = SnapKVAttentionReranker(llm=llm, budget_tokens=CONTEXT_TOKENS, **rerank)
    candidates = TokenBudgetPostprocessor(llm=llm, context_tokens=CANDIDATE_TOKENS)
    reranked = index.as_query_engine(llm=llm, similarity_top_k=SIMILARITY_TOP_K, node_postprocessors=[candidates, reranker])
    retriever = index.as_retriever(similarity_top_k=SIMILARITY_TOP_K)

    def answered(response: Any, rerank: Any = None) -> Answered:
        nodes = response.source_nodes
        return Answered(
            text=str(response.response or ""),
            files=[n.node.metadata.get("file_path", "") for n in nodes],
            texts=[n.node.get_content(metadata_mode=MetadataMode.LLM) for n in nodes],
            rerank_seconds=None if rerank is None else round(rerank.seconds, 3),
            rerank_prompt_tokens=None if rerank is None else rerank.prompt_tokens,
        )

    def candidate_files(question: str) -> list[str]:  # the reranker's input, retrieved again (deterministic)
        nodes = candidates.postprocess_nodes(retriever.retrieve(question), query_str=question)
        return [n.node.metadata.get("file_path", "") for n in nodes]

    return {
        "llamaindex": Pipeline(lambda q: answered(plain.query(q))),
        "llamaindex+rerank": Pipeline(lambda q: answered(reranked.query(q), reranker.last_rerank), candidate_files),
    }


def langchain_pipelines(engine: Engine, store: DocumentStore, rerank: dict) -> dict[str, Pipeline]:
    """``langchain`` and ``langchain+rerank``: LCEL chains retriever -> (reranker) -> prompt -> ChatSnapKV -> StrOutputParser."""
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough

    from langchain_snapkv import ChatSnapKV, SnapKVAttentionReranker, SnapKVStuffingRetriever, cited_prompt

    llm = ChatSnapKV(engine=engine, compression=None, max_tokens=MAX_NEW_TOKENS, kv_reuse="off")
    stuffed = SnapKVStuffingRetriever(store=store, llm=llm, context_tokens=CONTEXT_TOKENS, max_new_tokens=MAX_NEW_TOKENS)
    candidates = SnapKVStuffingRetriever(store=store, llm=llm, context_tokens=CANDIDATE_TOKENS, max_new_tokens=MAX_NEW_TOKENS)
    reranker = SnapKVAttentionReranker(llm=llm, budget_tokens=CONTEXT_TOKENS, **rerank)
    rerank = RunnableLambda(lambda q: reranker.compress_documents(candidates.invoke(q), q)).with_config(run_name="rerank")

    def chain(documents: Runnable) -> Runnable:
        answer = RunnableLambda(cited_prompt) | llm | StrOutputParser()
        return RunnableParallel(documents=documents, question=RunnablePassthrough()).assign(answer=answer)

    plain, reranked = chain(stuffed), chain(rerank)

    def answered(out: dict[str, Any], rerank: Any = None) -> Answered:
        docs = out["documents"]
        return Answered(
            text=out["answer"],
            files=[str(d.metadata.get("file", d.metadata.get("source", ""))) for d in docs],
            texts=[d.page_content for d in docs],
            rerank_seconds=None if rerank is None else round(rerank.seconds, 3),
            rerank_prompt_tokens=None if rerank is None else rerank.prompt_tokens,
        )

    def candidate_files(question: str) -> list[str]:
        return [str(d.metadata.get("file", d.metadata.get("source", ""))) for d in candidates.invoke(question)]

    return {
        "langchain": Pipeline(lambda q: answered(plain.invoke(q))),
        "langchain+rerank": Pipeline(lambda q: answered(reranked.invoke(q), reranker.last_rerank), candidate_files),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m eval rerank_pipelines", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipelines", nargs="*", choices=PIPELINES, default=list(PIPELINES))
    ap.add_argument("--questions", type=int, default=None, help="the first N sample questions (default: all 40)")
    ap.add_argument("--out", type=Path, default=RESULTS / "rerank_pipelines")
    ap.add_argument("--fusion", choices=("attention", "rrf"), default="attention", help="the reranker's fusion (rrf: with the retriever's order)")
    ap.add_argument(
        "--skim", choices=("prefill", "stored"), default="prefill", help="the reranker prefills the candidates (rolled; its default) or reads stored keys"
    )
    ap.add_argument("--table-only", action="store_true")
    return ap


def run(args: argparse.Namespace, out: Path, records: list[dict]) -> None:
    done = {(r["pipeline"], r["question"]) for r in records}
    with tempfile.TemporaryDirectory(prefix="snapkv-rerank-pipelines-") as tmp:
        folder, questions = load_corpus("sample", Path(tmp), args.questions)
        if all((name, q.question) in done for q in questions for name in args.pipelines):
            return
        # not the invariant mode (long_reads' choice): it refuses blended chunk reuse (an approximation by
        # design), so a skim from stored keys would read every passage again
        engine = Engine.default(invariant=False)
        rerank = {"fusion": args.fusion, "stored_keys": args.skim == "stored"}
        pipelines: dict[str, Pipeline] = {}
        if any(p.startswith("llamaindex") for p in args.pipelines):
            pipelines.update(llamaindex_pipelines(engine, folder, rerank))
        if any(p.startswith("langchain") for p in args.pipelines):
            store = DocumentStore("rerank-pipelines", path=tmp)
            store.ingest([folder])
            pipelines.update(langchain_pipelines(engine, store, rerank))
        with (out / "records.jsonl").open("a") as sink:
            for number, q in enumerate(questions, start=1):
                for name in args.pipelines:
                    if (name, q.question) in done:
                        continue
                    pipeline = pipelines[name]
                    start = time.perf_counter()
                    answered = pipeline.answer(q.question)
                    seconds = time.perf_counter() - start
                    candidates = pipeline.candidates(q.question) if pipeline.candidates is not None else None
                    record = {
                        "id": number,
                        "pipeline": name,
                        "question": q.question,
                        "answer": answered.text,
                        "right": bool(answer_correct(answered.text, q.answer)),
                        "gold_stuffed": any(is_gold_file(f, q.gold) for f in answered.files),
                        "gold_candidate": None if candidates is None else any(is_gold_file(f, q.gold) for f in candidates),
                        "stuffed": len(answered.files),
                        "stuffed_tokens": sum(engine.count_tokens(t, chat=False) for t in answered.texts),
                        "candidates": None if candidates is None else len(candidates),
                        "seconds": round(seconds, 3),
                        "rerank_seconds": answered.rerank_seconds,
                        "rerank_prompt_tokens": answered.rerank_prompt_tokens,
                    }
                    append_record(sink, records, record)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    records = read_records(out, missing_ok=True)
    if not args.table_only:
        run(args, out, records)
    lines = [
        "| pipeline | questions | right | gold document stuffed | gold among the reranker's candidates | median stuffed tokens | median s per question | median rerank s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in [p for p in PIPELINES if any(r["pipeline"] == p for r in records)]:
        rows = [r for r in records if r["pipeline"] == name]
        candidates = [r["gold_candidate"] for r in rows if r["gold_candidate"] is not None]
        reranks = [r["rerank_seconds"] for r in rows if r["rerank_seconds"] is not None]
        lines.append(
            f"| {name} | {len(rows)} | {sum(r['right'] for r in rows)} of {len(rows)} | {sum(r['gold_stuffed'] for r in rows)} of {len(rows)} | "
            f"{f'{sum(candidates)} of {len(candidates)}' if candidates else '-'} | {statistics.median(r['stuffed_tokens'] for r in rows):.0f} | "
            f"{statistics.median(r['seconds'] for r in rows):.1f} | {f'{statistics.median(reranks):.1f}' if reranks else '-'} |"
        )
    write_table(out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
