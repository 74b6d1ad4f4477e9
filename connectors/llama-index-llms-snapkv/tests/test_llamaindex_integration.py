"""The connector on the embedded SmolLM2-135M-Instruct, offline: query engines over Chroma with the
local all-MiniLM-L6-v2, CitationQueryEngine with the token-budget postprocessor, and a
FunctionAgent with one tool, streaming and not. Short prompts and few new tokens."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core import Settings, SimpleDirectoryReader, StorageContext, VectorStoreIndex
from llama_index.core.agent.workflow import AgentStream, FunctionAgent, ToolCallResult
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

pytestmark = pytest.mark.integration
QUESTION = "What time does the first ferry leave Marrowick harbour on weekdays?"


@pytest.fixture(scope="module")
def llm(embedded_engine):
    llm = SnapKVLLM(embedded_engine, compression="snapkv:budget=256,window=question", max_new_tokens=24)
    Settings.llm = llm  # never LlamaIndex's OpenAI default
    Settings.embed_model = default_embed_model()
    Settings.tokenizer = llm.tokenize
    return llm


@pytest.fixture(scope="module")
def index(llm, tmp_path_factory, sample_corpus):
    documents = hide_file_metadata(SimpleDirectoryReader(str(sample_corpus)).load_data())
    store = chroma_vector_store("marrowick", path=str(tmp_path_factory.mktemp("chroma")))
    return VectorStoreIndex.from_documents(
        documents,
        storage_context=StorageContext.from_defaults(vector_store=store),
        transformations=[SentenceSplitter(chunk_size=200, chunk_overlap=20)],
        embed_model=Settings.embed_model,
    )


def test_query_engine_answers_with_source_nodes(index, llm):
    response = index.as_query_engine(llm=llm, similarity_top_k=3).query(QUESTION)
    assert str(response).strip()
    assert len(response.source_nodes) == 3
    assert any(n.node.metadata["file_name"] == "harbour-ferry.md" for n in response.source_nodes)
    assert response.source_nodes[0].score > 0.3  # cosine similarities from the local embedder


def test_citation_query_engine_with_the_budget_postprocessor(index, llm):
    budget = TokenBudgetPostprocessor(llm=llm, context_tokens=500, node_header=CITATION_HEADER)
    engine = CitationQueryEngine.from_args(index, llm=llm, similarity_top_k=10, node_postprocessors=[budget])
    response = engine.query(QUESTION)
    report = budget.last_report
    assert 1 <= report["kept"] < report["candidates"] == 10 and report["used_tokens"] <= 500
    assert str(response).strip()
    assert len(response.source_nodes) >= report["kept"]
    for number, node in enumerate(response.source_nodes, start=1):
        text = node.node.get_content()
        assert text.startswith(f"Source {number}:")
        assert "file_path" not in text and "sample_corpus" not in text  # metadata kept out of the LLM text
    assert any(n.node.metadata["file_name"] == "harbour-ferry.md" for n in response.source_nodes)


def magic_function(input: int) -> int:
    """Applies a magic function to an input."""
    return input * 7 + 1


def _agent(llm):
    return FunctionAgent(tools=[FunctionTool.from_defaults(fn=magic_function)], llm=llm, initial_tool_choice="magic_function", allow_parallel_tool_calls=False)


async def _run(agent, question, memory=None):
    handler = agent.run(question, memory=memory)
    calls, deltas = [], []
    async for event in handler.stream_events():
        if isinstance(event, ToolCallResult):
            calls.append(event)
        elif isinstance(event, AgentStream) and event.delta:
            deltas.append(event.delta)
    return await handler, calls, deltas


@pytest.mark.parametrize("streaming", [True, False])
def test_function_agent_calls_its_tool_and_answers(llm, streaming):
    agent_llm = SnapKVLLM(llm.engine, max_new_tokens=40)
    agent = _agent(agent_llm)
    agent.streaming = streaming
    memory = SnapKVMemory.from_defaults(llm=agent_llm, thread_id=f"magic-{streaming}")
    result, calls, deltas = asyncio.run(_run(agent, "What is the value of magic_function(3)?", memory))
    assert [c.tool_name for c in calls][:1] == ["magic_function"]
    assert calls[0].tool_kwargs == {"input": 3} and str(calls[0].tool_output.content) == "22"
    assert "22" in str(result.response.content)
    assert bool(deltas) == streaming
    roles = [m.role.value for m in memory.get_all()]
    assert roles[:3] == ["user", "assistant", "tool"] and roles[-1] == "assistant"


def test_function_agent_with_default_settings_does_not_crash(embedded_engine):
    """Issue 28: FunctionAgent's defaults (parallel tool calls allowed, SnapKVLLM's defaults) on the
    embedded model. SmolLM2 used to write the same call until max_new_tokens ran out and the
    engine raised through the agent; whatever the model decides now, the run ends cleanly."""

    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    agent = FunctionAgent(tools=[multiply], llm=SnapKVLLM(embedded_engine))

    async def run():
        return await agent.run("What is 12 times 7? Use the tool.")

    result = asyncio.run(run())
    assert str(result.response.content).strip() or result.tool_calls
    for call in result.tool_calls:
        assert call.tool_name == "multiply" and not call.tool_output.is_error


def test_agent_workflow_over_a_long_history_reuses_each_turns_prefix(embedded_engine, tmp_path):
    """Issue 28: the long-history example (examples/long_log_agent.py), 3 turns on the embedded model."""
    import importlib.util
    from pathlib import Path

    example_path = Path(__file__).resolve().parents[1] / "examples" / "long_log_agent.py"
    spec = importlib.util.spec_from_file_location("llamaindex_long_log_agent_embedded", example_path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    llm = SnapKVLLM(embedded_engine, max_new_tokens=40, compression="snapkv:budget=512")
    memory = SnapKVMemory.from_defaults(llm=llm, path=str(tmp_path / "agent.sqlite3"), thread_id="long-log")
    rows = asyncio.run(example.run_session(llm, memory, turns=3, echo=lambda *_: None))
    calls = [r["tool_call"] for r in rows if r["tool_call"]]
    assert calls == [{"name": "read_log", "args": {"part": 1}}, {"name": "read_log", "args": {"part": 2}}]  # the model's arguments
    tool_logs = [str(m.content) for m in memory.get_all() if m.role.value == "tool"]
    assert tool_logs == [example.read_log(1), example.read_log(2)]
    assert all(r["reused_prompt_tokens"] > 0.5 * r["prompt_tokens"] for r in rows if r["turn"] > 1)
