"""The one request type of every front end (CLI, app, HTTP API): what to say, in which voice, with
which sampling. `SpeechRequest.validate()` checks everything that does not need the model, with one
specific sentence per problem, before any work starts; the checkpoint-dependent checks (speaker,
language, mode) follow in `TTS.prepare`, still before anything is generated."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pipeline.engine.core import DEFAULT_SCHEDULE, chunk_sizes
from pipeline.errors import TTSInputError

MAX_TEXT_CHARS = 5000
MAX_INSTRUCT_CHARS = 500  # instruction / voice description; with the longest reference and segment it still fits a segment's prompt
MAX_REF_TEXT_CHARS = 500  # transcript of the reference recording (3-30 s of speech)
MAX_SEED = 2**32 - 1  # seeds are hashed as 32-bit values
SEGMENT_CHARS = 300  # longer texts are split at sentence ends and spoken segment after segment
# After . ! ? ; … only when whitespace follows (so 3.5 stays whole); CJK stops need no space.
_SENTENCE_END = re.compile(r"(?<=[.!?;…])\s+|(?<=[。！？；])\s*")


@dataclass
class SpeechRequest:
    """One utterance. None means the checkpoint's default (generation_config.json)."""

    text: str
    language: str = "auto"
    speaker: str | None = None
    instruct: str | None = None
    ref_audio: Any = None  # a file path, or (samples, sample_rate)
    ref_text: str | None = None
    x_vector_only: bool = False
    voice_prompt: Any = None  # a saved voice instead of reference audio: a voice file's path, or its bytes
    greedy: bool = False
    seed: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    subtalker_temperature: float | None = None
    subtalker_top_k: int | None = None
    subtalker_top_p: float | None = None
    max_frames: int | None = None
    schedule: tuple[int, ...] | str = DEFAULT_SCHEDULE
    # Which of the app's models serves it (the CLI names its model on the command line instead).
    model_type: str | None = None
    checkpoint: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SpeechRequest":
        """A JSON object with the field names above; an unknown key is an error that names it."""
        if not isinstance(data, dict):
            raise TTSInputError(f"A request is a JSON object, not {type(data).__name__}.")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise TTSInputError(f"Unknown request field(s): {', '.join(unknown)}.")
        if "text" not in data:
            raise TTSInputError("The request has no 'text'.")
        return cls(**data)

    def validate(self) -> "SpeechRequest":
        """Raise TTSInputError for the first problem; returns self with the schedule parsed."""
        _check_text(self.text)
        _check_length("instruction", self.instruct, MAX_INSTRUCT_CHARS)
        _check_length("reference transcript", self.ref_text, MAX_REF_TEXT_CHARS)
        for name in ("temperature", "subtalker_temperature"):
            _check_number(name, getattr(self, name), lambda v: v > 0, "above 0")
        for name in ("top_p", "subtalker_top_p"):
            _check_number(name, getattr(self, name), lambda v: 0 < v <= 1, "in (0, 1]")
        _check_number("repetition_penalty", self.repetition_penalty, lambda v: v > 0, "above 0")
        for name, low, high in (("top_k", 0, None), ("subtalker_top_k", 0, None), ("seed", 0, MAX_SEED), ("max_frames", 1, None)):
            setattr(self, name, _check_integer(name, getattr(self, name), low, high))
        self.schedule = parse_schedule(self.schedule)
        if not isinstance(self.x_vector_only, bool) or not isinstance(self.greedy, bool):
            raise TTSInputError("x_vector_only and greedy are true or false.")
        for name in ("language", "speaker", "instruct", "ref_text", "model_type", "checkpoint"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TTSInputError(f"{name} must be text, not {type(value).__name__}.")
        if self.ref_audio is not None and isinstance(self.ref_audio, (str, Path)) and not str(self.ref_audio).strip():
            raise TTSInputError("ref_audio is empty: give the path of a recording.")
        if self.voice_prompt is not None:
            self._check_saved_voice()
        return self

    def _check_saved_voice(self) -> None:
        # The file brings the transcript and mode it was made with; a second, different one would be ignored.
        if not isinstance(self.voice_prompt, (str, Path, bytes)):
            raise TTSInputError(f"voice_prompt is a voice file's path or its bytes, not {type(self.voice_prompt).__name__}.")
        if isinstance(self.voice_prompt, (str, Path)) and not str(self.voice_prompt).strip():
            raise TTSInputError("voice_prompt is empty: give the path of a voice file.")
        if self.ref_audio is not None:
            raise TTSInputError("Give either reference audio or a saved voice (voice_prompt), not both.")
        if (self.ref_text or "").strip() or self.x_vector_only:
            raise TTSInputError("A saved voice brings its own transcript and x-vector-only mode: leave ref_text and x_vector_only out.")

    def sampling_overrides(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in (
            "temperature", "top_k", "top_p", "repetition_penalty", "subtalker_temperature", "subtalker_top_k", "subtalker_top_p")}


def _check_text(text: Any) -> None:
    if not isinstance(text, str):
        raise TTSInputError(f"The text must be a string, not {type(text).__name__}.")
    if not text.strip():
        raise TTSInputError("The text is empty: type what the voice should say.")
    if len(text) > MAX_TEXT_CHARS:
        raise TTSInputError(f"The text is {len(text)} characters long; the limit is {MAX_TEXT_CHARS} characters.")


def _check_length(name: str, value: str | None, limit: int) -> None:
    if isinstance(value, str) and len(value) > limit:
        raise TTSInputError(f"The {name} is {len(value)} characters long; the limit is {limit} characters.")


def _check_number(name: str, value: Any, ok, range_text: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise TTSInputError(f"{name} must be a number {range_text} (got {value!r}).")


def _check_integer(name: str, value: Any, low: int, high: int | None) -> int | None:
    """The value as an int (a float with no fraction, as number inputs send, is accepted)."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise TTSInputError(f"{name} must be a whole number {bound} (got {value!r}).")
    return value


def parse_schedule(schedule: Any) -> tuple[int, ...]:
    """'1, 2, 4, 8, 16' or (1, 2, 4, 8, 16) -> (1, 2, 4, 8, 16); frames per chunk, the last repeats."""
    message = f"A chunk schedule is a comma-separated list of frame counts like '1, 2, 4, 8, 16', not '{schedule}'."
    try:
        parts = re.split(r"[,\s]+", schedule.strip()) if isinstance(schedule, str) else list(schedule)
        values = tuple(int(p) for p in parts if p != "")
        chunk_sizes(values)
    except (TypeError, ValueError):
        raise TTSInputError(message) from None
    if any(v > 1000 for v in values):
        raise TTSInputError(message)
    return values


def _pieces(sentence: str, limit: int) -> list[str]:
    """A sentence longer than `limit` cut at its last clause break (or space) before the limit, so no
    segment outgrows the talker's static cache; a single unbroken run of characters is cut hard."""
    pieces = []
    while len(sentence) > limit:
        cut = max(sentence.rfind(mark, 0, limit) for mark in (", ", "，", "、", "; ", " "))
        cut = cut + 1 if cut > 0 else limit
        pieces.append(sentence[:cut].strip())
        sentence = sentence[cut:].strip()
    return pieces + [sentence] if sentence else pieces


def split_text(text: str, limit: int = SEGMENT_CHARS) -> list[str]:
    """Sentences packed into segments of at most `limit` characters (longer sentences cut at clause breaks)."""
    segments: list[str] = []
    for sentence in (s.strip() for s in _SENTENCE_END.split(text.strip())):
        for piece in _pieces(sentence, limit):
            if segments and len(segments[-1]) + 1 + len(piece) <= limit:
                segments[-1] = f"{segments[-1]} {piece}"
            else:
                segments.append(piece)
    return segments
