"""A listening session's definition: a YAML file (the organizer view writes the same), validated with
errors that name the file and line.

    name: sizes                 # the session's name (letters, digits, - and _)
    test: ab                    # ab (preference), abx or mushra
    trials_per_listener: 12     # ab / abx; mushra: one trial per item
    seed: 1                     # the trial design's seed
    listeners: [ann, ben]       # optional: only these ids may vote (any id when absent)
    reference: recording        # mushra: the system played as the hidden reference (and low-passed as the anchor)
    systems:
      - name: small             # our engine: a checkpoint, a mode, settings and a seed
        checkpoint: Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice
        mode: custom_voice      # custom_voice, voice_design, clone (ICL) or clone_x_vector
        seed: 7
        settings: {temperature: 0.9, schedule: [1, 2, 4, 8, 16]}
      - name: recording         # or a folder with one ITEM.wav per item
        folder: recordings
    items:
      - name: greeting
        text: Hello there, and welcome.
        speaker: ryan           # custom_voice; voice_design takes `instruct`;
        language: English       # clone takes `reference_audio` (and `reference_text` for ICL)

Paths are relative to the session file.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipeline.errors import TTSInputError
from pipeline.request import SpeechRequest

TESTS = ("ab", "abx", "mushra")
MODES = {  # what each engine mode needs of an item
    "custom_voice": ("speaker",),
    "voice_design": ("instruct",),
    "clone": ("reference_audio", "reference_text"),
    "clone_x_vector": ("reference_audio",),
}
MODEL_TYPE = {"custom_voice": "custom_voice", "voice_design": "voice_design", "clone": "base", "clone_x_vector": "base"}
ITEM_KEYS = ("name", "text", "speaker", "instruct", "language", "reference_audio", "reference_text")
SETTING_KEYS = ("language", "greedy", "temperature", "top_k", "top_p", "repetition_penalty", "subtalker_temperature", "subtalker_top_k",
                "subtalker_top_p", "max_frames", "schedule")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


class SessionError(TTSInputError):
    """A session file that cannot be run; the message names the file and the line."""


@dataclass(frozen=True)
class System:
    name: str
    line: int
    checkpoint: str | None = None  # our engine ...
    mode: str | None = None
    seed: int = 0
    settings: dict = field(default_factory=dict)
    folder: Path | None = None  # ... or existing recordings, ITEM.wav per item

    @property
    def rendered(self) -> bool:
        return self.checkpoint is not None

    def request(self, item: "Item") -> SpeechRequest:
        """The engine request of one clip (validated)."""
        fields = {"speaker": item.speaker, "instruct": item.instruct, "language": item.language or "auto"}
        if self.mode in ("clone", "clone_x_vector"):
            fields = {"ref_audio": str(item.reference_audio), "ref_text": item.reference_text if self.mode == "clone" else None,
                      "x_vector_only": self.mode == "clone_x_vector", "language": item.language or "auto"}
        fields = {k: v for k, v in fields.items() if v is not None}
        return SpeechRequest(item.text, **{**fields, **self.settings, "seed": self.seed, "model_type": MODEL_TYPE[self.mode],
                                           "checkpoint": self.checkpoint}).validate()


@dataclass(frozen=True)
class Item:
    name: str
    line: int
    text: str
    speaker: str | None = None
    instruct: str | None = None
    language: str | None = None
    reference_audio: Path | None = None
    reference_text: str | None = None


@dataclass(frozen=True)
class Session:
    name: str
    test: str
    systems: tuple[System, ...]
    items: tuple[Item, ...]
    trials_per_listener: int
    seed: int = 0
    listeners: tuple[str, ...] = ()  # empty: anyone with the link
    reference: str | None = None  # mushra
    path: Path | None = None

    def system(self, name: str) -> System:
        return next(s for s in self.systems if s.name == name)

    def item(self, name: str) -> Item:
        return next(i for i in self.items if i.name == name)


class _Map(dict):
    """A YAML mapping that remembers its line and the line of each key."""

    line = 0

    def __init__(self) -> None:
        super().__init__()
        self.key_lines: dict[str, int] = {}

    def at(self, key: str) -> int:
        return self.key_lines.get(key, self.line)


class _Loader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> _Map:
    loader.flatten_mapping(node)
    mapping = _Map()
    mapping.line = node.start_mark.line + 1
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in mapping:
            raise SessionError(f"line {line}: '{key}' is given twice.")
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.key_lines[key] = line
    return mapping


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_session(path: str | Path) -> Session:
    """Read and check a session file; SessionError names the file, the line and the problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SessionError(f"The session file {path} does not exist.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SessionError(f"The session file {path} cannot be read ({exc}).") from None
    try:
        return parse_session(text, path.parent, path.name)
    except SessionError as exc:
        raise SessionError(f"{path.name} {exc}") from None


def parse_session(text: str, base: Path, name: str = "session") -> Session:
    try:
        raw = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        raise SessionError(f"line {mark.line + 1 if mark else '?'}: not valid YAML ({exc.problem}).") from None
    if not isinstance(raw, _Map):
        raise SessionError("line 1: a session file is a mapping (name:, test:, systems:, items:, ...).")
    _require(raw, ("name", "test", "systems", "items"))
    unknown = sorted(set(raw) - {"name", "test", "systems", "items", "trials_per_listener", "seed", "listeners", "reference"})
    if unknown:
        raise SessionError(f"line {raw.at(unknown[0])}: unknown key '{unknown[0]}'.")
    session_name = _name(raw, "name")
    test = raw["test"]
    if test not in TESTS:
        raise SessionError(f"line {raw.at('test')}: test must be one of {', '.join(TESTS)}, not '{test}'.")
    systems = _entries(raw, "systems", lambda entry: _system(entry, base))
    items = _entries(raw, "items", lambda entry: _item(entry, base))
    _check_systems_serve_items(systems, items, base)
    reference = raw.get("reference")
    if test == "mushra":
        if reference is None:
            raise SessionError(f"line {raw.line}: a MUSHRA test needs a `reference:` system (the hidden reference and the anchor's source).")
        if reference not in {s.name for s in systems}:
            raise SessionError(f"line {raw.at('reference')}: unknown system '{reference}' (systems: {', '.join(s.name for s in systems)}).")
        if len(systems) < 2:
            raise SessionError(f"line {raw.at('systems')}: a MUSHRA test compares the reference with at least one other system.")
    elif len(systems) < 2:
        raise SessionError(f"line {raw.at('systems')}: an {test.upper()} test needs at least two systems.")
    trials = raw.get("trials_per_listener", len(items) if test == "mushra" else None)
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise SessionError(f"line {raw.at('trials_per_listener')}: trials_per_listener must be a positive whole number.")
    if test == "mushra" and trials > len(items):
        raise SessionError(f"line {raw.at('trials_per_listener')}: a MUSHRA listener rates each item once: at most {len(items)} trials.")
    listeners = raw.get("listeners") or []
    if not isinstance(listeners, list) or not all(isinstance(n, str) and NAME.match(n) for n in listeners):
        raise SessionError(f"line {raw.at('listeners')}: listeners is a list of ids (letters, digits, - and _).")
    if len(set(listeners)) != len(listeners):
        raise SessionError(f"line {raw.at('listeners')}: a listener id is given twice.")
    seed = raw.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise SessionError(f"line {raw.at('seed')}: seed must be a whole number.")
    return Session(session_name, test, tuple(systems), tuple(items), trials, seed, tuple(listeners), reference)


def _require(entry: _Map, keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in entry or entry[k] in (None, "")]
    if missing:
        raise SessionError(f"line {entry.line}: '{missing[0]}' is missing.")


def _name(entry: _Map, key: str) -> str:
    value = entry[key]
    if not isinstance(value, str) or not NAME.match(value):
        raise SessionError(f"line {entry.at(key)}: {key} '{value}' must be 1-64 letters, digits, - or _.")
    return value


def _entries(raw: _Map, key: str, make) -> list:
    entries = raw[key]
    if not isinstance(entries, list) or not entries:
        raise SessionError(f"line {raw.at(key)}: {key} is a non-empty list.")
    made, seen = [], {}
    for entry in entries:
        if not isinstance(entry, _Map):
            raise SessionError(f"line {raw.at(key)}: each of {key} is a mapping with a name.")
        value = make(entry)
        if value.name in seen:
            raise SessionError(f"line {entry.at('name')}: duplicate name '{value.name}' in {key} (first on line {seen[value.name]}).")
        seen[value.name] = entry.at("name")
        made.append(value)
    return made


def _system(entry: _Map, base: Path) -> System:
    _require(entry, ("name",))
    name = _name(entry, "name")
    unknown = sorted(set(entry) - {"name", "checkpoint", "mode", "seed", "settings", "folder"})
    if unknown:
        raise SessionError(f"line {entry.at(unknown[0])}: unknown key '{unknown[0]}' in system '{name}'.")
    if ("checkpoint" in entry) == ("folder" in entry):
        raise SessionError(f"line {entry.line}: system '{name}' needs either a checkpoint (with a mode) or a folder of recordings.")
    if "folder" in entry:
        folder = base / str(entry["folder"])
        if not folder.is_dir():
            raise SessionError(f"line {entry.at('folder')}: the folder {folder} of system '{name}' does not exist.")
        return System(name, entry.line, folder=folder)
    mode = entry.get("mode")
    if mode not in MODES:
        raise SessionError(f"line {entry.at('mode')}: system '{name}' needs a mode: one of {', '.join(MODES)}.")
    settings = entry.get("settings") or {}
    if not isinstance(settings, dict):
        raise SessionError(f"line {entry.at('settings')}: settings of system '{name}' is a mapping.")
    bad = sorted(set(settings) - set(SETTING_KEYS))
    if bad:
        raise SessionError(f"line {settings.at(bad[0])}: unknown setting '{bad[0]}' of system '{name}' (settings: {', '.join(SETTING_KEYS)}).")
    seed = entry.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise SessionError(f"line {entry.at('seed')}: the seed of system '{name}' is a whole number from 0 to 2^32-1.")
    if "schedule" in settings and isinstance(settings["schedule"], list):
        settings = {**settings, "schedule": tuple(settings["schedule"])}
    return System(name, entry.line, checkpoint=str(entry["checkpoint"]), mode=mode, seed=seed, settings=dict(settings))


def _item(entry: _Map, base: Path) -> Item:
    _require(entry, ("name", "text"))
    name = _name(entry, "name")
    unknown = sorted(set(entry) - set(ITEM_KEYS))
    if unknown:
        raise SessionError(f"line {entry.at(unknown[0])}: unknown key '{unknown[0]}' in item '{name}'.")
    values = {k: entry.get(k) for k in ITEM_KEYS if k != "name"}
    if values["reference_audio"] is not None:
        values["reference_audio"] = base / str(values["reference_audio"])
        if not values["reference_audio"].is_file():
            raise SessionError(f"line {entry.at('reference_audio')}: the reference audio {values['reference_audio']} of item '{name}' does not exist.")
    return Item(name, entry.line, **values)


def _check_systems_serve_items(systems: list[System], items: list[Item], base: Path) -> None:
    import soundfile as sf

    for system in systems:
        for item in items:
            if system.folder is not None:
                wav = system.folder / f"{item.name}.wav"
                if not wav.is_file():
                    raise SessionError(f"line {system.line}: system '{system.name}' has no recording of item '{item.name}' ({wav} is missing).")
                try:
                    sf.info(str(wav))
                except Exception:  # libsndfile's errors name no file
                    raise SessionError(f"line {system.line}: {wav} of system '{system.name}' is not a readable WAV file.") from None
                continue
            missing = [key for key in MODES[system.mode] if getattr(item, key) in (None, "")]
            if missing:
                raise SessionError(f"line {item.line}: item '{item.name}' has no {missing[0]}, which system '{system.name}' ({system.mode}) needs.")
            try:
                system.request(item)
            except TTSInputError as exc:
                raise SessionError(f"line {item.line}: item '{item.name}' with system '{system.name}': {exc}") from None
