"""The speech API on the app's own server: OpenAI's `POST /v1/audio/speech` (plus the Qwen3-TTS fields
vllm-omni accepts) and `GET /v1/models` (with `GET /v1/models/{id}`, which loads a checkpoint and
describes it: what a remote UI needs for its speaker and language choices). Requests go through the
same model service and engine queue as the UI. Errors are JSON in OpenAI's shape with a 4xx status;
a reference recording comes as base64 in the body and is written to a file the server names, a saved
voice (`voice_prompt`) comes as base64 and is read from memory (no request field is a path).

Access (`common.Access`): with a key, every call needs it as a bearer token; a server listening beyond
localhost without a key keeps the API off; a client has at most a few requests in flight.

Streaming (`"stream": true`, or vllm-omni's `"stream_format": "audio"`) sends the audio as it is made:
raw 16-bit PCM (`pcm`) or a WAV whose header leaves the length open (`wav`); `"stream_format": "sse"`
sends OpenAI's Server-Sent Events (`speech.audio.delta` with base64 PCM, then `speech.audio.warning`s
and `speech.audio.done`); without streaming every format is one file. With `"word_timestamps": true`
(where the text is fed one token per frame: `"non_streaming_mode": false`, or Base's default) an SSE
stream also sends `speech.audio.words` before its done event: each word's start and end in seconds
of the audio; a raw stream or a file has nowhere to carry them, so the pair is refused. Warnings (text left unspoken,
an ignored instruction) come in the `X-Warnings` header (a JSON list): at the end of a whole file,
at the start of a raw stream (warnings found later reach only SSE clients).
"""
from __future__ import annotations

import base64
import binascii
import json
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pipeline.contract.events import SAMPLE_RATE, TINY, Chunk, StreamEnd, StreamStart, Waiting
from pipeline.contract.models import CUSTOM_VOICE, MODEL_TYPES, by_task
from pipeline.errors import TTSInputError
from pipeline.request import REQUEST_FIELDS, SpeechRequest, api_fields
from pipeline.server.common import Access, ApiError, encode, input_error, pcm16, serve, until_gone
from pipeline.server.streaming import steps
from pipeline.service import ModelService

MEDIA_TYPES = {"pcm": "audio/pcm", "wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg"}
STREAMED_FORMATS = ("pcm", "wav")
SPEECH_TASKS = {t.task_type: t.id for t in MODEL_TYPES.values() if t.speech}  # what /v1/audio/speech speaks
DEFAULT_TASK = CUSTOM_VOICE  # a body that names neither a task nor a model: as in vllm-omni
API_NAMES = dict(api_fields())  # request field -> body field, for the request fields the API takes
# The body's fields: the request's, how it names the model, and OpenAI's response options.
FIELDS = {*API_NAMES.values(), "model", "task_type", "response_format", "speed", "stream", "stream_format"}


@dataclass
class SpeechCall:
    request: SpeechRequest
    response_format: str
    stream: bool
    reference: Path | None = None  # a decoded reference recording, removed after the call
    events: bool = False  # streamed as Server-Sent Events (audio deltas, warnings, done) rather than raw audio


def speech_routes(service: ModelService, access: Access | None = None) -> list[Route]:
    access = access or Access()

    async def speech(request: Request) -> Response:
        return await serve(request, access, lambda data: parse_speech(data, service), lambda call, key, done: _respond(call, service, key, done), service.stop)

    async def models(request: Request) -> Response:
        try:
            access.check(request)
        except ApiError as exc:
            return exc.response()
        data = [model_entry(service, kind, checkpoint) for kind, checkpoints in service.choices.items() for checkpoint in checkpoints]
        return JSONResponse({"object": "list", "data": data})

    async def model(request: Request) -> Response:
        """One checkpoint, loaded on first use (as a first speech request would load it) and described."""
        try:
            access.check(request)
            kind, checkpoint = _served(request.path_params["model"], request.query_params.get("task_type"), service)
            await run_in_threadpool(service.info, kind, checkpoint)
        except ApiError as exc:
            return exc.response()
        except TTSInputError as exc:  # a checkpoint that cannot be loaded says why
            return ApiError(400, str(exc)).response()
        return JSONResponse(model_entry(service, kind, checkpoint))

    return [Route("/v1/audio/speech", speech, methods=["POST"]), Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"])]


def model_entry(service: ModelService, kind: str, checkpoint: str) -> dict:
    """A checkpoint as /v1/models lists it: OpenAI's fields, vllm-omni's `task_type` (here also "Omni"),
    and ours; a loaded one also names its `voices` (vllm-omni's word for the speakers), languages and
    whether it follows instructions (nothing is loaded to list a checkpoint)."""
    entry = {"id": checkpoint, "object": "model", "owned_by": "local", "task_type": MODEL_TYPES[kind].task_type, "loaded": service.is_loaded(kind, checkpoint),
             "random_weights": service.random_weights(kind, checkpoint)}
    if entry["loaded"]:
        info = service.info(kind, checkpoint)
        entry.update(voices=info.speakers, languages=info.languages, supports_instruct=info.supports_instruct)
    return entry


def parse_speech(data: dict, service: ModelService) -> SpeechCall:
    """Check a /v1/audio/speech body (before any work) and make the engine request."""
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise ApiError(400, f"Unknown field '{unknown[0]}'.", unknown[0])
    text = data.get("input")
    if not isinstance(text, str) or not text.strip():
        raise ApiError(400, "'input' is required: the text to speak.", "input")
    if data.get("speed", 1.0) != 1.0:
        raise ApiError(400, "'speed' is not supported: Qwen3-TTS speaks at its own pace (leave it out or 1.0).", "speed")
    stream_format = data.get("stream_format")
    response_format = data.get("response_format", "pcm" if stream_format == "sse" else "wav")
    if not isinstance(response_format, str) or response_format not in MEDIA_TYPES:
        raise ApiError(400, f"'response_format' is one of {', '.join(MEDIA_TYPES)}, not '{response_format}'.", "response_format")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' is true or false.", "stream")
    if stream_format not in (None, "audio", "sse"):
        raise ApiError(400, f"'stream_format' is 'audio' (raw audio bytes) or 'sse' (Server-Sent Events), not '{stream_format}'.", "stream_format")
    if stream_format == "sse" and response_format != "pcm":
        raise ApiError(400, f"SSE events carry pcm audio, not {response_format}.", "response_format")
    stream = stream or stream_format is not None  # as in vllm-omni: a stream_format streams whatever 'stream' says
    if data.get("word_timestamps") is True and stream_format != "sse":
        raise ApiError(400, "Word timestamps come as Server-Sent Events: add \"stream_format\": \"sse\" (with response_format pcm).", "word_timestamps")
    if stream and response_format not in STREAMED_FORMATS:
        raise ApiError(400, f"A streamed response is pcm or wav, not {response_format}.", "response_format")
    model_type, checkpoint = _model(data, service)
    fields = _request_fields(data, model_type)
    reference = None
    if MODEL_TYPES[model_type].reference:
        if data.get("voice_prompt") is not None:
            fields["voice_prompt"] = _saved_voice(data)
        else:
            reference = _reference_file(data.get("ref_audio"))
            fields["ref_audio"] = str(reference)
    try:
        request = SpeechRequest(text, model_type=model_type, checkpoint=checkpoint, **fields).validate()
    except (TTSInputError, TypeError) as exc:
        _remove(reference)
        field = getattr(exc, "field", None)  # a TypeError names none
        raise ApiError(400, str(exc), API_NAMES.get(field, field)) from None
    return SpeechCall(request, response_format, stream, reference, events=stream_format == "sse")


def _request_fields(data: dict, model_type: str) -> dict:
    """The request fields the body sets, of those the model type takes (vllm-omni's clients send OpenAI's
    `voice` with every task, for one); text left empty counts as left out. The reference recording
    and the saved voice, which come as base64, are the caller's."""
    kind = MODEL_TYPES[model_type]
    if not kind.reference and data.get("voice_prompt") is not None:
        takers = ", ".join(t.task_type for t in MODEL_TYPES.values() if t.reference)
        raise ApiError(400, f"'voice_prompt' (a saved voice) is for task_type {takers}.", "voice_prompt")
    fields = {}
    for name, body in API_NAMES.items():
        spec, value = REQUEST_FIELDS[name], data.get(body)
        if name in ("text", "ref_audio", "voice_prompt") or value is None or (spec.kind == "text" and value == "") or not kind.takes(spec.role):
            continue
        fields[name] = value
    return fields


def _served(model: str, task: str | None, service: ModelService) -> tuple[str, str]:
    """(model type, checkpoint) of a listed checkpoint named by id (and task, where an id serves several)."""
    kind = by_task(task) if isinstance(task, str) else None
    if task is not None and kind is None:
        raise ApiError(400, f"'task_type' is one of {', '.join(t.task_type for t in MODEL_TYPES.values())}, not '{task}'.", "task_type")
    kinds = [k for k, checkpoints in service.choices.items() if model in checkpoints and (kind is None or k == kind.id)]
    if not kinds:
        raise ApiError(404, f"Model '{model}' is not served here{f' for {task}' if task else ''} (GET /v1/models lists them).", "model")
    if len(kinds) > 1:
        raise ApiError(400, f"Model '{model}' serves {', '.join(MODEL_TYPES[k].task_type for k in kinds)}: add ?task_type=.", "task_type")
    return kinds[0], model


def _model(data: dict, service: ModelService) -> tuple[str, str]:
    task = data.get("task_type")
    if task is not None and (not isinstance(task, str) or task not in SPEECH_TASKS):
        raise ApiError(400, f"'task_type' is one of {', '.join(SPEECH_TASKS)} (default: {DEFAULT_TASK.task_type}), not '{task}'.", "task_type")
    model = data.get("model")
    speech = SPEECH_TASKS.values()
    kinds = [kind for kind, checkpoints in service.choices.items() if model in checkpoints and kind in speech]
    if model is not None and model != TINY and not kinds:
        served = sorted({c for kind, cs in service.choices.items() if kind in speech for c in cs})
        raise ApiError(404, f"Model '{model}' is not served here (GET /v1/models lists them: {', '.join(served)}).", "model")
    model_type = SPEECH_TASKS[task] if task else (kinds[0] if kinds else DEFAULT_TASK.id)
    if kinds and model_type not in kinds:
        raise ApiError(400, f"Model '{model}' does not do {task}.", "task_type")
    return model_type, model if model is not None else service.default_checkpoint(model_type)


def _reference_file(encoded) -> Path:
    if not isinstance(encoded, str) or not encoded:
        raise ApiError(400, "Base (voice clone) needs 'ref_audio': a recording as base64 (a data: URL or plain base64), or 'voice_prompt': a saved voice.",
                       "ref_audio")
    audio = _base64(encoded, "ref_audio")
    # Named after the field, in a folder of its own: a message about the file names what the client sent.
    path = Path(tempfile.mkdtemp(prefix="api-ref-")) / "ref_audio"
    path.write_bytes(audio)
    return path


def _saved_voice(data: dict) -> bytes:
    """A voice file (Export voice, synth --save-voice-prompt) as base64: its bytes, read by the pipeline, never a path."""
    # The file holds the transcript and mode it was made with: other ones in the body would be ignored, so they are refused.
    if data.get("ref_audio") is not None:
        raise ApiError(400, "Give either 'ref_audio' (a recording) or 'voice_prompt' (a saved voice), not both.", "voice_prompt")
    if data.get("ref_text") or data.get("x_vector_only_mode"):
        raise ApiError(400, "A saved voice brings its own transcript and mode: leave 'ref_text' and 'x_vector_only_mode' out with 'voice_prompt'.",
                       "voice_prompt")
    if not isinstance(data["voice_prompt"], str):
        raise ApiError(400, "'voice_prompt' is a voice file as base64 (a data: URL or plain base64).", "voice_prompt")
    return _base64(data["voice_prompt"], "voice_prompt")


def _base64(encoded: str, field: str) -> bytes:
    payload = encoded.split(",", 1)[1] if encoded.startswith("data:") else encoded
    try:
        content = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"'{field}' is not valid base64.", field) from None
    if not content:
        raise ApiError(400, f"'{field}' is empty.", field)
    return content


async def _respond(call: SpeechCall, service: ModelService, key: str, done: Callable[[], None]) -> Response:
    stream = service.stream(call.request, key, wait=False)
    try:
        start = await run_in_threadpool(next, stream)  # validation against the checkpoint (speaker, language, reference audio)
    except Exception as exc:
        stream.close()
        _remove(call.reference)
        if isinstance(exc, TTSInputError):
            raise input_error(exc, API_NAMES) from None
        raise
    headers = {"X-Sample-Rate": str(SAMPLE_RATE), "X-Random-Weights": str(start.random_weights).lower()}
    if call.stream:  # the warnings known now; those of the end come as events in an SSE stream
        return until_gone(_streamed(stream, call), service, key, done, headers=headers | warnings_header(start.warnings),
                          media_type="text/event-stream" if call.events else MEDIA_TYPES[call.response_format])
    try:
        items = [item async for item in steps(stream) if isinstance(item, (Chunk, StreamEnd))]
    finally:
        await run_in_threadpool(stream.close)
        _remove(call.reference)
    audio = np.concatenate([item.audio for item in items if isinstance(item, Chunk)] or [np.zeros(0, np.float32)])
    warnings = next((item.warnings for item in items if isinstance(item, StreamEnd)), start.warnings)
    return Response(await run_in_threadpool(encode, audio, call.response_format), media_type=MEDIA_TYPES[call.response_format],
                    headers=headers | warnings_header(warnings))


def warnings_header(warnings: list[str]) -> dict[str, str]:
    """`X-Warnings`: what the user should know (e.g. text left unspoken), as a JSON list of sentences (ASCII-escaped, as headers must be)."""
    return {"X-Warnings": json.dumps(warnings)} if warnings else {}


def sse(event: dict) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def _streamed(stream: Iterator[StreamStart | Chunk | StreamEnd | Waiting], call: SpeechCall) -> Iterator[bytes | Waiting]:
    """Audio bytes as each chunk is made (and the stream's `Waiting`s, for `streaming.steps`); the
    engine's row is freed if the client goes away."""
    try:
        if call.response_format == "wav":
            yield wav_header(0xFFFFFFFF)
        for item in stream:
            if isinstance(item, Chunk):
                yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(pcm16(item.audio)).decode()}) if call.events else pcm16(item.audio)
            elif isinstance(item, Waiting):
                yield item
            elif isinstance(item, StreamEnd) and call.events:
                for warning in item.warnings:
                    yield sse({"type": "speech.audio.warning", "message": warning})
                if item.words is not None:
                    yield sse({"type": "speech.audio.words", "words": item.words})
                yield sse({"type": "speech.audio.done"})
    finally:
        stream.close()
        _remove(call.reference)


def wav_header(data_bytes: int) -> bytes:
    """A 16-bit mono 24 kHz WAV header; 0xFFFFFFFF for a stream whose length is not known yet."""
    riff = 0xFFFFFFFF if data_bytes == 0xFFFFFFFF else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, SAMPLE_RATE, SAMPLE_RATE * 2, 2, 16)
            + b"data" + struct.pack("<I", data_bytes))


def _remove(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path.parent, ignore_errors=True)
