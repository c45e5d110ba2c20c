"""Tie a worker call to the HTTP request that started it: a client that goes away cancels the gRPC call.

The worker stops a cancelled generation at its next decode step and releases its place, its lease
and its fetch engines, so an abandoned request stops costing other tenants anything.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Protocol, TypeVar

import anyio
import anyio.to_thread
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class Cancellable(Protocol):
    """A call that can be cancelled (a gRPC call object)."""

    def cancel(self) -> bool:
        """Cancel the call (no effect when it is over)."""
        ...


async def cancel_on_disconnect(receive: Receive, call: Cancellable) -> None:
    """Wait until the HTTP client disconnects, then cancel ``call``."""
    while (await receive())["type"] != "http.disconnect":
        pass
    call.cancel()


async def run_unless_disconnected(request: Request, call: Cancellable, fn: Callable[[], T]) -> T:
    """``fn()`` in a worker thread; if the HTTP client disconnects first, ``call`` is cancelled (so ``fn`` ends)."""
    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel_on_disconnect, request.receive, call)
        try:
            result = await anyio.to_thread.run_sync(fn)
        except Exception as e:  # raised below: inside the task group it would come out wrapped in a group
            error = e
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result


async def _in_threads(lines: Iterator[str]) -> AsyncIterator[str]:
    """A blocking iterator's items, each fetched in a worker thread that a disconnect does not wait for."""
    while (line := await anyio.to_thread.run_sync(next, lines, None, abandon_on_cancel=True)) is not None:
        yield line


class CancellingStream(StreamingResponse):
    """A text/event-stream response whose worker call is cancelled however the response ends."""

    def __init__(self, lines: Iterator[str], call: Cancellable):
        super().__init__(_in_threads(lines), media_type="text/event-stream")
        self.call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Watch for the disconnect ourselves: under ASGI 2.4 Starlette notices it only at the next send,
        # which for a generation waiting its turn may be long after the client left.
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await cancel_on_disconnect(receive, self.call)
                tg.cancel_scope.cancel()
        finally:
            self.call.cancel()  # no effect on a call that finished
