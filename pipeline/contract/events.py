"""What a stream yields and what a service describes, as plain records (numpy at most, no torch), and
the audio constants every side shares: the engine makes these records, the HTTP server and the remote
client carry them, the UI shows them."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

SAMPLE_RATE = 24000  # of every waveform the models speak
FRAMES_PER_SECOND = 12.5  # codec frames (one talker step each)
SAMPLES_PER_FRAME = 1920  # SAMPLE_RATE / FRAMES_PER_SECOND: 80 ms
FRAME_SECONDS = 1 / FRAMES_PER_SECOND
DEFAULT_SCHEDULE = (1, 2, 4, 8, 16)  # frames per chunk; the last size repeats
TINY = "tiny"  # the checkpoint name that selects the built-in tiny random checkpoint of a tab's type

# Omni chat's defaults and bounds, which its tab shows before a model is loaded.
DEFAULT_SPEAKER = "Ethan"
DEFAULT_SYSTEM_PROMPT = (
    "You are Qwen-Omni, a smart voice assistant created by Alibaba Qwen. You are communicating with the user by voice: "
    "keep your replies short and conversational, and do not use formatting, lists or emoji, which cannot be spoken."
)
MAX_REPLY_TOKENS = 1024  # reply tokens at most (and by default): the thinker's cache slot is sized for them
MAX_AUDIO_SECONDS = 60.0  # per spoken message


@dataclass
class Chunk:
    """One piece of streamed audio and where its time went."""

    index: int
    audio: np.ndarray  # float32 [samples] at 24 kHz
    frames: int
    # None where the figure is not known: a remote backend streams audio without its generation timings.
    generate_ms: float | None  # GPU time of the decode steps of this chunk's frames (the first chunk adds the prefill)
    vocode_ms: float | None  # GPU time of the vocoder for them
    elapsed_ms: float  # since the request was submitted, when this chunk was ready; chunk 0's is the TTFA
    audio_seconds: float  # audio streamed so far, this chunk included
    sample_rate: int = SAMPLE_RATE

    @property
    def rtf(self) -> float:
        """Running real-time factor: wall time so far over audio so far (below 1 is faster than real time)."""
        return self.elapsed_ms / 1000.0 / self.audio_seconds if self.audio_seconds else float("inf")


@dataclass
class Queued:
    """The request waits for a free row; `ahead` requests are before it."""

    ahead: int


@dataclass
class Waiting:
    """Yielded, instead of blocking, by a stream asked not to wait: nothing is ready yet.
    `when_ready(listener)` calls `listener()` once the next item is (see pipeline.engine.Mailbox)."""

    when_ready: Callable[[Callable[[], None]], None]


@dataclass
class StreamStart:
    """The first item of `Service.stream`: what serves the request and what the user should know."""

    checkpoint: str
    random_weights: bool
    warnings: list[str] = field(default_factory=list)
    backend: str | None = None  # the URL of the remote backend that generates it; None: this process
    stand_in: str | None = None  # what serves in the checkpoint's place (TINY: it could not be had); None: itself


@dataclass
class StreamEnd:
    """The last item of `Service.stream`: whether Stop ended it, and what the user should know."""

    stopped: bool
    warnings: list[str] = field(default_factory=list)
    words: list[dict] | None = None  # [{"word", "start", "end"}] in seconds of the audio, where the request asked for word timestamps


@dataclass
class TextDelta:
    """New reply text: tokens first_token..last_token (token k is spoken in speech frame k)."""

    first_token: int
    last_token: int
    text: str
    elapsed_ms: float  # since the request started


@dataclass
class ChatEnd:
    text: str  # the reply as the tokenizer decodes it, special tokens skipped
    tokens: list[int]  # the reply's token ids, <|im_end|> included when the thinker wrote it
    frames: int
    stopped: bool
    first_text_ms: float | None
    first_audio_ms: float | None
    thinker_ms_per_token: float
    codes: np.ndarray  # int64 [frames, 16], layer-0 code first
    warnings: list[str] = field(default_factory=list)
    dropped_turns: int = 0  # the oldest turns of the conversation left out to fit the model's context


@dataclass
class Fallback:
    """A checkpoint that could not be had, and the tiny random one serving in its place."""

    model_type: str
    source: str
    reason: str


@dataclass(frozen=True)
class ModelInfo:
    """What a tab shows about its checkpoint: the choices it offers and whether its weights are real."""

    checkpoint: str
    model_type: str
    speakers: list[str]
    languages: list[str]
    supports_instruct: bool
    random_weights: bool
    stand_in: str | None = None  # what serves in the checkpoint's place (TINY: it could not be had); None: itself


@dataclass(frozen=True)
class VoiceInfo:
    """What the Voice clone tab says about a loaded voice file."""

    x_vector_only: bool
    ref_text: str | None
    ref_seconds: float  # of reference audio behind its codes; 0 for x-vector only
