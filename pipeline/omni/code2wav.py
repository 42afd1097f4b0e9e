"""Qwen3-Omni's code2wav: talker codes [frames, 16] -> 24 kHz waveform, offline or streamed.

The same stages as the Qwen3-TTS codec decoder (`pipeline/codec/decoder.py`, whose layers it
reuses): a transformer with a 72-frame sliding window, 2 x (transposed conv + ConvNeXt), a SnakeBeta
conv vocoder. Two differences: the front end averages one embedding per codebook (no RVQ, no
projections around the transformer), and the vocoder's transposed convs look one input step ahead
(`LookaheadConvTranspose1d`), so N frames decode to 1920 * N - 555 samples and a stream holds back
those 555 samples (23 ms) until the next frame arrives.

Parameter names are the official checkpoint's (`code2wav.*` in Qwen3-Omni's safetensors).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.codec.config import DecoderConfig
from pipeline.codec.decoder import ConvNeXtBlock, DecoderBlock, DecoderTransformer, SnakeBeta
from pipeline.codec.streaming import CausalConv1d, LookaheadConvTranspose1d, StreamState, exact_float32_convolutions
from pipeline.errors import CheckpointError
from pipeline.loading import load_part, read_json
from pipeline.model import known_fields, read_rope_theta

WEIGHT_PREFIX = "code2wav."


@dataclass
class Code2WavConfig(DecoderConfig):
    """`code2wav_config` in Qwen3-Omni's config.json: the Qwen3-TTS codec decoder's keys, with the
    defaults of transformers' `Qwen3OmniMoeCode2WavConfig` (`codebook_dim` and `latent_dim` are
    not read: no RVQ, no projections here)."""

    hidden_size: int = 1024
    intermediate_size: int = 3072

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Code2WavConfig":
        return cls(**{**known_fields(cls, raw), "rope_theta": read_rope_theta(raw, cls.rope_theta)})

    @property
    def lookahead(self) -> int:
        """Output samples a stream holds back (and an offline decode never makes): each block's
        transposed conv trims one input step, `rate` samples at its output rate."""
        held, rate_after = 0, math.prod(self.upsample_rates)
        for rate in self.upsample_rates:
            rate_after //= rate
            held += rate * rate_after
        return held


class Code2Wav(nn.Module):
    """codes [B, T, Q] -> waveform [B, 1, T * upsample - lookahead] in [-1, 1] for a whole stream;
    with a `StreamState`, each call continues the stream."""

    def __init__(self, config: Code2WavConfig):
        super().__init__()
        self.config = config
        self.code_embedding = nn.Embedding(config.codebook_size * config.num_quantizers, config.hidden_size)
        self.register_buffer("code_offset", torch.arange(config.num_quantizers) * config.codebook_size, persistent=False)
        self.pre_transformer = DecoderTransformer(config, projected=False)
        self.upsample = nn.ModuleList([
            nn.ModuleList([LookaheadConvTranspose1d(config.hidden_size, config.hidden_size, r, r), ConvNeXtBlock(config.hidden_size)])
            for r in config.upsampling_ratios])
        dims = [config.decoder_dim // 2 ** i for i in range(len(config.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv1d(config.hidden_size, dims[0], 7)]
            + [DecoderBlock(dims[i], dims[i + 1], r, LookaheadConvTranspose1d) for i, r in enumerate(config.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv1d(dims[-1], 1, 7)])

    @property
    def device(self) -> torch.device:
        return self.code_embedding.weight.device

    def forward(self, codes: torch.Tensor, state: StreamState) -> torch.Tensor:
        with exact_float32_convolutions():
            h = self.code_embedding(codes + self.code_offset).mean(2)  # [B, T, hidden]
            h = self.pre_transformer(h, state).transpose(1, 2)
            for up, convnext in self.upsample:
                h = convnext(up(h, state), state)
            for layer in self.decoder:
                h = layer(h, state)
        state.started = True
        return h.clamp(-1, 1)

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu") -> "Code2Wav":
        """From a Qwen3-Omni checkpoint directory (official layout): `code2wav_config` of config.json
        and the `code2wav.*` tensors of its safetensors, float32 whatever they are stored in."""
        directory = Path(directory)
        raw = read_json(directory, "config.json").get("code2wav_config")
        if not isinstance(raw, dict):
            raise CheckpointError(f"{directory / 'config.json'} has no code2wav_config.")
        model = load_part(directory, WEIGHT_PREFIX, lambda: cls(Code2WavConfig.from_dict(raw)), "code2wav_config", torch.float32)
        model.code_offset = torch.arange(model.config.num_quantizers) * model.config.codebook_size
        return model.to(device).eval()


class Code2WavStream:
    """One streamed reply: `decode_chunk(codes[n, 16])` -> the samples that no later frame can
    change (n * upsample per call, less the look-ahead in the first); joined, they equal
    `decode(all codes)` of the same frames."""

    def __init__(self, model: Code2Wav):
        self.model = model
        with torch.inference_mode():
            self.state = StreamState(model, batch_size=1)

    @torch.inference_mode()
    def decode_chunk(self, codes: torch.Tensor) -> torch.Tensor:
        return self.model(codes[None].to(self.model.device), self.state)[0, 0]

    @torch.inference_mode()
    def reset(self) -> None:
        self.state.reset()


@torch.inference_mode()
def decode(model: Code2Wav, codes: torch.Tensor) -> torch.Tensor:
    """All the codes [frames, 16] in one offline pass -> float32 [frames * upsample - lookahead]."""
    return Code2WavStream(model).decode_chunk(codes)
