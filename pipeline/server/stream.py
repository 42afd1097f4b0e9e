"""`WS /v1/audio/speech/stream`: speech of text that is still being written (a language model's reply),
in the message shape of vllm-omni's endpoint of the same path, so that its clients work unchanged.

Client -> server (JSON text messages):
    {"type": "session.config", ...}       first and once: the fields of POST /v1/audio/speech but
                                          `input` and `stream*` (same checks), response_format "pcm"
    {"type": "input.text", "text": "..."}  pieces of the text, as they are written (a piece may end mid-word)
    {"type": "input.done"}                 the text is complete
    {"type": "session.close"}              stop now

Server -> client:
    {"type": "audio.start", "format": "pcm", "sample_rate": 24000, ...}   once the settings are accepted
    binary messages: 16-bit little-endian mono PCM at 24 kHz, one per chunk, as soon as it exists
    {"type": "chunk.timing", ...}          after each chunk: frames, audio so far, generation and vocoder ms
    {"type": "word.timings", "words": [{"word", "start", "end"}]}   words as their times become known (seconds of the audio)
    {"type": "queued", "ahead": n}         while the request waits for a free engine row
    {"type": "audio.done", ...}, then {"type": "session.done", ...} with the totals; the server closes (1000)
    {"type": "error", "message": "..."}    one sentence, then the server closes with a code of CLOSE_CODES

Unlike vllm-omni, which speaks whole sentences, the text reaches the talker token by token: the row is
taken and its prompt prefilled when the settings arrive, and it speaks each token once the text
after it shows it final (pipeline.word_timings), one token per frame (the official streaming-text
layout), waiting without frames while the writer is behind. Access, the per-client limit and the
request checks are those of the HTTP API (pipeline.server.common, pipeline.server.speech).
"""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.concurrency import run_in_threadpool
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from pipeline.contract.events import FRAME_SECONDS, SAMPLE_RATE, Chunk, Queued
from pipeline.contract.models import MODEL_TYPES
from pipeline.errors import EngineBusy, TTSInputError
from pipeline.request import load_json
from pipeline.server.common import Access, ApiError, pcm16
from pipeline.server.speech import SpeechCall, parse_speech
from pipeline.server.streaming import steps
from pipeline.service import ModelService
from pipeline.tts import TextStream

log = logging.getLogger(__name__)

PATH = "/v1/audio/speech/stream"
IDLE_TIMEOUT_S = 30.0  # the longest wait for a client's next message while its text is not complete
MAX_CONFIG_CHARS = 8 * 2**20  # session.config carries a reference recording as base64 (30 s of WAV is ~2 MB)
MAX_MESSAGE_CHARS = 64 * 2**10  # any other message; the whole text is MAX_TEXT_CHARS at most anyway
# Under uvicorn's own limit (16 MiB), so that an oversized message gets its error sentence rather than a bare close.
CLOSE_CODES = {"normal": 1000, "idle": 1001, "protocol": 1008, "binary": 1003, "too_big": 1009, "server": 1011, "busy": 1013}
SETTINGS_ONLY = "."  # the text that stands in while session.config is checked: the text comes in input.text
WS_FIELDS = ("stream_audio", "split_granularity", "word_timestamps")  # vllm-omni's session fields that concern only this route
REFUSED_FIELDS = {"input": "the text comes in input.text messages", "stream": "this route always streams",
                  "stream_format": "this route always streams", "non_streaming_mode": "this route feeds the text as it is written"}


class Refused(Exception):
    """A session ended by its client's fault (or the server's): one sentence, then `code`."""

    def __init__(self, message: str, code: str = "protocol"):
        super().__init__(message)
        self.message, self.code = message, code


def stream_routes(service: ModelService, access: Access | None = None, idle_timeout_s: float = IDLE_TIMEOUT_S) -> list[WebSocketRoute]:
    access = access or Access()

    async def endpoint(websocket: WebSocket) -> None:
        await websocket.accept()
        session = Session(websocket, service, idle_timeout_s)
        client = websocket.client.host if websocket.client else "?"
        try:
            access.check(websocket)  # a WebSocket's handshake carries the same headers as a request
            check_origin(websocket)
            access.enter(client)
        except ApiError as exc:
            await session.refuse(Refused(exc.message, "busy" if exc.status == 429 else "protocol"))
            return
        try:
            await session.run()
        finally:
            access.leave(client)

    return [WebSocketRoute(PATH, endpoint)]


def check_origin(websocket: WebSocket) -> None:
    """A page of another site may open a WebSocket to a localhost server without asking first (no CORS
    preflight): a browser's handshake names the page's origin, which must be this server."""
    origin = websocket.headers.get("origin")
    if origin and urlsplit(origin).netloc != websocket.headers.get("host"):
        raise ApiError(403, f"Pages of {origin} may not use this route; connect from this server's own pages or from a program.")


@dataclass
class Totals:
    chunks: int = 0
    frames: int = 0
    total_bytes: int = 0
    first_text: float | None = None  # perf_counter of the first input.text
    first_audio_ms: float | None = None  # from the first input.text to the first chunk sent


class Session:
    """One connection: its settings, its text stream and the two directions of its messages."""

    def __init__(self, websocket: WebSocket, service: ModelService, idle_timeout_s: float):
        self.websocket, self.service, self.idle_timeout_s = websocket, service, idle_timeout_s
        self.sending = asyncio.Lock()  # the reader (word timings) and the writer (audio) send on one socket
        self.stream: TextStream | None = None
        self.totals = Totals()
        self.words_sent = 0
        self.text_done = False

    async def run(self) -> None:
        try:
            call = await self._settings()
            self.stream = await self._open(call)
        except Refused as exc:
            await self.refuse(exc)
            return
        except WebSocketDisconnect:
            return
        try:
            await self._send({"type": "audio.start", "utterance_index": 0, "sentence_index": 0, "sentence_text": "", "format": "pcm",
                              "sample_rate": SAMPLE_RATE, "checkpoint": call.request.checkpoint,
                              "random_weights": self.service.random_weights(call.request.model_type, call.request.checkpoint),
                              "warnings": list(self.stream.handle.warnings)})
            await self._converse()
        except WebSocketDisconnect:
            pass  # the client went away: its row is freed below
        finally:
            await run_in_threadpool(self.stream.close)

    async def _converse(self) -> None:
        """Text in and audio out at once, until the audio ends (then the totals) or either side fails."""
        reader = asyncio.create_task(self._read_text())
        writer = asyncio.create_task(self._send_audio())
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            first = reader if reader in done else writer
            try:
                first.result()
            except Refused as exc:
                await run_in_threadpool(self.stream.close)  # the row is free before the client hears why
                await self.refuse(exc)
                return
            except (WebSocketDisconnect, asyncio.CancelledError):
                raise
            except Exception as exc:  # the engine failed this request: say so, and keep serving others
                log.exception("speech stream failed")
                await run_in_threadpool(self.stream.close)
                await self.refuse(Refused(f"Speech generation failed: {exc}", "server"))
                return
            if first is writer:
                await self._finish()
        finally:
            for task in (reader, writer):
                task.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)

    # ---- the client's messages -------------------------------------------------------------------

    async def _settings(self) -> SpeechCall:
        message = await self._receive()
        if message.get("type") != "session.config":
            raise Refused(f"The first message must be session.config, not {_kind(message)}.")
        data = {k: v for k, v in message.items() if k != "type"}
        for name, why in REFUSED_FIELDS.items():
            if name in data:
                raise Refused(f"session.config takes no '{name}': {why}.")
        check_ws_fields(data)
        data.setdefault("response_format", "pcm")
        if data["response_format"] != "pcm":
            raise Refused(f"This route sends raw 16-bit PCM at 24 kHz: response_format is 'pcm', not {data['response_format']!r}.")
        try:
            return await run_in_threadpool(parse_speech, {**data, "input": SETTINGS_ONLY}, self.service)
        except ApiError as exc:
            raise Refused(exc.message) from None

    async def _open(self, call: SpeechCall) -> TextStream:
        try:
            return await run_in_threadpool(open_text_stream, self.service, call)
        except EngineBusy as exc:
            raise Refused(str(exc), "busy") from None
        except TTSInputError as exc:
            raise Refused(str(exc)) from None

    async def _read_text(self) -> None:
        """The client's text, given to the stream as it comes; then its silence until the audio ends
        (a message after input.done is refused; a client gone ends the session)."""
        while True:
            message = await self._receive(idle=not self.text_done)
            kind = message.get("type")
            if kind == "session.close":
                raise Refused("The client closed the session.", "normal")
            if kind == "session.config":
                raise Refused("session.config comes once, as the first message.")
            if kind not in ("input.text", "input.done"):
                raise Refused(f"Unknown message type {_kind(message)}: send input.text, input.done or session.close.")
            if self.text_done:
                raise Refused(f"No message may follow input.done ({kind} came); the speech goes on to its end.")
            if kind == "input.text":
                await self._text(message)
            else:
                await self._done()

    async def _text(self, message: dict) -> None:
        piece = message.get("text")
        if not isinstance(piece, str):
            raise Refused("input.text carries its text as a string in 'text'.")
        if self.totals.first_text is None:
            self.totals.first_text = time.perf_counter()
        try:
            await run_in_threadpool(self.stream.append, piece)
        except TTSInputError as exc:
            raise Refused(str(exc)) from None
        await self._send_words(final=False)

    async def _done(self) -> None:
        if not self.stream.text.strip():
            raise Refused("input.done came before any text: send the text to speak in input.text messages first.")
        self.text_done = True
        await run_in_threadpool(self.stream.finish)
        await self._send_words(final=True)

    async def _receive(self, idle: bool = True) -> dict:
        """The next message as a JSON object; Refused for anything else, or after the idle timeout when `idle`."""
        try:
            event = await asyncio.wait_for(self.websocket.receive(), self.idle_timeout_s if idle else None)
        except asyncio.TimeoutError:
            raise Refused(f"No message came for {self.idle_timeout_s:g} s: the session timed out and its engine row was freed.", "idle") from None
        if event["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(event.get("code", 1000))
        if event.get("text") is None:
            raise Refused("This route takes JSON text messages; a binary message came.", "binary")
        return parse_message(event["text"])

    # ---- the server's messages -------------------------------------------------------------------

    async def _send_audio(self) -> None:
        """Each chunk as a binary message as soon as it exists, and its timing; ends with the audio."""
        async for item in steps(self.stream.handle.events(wait=False)):
            if isinstance(item, Queued):
                await self._send({"type": "queued", "ahead": item.ahead})
            elif isinstance(item, Chunk):
                await self._send_chunk(item)

    async def _send_chunk(self, chunk: Chunk) -> None:
        data = pcm16(chunk.audio)
        totals = self.totals
        if totals.first_audio_ms is None and totals.first_text is not None:
            totals.first_audio_ms = (time.perf_counter() - totals.first_text) * 1000.0
        totals.chunks, totals.frames, totals.total_bytes = totals.chunks + 1, totals.frames + chunk.frames, totals.total_bytes + len(data)
        async with self.sending:
            await self.websocket.send_bytes(data)
            await self.websocket.send_json({"type": "chunk.timing", "index": chunk.index, "frames": chunk.frames, "audio_seconds": chunk.audio_seconds,
                                            "generate_ms": chunk.generate_ms, "vocode_ms": chunk.vocode_ms, "elapsed_ms": chunk.elapsed_ms})

    async def _send_words(self, final: bool) -> None:
        words = self.stream.words(final)[self.words_sent:]
        if words:
            self.words_sent += len(words)
            await self._send({"type": "word.timings", "words": [w.as_dict() for w in words]})

    async def _finish(self) -> None:
        """The audio has ended: its totals, then the close."""
        await self._send_words(final=True)
        handle, totals = self.stream.handle, self.totals
        await self._send({"type": "audio.done", "utterance_index": 0, "sentence_index": 0, "total_bytes": totals.total_bytes, "error": False})
        await self._send({"type": "session.done", "utterance_index": 0, "total_sentences": 1, "chunks": totals.chunks, "frames": totals.frames,
                          "audio_seconds": totals.frames * FRAME_SECONDS, "total_bytes": totals.total_bytes, "first_audio_ms": totals.first_audio_ms,
                          "tokens": len(self.stream.tokens), "text_complete": self.text_done, "warnings": list(dict.fromkeys(handle.warnings))})
        await self.websocket.close(CLOSE_CODES["normal"])

    async def refuse(self, exc: Refused) -> None:
        """The error sentence and the close; nothing if the client has gone already."""
        try:
            if exc.code != "normal":
                await self._send({"type": "error", "message": exc.message})
            await self.websocket.close(CLOSE_CODES[exc.code])
        except (WebSocketDisconnect, RuntimeError):  # closed meanwhile: nobody to tell
            pass

    async def _send(self, event: dict) -> None:
        async with self.sending:
            await self.websocket.send_json(event)


def parse_message(raw: str) -> dict:
    """A client's text message as a JSON object with a type, within the size limit of its type."""
    if len(raw) > MAX_CONFIG_CHARS:
        raise Refused(f"The message is {len(raw):,} characters long; the limit is {MAX_CONFIG_CHARS:,} (for session.config).", "too_big")
    try:
        message = load_json(raw)
    except (json.JSONDecodeError, TTSInputError):
        raise Refused("A message is a JSON object with a 'type'; this one is not JSON.") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise Refused("A message is a JSON object with a 'type' (session.config, input.text, input.done or session.close).")
    if message["type"] != "session.config" and len(raw) > MAX_MESSAGE_CHARS:
        raise Refused(f"The {message['type']} message is {len(raw):,} characters long; the limit is {MAX_MESSAGE_CHARS:,}.", "too_big")
    return message


def check_ws_fields(data: dict) -> None:
    """vllm-omni's fields of this route, taken out of `data`: audio is always streamed as PCM and words
    always timed; sentence splitting does not apply (the text goes to the talker token by token)."""
    for name in WS_FIELDS:
        value = data.pop(name, None)
        if name == "split_granularity" and value not in (None, "sentence", "clause"):
            raise Refused(f"split_granularity is 'sentence' or 'clause' (and changes nothing here: the text is spoken token by token), not {value!r}.")
        if name == "stream_audio" and value is False:
            raise Refused("This route always streams its audio: leave stream_audio out or true.")
        if name in ("stream_audio", "word_timestamps") and value is not None and not isinstance(value, bool):
            raise Refused(f"{name} is true or false.")


def open_text_stream(service: ModelService, call: SpeechCall) -> TextStream:
    """The request's model and voice (loaded and cached as for POST /v1/audio/speech), and its text stream."""
    request = call.request
    try:
        tts = service.model(request.model_type, request.checkpoint)
        voice = None
        if MODEL_TYPES[request.model_type].reference:
            if request.voice_prompt is not None:
                voice = service.saved_voice(tts, request.voice_prompt)
            else:
                voice = service.voice_prompt(tts, request.ref_audio, request.ref_text, request.x_vector_only)
        return tts.open_text_stream(request, voice)
    finally:
        if call.reference is not None:
            shutil.rmtree(call.reference.parent, ignore_errors=True)


def _kind(message: dict) -> str:
    return repr(message.get("type"))
