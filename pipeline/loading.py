"""Find a checkpoint (local directory in the official layout, or a Hugging Face Hub id) and load it unchanged."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from pipeline.errors import CheckpointError, TTSInputError
from pipeline.model import MODEL_TYPES, Qwen3TTS, TTSConfig

REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "speech_tokenizer/config.json",
    "speech_tokenizer/model.safetensors",
)
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
HUB_PATTERNS = ["*.json", "*.txt", "*.safetensors", "speech_tokenizer/*"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_checkpoint(source: str) -> Path:
    """A local directory as it is, or a Hub id downloaded (or found in the cache); checked for every file."""
    path = Path(source).expanduser()
    directory = path if path.is_dir() else _download(source)
    missing = [name for name in REQUIRED_FILES if not (directory / name).is_file()]
    if not (directory / WEIGHTS).is_file() and not (directory / WEIGHTS_INDEX).is_file():
        missing.insert(0, WEIGHTS)
    if missing:
        raise CheckpointError(f"Checkpoint directory {directory} is missing {', '.join(missing)}.")
    return directory


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except HFValidationError:
        raise CheckpointError(f"'{repo_id}' is neither a local directory nor a valid Hugging Face Hub id (owner/name).") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"'{repo_id}' is not a local directory, and the Hugging Face Hub has no model with that id (or it is private).") from None
    except LocalEntryNotFoundError:
        raise CheckpointError(
            f"Cannot get '{repo_id}': the Hugging Face Hub is unreachable (no network or HF_HUB_OFFLINE=1) and the model is not in the local cache."
        ) from None


def read_json(directory: Path, name: str) -> dict[str, Any]:
    try:
        return json.loads((directory / name).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{directory / name} is not valid JSON ({exc}).") from None


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise TTSInputError(f"Unsupported dtype '{name}': use one of {', '.join(DTYPES)}.")
    return DTYPES[name]


def torch_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TTSInputError("CUDA was requested but no CUDA GPU is available here: use --device cpu.")
    return device


def load_weights(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / WEIGHTS).is_file():
        return load_file(directory / WEIGHTS)
    index = read_json(directory, WEIGHTS_INDEX)
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        if not (directory / shard).is_file():
            raise CheckpointError(f"Checkpoint directory {directory} is missing {shard}.")
        state.update(load_file(directory / shard))
    return state


def load_model(directory: Path, device: torch.device, dtype: torch.dtype) -> Qwen3TTS:
    raw = read_json(directory, "config.json")
    if raw.get("tts_model_type") not in MODEL_TYPES:
        raise CheckpointError(
            f"{directory / 'config.json'} has tts_model_type {raw.get('tts_model_type')!r}; "
            f"a Qwen3-TTS 12 Hz checkpoint has one of {', '.join(MODEL_TYPES)}."
        )
    config = TTSConfig.from_dict(raw)
    with torch.device("meta"):
        model = Qwen3TTS(config)
    result = model.load_state_dict(load_weights(directory), strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"{directory / WEIGHTS} does not fit a '{config.tts_model_type}' checkpoint of this config: "
            f"missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}."
        )
    return model.to(device=device, dtype=dtype).eval()
