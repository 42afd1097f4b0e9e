"""The clips of a session: rendered by our engine through the app's `Service` (its voice-prompt cache,
Stop by key; a wave of a session's requests started at once, so the batched engine runs them
together) or read from a system's folder; loudness-normalised to
-23 LUFS (EBU R 128, measured by pyloudnorm's ITU-R BS.1770 meter) so that level does not decide a
vote; cached on disk by a hash of everything that makes the clip, so a clip is rendered once and a
re-render (same checkpoint, settings, seed) gives the same audio. MUSHRA's anchor is the reference
low-passed at 3.5 kHz (ITU-R BS.1534), level-matched the same way.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from pipeline.audio import load_clip
from pipeline.contract import Service
from pipeline.contract.events import SAMPLE_RATE, Chunk, StreamEnd
from pipeline.errors import TTSInputError
from pipeline.listening.design import ANCHOR
from pipeline.listening.session import Item, Session, System

TARGET_LUFS = -23.0
PEAK_LIMIT = 0.999  # a gain that would clip is reduced to this peak (the clip is then quieter; the manifest says so)
ANCHOR_CUTOFF_HZ = 3500
SUBMIT_AT_ONCE = 32  # within the engine's queue limit
MIN_MEASURABLE_S = 0.4  # BS.1770 gates 400 ms blocks: shorter clips cannot be measured


@dataclass(frozen=True)
class Clip:
    system: str  # a system's name, or ANCHOR
    item: str
    path: Path
    loudness_lufs: float | None  # as rendered, before normalisation (None: too short or silent to measure)
    gain_db: float


class ClipCache:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, session: Session, system: str, item: str) -> Path:
        # Named by the hash alone: the file name a listener's browser sees must not name the system.
        return self.root / session.name / f"{clip_key(session, system, item)[:24]}.wav"

    def missing(self, session: Session) -> list[tuple[str, str]]:
        """(system, item) of every clip not rendered yet."""
        names = [s.name for s in session.systems] + ([ANCHOR] if session.test == "mushra" else [])
        return [(s, i.name) for s in names for i in session.items if not self.path(session, s, i.name).is_file()]

    def render(self, session: Session, service: Service, progress: Callable[[int, int], None] | None = None) -> list[Clip]:
        """Render (or find) every clip of the session; `progress(done, total)` after each. A clip's
        stream runs under the key `render_key(session, system, item)`: `service.stop` of it ends the
        render with a TTSInputError, the clips before it kept."""
        todo = self.missing(session)
        total, done = len(todo), 0
        engine_clips = [(s, i) for s, i in todo if s != ANCHOR and session.system(s).rendered]
        for start in range(0, len(engine_clips), SUBMIT_AT_ONCE):  # together: the engine batches them
            wave = [(s, i, _started(service, session, s, i)) for s, i in engine_clips[start:start + SUBMIT_AT_ONCE]]
            for s, i, stream in wave:
                self._store(session, s, i, _audio(stream, f"clip of system '{s}' and item '{i}'"))
                done += 1
                if progress:
                    progress(done, total)
        for s, i in todo:
            system = session.system(s) if s != ANCHOR else None
            if system is not None and not system.rendered:
                self._store(session, s, i, load_clip(system.folder / f"{i}.wav", SAMPLE_RATE))
            elif s == ANCHOR:
                reference, _ = sf.read(self.path(session, session.reference, i), dtype="float32")
                self._store(session, ANCHOR, i, low_pass(reference, ANCHOR_CUTOFF_HZ))
            else:
                continue
            done += 1
            if progress:
                progress(done, total)
        return [self.clip(session, s, i.name) for s in [x.name for x in session.systems] + ([ANCHOR] if session.test == "mushra" else [])
                for i in session.items]

    def clip(self, session: Session, system: str, item: str) -> Clip:
        path = self.path(session, system, item)
        meta = json.loads(path.with_suffix(".json").read_text())
        return Clip(system, item, path, meta["loudness_lufs"], meta["gain_db"])

    def _store(self, session: Session, system: str, item: str, audio: np.ndarray) -> None:
        path = self.path(session, system, item)
        path.parent.mkdir(parents=True, exist_ok=True)
        normalised, loudness, gain_db = normalise_loudness(audio)
        partial = path.with_suffix(".partial.wav")  # written aside and renamed: a killed render leaves no half clip
        sf.write(partial, normalised, SAMPLE_RATE, subtype="FLOAT")
        path.with_suffix(".json").write_text(json.dumps({"loudness_lufs": loudness, "gain_db": gain_db, "target_lufs": TARGET_LUFS}))
        partial.rename(path)


def clip_key(session: Session, system: str, item: str) -> str:
    """A hash of everything the clip depends on (for the anchor: its reference clip's)."""
    if system == ANCHOR:
        return hashlib.sha256(f"anchor:{ANCHOR_CUTOFF_HZ}:{clip_key(session, session.reference, item)}".encode()).hexdigest()
    spec_system, spec_item = session.system(system), session.item(item)
    if not spec_system.rendered:
        spec = {"recording": _file_hash(spec_system.folder / f"{item}.wav")}
    else:
        spec = {"system": _system_spec(spec_system), "item": _item_spec(spec_item)}
    return hashlib.sha256(json.dumps({**spec, "lufs": TARGET_LUFS}, sort_keys=True).encode()).hexdigest()


def normalise_loudness(audio: np.ndarray) -> tuple[np.ndarray, float | None, float]:
    """The clip at TARGET_LUFS integrated loudness (peak-limited); its loudness before, and the gain."""
    import pyloudnorm

    if len(audio) < MIN_MEASURABLE_S * SAMPLE_RATE or not np.any(audio):
        return audio.astype(np.float32), None, 0.0
    loudness = float(pyloudnorm.Meter(SAMPLE_RATE).integrated_loudness(audio.astype(np.float64)))
    if not np.isfinite(loudness):
        return audio.astype(np.float32), None, 0.0
    gain = 10 ** ((TARGET_LUFS - loudness) / 20)
    peak = float(np.abs(audio).max()) * gain
    if peak > PEAK_LIMIT:
        gain *= PEAK_LIMIT / peak
    return (audio * gain).astype(np.float32), loudness, float(20 * np.log10(gain))


def low_pass(audio: np.ndarray, cutoff_hz: float) -> np.ndarray:
    from scipy.signal import butter, sosfiltfilt

    sos = butter(8, cutoff_hz, fs=SAMPLE_RATE, output="sos")
    return sosfiltfilt(sos, audio.astype(np.float64)).astype(np.float32)


def render_key(session: Session, system: str, item: str) -> str:
    return f"listening:{session.name}:{system}:{item}"


def _started(service: Service, session: Session, system: str, item: str) -> Iterator:
    """The clip's stream, its request checked and sent to the engine (which starts it beside the others started before it)."""
    stream = service.stream(session.system(system).request(session.item(item)), render_key(session, system, item))
    next(stream)  # the StreamStart: the request is in the engine
    return stream


def _audio(stream: Iterator, what: str) -> np.ndarray:
    """The whole audio of a started stream; TTSInputError if Stop ended it."""
    try:
        items = list(stream)
    finally:
        stream.close()
    if next(item for item in items if isinstance(item, StreamEnd)).stopped:
        raise TTSInputError(f"Rendering was stopped at the {what}; render again to go on.")
    return np.concatenate([item.audio for item in items if isinstance(item, Chunk)])


def _system_spec(system: System) -> dict:
    spec = {"checkpoint": system.checkpoint, "mode": system.mode, "seed": system.seed, "settings": {k: list(v) if isinstance(v, tuple) else v
                                                                                                 for k, v in system.settings.items()}}
    if system.served_by is not None:  # another checkpoint's clip: never taken for the named checkpoint's
        spec["served_by"] = system.served_by
    return spec


def _item_spec(item: Item) -> dict:
    spec = {k: v for k, v in asdict(item).items() if k not in ("line", "reference_audio")}
    if item.reference_audio is not None:
        spec["reference_audio"] = _file_hash(item.reference_audio)
    return spec


def _file_hash(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
