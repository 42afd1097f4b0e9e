"""The audio path to the browser: raw PCM frames on one HTTP response per run, beside Gradio's queue.

Generation still runs as a queued Gradio event (its concurrency limit, its Stop/cancel), but the handler writes each chunk's PCM
into a channel that the page reads with fetch() on `ROUTE`. Why not only the queue: a value
yielded into a component reaches page JS through Svelte's reactivity, which coalesces values that
arrive close together — chunks were dropped in headless Chromium — and costs a render per chunk.
Why not only a route: it would bypass the queue's limits and cancellation.

Wire format: frames of a 4-byte little-endian length and that many bytes of 16-bit little-endian
mono PCM at 24 kHz; a zero-length frame is a heartbeat (sent while the run waits in the queue, so
proxies keep the connection); the response ends when the run ends.

Who may read: the page opens a run's stream at the click, a moment before the run's event starts
(its handler calls `open`). A reader waits at most `GRACE_S` for its run to start; an id that no
run takes by then gets 404 (JSON). A client (address) has at most `PER_CLIENT` streams open; more
get 429 (JSON).
"""
from __future__ import annotations

import asyncio
import re
import struct
import threading
import time
from collections import deque

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pipeline.server.common import StreamedUntilOver

ROUTE = "/pcm/{run_id}"
HEARTBEAT_S = 5.0
WAIT_LIMIT_S = 15 * 60  # a reader whose run started but sends nothing (a stuck run) gives up
GRACE_S = 30.0  # how long a reader waits for its run to start: the page asks just before its Gradio event starts the run, which a busy server takes seconds to do
PER_CLIENT = 16  # streams one client address may have open: a page holds one per tab
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
        self.started = False  # its run has started (or ended): a reader is welcome

    def start(self) -> None:
        with self._lock:
            self.started = True
        self._wake()

    def put(self, frame: bytes | None) -> None:
        with self._lock:
            self._frames.append(frame)
            self.started = True
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            loop, ready = self._loop, self._ready
        if loop is not None:
            loop.call_soon_threadsafe(ready.set)

    def _listen(self) -> asyncio.Event:
        """The event that `put` and `start` set, made on the reader's loop."""
        with self._lock:
            if self._ready is None:
                self._loop, self._ready = asyncio.get_running_loop(), asyncio.Event()
            return self._ready

    async def run_started(self, grace_s: float) -> bool:
        """Whether the run starts within `grace_s` (at once if it has)."""
        ready = self._listen()
        deadline = asyncio.get_running_loop().time() + grace_s
        while True:
            ready.clear()  # cleared before looking: a start after the look sets it again
            with self._lock:
                if self.started:
                    return True
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(ready.wait(), left)
            except TimeoutError:
                pass

    async def frames(self):
        self._listen()
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

    def __init__(self, grace_s: float = GRACE_S, per_client: int = PER_CLIENT) -> None:
        self.grace_s, self.per_client = grace_s, per_client
        self._channels: dict[str, PcmChannel] = {}
        self._ended: dict[str, float] = {}  # runs that ended with no reader (API clients, instant errors)
        self._readers: dict[str, int] = {}  # streams open, by client address
        self._lock = threading.Lock()

    def channel(self, run_id: str) -> PcmChannel:
        with self._lock:
            return self._channels.setdefault(run_id, PcmChannel())

    def open(self, run_id: str) -> None:
        """The run has started (its event handler calls this first): its page's stream may attach."""
        if RUN_ID.match(run_id or ""):  # API clients have no player, and no id
            self.channel(run_id).start()

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

    def _leave(self, client: str) -> None:
        with self._lock:
            self._readers[client] -= 1
            if not self._readers[client]:
                del self._readers[client]

    async def _respond(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        if not RUN_ID.match(run_id):
            return _error(400, "A run id is 8 to 80 letters, digits, '-' or '_'.")
        client = request.client.host if request.client else "?"
        with self._lock:
            if run_id in self._ended:  # the run was over before the page asked (e.g. it was rejected at once)
                return Response(b"", media_type="application/octet-stream", headers={"Cache-Control": "no-store"})
            if self._readers.get(client, 0) >= self.per_client:
                return _error(429, f"{self.per_client} audio streams of this client are already open; close one (or stop its run) first.")
            self._readers[client] = self._readers.get(client, 0) + 1
            channel = self._channels.setdefault(run_id, PcmChannel())
            channel.reader_attached = True
        try:
            started = await channel.run_started(self.grace_s)
        except BaseException:  # the client went away meanwhile
            self._release(run_id, channel)
            self._leave(client)
            raise
        if not started:
            self._release(run_id, channel)
            self._leave(client)
            return _error(404, f"No run '{run_id}' has started here (a page opens its run's stream at the click, "
                               f"and the run starts within {self.grace_s:g} s).")

        async def body():
            async for frame in channel.frames():
                yield struct.pack("<I", len(frame)) + frame

        async def closed() -> None:  # the run ended, or the page aborted the fetch (Stop, a new run, tab closed)
            self._release(run_id, channel)
            self._leave(client)

        headers = {
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",  # reverse proxies (Spaces) must not buffer the stream
            "Content-Encoding": "identity",  # keeps Gradio's Brotli middleware out: PCM does not compress
            "X-Sample-Rate": "24000",
        }
        return StreamedUntilOver(body(), closed, media_type="application/octet-stream", headers=headers)

    def route(self) -> Route:
        return Route(ROUTE, self._respond, methods=["GET"])


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status, headers={"Cache-Control": "no-store"})


CHANNELS = PcmChannels()  # one per process, shared by the event handlers and the route
