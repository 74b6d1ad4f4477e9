"""The token-budget postprocessor and SnapKVMemory on the tiny test model."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.base.llms.types import ChatMessage, TextBlock, ToolCallBlock
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.llms.snapkv import SnapKVLLM, SnapKVMemory, TokenBudgetPostprocessor
from llama_index.llms.snapkv.postprocessor import CITATION_HEADER

from snapkv_rag.agents import AgentMemory
from snapkv_rag.rag.stuffing import ContextBudgetError


@pytest.fixture(scope="module")
def llm(engine):
    return SnapKVLLM(engine, max_new_tokens=16)


def nodes(texts, **metadata):
    return [
        NodeWithScore(node=TextNode(text=t, metadata=dict(metadata), excluded_llm_metadata_keys=list(metadata)), score=1 - i / 10) for i, t in enumerate(texts)
    ]


TEXTS = ["hello world " * 10, "the fox " * 40, "paris " * 5, "engine " * 8]


def test_packs_in_rank_order_within_the_budget_counted_in_llm_tokens(llm):
    cost = [llm.count_tokens("\n\n" + t) for t in TEXTS]
    budget = cost[0] + cost[2] + cost[3]
    pp = TokenBudgetPostprocessor(llm=llm, context_tokens=budget)
    kept = pp.postprocess_nodes(nodes(TEXTS, file_path="/x/y.md"), query_str="q")
    assert [n.node.text for n in kept] == [TEXTS[0], TEXTS[2], TEXTS[3]]
    assert pp.last_report == {"candidates": 4, "kept": 3, "left_out": 1, "budget_tokens": budget, "used_tokens": budget, "left_out_tokens": cost[1]}


def test_headers_and_metadata_mode_count(llm):
    with_header = TokenBudgetPostprocessor(llm=llm, context_tokens=10_000, node_header=CITATION_HEADER)
    with_header.postprocess_nodes(nodes(TEXTS[:2]), query_str="q")
    plain = TokenBudgetPostprocessor(llm=llm, context_tokens=10_000)
    plain.postprocess_nodes(nodes(TEXTS[:2]), query_str="q")
    assert with_header.last_report["used_tokens"] > plain.last_report["used_tokens"]
    # excluded_llm_metadata_keys keep the file path out of what is counted (and sent)
    shown = [NodeWithScore(node=TextNode(text=TEXTS[2], metadata={"file_path": "/a/long/path/to/a/file.md"}), score=1.0)]
    plain.postprocess_nodes(shown, query_str="q")
    assert plain.last_report["used_tokens"] > llm.count_tokens("\n\n" + TEXTS[2])


def test_default_budget_is_what_the_llm_leaves(llm):
    pp = TokenBudgetPostprocessor(llm=llm, reserve_tokens=100)
    assert pp.budget("paris") == 512 - 16 - 100 - llm.count_tokens("paris")
    with pytest.raises(ContextBudgetError):
        TokenBudgetPostprocessor(llm=llm, reserve_tokens=600).postprocess_nodes(nodes(TEXTS), QueryBundle("q"))
    assert asyncio.run(pp.apostprocess_nodes(nodes(TEXTS), query_str="q")) and pp.last_report["kept"] == 4


def test_memory_round_trips_tool_calls_and_keeps_tool_output_whole(llm):
    memory = SnapKVMemory.from_defaults(llm=llm, thread_id="t1")
    long_output = "log line " * 60
    memory.put(ChatMessage(role="user", content="read the log"))
    memory.put_messages(
        [
            ChatMessage(role="assistant", blocks=[TextBlock(text=""), ToolCallBlock(tool_call_id="c1", tool_name="read_log", tool_kwargs={"job": "nightly"})]),
            ChatMessage(role="tool", content=long_output, additional_kwargs={"tool_call_id": "c1"}),
            ChatMessage(role="assistant", content="It failed."),
        ]
    )
    got = memory.get()
    assert [m.role.value for m in got] == ["user", "assistant", "tool", "assistant"]
    (call,) = [b for b in got[1].blocks if isinstance(b, ToolCallBlock)]
    assert call.tool_name == "read_log" and call.tool_kwargs == {"job": "nightly"} and call.tool_call_id == "c1"
    assert got[2].content == long_output and got[2].additional_kwargs["tool_call_id"] == "c1"
    assert memory.last_render.truncated is False and memory.get_all()[2].content == long_output
    assert [m.role.value for m in asyncio.run(memory.aget())] == ["user", "assistant", "tool", "assistant"]


def test_memory_drops_whole_old_turns_when_the_thread_outgrows_the_budget(llm):
    memory = SnapKVMemory.from_defaults(llm=llm, memory=AgentMemory(":memory:"), thread_id="t2")
    for i in range(12):
        memory.put(ChatMessage(role="user", content=f"question {i} " + "fox " * 20))
        memory.put(ChatMessage(role="assistant", content=f"answer {i} " + "dog " * 20))
    got = memory.get()
    assert memory.last_render.truncated and memory.last_render.dropped_turns > 0
    assert got[-1].content.startswith("answer 11") and got[0].role.value == "user"
    assert llm.engine.count_tokens([{"role": m.role.value, "content": m.content} for m in got]) <= 512 - 16
    assert len(memory.get_all()) == 24  # nothing is deleted from storage
    memory.set([ChatMessage(role="user", content="fresh")])
    assert [m.content for m in memory.get_all()] == ["fresh"]
    memory.reset()
    assert memory.get_all() == []


def test_in_a_retriever_query_engine(tokenizer):
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.query_engine import RetrieverQueryEngine
    from snapkv_root_conftest import tiny_engine

    class Fixed(BaseRetriever):
        def _retrieve(self, query_bundle):
            return nodes(TEXTS)

    llm = SnapKVLLM(tiny_engine("llama", tokenizer, context=4096), max_new_tokens=4)
    budget = sum(llm.count_tokens("\n\n" + TEXTS[i]) for i in (0, 2, 3))
    pp = TokenBudgetPostprocessor(llm=llm, context_tokens=budget)
    engine = RetrieverQueryEngine.from_args(Fixed(), llm=llm, node_postprocessors=[pp])
    response = engine.query("where is the fox?")
    assert [n.node.text for n in response.source_nodes] == [TEXTS[0], TEXTS[2], TEXTS[3]]
    assert pp.last_report["kept"] == 3 and isinstance(response.response, str)


def test_memory_renders_append_only_so_the_prefix_cache_is_reused(llm):
    memory = SnapKVMemory.from_defaults(llm=llm, thread_id="t3")
    memory.put(ChatMessage(role="user", content="the fox " * 30))
    first = llm.chat(memory.get(), max_new_tokens=2)
    memory.put_messages([first.message, ChatMessage(role="user", content="and the dog?")])
    second = llm.chat(memory.get(), max_new_tokens=2)
    assert second.additional_kwargs["reused_prompt_tokens"] > 0
    assert second.additional_kwargs["reused_prompt_tokens"] >= first.additional_kwargs["prompt_tokens"] - 1 - 32


def test_query_engine_reuses_the_kept_nodes_kv_in_any_order(tokenizer):
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.query_engine import RetrieverQueryEngine
    from snapkv_root_conftest import tiny_engine

    texts = [f"Report {i}: the {w} opened in {1900 + i} and keeps its records in hall {i}." * 2 for i, w in enumerate(["ferry", "museum", "tram"])]
    order = [texts]

    class Fixed(BaseRetriever):
        def _retrieve(self, query_bundle):
            return nodes(order[0])

    engine = tiny_engine("llama", tokenizer, context=4096)
    llm = SnapKVLLM(engine, max_new_tokens=2)
    query_engine = RetrieverQueryEngine.from_args(Fixed(), llm=llm, node_postprocessors=[TokenBudgetPostprocessor(llm=llm, context_tokens=2000)])
    query_engine.query("when did the tram open?")
    assert (engine.segment_store.stats.hits, engine.segment_store.stats.misses) == (0, 3)
    order[0] = texts[::-1]
    query_engine.query("when did the museum open?")
    assert (engine.segment_store.stats.hits, engine.segment_store.stats.misses) == (3, 3)
    off = SnapKVLLM(engine, max_new_tokens=2, kv_reuse="off")
    RetrieverQueryEngine.from_args(Fixed(), llm=off, node_postprocessors=[TokenBudgetPostprocessor(llm=off, context_tokens=2000)]).query("and the ferry?")
    assert engine.segment_store.stats.hits == 3
    with pytest.raises(ValueError, match="kv_reuse"):
        SnapKVLLM(engine, kv_reuse="sometimes")
