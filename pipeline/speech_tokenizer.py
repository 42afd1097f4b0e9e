"""Qwen3-TTS 12 Hz speech tokenizer (codec): 24 kHz audio <-> 16 codes per 80 ms frame.

Encoder: Mimi (SEANet convs -> causal transformer -> stride-2 downsample -> split RVQ), used once
per reference voice. Decoder: RVQ lookup -> causal conv -> transformer with a 72-frame sliding
window -> 2 x (transposed conv + ConvNeXt) -> SnakeBeta conv vocoder (x1920 in all).

Every decoder layer is causal, so the decoder streams exactly: each stateful layer (causal conv,
transposed conv, attention) keeps the tail of its input in a preallocated `StreamState`, updated in
place, and chunked decoding equals offline decoding whatever the chunk sizes. Offline decoding is
the same code path with a fresh state.

Parameter names are the official checkpoint's (`speech_tokenizer/model.safetensors`). Derived
tensors (codebook tables, fused projections, SnakeBeta exponentials) are non-persistent buffers
rebuilt by a load_state_dict post-hook (`_derive_`), so load a checkpoint into a model already in
its final dtype to get the reference's rounding (`from_pretrained` does).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import CheckpointError
from pipeline.layers import RMSNorm, apply_rope, rope_tables

__all__ = [
    "DecoderConfig",
    "EncoderConfig",
    "SpeechTokenizer",
    "SpeechTokenizerConfig",
    "StreamState",
    "StreamingDecoder",
    "randomize_speech_tokenizer_",
    "write_tiny_speech_tokenizer",
]


# ----------------------------------------------------------------------------------------------
# Config: the keys of the official speech_tokenizer/config.json


def _pick(cls, raw: dict):
    """The dataclass built from the keys of `raw` it knows; the rest of `raw` is ignored."""
    return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})


@dataclass
class EncoderConfig:
    """The MimiConfig keys the encoder uses (`encoder_config` in config.json)."""

    sampling_rate: int = 24000
    audio_channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: list[int] = field(default_factory=lambda: [8, 6, 5, 4])
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    compress: int = 2
    pad_mode: str = "constant"
    use_causal_conv: bool = True
    use_conv_shortcut: bool = False
    codebook_size: int = 2048
    codebook_dim: int = 256
    vector_quantization_hidden_dimension: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1
    num_hidden_layers: int = 8
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "gelu"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False
    frame_rate: float = 12.5

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        # The checkpoint's layout only; anything else is a different architecture.
        if not self.use_causal_conv or self.use_conv_shortcut or self.audio_channels != 1 or self.pad_mode != "constant":
            raise CheckpointError("speech tokenizer encoder: only causal, mono, zero-padded, shortcut-free Mimi is supported")
        if self.hidden_act != "gelu" or self.codebook_dim != self.vector_quantization_hidden_dimension:
            raise CheckpointError("speech tokenizer encoder: unsupported hidden_act / codebook_dim")

    @classmethod
    def from_dict(cls, raw: dict) -> "EncoderConfig":
        raw = dict(raw)
        # transformers 5 writes RoPE as rope_parameters, 4.x (the released checkpoints) as rope_theta.
        if "rope_theta" not in raw and isinstance(raw.get("rope_parameters"), dict):
            raw["rope_theta"] = raw["rope_parameters"].get("rope_theta", cls.rope_theta)
        return _pick(cls, raw)

    @property
    def latent_stride(self) -> int:
        # SEANet runs at ceil(sr / prod(ratios)) Hz (25 Hz); the downsample conv brings it to frame_rate.
        seanet_rate = math.ceil(self.sampling_rate / math.prod(self.upsampling_ratios))
        return int(seanet_rate / self.frame_rate)


@dataclass
class DecoderConfig:
    """`decoder_config` in config.json."""

    codebook_size: int = 2048
    codebook_dim: int = 512
    hidden_size: int = 512
    latent_dim: int = 1024
    max_position_embeddings: int = 8000
    rope_theta: float = 10000.0
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    attention_bias: bool = False
    sliding_window: int = 72
    intermediate_size: int = 1024
    hidden_act: str = "silu"
    layer_scale_initial_scale: float = 0.01
    rms_norm_eps: float = 1e-5
    num_hidden_layers: int = 8
    num_quantizers: int = 16
    upsample_rates: list[int] = field(default_factory=lambda: [8, 5, 4, 3])
    upsampling_ratios: list[int] = field(default_factory=lambda: [2, 2])
    decoder_dim: int = 1536

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.hidden_act != "silu":
            raise CheckpointError(f"speech tokenizer decoder: unsupported hidden_act {self.hidden_act!r}")

    @classmethod
    def from_dict(cls, raw: dict) -> "DecoderConfig":
        return _pick(cls, raw)

    @property
    def upsample(self) -> int:
        """Output samples per code frame."""
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)


@dataclass
class SpeechTokenizerConfig:
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    encoder_valid_num_quantizers: int = 16
    input_sample_rate: int = 24000
    output_sample_rate: int = 24000
    decode_upsample_rate: int = 1920
    encode_downsample_rate: int = 1920

    @classmethod
    def from_dict(cls, raw: dict) -> "SpeechTokenizerConfig":
        top = {k: raw[k] for k in ("encoder_valid_num_quantizers", "input_sample_rate", "output_sample_rate",
                                   "decode_upsample_rate", "encode_downsample_rate") if k in raw}
        config = cls(EncoderConfig.from_dict(raw.get("encoder_config") or {}),
                     DecoderConfig.from_dict(raw.get("decoder_config") or {}), **top)
        if config.decoder.upsample != config.decode_upsample_rate:
            raise CheckpointError(f"speech tokenizer: decoder upsamples x{config.decoder.upsample}, "
                                  f"config says decode_upsample_rate {config.decode_upsample_rate}")
        if config.decoder.num_quantizers != config.encoder_valid_num_quantizers:
            raise CheckpointError("speech tokenizer: encoder and decoder disagree on the number of codebooks")
        return config


# ----------------------------------------------------------------------------------------------
# Shared pieces


def _rederive(module: nn.Module, incompatible_keys) -> None:
    module._derive_()


def _derive_all_(module: nn.Module) -> None:
    """Rebuild every derived buffer below `module` (after changing parameters by hand)."""
    for m in module.modules():
        if hasattr(m, "_derive_"):
            m._derive_()


def exact_float32_convolutions():
    """cuDNN convolutions without TF32 (PyTorch's default allows it): with TF32, chunked and offline
    decoding round differently (~2e-3 on an H200) and encoded reference codes drift from the CPU's."""
    cudnn = torch.backends.cudnn
    return cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic, allow_tf32=False)


class StreamState:
    """The streaming state of every stateful layer below `root`, preallocated for one stream.

    Each stateful layer defines `init_state(batch_size, device, dtype)` (its own buffers) and reads
    `state[self]` in forward. Updates are in place (`copy_`, `add_`), so a CUDA graph captured with
    this object stays valid across calls; `reset()` zeroes everything in place.
    """

    def __init__(self, root: nn.Module, batch_size: int = 1):
        p = next(root.parameters())
        self._states = {}
        for m in root.modules():
            if hasattr(m, "init_state"):
                s = m.init_state(batch_size, p.device, p.dtype)
                if s is not None:
                    self._states[m] = s

    def __getitem__(self, layer: nn.Module):
        return self._states[layer]

    def _tensors(self) -> list[torch.Tensor]:
        return [t for s in self._states.values() for t in (s if isinstance(s, tuple) else (s,))]

    def reset(self) -> None:
        for t in self._tensors():
            t.zero_()

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self._tensors()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, value in zip(self._tensors(), saved):
            t.copy_(value)


def _history(layer: nn.Module, x: torch.Tensor, state: StreamState, context: int) -> torch.Tensor:
    """`x` [B, C, T] with the stream's previous `context` input steps prepended (zeros at the start
    of a stream: causal zero padding); the stored tail is advanced in place."""
    tail = state[layer]
    x = torch.cat((tail, x), dim=-1)
    tail.copy_(x[..., x.shape[-1] - context:])
    return x


# ----------------------------------------------------------------------------------------------
# Decoder


class CausalConv1d(nn.Module):
    """Stride-1 conv whose left context is the stream's previous input (zeros at the start)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.context = (kernel_size - 1) * dilation

    def init_state(self, batch_size: int, device, dtype):
        if self.context:
            return torch.zeros(batch_size, self.conv.in_channels, self.context, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        if self.context:
            x = _history(self, x, state, self.context)
        return self.conv(x)


class CausalConvTranspose1d(nn.Module):
    """Transposed conv trimmed to exactly `stride` outputs per input step.

    Output step t depends on inputs t // stride and the (kernel-1) // stride inputs before it, so
    the layer keeps those inputs (not the output overlap) and recomputes the overlap: the same
    history mechanism as the convs, and the bias is added once per output sample.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.context = (kernel_size - 1) // stride

    def init_state(self, batch_size: int, device, dtype):
        if self.context:
            return torch.zeros(batch_size, self.conv.in_channels, self.context, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        n = x.shape[-1]
        if self.context:
            x = _history(self, x, state, self.context)
        start = self.context * self.stride
        return self.conv(x)[..., start:start + n * self.stride]


class SnakeBeta(nn.Module):
    """x + 1/(exp(beta) + 1e-9) * sin(x * exp(alpha))^2, per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self.register_load_state_dict_post_hook(_rederive)
        self._derive_()

    def _derive_(self) -> None:
        # Same ops and dtype as the reference computes on every call, done once.
        self.register_buffer("alpha_exp", self.alpha.detach().exp()[:, None], persistent=False)
        self.register_buffer("inv_beta", (1.0 / (self.beta.detach().exp() + 1e-9))[:, None], persistent=False)

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        # `state` unused: stateless, but callable like its stateful neighbours in a ModuleList.
        return x + self.inv_beta * torch.sin(x * self.alpha_exp).pow(2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        h = self.dwconv(x, state).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x), state)), state)


class DecoderBlock(nn.Module):
    """SnakeBeta -> x`rate` transposed conv -> residual units with dilations 1, 3, 9."""

    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(in_dim), CausalConvTranspose1d(in_dim, out_dim, 2 * rate, rate)]
                                   + [ResidualUnit(out_dim, d) for d in (1, 3, 9)])

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        for layer in self.block:
            x = layer(x, state)
        return x


class LayerScale(nn.Module):
    def __init__(self, dim: int, initial: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), initial))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def _fused_weight(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    # A copy: the checkpoint's separate projections stay the parameters (and the state_dict).
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
    return weight, bias


class SlidingWindowAttention(nn.Module):
    """Causal attention over the last `window` frames (the frame itself included).

    Streaming keeps the last window-1 keys/values *before* RoPE. RoPE is applied per call at
    chunk-relative positions (history at 0..window-2, the chunk after it): scores depend only on
    position differences, so this equals absolute positions while the positions stay small and
    fixed for a given chunk size, however long the stream runs.
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        h, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.history = config.sliding_window - 1
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=config.attention_bias)
        self.register_load_state_dict_post_hook(_rederive)
        self._derive_()

    def _derive_(self) -> None:
        weight, bias = _fused_weight(self.q_proj, self.k_proj, self.v_proj)  # one GEMM instead of three
        self.register_buffer("qkv_weight", weight, persistent=False)
        self.register_buffer("qkv_bias", bias, persistent=False)

    def init_state(self, batch_size: int, device, dtype):
        shape = (batch_size, self.kv_heads, self.history, self.head_dim)
        return torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                state: StreamState) -> torch.Tensor:
        # x: [B, T, hidden]; cos/sin: [history + T, head_dim]; mask: [T, history + T] (True = attend)
        b, t, _ = x.shape
        q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        k_tail, v_tail = state[self]
        k, v = torch.cat((k_tail, k), dim=2), torch.cat((v_tail, v), dim=2)
        k_tail.copy_(k[:, :, t:])
        v_tail.copy_(v[:, :, t:])
        q = apply_rope(q, cos[self.history:], sin[self.history:])
        k = apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DecoderMLP(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.register_load_state_dict_post_hook(_rederive)
        self._derive_()

    def _derive_(self) -> None:
        self.register_buffer("gate_up_weight", _fused_weight(self.gate_proj, self.up_proj)[0], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.self_attn = SlidingWindowAttention(config)
        self.mlp = DecoderMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(config.hidden_size, config.layer_scale_initial_scale)

    def forward(self, x, cos, sin, mask, state: StreamState) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask, state))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class DecoderTransformer(nn.Module):
    """latent -> hidden -> sliding-window layers -> RMSNorm -> latent. Its own state is the number
    of frames already seen (a device tensor), which hides the history slots not yet filled."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_proj = nn.Linear(config.latent_dim, config.hidden_size)
        self.output_proj = nn.Linear(config.hidden_size, config.latent_dim)

    def init_state(self, batch_size: int, device, dtype):
        return torch.zeros((), device=device, dtype=torch.int64)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        # x: [B, T, latent_dim]
        t, window = x.shape[1], self.config.sliding_window
        history = window - 1
        x = self.input_proj(x)
        cos, sin = (c.to(x.dtype) for c in rope_tables(self.config.head_dim, self.config.rope_theta, history + t, x.device))
        q_pos = torch.arange(history, history + t, device=x.device)[:, None]
        k_pos = torch.arange(history + t, device=x.device)[None, :]
        seen = state[self]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window) & (k_pos >= history - seen)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, state)
        seen.add_(t)
        return self.output_proj(self.norm(x))


class _Codebook(nn.Module):
    """Stored as a running sum and a usage count; the codeword is their ratio."""

    def __init__(self, size: int, dim: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def embedding(self) -> torch.Tensor:
        return self.embedding_sum.detach() / self.cluster_usage.detach().clamp(min=1e-5)[:, None]


class _VQ(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self._codebook = _Codebook(size, dim)


class _VQStack(nn.Module):
    def __init__(self, n: int, size: int, dim: int):
        super().__init__()
        self.layers = nn.ModuleList([_VQ(size, dim) for _ in range(n)])


class _DecoderRVQ(nn.Module):
    def __init__(self, n: int, size: int, dim: int, io_dim: int):
        super().__init__()
        self.input_proj = nn.Conv1d(io_dim, dim, 1, bias=False)  # encode-side only; kept for the checkpoint
        self.output_proj = nn.Conv1d(dim, io_dim, 1, bias=False)
        self.vq = _VQStack(n, size, dim)


class DecoderQuantizer(nn.Module):
    """codes [B, T, Q] -> [B, codebook_dim, T]: codebook 0 (semantic) and the sum of codebooks
    1..Q-1 (acoustic) each go through their own 1x1 projection."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        dim, q, size = config.codebook_dim // 2, config.num_quantizers, config.codebook_size
        self.codebook_size = size
        self.rvq_first = _DecoderRVQ(1, size, dim, config.codebook_dim)
        self.rvq_rest = _DecoderRVQ(q - 1, size, dim, config.codebook_dim)
        self.register_load_state_dict_post_hook(_rederive)
        self._derive_()

    def _derive_(self) -> None:
        layers = list(self.rvq_first.vq.layers) + list(self.rvq_rest.vq.layers)
        # All codebooks in one table: one gather for the 16 lookups.
        table = torch.cat([m._codebook.embedding() for m in layers])
        self.register_buffer("table", table, persistent=False)
        self.register_buffer("offsets", torch.arange(len(layers), device=table.device) * self.codebook_size,
                             persistent=False)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        e = F.embedding(codes + self.offsets, self.table)  # [B, T, Q, dim]
        out = F.linear(e[:, :, 0], self.rvq_first.output_proj.weight[..., 0])
        out = out + F.linear(e[:, :, 1:].sum(2), self.rvq_rest.output_proj.weight[..., 0])
        return out.transpose(1, 2)


class SpeechDecoder(nn.Module):
    """codes [B, T, 16] -> waveform [B, 1, T * 1920] in [-1, 1]."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.quantizer = DecoderQuantizer(config)
        self.pre_conv = CausalConv1d(config.codebook_dim, config.latent_dim, 3)
        self.pre_transformer = DecoderTransformer(config)
        self.upsample = nn.ModuleList([
            nn.ModuleList([CausalConvTranspose1d(config.latent_dim, config.latent_dim, r, r),
                           ConvNeXtBlock(config.latent_dim)])
            for r in config.upsampling_ratios])
        dims = [config.decoder_dim // 2 ** i for i in range(len(config.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv1d(config.latent_dim, dims[0], 7)]
            + [DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(config.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv1d(dims[-1], 1, 7)])

    def forward(self, codes: torch.Tensor, state: StreamState) -> torch.Tensor:
        with exact_float32_convolutions():
            return self.vocode(self.latents(codes, state), state)

    def latents(self, codes: torch.Tensor, state: StreamState) -> torch.Tensor:
        """codes [B, T, 16] -> transformer output [B, latent_dim, T] (12.5 Hz)."""
        h = self.pre_conv(self.quantizer(codes), state)
        return self.pre_transformer(h.transpose(1, 2), state).transpose(1, 2)

    def vocode(self, h: torch.Tensor, state: StreamState) -> torch.Tensor:
        """[B, latent_dim, T] -> waveform [B, 1, T * 1920], clamped to [-1, 1] as the reference."""
        for up, convnext in self.upsample:
            h = convnext(up(h, state), state)
        for layer in self.decoder:
            h = layer(h, state)
        return h.clamp(-1, 1)

    @property
    def vocoder_context_frames(self) -> int:
        """Frames of `vocode` input that its state after a call depends on (its receptive field,
        rounded up): the contexts of its stateful layers, in frames at each layer's rate."""
        steps_per_frame, frames = 1, 0.0
        for m in list(self.upsample.modules()) + list(self.decoder.modules()):  # execution order
            if isinstance(m, (CausalConv1d, CausalConvTranspose1d)):
                frames += m.context / steps_per_frame
            if isinstance(m, CausalConvTranspose1d):
                steps_per_frame *= m.stride
        return math.ceil(frames) + 1


# ----------------------------------------------------------------------------------------------
# Encoder (Mimi)


class _MimiConv(nn.Module):
    """Causal conv: left pad kernel - stride, right pad to a whole number of output steps."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 dilation: int = 1, bias: bool = True, pad_mode: str = "constant"):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride, dilation=dilation, bias=bias)
        self.stride, self.left, self.pad_mode = stride, (kernel_size - 1) * dilation + 1 - stride, pad_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.left, -x.shape[-1] % self.stride), mode=self.pad_mode))


class _MimiResBlock(nn.Module):
    def __init__(self, config: EncoderConfig, dim: int, dilation: int):
        super().__init__()
        hidden = dim // config.compress
        self.block = nn.ModuleList([nn.ELU(), _MimiConv(dim, hidden, config.residual_kernel_size, dilation=dilation),
                                    nn.ELU(), _MimiConv(hidden, dim, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        return x + h


class _SEANetEncoder(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        layers: list[nn.Module] = [_MimiConv(1, config.num_filters, config.kernel_size)]
        dim = config.num_filters
        for ratio in reversed(config.upsampling_ratios):
            layers += [_MimiResBlock(config, dim, config.dilation_growth_rate ** j)
                       for j in range(config.num_residual_layers)]
            layers += [nn.ELU(), _MimiConv(dim, 2 * dim, 2 * ratio, stride=ratio)]
            dim *= 2
        layers += [nn.ELU(), _MimiConv(dim, config.hidden_size, config.last_kernel_size)]
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class _MimiAttention(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        h, kv, d, bias = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.attention_bias
        self.heads, self.kv_heads, self.head_dim, self.scale = h, kv, d, 1 / math.sqrt(d)
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv * d, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv * d, bias=bias)
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        # Full causal attention: the checkpoints were trained / released with transformers 4.57,
        # whose Mimi ignored `sliding_window` (250); honouring it changes codes beyond 10 s.
        out = F.scaled_dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, is_causal=True,
                                             scale=self.scale, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _MimiMLP(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _MimiLayer(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.self_attn = _MimiAttention(config)
        self.mlp = _MimiMLP(config)
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.self_attn_layer_scale = LayerScale(config.hidden_size, 0.01)
        self.mlp_layer_scale = LayerScale(config.hidden_size, 0.01)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class _MimiTransformer(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([_MimiLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = (c.to(x.dtype) for c in rope_tables(self.config.head_dim, self.config.rope_theta, x.shape[1], x.device))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


class _MimiCodebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("initialized", torch.ones(1))
        self.register_buffer("cluster_usage", torch.ones(size))
        self.register_buffer("embed_sum", torch.zeros(size, dim))
        self.register_load_state_dict_post_hook(_rederive)
        self._derive_()

    def _derive_(self) -> None:
        self.register_buffer("embed", self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None], persistent=False)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] -> nearest codeword [N]. cdist in float32 exactly as the reference, so that
        # near-ties resolve the same way.
        return torch.cdist(x[None].float(), self.embed[None].float(), p=2)[0].argmin(dim=-1)


class _MimiVQ(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.codebook = _MimiCodebook(size, dim)


class _MimiRVQ(nn.Module):
    def __init__(self, config: EncoderConfig, n: int):
        super().__init__()
        dim = config.vector_quantization_hidden_dimension
        self.input_proj = nn.Conv1d(config.hidden_size, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, config.hidden_size, 1, bias=False)  # decode-side only
        self.layers = nn.ModuleList([_MimiVQ(config.codebook_size, config.codebook_dim) for _ in range(n)])

    def encode(self, latents: torch.Tensor, n: int) -> torch.Tensor:
        # latents [B, C, T] -> codes [B, T, n]; each codebook quantizes what the previous left over.
        residual = self.input_proj(latents).transpose(1, 2)
        codes = []
        for vq in self.layers[:n]:
            idx = vq.codebook.encode(residual.reshape(-1, residual.shape[-1])).view(residual.shape[:2])
            residual = residual - F.embedding(idx, vq.codebook.embed)
            codes.append(idx)
        return torch.stack(codes, dim=-1)


class _MimiQuantizer(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.semantic = config.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = _MimiRVQ(config, config.num_semantic_quantizers)
        self.acoustic_residual_vector_quantizer = _MimiRVQ(config, config.num_quantizers - config.num_semantic_quantizers)

    def encode(self, latents: torch.Tensor, n: int) -> torch.Tensor:
        # Both stacks quantize the same latents (the acoustic one does not see the semantic residual).
        return torch.cat([self.semantic_residual_vector_quantizer.encode(latents, self.semantic),
                          self.acoustic_residual_vector_quantizer.encode(latents, n - self.semantic)], dim=-1)


class SpeechEncoder(nn.Module):
    """wav [B, samples] -> codes [B, ceil(samples / 1920), n_codebooks]."""

    def __init__(self, config: EncoderConfig, n_codebooks: int):
        super().__init__()
        self.config, self.n_codebooks = config, n_codebooks
        self.encoder = _SEANetEncoder(config)
        self.encoder_transformer = _MimiTransformer(config)
        stride = config.latent_stride
        self.downsample = _MimiConv(config.hidden_size, config.hidden_size, 2 * stride, stride, bias=False,
                                    pad_mode="replicate")
        self.quantizer = _MimiQuantizer(config)
        self.samples_per_frame = math.prod(config.upsampling_ratios) * stride

    def latents(self, wav: torch.Tensor) -> torch.Tensor:
        h = self.encoder(wav[:, None])
        h = self.encoder_transformer(h.transpose(1, 2)).transpose(1, 2)
        return self.downsample(h)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        with exact_float32_convolutions():
            codes = self.quantizer.encode(self.latents(wav), self.n_codebooks)
        # The convs' right padding can add a frame; the reference keeps ceil(samples / 1920).
        return codes[:, :-(-wav.shape[-1] // self.samples_per_frame)]


# ----------------------------------------------------------------------------------------------
# Public API


class StreamingDecoder:
    """One decoding stream: `decode_chunk(codes[n, 16])` -> exactly n * 1920 samples, and the
    concatenation over any chunking equals `SpeechTokenizer.decode` of all the codes.

    On CUDA with `use_cuda_graphs`, each chunk size is captured once as a CUDA graph over the
    stream state (updated in place, so the graphs stay valid across `reset()`) and replayed: one
    launch instead of ~640 kernels a chunk.
    """

    def __init__(self, decoder: SpeechDecoder, use_cuda_graphs: bool = False):
        self.decoder = decoder
        with torch.inference_mode():
            self.state = StreamState(decoder, batch_size=1)
        self.use_cuda_graphs = use_cuda_graphs and self.device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    @property
    def device(self) -> torch.device:
        return self.decoder.quantizer.table.device

    @torch.inference_mode()
    def prime(self, codes: torch.Tensor) -> None:
        """Feed context frames (e.g. the voice-clone reference codes) and emit nothing for them."""
        if len(codes):
            self.decoder(codes[None].to(self.device), self.state)

    @torch.inference_mode()
    def decode_chunk(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: LongTensor [n, 16] -> float32 waveform [n * 1920] (on the model's device).

        With CUDA graphs the result is a static buffer that the next chunk of this size overwrites.
        """
        if not self.use_cuda_graphs:
            return self.decoder(codes[None].to(self.device), self.state)[0, 0].float()
        graph, codes_in, wav_out = self.graphs.get(len(codes)) or self._capture(len(codes))
        codes_in.copy_(codes[None])
        graph.replay()
        return wav_out

    def _capture(self, frames: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        codes_in = torch.zeros(1, frames, self.decoder.config.num_quantizers, dtype=torch.long, device=self.device)
        saved = self.state.snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.decoder(codes_in, self.state)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            wav_out = self.decoder(codes_in, self.state)[0, 0].float()
        self.state.restore(saved)
        self.graphs[frames] = (graph, codes_in, wav_out)
        return self.graphs[frames]

    @torch.inference_mode()
    def reset(self) -> None:
        """Start a new stream, in place (buffers captured in a CUDA graph stay valid)."""
        self.state.reset()


class SpeechTokenizer(nn.Module):
    """The 12 Hz speech tokenizer; parameter names are the official checkpoint's."""

    # Offline decode runs through the streaming state in blocks of this many frames: exact (the
    # decoder is causal) and it bounds memory and the attention mask for long audio.
    decode_block_frames = 300

    def __init__(self, config: SpeechTokenizerConfig):
        super().__init__()
        self.config = config
        self.encoder = SpeechEncoder(config.encoder, config.encoder_valid_num_quantizers)
        self.decoder = SpeechDecoder(config.decoder)

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> "SpeechTokenizer":
        """Load `directory/speech_tokenizer/{config.json, model.safetensors}` (a model directory),
        or the same files directly in `directory` (the standalone tokenizer repository)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        root = directory / "speech_tokenizer" if (directory / "speech_tokenizer").is_dir() else directory
        config_path, weights_path = root / "config.json", root / "model.safetensors"
        for path in (config_path, weights_path):
            if not path.is_file():
                raise CheckpointError(f"speech tokenizer file missing: {path}")
        config = SpeechTokenizerConfig.from_dict(json.loads(config_path.read_text()))
        with torch.device("meta"):
            model = cls(config)
        weights = {k: v.to(dtype) if v.is_floating_point() else v
                   for k, v in load_file(str(weights_path), device=str(torch.device(device))).items()}
        try:
            # assign=True: the meta parameters become the loaded tensors; the post-hooks then
            # derive the fused buffers from them in the final dtype.
            model.load_state_dict(weights, strict=True, assign=True)
        except RuntimeError as e:
            raise CheckpointError(f"speech tokenizer weights {weights_path} do not match the config: {e}") from e
        return model.eval()

    @property
    def device(self) -> torch.device:
        return self.decoder.quantizer.table.device

    @torch.no_grad()
    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        """wav: float [samples] at 24 kHz -> codes LongTensor [ceil(samples / 1920), 16] (on the model's device)."""
        dtype = self.encoder.downsample.conv.weight.dtype
        return self.encoder(wav.to(self.device, dtype)[None])[0]

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: LongTensor [frames, 16] with values in [0, 2048) -> float32 [frames * 1920] in [-1, 1].

        Full causal decode (no windows, unlike the reference beyond 300 frames)."""
        stream = self.stream_decoder()
        chunks = [stream.decode_chunk(c) for c in codes.split(self.decode_block_frames)]
        return torch.cat(chunks) if chunks else torch.zeros(0, device=self.device)

    def stream_decoder(self, use_cuda_graphs: bool = False) -> StreamingDecoder:
        return StreamingDecoder(self.decoder, use_cuda_graphs)


# ----------------------------------------------------------------------------------------------
# Tiny random checkpoint (tests, offline mode)

# Small everywhere except what the rest of the engine depends on: 16 x 2048 codes, 12.5 Hz,
# 1920 samples per frame, 24 kHz, a 72-frame window. Head dims differ from hidden/heads and the
# decoder uses grouped KV heads, as a check that neither is assumed. The encoder's
# sliding_window (16 steps = 0.64 s) is far shorter than the test audio, so a Mimi that honours
# it gives different codes than the full causal attention the checkpoints expect.
TINY_CONFIG = {
    "architectures": ["Qwen3TTSTokenizerV2Model"],
    "model_type": "qwen3_tts_tokenizer_12hz",
    "encoder_valid_num_quantizers": 16,
    "input_sample_rate": 24000,
    "output_sample_rate": 24000,
    "decode_upsample_rate": 1920,
    "encode_downsample_rate": 1920,
    "encoder_config": {
        "sampling_rate": 24000, "audio_channels": 1, "hidden_size": 32, "num_filters": 4,
        "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4], "kernel_size": 7, "last_kernel_size": 3,
        "residual_kernel_size": 3, "dilation_growth_rate": 2, "compress": 2, "pad_mode": "constant",
        "use_causal_conv": True, "use_conv_shortcut": False, "trim_right_ratio": 1.0,
        "codebook_size": 2048, "codebook_dim": 16, "vector_quantization_hidden_dimension": 16,
        "num_quantizers": 32, "num_semantic_quantizers": 1, "upsample_groups": 32, "frame_rate": 12.5,
        "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
        "head_dim": 16, "hidden_act": "gelu", "max_position_embeddings": 8000, "norm_eps": 1e-5,
        "rope_theta": 10000.0, "sliding_window": 16, "layer_scale_initial_scale": 0.01, "use_cache": False,
    },
    "decoder_config": {
        "codebook_size": 2048, "codebook_dim": 16, "hidden_size": 32, "latent_dim": 32, "decoder_dim": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 64, "hidden_act": "silu", "attention_bias": False, "sliding_window": 72,
        "max_position_embeddings": 8000, "rope_theta": 10000, "rms_norm_eps": 1e-5,
        "layer_scale_initial_scale": 0.01, "num_quantizers": 16, "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2], "attention_dropout": 0.0,
    },
}

# What the reference's AutoFeatureExtractor reads (Mimi's feature extractor is Encodec's).
TINY_PREPROCESSOR_CONFIG = {
    "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1, "sampling_rate": 24000,
    "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
    "chunk_length_s": None, "overlap": None,
}


@torch.no_grad()
def randomize_speech_tokenizer_(model: "SpeechTokenizer", g: torch.Generator) -> None:
    """Seeded random weights that behave like a codec's: used by the tiny checkpoints and the GPU benchmark."""
    from pipeline.tiny import randomize_

    randomize_(model, g)

    def usage(n: int) -> torch.Tensor:
        # Varied positive counts: the codeword is sum / count, so a dropped division shows.
        return 0.5 + 1.5 * torch.rand(n, generator=g)

    for m in model.modules():
        if isinstance(m, ResidualUnit):
            # Unit-variance residual branches make the vocoder's activations grow ~x15 over its 12
            # units; the SnakeBeta sin() of large activations then turns float rounding into
            # O(1e-5) output noise. Smaller branches keep activations O(1), as in a trained model.
            m.conv2.conv.weight.mul_(0.3)
            m.conv2.conv.bias.mul_(0.3)
        elif isinstance(m, _Codebook):
            m.cluster_usage.copy_(usage(len(m.cluster_usage)))
        elif isinstance(m, _MimiCodebook):
            m.initialized.fill_(1.0)
            m.cluster_usage.copy_(usage(len(m.cluster_usage)))
    _derive_all_(model)


@torch.no_grad()
def write_tiny_speech_tokenizer(directory: Path, seed: int) -> None:
    """Write `directory/speech_tokenizer/{config.json, preprocessor_config.json, model.safetensors}`:
    a tiny random codec in the official layout, loadable by ours and by the reference."""
    from safetensors.torch import save_file

    config = SpeechTokenizerConfig.from_dict(TINY_CONFIG)
    model = SpeechTokenizer(config)
    g = torch.Generator().manual_seed(seed)
    randomize_speech_tokenizer_(model, g)

    # Encoder codebooks spread over what each of them quantizes (mean and spread per dimension, one
    # stage after the other), so that random audio gives varied codes in every codebook.
    wav = 0.5 * torch.randn(1, 4 * 24000, generator=g)
    latents = model.encoder.latents(wav)
    for rvq in (model.encoder.quantizer.semantic_residual_vector_quantizer,
                model.encoder.quantizer.acoustic_residual_vector_quantizer):
        residual = rvq.input_proj(latents).transpose(1, 2).reshape(-1, rvq.input_proj.out_channels)
        for vq in rvq.layers:
            cb = vq.codebook
            unit = (cb.embed - cb.embed.mean(0)) / cb.embed.std(0)
            cb.embed_sum.copy_((residual.mean(0) + unit * residual.std(0)) * cb.cluster_usage[:, None])
            cb._derive_()
            residual = residual - cb.embed[cb.encode(residual)]

    # Scale the last conv (output is linear in its weight and bias together) so that random codes
    # give a waveform well inside [-1, 1]: the reference's clamp would otherwise hide differences.
    last = model.decoder.decoder[-1].conv
    codes = torch.randint(0, config.decoder.codebook_size, (64, config.decoder.num_quantizers), generator=g)
    for _ in range(4):
        peak = model.decode(codes).abs().max()
        factor = 0.3 / peak if peak < 0.9 else 1e-2
        last.weight.mul_(factor)
        last.bias.mul_(factor)

    out = Path(directory) / "speech_tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR_CONFIG, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
