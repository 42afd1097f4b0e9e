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
and `speech.audio.done`); without streaming every format is one file. Warnings (text left unspoken,
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

from pipeline.engine import Chunk
from pipeline.errors import TTSInputError
from pipeline.request import SpeechRequest
from pipeline.server.common import SAMPLE_RATE, Access, ApiError, encode, input_error, pcm16, serve, until_gone
from pipeline.server.streaming import steps
from pipeline.service import API_TASK_TYPES, OMNI, TINY, ModelService, StreamEnd, StreamStart, Waiting

MEDIA_TYPES = {"pcm": "audio/pcm", "wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg"}
STREAMED_FORMATS = ("pcm", "wav")
TASK_TYPES = {name: kind for name, kind in API_TASK_TYPES.items() if kind != OMNI}  # what /v1/audio/speech speaks
FIELDS = {"model", "input", "voice", "response_format", "speed", "stream", "stream_format", "task_type", "language", "instructions", "ref_audio",
          "ref_text", "x_vector_only_mode", "voice_prompt", "max_new_tokens", "seed", "temperature", "top_k", "top_p", "repetition_penalty",
          "subtalker_temperature", "subtalker_top_k", "subtalker_top_p", "schedule"}
API_NAMES = {"text": "input", "speaker": "voice", "instruct": "instructions", "max_frames": "max_new_tokens"}  # request field -> body field
# Taken into the engine request as they are (its checks name a bad value); `schedule` is ours: frames per chunk.
PASSED_FIELDS = ("seed", "temperature", "top_k", "top_p", "repetition_penalty", "subtalker_temperature", "subtalker_top_k", "subtalker_top_p",
                 "schedule")


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
        data = [model_entry(service, kind, checkpoint) for kind, checkpoints in service.choices.items() if kind in API_TASK_TYPES.values()
                for checkpoint in checkpoints]
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
    entry = {"id": checkpoint, "object": "model", "owned_by": "local", "task_type": _task_name(kind), "loaded": service.is_loaded(kind, checkpoint),
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
    if stream and response_format not in STREAMED_FORMATS:
        raise ApiError(400, f"A streamed response is pcm or wav, not {response_format}.", "response_format")
    model_type, checkpoint = _model(data, service)
    fields = {k: data[k] for k in PASSED_FIELDS if data.get(k) is not None}
    if data.get("max_new_tokens") is not None:
        fields["max_frames"] = data["max_new_tokens"]
    reference = None
    if model_type != "base" and data.get("voice_prompt") is not None:
        raise ApiError(400, "'voice_prompt' (a saved voice) is for task_type Base.", "voice_prompt")
    if model_type == "custom_voice":
        fields["speaker"] = data.get("voice")
        fields["instruct"] = data.get("instructions")
    elif model_type == "voice_design":
        fields["instruct"] = data.get("instructions")  # required: the request's check says so, as on every surface
    elif data.get("voice_prompt") is not None:
        fields["voice_prompt"] = _saved_voice(data)
    else:
        reference = _reference_file(data.get("ref_audio"))
        fields.update(ref_audio=str(reference), ref_text=data.get("ref_text"), x_vector_only=data.get("x_vector_only_mode", False))
    try:
        request = SpeechRequest(text, language=data.get("language") or "auto", model_type=model_type, checkpoint=checkpoint,
                                **{k: v for k, v in fields.items() if v is not None}).validate()
    except (TTSInputError, TypeError) as exc:
        _remove(reference)
        field = getattr(exc, "field", None)  # a TypeError names none
        raise ApiError(400, str(exc), API_NAMES.get(field, field)) from None
    return SpeechCall(request, response_format, stream, reference, events=stream_format == "sse")


def _served(model: str, task: str | None, service: ModelService) -> tuple[str, str]:
    """(model type, checkpoint) of a listed checkpoint named by id (and task, where an id serves several)."""
    if task is not None and task not in API_TASK_TYPES:
        raise ApiError(400, f"'task_type' is one of {', '.join(API_TASK_TYPES)}, not '{task}'.", "task_type")
    kinds = [kind for kind, checkpoints in service.choices.items() if model in checkpoints and kind in API_TASK_TYPES.values()]
    if task is not None:
        kinds = [kind for kind in kinds if kind == API_TASK_TYPES[task]]
    if not kinds:
        raise ApiError(404, f"Model '{model}' is not served here{f' for {task}' if task else ''} (GET /v1/models lists them).", "model")
    if len(kinds) > 1:
        raise ApiError(400, f"Model '{model}' serves {', '.join(_task_name(k) for k in kinds)}: add ?task_type=.", "task_type")
    return kinds[0], model


def _model(data: dict, service: ModelService) -> tuple[str, str]:
    task = data.get("task_type")
    if task is not None and (not isinstance(task, str) or task not in TASK_TYPES):
        raise ApiError(400, f"'task_type' is one of {', '.join(TASK_TYPES)}, not '{task}'.", "task_type")
    model = data.get("model")
    kinds = [kind for kind, checkpoints in service.choices.items() if model in checkpoints and kind in TASK_TYPES.values()]
    if model is not None and model != TINY and not kinds:
        served = sorted({c for kind, cs in service.choices.items() if kind in TASK_TYPES.values() for c in cs})
        raise ApiError(404, f"Model '{model}' is not served here (GET /v1/models lists them: {', '.join(served)}).", "model")
    model_type = TASK_TYPES[task] if task else (kinds[0] if kinds else "custom_voice")
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
                yield sse({"type": "speech.audio.done"})
    finally:
        stream.close()
        _remove(call.reference)


def wav_header(data_bytes: int) -> bytes:
    """A 16-bit mono 24 kHz WAV header; 0xFFFFFFFF for a stream whose length is not known yet."""
    riff = 0xFFFFFFFF if data_bytes == 0xFFFFFFFF else 36 + data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, SAMPLE_RATE, SAMPLE_RATE * 2, 2, 16)
            + b"data" + struct.pack("<I", data_bytes))


def _task_name(model_type: str) -> str:
    return next(name for name, kind in API_TASK_TYPES.items() if kind == model_type)


def _remove(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path.parent, ignore_errors=True)
