"""Process-wide model service for the app: which checkpoint serves which tab, loaded once and shared.

Every tab of the app asks this module for its model, its voice prompts and its audio stream; the
UI holds no model and no tensor. Loading is lazy (a tab's checkpoint loads when the tab is first
used), once per process per checkpoint, and thread-safe. A checkpoint that cannot be had (no
network and not cached, a bad directory) is replaced by the tiny random checkpoint of the same
type, and the reason is kept for the app's banner: a demo that starts and says why its audio is
noise beats one that does not start.
"""
from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from pipeline import memory_plan, voice_file
from pipeline.contract.events import (
    DEFAULT_SCHEDULE,
    DEFAULT_SPEAKER,
    DEFAULT_SYSTEM_PROMPT,
    MAX_REPLY_TOKENS,
    TINY,
    ChatEnd,
    Chunk,
    Fallback,
    ModelInfo,
    Queued,
    StreamEnd,
    StreamStart,
    TextDelta,
    VoiceInfo,
    Waiting,
)
from pipeline.contract.models import BASE, MODEL_TYPES, OMNI, SPEECH_TYPES
from pipeline.contract.running import MAX_UPLOAD_BYTES, Running, check_reference_upload, content_hash
from pipeline.errors import CheckpointError, TTSInputError
from pipeline.loading import torch_device, torch_dtype
from pipeline.omni import MAX_AUDIO_SECONDS, ChatRequest, OmniChat, Turn
from pipeline.request import SpeechRequest
from pipeline.tts import SAMPLES_PER_FRAME, TTS, VoicePrompt, planned_rows

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_SCHEDULE", "DEFAULT_SPEAKER", "DEFAULT_SYSTEM_PROMPT", "MAX_AUDIO_SECONDS", "MAX_REPLY_TOKENS", "MAX_UPLOAD_BYTES", "TINY", "ChatEnd",
           "ChatRequest", "Chunk", "Fallback", "ModelInfo", "ModelService", "Queued", "SpeechRequest", "StreamEnd", "StreamStart", "TTSInputError",
           "TextDelta", "Turn", "VoiceInfo", "Waiting", "check_reference_upload"]

HUB_CHECKPOINTS = {kind.id: kind.hub_checkpoints for kind in MODEL_TYPES.values()}  # each tab's choices unless --models says otherwise
VOICE_PROMPT_CACHE = 32  # voice prompts kept (a few kB to a few hundred kB each)


def scratch_directory(owner: object, prefix: str) -> Path:
    """A new temporary directory, removed with what it holds once `owner` is collected or the process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    weakref.finalize(owner, shutil.rmtree, path, True)
    return path


class ModelService:
    """Lazy, shared, thread-safe checkpoints per model type, voice prompts by content, and stoppable streams."""

    def __init__(
        self,
        choices: dict[str, tuple[str, ...]] | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        tiny: bool = False,
        tiny_dir: str | Path | None = None,
        compiled: bool = False,
        rows: int | None = None,
        fused: bool | None = None,
        free_memory: int | None = None,
    ):
        """`fused`: the fused Triton decode kernels (None: where the GPU runs them; see pipeline.kernels).
        `free_memory`: the bytes each model's rows are planned against (pipeline.memory_plan; None: the
        GPU's free memory when it loads, and no plan on the CPU)."""
        merged = dict(HUB_CHECKPOINTS)
        merged.update(choices or {})
        self.choices = {kind: (TINY,) for kind in MODEL_TYPES} if tiny else merged
        self.device, self.dtype, self.compiled, self.rows, self.fused = device, dtype, compiled, rows, fused
        self.free_memory = free_memory
        self._tiny_root = Path(tiny_dir) if tiny_dir else scratch_directory(self, "qwen3-tts-tiny-")
        self._models: dict[tuple[str, str], TTS | OmniChat] = {}  # (model type, checkpoint) -> model
        self._load_locks: dict[tuple[str, str], threading.Lock] = {}
        self._progress: dict[tuple[str, str], tuple[int, int]] = {}  # loads under way: graphs captured of all
        self._lock = threading.Lock()  # guards the dicts, never held during a load
        self._tiny_lock = threading.Lock()  # one writer of the tiny checkpoints at a time
        self.fallbacks: dict[str, Fallback] = {}
        self._voice_prompts: OrderedDict[tuple, VoicePrompt] = OrderedDict()
        self._exports = scratch_directory(self, "qwen3-tts-voices-")  # voice files for download
        self._running = Running()

    # ---- checkpoints -------------------------------------------------------------------------

    def default_checkpoint(self, model_type: str) -> str:
        return self.choices[model_type][0]

    def random_weights(self, model_type: str, checkpoint: str | None = None) -> bool:
        source = checkpoint or self.default_checkpoint(model_type)
        return source == TINY or source in self.fallbacks

    def stand_in(self, model_type: str, checkpoint: str | None = None) -> str | None:
        """TINY for a checkpoint that could not be had (its tab runs the tiny random one); None for one that serves itself."""
        return TINY if (checkpoint or self.default_checkpoint(model_type)) in self.fallbacks else None

    def probe(self, timeout: float = 5.0) -> None:
        """Fall back now for default Hub checkpoints that are neither cached nor reachable, so the
        banner is up from the first page view instead of after a failed download."""
        for model_type in MODEL_TYPES:
            source = self.default_checkpoint(model_type)
            if source == TINY or Path(source).expanduser().exists():
                continue
            reason = hub_unavailable_reason(source, timeout)
            if reason:
                self._fall_back(model_type, source, reason)

    def register(self, model_type: str, checkpoint: str, model: TTS | OmniChat) -> None:
        """Serve a model built elsewhere (the API benchmark's random weights at real size) as one more
        checkpoint of its tab."""
        with self._lock:
            self.choices[model_type] = (*(c for c in self.choices[model_type] if c != checkpoint), checkpoint)
            self._models[(model_type, checkpoint)] = model

    def is_loaded(self, model_type: str, checkpoint: str | None = None) -> bool:
        return (model_type, checkpoint or self.default_checkpoint(model_type)) in self._models

    def load_progress(self, model_type: str, checkpoint: str | None = None) -> tuple[int, int] | None:
        """While the checkpoint loads on a GPU: (graphs captured, graphs in all) of its engine, whose
        first runs compile the kernels; None before that stage and once it is loaded."""
        return self._progress.get((model_type, checkpoint or self.default_checkpoint(model_type)))

    def info(self, model_type: str, checkpoint: str | None = None) -> ModelInfo:
        """Load the checkpoint if needed and describe it for the tab."""
        source = checkpoint or self.default_checkpoint(model_type)
        model = self.model(model_type, source)
        random, stand_in = self.random_weights(model_type, source), self.stand_in(model_type, source)
        if isinstance(model, OmniChat):
            return ModelInfo(source, model_type, model.speakers, [], False, random, stand_in)
        return ModelInfo(source, model_type, model.speakers, model.languages, model.supports_instruct, random, stand_in)

    def preload(self) -> None:
        """Load every tab's default checkpoint now, before the first request."""
        for model_type in SPEECH_TYPES:
            self.model(model_type)

    def model(self, model_type: str, checkpoint: str | None = None) -> TTS | OmniChat:
        """The loaded model for `checkpoint` (default: the tab's first); loads it on first use."""
        source = checkpoint or self.default_checkpoint(model_type)
        if source not in self.choices[model_type]:
            raise TTSInputError(f"'{source}' is not one of this app's {model_type} checkpoints: {', '.join(self.choices[model_type])}.")
        key = (model_type, source)  # "tiny" names a different checkpoint for each type
        with self._lock:
            if key in self._models:
                return self._models[key]
            load_lock = self._load_locks.setdefault(key, threading.Lock())
        with load_lock:  # one load per checkpoint; other callers wait for it rather than load twice
            if key not in self._models:
                try:
                    tts = self._load(model_type, source)
                finally:
                    self._progress.pop(key, None)
                with self._lock:
                    self._models[key] = tts
        return self._models[key]

    def _progress_of(self, key: tuple[str, str]) -> Callable[[int, int], None]:
        return lambda done, total: self._progress.__setitem__(key, (done, total))

    def _load(self, model_type: str, source: str) -> TTS | OmniChat:
        if source == TINY or source in self.fallbacks:
            return self._tiny(model_type)
        log.info("loading %s checkpoint %s on %s (%s)", model_type, source, self.device, self.dtype)
        if not MODEL_TYPES[model_type].speech:
            try:
                return OmniChat.from_pretrained(source, device=self.device, dtype=self.dtype, rows=self.rows, compiled=self.compiled,
                                                fused=self.fused, vocoder_lanes=3 if self.device.startswith("cuda") else 1,
                                                free_memory=self.free_memory)
            except CheckpointError as exc:
                self._fall_back(model_type, source, str(exc))
                return self._tiny(model_type)
        try:
            tts = TTS.from_pretrained(source, device=self.device, dtype=self.dtype, compiled=self.compiled, rows=self.rows, fused=self.fused,
                                      free_memory=self.free_memory, progress=self._progress_of((model_type, source)))
        except CheckpointError as exc:
            self._fall_back(model_type, source, str(exc))
            return self._tiny(model_type)
        if tts.model_type != model_type:
            self._fall_back(model_type, source, f"it is a {tts.model_type} checkpoint, not {model_type}.")
            return self._tiny(model_type)
        if tts.device.type == "cuda":  # capture (and compile) now, not in the first user's TTFA
            tts.warm_up()
        return tts

    def _fall_back(self, model_type: str, source: str, reason: str) -> None:
        log.warning("%s: %s Serving the tiny random %s checkpoint instead.", source, reason, model_type)
        with self._lock:
            self.fallbacks[source] = Fallback(model_type, source, reason)

    def _tiny(self, model_type: str) -> TTS | OmniChat:
        key = (model_type, f"{TINY}:{model_type}")  # shared by the "tiny" choice and every fallback
        with self._tiny_lock:
            if key not in self._models:
                directory = self._tiny_directory(model_type)
                if not MODEL_TYPES[model_type].speech:
                    self._models[key] = OmniChat.from_pretrained(str(directory), device=self.device, dtype=self.dtype, fused=self.fused,
                                                                 free_memory=self.free_memory)
                else:
                    self._models[key] = TTS.from_pretrained(str(directory), device=self.device, dtype=self.dtype, rows=self.rows, fused=self.fused,
                                                            free_memory=self.free_memory)
            return self._models[key]

    def _tiny_directory(self, model_type: str) -> Path:
        """The tiny random checkpoint of `model_type`, written on first use (under `_tiny_lock`)."""
        from pipeline.tiny import write_tiny_checkpoint, write_tiny_omni_checkpoint

        directory = self._tiny_root / model_type
        if not directory.is_dir():  # written aside and renamed: a failed write leaves no half checkpoint
            partial = Path(tempfile.mkdtemp(prefix=f"{model_type}-", dir=self._tiny_root))
            if not MODEL_TYPES[model_type].speech:
                write_tiny_omni_checkpoint(partial, seed=0)
            else:
                write_tiny_checkpoint(partial, model_type, seed=0)
            partial.rename(directory)
        return directory

    def check_rows(self) -> None:
        """Before any model loads, where rows were asked for and are planned (on CUDA, or with `free_memory`):
        NotEnoughMemory with its sentence if they do not fit beside a TTS tab's default checkpoint on its
        own. Checked for the checkpoints whose configs are at hand (a local directory, a tiny one, the Hub
        cache); the others, and checkpoints whose weights alone do not fit, are checked when they load."""
        if self.rows is None or (self.free_memory is None and not self.device.startswith("cuda")):
            return
        asked = {"rows": self.rows, "fused": self.fused}
        for model_type in SPEECH_TYPES:
            source = self.default_checkpoint(model_type)
            directory = self._configs_at_hand(model_type, source)
            if directory is None:
                continue
            try:
                planned_rows(directory, source, torch_device(self.device), torch_dtype(self.dtype), self.free_memory, asked)
            except CheckpointError:  # a damaged or partly cached checkpoint: said when it loads
                continue
            except memory_plan.NotEnoughMemory as exc:
                if exc.field == "rows":  # not the weights, which are said when it loads
                    raise

    def _configs_at_hand(self, model_type: str, source: str) -> Path | None:
        """The directory holding `source`'s config files without a download, or None."""
        if source == TINY or source in self.fallbacks:
            with self._tiny_lock:
                return self._tiny_directory(model_type)
        if Path(source).expanduser().is_dir():
            return Path(source).expanduser()
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(source, allow_patterns=["config.json", "speech_tokenizer/config.json"], local_files_only=True))
        except Exception:  # not in the cache (LocalEntryNotFoundError), or not a Hub id: checked when it loads
            return None

    # ---- voice prompts -----------------------------------------------------------------------

    def voice_prompt(self, tts: TTS, ref_audio: str | Path | None, ref_text: str | None, x_vector_only: bool) -> VoicePrompt:
        """The voice prompt of a reference recording, computed once per (model, audio content, mode):
        a new transcript for the same audio reuses the speaker embedding and reference codes."""
        path = check_reference_upload(ref_audio)
        transcript = (ref_text or "").strip()
        key = (id(tts), content_hash(path), x_vector_only)
        cached = self._cached_voice(key)
        if cached is not None and (x_vector_only or transcript):
            return cached if x_vector_only else replace(cached, ref_text=transcript)
        return self._keep_voice(key, tts.create_voice_prompt(str(path), transcript, x_vector_only))  # raises for ICL without transcript

    def saved_voice(self, tts: TTS, source: str | Path | bytes) -> VoicePrompt:
        """The voice of a voice file (path or bytes), checked against `tts` and loaded once per (model, file content)."""
        data = voice_file.read(source)
        key = (id(tts), "saved", hashlib.sha256(data).hexdigest())
        cached = self._cached_voice(key)
        return cached if cached is not None else self._keep_voice(key, tts.load_voice_prompt(data))

    def voice(self, tts: TTS, request: SpeechRequest) -> VoicePrompt:
        """The voice a request of a reference-taking type speaks in: its saved voice, or its recording's."""
        if request.voice_prompt is not None:
            return self.saved_voice(tts, request.voice_prompt)
        return self.voice_prompt(tts, request.ref_audio, request.ref_text, request.x_vector_only)

    def _cached_voice(self, key: tuple) -> VoicePrompt | None:
        with self._lock:
            cached = self._voice_prompts.get(key)
            if cached is not None:
                self._voice_prompts.move_to_end(key)
        return cached

    def _keep_voice(self, key: tuple, prompt: VoicePrompt) -> VoicePrompt:
        with self._lock:
            self._voice_prompts[key] = prompt
            while len(self._voice_prompts) > VOICE_PROMPT_CACHE:
                self._voice_prompts.popitem(last=False)
        return prompt

    def prepare_voice(self, checkpoint: str | None, ref_audio: str | Path | None, ref_text: str | None, x_vector_only: bool) -> bool:
        """Compute a reference's voice prompt before Generate is pressed, so that the first generation
        does not pay for it; False while the inputs cannot make one yet (no audio, or ICL without transcript)."""
        if ref_audio is None or not (x_vector_only or (ref_text or "").strip()):
            return False
        self.voice_prompt(self.model(BASE.id, checkpoint), ref_audio, ref_text, x_vector_only)
        return True

    def export_voice(self, checkpoint: str | None, ref_audio: str | Path, ref_text: str | None, x_vector_only: bool) -> Path:
        """A reference's voice prompt (computed once, as for Generate) as a voice file to download."""
        tts = self.model(BASE.id, checkpoint)
        prompt = self.voice_prompt(tts, ref_audio, ref_text, x_vector_only)
        # Named by what made it, so that preparing the same voice again rewrites one file rather than adding one.
        made_of = f"{tts.name}\0{content_hash(ref_audio)}\0{x_vector_only}\0{prompt.ref_text}"
        name = f"voice-{Path(ref_audio).stem[:40]}-{hashlib.sha256(made_of.encode()).hexdigest()[:8]}{voice_file.SUFFIX}"
        return tts.save_voice_prompt(prompt, self._exports / name)

    def load_voice_file(self, checkpoint: str | None, path: str | Path) -> VoiceInfo:
        """Check a voice file against the checkpoint and load it now (Generate then finds it ready);
        what it holds, for the tab to show. A bad file raises TTSInputError naming its problem."""
        tts = self.model(BASE.id, checkpoint)
        prompt = self.saved_voice(tts, path)
        frames = 0 if prompt.ref_codes is None else prompt.ref_codes.shape[0]
        return VoiceInfo(not prompt.icl, prompt.ref_text, frames * SAMPLES_PER_FRAME / tts.sample_rate)

    # ---- streaming ---------------------------------------------------------------------------

    def stream(self, request: SpeechRequest, key: str = "", wait: bool = True) -> Iterator[StreamStart | Queued | Chunk | StreamEnd | Waiting]:
        """Validate `request` (TTSInputError before anything is generated), then yield a `StreamStart`,
        `Queued` records while it waits for a row, the audio `Chunk`s, and a `StreamEnd`.
        `stop(key)` ends it within one frame; so does closing the generator. With `wait=False`, a
        `Waiting` stands where it would block (for an event loop, which then holds no thread)."""
        request = request.for_service()
        source = request.checkpoint or self.default_checkpoint(request.model_type)
        tts = self.model(request.model_type, source)
        voice = None
        if MODEL_TYPES[request.model_type].reference:
            voice = self.voice(tts, request)
        handle = tts.submit(request, voice)  # a full queue raises EngineBusy, a TTSInputError
        self._running.add(key, handle)
        try:
            yield StreamStart(source, self.random_weights(request.model_type, source), list(handle.warnings),
                              stand_in=self.stand_in(request.model_type, source))
            yield from handle.events(wait)
            words = [word.as_dict() for word in tts.spoken_words(request, voice, handle)] if request.word_timestamps else None
            yield StreamEnd(handle.stopped, list(dict.fromkeys(handle.warnings)), words)
        finally:
            handle.close()
            self._running.remove(key, handle)

    def chat(self, request: ChatRequest, checkpoint: str | None = None, key: str = "",
             wait: bool = True) -> Iterator[StreamStart | TextDelta | Queued | Chunk | ChatEnd | StreamEnd | Waiting]:
        """Omni chat: like `stream` (`wait` included), with the reply's text deltas and a ChatEnd before
        the StreamEnd. A new chat under the same `key` stops the one before it."""
        source = checkpoint or self.default_checkpoint(OMNI.id)
        model = self.model(OMNI.id, source)
        reply = model.stream(request)  # a full engine queue is found later, as a TTSInputError of the stream
        self._running.add(key, reply)
        try:
            yield StreamStart(source, self.random_weights(OMNI.id, source), list(reply.warnings), stand_in=self.stand_in(OMNI.id, source))
            end = None
            for event in reply.items(wait):
                end = event if isinstance(event, ChatEnd) else end
                yield event
            yield StreamEnd(end.stopped, list(dict.fromkeys(end.warnings)))
        finally:
            reply.close()
            self._running.remove(key, reply)

    def stop(self, key: str = "") -> bool:
        """Stop the stream running under `key`, if any, within one frame; True if there was one."""
        return self._running.stop(key)


def hub_unavailable_reason(repo_id: str, timeout: float = 5.0) -> str | None:
    """None if `repo_id` is in the local Hugging Face cache or the Hub answers for it; else why not."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        snapshot_download(repo_id, allow_patterns=["config.json"], local_files_only=True)
        return None
    except Exception:  # not cached (LocalEntryNotFoundError) or an odd cache: ask the Hub
        pass
    try:
        HfApi().model_info(repo_id, timeout=timeout)
        return None
    except RepositoryNotFoundError:
        return "the Hugging Face Hub has no model with this id (or it is private)."
    except Exception as exc:  # offline, DNS failure, timeout, HF_HUB_OFFLINE=1: all mean "cannot have it now"
        return f"not in the local Hugging Face cache, and the Hugging Face Hub cannot be reached ({type(exc).__name__})."
