"""Fit a thread's history into a token budget without breaking the prompt prefix more than needed.

Rendering is append-only: the engine messages are the thread's leading system messages
followed by every later message in the order it was stored, so while nothing is dropped,
turn k's rendered prompt is a prefix of turn k+1's (up to the chat template's generation
prompt) and a prefix cache reuses all of it.

Only when that rendering exceeds the budget are the oldest *turns* dropped. A turn is a
user message and everything after it up to the next user message (assistant text, tool
calls, tool results); turns linked by a tool call and its result are merged, so a call is
never separated from its result. The leading system messages and the latest turn are
always kept, and no message is ever shortened.

Where the cut lands (the stability choice): dropping one turn at a time would move the
start of the kept history on every turn once the budget is reached, so no two consecutive
prompts would share more than the system message. Instead, the turns are grouped into
*blocks* of about ``block_fraction * budget`` tokens, counted from the start of the thread
(each turn costed alone); the history only ever starts at a block boundary, and the cut is
the earliest boundary after which the rest fits. Block boundaries depend only on the
thread's (immutable) earlier turns and the budget, so the cut is stateless and
deterministic, it moves only when the history has grown by about the room one block left,
and it then jumps a whole block at once. Between moves, consecutive prompts share their
prefix. A larger ``block_fraction`` keeps the prefix stable longer but keeps less history
after each cut; ``0`` cuts one turn at a time.

With ``mode="summarize"`` the dropped turns are replaced by a caller-supplied summary that
is appended to the (last) leading system message, or becomes a system message when the
thread has none. Summaries are cached by the position of the cut (the memory persists them
in SQLite), so the same cut always renders the same summary text and the prefix holds.
The summariser sees only what is new: the previous summary (as a system message) plus the
turns between the previous cut and the new one.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import AgentMemoryError, HistoryTooLongError

CountTokens = Callable[[list[dict[str, Any]]], int]
Summarizer = Callable[[list[dict[str, Any]]], str]

MODES = ("drop", "summarize")
SUMMARY_PREFIX = "Summary of the earlier conversation:\n"


@dataclass(frozen=True)
class RenderedHistory:
    """The engine messages for a thread and what fitting them into the budget cost.

    ``messages`` go straight to ``Engine.generate``/``stream``. ``tokens`` is the rendered
    prompt's length by the counter (``None`` without one). ``dropped_turns`` and
    ``dropped_messages`` count what was left out (turns replaced by the summary included);
    ``first_kept`` is the position in the thread of the first kept non-system message.
    """

    messages: list[dict[str, Any]]
    tokens: int | None
    budget: int | None
    mode: str
    truncated: bool = False
    dropped_turns: int = 0
    dropped_messages: int = 0
    kept_turns: int = 0
    first_kept: int = 0
    summary: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "messages"}


class SummaryCache(Protocol):
    def get(self, upto: int) -> str | None: ...

    def latest_before(self, upto: int) -> tuple[int, str] | None: ...

    def put(self, upto: int, text: str) -> None:
        """Store ``text`` unless a summary for ``upto`` exists (the first one stays)."""


@dataclass
class DictSummaryCache:
    """In-process :class:`SummaryCache` (the memory uses a SQLite-backed one)."""

    items: dict[int, str] = field(default_factory=dict)

    def get(self, upto: int) -> str | None:
        return self.items.get(upto)

    def latest_before(self, upto: int) -> tuple[int, str] | None:
        keys = [k for k in self.items if k < upto]
        return (max(keys), self.items[max(keys)]) if keys else None

    def put(self, upto: int, text: str) -> None:
        self.items.setdefault(upto, text)


class CostCache:
    """LRU of per-turn token costs keyed by (counter, turn content hash)."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._items: OrderedDict[tuple[Any, str], int] = OrderedDict()
        self._lock = threading.Lock()

    def cost(self, count_tokens: CountTokens, turn: list[dict[str, Any]]) -> int:
        digest = hashlib.sha1(json.dumps(turn, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
        try:
            key: tuple[Any, str] | None = (count_tokens, digest)
            hash(key)
        except TypeError:
            key = None
        if key is not None:
            with self._lock:
                if key in self._items:
                    self._items.move_to_end(key)
                    return self._items[key]
        try:
            value = int(count_tokens(turn))
        except Exception:  # noqa: BLE001 - a lone turn may not render (empty, template rules);
            # the cost only places block boundaries, every fit is checked on the full rendering
            value = 1 + sum(len(m.get("content") or "") + len(json.dumps(m.get("tool_calls", ""))) for m in turn) // 4
        if key is not None:
            with self._lock:
                self._items[key] = value
                if len(self._items) > self.size:
                    self._items.popitem(last=False)
        return value


def split_turns(messages: Sequence[dict[str, Any]]) -> tuple[int, list[tuple[int, int]]]:
    """``(pinned, turns)``: the count of leading system messages and ``[start, end)`` turn spans.

    A new turn starts at every user message; turns joined by a tool call (in one) and its
    result (in a later one) are merged into one.
    """
    pinned = 0
    while pinned < len(messages) and messages[pinned]["role"] == "system":
        pinned += 1
    starts = [i for i in range(pinned, len(messages)) if i == pinned or messages[i]["role"] == "user"]
    spans = [[s, e] for s, e in zip(starts, starts[1:] + [len(messages)])]
    turn_of_call: dict[str, int] = {}
    merged: list[list[int]] = []
    for start, end in spans:
        merged.append([start, end])
        for i in range(start, end):
            msg = messages[i]
            for call in msg.get("tool_calls") or ():
                turn_of_call[call["id"]] = len(merged) - 1
            if msg["role"] == "tool" and turn_of_call.get(msg.get("tool_call_id") or "", len(merged) - 1) < len(merged) - 1:
                first = turn_of_call[msg["tool_call_id"]]
                merged[first:] = [[merged[first][0], merged[-1][1]]]
                for cid, t in turn_of_call.items():
                    turn_of_call[cid] = min(t, first)
    return pinned, [(s, e) for s, e in merged]


def _with_summary(system: list[dict[str, Any]], summary: str, prefix: str) -> list[dict[str, Any]]:
    text = prefix + summary
    if not system:
        return [{"role": "system", "content": text}]
    last = dict(system[-1])
    last["content"] = (last["content"] + "\n\n" if last["content"] else "") + text
    return [*system[:-1], last]


def fit_history(
    messages: Sequence[dict[str, Any]],
    *,
    count_tokens: CountTokens | None = None,
    budget: int | None = None,
    mode: str = "drop",
    summarizer: Summarizer | None = None,
    block_fraction: float = 0.25,
    summary_prefix: str = SUMMARY_PREFIX,
    summary_reserve: int | None = None,
    summaries: SummaryCache | None = None,
    costs: CostCache | None = None,
) -> RenderedHistory:
    """Engine messages for ``messages`` (stored shape) within ``budget`` tokens; see the module doc.

    ``summary_reserve`` (summarize mode): tokens set aside for the summary when choosing the
    first cut to try (default ``budget // 8``); later cuts are tried until the summary fits.
    """
    check_settings(mode, summarizer, block_fraction)
    if budget is not None and count_tokens is None:
        raise AgentMemoryError("a token budget needs count_tokens (for example engine.count_tokens)")
    if budget is not None and budget <= 0:
        raise AgentMemoryError(f"the token budget must be positive, got {budget}")
    messages = [dict(m) for m in messages]
    pinned, turns = split_turns(messages)
    system = messages[:pinned]

    def count(msgs: list[dict[str, Any]]) -> int:
        return int(count_tokens(msgs))  # type: ignore[misc]

    def rest(cut: int) -> list[dict[str, Any]]:
        return messages[turns[cut][0] :] if cut < len(turns) else []

    def report(msgs, tokens, cut, summary=None) -> RenderedHistory:
        first = turns[cut][0] if cut < len(turns) else len(messages)
        return RenderedHistory(
            messages=msgs,
            tokens=tokens,
            budget=budget,
            mode=mode,
            truncated=cut > 0,
            dropped_turns=cut,
            dropped_messages=first - pinned if cut else 0,
            kept_turns=len(turns) - cut,
            first_kept=first,
            summary=summary,
        )

    tokens = count(messages) if count_tokens is not None else None
    if budget is None or tokens is None or tokens <= budget or len(turns) <= 1:
        if budget is not None and tokens is not None and tokens > budget:
            raise HistoryTooLongError(tokens, budget)
        return report(messages, tokens, 0)

    # Block boundaries from the start of the thread: turn indices where a new block begins.
    costs = costs if costs is not None else CostCache()
    block = max(0, int(budget * block_fraction))
    candidates: list[int] = []
    acc = 0
    for t in range(len(turns) - 1):
        acc += costs.cost(count_tokens, messages[turns[t][0] : turns[t][1]])  # type: ignore[arg-type]
        if acc >= block:
            candidates.append(t + 1)
            acc = 0
    if not candidates or candidates[-1] != len(turns) - 1:
        candidates.append(len(turns) - 1)  # keeping only the latest turn is always a candidate

    def earliest_fit(limit: int) -> tuple[int, int] | None:
        """Smallest candidate index whose rendering fits ``limit`` (binary search), with its tokens."""
        lo, hi, found = 0, len(candidates) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            n = count(system + rest(candidates[mid]))
            if n <= limit:
                found, hi = (mid, n), mid - 1
            else:
                lo = mid + 1
        return found

    fit = earliest_fit(budget)
    if fit is None:
        n = count(system + rest(len(turns) - 1))
        raise HistoryTooLongError(n, budget)
    if mode == "drop":
        return report(system + rest(candidates[fit[0]]), fit[1], candidates[fit[0]])

    summaries = summaries if summaries is not None else DictSummaryCache()
    reserve = budget // 8 if summary_reserve is None else summary_reserve
    first_try = earliest_fit(budget - reserve) if reserve > 0 else fit
    start = first_try[0] if first_try is not None else fit[0]
    for ci in range(start, len(candidates)):
        cut = candidates[ci]
        summary = _summary_for(messages, turns, pinned, cut, summarizer, summaries)  # type: ignore[arg-type]
        msgs = _with_summary(system, summary, summary_prefix) + rest(cut)
        n = count(msgs)
        if n <= budget:
            return report(msgs, n, cut, summary)
    # Not even the latest turn fits beside a summary: render it without one.
    return report(system + rest(candidates[fit[0]]), fit[1], candidates[fit[0]])


def _summary_for(messages, turns, pinned, cut, summarizer: Summarizer, summaries: SummaryCache) -> str:
    upto = turns[cut][0]
    cached = summaries.get(upto)
    if cached is not None:
        return cached
    previous = summaries.latest_before(upto)
    if previous is not None and previous[0] > pinned:
        since, prior = previous
        new = [{"role": "system", "content": SUMMARY_PREFIX + prior}, *messages[since:upto]]
    else:
        new = list(messages[pinned:upto])
    text = summarizer([dict(m) for m in new])
    if not isinstance(text, str):
        raise AgentMemoryError(f"the summariser must return a string, got {type(text).__name__}")
    summaries.put(upto, text)
    stored = summaries.get(upto)  # another writer may have stored its summary for this cut first
    return text if stored is None else stored


def check_settings(mode: str, summarizer: Summarizer | None, block_fraction: float) -> None:
    if mode not in MODES:
        raise AgentMemoryError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if mode == "summarize" and not callable(summarizer):
        raise AgentMemoryError("mode='summarize' needs a summarizer: a callable (list of messages) -> str")
    if not isinstance(block_fraction, (int, float)) or not 0 <= block_fraction < 1:
        raise AgentMemoryError(f"block_fraction must be in [0, 1), got {block_fraction!r}")
