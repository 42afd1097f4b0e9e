"""The model service's streams driven from the server's event loop. Each step of a stream runs on a
worker thread (it may decode, encode or load), but where the stream would block — its request
waiting for an engine row, or for its next chunk — it yields a `Waiting`, and the loop waits for
the engine's call instead of holding one of the worker threads (which the page's own files and
every other request need)."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

from starlette.concurrency import run_in_threadpool

from pipeline.contract.events import Waiting

Item = TypeVar("Item")
_END = object()


async def steps(iterator: Iterator[Item | Waiting]) -> AsyncIterator[Item]:
    """The iterator's items but its `Waiting`s; a thread is held only while a step runs."""
    while (item := await run_in_threadpool(next, iterator, _END)) is not _END:
        if isinstance(item, Waiting):
            await ready(item)
        else:
            yield item


async def ready(waiting: Waiting) -> None:
    """Return once the stream that yielded `waiting` has its next item."""
    event = asyncio.Event()
    waiting.when_ready(_setter(asyncio.get_running_loop(), event))
    await event.wait()


def _setter(loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> Callable[[], None]:
    """`event.set` as the engine's threads may call it."""

    def set_event() -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed (the server stopped): nobody waits any more
            loop.call_soon_threadsafe(event.set)

    return set_event
