"""The text-to-speech API: load a checkpoint, validate a request, generate codes, decode audio."""
from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline import audio as audio_io
from pipeline.errors import TTSInputError
from pipeline.generate import FrameDecoder, SamplingConfig, generate_frames
from pipeline.loading import load_model, read_json, resolve_checkpoint, torch_device, torch_dtype
from pipeline.model import Qwen3TTS
from pipeline.prompt import ICLReference, Prompt, assistant_text, build_prompt, instruct_text, reference_text
from pipeline.speech_tokenizer import SpeechTokenizer
from pipeline.stream import DEFAULT_SCHEDULE, StreamRun, split_text

log = logging.getLogger(__name__)

MAX_TEXT_CHARS = 5000
DEFAULT_MAX_SEQ = 2048  # talker positions per segment: prompt + up to ~2.5 min of audio; long texts are split
OFFLINE_CHUNK = 64  # frames per vocoder call when nobody is listening live
SAMPLES_PER_FRAME = 1920


@dataclass
class VoicePrompt:
    """A cloned voice, computed once per reference recording and reusable across generations."""

    speaker_embedding: torch.Tensor  # [hidden]
    ref_codes: torch.Tensor | None = None  # [frames, 16]; None in x-vector-only mode
    ref_text: str | None = None
    vocoder_state: list[torch.Tensor] | None = None  # the streaming vocoder primed with ref_codes

    @property
    def icl(self) -> bool:
        return self.ref_codes is not None


@dataclass
class Request:
    """A validated request, ready for generation."""

    prompt: Prompt
    ref_codes: torch.Tensor | None
    warnings: list[str] = field(default_factory=list)
    vocoder_state: list[torch.Tensor] | None = None


@dataclass
class Synthesis:
    audio: np.ndarray  # float32 [samples] at `sample_rate`
    sample_rate: int
    codes: np.ndarray  # int64 [frames, 16], generated frames only
    warnings: list[str]


class TTS:
    def __init__(
        self,
        model: Qwen3TTS,
        text_tokenizer,
        speech_tokenizer: SpeechTokenizer,
        generation_config: dict,
        name: str,
        max_seq: int = DEFAULT_MAX_SEQ,
        use_cuda_graphs: bool = True,
        compiled: bool = False,
    ):
        self.model = model
        self.config = model.config
        self.text_tokenizer = text_tokenizer
        self.speech_tokenizer = speech_tokenizer
        self.generation_config = generation_config
        self.name = name
        self.device = model.talker.codec_head.weight.device
        self.dtype = model.talker.codec_head.weight.dtype
        self.lock = threading.Lock()  # one utterance at a time: the static caches belong to it
        self.max_seq = max_seq
        self.use_cuda_graphs = use_cuda_graphs
        self.compiled = compiled
        self.decoder: FrameDecoder | None = None
        self.vocoder = speech_tokenizer.stream_decoder(use_cuda_graphs=use_cuda_graphs)
        # Generation and vocoding overlap on two CUDA streams, kept for the process (a new stream
        # per request would also set up new cuBLAS workspaces each time).
        on_cuda = self.device.type == "cuda"
        self.generation_stream = torch.cuda.Stream(self.device) if on_cuda else None
        self.vocoder_stream = torch.cuda.Stream(self.device) if on_cuda else None

    @classmethod
    def from_pretrained(cls, source: str, device: str = "cpu", dtype: str = "float32", **options) -> "TTS":
        """Load from a Hugging Face Hub id or a local directory in the official layout."""
        from transformers import AutoTokenizer

        torch_dev, torch_dt = torch_device(device), torch_dtype(dtype)
        directory = resolve_checkpoint(source)
        model = load_model(directory, torch_dev, torch_dt)
        # The codec runs in float32 whatever the talker's dtype: in bf16 its 12-stage vocoder turns
        # rounding into ~0.05 of difference between chunked and offline decoding (docs/BENCHMARKS.md),
        # and reference codes from a bf16 encoder differ from float32 ones; its cost is small.
        speech_tokenizer = SpeechTokenizer.from_pretrained(directory / "speech_tokenizer", torch_dev, torch.float32)
        text_tokenizer = AutoTokenizer.from_pretrained(str(directory))
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
        # Prime a vocoder stream once per voice; each request then starts from a copy of its state.
        primer = self.speech_tokenizer.stream_decoder()
        primer.prime(codes)
        return VoicePrompt(embedding, codes, transcript, primer.state.snapshot())

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

    @torch.inference_mode()
    def prepare(
        self,
        text: str,
        language: str = "auto",
        speaker: str | None = None,
        instruct: str | None = None,
        voice_prompt: VoicePrompt | None = None,
        non_streaming_text: bool | None = None,
    ) -> Request:
        """Validate a request and build its prompt; every problem raises TTSInputError with one clear sentence."""
        if not text or not text.strip():
            raise TTSInputError("The text is empty: type what the voice should say.")
        if len(text) > MAX_TEXT_CHARS:
            raise TTSInputError(f"The text is {len(text)} characters long; the limit is {MAX_TEXT_CHARS} characters.")
        speaker = self._speaker(speaker)
        language_id = self._language_id(language, speaker)
        warnings = []
        instruct = (instruct or "").strip()
        if instruct and not self.supports_instruct:
            warnings.append(f"This {self.config.tts_model_size} {self.model_type} checkpoint ignores instructions; the instruction was not used.")
            instruct = ""
        if self.model_type == "base" and voice_prompt is None:
            raise TTSInputError("Voice cloning needs reference audio (a voice prompt).")
        if self.model_type != "base" and voice_prompt is not None:
            raise TTSInputError(f"Reference audio is for Base (voice clone) checkpoints; {self.name} is a {self.model_type} checkpoint.")
        for warning in warnings:
            log.warning(warning)

        talker = self.model.talker
        speaker_embed = None
        if speaker is not None:
            speaker_embed = talker.model.codec_embedding.weight[self.config.talker_config.spk_id[speaker]]
        icl = None
        if voice_prompt is not None:
            speaker_embed = voice_prompt.speaker_embedding
            if voice_prompt.icl:
                icl = ICLReference(self._ids(reference_text(voice_prompt.ref_text)), voice_prompt.ref_codes)
        if non_streaming_text is None:
            # The reference's defaults: the whole text up front, except for voice cloning.
            non_streaming_text = self.model_type != "base"
        prompt = build_prompt(
            talker,
            self.config,
            self._ids(assistant_text(text)),
            language_id,
            speaker_embed=speaker_embed,
            instruct_ids=self._ids(instruct_text(instruct)) if instruct else None,
            icl=icl,
            non_streaming_text=non_streaming_text,
        )
        if icl is None:
            return Request(prompt, None, warnings)
        return Request(prompt, voice_prompt.ref_codes, warnings, voice_prompt.vocoder_state)

    def default_max_frames(self) -> int:
        # The reference's max_new_tokens=N gives N-1 frames.
        return int(self.generation_config.get("max_new_tokens", 2048)) - 1

    def frame_decoder(self, request: Request, sampling: SamplingConfig, seed: int | None) -> FrameDecoder:
        """The model's decoder, loaded with this request; the caller holds `self.lock`."""
        if self.decoder is None:
            self.decoder = FrameDecoder(self.model.talker, self.max_seq, self.use_cuda_graphs, self.compiled)
        prompt = request.prompt
        self.decoder.reset(prompt.trailing_text, prompt.tts_pad, sampling, random.getrandbits(31) if seed is None else seed)
        return self.decoder

    def warm_up(self, sampling: SamplingConfig | None = None) -> None:
        """Build the decoder and capture its CUDA graph for `sampling` now, not during someone's first request."""
        speaker = self.speakers[0] if self.speakers else None
        voice = VoicePrompt(torch.zeros(self.config.talker_config.hidden_size, dtype=self.dtype, device=self.device)) if self.model_type == "base" else None
        for _ in self.stream("Warm up.", speaker=speaker, voice_prompt=voice, sampling=sampling, max_frames=3, seed=0):
            pass
        with self.lock, torch.inference_mode():
            self.decoder.capture_prefill_graphs()
            for frames in range(1, max(DEFAULT_SCHEDULE) + 1):  # every chunk size a stream can ask for
                self.vocoder.decode_chunk(torch.zeros(frames, 16, dtype=torch.long, device=self.device))
            self.vocoder.reset()

    def _max_frames(self, max_frames: int | None) -> int:
        max_frames = self.default_max_frames() if max_frames is None else max_frames
        if max_frames < 1:
            raise TTSInputError(f"max_frames must be at least 1 (got {max_frames}).")
        return max_frames

    @torch.inference_mode()
    def generate_codes(self, request: Request, sampling: SamplingConfig, max_frames: int | None = None, seed: int | None = None) -> Iterator[torch.Tensor]:
        """Yield the 16 codes of each generated frame, one host sync per frame (see `stream` for the fast path)."""
        max_frames = self._max_frames(max_frames)
        with self.lock:
            decoder = self.frame_decoder(request, sampling, seed)
            max_frames = min(max_frames, decoder.max_frames(request.prompt.prefill.shape[1]))
            yield from generate_frames(decoder, request.prompt.prefill, max_frames)

    def stream(
        self,
        text: str,
        language: str = "auto",
        speaker: str | None = None,
        instruct: str | None = None,
        voice_prompt: VoicePrompt | None = None,
        sampling: SamplingConfig | None = None,
        max_frames: int | None = None,
        seed: int | None = None,
        schedule: Sequence[int] = DEFAULT_SCHEDULE,
    ) -> StreamRun:
        """Validate now (errors raise here), then stream `Chunk`s; long texts go segment by segment in one voice."""
        # Unsplittable text (empty, too long) goes to prepare() whole, which says what is wrong with it.
        segments = (split_text(text) if len(text or "") <= MAX_TEXT_CHARS else []) or [text]
        requests = [self.prepare(segment, language, speaker, instruct, voice_prompt) for segment in segments]
        return StreamRun(self, requests, sampling or self.sampling(), self._max_frames(max_frames), seed, schedule)

    def sampling(self, greedy: bool = False, **overrides) -> SamplingConfig:
        config = SamplingConfig.from_generation_config(self.generation_config, **overrides)
        return config.greedy() if greedy else config

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor, ref_codes: torch.Tensor | None = None) -> np.ndarray:
        """Waveform of generated codes [frames, 16]; with reference codes as decoder context, cut exactly."""
        if ref_codes is None:
            return self.speech_tokenizer.decode(codes).float().cpu().numpy()
        wav = self.speech_tokenizer.decode(torch.cat([ref_codes.to(codes.device), codes]))
        return wav[ref_codes.shape[0] * SAMPLES_PER_FRAME :].float().cpu().numpy()

    def synthesize(
        self,
        text: str,
        language: str = "auto",
        speaker: str | None = None,
        instruct: str | None = None,
        voice_prompt: VoicePrompt | None = None,
        sampling: SamplingConfig | None = None,
        max_frames: int | None = None,
        seed: int | None = None,
    ) -> Synthesis:
        """Offline synthesis: the streamed chunks of `stream`, joined."""
        run = self.stream(text, language, speaker, instruct, voice_prompt, sampling, max_frames, seed, schedule=(OFFLINE_CHUNK,))
        warnings = [w for request in run.requests for w in request.warnings]
        # Never empty: EOS is masked for the first two frames, and max_frames >= 1.
        audio = np.concatenate([c.audio for c in run])
        return Synthesis(audio, self.sample_rate, run.codes_out.numpy(), list(dict.fromkeys(warnings)))
