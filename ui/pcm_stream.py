"""The audio path to the browser: raw PCM frames on one HTTP response per run, beside Gradio's queue.

Generation still runs as a queued Gradio event (its concurrency limit, its Stop/cancel, ZeroGPU's
wrapper: the event handler stays in the main process), but the handler writes each chunk's PCM
into a channel that the page reads with fetch() on `ROUTE`. Why not only the queue: a value
yielded into a component reaches page JS through Svelte's reactivity, which coalesces values that
arrive close together — chunks were dropped in headless Chromium — and costs a render per chunk.
Why not only a route: it would bypass the queue's limits, cancellation and ZeroGPU.

Wire format: frames of a 4-byte little-endian length and that many bytes of 16-bit little-endian
mono PCM at 24 kHz; a zero-length frame is a heartbeat (sent while the run waits in the queue, so
proxies keep the connection); the response ends when the run ends.
"""
from __future__ import annotations

import asyncio
import re
import struct
import threading
import time
from collections import deque

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

ROUTE = "/pcm/{run_id}"
HEARTBEAT_S = 5.0
WAIT_LIMIT_S = 15 * 60  # a reader whose run never starts (page closed mid-queue) gives up
TOMBSTONE_S = 60.0  # how long a run that ended before its reader came is remembered as ended
RUN_ID = re.compile(r"^[A-Za-z0-9_-]{8,80}$")
_END = None


class PcmChannel:
    """Frames from the generating thread to one async reader, in order; `None` ends it."""

    def __init__(self) -> None:
        self._frames: deque[bytes | None] = deque()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self.reader_attached = False

    def put(self, frame: bytes | None) -> None:
        with self._lock:
            self._frames.append(frame)
            loop, ready = self._loop, self._ready
        if loop is not None:
            loop.call_soon_threadsafe(ready.set)

    async def frames(self):
        with self._lock:
            self._loop, self._ready = asyncio.get_running_loop(), asyncio.Event()
        waited = 0.0
        while True:
            self._ready.clear()  # cleared before draining: a put after the drain sets it again
            with self._lock:
                batch = list(self._frames)
                self._frames.clear()
            for frame in batch:
                if frame is _END:
                    return
                yield frame
            if batch:
                waited = 0.0
                continue
            try:
                await asyncio.wait_for(self._ready.wait(), HEARTBEAT_S)
            except asyncio.TimeoutError:
                waited += HEARTBEAT_S
                if waited >= WAIT_LIMIT_S:
                    return
                yield b""


class PcmChannels:
    """Channels by run id (made by the page at the click, so they cannot be guessed)."""

    def __init__(self) -> None:
        self._channels: dict[str, PcmChannel] = {}
        self._ended: dict[str, float] = {}  # runs that ended with no reader (API clients, instant errors)
        self._lock = threading.Lock()

    def channel(self, run_id: str) -> PcmChannel:
        with self._lock:
            return self._channels.setdefault(run_id, PcmChannel())

    def send(self, run_id: str, pcm: bytes) -> None:
        self.channel(run_id).put(pcm)

    def finish(self, run_id: str) -> None:
        """End the run's response; with no reader (an API client), drop the channel and its audio."""
        now = time.monotonic()
        with self._lock:
            channel = self._channels.get(run_id)
            if channel is None or not channel.reader_attached:
                self._channels.pop(run_id, None)
                self._ended = {k: t for k, t in self._ended.items() if now - t < TOMBSTONE_S}
                self._ended[run_id] = now
        if channel is not None:
            channel.put(_END)

    def _release(self, run_id: str, channel: PcmChannel) -> None:
        with self._lock:
            if self._channels.get(run_id) is channel:
                del self._channels[run_id]

    async def _respond(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        if not RUN_ID.match(run_id):
            return PlainTextResponse("bad run id", status_code=400)
        with self._lock:
            if run_id in self._ended:  # the run was over before the page asked (e.g. it was rejected at once)
                return Response(b"", media_type="application/octet-stream", headers={"Cache-Control": "no-store"})
            channel = self._channels.setdefault(run_id, PcmChannel())
            channel.reader_attached = True

        async def body():
            try:
                async for frame in channel.frames():
                    yield struct.pack("<I", len(frame)) + frame
            finally:  # the run ended, or the page aborted the fetch (Stop, a new run, tab closed)
                self._release(run_id, channel)

        headers = {
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",  # reverse proxies (Spaces) must not buffer the stream
            "Content-Encoding": "identity",  # keeps Gradio's Brotli middleware out: PCM does not compress
            "X-Sample-Rate": "24000",
        }
        return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)

    def route(self) -> Route:
        return Route(ROUTE, self._respond, methods=["GET"])


CHANNELS = PcmChannels()  # one per process, shared by the event handlers and the route
