"""The text-to-speech entry point: load a checkpoint, validate a request, submit it to the model's
engine, get streamed `Chunk`s (or the whole utterance)."""
from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from pipeline import audio as audio_io
from pipeline import memory_plan, voice_file
from pipeline.codec import SpeechTokenizer
from pipeline.contract.events import SAMPLES_PER_FRAME
from pipeline.contract.models import MODEL_TYPES
from pipeline.engine import BatchDecoder, DecodeConfig, Engine, Handle, Job, SamplingConfig, Segment
from pipeline.errors import TTSInputError
from pipeline.kernels import fused_available
from pipeline.kernels.config import KernelConfig
from pipeline.loading import load_model, load_text_tokenizer, read_json, resolve_checkpoint, torch_device, torch_dtype
from pipeline.model import Qwen3TTS
from pipeline.prompt import REF_TAIL_TOKENS, ROLE_TOKENS, TEXT_TAIL_TOKENS, ICLReference, Prompt, assistant_text, build_prompt, instruct_text, reference_text
from pipeline.request import MAX_TEXT_CHARS, SpeechRequest, split_text
from pipeline.text_tokenizer import TextTokenizer
from pipeline.voice_file import SavedVoice, VoiceSpace
from pipeline.word_timings import IncrementalTokenizer, TextLayout, Token, WordTime, spoken_words, word_times

log = logging.getLogger(__name__)

DEFAULT_MAX_SEQ = 2048  # talker positions per segment: prompt + up to ~2.5 min of audio; long texts are split
# Utterances decoded together (the batch of the decode step) when none are asked for; on CUDA as many
# as the free memory holds, at most 16 (8 on a card under 40 GiB; pipeline.memory_plan).
DEFAULT_ROWS = {"cuda": 16, "cpu": 4}
# Vocoder calls that may run at once: one-stream lanes (pipeline.engine.scheduler.vocoder_lane: a stream's
# first chunks in two, other steady chunks in the third) and, on CUDA in an engine of
# memory_plan.VOCODER_BATCH_ROWS rows or more, two batched lanes whose calls decode the 16-frame steady
# chunks of up to VOCODER_SLOTS streams at once (H100, 1.7B: a call of 4 x 16 frames takes 9.6 ms against
# 4.3 ms for one stream's; 8 streams a call made a load of 20 requests/s stutter more). One lane on the CPU.
VOCODER_LANES = {"cuda": 3}
VOCODER_SLOTS = {"cuda": 4}
BATCH_LANES = 2


def planned_rows(directory: Path, source: str, device: torch.device, dtype: torch.dtype, free: int | None, options: dict) -> int | None:
    """The engine's rows for a checkpoint: on CUDA, or wherever `free` bytes are given, checked against the
    free memory (see `TTS.from_pretrained`); elsewhere those asked for (None: the device's default)."""
    if free is None and device.type != "cuda":
        return options.get("rows")
    fused = options.get("fused")
    frame_kernels = device.type == "cuda" and (fused_available(device) if fused is None else fused)
    max_seq = options.get("max_seq", DEFAULT_MAX_SEQ)
    plan = memory_plan.tts_checkpoint_plan(directory, dtype, max_seq, memory_plan.checkpoint_name(source), frame_kernels,
                                           max_rows=row_cap(device, dtype, max_seq))
    return plan.choose_rows(options.get("rows"), memory_plan.free_memory(device) if free is None else free)


def row_cap(device: torch.device, dtype: torch.dtype, max_seq: int) -> int:
    """The rows an engine gets at most without --rows: from the card's memory on CUDA (pipeline.memory_plan.tts_row_cap),
    else the device's default."""
    if device.type == "cuda":
        return memory_plan.tts_row_cap(torch.cuda.get_device_properties(device).total_memory, dtype, max_seq)
    return DEFAULT_ROWS.get(device.type, 4)


@dataclass
class VoicePrompt:
    """A cloned voice, computed once per reference recording and reusable across generations."""

    speaker_embedding: torch.Tensor  # [hidden]
    ref_codes: torch.Tensor | None = None  # [frames, 16]; None in x-vector-only mode
    ref_text: str | None = None
    vocoder_state: list[torch.Tensor] | None = None  # a one-row vocoder stream primed with ref_codes

    @property
    def icl(self) -> bool:
        return self.ref_codes is not None


@dataclass
class Synthesis:
    audio: np.ndarray  # float32 [samples] at `sample_rate`
    sample_rate: int
    codes: np.ndarray  # int64 [frames, 16], generated frames only
    warnings: list[str]
    words: list[WordTime] | None = None  # where the request asked for word timestamps


class TTS:
    def __init__(
        self,
        model: Qwen3TTS,
        text_tokenizer: TextTokenizer,
        speech_tokenizer: SpeechTokenizer,
        generation_config: dict,
        name: str,
        max_seq: int = DEFAULT_MAX_SEQ,
        rows: int | None = None,
        use_cuda_graphs: bool = True,
        compiled: bool = False,
        max_queue: int = 64,
        vocoder_lanes: int | None = None,
        vocoder_slots: int | None = None,
        fused: bool | None = None,
        kernels: KernelConfig | None = None,
        progress: Callable[[int, int], None] | None = None,
    ):
        """`progress(done, total)`: after each CUDA graph the engine captures while it is built (see Engine).
        `vocoder_lanes` / `vocoder_slots`: the vocoder's one-stream lanes, and the streams a batched
        call decodes (1: no batched lanes); by default the device's (VOCODER_LANES; VOCODER_SLOTS in an
        engine of memory_plan.VOCODER_BATCH_ROWS rows or more)."""
        self.model = model
        self.config = model.config
        self.text_tokenizer = text_tokenizer
        self.speech_tokenizer = speech_tokenizer
        self.generation_config = generation_config
        self.name = name
        self.device = model.talker.codec_head.weight.device
        self.dtype = model.talker.codec_head.weight.dtype
        self.max_seq = max_seq
        self.rows = rows or DEFAULT_ROWS.get(self.device.type, 4)
        with torch.inference_mode():
            tts_pad = model.talker.embed_text(torch.tensor([[self.config.tts_pad_token_id]], device=self.device))[0, 0]
            settings = DecodeConfig.for_talker(model.talker, self.rows, max_seq, use_cuda_graphs, compiled, fused=fused, kernels=kernels)
            decoder = BatchDecoder(model.talker, tts_pad, settings)
            lanes = vocoder_lanes or VOCODER_LANES.get(self.device.type, 1)
            slots = vocoder_slots or (VOCODER_SLOTS.get(self.device.type, 1) if self.rows >= memory_plan.VOCODER_BATCH_ROWS else 1)
            vocoder = speech_tokenizer.multi_stream_decoder(self.rows, use_cuda_graphs, lanes, BATCH_LANES if slots > 1 else 0, slots)
            self.engine = Engine(decoder, vocoder, max_queue=max_queue, progress=progress)

    @classmethod
    def from_pretrained(cls, source: str, device: str = "cpu", dtype: str = "float32", free_memory: int | None = None, **options) -> "TTS":
        """Load from a Hugging Face Hub id or a local directory in the official layout. On CUDA, or
        wherever `free_memory` (bytes) is given, the rows are planned before the weights load
        (pipeline.memory_plan): those asked for if they fit, else NotEnoughMemory; none asked for, as
        many as fit up to the default."""
        torch_dev, torch_dt = torch_device(device), torch_dtype(dtype)
        directory = resolve_checkpoint(source)
        options["rows"] = planned_rows(directory, source, torch_dev, torch_dt, free_memory, options)
        model = load_model(directory, torch_dev, torch_dt)
        # The codec runs in float32 whatever the talker's dtype: in bf16 its 12-stage vocoder turns
        # rounding into ~0.05 of difference between chunked and offline decoding (docs/BENCHMARKS.md),
        # and reference codes from a bf16 encoder differ from float32 ones; its cost is small.
        speech_tokenizer = SpeechTokenizer.from_pretrained(directory / "speech_tokenizer", torch_dev, torch.float32)
        text_tokenizer = load_text_tokenizer(directory)
        return cls(model, text_tokenizer, speech_tokenizer, read_json(directory, "generation_config.json"), str(source), **options)

    @property
    def model_type(self) -> str:
        return self.config.tts_model_type

    @property
    def sample_rate(self) -> int:
        return audio_io.SAMPLE_RATE

    @property
    def speakers(self) -> list[str]:
        return sorted(self.config.talker_config.spk_id)

    @property
    def languages(self) -> list[str]:
        return ["auto"] + [name for name in self.config.talker_config.codec_language_id if "dialect" not in name]

    @property
    def supports_instruct(self) -> bool:
        # The reference drops instructions on 0.6B CustomVoice checkpoints; Base checkpoints take none.
        if self.model_type == "custom_voice":
            return self.config.tts_model_size != "0b6"
        return self.model_type == "voice_design"

    def _ids(self, text: str) -> torch.Tensor:
        return torch.tensor([self.text_tokenizer(text)["input_ids"]], device=self.device)

    @torch.inference_mode()
    def create_voice_prompt(self, ref_audio, ref_text: str | None = None, x_vector_only: bool = False) -> VoicePrompt:
        """Reference audio (path or (array, sample_rate)) -> speaker embedding and, for ICL, reference codes."""
        if self.model_type != "base":
            raise TTSInputError(f"Reference audio is for Base (voice clone) checkpoints; {self.name} is a {self.model_type} checkpoint.")
        transcript = (ref_text or "").strip()
        if not x_vector_only and not transcript:
            raise TTSInputError("Voice cloning with reference codes (ICL) needs the transcript of the reference audio; give it, or use x-vector-only mode.")
        wav = torch.from_numpy(audio_io.load_reference_audio(ref_audio))
        embedding = self.model.speaker_encoder.embed(wav.to(self.device))
        if x_vector_only:
            return VoicePrompt(embedding)
        codes = self.speech_tokenizer.encode(wav.to(self.device))
        # Prime a one-row vocoder stream once per voice; each request's row starts from a copy of it.
        return VoicePrompt(embedding, codes, transcript, self.engine.vocoder.primed_state(codes))

    @cached_property
    def voice_space(self) -> VoiceSpace:
        """What this checkpoint's voice prompts mean: a saved voice must have been made in the same space."""
        codec = self.speech_tokenizer.config
        return VoiceSpace(
            self.name,
            voice_file.fingerprint(self.model.speaker_encoder, self.speech_tokenizer.decoder.quantizer),
            self.config.talker_config.hidden_size,
            codec.decoder.num_quantizers,
            codec.decoder.codebook_size,
            math.ceil(audio_io.MAX_SECONDS * codec.input_sample_rate / codec.encode_downsample_rate),
        )

    def save_voice_prompt(self, voice: VoicePrompt, path: str | Path) -> Path:
        """Write `voice` as a voice file (pipeline/voice_file.py) that `load_voice_prompt` reads back."""
        path = Path(path)
        path.write_bytes(voice_file.dumps(SavedVoice(voice.speaker_embedding, voice.ref_codes, voice.ref_text), self.voice_space))
        return path

    @torch.inference_mode()
    def load_voice_prompt(self, source: str | Path | bytes) -> VoicePrompt:
        """A voice file (its path or its bytes), checked in full against this checkpoint: every problem
        raises TTSInputError before anything is computed. Equal to the prompt it was saved from."""
        if self.model_type != "base":
            raise TTSInputError(f"A saved voice is for Base (voice clone) checkpoints; {self.name} is a {self.model_type} checkpoint.")
        saved = voice_file.loads(voice_file.read(source), self.voice_space)
        embedding = saved.speaker_embedding.to(self.device, self.dtype)
        if saved.ref_codes is None:
            return VoicePrompt(embedding)
        codes = saved.ref_codes.to(self.speech_tokenizer.device)
        # Not stored in the file: recomputed from the codes, bit for bit what create_voice_prompt primed.
        return VoicePrompt(embedding, codes, saved.ref_text, self.engine.vocoder.primed_state(codes))

    def _language_id(self, language: str, speaker: str | None) -> int | None:
        t = self.config.talker_config
        lang = (language or "auto").strip().lower()
        if lang not in self.languages:
            raise TTSInputError(f"Unsupported language '{language}': choose one of {', '.join(self.languages)}.")
        # Dialect speakers speak their dialect when the language is Chinese or left to the model.
        dialect = t.spk_is_dialect.get(speaker, False) if speaker else False
        if lang in ("chinese", "auto") and dialect:
            return t.codec_language_id[dialect]
        return None if lang == "auto" else t.codec_language_id[lang]

    def _speaker(self, speaker: str | None) -> str | None:
        if self.model_type != "custom_voice":
            if speaker:
                raise TTSInputError(f"Preset speakers exist only on CustomVoice checkpoints; {self.name} is a {self.model_type} checkpoint.")
            return None
        name = (speaker or "").strip().lower()
        if not name:
            raise TTSInputError(f"This CustomVoice checkpoint needs a speaker: one of {', '.join(self.speakers)}.")
        if name not in self.config.talker_config.spk_id:
            raise TTSInputError(f"Unknown speaker '{speaker}': choose one of {', '.join(self.speakers)}.")
        return name

    def check(self, request: SpeechRequest, voice: VoicePrompt | None = None) -> list[str]:
        """The checkpoint-dependent checks of a request (model-independent ones first, unless it is
        validated already); returns warnings."""
        request = request.validate()
        request.check_for_checkpoint(self.model_type, self.default_max_frames())
        speaker = self._speaker(request.speaker)
        self._language_id(request.language, speaker)
        if MODEL_TYPES[self.model_type].reference:
            if voice is None and request.ref_audio is None and request.voice_prompt is None:
                raise TTSInputError(
                    "This is a Base (voice clone) checkpoint: give reference audio (and its transcript, or x-vector-only mode), or a saved voice."
                )
        elif request.voice_prompt is not None:
            raise TTSInputError(f"A saved voice is for Base (voice clone) checkpoints; {self.name} is a {self.model_type} checkpoint.")
        elif request.ref_audio is not None or voice is not None:
            raise TTSInputError(f"Reference audio is for Base (voice clone) checkpoints; {self.name} is a {self.model_type} checkpoint.")
        elif request.ref_text or request.x_vector_only:
            raise TTSInputError("A reference transcript and x-vector-only mode need reference audio, which only Base checkpoints take.")
        if (request.instruct or "").strip() and not self.supports_instruct:
            return [f"This {self.config.tts_model_size} {self.model_type} checkpoint ignores instructions; the instruction was not used."]
        return []

    @torch.inference_mode()
    def prompt(self, text: str, language: str, speaker: str | None, instruct: str, voice: VoicePrompt | None,
               non_streaming: bool | None = None) -> Prompt:
        """The talker prompt of one segment of text: all of it in the prompt (`non_streaming`), or fed one
        token per frame; None: the model type's default, as the reference's (streamed for voice cloning)."""
        speaker = self._speaker(speaker)
        talker = self.model.talker
        speaker_embed = None
        if speaker is not None:
            speaker_embed = talker.model.codec_embedding.weight[self.config.talker_config.spk_id[speaker]]
        icl = None
        if voice is not None:
            speaker_embed = voice.speaker_embedding
            if voice.icl:
                icl = ICLReference(self._ids(reference_text(voice.ref_text)), voice.ref_codes)
        prompt = build_prompt(
            talker,
            self.config,
            self._ids(assistant_text(text)),
            self._language_id(language, speaker),
            speaker_embed=speaker_embed,
            instruct_ids=self._ids(instruct_text(instruct)) if instruct else None,
            icl=icl,
            non_streaming_text=not MODEL_TYPES[self.model_type].streams_text if non_streaming is None else non_streaming,
        )
        if prompt.prefill.shape[1] + 1 >= self.max_seq:
            raise TTSInputError(
                f"The prompt (instruction, reference and text) takes {prompt.prefill.shape[1]} positions; "
                f"one segment holds at most {self.max_seq - 2}. Shorten the instruction or the reference."
            )
        return prompt

    def prepare(self, request: SpeechRequest, voice: VoicePrompt | None = None) -> tuple[Job, list[str]]:
        """Validate `request` and build its job (every problem raises TTSInputError, before any generation)."""
        job, warnings, _ = self._prepare(request, voice)
        return job, warnings

    def _prepare(self, request: SpeechRequest, voice: VoicePrompt | None) -> tuple[Job, list[str], VoicePrompt | None]:
        """The job, its warnings and the voice it speaks in (made from the request's reference where none is given)."""
        request = request.validate()
        warnings = self.check(request, voice)
        voice = self._voice_of(request, voice)
        instruct = (request.instruct or "").strip() if self.supports_instruct else ""
        text = request.text
        segments = self.segments(text)
        prompts = [self.prompt(segment, request.language, request.speaker, instruct, voice, request.non_streaming_mode) for segment in segments]
        sampling = self.sampling(request.greedy, **request.sampling_overrides())
        seed = random.getrandbits(31) if request.seed is None else request.seed
        # Each segment may speak for as long as the checkpoint lets one utterance speak: a long text is
        # spoken whole. A request's own max_frames caps the whole text (the engine warns if that leaves segments unspoken).
        per_segment = self.default_max_frames()
        max_frames = per_segment * len(segments) if request.max_frames is None else request.max_frames
        job = Job(
            [Segment(p.prefill, p.trailing_text, True, chars=len(segment), text_tokens=p.text_tokens) for p, segment in zip(prompts, segments)],
            sampling,
            seed,
            max_frames,
            tuple(request.schedule),
            voice.vocoder_state if voice is not None and voice.icl else None,
            segment_frames=per_segment,
        )
        return job, warnings, voice

    @staticmethod
    def segments(text: str) -> list[str]:
        """The pieces of a text that are spoken one after the other, each from a prompt of its own."""
        return split_text(text) if len(text) <= MAX_TEXT_CHARS else [text]

    def submit(self, request: SpeechRequest, voice: VoicePrompt | None = None) -> Handle:
        """Validate now (errors raise here), then stream: iterate the handle for `Chunk`s."""
        return self._submit(request, voice)[0]

    def _submit(self, request: SpeechRequest, voice: VoicePrompt | None) -> tuple[Handle, VoicePrompt | None]:
        job, warnings, voice = self._prepare(request, voice)
        for warning in warnings:
            log.warning(warning)
        handle = self.engine.submit(job)
        handle.warnings.extend(warnings)
        return handle, voice

    def synthesize(self, request: SpeechRequest, voice: VoicePrompt | None = None) -> Synthesis:
        """The whole utterance: the streamed chunks of `submit`, joined (and its words timed, where the request asks)."""
        request = request.validate()
        # The request's own chunk schedule: the audio is then bit for bit what a listener streams.
        handle, voice = self._submit(request, voice)
        # Never empty: EOS is masked for the first two frames, and max_frames >= 1.
        audio = np.concatenate([chunk.audio for chunk in handle])
        words = self.spoken_words(request, voice, handle) if request.word_timestamps else None
        return Synthesis(audio, self.sample_rate, handle.codes.numpy(), list(dict.fromkeys(handle.warnings)), words)

    def spoken_words(self, request: SpeechRequest, voice: VoicePrompt | None, handle: Handle) -> list[WordTime]:
        """The words of a request spoken in the streaming-text layout (the `voice` it was spoken in, its
        ended `handle`), timed in seconds of its audio (pipeline.word_timings: the frame each word's first
        token enters at, and the frame after its last one's); words left unspoken are left out."""
        segments = [(segment, self.segment_tokens(segment)) for segment in self.segments(request.text)]
        return spoken_words(segments, self.text_layout(voice), handle.segment_frames, len(handle.codes))

    def segment_tokens(self, segment: str) -> list[Token]:
        """The text tokens of a segment as its prompt lays them (`prompt`), with their characters in `segment`."""
        framed = assistant_text(segment)
        start = framed.index(segment)
        encoding = self.text_tokenizer(framed)
        ids, spans = encoding["input_ids"][ROLE_TOKENS:-TEXT_TAIL_TOKENS], encoding["offset_mapping"][ROLE_TOKENS:-TEXT_TAIL_TOKENS]
        return [Token(i, a - start, b - start) for i, (a, b) in zip(ids, spans)]

    def text_layout(self, voice: VoicePrompt | None) -> TextLayout:
        """Where a streaming-text prompt lays the text: a voice clone's reference transcript and frames come before it."""
        if voice is None or not voice.icl:
            return TextLayout()
        transcript = len(self.text_tokenizer(reference_text(voice.ref_text))["input_ids"]) - ROLE_TOKENS - REF_TAIL_TOKENS
        return TextLayout(lead=voice.ref_codes.shape[0] - transcript)

    def default_max_frames(self) -> int:
        # The reference's max_new_tokens=N gives N-1 frames.
        return int(self.generation_config.get("max_new_tokens", 2048)) - 1

    def sampling(self, greedy: bool = False, **overrides) -> SamplingConfig:
        config = SamplingConfig.from_generation_config(self.generation_config, **overrides)
        return config.greedy() if greedy else config

    def warm_up(self) -> None:
        """Run one short request through the engine (its graphs were captured at load), so that no
        user pays for first-use costs in time to first audio."""
        speaker = self.speakers[0] if self.speakers else None
        voice = VoicePrompt(torch.zeros(self.config.talker_config.hidden_size, dtype=self.dtype, device=self.device)) if self.model_type == "base" else None
        for _ in self.submit(SpeechRequest("Warm up.", speaker=speaker, max_frames=3, seed=0), voice):
            pass

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor, ref_codes: torch.Tensor | None = None) -> np.ndarray:
        """Waveform of generated codes [frames, 16]; with reference codes as decoder context, cut exactly."""
        if ref_codes is None:
            return self.speech_tokenizer.decode(codes).float().cpu().numpy()
        wav = self.speech_tokenizer.decode(torch.cat([ref_codes.to(codes.device), codes]))
        return wav[ref_codes.shape[0] * SAMPLES_PER_FRAME :].float().cpu().numpy()

    # ---- text still being written ------------------------------------------------------------

    def open_text_stream(self, request: SpeechRequest, voice: VoicePrompt | None = None) -> "TextStream":
        """Speak text that is still being written, in the official streaming-text layout: `request`
        gives the voice, sampling and limits (its own text is not spoken); the text comes through the
        returned stream's `append` and `finish` and reaches the talker one token per frame. The row is
        taken now, its prompt prefilled but for the text's first positions. Problems raise TTSInputError here."""
        request = request.validate()
        warnings = self.check(request, voice)
        voice = self._voice_of(request, voice)
        layout = self._text_stream_layout(request, voice)
        per_segment = self.default_max_frames()
        max_frames = per_segment if request.max_frames is None else request.max_frames
        job = Job(
            [Segment(layout.prefix, layout.prefix.new_zeros(0, layout.prefix.shape[-1]), text_end=False, awaits=layout.codec_tail.shape[0])],
            self.sampling(request.greedy, **request.sampling_overrides()),
            random.getrandbits(31) if request.seed is None else request.seed,
            max_frames,
            tuple(request.schedule),
            voice.vocoder_state if voice is not None and voice.icl else None,
            segment_frames=per_segment,
        )
        capacity = min(max_frames, per_segment, self.engine.decoder.max_frames(layout.prefix.shape[1] + layout.codec_tail.shape[0]))
        handle = self.engine.submit(job)  # a full queue raises EngineBusy, a TTSInputError
        handle.warnings.extend(warnings)
        return TextStream(self, handle, layout, capacity)

    def _voice_of(self, request: SpeechRequest, voice: VoicePrompt | None) -> VoicePrompt | None:
        """The request's cloned voice (Base checkpoints): `voice` if given, else made from its saved voice or reference audio."""
        if not MODEL_TYPES[self.model_type].reference or voice is not None:
            return voice
        if request.voice_prompt is not None:
            return self.load_voice_prompt(request.voice_prompt)
        return self.create_voice_prompt(request.ref_audio, request.ref_text, request.x_vector_only)

    @torch.inference_mode()
    def _text_stream_layout(self, request: SpeechRequest, voice: VoicePrompt | None) -> "TextStreamLayout":
        instruct = (request.instruct or "").strip() if self.supports_instruct else ""
        # What precedes the text's positions does not depend on the text: the prompt of a stand-in
        # text, cut where the text begins (its last position, or the reference frames of a voice clone).
        prompt = self.prompt(STAND_IN_TEXT, request.language, request.speaker, instruct, voice, non_streaming=False)
        talker = self.model.talker
        ids = torch.tensor([[self.config.talker_config.codec_bos_id]], device=self.device)
        codec_tail = talker.model.codec_embedding(ids)[0]
        lead_text = codec_tail.new_zeros(0, codec_tail.shape[-1])
        if voice is not None and voice.icl:
            codec_tail = torch.cat([codec_tail, talker.embed_codes(voice.ref_codes.to(self.device))])
            lead_text = talker.embed_text(self._ids(reference_text(voice.ref_text))[:, ROLE_TOKENS:-REF_TAIL_TOKENS])[0]
        eos_pad = talker.embed_text(torch.tensor([[self.config.tts_eos_token_id, self.config.tts_pad_token_id]], device=self.device))[0]
        return TextStreamLayout(prompt.prefill[:, : -codec_tail.shape[0]], codec_tail, lead_text, eos_pad[:1], eos_pad[1:])


STAND_IN_TEXT = "."  # any text: only the prompt's part before the text is kept


@dataclass
class TextStreamLayout:
    """A streaming-text prompt around text still to come. Its last `n` positions (n = len(codec_tail))
    lay the first n positions of the text track (`lead_text`, then the text's tokens, then tts_eos;
    tts_pad where they run out) over `codec_tail`; the rest of the text track follows, one per frame."""

    prefix: torch.Tensor  # [1, L, hidden]: the prompt before those positions
    codec_tail: torch.Tensor  # [n, hidden]: codec_bos (then a voice clone's reference frames)
    lead_text: torch.Tensor  # [r, hidden]: text before the streamed text (a voice clone's reference transcript)
    tts_eos: torch.Tensor  # [1, hidden]
    tts_pad: torch.Tensor  # [1, hidden]

    @property
    def timing(self) -> TextLayout:
        # Text token j is position r + j of the text track; positions from n on enter one per frame from frame 1.
        return TextLayout(lead=self.codec_tail.shape[0] - 1 - self.lead_text.shape[0])


class TextStream:
    """The text of a job opened by `TTS.open_text_stream`, given as it is written: its tokens are the
    whole text's (`pipeline.word_timings.IncrementalTokenizer`), fed to the row as each one is final.
    Iterate `handle` for the audio; `close()` frees the row within a frame."""

    def __init__(self, tts: TTS, handle: Handle, layout: TextStreamLayout, capacity: int):
        self.tts, self.handle, self.layout = tts, handle, layout
        self.tokenizer = IncrementalTokenizer(tts.text_tokenizer)
        self.capacity = capacity  # text positions after the prompt that the row can read
        self._prompt_text = layout.lead_text  # the text track's positions still to lay over codec_tail
        self._fed = 0  # text positions after the prompt
        if self._prompt_text.shape[0] >= layout.codec_tail.shape[0]:  # a reference transcript longer than its frames
            self._send(self._prompt_text.new_zeros(0, self._prompt_text.shape[-1]), end=False)

    @property
    def text(self) -> str:
        return self.tokenizer.text

    @property
    def tokens(self) -> list[Token]:
        return self.tokenizer.tokens

    def append(self, piece: str) -> list[Token]:
        """More text; returns the tokens that it made final (sent to the row)."""
        if len(self.tokenizer.text) + len(piece) > MAX_TEXT_CHARS:
            raise TTSInputError(f"The text is {len(self.tokenizer.text) + len(piece)} characters long; the limit is {MAX_TEXT_CHARS} characters.", "text")
        new = self.tokenizer.feed(piece)
        self._send(self._embed(new), end=False)
        return new

    def finish(self) -> list[Token]:
        """The text ends: its last tokens, then tts_eos; the row speaks to its end."""
        new = self.tokenizer.finish()
        if not self.tokenizer.tokens:
            raise TTSInputError("No text came before the end: send the text to speak first.", "text")
        self._send(torch.cat([self._embed(new), self.layout.tts_eos]), end=True)
        return new

    def words(self, final: bool = False) -> list[WordTime]:
        """The words timed so far (all of them once the text has ended and `final`), in seconds of the audio."""
        return word_times(self.tokenizer.text, self.tokenizer.tokens, self.layout.timing, final)

    def close(self) -> None:
        self.handle.close()

    @torch.inference_mode()
    def _embed(self, tokens: list[Token]) -> torch.Tensor:
        ids = torch.tensor([[t.id for t in tokens]], dtype=torch.long, device=self.tts.device)
        return self.tts.model.talker.embed_text(ids)[0]

    @torch.inference_mode()
    def _send(self, embeds: torch.Tensor, end: bool) -> None:
        """Text track positions in order: the prompt's last ones first (the row starts once they are
        all there, tts_pad filling them if the text ends before), then one per frame."""
        layout = self.layout
        if self._prompt_text is not None:
            self._prompt_text = torch.cat([self._prompt_text, embeds])
            n = layout.codec_tail.shape[0]
            if self._prompt_text.shape[0] < n and not end:
                return
            head, embeds = self._prompt_text[:n], self._prompt_text[n:]
            head = torch.cat([head, layout.tts_pad.expand(n - head.shape[0], -1)])
            self._prompt_text = None
            self.handle.finish_prompt((head + layout.codec_tail)[None])
        room = self.capacity - self._fed
        if embeds.shape[0] > room:  # never read: the row reaches its frame limit first
            embeds = embeds[:max(room, 0)]
        self._fed += embeds.shape[0]
        if embeds.shape[0] or end:
            self.handle.append_text(embeds, end)
