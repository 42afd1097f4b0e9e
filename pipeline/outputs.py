"""Output paths, checked before any work: a bad --out should cost no synthesis."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pipeline.errors import TTSInputError

# The extensions each kind of output may have: audio in the formats soundfile writes (from the extension,
# in any letter case), codes as NumPy's .npy, a saved voice as safetensors.
OUTPUT_EXTENSIONS = {"audio": (".wav", ".flac", ".ogg"), "codes": (".npy",), "text": (".txt",), "voice": (".safetensors",)}


def check_output_path(path: Path, kind: Literal["audio", "codes", "text", "voice"]) -> None:
    """Raise TTSInputError unless a file of `kind` ("audio", "codes", "text" or "voice", see OUTPUT_EXTENSIONS) can be written at `path`."""
    extensions = OUTPUT_EXTENSIONS[kind]
    if path.is_dir():
        raise TTSInputError(f"Cannot write {kind} to {path}: it is a directory; give a file name such as {path / ('out' + extensions[0])}.")
    if path.suffix.lower() not in extensions:
        raise TTSInputError(f"Cannot write {kind} to {path}: the file name must end in {_one_of(extensions)}.")
    _check_writable_directory(path.parent, f"Cannot write {kind} to {path}")
    if path.exists() and not os.access(path, os.W_OK):
        raise TTSInputError(f"Cannot write {kind} to {path}: the file exists and is read-only.")


def check_output_dir(path: Path) -> None:
    """Raise TTSInputError unless `path` is a writable directory, or could be created (the writer creates it)."""
    if path.exists() and not path.is_dir():
        raise TTSInputError(f"Cannot write into {path}: it is a file, not a directory.")
    _check_writable_directory(_nearest_existing(path), f"Cannot write into {path}")


def _check_writable_directory(directory: Path, action: str) -> None:
    if not directory.exists():
        raise TTSInputError(f"{action}: the directory {directory} does not exist.")
    if not directory.is_dir():
        raise TTSInputError(f"{action}: {directory} is a file, not a directory.")
    try:
        # Creating a file is the only reliable test: os.access says yes to root where the filesystem refuses (sysfs, procfs).
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise TTSInputError(f"{action}: the directory {directory} is not writable ({exc.strerror}).") from None


def _nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists: where a directory that is not there yet would be created."""
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _one_of(choices: Sequence[str]) -> str:
    return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"
