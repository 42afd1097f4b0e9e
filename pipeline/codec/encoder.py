"""The codec's encoder, Mimi: wav [B, samples] -> codes [B, ceil(samples / 1920), 16].

SEANet convs -> causal transformer -> stride-2 downsample -> split RVQ; used once per reference
voice. Modules and parameter names are those transformers' MimiModel builds for the same config
(the reference's encoder is a MimiModel).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.codec.config import EncoderConfig
from pipeline.codec.streaming import derive_unless_meta_, exact_float32_convolutions, rederive_after_load
from pipeline.layers import LayerScale, apply_rope, rope_tables


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


class MimiCodebook(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.register_buffer("initialized", torch.ones(1))
        self.register_buffer("cluster_usage", torch.ones(size))
        self.register_buffer("embed_sum", torch.zeros(size, dim))
        self.register_load_state_dict_post_hook(rederive_after_load)
        derive_unless_meta_(self)

    def _derive_(self) -> None:
        self.register_buffer("embed", self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None], persistent=False)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] -> nearest codeword [N]. cdist in float32 exactly as the reference, so that
        # near-ties resolve the same way.
        return torch.cdist(x[None].float(), self.embed[None].float(), p=2)[0].argmin(dim=-1)


class _MimiVQ(nn.Module):
    def __init__(self, size: int, dim: int):
        super().__init__()
        self.codebook = MimiCodebook(size, dim)


class MimiRVQ(nn.Module):
    """Residual vector quantizer: each codebook quantizes what the previous ones left over."""

    def __init__(self, config: EncoderConfig, n: int):
        super().__init__()
        # As Mimi: 1x1 projections only when the codebooks' size differs from the latents'.
        self.input_proj = self.output_proj = None
        if config.projects_latents:
            dim = config.vector_quantization_hidden_dimension
            self.input_proj = nn.Conv1d(config.hidden_size, dim, 1, bias=False)
            self.output_proj = nn.Conv1d(dim, config.hidden_size, 1, bias=False)  # decode-side only
        self.layers = nn.ModuleList([_MimiVQ(config.codebook_size, config.codebook_dim) for _ in range(n)])

    def project(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, hidden_size, T] -> the vectors the codebooks quantize, [B, T, codebook_dim]."""
        if self.input_proj is not None:
            latents = self.input_proj(latents)
        return latents.transpose(1, 2)

    def encode(self, latents: torch.Tensor, n: int) -> torch.Tensor:
        """latents [B, hidden_size, T] -> codes [B, T, n] from the first n codebooks."""
        residual = self.project(latents)
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
        self.semantic_residual_vector_quantizer = MimiRVQ(config, config.num_semantic_quantizers)
        self.acoustic_residual_vector_quantizer = MimiRVQ(config, config.num_quantizers - config.num_semantic_quantizers)

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
        """wav [B, samples] -> latents [B, hidden_size, frames] (what the quantizers encode)."""
        h = self.encoder(wav[:, None])
        h = self.encoder_transformer(h.transpose(1, 2)).transpose(1, 2)
        return self.downsample(h)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        with exact_float32_convolutions():
            codes = self.quantizer.encode(self.latents(wav), self.n_codebooks)
        # The convs' right padding can add a frame; the reference keeps ceil(samples / 1920).
        return codes[:, :-(-wav.shape[-1] // self.samples_per_frame)]
