"""Persistent, per-thread agent memory in SQLite: every turn and tool log kept verbatim.

One database file holds any number of threads. Each connection runs in WAL mode with a busy
timeout, and every write is one ``BEGIN IMMEDIATE`` transaction, so several threads and
processes may append to the same file (and the same thread) at once: each append gets the
next position in its thread, atomically, and readers never block writers. A file database
survives restarts; ``":memory:"`` gives a private in-process one (one connection behind a
lock) for tests and throwaway agents.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import AgentMemoryError, InvalidPromptError
from ..reuse.offered import offer_segments
from .messages import validate_message
from .window import SUMMARY_PREFIX, CostCache, CountTokens, RenderedHistory, Summarizer, check_settings, fit_history

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS threads (
    thread_id  TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    thread_id    TEXT NOT NULL REFERENCES threads(thread_id) ON DELETE CASCADE,
    seq          INTEGER NOT NULL,
    role         TEXT NOT NULL,
    content      TEXT NOT NULL,
    tool_calls   TEXT,
    tool_call_id TEXT,
    name         TEXT,
    metadata     TEXT,
    created_at   REAL NOT NULL,
    PRIMARY KEY (thread_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tool_calls (
    thread_id TEXT NOT NULL REFERENCES threads(thread_id) ON DELETE CASCADE,
    call_id   TEXT NOT NULL,
    seq       INTEGER NOT NULL,
    name      TEXT NOT NULL,
    PRIMARY KEY (thread_id, call_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS summaries (
    thread_id TEXT NOT NULL REFERENCES threads(thread_id) ON DELETE CASCADE,
    upto      INTEGER NOT NULL,
    content   TEXT NOT NULL,
    PRIMARY KEY (thread_id, upto)
) WITHOUT ROWID;
"""


@dataclass(frozen=True)
class StoredMessage:
    """One stored message: its position in the thread, the message, metadata and time."""

    thread_id: str
    seq: int
    message: dict[str, Any]
    metadata: dict[str, Any] | None
    created_at: float


@dataclass(frozen=True)
class ThreadInfo:
    thread_id: str
    messages: int
    created_at: float
    updated_at: float


def context_budget(engine: Any, *, max_new_tokens: int = 256, reserve: int = 0) -> int | None:
    """``engine.context_length - max_new_tokens - reserve`` (``None`` when the context is unknown).

    ``reserve`` covers prompt tokens the messages do not account for, such as tool
    specifications the engine renders into the prompt.
    """
    if max_new_tokens < 0 or reserve < 0:
        raise AgentMemoryError("max_new_tokens and reserve must be non-negative")
    context = getattr(engine, "context_length", None)
    if context is None:
        return None
    budget = int(context) - max_new_tokens - reserve
    if budget <= 0:
        raise AgentMemoryError(f"no room for history: context {context} - max_new_tokens {max_new_tokens} - reserve {reserve} = {budget}")
    return budget


def _thread(thread_id: Any) -> str:
    if not isinstance(thread_id, str) or not thread_id:
        raise AgentMemoryError(f"thread_id must be a non-empty string, got {thread_id!r}")
    return thread_id


class _SqlSummaries:
    """The window's summary cache, stored per thread so a cut renders the same summary after restart."""

    def __init__(self, memory: AgentMemory, thread_id: str):
        self.memory, self.thread_id = memory, thread_id

    def get(self, upto: int) -> str | None:
        with self.memory._read() as db:
            row = db.execute("SELECT content FROM summaries WHERE thread_id=? AND upto=?", (self.thread_id, upto)).fetchone()
        return row[0] if row else None

    def latest_before(self, upto: int) -> tuple[int, str] | None:
        with self.memory._read() as db:
            row = db.execute(
                "SELECT upto, content FROM summaries WHERE thread_id=? AND upto<? ORDER BY upto DESC LIMIT 1",
                (self.thread_id, upto),
            ).fetchone()
        return (row[0], row[1]) if row else None

    def put(self, upto: int, text: str) -> None:
        with self.memory._write() as db:
            if db.execute("SELECT 1 FROM threads WHERE thread_id=?", (self.thread_id,)).fetchone():
                # First writer wins, so concurrent renderers agree on one summary per cut.
                db.execute(
                    "INSERT OR IGNORE INTO summaries(thread_id, upto, content) VALUES (?, ?, ?)",
                    (self.thread_id, upto, text),
                )


class AgentMemory:
    """Every turn of every thread, verbatim, in one SQLite file; renders a thread for the engine.

    ``mode`` decides what happens when a thread no longer fits the budget: ``"drop"`` leaves
    out the oldest whole turns, ``"summarize"`` replaces them with ``summarizer(messages) -> str``
    (cached per cut). ``block_fraction`` sizes the blocks the cut moves by (see
    :mod:`snapkv_rag.agents.window`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mode: str = "drop",
        summarizer: Summarizer | None = None,
        block_fraction: float = 0.25,
        summary_prefix: str = SUMMARY_PREFIX,
        timeout_s: float = 30.0,
    ):
        check_settings(mode, summarizer, block_fraction)
        self.mode, self.summarizer, self.block_fraction = mode, summarizer, block_fraction
        self.summary_prefix = summary_prefix
        self.timeout_s = timeout_s
        self._costs = CostCache()
        self._local = threading.local()
        self._all: list[tuple[int, sqlite3.Connection]] = []
        self._guard = threading.Lock()
        self._closed = False
        self.path = str(path)
        self._memory = self.path == ":memory:"
        if not self._memory:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._shared: sqlite3.Connection | None = self._connect() if self._memory else None
        self._shared_lock = threading.RLock()
        with self._write() as db:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise AgentMemoryError(f"{self.path} has agent-memory schema {version}; this version reads {SCHEMA_VERSION}")
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    # ------------------------------------------------------------------ connections
    def _connect(self) -> sqlite3.Connection:
        if self._closed:
            raise AgentMemoryError("this AgentMemory is closed")
        db = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None, check_same_thread=False)
        db.execute(f"PRAGMA busy_timeout={int(self.timeout_s * 1000)}")
        if not self._memory:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA foreign_keys=ON")
        with self._guard:
            self._all.append((os.getpid(), db))
        return db

    @contextmanager
    def _conn(self) -> Iterator[sqlite3.Connection]:
        if self._closed:
            raise AgentMemoryError("this AgentMemory is closed")
        if self._shared is not None:
            with self._shared_lock:
                yield self._shared
            return
        db = getattr(self._local, "db", None)
        if db is None or self._local.pid != os.getpid():  # never reuse a connection across fork
            db = self._local.db = self._connect()
            self._local.pid = os.getpid()
        yield db

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._conn() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._conn() as db:
            db.execute("BEGIN")
            try:
                yield db
            finally:
                db.execute("COMMIT")

    def close(self) -> None:
        """Close every connection this object opened in this process (from any thread)."""
        with self._guard:
            self._closed = True
            for pid, db in self._all:
                if pid == os.getpid():  # a forked child leaves its parent's connections alone
                    db.close()
            self._all.clear()

    def __enter__(self) -> AgentMemory:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ writing
    def append(self, thread_id: str, messages: dict[str, Any] | Sequence[dict[str, Any]]) -> list[int]:
        """Append one message or a list of them to a thread (created on first use), atomically.

        Returns their positions in the thread. A tool message must answer a tool call made
        earlier in the thread (or earlier in the same list), and tool call ids must be unique
        within a thread; its ``name`` defaults to the called function's name. Raises
        :class:`InvalidPromptError` on any bad message, writing none of them.
        """
        thread_id = _thread(thread_id)
        if isinstance(messages, dict):
            messages = [messages]
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise InvalidPromptError("append takes a message mapping or a list of them")
        checked = [validate_message(m, i) for i, m in enumerate(messages)]
        if not checked:
            return []
        now = time.time()
        with self._write() as db:
            db.execute(
                "INSERT INTO threads(thread_id, created_at, updated_at) VALUES (?, ?, ?) ON CONFLICT(thread_id) DO UPDATE SET updated_at=excluded.updated_at",
                (thread_id, now, now),
            )
            (seq,) = db.execute("SELECT COALESCE(MAX(seq) + 1, 0) FROM messages WHERE thread_id=?", (thread_id,)).fetchone()
            positions = []
            for i, (msg, metadata) in enumerate(checked):
                if msg["role"] == "tool":
                    row = db.execute("SELECT name FROM tool_calls WHERE thread_id=? AND call_id=?", (thread_id, msg["tool_call_id"])).fetchone()
                    if row is None:
                        raise InvalidPromptError(f"message {i}: tool_call_id {msg['tool_call_id']!r} answers no tool call in thread {thread_id!r}")
                    msg.setdefault("name", row[0])
                for call in msg.get("tool_calls", ()):
                    try:
                        db.execute(
                            "INSERT INTO tool_calls(thread_id, call_id, seq, name) VALUES (?, ?, ?, ?)",
                            (thread_id, call["id"], seq, call["function"]["name"]),
                        )
                    except sqlite3.IntegrityError:
                        raise InvalidPromptError(f"message {i}: tool call id {call['id']!r} is already used in thread {thread_id!r}") from None
                db.execute(
                    "INSERT INTO messages(thread_id, seq, role, content, tool_calls, tool_call_id, name, metadata, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        thread_id,
                        seq,
                        msg["role"],
                        msg["content"],
                        json.dumps(msg["tool_calls"], ensure_ascii=False) if "tool_calls" in msg else None,
                        msg.get("tool_call_id"),
                        msg.get("name"),
                        json.dumps(metadata, ensure_ascii=False) if metadata is not None else None,
                        now,
                    ),
                )
                positions.append(seq)
                seq += 1
        return positions

    def add_system(self, thread_id: str, content: str, **extra: Any) -> int:
        return self.append(thread_id, {"role": "system", "content": content, **extra})[0]

    def add_user(self, thread_id: str, content: str, **extra: Any) -> int:
        return self.append(thread_id, {"role": "user", "content": content, **extra})[0]

    def add_assistant(self, thread_id: str, content: str | None = "", *, tool_calls: Sequence[dict] | None = None, **extra: Any) -> int:
        msg: dict[str, Any] = {"role": "assistant", "content": content, **extra}
        if tool_calls:
            msg["tool_calls"] = list(tool_calls)
        return self.append(thread_id, msg)[0]

    def add_tool_result(self, thread_id: str, tool_call_id: str, content: str, *, name: str | None = None, **extra: Any) -> int:
        msg = {"role": "tool", "content": content, "tool_call_id": tool_call_id, **extra}
        if name is not None:
            msg["name"] = name
        return self.append(thread_id, msg)[0]

    # ------------------------------------------------------------------ reading
    def history(self, thread_id: str) -> list[StoredMessage]:
        """Every stored message of a thread in order (empty for an unknown thread)."""
        thread_id = _thread(thread_id)
        with self._read() as db:
            rows = db.execute(
                "SELECT seq, role, content, tool_calls, tool_call_id, name, metadata, created_at FROM messages WHERE thread_id=? ORDER BY seq",
                (thread_id,),
            ).fetchall()
        out = []
        for seq, role, content, tool_calls, tool_call_id, name, metadata, created in rows:
            msg: dict[str, Any] = {"role": role, "content": content}
            if tool_calls is not None:
                msg["tool_calls"] = json.loads(tool_calls)
            if tool_call_id is not None:
                msg["tool_call_id"] = tool_call_id
            if name is not None:
                msg["name"] = name
            out.append(StoredMessage(thread_id, seq, msg, json.loads(metadata) if metadata else None, created))
        return out

    def messages(self, thread_id: str) -> list[dict[str, Any]]:
        """The thread's messages, verbatim, in the engine's message shape."""
        return [m.message for m in self.history(thread_id)]

    def threads(self) -> list[ThreadInfo]:
        """Every thread, most recently updated first."""
        with self._read() as db:
            rows = db.execute(
                "SELECT t.thread_id, COUNT(m.seq), t.created_at, t.updated_at FROM threads t "
                "LEFT JOIN messages m ON m.thread_id = t.thread_id GROUP BY t.thread_id "
                "ORDER BY t.updated_at DESC, t.thread_id"
            ).fetchall()
        return [ThreadInfo(*row) for row in rows]

    def delete_thread(self, thread_id: str) -> bool:
        """Delete a thread, its messages and its summaries; ``False`` when it did not exist."""
        thread_id = _thread(thread_id)
        with self._write() as db:
            for table in ("summaries", "tool_calls", "messages"):
                db.execute(f"DELETE FROM {table} WHERE thread_id=?", (thread_id,))
            return db.execute("DELETE FROM threads WHERE thread_id=?", (thread_id,)).rowcount > 0

    # ------------------------------------------------------------------ rendering
    def render(
        self,
        thread_id: str,
        *,
        count_tokens: CountTokens | None = None,
        budget: int | None = None,
        summary_reserve: int | None = None,
    ) -> RenderedHistory:
        """The thread as engine messages, fitted into ``budget`` tokens by ``count_tokens``.

        Without a budget every message is rendered. See :mod:`snapkv_rag.agents.window` for
        what is dropped or summarised, and where the cut lands.
        """
        thread_id = _thread(thread_id)
        rendered = fit_history(
            self.messages(thread_id),
            count_tokens=count_tokens,
            budget=budget,
            mode=self.mode,
            summarizer=self.summarizer,
            block_fraction=self.block_fraction,
            summary_prefix=self.summary_prefix,
            summary_reserve=summary_reserve,
            summaries=_SqlSummaries(self, thread_id),
            costs=self._costs,
        )
        # long tool logs are reusable segments: kv_reuse="chunks" reuses their K/V at any position
        offer_segments(m["content"] for m in rendered.messages if m["role"] == "tool" and isinstance(m.get("content"), str))
        return rendered

    def render_for(self, engine: Any, thread_id: str, *, max_new_tokens: int = 256, reserve: int = 0) -> RenderedHistory:
        """:meth:`render` with ``engine.count_tokens`` and ``context_budget(engine, ...)``."""
        return self.render(
            thread_id,
            count_tokens=engine.count_tokens,
            budget=context_budget(engine, max_new_tokens=max_new_tokens, reserve=reserve),
        )
