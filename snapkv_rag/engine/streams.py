"""The engine's streams: a synchronous one that runs a step per piece asked for, and an async
one that runs the same stream in a worker thread; both end with a usable result."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor
from typing import Any

from ..tools.calls import ToolCallDelta
from .results import GenerationResult

StreamPiece = str | ToolCallDelta


class GenerationStream:
    """Iterate for text pieces; ``result`` holds the full :class:`GenerationResult` once done.

    Text always arrives as plain ``str``; with ``tools``, tool calls arrive as
    :class:`~snapkv_rag.tools.ToolCallDelta` objects (name first, then argument fragments).

    The model runs in the engine's scheduler, batched with other requests; the stream only
    reads this request's events, so a paused, unread or abandoned stream never blocks other
    calls (generation runs ahead of the reader, up to ``max_new_tokens``). ``close()`` (also on leaving a ``with`` block)
    ends generation with ``finish_reason="cancelled"`` and a usable ``result``.
    """

    def __init__(self, events: Iterator[Any], first: Any, cancel: threading.Event):
        self._events = events
        self._pending: Any = first
        self._cancel = cancel
        self._result: GenerationResult | None = None

    def __iter__(self) -> GenerationStream:
        return self

    def _next_event(self) -> Any:
        if self._pending is not None:
            item, self._pending = self._pending, None
            return item
        return next(self._events)

    def __next__(self) -> StreamPiece:
        if self._result is not None:
            raise StopIteration
        item = self._next_event()
        if isinstance(item, list):
            self._result = item[0]
            raise StopIteration
        return item[1]

    @property
    def finished(self) -> bool:
        return self._result is not None

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("the stream has not finished yet; iterate it to the end or close() it first")
        return self._result

    def close(self) -> None:
        """Stop generating (this request's rows leave the batch at the next step); ``result``
        then says ``cancelled``, unless the generation had already finished (it runs ahead of
        the reader). A cancelled result's text is all that was generated, read or not."""
        if self._result is not None:
            return
        self._cancel.set()
        while self._result is None:
            item = self._next_event()
            if isinstance(item, list):
                self._result = item[0]

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncGenerationStream:
    """Async iteration over text pieces, produced in a worker thread; ``result`` when done.

    Leaving ``async with`` (or ``aclose()``) cancels the generation, like
    :meth:`GenerationStream.close`.
    """

    def __init__(self, start: Callable[[threading.Event], GenerationStream], executor: Executor | None = None):
        self._start = start  # begins the generation (in the worker thread) with this stream's cancel event
        self._executor = executor  # where that thread comes from (None: the event loop's default pool)
        self._cancel = threading.Event()
        self._result: GenerationResult | None = None
        self._iterator: AsyncIterator[str] | None = None

    def __aiter__(self) -> AsyncIterator[str]:
        if self._iterator is None:
            self._iterator = self._produce()
        return self._iterator

    async def _produce(self) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        def produce() -> None:
            try:
                stream = self._start(self._cancel)
                for piece in stream:
                    loop.call_soon_threadsafe(queue.put_nowait, piece)
                    if self._cancel.is_set():
                        break
                stream.close()
                self._result = stream.result
                loop.call_soon_threadsafe(queue.put_nowait, done)
            except BaseException as exc:  # re-raised in the consumer
                loop.call_soon_threadsafe(queue.put_nowait, exc)

        worker = loop.run_in_executor(self._executor, produce)
        try:
            while True:
                item = await queue.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._cancel.set()
            await asyncio.shield(worker)

    async def aclose(self) -> None:
        self._cancel.set()
        if self._iterator is not None:
            await self._iterator.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise RuntimeError("the stream has not finished yet")
        return self._result


async def cancellable(work: Callable[[threading.Event], Any], executor: Executor | None = None) -> Any:
    """Run ``work(cancel_event)`` in a thread; if the awaiting task is cancelled, set the event
    (the generation stops before its next step) and wait for the thread to finish."""
    cancel = threading.Event()
    future = asyncio.get_running_loop().run_in_executor(executor, work, cancel)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        cancel.set()
        try:
            await future
        except BaseException:
            pass
        raise
