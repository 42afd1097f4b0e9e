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

Paths are relative to the session file. Limits (bounded work for any file a visitor can paste):
MAX_FILE_BYTES, MAX_SYSTEMS, MAX_ITEMS, MAX_TRIALS, MAX_LISTENERS, MAX_DEPTH and MAX_NODES below; no
YAML aliases.
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pipeline.contract.models import MODEL_TYPES
from pipeline.errors import TTSInputError
from pipeline.request import REQUEST_FIELDS, SETTING_ROLES, SpeechRequest, fields_of

TESTS = ("ab", "abx", "mushra")


@dataclass(frozen=True)
class Mode:
    """How a system renders: its model type, and what its items need."""

    model_type: str
    needs: tuple[str, ...]  # the item keys each item must give
    x_vector_only: bool = False


def _modes() -> dict[str, Mode]:
    """The engine modes: one per model type that speaks in its own voices, then two per one that clones
    a reference (ICL, and x-vector only)."""
    speech = [kind for kind in MODEL_TYPES.values() if kind.speech]
    modes = {kind.id: Mode(kind.id, ("speaker",) * kind.speaker + ("instruct",) * kind.needs_instruct) for kind in speech if not kind.reference}
    for kind in (kind for kind in speech if kind.reference):
        modes[kind.name] = Mode(kind.id, ("reference_audio", "reference_text"))
        modes[f"{kind.name}_x_vector"] = Mode(kind.id, ("reference_audio",), x_vector_only=True)
    return modes


MODES = _modes()
ITEM_FIELDS = {"speaker": "speaker", "instruct": "instruct", "reference_audio": "ref_audio", "reference_text": "ref_text"}  # item key -> request field
ITEM_KEYS = ("name", "text", "speaker", "instruct", "language", "reference_audio", "reference_text")
SETTING_KEYS = fields_of(*SETTING_ROLES)
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
MAX_FILE_BYTES = 128 * 1024  # a few hundred items of several sentences each; parsed in about half a second
MAX_SYSTEMS = 7  # a MUSHRA trial shows every system and the anchor: 8 conditions on one screen
MAX_ITEMS = 500
MAX_TRIALS = 1000  # per listener: hours of listening already
MAX_LISTENERS = 1000
MAX_DEPTH = 8  # nested lists and mappings; a session file needs 5 (the schedule of a system's settings)
MAX_NODES = 10_000  # YAML values and keys: they bound the parser's work (500 items and 1,000 listeners take 6,600)
MAX_NUMBER_CHARS = 30  # a whole number's digits (a 64-bit seed has 20)
SHOWN_CHARS = 60  # the longest excerpt of a value an error message echoes
_SURROGATE = re.compile("[\ud800-\udfff]")


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
    served_by: str | None = None  # the app's checkpoint that renders `checkpoint`, where another one does (the tiny one under --tiny)

    @property
    def rendered(self) -> bool:
        return self.checkpoint is not None

    def request(self, item: Item) -> SpeechRequest:
        """The engine request of one clip (validated), for the checkpoint that renders it: the item's
        fields that the mode's model type takes, the system's settings and seed."""
        mode = MODES[self.mode]
        kind = MODEL_TYPES[mode.model_type]
        fields = {name: getattr(item, key) for key, name in ITEM_FIELDS.items() if kind.takes(REQUEST_FIELDS[name].role) and getattr(item, key) is not None}
        if kind.reference:
            fields.update(ref_audio=str(item.reference_audio), x_vector_only=mode.x_vector_only)
            if mode.x_vector_only:
                fields.pop("ref_text", None)  # an x-vector-only voice is made without it
        return SpeechRequest(item.text, **{**fields, "language": item.language or "auto", **self.settings, "seed": self.seed,
                                           "model_type": mode.model_type, "checkpoint": self.served_by or self.checkpoint}).validate()


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
    """PyYAML's safe loader with bounded work: no aliases (a few hundred bytes of nested aliases
    stand for gigabytes wherever the value is walked or printed), bounded nesting, bounded numbers,
    keys that are names."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.depth = 0
        self.nodes = 0

    def compose_node(self, parent, index):
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            raise SessionError(f"line {mark.line + 1}: a session file uses no YAML aliases (*name): write the value out.")
        if self.depth >= MAX_DEPTH:
            raise SessionError(f"line {mark.line + 1}: lists and mappings are nested more than {MAX_DEPTH} deep.")
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise SessionError(f"line {mark.line + 1}: a session file holds at most {MAX_NODES:,} values.")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> _Map:
    loader.flatten_mapping(node)
    mapping = _Map()
    mapping.line = node.start_mark.line + 1
    for key_node, value_node in node.value:
        line = key_node.start_mark.line + 1
        if not isinstance(key_node, yaml.ScalarNode):
            raise SessionError(f"line {line}: a key is a name such as text:, not a {'list' if isinstance(key_node, yaml.SequenceNode) else 'mapping'}.")
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str):
            raise SessionError(f"line {line}: the key {_shown(key_node.value)} is not a name such as text:.")
        if key in mapping:
            raise SessionError(f"line {line}: {_shown(key)} is given twice.")
        mapping[key] = loader.construct_object(value_node, deep=True)
        mapping.key_lines[key] = line
    return mapping


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    if len(node.value) > MAX_NUMBER_CHARS:  # int() of thousands of digits is slow, or refused with a traceback
        raise SessionError(f"line {node.start_mark.line + 1}: the number {_shown(node.value)} has more than {MAX_NUMBER_CHARS} digits.")
    return loader.construct_yaml_int(node)


def _construct_str(loader: _Loader, node: yaml.ScalarNode) -> str:
    value = loader.construct_yaml_str(node)
    if _SURROGATE.search(value):  # an escape such as "\\udcff": not text, and it could never be saved as UTF-8
        raise SessionError(f"line {node.start_mark.line + 1}: a value holds a lone surrogate escape (\\ud800-\\udfff), which is not text.")
    return value


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:str", _construct_str)


def _shown(value) -> str:
    """A value as an error message echoes it: a short quoted excerpt of a scalar, never a whole structure."""
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    text = str(value)
    return f"'{text}'" if len(text) <= SHOWN_CHARS else f"'{text[:SHOWN_CHARS]}…'"


def _path_shown(path: Path) -> str:
    """A path as an error message echoes it: its last SHOWN_CHARS * 2 characters (the name is at the end)."""
    text = str(path)
    return text if len(text) <= SHOWN_CHARS * 2 else "…" + text[-SHOWN_CHARS * 2:]


def load_session(path: str | Path, base: Path | None = None, root: Path | None = None) -> Session:
    """Read and check a session file (paths relative to `base`, default its folder, and inside `root`
    when given); SessionError names the file, the line and the problem."""
    path = Path(path)
    try:
        text = _read_bounded(path)
    except FileNotFoundError:
        raise SessionError(f"The session file {path} does not exist.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SessionError(f"The session file {path} cannot be read ({exc}).") from None
    try:
        return parse_session(text, base or path.parent, path.name, root)
    except SessionError as exc:
        raise SessionError(f"{path.name} {exc}") from None


def _read_bounded(path: Path) -> str:
    """The file's text, refused by its size before it is read (and never more than the limit read:
    a file can grow, and /dev/zero says it is empty)."""
    info = path.stat()
    if not stat.S_ISREG(info.st_mode):
        raise SessionError(f"The session file {path} is not a regular file.")
    if info.st_size > MAX_FILE_BYTES:
        raise SessionError(f"The session file {path} is {info.st_size:,} bytes long; a session file is at most {MAX_FILE_BYTES:,} bytes.")
    with path.open("rb") as file:
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise SessionError(f"The session file {path} is over {MAX_FILE_BYTES:,} bytes long, the most a session file may be.")
    return data.decode("utf-8")


def parse_session(text: str, base: Path, name: str = "session", root: Path | None = None) -> Session:
    """Check a session file's text; paths are relative to `base` and, with a `root`, must stay inside it."""
    if len(text) > MAX_FILE_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_FILE_BYTES:  # characters first: no copy of a huge text
        raise SessionError(f"is over {MAX_FILE_BYTES:,} bytes long, the most a session file may be.")
    try:
        raw = yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        raise SessionError(f"line {mark.line + 1 if mark else '?'}: not valid YAML ({exc.problem}).") from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (a control character, a lone surrogate)
        raise SessionError(f"line {text.count(chr(10), 0, exc.position) + 1}: the character #x{exc.character:04x} is not allowed in a session file.") from None
    if not isinstance(raw, _Map):
        raise SessionError("line 1: a session file is a mapping (name:, test:, systems:, items:, ...).")
    _require(raw, ("name", "test", "systems", "items"))
    unknown = sorted(set(raw) - {"name", "test", "systems", "items", "trials_per_listener", "seed", "listeners", "reference"})
    if unknown:
        raise SessionError(f"line {raw.at(unknown[0])}: unknown key {_shown(unknown[0])}.")
    session_name = _name(raw, "name")
    test = raw["test"]
    if test not in TESTS:
        raise SessionError(f"line {raw.at('test')}: test must be one of {', '.join(TESTS)}, not {_shown(test)}.")
    systems = _entries(raw, "systems", MAX_SYSTEMS, lambda entry: _system(entry, base, root))
    items = _entries(raw, "items", MAX_ITEMS, lambda entry: _item(entry, base, root))
    _check_systems_serve_items(systems, items, root)
    reference = raw.get("reference")
    if test == "mushra":
        if reference is None:
            raise SessionError(f"line {raw.line}: a MUSHRA test needs a `reference:` system (the hidden reference and the anchor's source).")
        if not isinstance(reference, str) or reference not in {s.name for s in systems}:
            raise SessionError(f"line {raw.at('reference')}: unknown system {_shown(reference)} (systems: {', '.join(s.name for s in systems)}).")
        if len(systems) < 2:
            raise SessionError(f"line {raw.at('systems')}: a MUSHRA test compares the reference with at least one other system.")
    elif len(systems) < 2:
        raise SessionError(f"line {raw.at('systems')}: an {test.upper()} test needs at least two systems.")
    trials = raw.get("trials_per_listener", len(items) if test == "mushra" else None)
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise SessionError(f"line {raw.at('trials_per_listener')}: trials_per_listener must be a positive whole number.")
    if trials > MAX_TRIALS:
        raise SessionError(f"line {raw.at('trials_per_listener')}: trials_per_listener is at most {MAX_TRIALS:,}; split a longer test into sessions.")
    if test == "mushra" and trials > len(items):
        raise SessionError(f"line {raw.at('trials_per_listener')}: a MUSHRA listener rates each item once: at most {len(items)} trials.")
    listeners = raw.get("listeners") or []
    if not isinstance(listeners, list) or not all(isinstance(n, str) and NAME.match(n) for n in listeners):
        raise SessionError(f"line {raw.at('listeners')}: listeners is a list of ids (letters, digits, - and _).")
    if len(listeners) > MAX_LISTENERS:
        raise SessionError(f"line {raw.at('listeners')}: a session has at most {MAX_LISTENERS:,} listeners.")
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
        raise SessionError(f"line {entry.at(key)}: {key} {_shown(value)} must be 1-64 letters, digits, - or _.")
    return value


def _entries(raw: _Map, key: str, most: int, make) -> list:
    entries = raw[key]
    if not isinstance(entries, list) or not entries:
        raise SessionError(f"line {raw.at(key)}: {key} is a non-empty list.")
    if len(entries) > most:
        raise SessionError(f"line {raw.at(key)}: a session has at most {most} {key}.")
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


def _system(entry: _Map, base: Path, root: Path | None) -> System:
    _require(entry, ("name",))
    name = _name(entry, "name")
    unknown = sorted(set(entry) - {"name", "checkpoint", "mode", "seed", "settings", "folder"})
    if unknown:
        raise SessionError(f"line {entry.at(unknown[0])}: unknown key {_shown(unknown[0])} in system '{name}'.")
    if ("checkpoint" in entry) == ("folder" in entry):
        raise SessionError(f"line {entry.line}: system '{name}' needs either a checkpoint (with a mode) or a folder of recordings.")
    if "folder" in entry:
        folder = _local_path(entry["folder"], base, root, entry.at("folder"), f"the folder of system '{name}'")
        if not folder.is_dir():
            raise SessionError(f"line {entry.at('folder')}: the folder {_path_shown(folder)} of system '{name}' does not exist.")
        return System(name, entry.line, folder=folder)
    if not isinstance(entry["checkpoint"], str):
        raise SessionError(f"line {entry.at('checkpoint')}: the checkpoint of system '{name}' is a name or a folder, not {_shown(entry['checkpoint'])}.")
    mode = entry.get("mode")
    if not isinstance(mode, str) or mode not in MODES:
        raise SessionError(f"line {entry.at('mode')}: system '{name}' needs a mode: one of {', '.join(MODES)}.")
    settings = entry.get("settings") or {}
    if not isinstance(settings, dict):
        raise SessionError(f"line {entry.at('settings')}: settings of system '{name}' is a mapping.")
    bad = sorted(set(settings) - set(SETTING_KEYS))
    if bad:
        raise SessionError(f"line {settings.at(bad[0])}: unknown setting {_shown(bad[0])} of system '{name}' (settings: {', '.join(SETTING_KEYS)}).")
    seed = entry.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise SessionError(f"line {entry.at('seed')}: the seed of system '{name}' is a whole number from 0 to 2^32-1.")
    if "schedule" in settings and isinstance(settings["schedule"], list):
        settings = {**settings, "schedule": tuple(settings["schedule"])}
    return System(name, entry.line, checkpoint=entry["checkpoint"], mode=mode, seed=seed, settings=dict(settings))


def _item(entry: _Map, base: Path, root: Path | None) -> Item:
    _require(entry, ("name", "text"))
    name = _name(entry, "name")
    unknown = sorted(set(entry) - set(ITEM_KEYS))
    if unknown:
        raise SessionError(f"line {entry.at(unknown[0])}: unknown key {_shown(unknown[0])} in item '{name}'.")
    values = {k: entry.get(k) for k in ITEM_KEYS if k != "name"}
    for key in ("text", "speaker", "instruct", "language", "reference_text"):
        if values[key] is not None and not isinstance(values[key], str):
            raise SessionError(f"line {entry.at(key)}: the {key} of item '{name}' is text, not {_shown(values[key])}.")
    if values["reference_audio"] is not None:
        values["reference_audio"] = _local_path(values["reference_audio"], base, root, entry.at("reference_audio"),
                                                f"the reference audio of item '{name}'")
        if not values["reference_audio"].is_file():
            raise SessionError(f"line {entry.at('reference_audio')}: the reference audio {_path_shown(values['reference_audio'])} of item '{name}' does not exist.")
    return Item(name, entry.line, **values)


def _local_path(value, base: Path, root: Path | None, line: int, what: str) -> Path:
    """`value` as a path relative to `base`. With a `root`, a path that leads outside it is refused
    from its text alone, before anything there is looked up, so that the answer never depends on
    what is there; then once more with its symlinks followed."""
    if not isinstance(value, (str, int)) or isinstance(value, bool) or "\0" in str(value):
        raise SessionError(f"line {line}: {what} is a path, not {_shown(value)}.")
    path = base / str(value)
    if root is None:
        return path
    inside = Path(os.path.normpath(os.path.abspath(path))).is_relative_to(os.path.abspath(root))
    # realpath, not Path.resolve: that also stats where a symlink leads, even outside
    if not inside or not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root)):
        raise SessionError(f"line {line}: {what} is outside the sessions folder; recordings and reference voices go inside it.")
    return path


def _check_systems_serve_items(systems: list[System], items: list[Item], root: Path | None) -> None:
    import soundfile as sf

    for system in systems:
        for item in items:
            if system.folder is not None:
                wav = _local_path(f"{item.name}.wav", system.folder, root, system.line, f"the recording of item '{item.name}' of system '{system.name}'")
                if not wav.is_file():
                    raise SessionError(f"line {system.line}: system '{system.name}' has no recording of item '{item.name}' ({_path_shown(wav)} is missing).")
                try:
                    sf.info(str(wav))
                except (RuntimeError, OSError):  # libsndfile's errors name no file
                    raise SessionError(f"line {system.line}: {_path_shown(wav)} of system '{system.name}' is not a readable WAV file.") from None
                continue
            missing = [key for key in MODES[system.mode].needs if getattr(item, key) in (None, "")]
            if missing:
                raise SessionError(f"line {item.line}: item '{item.name}' has no {missing[0]}, which system '{system.name}' ({system.mode}) needs.")
            try:
                system.request(item)
            except TTSInputError as exc:
                raise SessionError(f"line {item.line}: item '{item.name}' with system '{system.name}': {excerpt(str(exc))}") from None


def excerpt(message: str, most: int = 300) -> str:
    """A message from elsewhere, cut to a bounded length (it may quote a long value)."""
    return message if len(message) <= most else message[:most] + "…"
