"""`RemoteService`: the UI's entry point when the models run on another server. It offers the methods
of `ModelService` that the UI calls and yields the same items, so the tabs and the latency panel work
unchanged; only what is measured differs: a chunk's time is its arrival here, and the backend's
generation-side figures (generate / vocode ms, queue position) are not reported, so they are None.
"""
from __future__ import annotations

import base64
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn
from urllib.parse import quote

import httpx

from pipeline.contract.events import SAMPLE_RATE, SAMPLES_PER_FRAME, ChatEnd, Chunk, Fallback, ModelInfo, StreamEnd, StreamStart, TextDelta, VoiceInfo
from pipeline.contract.models import MODEL_TYPES, OMNI
from pipeline.contract.running import Running, check_reference_upload, content_hash
from pipeline.errors import TTSInputError
from pipeline.remote.backend import LOAD_TIMEOUT_S, Backend, StallRule
from pipeline.remote.chat import QWEN3_OMNI_VOICES, chat_body, reply_items
from pipeline.remote.speech import Connection, EndEvents, data_url, pcm_chunks, speech_body, unsent_settings
from pipeline.request import SpeechRequest

if TYPE_CHECKING:
    from pipeline.omni import ChatRequest

REFERENCES_KEPT = 8  # encoded reference recordings (a few MB each)


class RemoteService:
    """The UI's models served by the backend at `url` (this app's API, or vLLM-Omni), `key` its API key.
    Raises TTSInputError (BackendUnavailable) at once when the backend cannot be reached, refuses the
    key, or serves no model a tab can use: the tabs are made from what it serves. `stall`: when a
    stream whose audio has started is taken as stalled (see StallRule)."""

    def __init__(self, url: str, key: str | None = None, stall: StallRule | None = None):
        self.backend = Backend(url, key)
        self.stall = stall or StallRule()
        self.url = self.backend.url
        self.ours, models = self.backend.models()
        if not models:
            raise TTSInputError(f"The backend at {self.url} serves no Qwen3-TTS or Qwen3-Omni model (GET /v1/models); "
                                "vLLM-Omni names the task at the end of the model's name (-Base, -CustomVoice, -VoiceDesign).")
        self.choices = {kind: served for kind in MODEL_TYPES if (served := tuple(m.id for m in models if m.model_type == kind))}
        self._entries = {(m.model_type, m.id): m.entry for m in models}
        self._info: dict[tuple[str, str], ModelInfo] = {}
        self._references: OrderedDict[str, str] = OrderedDict()  # content hash -> data: URL
        self._lock = threading.Lock()
        self._running = Running()
        self.fallbacks: dict[str, Fallback] = {}  # a backend's checkpoints serve themselves

    @property
    def kind(self) -> str:
        return "this app" if self.ours else "vLLM-Omni"

    # ---- models ------------------------------------------------------------------------------

    def default_checkpoint(self, model_type: str) -> str:
        return self.choices[model_type][0]

    def random_weights(self, model_type: str, checkpoint: str | None = None) -> bool:
        entry = self._entries.get((model_type, checkpoint or self.default_checkpoint(model_type)), {})
        return bool(entry.get("random_weights", False))

    def stand_in(self, model_type: str, checkpoint: str | None = None) -> None:
        return None

    def is_loaded(self, model_type: str, checkpoint: str | None = None) -> bool:
        """Whether the first use will be quick: vLLM-Omni's one model is always loaded; this app says."""
        source = checkpoint or self.default_checkpoint(model_type)
        if not self.ours or (model_type, source) in self._info:
            return True
        entries = self.backend.get_json("/v1/models").get("data") or []
        return any(e.get("id") == source and e.get("task_type") == MODEL_TYPES[model_type].task_type and e.get("loaded") for e in entries)

    def load_progress(self, model_type: str, checkpoint: str | None = None) -> None:
        """The backend loads its checkpoints itself and does not say how far it is."""
        return None

    def info(self, model_type: str, checkpoint: str | None = None) -> ModelInfo:
        """The checkpoint's speakers and languages, as the backend reports them (asked once)."""
        source = checkpoint or self.default_checkpoint(model_type)
        self._check_served(model_type, source)
        key = (model_type, source)
        if key not in self._info:
            info = self._describe(model_type, source)
            with self._lock:
                self._info[key] = info
        return self._info[key]

    def _describe(self, model_type: str, source: str) -> ModelInfo:
        if self.ours:  # loads the checkpoint on first use, as a local tab would
            entry = self.backend.get_json(f"/v1/models/{quote(source, safe='')}", {"task_type": MODEL_TYPES[model_type].task_type}, LOAD_TIMEOUT_S)
            return ModelInfo(source, model_type, entry["voices"], entry["languages"], entry["supports_instruct"], entry["random_weights"])
        kind = MODEL_TYPES[model_type]
        if not kind.speech:
            return ModelInfo(source, model_type, QWEN3_OMNI_VOICES, [], False, False)
        # vLLM-Omni reports the preset speakers, not the languages (its error for a wrong one lists them);
        # whether a checkpoint follows instructions is read from its official name (0.6B CustomVoice: no).
        speakers = self._vllm_voices() if kind.speaker else []
        instruct = kind.needs_instruct or (kind.instruct and "0.6b" not in source.lower())
        return ModelInfo(source, model_type, speakers, ["auto"], instruct, False)

    def _vllm_voices(self) -> list[str]:
        data = self.backend.get_json("/v1/audio/voices")
        uploaded = {v.get("name") for v in data.get("uploaded_voices") or []}  # uploads are Base voices, not presets
        return [v for v in data.get("voices") or [] if v not in uploaded]

    def _check_served(self, model_type: str, checkpoint: str) -> None:
        if checkpoint not in self.choices.get(model_type, ()):
            served = ", ".join(self.choices.get(model_type, ())) or "none"
            raise TTSInputError(f"'{checkpoint}' is not one of the {model_type} models of the backend at {self.url} ({served}).")

    def model(self, model_type: str, checkpoint: str | None = None) -> NoReturn:
        """Local models only: what renders listening clips. Over a backend there is none to hand out."""
        raise TTSInputError(f"Rendering clips needs the models on this machine; this app runs against the backend at {self.url}. "
                            "Render the session with a local `python app.py`, or use systems that are folders of recordings.")

    # ---- voice clone -------------------------------------------------------------------------

    def prepare_voice(self, checkpoint: str | None, ref_audio: str | Path | None, ref_text: str | None, x_vector_only: bool) -> bool:
        """Check and encode a reference before Generate is pressed (the backend makes the voice prompt
        from it per request); False while the inputs cannot make one yet."""
        if ref_audio is None or not (x_vector_only or (ref_text or "").strip()):
            return False
        self._reference(ref_audio)
        return True

    def export_voice(self, checkpoint: str | None, ref_audio: str | Path, ref_text: str | None, x_vector_only: bool) -> None:
        """No voice file to download: over a backend the voice prompt is made there, per request."""
        return None

    def load_voice_file(self, checkpoint: str | None, path: str | Path) -> VoiceInfo:
        """What a voice file holds; it goes to the backend with each request, which checks it against its checkpoint."""
        if not self.ours:
            raise TTSInputError("vLLM-Omni takes no saved voices: clear the voice file and use the reference audio.")
        from pipeline import voice_file  # reads safetensors with torch: imported on the first voice file, not with the UI

        x_vector_only, ref_text, frames = voice_file.describe(voice_file.read(path))
        return VoiceInfo(x_vector_only, ref_text, frames * SAMPLES_PER_FRAME / SAMPLE_RATE)

    def _voice(self, checkpoint: str, request: SpeechRequest) -> str:
        """The voice a request sends: its saved voice as base64, or its reference recording as a data: URL."""
        if request.voice_prompt is None:
            return self._reference(request.ref_audio)
        from pipeline import voice_file

        self.load_voice_file(checkpoint, request.voice_prompt)  # a damaged file is told here, not by a 400
        return base64.b64encode(voice_file.read(request.voice_prompt)).decode()

    def _reference(self, ref_audio: str | Path | None) -> str:
        """The recording as a base64 data: URL, encoded once per content."""
        path = check_reference_upload(ref_audio)
        digest = content_hash(path)
        with self._lock:
            if digest in self._references:
                self._references.move_to_end(digest)
                return self._references[digest]
        encoded = data_url(path)
        with self._lock:
            self._references[digest] = encoded
            while len(self._references) > REFERENCES_KEPT:
                self._references.popitem(last=False)
        return encoded

    # ---- streaming ---------------------------------------------------------------------------

    def stream(self, request: SpeechRequest, key: str = "") -> Iterator[StreamStart | Chunk | StreamEnd]:
        """As `ModelService.stream`: a bad request raises TTSInputError (checked here, or the server's
        own message), then a StreamStart, the Chunks as they arrive, a StreamEnd. `stop(key)` closes
        the connection, which makes the backend free the request's row."""
        request = request.for_service()
        if request.greedy:
            raise TTSInputError("Greedy decoding is not offered over the HTTP API: give a seed for a repeatable take.")
        checkpoint = request.checkpoint or self.default_checkpoint(request.model_type)
        self._check_served(request.model_type, checkpoint)
        reference = self._voice(checkpoint, request) if MODEL_TYPES[request.model_type].reference else None
        warnings = self._unsent_warnings(request)
        body = speech_body(request, checkpoint, self.ours, reference)
        end = EndEvents()  # this app's backend tells them after the audio: text left unspoken, the words' times
        with self._call("/v1/audio/speech", body, key) as (response, connection, started):
            yield StreamStart(checkpoint, self._random_weights(response, request.model_type, checkpoint), warnings, backend=self.url)
            yield from pcm_chunks(response, connection, self.backend, started, end if self.ours else None)
        yield StreamEnd(connection.stopped, end.warnings, end.words)

    def chat(self, request: ChatRequest, checkpoint: str | None = None, key: str = "") -> Iterator[StreamStart | TextDelta | Chunk | ChatEnd | StreamEnd]:
        """As `ModelService.chat`: the reply's text and speech as they arrive, a ChatEnd, a StreamEnd; a new
        chat under `key` (barge-in) or `stop(key)` closes this one. The chunk schedule and the length
        of the speech are the backend's."""
        if request.greedy:
            raise TTSInputError("Greedy decoding is not offered over the HTTP API: give a seed for a repeatable reply.")
        source = checkpoint or self.default_checkpoint(OMNI.id)
        self._check_served(OMNI.id, source)
        with self._call("/v1/chat/completions", chat_body(request, source), key) as (response, connection, started):
            yield StreamStart(source, self._random_weights(response, OMNI.id, source), backend=self.url)
            end = None
            for item in reply_items(response, connection, self.backend, started):
                end = item if isinstance(item, ChatEnd) else end
                yield item
        yield StreamEnd(end.stopped)

    @contextmanager
    def _call(self, path: str, body: dict, key: str) -> Iterator[tuple[httpx.Response, Connection, float]]:
        """A streamed POST (its response, its connection, when it was sent), known under `key` while it
        runs: Stop, or the key's next run, closes it."""
        connection = Connection(self.stall)
        self._running.add(key, connection)
        try:
            started = time.perf_counter()
            with self.backend.post_stream(path, body) as response:
                connection.attach(response)
                yield response, connection, started
        finally:
            connection.end()
            self._running.remove(key, connection)

    def _random_weights(self, response: httpx.Response, model_type: str, checkpoint: str) -> bool:
        return response.headers.get("x-random-weights") == "true" or self.random_weights(model_type, checkpoint)

    def _unsent_warnings(self, request: SpeechRequest) -> list[str]:
        if self.ours or not (unsent := unsent_settings(request)):
            return []
        return [f"vLLM-Omni takes no {', '.join(unsent)} per request (its deploy config sets them): they were not applied; seed and length were."]

    def stop(self, key: str = "") -> bool:
        """Close the stream running under `key`, if any; True if there was one."""
        return self._running.stop(key)
