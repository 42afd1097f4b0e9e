"""What the API routes share: who may call (`Access`), JSON errors in OpenAI's shape (`ApiError`), one
call from body to response (`serve`), a streamed response that stops its engine row when the client
goes away (`until_gone`), and the audio encodings."""
from __future__ import annotations

import hmac
import io
import json
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import anyio
import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pipeline.contract import Service
from pipeline.contract.events import SAMPLE_RATE, Waiting
from pipeline.contract.running import MAX_UPLOAD_BYTES
from pipeline.errors import EngineBusy, TTSInputError
from pipeline.request import load_json
from pipeline.server.streaming import steps

DISCONNECT_POLL_S = 0.1  # how often a whole (not streamed) response looks for its client having gone
Call = TypeVar("Call")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


@dataclass
class Access:
    """Who may call the API: `key` required as `Authorization: Bearer KEY` when set; `public`: the
    server listens beyond localhost (then the API is off without a key); at most `per_client`
    requests in flight per client address, over all routes."""

    key: str | None = None
    public: bool = False
    per_client: int = 4

    def __post_init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        self.lock = threading.Lock()

    def check(self, request: Request) -> None:
        if self.key is None:
            if self.public:
                raise ApiError(403, "The HTTP API is off: this server listens beyond localhost and was started without --api-key.")
            return
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {self.key}".encode()):
            raise ApiError(401, "Missing or wrong API key: send the header 'Authorization: Bearer KEY'.")

    def enter(self, client: str) -> None:
        with self.lock:
            if self.in_flight.get(client, 0) >= self.per_client:
                raise ApiError(429, f"{self.per_client} requests of this client are already running; wait for one to end.")
            self.in_flight[client] = self.in_flight.get(client, 0) + 1

    def leave(self, client: str) -> None:
        with self.lock:
            self.in_flight[client] -= 1


def input_error(exc: TTSInputError, names: dict[str, str] | None = None) -> ApiError:
    """A request the engine cannot take as an API error: 429 when its queue is full, else 400; its
    `param` the field at fault, by its name in the body (`names` maps the request's names to those)."""
    param = (names or {}).get(exc.field, exc.field)
    return ApiError(429 if isinstance(exc, EngineBusy) else 400, str(exc), param)


async def serve(request: Request, access: Access, parse: Callable[[dict], Call],
                respond: Callable[[Call, str, Callable[[], None]], Awaitable[Response]], stop: Callable[[str], bool]) -> Response:
    """One API call: access, the body checked by `parse` before any work, a place among the client's
    requests in flight, then `respond(call, leave)`. `parse` runs on a worker thread (decoding audio
    would block the server's event loop, the UI's included); `respond` drives its stream with
    `streaming.steps`, which holds no thread while the request waits. ApiErrors become JSON errors.
    A streamed response gives its place back when its last byte is sent or its client goes away
    (through `leave`); any other response here. The request runs under a key of its own: a client
    that goes away before a whole (not streamed) response is ready has it stopped by `stop(key)`."""
    client = request.client.host if request.client else "?"
    try:
        access.check(request)
        check_json_type(request)
        access.enter(client)  # before parsing: a refused request has written nothing (a reference file)
    except ApiError as exc:
        return exc.response()
    streaming = False
    try:
        call = await run_in_threadpool(parse, await json_body(request))
        response = await _unless_gone(request, partial(respond, call, key := f"api:{uuid.uuid4().hex}", partial(access.leave, client)),
                                      partial(stop, key))
        streaming = isinstance(response, StreamingResponse)
        return response
    except ApiError as exc:
        return exc.response()
    finally:
        if not streaming:
            access.leave(client)


async def _unless_gone(request: Request, respond: Callable[[], Awaitable[Response]], stop: Callable[[], bool]) -> Response:
    """`await respond()`, stopped if the client disconnects meanwhile (a whole reply would otherwise
    hold its engine row until its last frame for nobody)."""
    async with anyio.create_task_group() as tasks:
        async def watch() -> None:
            while not await request.is_disconnected():
                await anyio.sleep(DISCONNECT_POLL_S)
            await run_in_threadpool(stop)

        tasks.start_soon(watch)
        try:
            response = await respond()
        except Exception as exc:  # raised from here, not inside the task group (which would wrap it in an ExceptionGroup)
            failure = exc
        else:
            failure = None
        tasks.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return response


def check_json_type(request: Request) -> None:
    """A body must be declared JSON: a page on another site can POST text/plain (or a form) to a localhost
    server without the browser asking first, but not application/json."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, f"The request body must be sent as 'Content-Type: application/json', not '{media_type or 'none'}'.")


async def json_body(request: Request) -> dict:
    """The body as a JSON object, refused (413) as soon as it is known to pass MAX_UPLOAD_BYTES: from
    its Content-Length, or while it arrives; never held whole beyond the limit."""
    limit_mb = MAX_UPLOAD_BYTES // 2**20
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_UPLOAD_BYTES:
        raise ApiError(413, f"The request is {int(declared) / 2**20:.0f} MB; the limit is {limit_mb} MB.")
    pieces, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > MAX_UPLOAD_BYTES:
            raise ApiError(413, f"The request is over the limit of {limit_mb} MB.")
        pieces.append(piece)
    try:
        data = await run_in_threadpool(load_json, b"".join(pieces))  # up to 50 MB: not on the event loop
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "The request body is not JSON.") from None
    except TTSInputError as exc:
        raise ApiError(400, str(exc), exc.field) from None
    if not isinstance(data, dict):
        raise ApiError(400, "The request body is a JSON object.")
    return data


def until_gone(chunks: Generator[bytes | Waiting, None, None], service: Service, key: str, done: Callable[[], None],
               **options) -> StreamingResponse:
    """A streamed response (`options`: StreamingResponse's) of the chunks as `streaming.steps` makes
    them (no thread held between two). However it ends (sent whole, or its client gone, even before
    its body began), the stream under `key` is stopped, which frees its engine row within a frame,
    then `done()`."""
    async def body() -> AsyncIterator[bytes]:
        async for chunk in steps(chunks):
            yield chunk

    async def over() -> None:
        await run_in_threadpool(service.stop, key)
        await run_in_threadpool(chunks.close)
        done()

    return StreamedUntilOver(body(), over, **options)


class StreamedUntilOver(StreamingResponse):
    """A streamed response that awaits `over()` once it is over, however it ends: sent whole, or its
    client gone (even before its body began, when the body's own `finally` would never run)."""

    def __init__(self, content: AsyncIterator[bytes], over: Callable[[], Awaitable[None]], **options) -> None:
        super().__init__(content, **options)
        self.over = over

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.over()


def pcm16(audio: np.ndarray) -> bytes:
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def encode(audio: np.ndarray, audio_format: str) -> bytes:
    """24 kHz mono audio as one file: pcm (raw 16-bit), wav, flac or mp3."""
    if audio_format == "pcm":
        return pcm16(audio)
    import soundfile as sf

    out = io.BytesIO()
    subtype = {"wav": "PCM_16", "flac": "PCM_16", "mp3": "MPEG_LAYER_III"}[audio_format]
    sf.write(out, audio, SAMPLE_RATE, format=audio_format.upper(), subtype=subtype)
    return out.getvalue()
