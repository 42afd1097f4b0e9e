"""The one request type of every front end (CLI, app, HTTP API): what to say, in which voice, with
which sampling. `SpeechRequest.validate()` checks everything that does not need the model, with one
specific sentence per problem, before any work starts; the checkpoint-dependent checks (speaker,
language, mode) follow in `TTS.prepare`, still before anything is generated."""
from __future__ import annotations

import json
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
MAX_SCALE = 100  # temperature, repetition penalty: far past any use (the samplers hold them as float32)
MAX_TOP_K = 2**31 - 1  # what the samplers' integer tensors hold with room; a top-k beyond the vocabulary keeps it whole
# No field takes a number a double cannot hold (~1.8e308): longer integers are refused where the JSON is
# read, before Python converts them (it refuses over 4,300 digits) or a float conversion overflows.
MAX_NUMBER_DIGITS = 308
FRAME_SECONDS = 0.08
_SURROGATE = re.compile(r"[\ud800-\udfff]")
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
        for name in ("text", "language", "speaker", "instruct", "ref_text", "model_type", "checkpoint"):
            check_unicode(name, getattr(self, name))
        _check_length("instruction", self.instruct, MAX_INSTRUCT_CHARS)
        _check_length("reference transcript", self.ref_text, MAX_REF_TEXT_CHARS)
        for name in ("temperature", "subtalker_temperature", "repetition_penalty"):
            setattr(self, name, check_number(name, getattr(self, name), lambda v: 0 < v <= MAX_SCALE, f"above 0 and at most {MAX_SCALE}"))
        for name in ("top_p", "subtalker_top_p"):
            setattr(self, name, check_number(name, getattr(self, name), lambda v: 0 < v <= 1, "in (0, 1]"))
        for name, low, high in (("top_k", 0, MAX_TOP_K), ("subtalker_top_k", 0, MAX_TOP_K), ("seed", 0, MAX_SEED), ("max_frames", 1, None)):
            setattr(self, name, check_integer(name, getattr(self, name), low, high))
        self.schedule = parse_schedule(self.schedule)
        if not isinstance(self.x_vector_only, bool) or not isinstance(self.greedy, bool):
            raise TTSInputError("x_vector_only and greedy are true or false.")
        for name in ("language", "speaker", "instruct", "ref_text", "model_type", "checkpoint"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TTSInputError(f"{name} must be text, not {type(value).__name__}.")
        if self.ref_audio is not None and isinstance(self.ref_audio, (str, Path)) and not str(self.ref_audio).strip():
            raise TTSInputError("ref_audio is empty: give the path of a recording.")
        if self.model_type == "voice_design":
            self._check_voice_description()
        if self.voice_prompt is not None:
            self._check_saved_voice()
        return self

    def _check_voice_description(self) -> None:
        if not (self.instruct or "").strip():
            raise TTSInputError("Voice design needs a voice description (the instruction): describe the voice to speak in.", "instruct")

    def check_for_checkpoint(self, model_type: str, frame_limit: int) -> None:
        """The checks that need the checkpoint's type and its bound on max_frames (its generation_config's
        max_new_tokens - 1: one request may not hold an engine row for longer than the checkpoint would speak)."""
        if model_type == "voice_design":
            self._check_voice_description()
        if self.max_frames is not None and self.max_frames > frame_limit:
            raise TTSInputError(f"max_frames (max_new_tokens in the API) must be at most {frame_limit} for this checkpoint "
                                f"({frame_limit * FRAME_SECONDS:.1f} s), not {self.max_frames}.", "max_frames")

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
        raise TTSInputError(f"The text must be a string, not {type(text).__name__}.", "text")
    if not text.strip():
        raise TTSInputError("The text is empty: type what the voice should say.", "text")
    if len(text) > MAX_TEXT_CHARS:
        raise TTSInputError(f"The text is {len(text)} characters long; the limit is {MAX_TEXT_CHARS} characters.", "text")


def _check_length(name: str, value: str | None, limit: int) -> None:
    if isinstance(value, str) and len(value) > limit:
        raise TTSInputError(f"The {name} is {len(value)} characters long; the limit is {limit} characters.")


def check_unicode(name: str, value: Any, field: str | None = None) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (an invalid byte of a command line, or a JSON
    escape such as \\udcff) is not text, and would fail later in the tokenizer or in the reply."""
    found = _SURROGATE.search(value) if isinstance(value, str) else None
    if found:
        raise TTSInputError(f"{name} holds the lone surrogate \\u{ord(found.group()):04x} (an invalid UTF-8 byte, or half of a "
                            "\\u escape pair), which is not text.", field or name)


def shown(value: Any) -> str:
    """A value as a message quotes it: an integer too long to print usefully (or at all: Python
    refuses over 4,300 digits) by its size."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"a number of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return repr(value)


def check_number(name: str, value: Any, ok, range_text: str) -> float | None:
    """The value as a float: a real number (int or float, not bool) that a double holds, finite and `ok`."""
    if value is None:
        return None
    try:
        number = None if isinstance(value, bool) or not isinstance(value, (int, float)) else float(value)
    except OverflowError:  # an int beyond a double's range
        number = None
    if number is None or not math.isfinite(number) or not ok(value):
        raise TTSInputError(f"{name} must be a number {range_text} (got {shown(value)}).", name)
    return number


def check_integer(name: str, value: Any, low: int, high: int | None) -> int | None:
    """The value as an int (a float with no fraction, as number inputs send, is accepted)."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise TTSInputError(f"{name} must be a whole number {bound} (got {shown(value)}).", name)
    return value


class _LongNumber:
    """An integer literal of more than MAX_NUMBER_DIGITS digits, kept as its digits until it is refused by name."""

    def __init__(self, digits: str):
        self.digits = len(digits.lstrip("-"))


def _integer(literal: str) -> int | _LongNumber:
    return _LongNumber(literal) if len(literal.lstrip("-")) > MAX_NUMBER_DIGITS else int(literal)


def load_json(text: str | bytes) -> Any:
    """A JSON document as every front end reads one (API bodies, synth-batch lines): each value that no
    field could take is refused by where it is: a lone surrogate in a string or key, an integer of
    over MAX_NUMBER_DIGITS digits. json.JSONDecodeError for text that is not JSON."""
    try:
        data = json.loads(text, parse_int=_integer)
        _check_tree(data, "")
    except RecursionError:
        raise TTSInputError("The JSON is nested too deeply to read.") from None
    return data


def _check_tree(value: Any, path: str) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            check_unicode(f"A key of {path or 'the request'}", key, path or None)
            _check_tree(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_tree(item, f"{path}[{index}]")
    elif isinstance(value, _LongNumber):
        raise TTSInputError(f"{path} is a number of {value.digits} digits; no field takes a number of over {MAX_NUMBER_DIGITS} digits.", path)
    else:
        check_unicode(path or "The request", value)


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
