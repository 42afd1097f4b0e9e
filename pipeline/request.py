"""The one request type of every front door (CLI, app, HTTP API, remote client, listening sessions),
described once: each field of `SpeechRequest` carries its `Spec` (kind, range, help sentence, role, its
name in the HTTP API, its Advanced control in the UI). The CLI's flags, the API's fields, the remote
body, the listening settings and the UI's Advanced values are made from these specs, and so is
`SpeechRequest.validate()`, which checks everything that does not need the model, with one specific
sentence per problem, before any work starts, and returns the request marked valid, which the
services and `TTS` take without checking it again. The checkpoint-dependent checks (speaker, language,
frame limit) follow in `TTS.check`, still before anything is generated."""
from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pipeline.contract.events import DEFAULT_SCHEDULE, FRAME_SECONDS
from pipeline.contract.models import MODEL_TYPES, SPEECH_TYPES
from pipeline.errors import TTSInputError

MAX_TEXT_CHARS = 5000
MAX_INSTRUCT_CHARS = 500  # instruction / voice description; with the longest reference and segment it still fits a segment's prompt
MAX_REF_TEXT_CHARS = 500  # transcript of the reference recording (3-30 s of speech)
MAX_SEED = 2**32 - 1  # seeds are hashed as 32-bit values
MAX_SCALE = 100  # temperature, repetition penalty: far past any use (the samplers hold them as float32)
MAX_TOP_K = 2**31 - 1  # what the samplers' integer tensors hold with room; a top-k beyond the vocabulary keeps it whole
MAX_CHUNK_FRAMES = 1000
# No field takes a number a double cannot hold (~1.8e308): longer integers are refused where the JSON is
# read, before Python converts them (it refuses over 4,300 digits) or a float conversion overflows.
MAX_NUMBER_DIGITS = 308
_SURROGATE = re.compile(r"[\ud800-\udfff]")
SEGMENT_CHARS = 300  # longer texts are split at sentence ends and spoken segment after segment
# After . ! ? ; … only when whitespace follows (so 3.5 stays whole); CJK stops need no space.
_SENTENCE_END = re.compile(r"(?<=[.!?;…])\s+|(?<=[。！？；])\s*")

# Roles: what part of a request a field is: text, language, speaker, instruct, reference, greedy, seed,
# sampling, length, delivery, timings or routing. A model type takes the fields of "speaker", "instruct" and
# "reference" only where its registry entry says so (pipeline.contract.models.ModelType.takes).
SETTING_ROLES = ("language", "greedy", "sampling", "length", "delivery")  # a listening system's `settings`


@dataclass(frozen=True)
class Slider:
    """The UI's Advanced control of a field: a slider from `low` to `high`."""

    low: float
    high: float
    step: float
    label: str


@dataclass(frozen=True)
class Choice:
    """The UI's Advanced control of a field: one of `options`, (label, value) pairs, the first the default."""

    label: str
    options: tuple[tuple[str, Any], ...]
    info: str = ""


@dataclass(frozen=True)
class Spec:
    """One request field: `kind` is text, utterance (the text to speak), number, integer, flag, schedule,
    file (a path, or what a file holds), or model_type."""

    kind: str
    role: str
    help: str  # for the CLI's --help, its default included
    api: str | None  # its name in a POST /v1/audio/speech body (None: not taken there)
    low: float | None = None  # numbers: the range
    high: float | None = None
    low_open: bool = False  # the range excludes `low`
    max_chars: int | None = None  # text: the longest accepted
    label: str = ""  # how a message names it (the length check's, the warning of settings vLLM-Omni does not take); "": its name
    shipped: Any = None  # sampling: the value the official checkpoints ship (generation_config.json), the UI's starting value
    slider: Slider | None = None  # in the UI's Advanced accordion
    choice: Choice | None = None  # in the UI's Advanced accordion
    cli: bool = True  # a flag of `python -m pipeline synth`
    vllm: bool = True  # vLLM-Omni takes it per request (its deploy config sets the others)

    def range_text(self) -> str:
        if self.low_open:  # a probability reads as an interval, a scale in words
            return f"in ({self.low:g}, {self.high:g}]" if self.high <= 1 else f"above {self.low:g} and at most {self.high:g}"
        return f"from {self.low:g} to {self.high:g}"


def _spec(default: Any, kind: str, role: str, help: str, api: str | None, **more: Any) -> Any:
    return field(default=default, metadata={"spec": Spec(kind, role, help, api, **more)})


def _sampling(kind: str, help: str, shipped: Any, slider: Slider | None = None, **more: Any) -> Any:
    return _spec(None, kind, "sampling", f"{help} (default: the checkpoint's generation_config.json)", _same, shipped=shipped, slider=slider,
                 vllm=False, **more)


_same = "="  # the API's name for the field is its own


@dataclass(frozen=True)
class SpeechRequest:
    """One utterance. None means the checkpoint's default (generation_config.json). Build it with any
    values; `validate()` returns it checked and normalised (a schedule parsed, whole floats made ints)."""

    text: str = _spec(dataclasses.MISSING, "utterance", "text", "what to say (required)", "input")
    language: str = _spec("auto", "text", "language", "language of the text, or auto (default: auto)", _same)
    speaker: str | None = _spec(None, "text", "speaker", "preset speaker (CustomVoice checkpoints; default: none)", "voice")
    instruct: str | None = _spec(None, "text", "instruct", "style instruction (CustomVoice 1.7B) or voice description (VoiceDesign) (default: none)",
                                 "instructions", max_chars=MAX_INSTRUCT_CHARS, label="instruction")
    ref_audio: Any = _spec(None, "file", "reference", "reference recording to clone (Base checkpoints; default: none)", _same)  # a path, or (samples, rate)
    ref_text: str | None = _spec(None, "text", "reference", "transcript of the reference recording (ICL voice clone; default: none)", _same,
                                 max_chars=MAX_REF_TEXT_CHARS, label="reference transcript")
    x_vector_only: bool = _spec(False, "flag", "reference", "clone from the speaker embedding alone, no transcript (default: off)",
                                "x_vector_only_mode")
    voice_prompt: Any = _spec(None, "file", "reference", "a saved voice (.safetensors from --save-voice-prompt or the app's Export voice) "
                              "instead of --ref-audio (default: none)", _same, vllm=False)  # a voice file's path, or its bytes
    greedy: bool = _spec(False, "flag", "greedy", "no sampling, for talker and sub-talker (default: off)", None)
    seed: int | None = _spec(None, "integer", "seed", "0..2^32-1; the same seed gives the same audio (default: a new take each time)", _same,
                             low=0, high=MAX_SEED)
    temperature: float | None = _sampling("number", "the talker's sampling temperature", 0.9, Slider(0.1, 1.5, 0.05, "Temperature"),
                                          low=0, high=MAX_SCALE, low_open=True)
    top_k: int | None = _sampling("integer", "the talker's top-k (0: off)", 50, Slider(1, 200, 1, "Top-k"), low=0, high=MAX_TOP_K)
    top_p: float | None = _sampling("number", "the talker's top-p", 1.0, Slider(0.05, 1.0, 0.05, "Top-p"), low=0, high=1, low_open=True)
    repetition_penalty: float | None = _sampling("number", "the talker's repetition penalty", 1.05, Slider(1.0, 1.5, 0.01, "Repetition penalty"),
                                                 low=0, high=MAX_SCALE, low_open=True)
    subtalker_temperature: float | None = _sampling("number", "the code predictor's sampling temperature", 0.9, low=0, high=MAX_SCALE, low_open=True)
    subtalker_top_k: int | None = _sampling("integer", "the code predictor's top-k (0: off)", 50, low=0, high=MAX_TOP_K)
    subtalker_top_p: float | None = _sampling("number", "the code predictor's top-p", 1.0, low=0, high=1, low_open=True)
    max_frames: int | None = _spec(None, "integer", "length", "at most this many 80 ms frames for the whole text, at most the checkpoint's "
                                   "max_new_tokens - 1 (default: each segment of the text up to that many; a warning on stderr says what is left "
                                   "unspoken)", "max_new_tokens", low=1)
    schedule: tuple[int, ...] | str = _spec(DEFAULT_SCHEDULE, "schedule", "delivery", "frames per chunk, 80 ms each, the last repeating, "
                                            "as '1, 2, 4, 8, 16' (default: 1, 2, 4, 8, 16)", _same, vllm=False, label="chunk schedule")
    non_streaming_mode: bool | None = _spec(None, "flag", "delivery", "the whole text in the prompt (on), or fed one token per frame (off) "
                                            "(default: the model type's: off for Base, on for the others)", _same, vllm=False,
                                            choice=Choice("Text layout", (("The model type's", None), ("Whole text in the prompt", True),
                                                                          ("One token per frame", False)),
                                                          "How the talker reads the text. The model type's: one token per frame for voice "
                                                          "clone, the whole text for the others. One token per frame also times the words, "
                                                          "and the word being spoken is highlighted."))
    word_timestamps: bool = _spec(False, "flag", "timings", "each word's start and end in the audio, where the text is fed one token per frame "
                                  "(default: off)", _same, cli=False, vllm=False)
    # Which of the app's models serves it (the CLI names its model on the command line instead; the API its model and task_type).
    model_type: str | None = _spec(None, "model_type", "routing", "base, custom_voice or voice_design", None, cli=False)
    checkpoint: str | None = _spec(None, "text", "routing", "one of the app's checkpoints of the model type", None, cli=False)
    validated: bool = field(default=False, init=False, repr=False, compare=False)  # set by validate() alone

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SpeechRequest":
        """A JSON object with the field names above; an unknown key is an error that names it."""
        if not isinstance(data, dict):
            raise TTSInputError(f"A request is a JSON object, not {type(data).__name__}.")
        unknown = sorted(set(data) - set(REQUEST_FIELDS))
        if unknown:
            raise TTSInputError(f"Unknown request field(s): {', '.join(unknown)}.")
        if "text" not in data:
            raise TTSInputError("The request has no 'text'.")
        return cls(**data)

    def validate(self) -> "SpeechRequest":
        """The request checked field by field and across fields (TTSInputError for the first problem),
        normalised and marked valid; a valid request is returned as it is."""
        if self.validated:
            return self
        values = {name: _checked(name, spec, getattr(self, name)) for name, spec in REQUEST_FIELDS.items()}
        checked = dataclasses.replace(self, **values)
        checked._check_across()
        object.__setattr__(checked, "validated", True)
        return checked

    def for_service(self) -> "SpeechRequest":
        """The request validated, naming the model type that a service picks its model by."""
        checked = self.validate()
        if checked.model_type is None:
            raise TTSInputError(f"The request names no model type: use one of {', '.join(SPEECH_TYPES)}.", "model_type")
        return checked

    def _check_across(self) -> None:
        if self.model_type is not None and MODEL_TYPES[self.model_type].needs_instruct:
            self.check_voice_description()
        if self.model_type is not None:
            self.check_word_timestamps(self.model_type)
        if self.voice_prompt is not None:
            self._check_saved_voice()

    def check_voice_description(self) -> None:
        if not (self.instruct or "").strip():
            raise TTSInputError("Voice design needs a voice description (the instruction): describe the voice to speak in.", "instruct")

    def streams_text(self, model_type: str) -> bool:
        """Whether a checkpoint of `model_type` is fed this request's text one token per frame (the streaming-text layout)."""
        return MODEL_TYPES[model_type].streams_text if self.non_streaming_mode is None else not self.non_streaming_mode

    def check_word_timestamps(self, model_type: str) -> None:
        """Words are timed from the frames at which their tokens enter the talker, which only the streaming-text layout has."""
        if self.word_timestamps and not self.streams_text(model_type):
            why = "non_streaming_mode is true" if self.non_streaming_mode else f"{MODEL_TYPES[model_type].task_type} puts it there by default"
            raise TTSInputError("Word timestamps need the text fed one token per frame, and this request has the whole text in the prompt "
                                f"({why}): set non_streaming_mode to false.", "word_timestamps")

    def check_for_checkpoint(self, model_type: str, frame_limit: int) -> None:
        """The checks that need the checkpoint's type and its bound on max_frames (its generation_config's
        max_new_tokens - 1: one request may not hold an engine row for longer than the checkpoint would speak)."""
        if self.model_type != model_type and MODEL_TYPES[model_type].needs_instruct:  # validate() checked it for the type named
            self.check_voice_description()
        if self.model_type != model_type:
            self.check_word_timestamps(model_type)
        if self.max_frames is not None and self.max_frames > frame_limit:
            raise TTSInputError(f"max_frames (max_new_tokens in the API) must be at most {frame_limit} for this checkpoint "
                                f"({frame_limit * FRAME_SECONDS:.1f} s), not {self.max_frames}.", "max_frames")

    def _check_saved_voice(self) -> None:
        # The file brings the transcript and mode it was made with; a second, different one would be ignored.
        if self.ref_audio is not None:
            raise TTSInputError("Give either reference audio or a saved voice (voice_prompt), not both.")
        if (self.ref_text or "").strip() or self.x_vector_only:
            raise TTSInputError("A saved voice brings its own transcript and x-vector-only mode: leave ref_text and x_vector_only out.")

    def sampling_overrides(self) -> dict[str, Any]:
        """The sampling settings it sets (None: the checkpoint's), by SamplingConfig's field names."""
        return {name: getattr(self, name) for name in fields_of("sampling")}


REQUEST_FIELDS: dict[str, Spec] = {f.name: f.metadata["spec"] for f in fields(SpeechRequest) if "spec" in f.metadata}
_DEFAULTS = {f.name: f.default for f in fields(SpeechRequest)}


def fields_of(*roles: str) -> tuple[str, ...]:
    """The request's fields of these roles, in the request's order."""
    return tuple(name for name, spec in REQUEST_FIELDS.items() if spec.role in roles)


def default(name: str) -> Any:
    return _DEFAULTS[name]


def shipped(name: str) -> Any:
    """A sampling field's value in the official checkpoints (the reference's default)."""
    return REQUEST_FIELDS[name].shipped


def api_fields() -> Iterator[tuple[str, str]]:
    """(request field, its name in an HTTP body) of every field the API takes."""
    for name, spec in REQUEST_FIELDS.items():
        if spec.api is not None:
            yield name, name if spec.api == _same else spec.api


def _checked(name: str, spec: Spec, value: Any) -> Any:
    """The value of one field, checked against its spec and normalised."""
    if spec.kind == "utterance":
        _check_text(value)
    elif spec.kind == "text":
        _check_optional_text(name, spec, value)
    elif spec.kind == "number":
        return check_number(name, value, lambda v: (spec.low < v if spec.low_open else spec.low <= v) and v <= spec.high, spec.range_text())
    elif spec.kind == "integer":
        return check_integer(name, value, int(spec.low), None if spec.high is None else int(spec.high))
    elif spec.kind == "flag":
        if not isinstance(value, bool) and not (value is None and _DEFAULTS[name] is None):
            raise TTSInputError(f"{name} is true or false, not {shown(value)}.", name)
    elif spec.kind == "schedule":
        return parse_schedule(value)
    elif spec.kind == "file":
        _check_file(name, value)
    elif spec.kind == "model_type":
        _check_optional_text(name, spec, value)
        if value is not None and value not in SPEECH_TYPES:
            raise TTSInputError(f"Unknown model type {value!r}: use one of {', '.join(SPEECH_TYPES)}.", name)
    return value


def _check_text(text: Any) -> None:
    if not isinstance(text, str):
        raise TTSInputError(f"The text must be a string, not {type(text).__name__}.", "text")
    check_unicode("text", text)
    if not text.strip():
        raise TTSInputError("The text is empty: type what the voice should say.", "text")
    if len(text) > MAX_TEXT_CHARS:
        raise TTSInputError(f"The text is {len(text)} characters long; the limit is {MAX_TEXT_CHARS} characters.", "text")


def _check_optional_text(name: str, spec: Spec, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise TTSInputError(f"{name} must be text, not {type(value).__name__}.", name)
    check_unicode(name, value)
    if spec.max_chars is not None and len(value) > spec.max_chars:
        raise TTSInputError(f"The {spec.label} is {len(value)} characters long; the limit is {spec.max_chars} characters.", name)


def _check_file(name: str, value: Any) -> None:
    """A path (or, for a saved voice, the file's bytes; for reference audio, (samples, sample rate)) that is not empty."""
    if value is None:
        return
    if name == "voice_prompt" and not isinstance(value, (str, Path, bytes)):
        raise TTSInputError(f"voice_prompt is a voice file's path or its bytes, not {type(value).__name__}.", name)
    if isinstance(value, (str, Path)) and not str(value).strip():
        what = "a voice file" if name == "voice_prompt" else "a recording"
        raise TTSInputError(f"{name} is empty: give the path of {what}.", name)


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
    except (TypeError, ValueError):
        raise TTSInputError(message, "schedule") from None
    if not values or any(v < 1 or v > MAX_CHUNK_FRAMES for v in values):
        raise TTSInputError(message, "schedule")
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
