"""A cited answer over the shipped sample corpus, on the embedded model, offline.

    python connectors/langchain-snapkv/examples/cited_answer.py ["question"]

Ingests examples/sample_corpus into a Chroma collection (idempotent: a re-run adds nothing),
packs the most relevant chunks into 2000 LLM tokens, answers with SnapKV (budget 1024, a
question-aligned window) and prints the answer, its citations mapped to documents, and what
compression did.
"""

from __future__ import annotations

import sys
from pathlib import Path

from langchain_snapkv import ChatSnapKV, SnapKVStuffingRetriever, create_cited_qa_chain
from snapkv_rag.integrations import DocumentStore

CORPUS = Path(__file__).resolve().parents[3] / "examples" / "sample_corpus"


def main() -> None:
    question = sys.argv[1] if len(sys.argv) > 1 else "What time does the first ferry leave Marrowick harbour on weekdays?"
    store = DocumentStore("marrowick-langchain")
    print(store.ingest([CORPUS]).summary())
    llm = ChatSnapKV(model="default", max_tokens=64, compression="snapkv:budget=1024,window=question")
    retriever = SnapKVStuffingRetriever(store=store, llm=llm, context_tokens=2000, max_new_tokens=64)
    chain = create_cited_qa_chain(llm, retriever)
    out = chain.invoke(question)
    meta = out["message"].response_metadata
    print(f"Q: {question}\nA: {out['answer'].strip()}")
    print("Citations:")
    for c in out["citations"]:
        doc = c["document"]
        score = f", score {c['score']:.2f}" if c["score"] is not None else ""
        print(f"  [{c['number']}] {c['route']}: {doc.metadata['title']} - {Path(doc.metadata['source']).name} (chunk {doc.metadata['position']}{score})")
    if out["invalid_citations"]:
        print(f"  markers pointing at no document: {out['invalid_citations']}")
    print(
        f"Stuffed {len(out['documents'])} documents; prompt {meta['prompt_tokens']} tokens, KV kept {meta['kept_tokens']} per layer "
        f"({meta['compression']['method'] if meta['compression'] else 'full'}, {meta['compression_ratio']:.2f}x); "
        f"prefill {meta['prefill_seconds']:.1f} s, decode {meta['decode_ms_per_token'] or 0:.0f} ms/token"
    )


if __name__ == "__main__":
    main()
