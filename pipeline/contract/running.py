"""What both services do alike without a model: keep the streams running by key (for Stop), and check
an uploaded reference recording before anything reads it."""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Protocol

from pipeline.errors import TTSInputError

MAX_UPLOAD_BYTES = 50 * 1024 * 1024


class Stoppable(Protocol):
    def close(self) -> None:  # thread-safe: ends the stream within a frame
        ...


class Running:
    """The streams running, by key (browser session, tab and run): one per key, a new run replacing the
    one before; an engine handle, a chat, or a remote backend's connection."""

    def __init__(self) -> None:
        self._streams: dict[str, Stoppable] = {}
        self._lock = threading.Lock()

    def add(self, key: str, handle: Stoppable) -> None:
        with self._lock:
            previous = self._streams.get(key)
            self._streams[key] = handle
        if previous is not None:
            previous.close()

    def remove(self, key: str, handle: Stoppable) -> None:
        with self._lock:
            if self._streams.get(key) is handle:
                del self._streams[key]

    def stop(self, key: str) -> bool:
        with self._lock:
            handle = self._streams.get(key)
        if handle is None:
            return False
        handle.close()
        return True


def check_reference_upload(path: str | Path | None) -> Path:
    """The problems of an uploaded or recorded reference file that come before decoding it."""
    if path is None or str(path) == "":
        raise TTSInputError("No reference audio: upload a recording, record one with the microphone, or pick a sample voice.")
    path = Path(path)
    if not path.is_file():
        raise TTSInputError(f"The reference audio file {path.name} is gone; upload it again.")
    size = path.stat().st_size
    if size == 0:
        raise TTSInputError("The reference recording is empty: record again, and speak for 3-20 seconds.")
    if size > MAX_UPLOAD_BYTES:
        raise TTSInputError(f"The reference file is {size / 2**20:.0f} MB; the limit is {MAX_UPLOAD_BYTES // 2**20} MB (3-20 s of speech is far less).")
    return path


def content_hash(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
