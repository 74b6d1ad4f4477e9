"""The single-process server's shutdown under load: Ctrl+C, or SIGTERM from ``docker stop``.

From the signal on, a request that has produced nothing yet (it waits for room, or is in its
prefill) stops at once, and one that is generating gets ``grace`` seconds to finish before it
stops. Either way its client hears why: a stream ends with a ``server_shutting_down`` error
event, a plain reply is a 503 with ``Retry-After``, as is a request that arrives meanwhile. The
process then exits 0. (Ray Serve replicas drain on their own: :mod:`.ray_serve`.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import uvicorn

from .protocol import APIError


def shutting_down() -> APIError:
    return APIError(
        503,
        "the server is shutting down and stopped this request; retry it (on another replica, or once the server is back)",
        type="server_error",
        code="server_shutting_down",
        headers={"Retry-After": "5"},
    )


class Drain:
    """When requests must stop: nothing before :meth:`begin`; then at once for those that
    produced no piece yet, and ``grace`` seconds later for the rest."""

    def __init__(self, grace: float):
        self.grace = grace
        self.begun = False
        self._idle_ones: asyncio.Event | None = None  # set at begin(): requests without a piece stop
        self._all: asyncio.Event | None = None  # set when the grace is over: every request stops

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        if self._idle_ones is None or self._all is None:  # made on the event loop, at first use
            self._idle_ones, self._all = asyncio.Event(), asyncio.Event()
        return self._idle_ones, self._all

    def begin(self) -> None:
        """Start the shutdown (on the event loop)."""
        if self.begun:
            return
        self.begun = True
        idle_ones, everyone = self._events()
        idle_ones.set()
        asyncio.get_running_loop().call_later(self.grace, everyone.set)

    async def pieces(self, stream: Any) -> AsyncIterator[Any]:
        """``stream``'s pieces until it ends, or until the drain stops it: then the stream's
        generation is cancelled and :func:`shutting_down` is raised."""
        idle_ones, everyone = self._events()
        iterator = stream.__aiter__()
        produced = False
        while True:
            stop = everyone if produced else idle_ones
            if stop.is_set():
                raise shutting_down()
            following = asyncio.ensure_future(iterator.__anext__())
            stopping = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({following, stopping}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
                if not following.done():  # stopped, or this task was cancelled (the client left)
                    following.cancel()  # the stream's generation stops at its next step
                    with contextlib.suppress(BaseException):
                        await following
            if following.cancelled():
                raise shutting_down()
            try:
                piece = following.result()
            except StopAsyncIteration:
                return
            produced = True
            yield piece


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which starts ``drain`` at the first Ctrl+C or SIGTERM and exits 0 once
    the requests are done (uvicorn itself re-raises the signal, so the process ends with 143)."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._loop is not None and not self.drain.begun:
            self._loop.call_soon_threadsafe(self.drain.begin)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # the shutdown went as planned: no signal re-raised
