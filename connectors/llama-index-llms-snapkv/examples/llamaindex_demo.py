"""SnapKVLLM inside LlamaIndex, offline on the embedded SmolLM2-135M-Instruct.

1. Cited answers over the sample corpus: VectorStoreIndex over Chroma (local all-MiniLM-L6-v2
   embeddings), CitationQueryEngine with the token-budget postprocessor, full cache vs SnapKV
   side by side with their sources and kept tokens.
2. A FunctionAgent over long tool outputs: SnapKVMemory keeps them whole across turns.

    HF_HUB_OFFLINE=1 python connectors/llama-index-llms-snapkv/examples/llamaindex_demo.py [--context-tokens 1200]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from llama_index.core import Settings, SimpleDirectoryReader, StorageContext, VectorStoreIndex
from llama_index.core.agent.workflow import AgentStream, FunctionAgent, ToolCallResult
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.query_engine import CitationQueryEngine
from llama_index.core.tools import FunctionTool
from llama_index.llms.snapkv import (
    CITATION_HEADER,
    SnapKVLLM,
    SnapKVMemory,
    TokenBudgetPostprocessor,
    chroma_vector_store,
    default_embed_model,
    hide_file_metadata,
)

from snapkv_rag.integrations import parse_citations

CORPUS = Path(__file__).resolve().parents[3] / "examples" / "sample_corpus"
QUESTION = "What time does the first ferry leave Marrowick harbour on weekdays?"


class LastLLMCall(BaseEventHandler):
    """Keeps the additional_kwargs (usage and compression stats) of the latest LLM chat call."""

    last: dict = {}

    @classmethod
    def class_name(cls) -> str:
        return "LastLLMCall"

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            LastLLMCall.last = dict(event.response.additional_kwargs)


def describe(stats: dict) -> str:
    kept = stats.get("kept_tokens_per_layer") or [0]
    method = (stats.get("compression") or {}).get("method", "full")
    reused = stats.get("reused_prompt_tokens")
    return (
        f"prompt {stats.get('prompt_tokens')} tokens, KV kept {kept[0]} per layer ({method}, "
        f"{stats.get('compression_ratio', 1.0):.2f}x), prefill {stats.get('prefill_seconds', 0):.1f} s"
        + (f", reused prefix {reused} tokens" if reused is not None else "")
    )


def cited_answers(context_tokens: int) -> None:
    with tempfile.TemporaryDirectory(prefix="snapkv-llamaindex-") as tmp:
        index_and_ask(tmp, context_tokens)


def index_and_ask(tmp: str, context_tokens: int) -> None:
    documents = hide_file_metadata(SimpleDirectoryReader(str(CORPUS)).load_data())
    storage = StorageContext.from_defaults(vector_store=chroma_vector_store("marrowick", path=tmp))
    index = VectorStoreIndex.from_documents(documents, storage_context=storage, transformations=[SentenceSplitter(chunk_size=200, chunk_overlap=20)])
    print(f"Indexed {len(documents)} documents into a temporary Chroma store ({tmp}, removed at the end)")
    for label, compression in (("full cache", None), ("SnapKV", "snapkv:budget=512,window=question")):
        llm = SnapKVLLM(model="default", compression=compression, max_new_tokens=48)
        budget = TokenBudgetPostprocessor(llm=llm, context_tokens=context_tokens, node_header=CITATION_HEADER)
        engine = CitationQueryEngine.from_args(index, llm=llm, similarity_top_k=20, node_postprocessors=[budget])
        response = engine.query(QUESTION)
        print(f"\n== {label} ==")
        print(str(response).strip())
        cited, invalid = parse_citations(str(response), len(response.source_nodes))
        print(f"  cited by the answer: {cited or 'none'}" + (f" (invalid: {invalid})" if invalid else ""))
        print("  sources, numbered as in the prompt:")
        for number, node in enumerate(response.source_nodes, start=1):
            print(f"  [{number}] {node.node.metadata.get('file_name')} (similarity {node.score:.2f})")
        report = budget.last_report
        print(f"  packed {report['kept']} of {report['candidates']} nodes, {report['used_tokens']} of {report['budget_tokens']} tokens")
        print("  " + describe(LastLLMCall.last))


LOG_LINES = [f"02:{m:02d}:{s:02d} INFO backup: copied chunk {m * 60 + s} of /srv/data to /var/backups (ok)" for m in range(0, 12) for s in range(0, 60, 5)]


def read_log(job: str) -> str:
    """Read the full log of a scheduled job (for example 'nightly')."""
    lines = LOG_LINES[:40] + ["02:13:07 ERROR backup: disk quota exceeded on /var/backups; job aborted"]
    return f"log of job {job}:\n" + "\n".join(lines)


async def agent_session() -> None:
    llm = SnapKVLLM(model="default", compression="snapkv:budget=512,window=question", max_new_tokens=48)
    tool = FunctionTool.from_defaults(fn=read_log)
    agent = FunctionAgent(
        tools=[tool],
        llm=llm,
        system_prompt="You are an operations assistant. Use read_log to read job logs, then answer briefly.",
        initial_tool_choice="read_log",
        allow_parallel_tool_calls=False,  # one call per step: a 135M model otherwise repeats the call
    )
    memory = SnapKVMemory.from_defaults(llm=llm, thread_id="ops", reserve_tokens=400)
    print("\n== FunctionAgent over a long tool output (streamed) ==")
    for question in ("Why did the nightly job fail?", "Which directory ran out of space?"):
        print(f"user: {question}")
        handler = agent.run(question, memory=memory)
        print("agent: ", end="", flush=True)
        async for event in handler.stream_events():
            if isinstance(event, ToolCallResult):
                print(f"[called {event.tool_name}({event.tool_kwargs}) -> {len(str(event.tool_output.content))} chars] ", end="", flush=True)
            elif isinstance(event, AgentStream) and event.delta:
                print(event.delta, end="", flush=True)
        await handler
        print()
        print("  " + describe(LastLLMCall.last))
        view = memory.last_render
        print(f"  memory: {len(memory.get_all())} messages stored, prompt history {view.tokens} tokens, truncated={view.truncated}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context-tokens", type=int, default=1200, help="LLM tokens for the retrieved nodes")
    parser.add_argument("--skip-agent", action="store_true")
    parser.add_argument("--skip-rag", action="store_true")
    args = parser.parse_args()
    Settings.embed_model = default_embed_model()
    Settings.llm = SnapKVLLM(model="default")  # never the OpenAI default
    Settings.tokenizer = Settings.llm.tokenize  # LlamaIndex counts in the LLM's own tokens
    get_dispatcher().add_event_handler(LastLLMCall())
    if not args.skip_rag:
        cited_answers(args.context_tokens)
    if not args.skip_agent:
        asyncio.run(agent_session())


if __name__ == "__main__":
    main()
