"""How much GPU memory a model takes, and so how many engine rows fit: `python -m pipeline.memory_plan`
prints the table of rows per model and GPU size.

A model takes its weights (as loaded: the talker in the chosen dtype, the codec in float32, with the
tensors derived from them), a fixed reserve (CUDA graph pools, workspaces, activations, the
allocator's slack) and, per engine row, the row's caches and state: the talker's and the code
predictor's KV caches, the decode step's per-row buffers and the vocoder's streaming state; Qwen3-Omni
adds a thinker slot (its KV cache) per row. Weights and rows are counted from the checkpoint's
config, byte for byte what the loaders and the engine allocate; the reserve is a measured constant.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.codec.config import SpeechTokenizerConfig
from pipeline.config_types import check_config
from pipeline.errors import CheckpointError, TTSInputError
from pipeline.model import CodePredictorConfig, Qwen3TTS, TTSConfig

GIB = 2**30
# The fixed reserve besides weights and rows: CUDA graph pools (one per graph of the decode step's row
# blocks, the prefill buckets and the vocoder's call sizes per lane), cuBLAS and Triton workspaces,
# prefill activations and the caching allocator's slack: torch.cuda.memory_reserved() after warm-up,
# less the plan's weights and rows. Measured on an H100 (random weights at the real size, bf16,
# compiled): a second engine in a process, 16 rows, 0.94 GiB (0.6B) and 0.76 GiB (1.7B). The first
# engine of a process took 2.69 GiB (0.6B, 4 rows): 1.75 GiB more, paid once (PROCESS_RESERVE_BYTES).
TTS_RESERVE_BYTES = 1 * GIB
PROCESS_RESERVE_BYTES = int(1.75 * GIB)
# Rows a TTS model gets at most without --rows: as many as the free memory holds, up to TTS_MOST_ROWS, and no
# more than let the app's default checkpoints of its three TTS tabs (SHARED_TTS) share the card with as many
# rows each, so that a model loaded first leaves room for the others (bf16: an L4's 22.5 GiB, 11 rows each;
# 40 GiB, 37; 64 from 58.3 GiB). Never fewer than TTS_LEAST_CAP: on a card too small for the three to share
# with that many rows each (under 20.8 GiB), each model gets what its free memory holds, up to that.
TTS_MOST_ROWS, TTS_LEAST_CAP = 64, 8
SHARED_TTS = (("0.6B", "base"), ("0.6B", "custom_voice"), ("1.7B", "voice_design"))  # pipeline.service.HUB_CHECKPOINTS' first of each TTS tab
# Qwen3-Omni on an H100 (benchmarks.omni, docs/BENCHMARKS.md): 4.7 GiB reserved beyond what is
# allocated once ready, for the thinker's shared graph pool and prefill staging, the talker's MoE prefill.
OMNI_RESERVE_BYTES = 6 * GIB
MOST_ROWS = 256  # what --rows takes at most; a plan's `max_rows` where its caller sets none
CUDA_CONTEXT_BYTES = int(0.5 * GIB)  # a card's memory that the CUDA context takes before any model (the table's assumption)
TABLE_GPU_GIB = (8, 12, 16, 24, 40, 48, 80, 141)


class NotEnoughMemory(TTSInputError):
    """A model, or the rows asked of it, that the device's free memory cannot hold; the sentence says
    what is needed and what is free."""


@dataclass(frozen=True)
class MemoryPlan:
    """One model's memory: `weights` + `reserve` + rows x `per_row` bytes."""

    name: str  # what the sentences call the model: its checkpoint's name
    dtype: str
    weights: int
    per_row: int
    reserve: int
    max_rows: int  # the most rows chosen when none are asked for

    def needed(self, rows: int) -> int:
        return self.weights + self.reserve + rows * self.per_row

    def rows_that_fit(self, free: int) -> int:
        """The rows to build when none are asked for: as many as `free` bytes hold, from 1 to `max_rows`."""
        return max(1, min(self.max_rows, self._most_rows(free)))

    def _most_rows(self, free: int) -> int:
        return max(0, (free - self.weights - self.reserve) // self.per_row)

    def weights_sentence(self, free: int) -> str:
        return (f"{self.name} needs about {gib(self.needed(1))} GiB of GPU memory in {self.dtype} (its weights, working memory and one "
                f"row's caches); this GPU has {gib(free)} GiB free.")

    def rows_sentence(self, rows: int, free: int) -> str:
        return (f"--rows {rows} needs about {gib(self.needed(rows) - self.weights)} GiB for {self.name}'s caches and working memory; "
                f"this GPU has {gib(free - self.weights)} GiB free after the weights; at most {self._most_rows(free)} rows fit.")

    def choose_rows(self, rows: int | None, free: int) -> int:
        """`rows` if `free` bytes hold them (None: `rows_that_fit`); else NotEnoughMemory with the sentence
        for the weights (not even one row fits) or for the rows."""
        if self._most_rows(free) < 1:
            raise NotEnoughMemory(self.weights_sentence(free))
        if rows is None:
            return self.rows_that_fit(free)
        if rows > self._most_rows(free):
            raise NotEnoughMemory(self.rows_sentence(rows, free), field="rows")
        return rows


def gib(size: int) -> str:
    return f"{size / GIB:.1f}"


def free_memory(device: torch.device) -> int:
    """Bytes a new model can take on `device`: the GPU's free memory and what PyTorch's caching allocator
    holds unused (freed by models before, counted as used by the driver), less what the process's first
    model pays once (PROCESS_RESERVE_BYTES) while none is loaded."""
    free, _ = torch.cuda.mem_get_info(device)
    first = torch.cuda.memory_allocated(device) == 0
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) - (PROCESS_RESERVE_BYTES if first else 0)


def tts_row_cap(total: int, dtype: torch.dtype, max_seq: int) -> int:
    """The rows a TTS model gets at most without --rows on a card of `total` bytes, its talker in `dtype`
    with caches of `max_seq` positions (see TTS_MOST_ROWS)."""
    plans = shared_tts_plans(dtype, max_seq)
    room = total - CUDA_CONTEXT_BYTES - PROCESS_RESERVE_BYTES - sum(plan.weights + plan.reserve for plan in plans)
    shared = max(0, room) // sum(plan.per_row for plan in plans)
    return min(TTS_MOST_ROWS, max(TTS_LEAST_CAP, shared))


@functools.cache
def shared_tts_plans(dtype: torch.dtype, max_seq: int) -> tuple[MemoryPlan, ...]:
    """The plans of SHARED_TTS at their real sizes, as the fused frame runs them on CUDA (built once per process)."""
    return tuple(released_tts_plan(size, model_type, dtype, max_seq) for size, model_type in SHARED_TTS)


def checkpoint_name(source: str) -> str:
    """'Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice' and '/models/Qwen3-TTS-12Hz-1.7B-CustomVoice/' -> 'Qwen3-TTS-12Hz-1.7B-CustomVoice'."""
    return source.rstrip("/").split("/")[-1] or source


# ---- bytes of modules and of rows ------------------------------------------------------------

def module_bytes(build, dtype: torch.dtype | None = None) -> int:
    """Bytes of the parameters and buffers of the module `build()` makes (built on the meta device:
    nothing is allocated), its floating-point tensors counted in `dtype` where given, as the loaders
    cast them."""
    with torch.device("meta"):
        module = build()
    storages = {}  # a derived tensor that is a view of a parameter (a permuted 1-tap conv weight) takes no memory of its own
    for t in (*module.parameters(), *module.buffers()):
        storage = t.untyped_storage()
        size = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
        storages[storage._cdata] = storage.nbytes() // t.element_size() * size
    return sum(storages.values())


def stream_state_bytes(build) -> int:
    """Bytes of one stream's state of the vocoder `build()` makes: what `StreamState` allocates per row,
    from each stateful layer's `init_state` (float32, as the codecs run)."""
    with torch.device("meta"):
        vocoder = build()
    total = 0
    for layer in vocoder.modules():
        state = layer.init_state(1, torch.device("meta"), torch.float32) if hasattr(layer, "init_state") else None
        for t in (state if isinstance(state, tuple) else (state,) if state is not None else ()):
            total += t.numel() * t.element_size()
    return total


def decoder_row_bytes(layers: int, kv_heads: int, head_dim: int, hidden: int, vocab: int, predictor: CodePredictorConfig,
                      max_seq: int, dtype: torch.dtype, frame_kernels: bool) -> int:
    """Bytes `pipeline.engine.BatchDecoder` allocates per row for a talker of this shape."""
    size, groups, long = dtype.itemsize, predictor.num_code_groups, 8
    talker_cache = 2 * layers * kv_heads * max_seq * head_dim * size
    predictor_cache = 2 * predictor.num_hidden_layers * predictor.num_key_value_heads * groups * predictor.head_dim * size
    caches_rows = 2 * long  # each cached transformer's `all_rows`
    text = max_seq * hidden * size  # `trailing`: the text fed with each frame
    predictor_input = 2 * hidden * size
    seen = vocab  # bool per codebook-0 id
    # all_rows, token, pos, frame, max_frame, seed_hash, text_len; codes and the code predictor's positions (a [groups] each)
    longs = 7 * long + 2 * groups * long
    flags = 3  # active, text_end, produced
    sampling = 2 * (1 + 4 + 8 + 4) + 4  # two RowSamplings (do_sample, temperature, top_k, top_p) and the repetition penalty
    total = talker_cache + predictor_cache + caches_rows + text + predictor_input + seen + longs + flags + sampling
    if frame_kernels:
        projected = 3 * predictor.hidden_size * size if predictor.hidden_size != hidden else 0  # the 1.7B's projected inputs
        total += 3 * hidden * size + projected  # predictor_next, talker_input, next_hidden
    return total


# ---- Qwen3-TTS -------------------------------------------------------------------------------

def tts_plan(config: TTSConfig, codec: SpeechTokenizerConfig, dtype: torch.dtype, max_seq: int, name: str,
             frame_kernels: bool = True, max_rows: int = MOST_ROWS) -> MemoryPlan:
    """A Qwen3-TTS checkpoint's plan: `frame_kernels` as BatchDecoder's (its whole frame in kernels: on CUDA with the fused kernels)."""
    from pipeline.codec.decoder import SpeechDecoder
    from pipeline.codec.tokenizer import SpeechTokenizer

    weights = module_bytes(lambda: Qwen3TTS(config), dtype) + module_bytes(lambda: SpeechTokenizer(codec), torch.float32)
    t = config.talker_config
    per_row = decoder_row_bytes(t.num_hidden_layers, t.num_key_value_heads, t.head_dim, t.hidden_size, t.vocab_size, t.code_predictor_config,
                                max_seq, dtype, frame_kernels)
    per_row += stream_state_bytes(lambda: SpeechDecoder(codec.decoder))
    return MemoryPlan(name, str(dtype).removeprefix("torch."), weights, per_row, TTS_RESERVE_BYTES, max_rows)


def read_tts_configs(directory: Path) -> tuple[TTSConfig, SpeechTokenizerConfig]:
    """The configs of a Qwen3-TTS checkpoint directory, checked as the loaders check them (a bad file is a CheckpointError naming it)."""
    from pipeline.loading import TTS_CONFIG, read_json

    raw = read_json(directory, "config.json")
    check_config(directory / "config.json", raw, TTS_CONFIG)
    codec_path = directory / "speech_tokenizer" / "config.json"
    try:
        codec = SpeechTokenizerConfig.from_dict(read_json(codec_path.parent, codec_path.name))
    except CheckpointError as exc:
        raise CheckpointError(f"{codec_path}: {exc}") from None
    return TTSConfig.from_dict(raw), codec


def tts_checkpoint_plan(directory: Path, dtype: torch.dtype, max_seq: int, name: str, frame_kernels: bool = True,
                        max_rows: int = MOST_ROWS) -> MemoryPlan:
    config, codec = read_tts_configs(directory)
    return tts_plan(config, codec, dtype, max_seq, name, frame_kernels, max_rows)


# ---- Qwen3-Omni ------------------------------------------------------------------------------

def thinker_slot_bytes(text_config: dict[str, Any], max_len: int, dtype: torch.dtype) -> int:
    """Bytes of one thinker slot (`pipeline.omni.thinker._Slot`): its KV cache of `max_len` positions,
    its token, rope position and cache position."""
    layers, kv_heads = text_config["num_hidden_layers"], text_config["num_key_value_heads"]
    head_dim = text_config.get("head_dim") or text_config["hidden_size"] // text_config["num_attention_heads"]
    return 2 * layers * kv_heads * max_len * head_dim * dtype.itemsize + 3 * 8


def omni_row_bytes(config: dict[str, Any], dtype: torch.dtype, talker_max_seq: int, thinker_max_seq: int) -> int:
    """Bytes per conversation: a talker row (its decode step runs in PyTorch ops: sparse layers), a
    thinker slot and a code2wav stream."""
    from pipeline.omni.code2wav import Code2Wav, Code2WavConfig
    from pipeline.omni.talker import OmniTalkerConfig

    talker = OmniTalkerConfig.from_dict(config["talker_config"])
    t = talker.text_config
    row = decoder_row_bytes(t.num_hidden_layers, t.num_key_value_heads, t.head_dim, t.hidden_size, t.vocab_size, talker.code_predictor_config,
                            talker_max_seq, dtype, frame_kernels=False)
    row += thinker_slot_bytes(config["thinker_config"]["text_config"], thinker_max_seq, dtype)
    return row + stream_state_bytes(lambda: Code2Wav(Code2WavConfig.from_dict(config["code2wav_config"])))


def omni_plan(config: dict[str, Any], weights: int, dtype: torch.dtype, talker_max_seq: int, thinker_max_seq: int, name: str,
              max_rows: int = MOST_ROWS) -> MemoryPlan:
    """Qwen3-Omni's plan from its config.json and the bytes of its weights as loaded (`omni_weight_bytes`)."""
    return MemoryPlan(name, str(dtype).removeprefix("torch."), weights, omni_row_bytes(config, dtype, talker_max_seq, thinker_max_seq),
                      OMNI_RESERVE_BYTES, max_rows)


def omni_weight_bytes(directory: Path, dtype: torch.dtype) -> int:
    """Bytes of a Qwen3-Omni checkpoint's weights as OmniChat loads them, from its safetensors headers:
    the thinker without its vision encoder and the talker in `dtype`, code2wav in float32."""
    from safetensors import safe_open

    total = 0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                if key.startswith("thinker.visual."):
                    continue
                size = 4 if key.startswith("code2wav.") else dtype.itemsize
                total += math.prod(f.get_slice(key).get_shape()) * size
    return total


def released_omni_weight_bytes(config: dict[str, Any], dtype: torch.dtype) -> int:
    """The same bytes counted from the modules the released config builds (on the meta device)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration

    from pipeline.omni.code2wav import Code2Wav, Code2WavConfig
    from pipeline.omni.talker import OmniTalker, OmniTalkerConfig

    def thinker() -> nn.Module:
        model = Qwen3OmniMoeThinkerForConditionalGeneration(Qwen3OmniMoeThinkerConfig(**config["thinker_config"]))
        model.model.visual = None  # the vision encoder: messages are text and audio, Thinker does not keep it
        return model

    return (module_bytes(thinker, dtype) + module_bytes(lambda: OmniTalker(OmniTalkerConfig.from_dict(config["talker_config"])), dtype)
            + module_bytes(lambda: Code2Wav(Code2WavConfig.from_dict(config["code2wav_config"])), torch.float32))


# ---- the README's table ----------------------------------------------------------------------

TTS_NAMES = {("0.6B", "custom_voice"): "CustomVoice", ("0.6B", "base"): "Base", ("1.7B", "custom_voice"): "CustomVoice",
             ("1.7B", "base"): "Base", ("1.7B", "voice_design"): "VoiceDesign"}  # the released Qwen3-TTS checkpoints: name suffixes


def released_tts_plan(size: str, model_type: str, dtype: torch.dtype, max_seq: int) -> MemoryPlan:
    """A released Qwen3-TTS checkpoint's plan at its real size (`pipeline.released`), named as on the Hub."""
    from pipeline.released import real_size_config
    from pipeline.tiny import SPECIAL_TOKENS

    special = {token: 151643 + i for i, token in enumerate(SPECIAL_TOKENS)}  # ids only name tokens: sizes come from text_vocab_size
    config = TTSConfig.from_dict(real_size_config(size, model_type, special))
    return tts_plan(config, SpeechTokenizerConfig(), dtype, max_seq, f"Qwen3-TTS-12Hz-{size}-{TTS_NAMES[size, model_type]}")


@dataclass(frozen=True)
class TableRow:
    """A model of the table: its plan, and the most rows it gets without --rows on a card of a given size in bytes."""

    plan: MemoryPlan
    cap: Callable[[int], int]

    def rows(self, gpu: int) -> str:
        """The rows it gets on a card of `gpu` bytes by itself (its memory less the CUDA context and the process's reserve)."""
        free = gpu - CUDA_CONTEXT_BYTES - PROCESS_RESERVE_BYTES
        if self.plan.needed(1) > free:
            return "does not fit"
        return str(replace(self.plan, max_rows=self.cap(gpu)).rows_that_fit(free))


def table_plans(dtype: torch.dtype = torch.bfloat16) -> list[TableRow]:
    """The released checkpoints at their real sizes, default max_seq, with the caps their loaders apply on CUDA."""
    from pipeline.omni.chat import DEFAULT_ROWS, HUB_ID, TALKER_MAX_SEQ, THINKER_MAX_SEQ
    from pipeline.released import RELEASED_CONFIG
    from pipeline.tts import DEFAULT_MAX_SEQ

    rows = [TableRow(released_tts_plan(size, model_type, dtype, DEFAULT_MAX_SEQ), lambda gpu: tts_row_cap(gpu, dtype, DEFAULT_MAX_SEQ))
            for size, model_type in TTS_NAMES]
    omni = omni_plan(RELEASED_CONFIG, released_omni_weight_bytes(RELEASED_CONFIG, dtype), dtype, TALKER_MAX_SEQ, THINKER_MAX_SEQ, checkpoint_name(HUB_ID))
    return [*rows, TableRow(omni, lambda gpu: DEFAULT_ROWS["cuda"])]


def table(rows: list[TableRow], gpus_gib: tuple[int, ...] = TABLE_GPU_GIB) -> str:
    """Markdown: per model, its weights, bytes per row, and the rows it gets without --rows on a card of
    each size by itself, or 'does not fit'."""
    head = "| model (bf16) | weights GiB | per row MiB | " + " | ".join(f"{g} GB" for g in gpus_gib) + " |"
    lines = [head, "|---" * (3 + len(gpus_gib)) + "|"]
    for row in rows:
        cells = [row.rows(g * GIB) for g in gpus_gib]
        lines.append(f"| {row.plan.name} | {gib(row.plan.weights)} | {row.plan.per_row / 2**20:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(table_plans()))
