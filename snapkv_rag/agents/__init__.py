"""Agent memory: every turn and tool log of a thread kept verbatim on disk, rendered for the engine.

Framework-free core that the LangChain and LlamaIndex connectors wrap::

    from snapkv_rag import Engine
    from snapkv_rag.agents import AgentMemory

    engine = Engine.default()
    memory = AgentMemory("agents.sqlite3")             # mode="drop" | "summarize"
    memory.add_system("t1", "You are a helpful agent.")
    memory.add_user("t1", "What is in the log?")
    view = memory.render_for(engine, "t1", max_new_tokens=256)
    result = engine.generate(view.messages, max_new_tokens=256)
    memory.add_assistant("t1", result.text)
"""

from ..errors import AgentMemoryError, HistoryTooLongError
from .memory import AgentMemory, StoredMessage, ThreadInfo, context_budget
from .messages import ROLES, validate_message
from .window import SUMMARY_PREFIX, RenderedHistory, fit_history, split_turns

__all__ = [
    "AgentMemory",
    "AgentMemoryError",
    "HistoryTooLongError",
    "ROLES",
    "RenderedHistory",
    "SUMMARY_PREFIX",
    "StoredMessage",
    "ThreadInfo",
    "context_budget",
    "fit_history",
    "split_turns",
    "validate_message",
]
