"""Reference audio for voice cloning: load, mix to mono, validate, resample to 24 kHz.

One 24 kHz waveform feeds both the speaker encoder and the codec encoder: the official package
resamples with librosa (soxr_hq) to 24 kHz for each, so resampling once here is equivalent.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np

from pipeline.contract.events import SAMPLE_RATE
from pipeline.errors import TTSInputError

MIN_SECONDS = 1.0
MAX_SECONDS = 30.0
MAX_CHANNELS = 8
MIN_MESSAGE_SECONDS = 0.1
SILENCE_PEAK = 1e-4  # ~-80 dBFS: below this no voice can be heard, let alone cloned

AudioSource = str | Path | tuple[np.ndarray, int] | tuple[int, np.ndarray]


def load_reference_audio(source: AudioSource) -> np.ndarray:
    """Reference audio as float32 mono at 24 kHz, or TTSInputError with one sentence a user can act on.

    `source` is a file path (anything libsndfile reads: WAV, FLAC, OGG, MP3; other formats go
    through librosa/audioread, which needs ffmpeg) or an in-memory clip: `(samples, sample_rate)`
    as in the official package, or `(sample_rate, samples)` as a Gradio numpy Audio gives it.
    Integer samples are scaled to [-1, 1) (the official package would feed raw int16 values).
    Multi-channel audio is averaged to mono; arrays are [samples, channels] unless the first axis
    has at most 8 entries and the second more (channels-first, e.g. from torchaudio).

    Clips outside 1-30 s are rejected rather than trimmed: a silent cut could end mid-word, and in
    ICL mode the reference transcript must match the audio exactly, so only the user can choose
    the excerpt. The length is checked before resampling, so long uploads fail fast.
    """
    if isinstance(source, tuple):
        wav, sr = _from_tuple(source)
    else:
        wav, sr = _read_file(Path(source))
    if wav.size == 0:  # before the mono mix, which cannot tell the channel axis of an empty array
        raise TTSInputError("The reference audio is empty (it has no samples).")
    wav = _to_mono(wav)
    _validate(wav, sr)
    if sr != SAMPLE_RATE:
        import librosa  # imported where used: in-memory 24 kHz audio needs neither librosa nor soundfile

        wav = librosa.resample(wav, orig_sr=sr, target_sr=SAMPLE_RATE)  # soxr_hq, as the reference
    return np.ascontiguousarray(wav, dtype=np.float32)


def _read_file(path: Path, what: str = "reference audio") -> tuple[np.ndarray, int]:
    if not path.exists():
        raise TTSInputError(f"The {what} file {path} does not exist.")
    if not path.is_file():
        raise TTSInputError(f"The {what} path {path} is a directory, not an audio file.")
    import librosa
    import soundfile as sf

    try:
        wav, sr = sf.read(str(path), dtype="float32", always_2d=True)  # [samples, channels]
        return wav, int(sr)
    except sf.LibsndfileError:
        pass  # not a libsndfile format (e.g. m4a): let librosa try audioread below
    try:
        with warnings.catch_warnings():  # librosa warns that its audioread fallback is deprecated
            warnings.simplefilter("ignore")
            wav, sr = librosa.load(str(path), sr=None, mono=False)  # [channels, samples] or [samples]
        return np.asarray(wav, dtype=np.float32), int(sr)
    except Exception as e:  # audioread raises several unrelated types (NoBackendError, EOFError, ...)
        raise TTSInputError(
            f"The file {path.name} could not be read as audio; upload a WAV, FLAC, OGG or MP3 recording."
        ) from e


def load_clip(path: str | Path, sample_rate: int) -> np.ndarray:
    """A recording of any length as float32 mono at `sample_rate` (a listening session's folder system)."""
    wav, sr = _read_file(Path(path), "recording")
    wav = _to_mono(wav) if wav.size else wav.reshape(-1)
    if wav.size == 0 or not np.isfinite(wav).all():
        raise TTSInputError(f"The recording {Path(path).name} is empty or holds NaN or infinite samples.")
    if sr != sample_rate:
        import librosa

        wav = librosa.resample(wav, orig_sr=sr, target_sr=sample_rate)
    return np.ascontiguousarray(wav, dtype=np.float32)


def load_message_audio(source: AudioSource, sample_rate: int, max_seconds: float) -> np.ndarray:
    """A spoken chat message (file or in-memory clip, as `load_reference_audio` takes them) as
    float32 mono at `sample_rate`; TTSInputError for an unreadable, empty, silent or too long one."""
    wav, sr = _from_tuple(source) if isinstance(source, tuple) else _read_file(Path(source), "audio message")
    wav = _to_mono(wav) if wav.size else wav.reshape(-1)
    if wav.size < sr * MIN_MESSAGE_SECONDS:
        raise TTSInputError(f"The audio message is empty or shorter than {MIN_MESSAGE_SECONDS:g} s; record or upload some speech.")
    if not np.isfinite(wav).all():
        raise TTSInputError("The audio message contains NaN or infinite sample values.")
    if wav.size / sr > max_seconds:
        raise TTSInputError(f"The audio message is {math.ceil(wav.size / sr * 10) / 10:.1f} s long but may be at most {max_seconds:g} s; "
                            "send a shorter clip.")
    if float(np.abs(wav).max()) < SILENCE_PEAK:
        raise TTSInputError("The audio message is silent; record or upload a clip in which the voice is audible.")
    if sr != sample_rate:
        import librosa

        wav = librosa.resample(wav, orig_sr=sr, target_sr=sample_rate)
    return np.ascontiguousarray(wav, dtype=np.float32)


def _from_tuple(source: tuple) -> tuple[np.ndarray, int]:
    if len(source) != 2:
        raise TTSInputError("In-memory reference audio must be a (samples, sample_rate) pair.")
    a, b = source
    wav, sr = (b, a) if isinstance(a, (int, np.integer)) else (a, b)
    if not isinstance(wav, np.ndarray) or not isinstance(sr, (int, np.integer)) or sr <= 0:
        raise TTSInputError("In-memory reference audio must be a numpy array with a positive integer sample rate.")
    if np.issubdtype(wav.dtype, np.signedinteger):
        wav = wav.astype(np.float32) / float(2 ** (8 * wav.dtype.itemsize - 1))
    elif np.issubdtype(wav.dtype, np.unsignedinteger):  # 8-bit PCM is unsigned with a 128 offset
        half = float(2 ** (8 * wav.dtype.itemsize - 1))
        wav = (wav.astype(np.float32) - half) / half
    elif not np.issubdtype(wav.dtype, np.floating):
        raise TTSInputError(f"In-memory reference audio has unsupported sample type {wav.dtype}.")
    return wav.astype(np.float32, copy=False), int(sr)


def _to_mono(wav: np.ndarray) -> np.ndarray:
    if wav.ndim == 1:
        return wav
    if wav.ndim != 2:
        raise TTSInputError(f"Reference audio must be mono or multi-channel 2-D, got shape {wav.shape}.")
    # [samples, channels] (soundfile, Gradio) unless the first axis is clearly a channel axis.
    channel_axis = 0 if wav.shape[0] <= MAX_CHANNELS < wav.shape[1] else 1
    return wav.mean(axis=channel_axis, dtype=np.float32)


def _validate(wav: np.ndarray, sr: int) -> None:
    if not np.isfinite(wav).all():
        raise TTSInputError("The reference audio contains NaN or infinite sample values.")
    seconds = wav.size / sr
    if seconds < MIN_SECONDS:  # floor the shown value so it never reads as the minimum itself
        shown = math.floor(seconds * 100) / 100
        raise TTSInputError(
            f"The reference audio is {shown:.2f} s long but must be at least {MIN_SECONDS:g} s; "
            "use 3-20 s of clear speech."
        )
    if seconds > MAX_SECONDS:  # ceil, for the same reason
        shown = math.ceil(seconds * 100) / 100
        raise TTSInputError(
            f"The reference audio is {shown:.2f} s long but may be at most {MAX_SECONDS:g} s; "
            "trim it to 3-20 s of clear speech."
        )
    peak = float(np.abs(wav).max())
    if peak < SILENCE_PEAK:
        raise TTSInputError(
            f"The reference audio is silent (peak amplitude {peak:.1e}, below {SILENCE_PEAK:.0e}); "
            "record or upload a clip in which the voice is audible."
        )
