"""Agent memory storage: persistence, per-thread isolation, concurrent writers, bad input (no model)."""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading

import pytest

from snapkv_rag.agents import AgentMemory
from snapkv_rag.errors import AgentMemoryError, InvalidPromptError, SnapKVRagError


def call(call_id: str, name: str = "read_log", arguments='{"path": "/var/log/app"}') -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def agent_turn(memory: AgentMemory, thread: str, k: int, log: str = "line\n" * 3) -> None:
    memory.add_user(thread, f"question {k}")
    memory.add_assistant(thread, None, tool_calls=[call(f"c{k}")])
    memory.add_tool_result(thread, f"c{k}", f"{log}end of log {k}")
    memory.add_assistant(thread, f"answer {k}")


def test_persists_across_reopen(tmp_path):
    path = tmp_path / "sub" / "agents.sqlite3"  # the parent folder is created
    with AgentMemory(path) as memory:
        memory.add_system("t", "You are an agent.")
        agent_turn(memory, "t", 0)
        before = memory.messages("t")
        history = memory.history("t")
    reopened = AgentMemory(path)
    assert reopened.messages("t") == before
    assert [m.seq for m in reopened.history("t")] == [0, 1, 2, 3, 4]
    assert [m.created_at for m in reopened.history("t")] == [m.created_at for m in history]
    assert before[2] == {"role": "assistant", "content": "", "tool_calls": [call("c0")]}
    assert before[3] == {"role": "tool", "content": "line\nline\nline\nend of log 0", "tool_call_id": "c0", "name": "read_log"}
    # appending after a restart continues the thread (and still knows its tool calls)
    agent_turn(reopened, "t", 1)
    assert [m.seq for m in reopened.history("t")][-1] == 8
    with pytest.raises(InvalidPromptError, match="already used"):
        reopened.add_assistant("t", "", tool_calls=[call("c0")])
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    reopened.close()
    with pytest.raises(AgentMemoryError, match="closed"):
        reopened.messages("t")


def test_messages_are_stored_verbatim_including_huge_tool_logs(tmp_path):
    memory = AgentMemory(tmp_path / "m.db")
    log = "".join(f"{i:06d} GET /api/items/{i} 200 {i % 97}ms\n" for i in range(12000))  # ~400K chars
    unicode = "naïve café ✓ 你好 \x00 trailing  "
    memory.add_user("t", unicode, metadata={"source": "cli", "n": [1, 2]})
    memory.add_assistant("t", "", tool_calls=[call("big", "tail", {"lines": 12000, "nested": {"a": [1, "x"]}})])
    memory.add_tool_result("t", "big", log, name="tail_alias")
    stored = memory.history("t")
    assert stored[0].message == {"role": "user", "content": unicode}
    assert stored[0].metadata == {"source": "cli", "n": [1, 2]}
    assert stored[1].message["tool_calls"][0]["function"]["arguments"] == {"lines": 12000, "nested": {"a": [1, "x"]}}
    assert stored[2].message == {"role": "tool", "content": log, "tool_call_id": "big", "name": "tail_alias"}
    assert memory.render("t").messages[2]["content"] == log  # rendered whole too


def test_threads_are_isolated_listed_and_deleted(tmp_path):
    memory = AgentMemory(tmp_path / "m.db")
    agent_turn(memory, "alpha", 0)
    memory.add_user("beta", "hello beta")
    assert [m["content"] for m in memory.messages("beta")] == ["hello beta"]
    assert len(memory.messages("alpha")) == 4
    assert memory.messages("nobody") == []
    with pytest.raises(InvalidPromptError, match="answers no tool call"):
        memory.add_tool_result("beta", "c0", "a result for alpha's call")
    memory.add_assistant("beta", None, tool_calls=[call("c0")])  # ids are per thread
    info = {t.thread_id: t.messages for t in memory.threads()}
    assert info == {"alpha": 4, "beta": 2}
    assert memory.threads()[0].thread_id == "beta"  # most recently updated first
    assert memory.delete_thread("alpha") is True
    assert memory.delete_thread("alpha") is False
    assert [t.thread_id for t in memory.threads()] == ["beta"]
    assert memory.messages("alpha") == []
    agent_turn(memory, "alpha", 0)  # a deleted id starts afresh, its call ids free again
    assert [m.seq for m in memory.history("alpha")] == [0, 1, 2, 3]


def test_in_memory_database(tmp_path):
    memory = AgentMemory(":memory:")
    agent_turn(memory, "t", 0)
    assert len(memory.messages("t")) == 4


def _writer(path: str, name: str, count: int) -> None:
    memory = AgentMemory(path)
    for i in range(count):
        memory.append(
            name.split("/")[0],
            [
                {"role": "user", "content": f"{name} {i}"},
                {"role": "assistant", "content": f"{name} reply {i}"},
            ],
        )
    memory.close()


def _check_writers(memory: AgentMemory, thread: str, writers: list[str], count: int) -> None:
    history = memory.history(thread)
    assert [m.seq for m in history] == list(range(2 * count * len(writers)))
    for w in writers:
        mine = [m.message["content"] for m in history if m.message["content"].startswith(w + " ")]
        assert mine == [f"{w} {i // 2}" if i % 2 == 0 else f"{w} reply {i // 2}" for i in range(2 * count)]
    for a, b in zip(history[::2], history[1::2]):  # each append's two messages stay adjacent
        writer, i = a.message["content"].rsplit(" ", 1)
        assert b.message["content"] == f"{writer} reply {i}"


def test_concurrent_writers_threads_and_processes(tmp_path):
    path = str(tmp_path / "shared.db")
    memory = AgentMemory(path)
    # threads sharing one AgentMemory object (one connection per thread) and threads with their own
    shared_writers = [f"shared/t{i}" for i in range(4)]
    own_writers = [f"shared/o{i}" for i in range(4)]
    threads = [
        threading.Thread(
            target=lambda n=n: [
                memory.append("shared", [{"role": "user", "content": f"{n} {i}"}, {"role": "assistant", "content": f"{n} reply {i}"}]) for i in range(20)
            ]
        )
        for n in shared_writers
    ]
    threads += [threading.Thread(target=_writer, args=(path, n, 20)) for n in own_writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _check_writers(memory, "shared", shared_writers + own_writers, 20)

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, f"procs/p{i}", 15)) for i in range(2)]
    # a child that keeps using the parent's object opens its own connection after the fork
    procs.append(
        ctx.Process(
            target=lambda: [
                memory.append("procs", [{"role": "user", "content": f"procs/p2 {i}"}, {"role": "assistant", "content": f"procs/p2 reply {i}"}])
                for i in range(15)
            ]
        )
    )
    for p in procs:
        p.start()
    for i in range(15):
        memory.append("procs", [{"role": "user", "content": f"procs/main {i}"}, {"role": "assistant", "content": f"procs/main reply {i}"}])
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    _check_writers(memory, "procs", [f"procs/p{i}" for i in range(3)] + ["procs/main"], 15)


@pytest.mark.parametrize(
    "message, match",
    [
        ({"role": "robot", "content": "x"}, "role 'robot'"),
        ({"content": "x"}, "role None"),
        ({"role": "user", "content": 42}, "content must be a string, got int"),
        ({"role": "user", "content": b"bytes"}, "content must be a string, got bytes"),
        ({"role": "user", "content": [{"type": "text", "text": "x"}]}, "content must be a string, got list"),
        ({"role": "user"}, "content must be a string, got NoneType"),
        ({"role": "user", "content": "x", "colour": "red"}, "unknown keys"),
        ({"role": "user", "content": "x", "tool_calls": [call("a")]}, "only assistant"),
        ({"role": "tool", "content": "x"}, "needs tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "a"}, "only tool messages"),
        ({"role": "assistant", "content": "", "tool_calls": [{"id": "", "function": {"name": "f"}}]}, "id must be"),
        ({"role": "assistant", "content": "", "tool_calls": [{"id": "a", "type": "web", "function": {"name": "f"}}]}, "type must be"),
        ({"role": "assistant", "content": "", "tool_calls": [{"id": "a", "function": {"arguments": "{}"}}]}, "name must be"),
        ({"role": "assistant", "content": "", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": 3}}]}, "arguments must be"),
        ({"role": "assistant", "content": "", "tool_calls": [call("a"), call("a")]}, "repeat"),
        ({"role": "assistant", "content": "", "tool_calls": "call()"}, "must be a list"),
        ({"role": "user", "content": "x", "metadata": "m"}, "metadata must be a mapping"),
        ({"role": "user", "content": "x", "name": 5}, "name must be a string"),
        ("just a string", "must be a mapping"),
    ],
)
def test_bad_messages_raise_typed_errors_and_write_nothing(tmp_path, message, match):
    memory = AgentMemory(tmp_path / "m.db")
    memory.add_user("t", "kept")
    with pytest.raises(InvalidPromptError, match=match):
        memory.append("t", [{"role": "user", "content": "first of the batch"}, message])
    assert memory.messages("t") == [{"role": "user", "content": "kept"}]


def test_bad_thread_ids_and_settings(tmp_path):
    memory = AgentMemory(tmp_path / "m.db")
    for bad in ("", None, 3):
        with pytest.raises(AgentMemoryError, match="thread_id"):
            memory.add_user(bad, "x")
    with pytest.raises(InvalidPromptError):
        memory.append("t", "not a list of messages")
    with pytest.raises(AgentMemoryError, match="mode must be"):
        AgentMemory(tmp_path / "m.db", mode="forget")
    with pytest.raises(AgentMemoryError, match="needs a summarizer"):
        AgentMemory(tmp_path / "m.db", mode="summarize")
    with pytest.raises(AgentMemoryError, match="block_fraction"):
        AgentMemory(tmp_path / "m.db", block_fraction=1.5)
    assert issubclass(AgentMemoryError, SnapKVRagError) and issubclass(AgentMemoryError, ValueError)
