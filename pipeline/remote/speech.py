"""A Qwen3-TTS request over `POST /v1/audio/speech`: the body (our `SpeechRequest` in the fields both
servers read), the streamed audio (raw PCM, or this app's SSE events) cut back into `Chunk`s timed
by their arrival here, and what this app's events tell after the audio (`EndEvents`)."""
from __future__ import annotations

import base64
import json
import math
import mimetypes
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from pipeline.contract.events import SAMPLE_RATE, SAMPLES_PER_FRAME, Chunk
from pipeline.contract.models import MODEL_TYPES
from pipeline.errors import BackendUnavailable
from pipeline.remote.backend import Backend, StallRule
from pipeline.request import REQUEST_FIELDS, SpeechRequest, api_fields, default, shipped

BYTES_PER_FRAME = 2 * SAMPLES_PER_FRAME  # 16-bit mono


def speech_body(request: SpeechRequest, checkpoint: str, ours: bool, reference: str | None) -> dict:
    """The JSON body: raw PCM streamed (`stream` for this app and older vLLM-Omni, `stream_format` for
    current vLLM-Omni, which streams SSE events on `stream` alone); from this app, SSE events, which
    also carry the warnings of the stream's end (text left unspoken). The request's fields that the
    model type takes (vLLM-Omni refuses the Base-only fields on other tasks) and that the server takes
    per request (this app: all; vLLM-Omni: those its deploy config does not set). `reference`: the
    recording as a data: URL, or the saved voice as base64."""
    kind = MODEL_TYPES[request.model_type]
    body = {"model": checkpoint, "task_type": kind.task_type, "response_format": "pcm", "stream": True, "stream_format": "sse" if ours else "audio"}
    for name, body_name in api_fields():
        spec = REQUEST_FIELDS[name]
        if kind.takes(spec.role) and (ours or spec.vllm):
            body[body_name] = getattr(request, name)
    if kind.reference:
        body[dict(api_fields())["voice_prompt" if request.voice_prompt is not None else "ref_audio"]] = reference
    return {name: value for name, value in body.items() if value is not None and value != ""}


def unsent_settings(request: SpeechRequest) -> list[str]:
    """The settings of `request` that differ from the defaults and that vLLM-Omni does not take per request."""
    return [spec.label or name for name, spec in REQUEST_FIELDS.items()
            if spec.api is not None and not spec.vllm and spec.role != "reference" and getattr(request, name) not in (None, shipped(name), default(name))]


def data_url(path: str | Path) -> str:
    """A recording as a base64 `data:` URL, the form of `ref_audio` both servers accept."""
    mime = mimetypes.guess_type(str(path))[0] or ""
    mime = mime if mime.startswith("audio/") else "audio/wav"
    return f"data:{mime};base64,{base64.b64encode(Path(path).read_bytes()).decode()}"


class Connection:
    """A streamed response that another thread may end (Stop): shutting its socket down wakes the
    reading thread at once, and the server sees its client gone (this app then frees the engine row).
    Once its audio has started, a watch ends it the same way when the backend stalls (`stall`)."""

    def __init__(self, stall: StallRule | None = None) -> None:
        self.stopped = False
        self.stall = stall or StallRule()
        self.stalled_for: float | None = None  # the silence after which the watch ended it
        self._response: httpx.Response | None = None
        self._lock = threading.Lock()
        self._heard = threading.Condition(self._lock)  # an audio chunk arrived, or the stream is over
        self._last_audio: float | None = None  # time.monotonic() of the last audio chunk's arrival
        self._longest_interval = 0.0
        self._over = False

    def audio_arrived(self) -> None:
        """Called by the reader on each audio chunk: the first starts the stall watch."""
        now = time.monotonic()
        with self._lock:
            first = self._last_audio is None
            if not first:
                self._longest_interval = max(self._longest_interval, now - self._last_audio)
            self._last_audio = now
            self._heard.notify()
        if first:
            threading.Thread(target=self._watch, name="backend-stall-watch", daemon=True).start()

    def end(self) -> None:
        """The stream is over (read to its end, failed or stopped): the watch ends."""
        with self._lock:
            self._over = True
            self._heard.notify()

    def broken(self, backend: Backend, exc: Exception, audio_seconds: float) -> BackendUnavailable:
        """Why the stream broke off (not by Stop): the stall the watch saw, or the backend's going away."""
        if self.stalled_for is not None:
            return backend.stalled(self.stalled_for, audio_seconds, self.stall)
        return backend.stopped_answering(exc, audio_seconds)

    def _watch(self) -> None:
        with self._lock:
            while not (self._over or self.stopped):
                limit = self.stall.limit(self._longest_interval)
                left = self._last_audio + limit - time.monotonic()
                if left <= 0:
                    self.stalled_for = limit
                    self._shutdown()  # the reading thread wakes with a transport error (or the response's end)
                    return
                self._heard.wait(left)

    def attach(self, response: httpx.Response) -> None:
        with self._lock:
            self._response = response
            if self.stopped:  # stopped while the request was on its way
                self._shutdown()

    def close(self) -> None:
        with self._lock:
            self.stopped = True
            self._heard.notify()
            if self._response is not None:
                self._shutdown()

    def _shutdown(self) -> None:
        stream = self._response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # closed already: nothing is left to end
            pass


@dataclass
class PcmCutter:
    """Raw 16-bit PCM as it arrives, cut at whole 80 ms frames into Chunks; `elapsed_ms` is measured
    here, from `started` (when the request was sent) to the arrival of the chunk's last byte."""

    started: float
    pending: bytes = b""
    index: int = 0
    samples: int = 0

    @property
    def audio_seconds(self) -> float:
        return self.samples / SAMPLE_RATE

    def take(self, data: bytes, final: bool = False) -> Chunk | None:
        """The whole frames received so far (at the end, whatever whole samples are left); None if none."""
        self.pending += data
        size = len(self.pending) - len(self.pending) % (2 if final else BYTES_PER_FRAME)
        if size == 0:
            return None
        pcm, self.pending = self.pending[:size], self.pending[size:]
        audio = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767.0  # the inverse of the players' and servers' pcm16
        self.samples += audio.size
        elapsed_ms = (time.perf_counter() - self.started) * 1000.0
        chunk = Chunk(self.index, audio, math.ceil(audio.size / SAMPLES_PER_FRAME), None, None, elapsed_ms, self.audio_seconds)
        self.index += 1
        return chunk


@dataclass
class EndEvents:
    """What this app's SSE stream tells besides its audio, for the stream's `StreamEnd`: the warnings
    of its end (text left unspoken) and, where the request asked for word timestamps, the words."""

    warnings: list[str] = field(default_factory=list)
    words: list[dict] | None = None  # [{"word", "start", "end"}] in seconds of the audio


def pcm_chunks(response: httpx.Response, connection: Connection, backend: Backend, started: float,
               end: EndEvents | None = None) -> Iterator[Chunk]:
    """The response's audio as Chunks: raw PCM or, given `end`, this app's SSE events (what they tell
    besides the audio goes to `end`). Stop ends it quietly; a backend that goes away raises BackendUnavailable."""
    cutter = PcmCutter(started)
    try:
        for data in (response.iter_bytes() if end is None else sse_audio(response, end)):
            if (chunk := cutter.take(data)) is not None:
                connection.audio_arrived()
                yield chunk
    except httpx.TransportError as exc:
        if connection.stopped:
            return
        raise connection.broken(backend, exc, cutter.audio_seconds) from None
    if connection.stalled_for is not None:  # a response that its connection's close delimits reads as ended
        raise connection.broken(backend, TimeoutError(), cutter.audio_seconds)
    if (chunk := cutter.take(b"", final=True)) is not None:
        yield chunk


def sse_audio(response: httpx.Response, end: EndEvents) -> Iterator[bytes]:
    """The PCM of this app's `speech.audio.delta` events; its `speech.audio.warning`s and `speech.audio.words` go to `end`."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line.removeprefix("data: "))
        if event.get("type") == "speech.audio.delta":
            yield base64.b64decode(event["audio"])
        elif event.get("type") == "speech.audio.warning":
            end.warnings.append(event["message"])
        elif event.get("type") == "speech.audio.words":
            end.words = event["words"]
