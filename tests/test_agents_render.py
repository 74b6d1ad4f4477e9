"""Agent memory rendering: append-only order, shared prefixes, dropping and summarising whole turns."""

from __future__ import annotations

import pytest

from snapkv_rag.agents import AgentMemory, context_budget, fit_history, split_turns
from snapkv_rag.engine.prompts import render_prompt
from snapkv_rag.errors import AgentMemoryError, EmptyPromptError, HistoryTooLongError, PromptTooLongError


def call(call_id: str, name: str = "read_log") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


def tool_log(k: int, lines: int) -> str:
    return "".join(f"The quick brown fox {k}.{i} jumps over the lazy dog.\n" for i in range(lines))


def agent_turn(memory: AgentMemory, thread: str, k: int, lines: int = 3) -> None:
    memory.add_user(thread, f"Question {k}: what happened?")
    memory.add_assistant(thread, None, tool_calls=[call(f"c{k}")])
    memory.add_tool_result(thread, f"c{k}", tool_log(k, lines))
    memory.add_assistant(thread, f"Answer {k}: Paris.")


@pytest.fixture
def counter(tokenizer):
    calls = []

    def count(messages):
        calls.append(len(messages))
        return len(render_prompt(tokenizer, messages))

    count.calls = calls
    return count


def ids(tokenizer, messages):
    return render_prompt(tokenizer, messages)


def test_render_is_append_only_and_each_prompt_prefixes_the_next(tmp_path, tokenizer):
    """Through the engine's own count/render path: turn k's prompt ids are a prefix of turn k+1's."""
    from conftest import tiny_engine

    # 1024 tokens of context: earlier tool calls render as call blocks, so five turns need more than 512
    engine = tiny_engine("llama", tokenizer, context=1024)
    memory = AgentMemory(tmp_path / "m.db")
    memory.add_system("t", "You are an agent with tools.")
    prompts = []
    for k in range(5):
        memory.add_user("t", f"Question {k}: hello engine!")
        view = memory.render_for(engine, "t", max_new_tokens=16)
        prompts.append(ids(engine.tokenizer, view.messages))
        assert view.tokens == engine.count_tokens(view.messages) == len(prompts[-1])
        assert not view.truncated and view.dropped_turns == 0 and view.first_kept == 1
        # the agent loop inside one turn: a tool call, its result, the model sees it, answers
        memory.add_assistant("t", None, tool_calls=[call(f"c{k}")])
        memory.add_tool_result("t", f"c{k}", tool_log(k, 2))
        view = memory.render_for(engine, "t", max_new_tokens=16)
        prompts.append(ids(engine.tokenizer, view.messages))
        memory.add_assistant("t", f"Answer {k}.")
    assert memory.render("t").messages == memory.messages("t")  # stored order, nothing added
    for earlier, later in zip(prompts, prompts[1:]):
        assert later[: len(earlier)] == earlier
    assert len(prompts[-1]) > len(prompts[0])


@pytest.mark.integration
def test_prefix_stable_with_the_embedded_tokenizer_template(tmp_path):
    """The same property with SmolLM2's real tokenizer and ChatML template (no model weights)."""
    from transformers import AutoTokenizer

    from snapkv_rag.model.loading import converted_gguf_dir, embedded_gguf_path

    try:
        tok = AutoTokenizer.from_pretrained(converted_gguf_dir(embedded_gguf_path()))
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"embedded tokenizer unavailable: {exc}")
    memory = AgentMemory(tmp_path / "m.db")
    memory.add_system("t", "You are an agent.")
    prompts = []
    for k in range(4):
        memory.add_user("t", f"Question {k}: what does the log say about item {k * 7}?")
        prompts.append(render_prompt(tok, memory.render("t").messages))
        memory.add_assistant("t", None, tool_calls=[call(f"c{k}")])
        memory.add_tool_result("t", f"c{k}", tool_log(k, 3))
        prompts.append(render_prompt(tok, memory.render("t").messages))
        memory.add_assistant("t", f" The log says item {k * 7} returned 200.\n")
    for earlier, later in zip(prompts, prompts[1:]):
        assert later[: len(earlier)] == earlier


def test_split_turns_keeps_tool_calls_with_their_results():
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "assistant", "content": "Hi, how can I help?"},  # a turn that starts without a user
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "", "tool_calls": [call("a")]},
        {"role": "user", "content": "u2 (interrupts before the result)"},
        {"role": "tool", "content": "result a", "tool_call_id": "a"},
        {"role": "user", "content": "u3"},
        {"role": "assistant", "content": "done"},
    ]
    pinned, turns = split_turns(msgs)
    assert pinned == 1
    assert turns == [(1, 2), (2, 6), (6, 8)]


def test_no_dropping_while_the_history_fits(tmp_path, counter, tokenizer):
    memory = AgentMemory(tmp_path / "m.db")
    memory.add_system("t", "sys")
    for k in range(3):
        agent_turn(memory, "t", k)
    full = memory.messages("t")
    n = len(ids(tokenizer, full))
    view = memory.render("t", count_tokens=counter, budget=n)
    assert view.messages == full and view.tokens == n and not view.truncated
    assert (view.dropped_turns, view.dropped_messages, view.kept_turns) == (0, 0, 3)
    assert counter.calls == [len(full)]  # one count, no per-turn work on the common path


def test_drop_keeps_system_and_latest_turn_and_whole_tool_exchanges(tmp_path, counter, tokenizer):
    memory = AgentMemory(tmp_path / "m.db", block_fraction=0)
    memory.add_system("t", "You are an agent.")
    for k in range(6):
        agent_turn(memory, "t", k, lines=4)
    memory.add_user("t", "Final question?")
    full = memory.messages("t")
    budget = len(ids(tokenizer, full)) * 6 // 10
    view = memory.render("t", count_tokens=counter, budget=budget)
    assert view.truncated and view.tokens == len(ids(tokenizer, view.messages)) <= budget
    assert view.messages[0] == full[0]
    assert view.messages[-1] == {"role": "user", "content": "Final question?"}
    kept = view.messages[1:]
    assert kept == full[view.first_kept :]  # a contiguous, verbatim tail
    assert kept[0]["role"] == "user"  # starts at a turn boundary
    call_ids = {c["id"] for m in kept for c in m.get("tool_calls", ())}
    result_ids = {m["tool_call_id"] for m in kept if m["role"] == "tool"}
    assert call_ids == result_ids
    assert view.dropped_messages == view.first_kept - 1 == 4 * view.dropped_turns
    assert view.kept_turns == 7 - view.dropped_turns
    # block_fraction=0 drops no more than needed: one more turn would not have fit
    one_more = [full[0], *full[view.first_kept - 4 :]]
    assert len(ids(tokenizer, one_more)) > budget


def test_cut_moves_in_blocks_so_consecutive_prompts_keep_sharing_their_prefix(tmp_path, tokenizer):
    count = lambda m: len(render_prompt(tokenizer, m))  # noqa: E731
    budget = 2000  # each turn renders its tool-call block too
    moves = {}
    for fraction in (0, 0.25, 0.5):
        memory = AgentMemory(tmp_path / f"m{fraction}.db", block_fraction=fraction)
        memory.add_system("t", "You are an agent.")
        cuts, prompts = [], []
        for k in range(30):
            memory.add_user("t", f"Question {k}?")
            view = memory.render("t", count_tokens=count, budget=budget)
            assert view.tokens <= budget
            cuts.append(view.first_kept)
            prompts.append(ids(tokenizer, view.messages))
            memory.add_assistant("t", None, tool_calls=[call(f"c{k}")])
            memory.add_tool_result("t", f"c{k}", tool_log(k, 1 + k % 3))
            memory.add_assistant("t", f"Answer {k}.")
        assert cuts == sorted(cuts)  # the history start only moves forward
        truncated = [i for i, c in enumerate(cuts) if c > 1]
        assert truncated, "the thread must outgrow the budget in this test"
        moves[fraction] = sum(a != b for a, b in zip(cuts, cuts[1:]))
        for i in range(len(cuts) - 1):  # whenever the cut stays, the next prompt extends this one
            if cuts[i] == cuts[i + 1]:
                assert prompts[i + 1][: len(prompts[i])] == prompts[i]
    # Measured here (18 truncated turns): turn-at-a-time moves the cut 18 times, blocks of a
    # quarter of the budget 6 times, blocks of half 3 times.
    assert moves[0.5] < moves[0.25] < moves[0]
    assert moves[0] >= len(truncated) - 2  # turn-at-a-time breaks the prefix on almost every turn
    assert moves[0.25] <= len(truncated) // 3


def test_summarize_replaces_dropped_turns_and_caches_the_summary(tmp_path, tokenizer):
    count = lambda m: len(render_prompt(tokenizer, m))  # noqa: E731
    seen = []

    def summarizer(messages):
        seen.append(messages)
        return f"{sum(m['role'] == 'user' for m in messages)} earlier questions about logs."

    path = tmp_path / "m.db"
    memory = AgentMemory(path, mode="summarize", summarizer=summarizer, block_fraction=0.25)
    memory.add_system("t", "You are an agent.")
    for k in range(8):
        agent_turn(memory, "t", k, lines=4)
    memory.add_user("t", "Final question?")
    full = memory.messages("t")
    budget = len(ids(tokenizer, full)) // 2
    view = memory.render("t", count_tokens=count, budget=budget)
    assert view.truncated and view.mode == "summarize" and view.tokens <= budget
    assert len(seen) == 1 and seen[0] == full[1 : view.first_kept]  # the dropped turns, verbatim
    assert view.summary == f"{view.dropped_turns} earlier questions about logs."
    assert view.messages[0] == {"role": "system", "content": "You are an agent.\n\nSummary of the earlier conversation:\n" + view.summary}
    assert view.messages[1:] == full[view.first_kept :]
    # the same cut renders the same summary without calling the summariser, also after a restart
    again = AgentMemory(path, mode="summarize", summarizer=summarizer).render("t", count_tokens=count, budget=budget)
    assert again.messages == view.messages and len(seen) == 1
    # growing further moves the cut; the summariser sees only the previous summary and the new turns
    for k in range(8, 14):
        agent_turn(memory, "t", k, lines=4)
    later = memory.render("t", count_tokens=count, budget=budget)
    assert later.first_kept > view.first_kept and len(seen) == 2
    assert seen[1][0] == {"role": "system", "content": "Summary of the earlier conversation:\n" + view.summary}
    assert seen[1][1:] == memory.messages("t")[view.first_kept : later.first_kept]
    # drop mode on the same thread is unaffected by stored summaries
    plain = AgentMemory(path).render("t", count_tokens=count, budget=budget)
    assert plain.summary is None and plain.messages[0] == full[0]


def test_summary_without_system_message_and_bad_summariser(tokenizer):
    count = lambda m: len(render_prompt(tokenizer, m))  # noqa: E731
    msgs = []
    for k in range(6):
        msgs += [{"role": "user", "content": f"Question {k}? " + tool_log(k, 2)}, {"role": "assistant", "content": "ok"}]
    budget = count(msgs) // 2
    view = fit_history(msgs, count_tokens=count, budget=budget, mode="summarize", summarizer=lambda m: "short")
    assert view.messages[0] == {"role": "system", "content": "Summary of the earlier conversation:\nshort"}
    assert view.messages[1]["role"] == "user" and view.tokens <= budget
    with pytest.raises(AgentMemoryError, match="must return a string"):
        fit_history(msgs, count_tokens=count, budget=budget, mode="summarize", summarizer=lambda m: None)


def test_history_too_long_and_budget_errors(tmp_path, engine, tokenizer):
    memory = AgentMemory(tmp_path / "m.db")
    memory.add_system("t", "You are an agent.")
    agent_turn(memory, "t", 0)
    memory.add_user("t", "Summarise this log: " + tool_log(1, 60))  # the latest turn alone is too long
    with pytest.raises(HistoryTooLongError) as info:
        memory.render_for(engine, "t", max_new_tokens=64)
    assert isinstance(info.value, PromptTooLongError)
    assert info.value.budget == engine.context_length - 64 and info.value.prompt_tokens > info.value.budget
    assert memory.messages("t")[-1]["content"].endswith(tool_log(1, 60))  # still stored whole
    with pytest.raises(AgentMemoryError, match="needs count_tokens"):
        memory.render("t", budget=100)
    with pytest.raises(AgentMemoryError, match="positive"):
        memory.render("t", count_tokens=len, budget=0)
    with pytest.raises(AgentMemoryError, match="no room"):
        context_budget(engine, max_new_tokens=engine.context_length)
    with pytest.raises(EmptyPromptError):
        memory.render_for(engine, "empty-thread")


def test_rendered_history_drives_the_engine(tmp_path, engine):
    """End to end on the tiny model: the fitted messages (tool calls included) generate within context."""
    memory = AgentMemory(tmp_path / "m.db")
    memory.add_system("t", "You are an agent.")
    for k in range(12):
        agent_turn(memory, "t", k, lines=2)
    memory.add_user("t", "And now?")
    view = memory.render_for(engine, "t", max_new_tokens=8)
    assert view.truncated and view.tokens + 8 <= engine.context_length
    result = engine.generate(view.messages, max_new_tokens=8)
    assert result.usage.prompt_tokens == view.tokens
    memory.add_assistant("t", result.text)
    report = view.to_dict()
    assert report["dropped_turns"] == view.dropped_turns and "messages" not in report
