"""Find a checkpoint (local directory in the official layout, or a Hugging Face Hub id) and load it unchanged.

Every damaged or inconsistent file raises CheckpointError naming it, so the CLI can say which file to replace.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from pipeline.config_types import ROPE, check_config, dataclass_schema
from pipeline.errors import CheckpointError, TTSInputError
from pipeline.model import MODEL_TYPES, CodePredictorConfig, Qwen3TTS, TalkerConfig, TTSConfig
from pipeline.text_tokenizer import TextTokenizer

# The keys of a Qwen3-TTS config.json that TTSConfig.from_dict reads, by their JSON types.
TTS_CONFIG = dataclass_schema(TTSConfig, {TalkerConfig: {"rope_parameters": ROPE}, CodePredictorConfig: {"rope_parameters": ROPE}})
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
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICE_NAME = re.compile(r"cpu|cuda(:[0-9]+)?")
# bfloat16 arithmetic (and Triton's bf16 dots) from Ampere on; a T4 (7.5) has float16 tensor cores only.
BFLOAT16_CAPABILITY = (8, 0)
CUDA_ARCH = re.compile(r"sm_([0-9]+)([0-9])[a-z]?")


def resolve_checkpoint(source: str, required: tuple[str, ...] = REQUIRED_FILES) -> Path:
    """A local directory as it is, or a Hub id downloaded (or found in the cache); checked for every file."""
    path = Path(source).expanduser()
    directory = path if path.is_dir() else _download(source)
    missing = [name for name in required if not (directory / name).is_file()]
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


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"Checkpoint directory {path.parent} is missing {path.name}.") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not UTF-8 text: the file is damaged.") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({exc.strerror}).") from None


def read_json(directory: Path, name: str) -> dict[str, Any]:
    """The JSON object in `directory/name`; a missing, unreadable or malformed file is a CheckpointError naming it."""
    path = directory / name
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}).") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object ({{\"key\": value, ...}}).")
    return data


def load_text_tokenizer(directory: Path) -> TextTokenizer:
    """The checkpoint's BPE text tokenizer (vocab.json, merges.txt, tokenizer_config.json), each file checked."""
    _check_vocab(directory)
    config = read_json(directory, "tokenizer_config.json")
    # The tokenizers library reports a non-UTF-8 merges.txt without naming the file.
    _read_text(directory / "merges.txt")
    try:
        return TextTokenizer.from_files(directory / "vocab.json", directory / "merges.txt", config)
    except Exception as exc:  # the tokenizers library raises bare Exception when it cannot build the BPE
        reason = " ".join(str(exc).split()).rstrip(".")
        raise CheckpointError(
            f"The text tokenizer in {directory} cannot be built from its vocab.json, merges.txt and tokenizer_config.json: {reason}."
        ) from None


def _check_vocab(directory: Path) -> None:
    vocab = read_json(directory, "vocab.json")
    if not vocab or not all(type(token_id) is int and token_id >= 0 for token_id in vocab.values()):
        raise CheckpointError(f"{directory / 'vocab.json'} should map every token to its integer id.")


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise TTSInputError(f"Unsupported dtype '{name}': use one of {', '.join(DTYPES)}.")
    return DTYPES[name]


@dataclass(frozen=True)
class CudaGPU:
    """What the dtype choice reads of a CUDA GPU: its name and compute capability, and the oldest
    compute capability this PyTorch build has machine code for (`CudaGPU.of` reads them; tests
    name them)."""

    name: str
    capability: tuple[int, int]
    oldest_supported: tuple[int, int]

    @classmethod
    def of(cls, device: torch.device) -> "CudaGPU":
        return cls(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device), oldest_capability(torch.cuda.get_arch_list()))

    def describe(self) -> str:
        return f"This GPU ({self.name}, compute capability {_dotted(self.capability)})"


def _dotted(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def oldest_capability(arch_list: list[str]) -> tuple[int, int]:
    """The oldest compute capability among a PyTorch build's CUDA architectures ("sm_75", "sm_120",
    ...: torch.cuda.get_arch_list()); PTX entries ("compute_120") only run on newer GPUs; (0, 0)
    where the list names none (a ROCm build). torch 2.11's and 2.13's CUDA 13 wheels start at sm_75:
    CUDA 13 builds nothing older."""
    found = [CUDA_ARCH.fullmatch(arch) for arch in arch_list]
    return min(((int(m[1]), int(m[2])) for m in found if m), default=(0, 0))


class DtypeChoice(NamedTuple):
    """The dtype to load and run in, and the sentence that says which and why."""

    name: str
    sentence: str


def choose_dtype(requested: str | None, gpu: CudaGPU | None) -> DtypeChoice:
    """`requested` (None: the device's best) on `gpu` (None: the CPU), checked before anything loads:
    bfloat16 on GPUs of compute capability 8.0 or newer, float16 below (they have no bfloat16),
    float32 on the CPU. A GPU older than this PyTorch build runs, or a bfloat16 it cannot run, is
    refused in one sentence."""
    if requested is not None:
        torch_dtype(requested)
    if gpu is None:
        name = requested or "float32"
        return DtypeChoice(name, f"Running in {name} on the CPU.")
    if gpu.capability < gpu.oldest_supported:
        raise TTSInputError(f"{gpu.describe()} is too old for this PyTorch build (torch {torch.__version__}), which runs on compute "
                            f"capability {_dotted(gpu.oldest_supported)} or newer: use --device cpu.")
    has_bfloat16 = gpu.capability >= BFLOAT16_CAPABILITY
    if requested == "bfloat16" and not has_bfloat16:
        raise TTSInputError(f"{gpu.describe()} has no bfloat16, which needs compute capability {_dotted(BFLOAT16_CAPABILITY)} or newer: "
                            "use --dtype float16 or float32.")
    if requested is not None:
        return DtypeChoice(requested, f"{gpu.describe()} runs in {requested}, as requested.")
    if has_bfloat16:
        return DtypeChoice("bfloat16", f"{gpu.describe()} runs in bfloat16.")
    return DtypeChoice("float16", f"{gpu.describe()} has no bfloat16; running in float16.")


def device_dtype(device: str, requested: str | None) -> DtypeChoice:
    """`choose_dtype` for the device named `device` (cpu, cuda, cuda:N), checked first by `torch_device`."""
    checked = torch_device(device)
    return choose_dtype(requested, CudaGPU.of(checked) if checked.type == "cuda" else None)


def torch_device(name: str) -> torch.device:
    """cpu, cuda or cuda:N, checked against this machine's GPUs before anything loads."""
    if DEVICE_NAME.fullmatch(name) is None:
        raise TTSInputError(f"Unsupported device '{name}': use cpu, cuda or cuda:N (N the index of a CUDA GPU, from 0).")
    device = torch.device(name)
    if device.type == "cuda":
        _check_cuda_gpu(device.index)
    return device


def _check_cuda_gpu(index: int | None) -> None:
    if not torch.cuda.is_available():
        raise TTSInputError("CUDA was requested but no CUDA GPU is available here: use --device cpu.")
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        present = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise TTSInputError(f"There is no CUDA GPU cuda:{index} on this machine: it has {count} ({present}).")


def _load_safetensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    try:
        if not prefix:
            return load_file(path)
        with safe_open(path, "pt") as f:
            return {name: f.get_tensor(name) for name in f.keys() if name.startswith(prefix)}
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path} is damaged or is not a safetensors file ({exc}).") from None


def _shard_names(directory: Path, prefix: str = "") -> list[str]:
    """The shard files the index's weight_map names (for the tensors named `prefix`...), each present."""
    weight_map = read_json(directory, WEIGHTS_INDEX).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(shard, str) for shard in weight_map.values()):
        raise CheckpointError(f"{directory / WEIGHTS_INDEX} has no weight_map naming the shard file of each tensor.")
    shards = sorted({shard for name, shard in weight_map.items() if name.startswith(prefix)})
    missing = [shard for shard in shards if not (directory / shard).is_file()]
    if missing:
        raise CheckpointError(f"Checkpoint directory {directory} is missing {', '.join(missing)}.")
    return shards


def load_weights(directory: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (those whose names start with `prefix`: only their shards are read)."""
    if (directory / WEIGHTS).is_file():
        return _load_safetensors(directory / WEIGHTS, prefix)
    state: dict[str, torch.Tensor] = {}
    for shard in _shard_names(directory, prefix):
        state.update(_load_safetensors(directory / shard, prefix))
    return state


def load_part(directory: Path, prefix: str, build: Callable[[], torch.nn.Module], config_name: str,
              dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A module built on the meta device, given the checkpoint's `prefix*` tensors (prefix removed,
    cast to `dtype` if given), all of them and no others, under their own names."""
    weights = {k.removeprefix(prefix): v if dtype is None else v.to(dtype) for k, v in load_weights(directory, prefix).items()}
    with torch.device("meta"):
        module = build()
    try:
        module.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as exc:
        raise CheckpointError(f"The {prefix.rstrip('.')} weights in {directory} do not match its {config_name}: {exc}") from None
    return module


def _weights_file(directory: Path) -> Path:
    """The file to name when the weights do not fit: the single weights file, or the index of the shards."""
    return directory / WEIGHTS if (directory / WEIGHTS).is_file() else directory / WEIGHTS_INDEX


def _check_shapes(model: Qwen3TTS, state: dict[str, torch.Tensor], directory: Path) -> None:
    # load_state_dict raises a bare RuntimeError listing every mismatch; checked first to name the file in one line.
    expected = model.state_dict()
    wrong = [
        f"{key} {tuple(tensor.shape)} (expected {tuple(expected[key].shape)})"
        for key, tensor in state.items()
        if key in expected and tensor.shape != expected[key].shape
    ]
    if wrong:
        raise CheckpointError(
            f"{_weights_file(directory)} has tensors shaped for another model than {directory / 'config.json'} describes: {', '.join(wrong[:3])}."
        )


def load_model(directory: Path, device: torch.device, dtype: torch.dtype) -> Qwen3TTS:
    raw = read_json(directory, "config.json")
    check_config(directory / "config.json", raw, TTS_CONFIG)
    if raw.get("tts_model_type") not in MODEL_TYPES:
        raise CheckpointError(
            f"{directory / 'config.json'} has tts_model_type {raw.get('tts_model_type')!r}; "
            f"a Qwen3-TTS 12 Hz checkpoint has one of {', '.join(MODEL_TYPES)}."
        )
    config = TTSConfig.from_dict(raw)
    with torch.device("meta"):
        model = Qwen3TTS(config)
    state = load_weights(directory)
    _check_shapes(model, state, directory)
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"{_weights_file(directory)} does not fit a '{config.tts_model_type}' checkpoint of this config: "
            f"missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}."
        )
    return model.to(device=device, dtype=dtype).eval()
