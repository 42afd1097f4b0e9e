"""Omni chat, the entry point: a Qwen3-Omni checkpoint answers a conversation in streamed text and
streamed speech.

The thinker (transformers' module) writes every conversation's reply one token a step, all
conversations in one batched step on its scheduler thread; each token goes to the chat at once and
to the talker, which runs on the engine (one row of the batched
CUDA-graph decode step per conversation, code2wav as its per-listener vocoder). The talker's
prompt is made from the thinker's prefill and the first token; after it, one token per frame, as
the thinker writes them: when the thinker is behind, the talker's row waits (the engine's streamed
text); after the last token, tts_eos once, then tts_pad until the talker ends the speech.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline import memory_plan
from pipeline.audio import load_message_audio
from pipeline.codec import MultiStreamDecoder
from pipeline.config_types import ROPE, check_config, dataclass_schema
from pipeline.contract.events import DEFAULT_SPEAKER, DEFAULT_SYSTEM_PROMPT, MAX_REPLY_TOKENS, ChatEnd, TextDelta
from pipeline.contract.models import OMNI
from pipeline.engine import DEFAULT_SCHEDULE, BatchDecoder, Chunk, DecodeConfig, Engine, Handle, Job, Mailbox, Queued, SamplingConfig, Segment, Waiting
from pipeline.errors import CheckpointError, TTSInputError
from pipeline.loading import load_part, read_json, resolve_checkpoint, torch_device, torch_dtype
from pipeline.model import CodePredictorConfig
from pipeline.omni.code2wav import Code2Wav, Code2WavConfig
from pipeline.omni.conversation import AUDIO_SAMPLE_RATE, MAX_AUDIO_SECONDS, ThinkerInputs, Turn, build_inputs, check_turns
from pipeline.omni.prompt import PromptIds, assistant_first, assistant_prefix, text_specials, user_part
from pipeline.omni.talker import OmniTalker, OmniTalkerConfig, TalkerTextConfig
from pipeline.omni.thinker import Thinker, ThinkerSampling
from pipeline.request import MAX_SCALE, MAX_SEED, MAX_TOP_K, check_integer, check_number, check_unicode

log = logging.getLogger(__name__)

HUB_ID = OMNI.hub_checkpoints[0]
REQUIRED_FILES = ("config.json", "vocab.json", "merges.txt", "tokenizer_config.json", "preprocessor_config.json")
MAX_PROMPT = 2030  # thinker positions of the conversation (so the talker's prompt fits its largest prefill); older turns are dropped beyond
THINKER_MAX_SEQ = MAX_PROMPT + MAX_REPLY_TOKENS  # thinker positions per conversation (its cache row)
DEFAULT_ROWS = {"cuda": 8, "cpu": 2}  # conversations speaking at once; on CUDA fewer where the free memory holds fewer (pipeline.memory_plan)
TALKER_MAX_SEQ = 4096  # talker positions per conversation: the user turns + 9 + frames
CLOSE_TIMEOUT_S = 10.0
SPEECH_TAIL_FRAMES = 25  # frames a reply may speak beyond one per token before it is cut (the talker ends sooner)
MAX_REPLY_FRAMES = 2 * MAX_REPLY_TOKENS + SPEECH_TAIL_FRAMES  # speech frames at most: what the longest reply may speak
FRAME_SECONDS = 0.08
# The talker samples as transformers' Qwen3-Omni generate does; its code predictor with top-k 50, top-p 0.8.
TALKER_SAMPLING = SamplingConfig(do_sample=True, temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05,
                                 subtalker_dosample=True, subtalker_temperature=1.0, subtalker_top_k=50, subtalker_top_p=0.8)
MEMORY_HEADROOM = 1.15  # caches, activations, CUDA graphs and the allocator's slack on top of the weights
KNOWN_PARAMETERS = {HUB_ID: 35_260_000_000}  # checked before a download of ~70 GB


# The keys of Qwen3-Omni's config.json that our loaders read (PromptIds, the talker, code2wav), by their JSON types.
# Every config object transformers builds reads these two keys of its base class as objects.
LABELS = {"id2label": dict[str, str] | None, "label2id": dict[str, int] | None}
OMNI_CONFIG = {
    **LABELS,
    **{name: int for name in ("im_start_token_id", "user_token_id", "assistant_token_id", "tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id")},
    "architectures": list[str] | None,  # checked by transformers when it reads the file
    "transformers_version": str | None,
    "talker_config": {
        **LABELS,
        "text_config": LABELS | dataclass_schema(TalkerTextConfig, {TalkerTextConfig: {"rope_parameters": ROPE, "num_local_experts": int}}),
        "code_predictor_config": LABELS | dataclass_schema(CodePredictorConfig, {CodePredictorConfig: {"rope_parameters": ROPE}}),
        **{name: int for name in ("thinker_hidden_size", "codec_eos_token_id", "accept_hidden_layer", "codec_nothink_id", "codec_think_bos_id",
                                  "codec_think_eos_id", "codec_pad_id", "codec_bos_id")},
        "speaker_id": dict[str, int],
    },
    "code2wav_config": LABELS | dataclass_schema(Code2WavConfig, {Code2WavConfig: {"rope_parameters": ROPE}}),
    "thinker_config": {
        **LABELS,
        **{name: int for name in ("audio_token_id", "image_token_id", "video_token_id")},
        "audio_config": LABELS,
        "vision_config": {**LABELS, "rope_parameters": {"rope_theta": float, "rope_type": str}},
        # Read by transformers' thinker but not declared (so not checked) by its config classes.
        "text_config": {**LABELS, "head_dim": int | None, "rope_parameters": {"rope_theta": float, "rope_type": str, "mrope_section": list[int],
                                                                                "interleaved": bool}},
    },
}


@dataclass
class ChatRequest:
    turns: list[Turn]  # the conversation so far, ending with the user's new message
    system: str = DEFAULT_SYSTEM_PROMPT
    speaker: str = DEFAULT_SPEAKER
    greedy: bool = False  # thinker, talker and code predictor greedy (the talker's repetition penalty stays)
    seed: int | None = None
    max_new_tokens: int = MAX_REPLY_TOKENS
    max_frames: int | None = None  # speech frames (80 ms); None: as many as the reply needs
    schedule: tuple[int, ...] = DEFAULT_SCHEDULE
    # The thinker's sampling (None: generation_config.json's); temperature 0 means greedy. The talker keeps its own.
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0: no top-k cut
    speak: bool = True  # False: text only, the talker is not started

    def validate(self) -> "ChatRequest":
        """The checks that need no model, with the sentences a SpeechRequest gives the fields both have
        (seed, top_p, top_k, max_frames); returns self with whole-number floats made ints."""
        check_turns(self.turns)
        for number, turn in enumerate(self.turns, 1):
            check_unicode(f"Message {number}", turn.text, "messages")
        check_unicode("The system prompt", self.system, "system")
        check_unicode("speaker", self.speaker)
        self.seed = check_integer("seed", self.seed, 0, MAX_SEED)
        self.max_new_tokens = check_integer("max_new_tokens", self.max_new_tokens, 1, MAX_REPLY_TOKENS)
        self.max_frames = check_integer("max_frames", self.max_frames, 1, MAX_REPLY_FRAMES)
        self.temperature = check_number("temperature", self.temperature, lambda v: 0 <= v <= MAX_SCALE,
                                        f"from 0 to {MAX_SCALE} (0: always the most likely token)")
        self.top_p = check_number("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        self.top_k = check_integer("top_k", self.top_k, 0, MAX_TOP_K)
        return self


@dataclass
class ChatReply:
    text: str
    tokens: list[int]
    audio: np.ndarray  # float32 at 24 kHz
    codes: np.ndarray  # int64 [frames, 16]
    warnings: list[str]


@dataclass
class _Prepared:
    inputs: ThinkerInputs
    speaker: int
    sampling: SamplingConfig
    thinker_sampling: ThinkerSampling
    seed: int
    max_frames: int
    max_new_tokens: int
    schedule: tuple[int, ...]
    speak: bool
    warnings: list[str]


class OmniChat:
    def __init__(self, thinker: Thinker, tokenizer, feature_extractor, talker: OmniTalker, code2wav: Code2Wav, ids: PromptIds,
                 generation_config: dict, name: str, rows: int | None = None, max_seq: int = TALKER_MAX_SEQ,
                 use_cuda_graphs: bool = True, compiled: bool = False, max_queue: int = 64, vocoder_lanes: int = 1, fused: bool | None = None):
        self.thinker, self.tokenizer, self.feature_extractor = thinker, tokenizer, feature_extractor
        self.talker, self.code2wav, self.ids, self.name = talker, code2wav, ids, name
        self.thinker_sampling = ThinkerSampling.from_generation_config(generation_config)
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        device = talker.codec_head.weight.device
        self.rows = rows or DEFAULT_ROWS.get(device.type, 2)
        thinker.use_graphs(use_cuda_graphs)
        with torch.inference_mode():
            self.specials = text_specials(talker, thinker.model.get_input_embeddings(), ids).to(talker.codec_head.weight.dtype)
            settings = DecodeConfig.for_talker(talker, self.rows, max_seq, use_cuda_graphs, compiled, fused=fused, min_new_tokens=0)
            decoder = BatchDecoder(talker, self.specials[0], settings)
            vocoder = MultiStreamDecoder(code2wav, self.rows, use_cuda_graphs, vocoder_lanes)
            self.engine = Engine(decoder, vocoder, max_queue=max_queue)

    @classmethod
    def from_pretrained(cls, source: str = HUB_ID, device: str = "cpu", dtype: str = "float32", free_memory: int | None = None,
                        **options) -> "OmniChat":
        """From a Hugging Face Hub id or a local directory in the official layout; the free memory of
        the device is checked against the weights first, and, on CUDA or wherever `free_memory` (bytes)
        is given, against the rows (pipeline.memory_plan): those asked for if they fit, else
        NotEnoughMemory; none asked for, as many as fit up to the default."""
        from transformers import AutoTokenizer, WhisperFeatureExtractor

        torch_dev, torch_dt = torch_device(device), torch_dtype(dtype)
        if source in KNOWN_PARAMETERS:
            check_memory(None, torch_dev, torch_dt, KNOWN_PARAMETERS[source])
        directory = resolve_checkpoint(source, REQUIRED_FILES)
        config = read_config(directory)
        check_memory(directory, torch_dev, torch_dt)
        ids = PromptIds.from_config(config)
        talker_raw = config.get("talker_config") or {}
        options["rows"] = planned_rows(directory, config, source, torch_dev, torch_dt, free_memory, options)
        rows = options.get("rows") or DEFAULT_ROWS.get(torch_dev.type, 2)
        thinker = Thinker.from_pretrained(directory, torch_dev, torch_dt, int(talker_raw.get("accept_hidden_layer", 24)),
                                          rows=rows, max_len=THINKER_MAX_SEQ)
        talker = load_talker(directory, talker_raw, torch_dev, torch_dt)
        # code2wav in float32 whatever the rest runs in, as the Qwen3-TTS codec (streamed == offline).
        code2wav = Code2Wav.from_pretrained(directory, torch_dev)
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
        feature_extractor = WhisperFeatureExtractor.from_pretrained(str(directory))
        generation = read_json(directory, "generation_config.json") if (directory / "generation_config.json").is_file() else {}
        return cls(thinker, tokenizer, feature_extractor, talker, code2wav, ids, generation, str(source), **options)

    @property
    def speakers(self) -> list[str]:
        return sorted(name.capitalize() for name in self.ids.speakers)

    @property
    def sample_rate(self) -> int:
        return 24000

    # ---- requests ----------------------------------------------------------------------------

    def prepare(self, request: ChatRequest) -> _Prepared:
        """Everything checked and encoded before any work starts."""
        request.validate()
        speaker = self.ids.speaker(request.speaker)
        schedule = tuple(int(n) for n in request.schedule)
        if not schedule or min(schedule) < 1:
            raise TTSInputError(f"A chunk schedule is a list of positive frame counts, not {list(request.schedule)}.")
        thinker_sampling = self._thinker_sampling(request)
        inputs = build_inputs(self.tokenizer, self.feature_extractor, [_with_audio_loaded(t) for t in request.turns], request.system, MAX_PROMPT)
        warnings = []
        if inputs.dropped_turns:
            dropped = inputs.dropped_turns
            warnings.append(f"The conversation was longer than the model's context: the {dropped} oldest turn{'s were' if dropped > 1 else ' was'} left out.")
        user_positions = int(inputs.input_ids.shape[1])  # at most; the talker reads only the user turns
        room = self.engine.decoder.max_frames(user_positions + 9)
        max_frames = min(request.max_frames or 2 * request.max_new_tokens + SPEECH_TAIL_FRAMES, room)
        seed = request.seed if request.seed is not None else int(np.random.default_rng().integers(2**31))
        sampling = TALKER_SAMPLING.greedy() if request.greedy else TALKER_SAMPLING
        return _Prepared(inputs, speaker, sampling, thinker_sampling, seed, max_frames, request.max_new_tokens, schedule, request.speak, warnings)

    def _thinker_sampling(self, request: ChatRequest) -> ThinkerSampling:
        """The checkpoint's thinker sampling with the request's overrides; greedy, or temperature 0, is argmax."""
        overrides = {name: value for name in ("temperature", "top_p", "top_k") if (value := getattr(request, name)) is not None}
        if request.greedy or overrides.get("temperature") == 0:
            overrides.pop("temperature", None)  # the sampler divides by it even for rows that take the argmax
            overrides["do_sample"] = False
        return dataclasses.replace(self.thinker_sampling, **overrides)

    def stream(self, request: ChatRequest) -> "ChatStream":
        """The reply as it is made (see ChatStream). Bad input raises TTSInputError here, before any work."""
        return ChatStream(self, self.prepare(request))

    def reply(self, request: ChatRequest) -> ChatReply:
        """The whole reply at once (text, audio, codes)."""
        audio, end = [], None
        for event in self.stream(request):
            if isinstance(event, Chunk):
                audio.append(event.audio)
            elif isinstance(event, ChatEnd):
                end = event
        wav = np.concatenate(audio) if audio else np.zeros(0, dtype=np.float32)
        return ChatReply(end.text, end.tokens, wav, end.codes, end.warnings)


class ChatStream:
    """One reply in the making. Iterate for text deltas, queue positions while the talker waits for
    a row, audio chunks (their `elapsed_ms` counted from the start of the request) and, last, a
    ChatEnd. `close()` (from any thread: Stop, a new message) stops the thinker and the talker at
    once; the iteration then ends with a ChatEnd marked stopped. `items(wait=False)` yields a
    `Waiting` where it would block (an event loop's reader holds no thread meanwhile)."""

    def __init__(self, chat: OmniChat, prepared: _Prepared):
        self.started = time.perf_counter()
        self.events = Mailbox()
        self.stop = threading.Event()
        self.warnings = list(prepared.warnings)
        self.turn = _Turn(chat, prepared, self.events, self.stop, self.started)
        self.worker = threading.Thread(target=self.turn.run, name="omni-thinker", daemon=True)
        self.worker.start()

    def __iter__(self) -> Iterator[TextDelta | Queued | Chunk | ChatEnd]:
        return self.items()

    def items(self, wait: bool = True) -> Iterator[TextDelta | Queued | Chunk | ChatEnd | Waiting]:
        first_audio_ms, frames = None, 0
        try:
            while True:
                if not wait and self.events.empty():
                    yield Waiting(self.events.when_ready)
                    continue
                event = self.events.get()
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, Chunk):
                    event = dataclasses.replace(event, elapsed_ms=(time.perf_counter() - self.started) * 1000.0)
                    first_audio_ms = event.elapsed_ms if first_audio_ms is None else first_audio_ms
                    frames += event.frames
                if isinstance(event, ChatEnd):
                    event.first_audio_ms, event.frames = first_audio_ms, frames
                    yield event
                    return
                yield event
        finally:
            self.close()
            self.worker.join(CLOSE_TIMEOUT_S)

    def close(self) -> None:
        self.stop.set()
        self.turn.close()


class _Turn:
    """One reply: the thinker's loop on its own thread, the talker's row on the engine."""

    def __init__(self, chat: OmniChat, prepared: _Prepared, events: queue.Queue, stop: threading.Event, started: float):
        self.chat, self.prepared, self.events, self.stop, self.started = chat, prepared, events, stop, started
        self.handle: Handle | None = None
        self.speech_submitted = threading.Event()  # _start_speech has run (on the thinker's hand-off thread)
        self.speech_error: BaseException | None = None
        self.forward: threading.Thread | None = None  # hands the row's audio to the events
        self.lock = threading.Lock()
        self.tokens: list[int] = []
        self.shown, self.unsent = "", 0  # text sent to the chat; the first token not in it yet
        self.first_text_ms: float | None = None
        self.thinker_ms = 0.0
        self.codes = np.zeros((0, 16), dtype=np.int64)
        self.warnings = list(prepared.warnings)

    def run(self) -> None:
        try:
            self._think()
            if self.forward is not None:
                self.forward.join()
            self._finish()
        except BaseException as exc:  # noqa: BLE001 - the consumer raises it
            log.exception("omni chat turn failed")
            self.stop.set()  # the thinker lets the reply go; a talker row submitted later closes at once
            self.close()
            self.events.put(exc)

    def close(self) -> None:
        with self.lock:
            handle = self.handle
        if handle is not None:
            handle.close()

    def _elapsed(self) -> float:
        return (time.perf_counter() - self.started) * 1000.0

    def _think(self) -> None:
        prepared = self.prepared
        # The talker's prompt but its last position is known once the thinker's layer accept_hidden_layer
        # is done: its prefill runs on the engine while the thinker's upper layers still run.
        on_accept_layer = self._start_speech if prepared.speak else None
        # The talker's frame k reads the thinker's token k + 1: the speech's first two chunks need 1 + their
        # frames of tokens, written before another prompt's pack runs (none where it does not speak).
        lead_tokens = 1 + sum(prepared.schedule[:2]) if prepared.speak else 0
        reply = self.chat.thinker.start(prepared.inputs, prepared.thinker_sampling, prepared.seed, prepared.max_new_tokens, self.chat.im_end,
                                        self.stop, on_accept_layer, lead_tokens)
        self._reply(iter(reply))

    def _reply(self, tokens: Iterator[int]) -> None:
        chat, prepared = self.chat, self.prepared
        thinker, talker = chat.thinker, chat.talker
        token = next(tokens, None)
        if token is None:  # stopped while waiting for a row
            return
        self.first_text_ms = self._elapsed()
        self._add_token(token)
        if prepared.speak:  # the thinker handed the talker's prompt over before this token
            self.speech_submitted.wait()
            if self.speech_error is not None:
                raise self.speech_error
        if token == chat.im_end or self.stop.is_set():
            if token == chat.im_end:
                self.warnings.append("The model ended its reply before writing anything.")
            self.close()  # the talker's row, still waiting for its last prompt position, is let go
            return
        if prepared.speak:
            with torch.inference_mode():
                first = thinker.embed(torch.tensor([token])).to(talker.codec_head.weight.dtype)
                self.handle.finish_prompt(assistant_first(talker, first, chat.ids)[None])
        thinker_start, steps = time.perf_counter(), 0
        for token in tokens:
            steps += 1
            self._add_token(token)
            if token == chat.im_end:
                break
            self._speak([token], end=False)
        self.thinker_ms = (time.perf_counter() - thinker_start) * 1000.0 / steps if steps else 0.0
        # <|im_end|> is never spoken; the text ends with tts_eos, then the talker pads until it ends the speech.
        self._speak([], end=True)

    def _start_speech(self, embeds: torch.Tensor, hidden: torch.Tensor) -> None:
        """Submit the talker's row with its prompt but the last position: the user turns (from the
        thinker's input embeddings and layer-accept states) and the first 8 assistant positions.
        On the thinker's hand-off thread: an error goes to the turn, which raises it."""
        try:
            self._submit_speech(embeds, hidden)
        except BaseException as exc:  # noqa: BLE001
            self.speech_error = exc
        finally:
            self.speech_submitted.set()

    def _submit_speech(self, embeds: torch.Tensor, hidden: torch.Tensor) -> None:
        chat, prepared = self.chat, self.prepared
        talker, ids = chat.talker, chat.ids
        dtype = talker.codec_head.weight.dtype
        input_ids = prepared.inputs.input_ids[0].to(embeds.device)
        length = input_ids.shape[0]
        prefix = torch.cat([user_part(talker, input_ids, embeds.to(dtype), hidden.to(dtype), ids),
                            assistant_prefix(talker, embeds[length - 3:length].to(dtype), chat.specials, prepared.speaker, ids)])
        trailing = prefix.new_zeros(0, prefix.shape[-1])
        job = Job([Segment(prefix[None], trailing, text_end=False, awaits=1)], prepared.sampling, prepared.seed,
                  min(prepared.max_frames, chat.engine.decoder.max_frames(prefix.shape[0] + 1)), prepared.schedule)
        handle = chat.engine.submit(job)  # a full queue raises EngineBusy, a TTSInputError
        with self.lock:
            self.handle = handle
        if self.stop.is_set():
            handle.close()
        self.forward = threading.Thread(target=self._forward, args=(handle,), name="omni-audio", daemon=True)
        self.forward.start()

    def _forward(self, handle: Handle) -> None:
        try:
            for event in handle.events():
                self.events.put(event)
            self.codes = handle.codes.numpy()
            self.warnings.extend(handle.warnings)
        except BaseException as exc:  # noqa: BLE001
            self.events.put(exc)

    def _speak(self, tokens: list[int], end: bool) -> None:
        handle = self.handle
        if handle is None or handle.closed:
            return
        with torch.inference_mode():
            talker, specials = self.chat.talker, self.chat.specials
            embeds = [talker.text_projection(self.chat.thinker.embed(torch.tensor(tokens)).to(specials.dtype))] if tokens else []
            if end:
                embeds.append(specials[2:3])
            handle.append_text(torch.cat(embeds), end)

    def _add_token(self, token: int) -> None:
        """Record a reply token and send the text it completes (a character split over tokens waits for the rest)."""
        self.tokens.append(token)
        text = self.chat.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        new = text[len(self.shown):]
        index = len(self.tokens) - 1
        if new or token == self.chat.im_end:
            self.events.put(TextDelta(self.unsent, index, new, self._elapsed()))
            self.shown, self.unsent = text, index + 1

    def _finish(self) -> None:
        text = self.chat.tokenizer.decode(self.tokens, skip_special_tokens=True)
        stopped = self.stop.is_set() or (self.handle is not None and self.handle.stopped)
        self.events.put(ChatEnd(text, list(self.tokens), 0, stopped, self.first_text_ms, None, self.thinker_ms, self.codes, self.warnings,
                                self.prepared.inputs.dropped_turns))


def _with_audio_loaded(turn: Turn) -> Turn:
    """A turn whose audio is a file path, with the audio read (16 kHz mono; checked for length and content)."""
    if turn.audio is None or isinstance(turn.audio, np.ndarray):
        return turn
    return dataclasses.replace(turn, audio=load_message_audio(turn.audio, AUDIO_SAMPLE_RATE, MAX_AUDIO_SECONDS))


def read_config(directory: Path) -> dict[str, Any]:
    """The checkpoint's config.json, every value our loaders and transformers' thinker read of the type it must be."""
    config = read_json(directory, "config.json")
    check_config(directory / "config.json", config, OMNI_CONFIG)
    _check_transformers_types(directory / "config.json", config)
    return config


def _check_transformers_types(path: Path, config: dict[str, Any]) -> None:
    """The thinker's config is transformers' to read, and its config classes check each field's type
    (huggingface_hub's strict dataclasses): asked here, before any weight loads, the answer is one sentence."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig

    try:
        Qwen3OmniMoeConfig.from_dict(config)
    except StrictDataclassError as exc:  # its message goes on to print the whole value; the field says enough
        where = str(exc).splitlines()[0].rstrip(":").replace("Validation error for", "the")
        raise CheckpointError(f"{path}: transformers' Qwen3-Omni config refuses {where}, a value of the wrong type.") from None
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        raise CheckpointError(f"{path} is not a Qwen3-Omni config transformers can read: {' '.join(str(exc).split())}") from None


def planned_rows(directory: Path, config: dict[str, Any], source: str, device: torch.device, dtype: torch.dtype, free: int | None,
                 options: dict) -> int | None:
    """Talker rows and thinker rows (one each per conversation): on CUDA, or wherever `free` bytes are given, checked against the
    free memory (see `OmniChat.from_pretrained`); elsewhere those asked for (None: the device's default)."""
    if free is None and device.type != "cuda":
        return options.get("rows")
    plan = memory_plan.omni_plan(config, memory_plan.omni_weight_bytes(directory, dtype), dtype, options.get("max_seq", TALKER_MAX_SEQ),
                                 THINKER_MAX_SEQ, memory_plan.checkpoint_name(source), max_rows=DEFAULT_ROWS.get(device.type, 2))
    return plan.choose_rows(options.get("rows"), memory_plan.free_memory(device) if free is None else free)


def load_talker(directory: Path, raw: dict, device: torch.device, dtype: torch.dtype) -> OmniTalker:
    """Our talker from the checkpoint's `talker.*` tensors (per-expert tensors stacked on load)."""
    talker = load_part(directory, "talker.", lambda: OmniTalker(OmniTalkerConfig.from_dict(raw)), "talker_config")
    return talker.to(device=device, dtype=dtype).eval()


def check_memory(directory: Path | None, device: torch.device, dtype: torch.dtype, parameters: int | None = None) -> None:
    """Refuse to load weights that cannot fit (GPU memory on CUDA, free RAM on the CPU), saying what
    is needed and what the machine has. `parameters`: counted from the checkpoint's safetensors when None."""
    if parameters is None:
        parameters = count_parameters(directory)
    needed = parameters * dtype.itemsize * MEMORY_HEADROOM
    precision = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        where = f"{device} ({torch.cuda.get_device_name(device)}) has {free / 2**30:.0f} GiB free of {total / 2**30:.0f} GiB"
        advice = "Use a GPU with more memory (an H200, or an 80 GB card with nothing else on it)."
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        where = f"this machine has {free / 2**30:.0f} GiB of free memory"
        advice = "Run it on a GPU (--device cuda --dtype bfloat16)."
    if needed > free:
        raise CheckpointError(f"Qwen3-Omni ({parameters / 1e9:.1f} B parameters) needs about {needed / 2**30:.0f} GiB of memory in {precision}; "
                              f"{where}. {advice}")


def count_parameters(directory: Path) -> int:
    from safetensors import safe_open

    parameters = 0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                parameters += int(np.prod(f.get_slice(name).get_shape()))
    return parameters
