"""Saved voices: a computed voice prompt as a small safetensors file, and back (`TTS.save_voice_prompt`,
`TTS.load_voice_prompt` are the entry points).

Stored is only what cannot be had again without the recording: the speaker embedding (float32
[speaker_dim]) and, for ICL cloning, the reference codes (int16 [frames, 16]) and transcript. The
vocoder state primed with the reference codes is left out: it is larger than the rest together, and
the model recomputes it exactly from the codes in one decoder pass. A 20 s ICL voice of the 1.7B
model takes about 17 kB.

The JSON metadata (one `__metadata__` key) holds the format and its version, the transcript and
mode, and the checkpoint the voice was made with: its name, for messages, and a fingerprint of the
weights that give the tensors their meaning (speaker encoder and codec codebooks), which decides.
So the same weights under another name (a Hub id or a local copy) or in another dtype read the
file, and another checkpoint is refused with both named.

Every problem is one TTSInputError sentence, raised before any synthesis work.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from pipeline.errors import TTSInputError
from pipeline.request import MAX_REF_TEXT_CHARS

FORMAT = "qwen3-tts-voice"
VERSION = 1
METADATA_KEY = "qwen3_tts_voice"
SUFFIX = ".safetensors"
MAX_BYTES = 1 << 20  # 50x the largest real voice file: anything bigger is not one
NOT_A_VOICE_FILE = "This is not a Qwen3-TTS voice file (a .safetensors file made by Export voice or synth --save-voice-prompt)."
# The metadata fields and their JSON types (ref_text is null for x-vector-only voices).
METADATA_TYPES = {"checkpoint": str, "fingerprint": str, "speaker_dim": int, "x_vector_only": bool, "ref_text": (str, type(None))}


@dataclass(frozen=True)
class VoiceSpace:
    """What a voice's tensors mean in a loaded checkpoint, and what they may hold there."""

    checkpoint: str  # the name it was loaded under (Hub id or directory), for messages
    fingerprint: str  # of the weights that give the tensors their meaning (see `fingerprint`)
    speaker_dim: int
    codebooks: int
    codebook_size: int
    max_ref_frames: int  # codec frames of the longest reference recording accepted


@dataclass
class SavedVoice:
    speaker_embedding: torch.Tensor  # float32 [speaker_dim]
    ref_codes: torch.Tensor | None  # int64 [frames, codebooks]; None for an x-vector-only voice
    ref_text: str | None


def fingerprint(*modules: torch.nn.Module) -> str:
    """A short hash of the modules' weights, names and shapes."""
    digest = hashlib.sha256()
    for module in modules:
        for name, tensor in module.state_dict().items():
            digest.update(f"{name}{tuple(tensor.shape)}".encode())
            # Rounded to bfloat16 (the official weights' dtype), so that one checkpoint loaded in float32
            # or in bfloat16 has one fingerprint.
            digest.update(tensor.detach().to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def dumps(voice: SavedVoice, space: VoiceSpace) -> bytes:
    tensors = {"speaker_embedding": voice.speaker_embedding.detach().to("cpu", torch.float32).contiguous()}
    if voice.ref_codes is not None:
        tensors["ref_codes"] = voice.ref_codes.detach().to("cpu", torch.int16).contiguous()  # ids < 2048
    metadata = {"format": FORMAT, "version": VERSION, "checkpoint": space.checkpoint, "fingerprint": space.fingerprint,
                "speaker_dim": space.speaker_dim, "x_vector_only": voice.ref_codes is None, "ref_text": voice.ref_text}
    return save(tensors, metadata={METADATA_KEY: json.dumps(metadata, ensure_ascii=False)})


def read(source: str | Path | bytes) -> bytes:
    """A voice file's bytes: read from a path (its size checked first), or as given (an upload's body)."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise TTSInputError(f"The voice file {path} does not exist.")
        _check_size(path.stat().st_size)
        return path.read_bytes()
    if not isinstance(source, bytes):
        raise TTSInputError(f"A voice file is given as a path or as its bytes, not as {type(source).__name__}.")
    _check_size(len(source))
    return source


def _check_size(size: int) -> None:
    if size == 0:
        raise TTSInputError("The voice file is empty.")
    if size > MAX_BYTES:
        raise TTSInputError(f"The file is {size / 2**20:.1f} MB; a voice file is a few kB (at most {MAX_BYTES // 2**10} kB), so this is not one.")


def loads(data: bytes, space: VoiceSpace) -> SavedVoice:
    """The voice in a voice file's bytes, checked in full against the loaded checkpoint's `space`."""
    header = _header(data)
    metadata = _metadata(header)
    _check_space(metadata, space)
    try:
        tensors = load(data)
    except SafetensorError:  # offsets that overlap or do not match the dtypes: damaged
        raise TTSInputError(NOT_A_VOICE_FILE) from None
    unexpected = sorted(set(tensors) - {"speaker_embedding", "ref_codes"})
    if unexpected:
        raise TTSInputError(f"The voice file holds tensors a voice file does not have ({', '.join(unexpected)}): it is damaged or not a voice file.")
    embedding = _speaker_embedding(tensors.get("speaker_embedding"), space)
    if metadata["x_vector_only"]:
        if "ref_codes" in tensors or metadata["ref_text"] is not None:
            raise TTSInputError("The voice file is damaged: it says x-vector only, yet holds reference codes or a transcript.")
        return SavedVoice(embedding, None, None)
    return SavedVoice(embedding, _ref_codes(tensors.get("ref_codes"), space), _ref_text(metadata["ref_text"]))


def describe(data: bytes) -> tuple[bool, str | None, int]:
    """What a voice file says it holds, read without a model (x-vector only, transcript, reference
    frames); the full check is `loads` against the checkpoint that will use it."""
    header = _header(data)
    metadata = _metadata(header)
    codes = header.get("ref_codes")
    frames = int(codes["shape"][0]) if isinstance(codes, dict) and codes.get("shape") else 0
    return bool(metadata["x_vector_only"]), metadata["ref_text"], frames


def _header(data: bytes) -> dict[str, Any]:
    """safetensors' JSON header (8 bytes of length, then the JSON); a file cut short is told apart
    from one that is not safetensors at all."""
    size = int.from_bytes(data[:8], "little")
    if len(data) < 9 or data[8:9] != b"{" or size > MAX_BYTES:
        raise TTSInputError(NOT_A_VOICE_FILE)
    if 8 + size > len(data):
        raise _truncated(len(data), 8 + size)
    try:
        header = json.loads(data[8:8 + size])
        end = 8 + size + max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0)
    except (ValueError, UnicodeDecodeError, AttributeError, KeyError, TypeError, IndexError):
        raise TTSInputError(NOT_A_VOICE_FILE) from None
    if not isinstance(end, int):
        raise TTSInputError(NOT_A_VOICE_FILE)
    if end > len(data):
        raise _truncated(len(data), end)
    return header


def _truncated(size: int, needed: int) -> TTSInputError:
    return TTSInputError(f"The voice file is cut short: it has {size} bytes of at least {needed}; download or export it again.")


def _metadata(header: dict[str, Any]) -> dict[str, Any]:
    stored = header.get("__metadata__")
    raw = stored.get(METADATA_KEY) if isinstance(stored, dict) else None
    if raw is None:
        raise TTSInputError("This .safetensors file is not a Qwen3-TTS voice file: it has no voice metadata.")
    try:
        metadata = json.loads(raw)
    except ValueError:
        raise TTSInputError("The voice file's metadata is damaged (not JSON).") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise TTSInputError(NOT_A_VOICE_FILE)
    if metadata.get("version") != VERSION:
        raise TTSInputError(
            f"The voice file has format version {metadata.get('version')!r} and this program reads version {VERSION}: "
            "export the voice again from its reference audio."
        )
    for name, kind in METADATA_TYPES.items():
        # bool is an int in Python; speaker_dim must be a true integer.
        if not isinstance(metadata.get(name), kind) or (kind is int and isinstance(metadata[name], bool)):
            raise TTSInputError(f"The voice file's metadata is damaged: '{name}' is missing or of the wrong type.")
    return metadata


def _check_space(metadata: dict[str, Any], space: VoiceSpace) -> None:
    if metadata["fingerprint"] != space.fingerprint:
        made = f"'{metadata['checkpoint']}' (weights {metadata['fingerprint']}, {metadata['speaker_dim']}-dim speaker embedding)"
        here = f"'{space.checkpoint}' (weights {space.fingerprint}, {space.speaker_dim}-dim)"
        raise TTSInputError(
            f"This voice was made with the checkpoint {made} and cannot be used with {here}: export it again from its reference audio with this checkpoint."
        )


def _speaker_embedding(embedding: torch.Tensor | None, space: VoiceSpace) -> torch.Tensor:
    if embedding is None:
        raise TTSInputError("The voice file has no speaker_embedding.")
    if not embedding.is_floating_point() or tuple(embedding.shape) != (space.speaker_dim,):
        raise TTSInputError(
            f"The voice file's speaker_embedding is {_describe(embedding)}; {space.checkpoint} needs a float vector of {space.speaker_dim}."
        )
    if not torch.isfinite(embedding).all():
        raise TTSInputError("The voice file's speaker_embedding holds values that are not finite (NaN or infinity).")
    return embedding.float()


def _ref_codes(codes: torch.Tensor | None, space: VoiceSpace) -> torch.Tensor:
    if codes is None:
        raise TTSInputError("The voice file is for ICL cloning but has no ref_codes.")
    frames = codes.shape[0] if codes.dim() == 2 else 0
    if codes.is_floating_point() or codes.dtype == torch.bool or codes.dim() != 2 or codes.shape[1] != space.codebooks \
            or not 1 <= frames <= space.max_ref_frames:
        raise TTSInputError(
            f"The voice file's ref_codes are {_describe(codes)}; {space.checkpoint} needs integers shaped "
            f"[frames, {space.codebooks}] with 1 to {space.max_ref_frames} frames."
        )
    codes = codes.long()
    outside = codes[(codes < 0) | (codes >= space.codebook_size)]
    if outside.numel():
        raise TTSInputError(
            f"The voice file's ref_codes hold {outside[0].item()}, outside the codebook of {space.checkpoint} (0 to {space.codebook_size - 1})."
        )
    return codes


def _ref_text(text: str | None) -> str:
    if not (text or "").strip():
        raise TTSInputError("The voice file is for ICL cloning but has no reference transcript.")
    if len(text) > MAX_REF_TEXT_CHARS:
        raise TTSInputError(f"The voice file's reference transcript is {len(text)} characters long; the limit is {MAX_REF_TEXT_CHARS} characters.")
    return text


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"
