"""LangChain chat history backed by the core agent memory (:class:`snapkv_rag.agents.AgentMemory`).

Every message of a thread, tool calls and long tool logs included, is kept verbatim in
SQLite (nothing is dropped on disk). :meth:`SnapKVChatMessageHistory.fitted_messages`
renders what fits the model's context through the core's block-stable history fitting, so
consecutive turns share a long prompt prefix and the engine's prefix cache reuses it.

With ``langchain.agents.create_agent``::

    history = SnapKVChatMessageHistory(AgentMemory("agent.sqlite3"), "thread-1")
    before = history.fitted_messages(llm.client)
    state = agent.invoke({"messages": [*before, HumanMessage(question)]})
    history.add_messages(state["messages"][len(before):])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.chat_history import BaseChatMessageHistory
from langchain_core.messages import BaseMessage

from snapkv_rag.integrations import AgentMemory

from .chat_models import from_engine_messages, to_engine_messages


class SnapKVChatMessageHistory(BaseChatMessageHistory):
    """One thread of an :class:`AgentMemory` as a LangChain ``BaseChatMessageHistory``."""

    def __init__(self, memory: AgentMemory | str, thread_id: str):
        self.memory = memory if isinstance(memory, AgentMemory) else AgentMemory(memory)
        self.thread_id = thread_id

    @property
    def messages(self) -> list[BaseMessage]:  # type: ignore[override]
        """Every stored message, verbatim."""
        return from_engine_messages(self.memory.messages(self.thread_id))

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        if messages:
            self.memory.append(self.thread_id, to_engine_messages(list(messages)))

    def clear(self) -> None:
        self.memory.delete_thread(self.thread_id)

    def fitted_messages(self, engine: Any, *, max_new_tokens: int = 256, reserve: int = 0) -> list[BaseMessage]:
        """The thread as it fits ``engine``'s context (the memory's drop/summarize mode decides what goes)."""
        stored = self.memory.messages(self.thread_id)
        if not any(m["role"] != "system" for m in stored):
            return from_engine_messages(stored)  # a new thread: nothing to fit (the core counts only renderable prompts)
        view = self.memory.render_for(engine, self.thread_id, max_new_tokens=max_new_tokens, reserve=reserve)
        return from_engine_messages(view.messages)
