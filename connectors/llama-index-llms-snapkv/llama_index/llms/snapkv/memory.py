"""``SnapKVMemory``: a LlamaIndex memory backed by :class:`snapkv_rag.agents.AgentMemory`.

Every message (tool outputs included) is stored whole in SQLite; ``get()`` renders the
thread append-only, so consecutive agent prompts share their token prefix (the engine's
prefix cache reuses it) and only when the thread outgrows the LLM's budget are the oldest
whole turns dropped or summarised, never shortened.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.memory.types import BaseMemory

from snapkv_rag.integrations import AgentMemory, RenderedHistory

from .messages import from_engine_message, to_engine_message


class SnapKVMemory(BaseMemory):
    """Chat history of one thread of an :class:`AgentMemory`, rendered to fit the LLM.

    ``SnapKVMemory.from_defaults(llm=SnapKVLLM(...), path="agents.sqlite3", thread_id="t1")``.
    ``reserve_tokens``: prompt tokens the memory does not hold (the agent's system prompt and
    tool specs). ``last_render`` is the latest :class:`RenderedHistory` (tokens, truncated,
    dropped turns).
    """

    thread_id: str = Field(default="default")
    max_new_tokens: int = Field(default=256, ge=0)
    reserve_tokens: int = Field(default=0, ge=0)

    _store: AgentMemory = PrivateAttr()
    _engine: Any = PrivateAttr(default=None)
    _last: RenderedHistory | None = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "SnapKVMemory"

    @classmethod
    def from_defaults(
        cls,
        llm: Any = None,
        *,
        engine: Any = None,
        memory: AgentMemory | None = None,
        path: str = ":memory:",
        thread_id: str = "default",
        mode: str = "drop",
        summarizer: Any = None,
        max_new_tokens: int | None = None,
        reserve_tokens: int = 0,
        **kwargs: Any,
    ) -> SnapKVMemory:
        """``llm`` (a SnapKVLLM) or ``engine`` sets the token budget; without either, nothing is cut."""
        if engine is None and llm is not None:
            engine = llm.engine
        if max_new_tokens is None:
            max_new_tokens = getattr(llm, "max_new_tokens", 256)
        out = cls(thread_id=thread_id, max_new_tokens=max_new_tokens, reserve_tokens=reserve_tokens, **kwargs)
        out._store = memory if memory is not None else AgentMemory(path, mode=mode, summarizer=summarizer)
        out._engine = engine
        return out

    @property
    def agent_memory(self) -> AgentMemory:
        return self._store

    @property
    def last_render(self) -> RenderedHistory | None:
        return self._last

    def get(self, input: str | None = None, **kwargs: Any) -> list[ChatMessage]:
        if self._engine is None:
            self._last = self._store.render(self.thread_id)
        else:
            self._last = self._store.render_for(self._engine, self.thread_id, max_new_tokens=self.max_new_tokens, reserve=self.reserve_tokens)
        return [from_engine_message(m) for m in self._last.messages]

    def get_all(self) -> list[ChatMessage]:
        return [from_engine_message(m) for m in self._store.messages(self.thread_id)]

    def put(self, message: ChatMessage) -> None:
        self.put_messages([message])

    def put_messages(self, messages: list[ChatMessage]) -> None:
        if messages:
            self._store.append(self.thread_id, [to_engine_message(m, i) for i, m in enumerate(messages)])

    def set(self, messages: list[ChatMessage]) -> None:
        self._store.delete_thread(self.thread_id)
        self.put_messages(messages)

    def reset(self) -> None:
        self._store.delete_thread(self.thread_id)
