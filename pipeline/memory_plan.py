"""How much GPU memory a model takes, and so how many engine rows fit: `python -m pipeline.memory_plan`
prints the table of rows per model and GPU size.

A model takes its weights (as loaded: the talker in the chosen dtype, the codec in float32, with the
tensors derived from them), a fixed reserve (CUDA graph pools, workspaces, activations, the
allocator's slack) and, per engine row, the row's caches and state: the talker's and the code
predictor's KV caches, the decode step's per-row buffers and the vocoder's streaming state; Qwen3-Omni
adds a thinker row (its KV cache) per conversation. Weights and rows are counted from the checkpoint's
config, byte for byte what the loaders and the engine allocate; the reserve is a measured constant.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.codec.config import DecoderConfig, EncoderConfig, SpeechTokenizerConfig
from pipeline.codec.transformer_kernels import FUSED_FRAMES
from pipeline.config_types import check_config
from pipeline.errors import CheckpointError, TTSInputError
from pipeline.model import CodePredictorConfig, TalkerConfig, TTSConfig
from pipeline.speaker_encoder import SpeakerEncoderConfig

if TYPE_CHECKING:
    from pipeline.omni.code2wav import Code2WavConfig
    from pipeline.omni.talker import OmniTalkerConfig

GIB = 2**30
# The fixed reserve besides weights and rows: CUDA graph pools (one per graph of the decode step's row
# blocks, the prefill buckets and the vocoder's call sizes per lane), cuBLAS and Triton workspaces,
# prefill activations and the caching allocator's slack: torch.cuda.memory_reserved() after warm-up,
# less the plan's weights and rows. Measured on an H100 (random weights at the real size, bf16,
# compiled): a second engine in a process, 16 rows, 0.94 GiB (0.6B) and 0.76 GiB (1.7B). The first
# engine of a process took 2.69 GiB (0.6B, 4 rows): 1.75 GiB more, paid once (PROCESS_RESERVE_BYTES).
TTS_RESERVE_BYTES = 1 * GIB
PROCESS_RESERVE_BYTES = int(1.75 * GIB)
# A TTS engine of VOCODER_BATCH_ROWS rows or more on CUDA vocodes its steady chunks in batched calls
# (pipeline.tts: VOCODER_SLOTS), whose two lanes' graph pools hold several streams' activations: on an
# H100 the 64-row engines' peak reserved memory under load rose by 1.6-1.7 GiB with them (0.6B 18.4 ->
# 20.0 GiB, 1.7B 20.7 -> 22.4 at 10 requests/s). Smaller engines keep one stream a call and do not pay
# it, so the cards that give a model fewer rows keep them all.
VOCODER_BATCH_ROWS = 48
VOCODER_BATCH_BYTES = 2 * GIB
# Rows a TTS model gets at most without --rows: as many as the free memory holds, up to TTS_MOST_ROWS, and no
# more than let the app's default checkpoints of its three TTS tabs (SHARED_TTS) share the card with as many
# rows each, so that a model loaded first leaves room for the others (bf16: an L4's 22.5 GiB, 11 rows each;
# 40 GiB, 37; 48-53 GiB, 47, where the batched vocoder does not fit beside 48 rows each; 64 from 64.3 GiB).
# Never fewer than TTS_LEAST_CAP: on a card too small for the three to share with that many rows each
# (under 20.8 GiB), each model gets what its free memory holds, up to that.
TTS_MOST_ROWS, TTS_LEAST_CAP = 64, 8
SHARED_TTS = (("0.6B", "base"), ("0.6B", "custom_voice"), ("1.7B", "voice_design"))  # pipeline.service.HUB_CHECKPOINTS' first of each TTS tab
# Qwen3-Omni on an H100 (benchmarks.omni, docs/BENCHMARKS.md): 4.7 GiB reserved beyond what is
# allocated once ready, for the thinker's shared graph pool (its prompt pack's working memory), the talker's MoE prefill.
OMNI_RESERVE_BYTES = 6 * GIB
MOST_ROWS = 256  # what --rows takes at most; a plan's `max_rows` where its caller sets none
CUDA_CONTEXT_BYTES = int(0.5 * GIB)  # a card's memory that the CUDA context takes before any model (the table's assumption)
TABLE_GPU_GIB = (8, 12, 16, 24, 40, 48, 80, 141)


class NotEnoughMemory(TTSInputError):
    """A model, or the rows asked of it, that the device's free memory cannot hold; the sentence says
    what is needed and what is free."""


@dataclass(frozen=True)
class MemoryPlan:
    """One model's memory: `weights` + `reserve` + rows x `per_row` bytes, and `batch_reserve` more for an
    engine of VOCODER_BATCH_ROWS rows or more (its batched vocoder lanes)."""

    name: str  # what the sentences call the model: its checkpoint's name
    dtype: str
    weights: int
    per_row: int
    reserve: int
    max_rows: int  # the most rows chosen when none are asked for
    batch_reserve: int = 0

    def needed(self, rows: int) -> int:
        return self.weights + self.reserve + rows * self.per_row + (self.batch_reserve if rows >= VOCODER_BATCH_ROWS else 0)

    def rows_that_fit(self, free: int) -> int:
        """The rows to build when none are asked for: as many as `free` bytes hold, from 1 to `max_rows`."""
        return max(1, min(self.max_rows, self._most_rows(free)))

    def _most_rows(self, free: int) -> int:
        return most_rows(free - self.weights - self.reserve, self.per_row, self.batch_reserve)

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


def most_rows(room: int, per_row: int, batch_reserve: int) -> int:
    """The most rows of `per_row` bytes that `room` bytes hold, where VOCODER_BATCH_ROWS rows or more also
    need `batch_reserve`: fewer than VOCODER_BATCH_ROWS where that reserve does not fit beside them."""
    plain = max(0, room) // per_row
    if plain < VOCODER_BATCH_ROWS:
        return plain
    batched = (room - batch_reserve) // per_row
    return batched if batched >= VOCODER_BATCH_ROWS else VOCODER_BATCH_ROWS - 1


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
    shared = most_rows(room, sum(plan.per_row for plan in plans), sum(plan.batch_reserve for plan in plans))
    return min(TTS_MOST_ROWS, max(TTS_LEAST_CAP, shared))


@functools.cache
def shared_tts_plans(dtype: torch.dtype, max_seq: int) -> tuple[MemoryPlan, ...]:
    """The plans of SHARED_TTS at their real sizes, as the fused frame runs them on CUDA (built once per process)."""
    return tuple(released_tts_plan(size, model_type, dtype, max_seq) for size, model_type in SHARED_TTS)


def checkpoint_name(source: str) -> str:
    """'Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice' and '/models/Qwen3-TTS-12Hz-1.7B-CustomVoice/' -> 'Qwen3-TTS-12Hz-1.7B-CustomVoice'."""
    return source.rstrip("/").split("/")[-1] or source


# ---- bytes of weights and of rows, from the configs' numbers -----------------------------------
# Elements of the tensors that the modules of pipeline/model.py, pipeline/speaker_encoder.py and
# pipeline/codec/ hold once loaded (parameters, and the buffers derived from them at load), and of
# the vocoder's per-stream state; tests/test_memory_plan.py checks each count against the modules.

def linear(inputs: int, outputs: int, bias: bool = False) -> int:
    return inputs * outputs + (outputs if bias else 0)


def conv(inputs: int, outputs: int, kernel: int, bias: bool = True) -> int:
    """A Conv1d's or ConvTranspose1d's elements (not grouped)."""
    return linear(inputs * kernel, outputs, bias)


def transformer_elements(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, mlp: int) -> int:
    """`pipeline.model.Transformer` whose layers' MLPs have `mlp` elements each: per layer the fused q/k/v
    projection, the output projection, the q and k norms, the MLP and two norms; then the final norm."""
    attention = linear(hidden, (heads + 2 * kv_heads) * head_dim) + linear(heads * head_dim, hidden) + 2 * head_dim
    return layers * (attention + mlp + 2 * hidden) + hidden


def dense_mlp_elements(hidden: int, intermediate: int) -> int:
    return 3 * hidden * intermediate  # gate and up (fused or not), down


def code_predictor_elements(p: CodePredictorConfig, talker_hidden: int) -> int:
    """`pipeline.model.CodePredictor`: its transformer, an embedding table (talker-wide) and an output head per
    codebook after the first, and the projection from the talker's width where the two differ (the 1.7B's)."""
    model = transformer_elements(p.hidden_size, p.num_hidden_layers, p.num_attention_heads, p.num_key_value_heads, p.head_dim,
                                 dense_mlp_elements(p.hidden_size, p.intermediate_size))
    heads = (p.num_code_groups - 1) * (p.vocab_size * talker_hidden + linear(p.hidden_size, p.vocab_size))
    return model + heads + (linear(talker_hidden, p.hidden_size, bias=True) if p.hidden_size != talker_hidden else 0)


def talker_elements(t: TalkerConfig) -> int:
    """`pipeline.model.Talker`: its transformer, the codec and text embeddings, the text projection, the codec
    head and the code predictor."""
    model = transformer_elements(t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
                                 dense_mlp_elements(t.hidden_size, t.intermediate_size))
    embeddings = t.vocab_size * t.hidden_size + t.text_vocab_size * t.text_hidden_size
    text_projection = linear(t.text_hidden_size, t.text_hidden_size, bias=True) + linear(t.text_hidden_size, t.hidden_size, bias=True)
    return model + embeddings + text_projection + linear(t.hidden_size, t.vocab_size) + code_predictor_elements(t.code_predictor_config, t.hidden_size)


def speaker_encoder_elements(c: SpeakerEncoderConfig) -> int:
    """`pipeline.speaker_encoder.SpeakerEncoder` (Base models): TDNN, SE-Res2Net blocks, aggregation, attentive pooling, output conv."""
    channels, kernels, scale = c.enc_channels, c.enc_kernel_sizes, c.enc_res2net_scale
    total = conv(c.mel_dim, channels[0], kernels[0])
    for width, kernel in zip(channels[1:-1], kernels[1:-1]):
        total += (2 * conv(width, width, 1) + (scale - 1) * conv(width // scale, width // scale, kernel)
                  + conv(width, c.enc_se_channels, 1) + conv(c.enc_se_channels, width, 1))
    last = channels[-1]
    pooling = conv(3 * last, c.enc_attention_channels, 1) + conv(c.enc_attention_channels, last, 1)
    return total + conv(last, last, kernels[-1]) + pooling + conv(2 * last, c.enc_dim, 1)


def tts_model_bytes(config: TTSConfig, dtype: torch.dtype) -> int:
    """Bytes of `pipeline.model.Qwen3TTS` as `load_model` loads it in `dtype`."""
    encoder = speaker_encoder_elements(config.speaker_encoder_config) if config.tts_model_type == "base" else 0
    return (talker_elements(config.talker_config) + encoder) * dtype.itemsize


def codec_encoder_elements(c: EncoderConfig) -> int:
    """`pipeline.codec.encoder.SpeechEncoder`: SEANet convs, transformer, downsample and the two RVQs, each
    codebook with its codewords derived at load (`embed`)."""
    total, dim = conv(1, c.num_filters, c.kernel_size), c.num_filters
    for ratio in reversed(c.upsampling_ratios):
        hidden = dim // c.compress
        total += c.num_residual_layers * (conv(dim, hidden, c.residual_kernel_size) + conv(hidden, dim, 1)) + conv(dim, 2 * dim, 2 * ratio)
        dim *= 2
    h, heads, kv, d, bias = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.attention_bias
    attention = linear(h, heads * d, bias) + 2 * linear(h, kv * d, bias) + linear(heads * d, h, bias)
    layer = attention + 2 * linear(h, c.intermediate_size) + 2 * 2 * h + 2 * h  # MLP, two LayerNorms, two layer scales
    total += conv(dim, h, c.last_kernel_size) + c.num_hidden_layers * layer + conv(h, h, 2 * c.latent_stride, bias=False)
    projections = 2 * 2 * h * c.vector_quantization_hidden_dimension if c.projects_latents else 0
    codebook = 1 + c.codebook_size + 2 * c.codebook_size * c.codebook_dim  # initialized, cluster_usage, embed_sum, embed
    return total + projections + c.num_quantizers * codebook


def window_transformer_elements(c: DecoderConfig) -> int:
    """`pipeline.codec.decoder.DecoderTransformer`'s layers and norm (not its latent projections): each layer's
    separate projections with their fused copies (q/k/v, gate/up), two norms and two layer scales; and the
    RoPE tables its kernels read (cos and sin of the window and a 16-frame pass)."""
    h, heads, kv, d, bias = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.attention_bias
    qkv = (heads + 2 * kv) * d
    attention = linear(h, heads * d, bias) + 2 * linear(h, kv * d, bias) + linear(heads * d, h, bias) + linear(h, qkv, bias)
    mlp = 3 * linear(h, c.intermediate_size) + linear(h, 2 * c.intermediate_size)
    rope = 2 * (c.sliding_window - 1 + FUSED_FRAMES) * d
    return c.num_hidden_layers * (attention + mlp + 4 * h) + h + rope


def convnext_elements(dim: int) -> int:
    """`pipeline.codec.decoder.ConvNeXtBlock`: depthwise 7-tap conv, LayerNorm, two pointwise linears, gamma."""
    return 7 * dim + dim + 2 * dim + linear(dim, 4 * dim, bias=True) + linear(4 * dim, dim, bias=True) + dim


def snake_elements(channels: int) -> int:
    return 4 * channels  # alpha, beta and the exponentials derived from them


def transposed_conv_elements(inputs: int, outputs: int, kernel: int, stride: int) -> int:
    """`pipeline.codec.streaming.CausalConvTranspose1d` (and its look-ahead form): the conv and its bias
    repeated for each of the `stride` output phases of its fused form. (Where the fused kernels run, the
    layers keep their weights tap-major and the parameters are views: no second copy.)"""
    return conv(inputs, outputs, kernel) + stride * outputs


def residual_unit_elements(dim: int) -> int:
    """`pipeline.codec.decoder.ResidualUnit`: two SnakeBetas, a 7-tap and a 1-tap conv."""
    return 2 * snake_elements(dim) + conv(dim, dim, 7) + conv(dim, dim, 1)


def vocoder_dims(c: DecoderConfig) -> list[int]:
    return [c.decoder_dim // 2**i for i in range(len(c.upsample_rates) + 1)]


def vocoder_elements(c: DecoderConfig, width: int) -> int:
    """The upsampling stages (transposed conv + ConvNeXt) of `width` channels and the SnakeBeta conv vocoder after them."""
    dims = vocoder_dims(c)
    total = sum(transposed_conv_elements(width, width, ratio, ratio) + convnext_elements(width) for ratio in c.upsampling_ratios)
    total += conv(width, dims[0], 7)
    for i, rate in enumerate(c.upsample_rates):
        total += snake_elements(dims[i]) + transposed_conv_elements(dims[i], dims[i + 1], 2 * rate, rate) + 3 * residual_unit_elements(dims[i + 1])  # dilations 1, 3, 9
    return total + snake_elements(dims[-1]) + conv(dims[-1], 1, 7)


def codec_decoder_elements(c: DecoderConfig) -> int:
    """`pipeline.codec.decoder.SpeechDecoder`'s floating-point elements: the quantizer (both RVQs' projections,
    each codebook's usage and sum, and the table of codewords derived from them), the pre-conv, the
    transformer with its latent projections, and the upsampling stages and vocoder."""
    dim, q, size = c.codebook_dim // 2, c.num_quantizers, c.codebook_size
    quantizer = 2 * 2 * c.codebook_dim * dim + q * size * (1 + dim) + q * size * dim
    transformer = window_transformer_elements(c) + linear(c.latent_dim, c.hidden_size, bias=True) + linear(c.hidden_size, c.latent_dim, bias=True)
    return quantizer + conv(c.codebook_dim, c.latent_dim, 3) + transformer + vocoder_elements(c, c.latent_dim)


def codec_bytes(codec: SpeechTokenizerConfig) -> int:
    """Bytes of `pipeline.codec.SpeechTokenizer` as loaded (float32), with the quantizer's codebook offsets (int64)."""
    return (codec_encoder_elements(codec.encoder) + codec_decoder_elements(codec.decoder)) * 4 + codec.decoder.num_quantizers * 8


def stream_state_bytes(c: DecoderConfig, width: int, front: int = 0) -> int:
    """Bytes of one stream's state (`pipeline.codec.StreamState`, float32 as the codecs run) of a decoder
    whose upsampling stages are `width` channels wide, after a front conv keeping `front` elements: the
    transformer's frame count (int64) and its window of keys and values, and each causal conv's last
    inputs (a 7-tap conv keeps 6 steps, a dilated one 6 x its dilation; each block's transposed conv,
    kernel 2 x its stride, keeps one step, and the upsampling ones, kernel = stride, none)."""
    dims = vocoder_dims(c)
    window = c.num_hidden_layers * 2 * c.num_key_value_heads * (c.sliding_window - 1) * c.head_dim
    upsample = len(c.upsampling_ratios) * 6 * width  # the ConvNeXt blocks' depthwise convs
    vocoder = 6 * width + sum(dims[i] + 6 * (1 + 3 + 9) * dims[i + 1] for i in range(len(c.upsample_rates))) + 6 * dims[-1]
    return (front + window + upsample + vocoder) * 4 + 8


def codec_stream_bytes(c: DecoderConfig) -> int:
    """One stream of `pipeline.codec.decoder.SpeechDecoder`: its pre-conv (3 taps) keeps 2 steps of the codewords."""
    return stream_state_bytes(c, c.latent_dim, front=2 * c.codebook_dim)


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
    weights = tts_model_bytes(config, dtype) + codec_bytes(codec)
    t = config.talker_config
    per_row = decoder_row_bytes(t.num_hidden_layers, t.num_key_value_heads, t.head_dim, t.hidden_size, t.vocab_size, t.code_predictor_config,
                                max_seq, dtype, frame_kernels)
    per_row += codec_stream_bytes(codec.decoder)
    return MemoryPlan(name, str(dtype).removeprefix("torch."), weights, per_row, TTS_RESERVE_BYTES, max_rows, VOCODER_BATCH_BYTES)


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
    """Bytes of one conversation's thinker row (`pipeline.omni.row_invariant.RowKV`): its KV cache of `max_len`
    positions and its sink, and a few per-row numbers (its flag per vocabulary id, ~150 KB, fits in the fixed reserve)."""
    layers, kv_heads = text_config["num_hidden_layers"], text_config["num_key_value_heads"]
    head_dim = text_config.get("head_dim") or text_config["hidden_size"] // text_config["num_attention_heads"]
    return 2 * layers * kv_heads * (max_len + 1) * head_dim * dtype.itemsize + 4 * 8


def omni_row_bytes(config: dict[str, Any], dtype: torch.dtype, talker_max_seq: int, thinker_max_seq: int) -> int:
    """Bytes per conversation: a talker row (its decode step runs in PyTorch ops: sparse layers), a
    thinker row and a code2wav stream."""
    from pipeline.omni.code2wav import Code2WavConfig
    from pipeline.omni.talker import OmniTalkerConfig

    talker = OmniTalkerConfig.from_dict(config["talker_config"])
    t = talker.text_config
    row = decoder_row_bytes(t.num_hidden_layers, t.num_key_value_heads, t.head_dim, t.hidden_size, t.vocab_size, talker.code_predictor_config,
                            talker_max_seq, dtype, frame_kernels=False)
    row += thinker_slot_bytes(config["thinker_config"]["text_config"], thinker_max_seq, dtype)
    code2wav = Code2WavConfig.from_dict(config["code2wav_config"])
    return row + stream_state_bytes(code2wav, code2wav.hidden_size)  # no front conv: the codes' embeddings go to the transformer


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
    """The same bytes counted from the modules a config.json builds (with their buffers): the thinker
    without its vision encoder and the talker in `dtype`, code2wav in float32 with its code offsets (int64)."""
    from pipeline.omni.code2wav import Code2WavConfig
    from pipeline.omni.talker import OmniTalkerConfig

    code2wav = Code2WavConfig.from_dict(config["code2wav_config"])
    talker = omni_talker_elements(OmniTalkerConfig.from_dict(config["talker_config"]))
    return (thinker_elements(config["thinker_config"]) + talker) * dtype.itemsize + code2wav_elements(code2wav) * 4 + code2wav.num_quantizers * 8


def omni_talker_elements(c: OmniTalkerConfig) -> int:
    """`pipeline.omni.talker.OmniTalker`: a transformer of sparse MoE layers (`pipeline.omni.moe.SparseMoeBlock`: router,
    stacked experts, gated shared expert), its codec embedding, text and hidden projections, codec head and code predictor."""
    t = c.text_config
    moe = (t.num_experts * t.hidden_size + t.num_experts * dense_mlp_elements(t.hidden_size, t.moe_intermediate_size)
           + dense_mlp_elements(t.hidden_size, t.shared_expert_intermediate_size) + linear(t.hidden_size, 1))
    model = transformer_elements(t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim, moe)
    projections = 2 * (linear(c.thinker_hidden_size, t.intermediate_size, bias=True) + linear(t.intermediate_size, t.hidden_size, bias=True))
    return (model + t.vocab_size * t.hidden_size + projections + linear(t.hidden_size, t.vocab_size)
            + code_predictor_elements(c.code_predictor_config, t.hidden_size))


def code2wav_elements(c: Code2WavConfig) -> int:
    """`pipeline.omni.code2wav.Code2Wav`'s floating-point elements: one embedding table for all codebooks, the
    transformer (no latent projections), and the upsampling stages and vocoder at the transformer's width."""
    return c.codebook_size * c.num_quantizers * c.hidden_size + window_transformer_elements(c) + vocoder_elements(c, c.hidden_size)


def thinker_elements(thinker: dict[str, Any]) -> int:
    """transformers' Qwen3OmniMoeThinkerForConditionalGeneration without its vision encoder, as
    `pipeline.omni.thinker` keeps it: the text model and its head (unless tied to the embedding) and the
    audio encoder; absent keys take transformers' defaults."""
    t = thinker["text_config"]
    hidden, heads, kv_heads = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"]
    head_dim, bias = t.get("head_dim") or hidden // heads, t.get("attention_bias", False)
    attention = (linear(hidden, heads * head_dim, bias) + 2 * linear(hidden, kv_heads * head_dim, bias)
                 + linear(heads * head_dim, hidden, bias) + 2 * head_dim)
    experts, step, dense = t.get("num_experts", 128), t.get("decoder_sparse_step", 1), set(t.get("mlp_only_layers") or ())
    moe = experts * hidden + experts * dense_mlp_elements(hidden, t.get("moe_intermediate_size", 768))
    mlps = sum(moe if i not in dense and experts > 0 and (i + 1) % step == 0 else dense_mlp_elements(hidden, t["intermediate_size"])
               for i in range(t["num_hidden_layers"]))
    layers = t["num_hidden_layers"] * (attention + 2 * hidden) + mlps + hidden
    rotary = 2 * len(range(0, head_dim, 2))  # inv_freq and its original copy
    embeddings = t["vocab_size"] * hidden * (1 if thinker.get("tie_word_embeddings", False) else 2)
    return layers + rotary + embeddings + audio_encoder_elements(thinker["audio_config"])


def audio_encoder_elements(a: dict[str, Any]) -> int:
    """transformers' Qwen3OmniMoeAudioEncoder: three 3x3 stride-2 convs over the mel, their projection,
    the transformer layers, the output norm and projections, and the sinusoidal position table."""
    width, channels, mels = a["d_model"], a["downsample_hidden_size"], a["num_mel_bins"]
    convs = conv(1, channels, 9) + 2 * conv(channels, channels, 9) + linear(channels * ((((mels + 1) // 2 + 1) // 2 + 1) // 2), width)
    layer = 4 * linear(width, width, bias=True) + linear(width, a["encoder_ffn_dim"], bias=True) + linear(a["encoder_ffn_dim"], width, bias=True) + 2 * 2 * width
    head = 2 * width + linear(width, width, bias=True) + linear(width, a["output_dim"], bias=True)
    return convs + a["encoder_layers"] * layer + head + a.get("max_source_positions", 1500) * width


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
