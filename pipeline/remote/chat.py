"""A Qwen3-Omni conversation over `POST /v1/chat/completions`, in the shape vLLM-Omni serves it (and
this app's server, which follows it): the body (OpenAI messages, the user's recordings as base64
`input_audio` parts), and the Server-Sent Events of `chat.completion.chunk`s turned back into the
chat's items: vLLM-Omni's top-level `modality` says whether `delta.content` is text or an audio
chunk (base64 of a whole file: raw 16-bit PCM as asked here, or a WAV from servers that always send
one).

What the events do not carry is not made up: the reply's token ids, its codec codes and the
thinker's time per token stay empty; times are measured here, from sending the request. A text
event is taken as one token (a server streams one per token, now and then two), which places the
highlight of the word being spoken; it may run a token early where a piece held two.
"""
from __future__ import annotations

import base64
import io
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import numpy as np

from pipeline.contract.events import SAMPLE_RATE, SAMPLES_PER_FRAME, ChatEnd, Chunk, TextDelta
from pipeline.errors import TTSInputError
from pipeline.remote.backend import Backend
from pipeline.remote.speech import Connection

if TYPE_CHECKING:
    from pipeline.omni import ChatRequest, Turn

# The official checkpoint's voices: vLLM-Omni does not list a Qwen3-Omni model's speakers.
QWEN3_OMNI_VOICES = ["Aiden", "Chelsie", "Ethan"]


def chat_body(request: ChatRequest, checkpoint: str) -> dict:
    """The JSON body: the voice as OpenAI's `audio.voice` and as vLLM-Omni's `speaker`, the speech as
    raw 16-bit PCM (`pcm16`), streamed."""
    messages = [{"role": "system", "content": request.system}] + [message(turn) for turn in request.turns]
    body = {"model": checkpoint, "messages": messages, "modalities": ["text", "audio"] if request.speak else ["text"],
            "audio": {"voice": request.speaker, "format": "pcm16"}, "speaker": request.speaker, "stream": True,
            "max_tokens": request.max_new_tokens, "seed": request.seed, "temperature": request.temperature, "top_p": request.top_p,
            "top_k": request.top_k}
    return {name: value for name, value in body.items() if value is not None}


def message(turn: Turn) -> dict:
    """A turn as an OpenAI message: its text, and a user's recording (a file the UI saved) as base64."""
    if turn.audio is None:
        return {"role": turn.role, "content": turn.text}
    path = Path(turn.audio)
    if not path.is_file():
        raise TTSInputError(f"The recording {path.name} is gone; record or upload it again.")
    audio_format = path.suffix.lstrip(".").lower() or "wav"  # OpenAI's names: wav, mp3, ...
    parts = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(path.read_bytes()).decode(), "format": audio_format}}]
    return {"role": turn.role, "content": parts + ([{"type": "text", "text": turn.text}] if turn.text.strip() else [])}


def audio_samples(encoded: str) -> np.ndarray:
    """An audio delta's samples: raw 16-bit PCM, or a whole WAV file."""
    raw = base64.b64decode(encoded)
    if raw[:4] == b"RIFF":  # read as 16-bit, as the raw PCM: both then scale back alike
        import soundfile as sf

        samples, rate = sf.read(io.BytesIO(raw), dtype="int16", always_2d=True)
        if rate != SAMPLE_RATE:
            raise TTSInputError(f"The backend sent speech at {rate} Hz; this app plays Qwen3-Omni's {SAMPLE_RATE} Hz.")
        return samples[:, 0].astype(np.float32) / 32767.0
    return np.frombuffer(raw[: len(raw) - len(raw) % 2], dtype="<i2").astype(np.float32) / 32767.0


@dataclass
class ReplyReader:
    """The chat's items from the reply's events, timed from `started` (when the request was sent)."""

    started: float
    texts: list[str] = field(default_factory=list)
    chunks: int = 0
    samples: int = 0
    first_text_ms: float | None = None
    first_audio_ms: float | None = None

    def items(self, event: dict) -> list[TextDelta | Chunk]:
        if isinstance(event.get("error"), dict):  # an error after the 200 went out, sent as an event
            raise TTSInputError(str(event["error"].get("message") or event["error"]))
        elapsed_ms = (time.perf_counter() - self.started) * 1000.0
        content = next(iter(event.get("choices") or []), {}).get("delta", {}).get("content")
        if not content:
            return []
        if event.get("modality", "text") == "audio":
            return [self._chunk(audio_samples(content), elapsed_ms)]
        self.first_text_ms = elapsed_ms if self.first_text_ms is None else self.first_text_ms
        index = len(self.texts)
        self.texts.append(content)
        return [TextDelta(index, index, content, elapsed_ms)]

    def _chunk(self, audio: np.ndarray, elapsed_ms: float) -> Chunk:
        self.first_audio_ms = elapsed_ms if self.first_audio_ms is None else self.first_audio_ms
        self.samples += audio.size
        chunk = Chunk(self.chunks, audio, math.ceil(audio.size / SAMPLES_PER_FRAME), None, None, elapsed_ms, self.samples / SAMPLE_RATE)
        self.chunks += 1
        return chunk

    def end(self, stopped: bool) -> ChatEnd:
        return ChatEnd("".join(self.texts), [], math.ceil(self.samples / SAMPLES_PER_FRAME), stopped, self.first_text_ms, self.first_audio_ms,
                       math.nan, np.zeros((0, 16), dtype=np.int64))


def reply_items(response: httpx.Response, connection: Connection, backend: Backend, started: float) -> Iterator[TextDelta | Chunk | ChatEnd]:
    """The reply as it arrives, then its ChatEnd. Stop ends it quietly; a backend that goes away raises BackendUnavailable."""
    reader = ReplyReader(started)
    try:
        for line in response.iter_lines():
            data = line[len("data:"):].strip() if line.startswith("data:") else ""
            if data == "[DONE]":
                break
            for item in reader.items(json.loads(data)) if data else []:
                if isinstance(item, Chunk):
                    connection.audio_arrived()
                yield item
    except httpx.TransportError as exc:
        if not connection.stopped:
            raise connection.broken(backend, exc, reader.samples / SAMPLE_RATE) from None
    if connection.stalled_for is not None:  # a response that its connection's close delimits reads as ended
        raise connection.broken(backend, TimeoutError(), reader.samples / SAMPLE_RATE)
    yield reader.end(connection.stopped)
