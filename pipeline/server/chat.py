"""Qwen3-Omni over HTTP: `POST /v1/chat/completions` on the app's server, in the shape vllm-omni serves
Qwen3-Omni in (its vllm_omni/entrypoints/openai/serving_chat.py), through the same model service and
engine queue as the Omni chat tab.

Request: OpenAI's chat body. `messages`: an optional system message first (without one, the app's
voice-assistant prompt), then user and earlier assistant turns, the last the user's; a content is a
string or a list of `text`, `input_audio` ({"data": base64, "format"}) and `audio_url` (a `data:` URL)
parts, one audio part at most, in user messages only. `modalities` (default ["text", "audio"]),
`audio` ({"voice", "format"}; vllm-omni's top-level `speaker` also names the voice), `stream`,
`max_tokens` / `max_completion_tokens`, `temperature` / `top_p` / `top_k` (the thinker's; the talker
samples as the checkpoint says), `seed`.

Reply: a `chat.completion` whose one choice has the text as `message.content` and the speech as
`message.audio` ({"id", "data": base64 in `audio.format`, "expires_at", "transcript"}), plus
vllm-omni's `audio_metadata`. Streamed: Server-Sent Events of `chat.completion.chunk`s marked with
vllm-omni's top-level `modality`: "text" chunks carry text in `delta.content`; "audio" chunks carry
one audio chunk in `delta.content`, base64 of a complete file in `audio.format` (a WAV has its own
header; pcm is raw 16-bit samples), with `audio_metadata`; then a chunk with the `finish_reason`, and
`data: [DONE]`. Ours: `dropped_turns` (on the completion, and on the chunk with the `finish_reason`)
counts the oldest messages left out to fit the model's context (0: none). A client that goes away mid-stream frees its engine row.
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import math
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pipeline.audio import load_message_audio
from pipeline.contract.events import MAX_REPLY_TOKENS, SAMPLE_RATE, ChatEnd, Chunk, StreamEnd, StreamStart, TextDelta, Waiting
from pipeline.contract.models import OMNI
from pipeline.errors import TTSInputError
from pipeline.omni.conversation import AUDIO_SAMPLE_RATE
from pipeline.server.common import Access, ApiError, encode, input_error, serve, until_gone
from pipeline.server.streaming import steps
from pipeline.service import MAX_AUDIO_SECONDS, ChatRequest, ModelService, Turn

FIELDS = {"model", "messages", "modalities", "audio", "speaker", "stream", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "seed"}
MODALITIES = ("text", "audio")
ROLES = ("system", "user", "assistant")
AUDIO_FORMATS = {"wav": "wav", "pcm16": "pcm", "pcm": "pcm", "flac": "flac", "mp3": "mp3"}  # OpenAI's pcm16 is vllm-omni's pcm
AUDIO_PARTS = ("input_audio", "audio_url")
VISUAL_PARTS = ("image_url", "input_image", "image", "video_url", "input_video", "video")
AUDIO_EXPIRES_S = 24 * 3600  # what `expires_at` says, as vllm-omni; nothing is kept here, the audio is in the reply


@dataclass
class ChatCall:
    request: ChatRequest
    checkpoint: str
    text: bool  # the reply's text is sent ("text" in modalities)
    audio_format: str | None  # the speech's encoding; None: text only (the talker does not run)
    stream: bool


@dataclass
class _Reply:
    """What every part of one reply shares."""

    id: str
    created: int
    model: str
    im_end: int

    def chunk(self, modality: str | None, delta: dict, finish_reason: str | None = None, dropped_turns: int | None = None, **extra) -> bytes:
        """One `chat.completion.chunk` event; `modality` is vllm-omni's mark of what `delta.content` holds;
        the last one says how many of the oldest turns were left out (`dropped_turns`, ours)."""
        body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason, **extra}]}
        if modality is not None:
            body["modality"] = modality
        if dropped_turns is not None:
            body["dropped_turns"] = dropped_turns
        return _event(body)

    def finish_reason(self, end: ChatEnd) -> str:
        """'stop' when the model ended its reply, 'length' when max_tokens cut it."""
        return "stop" if end.tokens and end.tokens[-1] == self.im_end else "length"


def chat_routes(service: ModelService, access: Access | None = None) -> list[Route]:
    access = access or Access()

    async def completions(request: Request) -> Response:
        return await serve(request, access, lambda data: parse_chat(data, service), lambda call, key, done: _respond(call, service, key, done), service.stop)

    return [Route("/v1/chat/completions", completions, methods=["POST"])]


def parse_chat(data: dict, service: ModelService) -> ChatCall:
    """Check a /v1/chat/completions body before any work (audio parts are decoded here) and make the chat request."""
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise ApiError(400, f"Unknown field '{unknown[0]}'.", unknown[0])
    checkpoint = _omni_checkpoint(data.get("model"), service)
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' is true or false.", "stream")
    modalities = _modalities(data.get("modalities", list(MODALITIES)))
    voice, audio_format = _audio_options(data.get("audio"), data.get("speaker"))
    system, turns = _conversation(data.get("messages"))
    sampling = {name: data.get(name) for name in ("temperature", "top_p", "top_k")}
    if sampling["top_k"] == -1:  # vLLM's "no top-k cut"
        sampling["top_k"] = 0
    options = {"system": system, "speaker": voice, "seed": data.get("seed"), "max_new_tokens": _max_tokens(data), **sampling}
    try:  # checked as the model checks them, in the same sentences as the speech API's fields of the same names
        request = ChatRequest(turns, speak="audio" in modalities, **{name: value for name, value in options.items() if value is not None}).validate()
    except TTSInputError as exc:
        raise ApiError(400, str(exc), exc.field) from None
    return ChatCall(request, checkpoint, "text" in modalities, audio_format if "audio" in modalities else None, stream)


def _omni_checkpoint(model, service: ModelService) -> str:
    served = service.choices[OMNI.id]
    if model is None:
        return service.default_checkpoint(OMNI.id)
    if model in served:
        return model
    if any(model in checkpoints for kind, checkpoints in service.choices.items() if kind != OMNI.id):
        raise ApiError(400, f"Model '{model}' is a Qwen3-TTS model; chat completions need a Qwen3-Omni model: {', '.join(served)}.", "model")
    raise ApiError(404, f"Model '{model}' is not served here; chat completions take {', '.join(served)}.", "model")


def _modalities(modalities) -> set[str]:
    if not isinstance(modalities, list) or not modalities or not all(isinstance(m, str) for m in modalities):
        raise ApiError(400, "'modalities' is a list of 'text' and 'audio'.", "modalities")
    unsupported = [m for m in modalities if m not in MODALITIES]
    if unsupported:
        raise ApiError(400, f"Output modality '{unsupported[0]}' is not supported: Qwen3-Omni answers in 'text' and 'audio'.", "modalities")
    return set(modalities)


def _audio_options(audio, speaker) -> tuple[str | None, str]:
    """The voice (OpenAI's audio.voice, or vllm-omni's top-level speaker) and the speech's encoding."""
    audio = {} if audio is None else audio
    if not isinstance(audio, dict):
        raise ApiError(400, "'audio' is an object such as {\"voice\": \"Ethan\", \"format\": \"wav\"}.", "audio")
    voice = audio.get("voice", speaker)
    if voice is not None and not isinstance(voice, str):
        raise ApiError(400, "The voice ('audio.voice') is a speaker's name.", "audio")
    audio_format = audio.get("format", "wav")
    if not isinstance(audio_format, str) or audio_format not in AUDIO_FORMATS:
        raise ApiError(400, f"'audio.format' is one of {', '.join(AUDIO_FORMATS)}, not {json.dumps(audio_format)}.", "audio")
    return voice, AUDIO_FORMATS[audio_format]


def _number(data: dict, name: str, integer: bool = False) -> int | float | None:
    value = data.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or not math.isfinite(value)):
        raise ApiError(400, f"'{name}' is {'an integer' if integer else 'a number'}, not {json.dumps(value)}.", name)
    return value


def _max_tokens(data: dict) -> int | None:
    name = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"  # OpenAI's newer name wins
    value = _number(data, name, integer=True)
    if value is not None and not 1 <= value <= MAX_REPLY_TOKENS:
        raise ApiError(400, f"'{name}' is from 1 to {MAX_REPLY_TOKENS}, not {value}.", name)
    return value


def _conversation(messages) -> tuple[str | None, list[Turn]]:
    """The system prompt (None: none was sent) and the turns."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required: a list of chat messages that ends with the user's.", "messages")
    system, turns = None, []
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            raise ApiError(400, f"Message {number} is not an object with 'role' and 'content'.", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"Message {number} has role {json.dumps(role)}; this server takes system, user and assistant messages.", "messages")
        if message.get("content") is None:
            raise ApiError(400, f"Message {number} has no 'content' (an earlier reply goes back as its text).", "messages")
        text, audio = _content(message["content"], number)
        if audio is not None and role != "user":
            raise ApiError(400, f"Message {number} is a {role} message with audio; only user messages may carry audio.", "messages")
        if role == "system" and number > 1:
            raise ApiError(400, f"Message {number} is a system message; only the first message may be one.", "messages")
        if role == "system":
            system = text
        else:
            turns.append(Turn(role, text, audio))
    if not turns or turns[-1].role != "user":
        raise ApiError(400, "The last message must be the user's: the one to answer.", "messages")
    return system, turns


def _content(content, number: int) -> tuple[str, np.ndarray | None]:
    """A message's text (its text parts, one per line) and its audio, if any."""
    if isinstance(content, str):
        return content, None
    if not isinstance(content, list):
        raise ApiError(400, f"Message {number}'s 'content' is a string or a list of content parts.", "messages")
    texts, audios = [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"Message {number} has a text part without a string 'text'.", "messages")
            texts.append(part["text"])
        elif kind in AUDIO_PARTS:
            audios.append(_audio_part(part, number))
        elif kind in VISUAL_PARTS:
            raise ApiError(400, f"Message {number} has an {kind} part: images and video are not supported here, only text and audio.", "messages")
        else:
            raise ApiError(400, f"Message {number} has a content part of type {json.dumps(kind)}; this server takes text, input_audio and "
                                "audio_url parts.", "messages")
    if len(audios) > 1:
        raise ApiError(400, f"Message {number} has {len(audios)} audio parts; a message takes at most one.", "messages")
    return "\n".join(texts), audios[0] if audios else None


def _audio_part(part: dict, number: int) -> np.ndarray:
    """An audio part's recording, 16 kHz mono for the thinker: base64 in input_audio.data, or a data:
    URL in audio_url.url (vLLM's part; this server fetches nothing, so other URLs are refused). The
    encoding is read from the bytes; input_audio's `format` is not needed."""
    if part["type"] == "input_audio":
        inner = part.get("input_audio")
        encoded = inner.get("data") if isinstance(inner, dict) else None
    else:
        inner = part.get("audio_url")
        url = inner.get("url") if isinstance(inner, dict) else None
        if not isinstance(url, str) or not url.startswith("data:"):
            raise ApiError(400, f"Message {number}'s audio_url is not a data: URL; this server fetches nothing, so send the audio inline.",
                           "messages")
        encoded = url.partition(",")[2]
    if not isinstance(encoded, str) or not encoded:
        raise ApiError(400, f"Message {number}'s audio part has no base64 data.", "messages")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"Message {number}'s audio is not valid base64.", "messages") from None
    import soundfile as sf

    try:
        wav, rate = sf.read(io.BytesIO(raw), dtype="float32", always_2d=True)
    except RuntimeError:  # libsndfile's errors: not a format it reads, or a damaged file
        raise ApiError(400, f"Message {number}'s audio could not be read; send WAV, FLAC, OGG or MP3.", "messages") from None
    try:
        return load_message_audio((wav, rate), AUDIO_SAMPLE_RATE, MAX_AUDIO_SECONDS)
    except TTSInputError as exc:  # empty, silent, too long, NaN
        raise ApiError(400, str(exc), "messages") from None


async def _respond(call: ChatCall, service: ModelService, key: str, done: Callable[[], None]) -> Response:
    events = service.chat(call.request, call.checkpoint, key, wait=False)
    try:
        start = await run_in_threadpool(next, events)  # the request checked against the checkpoint (voice, control tokens, length) before any work
    except TTSInputError as exc:
        raise input_error(exc) from None
    reply = _Reply(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), start.checkpoint, service.model(OMNI.id, start.checkpoint).im_end)
    headers = {"X-Random-Weights": str(start.random_weights).lower()}
    if call.stream:
        return until_gone(_sse(events, call, reply), service, key, done, media_type="text/event-stream", headers=headers)
    try:
        collected = [event async for event in steps(events)]
    except TTSInputError as exc:  # a full engine queue is found once the thinker has read the prompt
        raise input_error(exc) from None
    finally:
        await run_in_threadpool(events.close)
    return await run_in_threadpool(lambda: JSONResponse(_completion(collected, call, reply), headers=headers))


def _completion(events: Iterable[StreamStart | TextDelta | Chunk | ChatEnd | StreamEnd], call: ChatCall, reply: _Reply) -> dict:
    """The whole reply as one `chat.completion`."""
    audio, end = [], None
    for event in events:
        if isinstance(event, Chunk):
            audio.append(event.audio)
        elif isinstance(event, ChatEnd):
            end = event
    message = {"role": "assistant", "content": end.text if call.text else None}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reply.finish_reason(end)}
    if audio:
        speech = np.concatenate(audio)
        message["audio"] = {"id": f"audio-{uuid.uuid4().hex[:16]}", "data": _base64(encode(speech, call.audio_format)),
                            "expires_at": reply.created + AUDIO_EXPIRES_S, "transcript": end.text}
        choice["audio_metadata"] = _metadata(speech, call.audio_format)
    return {"id": reply.id, "object": "chat.completion", "created": reply.created, "model": reply.model, "choices": [choice],
            "dropped_turns": end.dropped_turns}


def _sse(events: Iterator[StreamStart | TextDelta | Chunk | ChatEnd | StreamEnd | Waiting], call: ChatCall, reply: _Reply) -> Iterator[bytes | Waiting]:
    """The reply as Server-Sent Events: text and audio as they are made, the finish reason, [DONE]
    (and the reply's `Waiting`s, for `streaming.steps`)."""
    try:
        if call.text:
            yield reply.chunk("text", {"role": "assistant", "content": ""})
        for event in events:
            if isinstance(event, TextDelta) and call.text and event.text:
                yield reply.chunk("text", {"content": event.text})
            elif isinstance(event, Chunk):
                yield reply.chunk("audio", {"role": "assistant", "content": _base64(encode(event.audio, call.audio_format))},
                                  audio_metadata=_metadata(event.audio, call.audio_format))
            elif isinstance(event, ChatEnd):
                yield reply.chunk(None, {}, finish_reason=reply.finish_reason(event), dropped_turns=event.dropped_turns)
            elif isinstance(event, Waiting):
                yield event
    except TTSInputError as exc:  # after the 200 has gone out: the error is an event, as vllm-omni sends it
        yield _event(input_error(exc).body())
    finally:
        events.close()
    yield b"data: [DONE]\n\n"


def _event(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


def _base64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _metadata(audio: np.ndarray, audio_format: str) -> dict:
    return {"format": audio_format, "sample_rate_hz": SAMPLE_RATE, "frame_count": len(audio), "channels": 1}
