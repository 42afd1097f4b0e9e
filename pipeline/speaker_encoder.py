"""Speaker encoder of the Qwen3-TTS Base models: an ECAPA-TDNN x-vector on a 128-bin log-mel.

The voice-clone prompt carries one speaker embedding ([enc_dim] = talker hidden size) computed
from the 24 kHz reference audio. Parameter names follow the official checkpoint (prefix
`speaker_encoder.`), so the top-level model owns this module as its `speaker_encoder` child.
Unlike SpeechBrain's ECAPA-TDNN, the official TDNN blocks have no BatchNorm: conv + ReLU only.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# Fixed by the official extract_speaker_embedding; the checkpoints were trained on this mel.
MEL_SAMPLE_RATE = 24000
MEL_N_FFT = 1024
MEL_HOP = 256
MEL_WIN = 1024
MEL_FMIN = 0.0
MEL_FMAX = 12000.0
MEL_LOG_FLOOR = 1e-5  # log(max(mel, floor)): silence maps to log(1e-5), not -inf
MAG_EPS = 1e-9  # added under the sqrt of |STFT|^2, part of the trained feature


@dataclass
class SpeakerEncoderConfig:
    """`speaker_encoder_config` of the main config.json; defaults are the official code defaults.

    The released config.json files only set `enc_dim` (1024 for 0.6B, 2048 for 1.7B) and
    `sample_rate`, so every other field comes from these defaults.
    """

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: list[int] = field(default_factory=lambda: [512, 512, 512, 512, 1536])
    enc_kernel_sizes: list[int] = field(default_factory=lambda: [5, 3, 3, 3, 1])
    enc_dilations: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 1])
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000

    def __post_init__(self) -> None:
        # Fail at config time with the reason, instead of a shape error deep in forward.
        n = len(self.enc_channels)
        if not (len(self.enc_kernel_sizes) == len(self.enc_dilations) == n):
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations must have the same length")
        if n < 3:
            raise ValueError("enc_channels needs at least 3 entries: first TDNN, >=1 SE-Res2Net block, MFA")
        inner = self.enc_channels[1:-1]
        if any(c != self.enc_channels[0] for c in inner):
            raise ValueError("SE-Res2Net blocks are residual: enc_channels[1:-1] must equal enc_channels[0]")
        if any(c % self.enc_res2net_scale for c in inner):
            raise ValueError("enc_channels[1:-1] must be divisible by enc_res2net_scale")
        if self.enc_channels[-1] != sum(inner):
            raise ValueError("enc_channels[-1] must equal sum(enc_channels[1:-1]): MFA concatenates the blocks")

    @classmethod
    def from_dict(cls, config: dict[str, Any] | None) -> SpeakerEncoderConfig:
        # Serialized HF configs carry bookkeeping keys (model_type, transformers_version, ...).
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (config or {}).items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tiny_speaker_encoder_config(enc_dim: int = 24) -> dict[str, Any]:
    """`speaker_encoder_config` for tiny test checkpoints; `enc_dim` must equal the talker hidden size."""
    return SpeakerEncoderConfig(
        enc_dim=enc_dim,
        enc_channels=[32, 32, 32, 32, 96],
        enc_attention_channels=16,
        enc_res2net_scale=8,  # same 7-step Res2Net chain as the real model, 4 channels per split
        enc_se_channels=16,
    ).to_dict()


def _hz_to_slaney_mel(hz: np.ndarray) -> np.ndarray:
    # Slaney's auditory scale: linear below 1 kHz, logarithmic above.
    linear = hz / (200.0 / 3)
    log_part = 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(hz >= 1000.0, log_part, linear)


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    return np.where(mel >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0)), (200.0 / 3) * mel)


@functools.lru_cache(maxsize=8)
def _mel_basis(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> torch.Tensor:
    """Slaney-scale, Slaney-normalised triangular filters [n_mels, n_fft // 2 + 1] (librosa's default bank).

    Cached on CPU in float32, not a module buffer: .to(bfloat16) must not touch it, and
    meta-device loading must not lose it.
    """
    bins = np.linspace(0.0, sample_rate / 2, 1 + n_fft // 2)
    edges = _slaney_mel_to_hz(np.linspace(_hz_to_slaney_mel(np.array(fmin)), _hz_to_slaney_mel(np.array(fmax)), n_mels + 2))
    widths = np.diff(edges)
    rising = (bins[None, :] - edges[:-2, None]) / widths[:-1, None]
    falling = (edges[2:, None] - bins[None, :]) / widths[1:, None]
    filters = np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return torch.from_numpy(filters.astype(np.float32))


def mel_spectrogram(
    wav: torch.Tensor,
    n_mels: int = 128,
    sample_rate: int = MEL_SAMPLE_RATE,
    n_fft: int = MEL_N_FFT,
    hop: int = MEL_HOP,
    win: int = MEL_WIN,
    fmin: float = MEL_FMIN,
    fmax: float = MEL_FMAX,
) -> torch.Tensor:
    """Log-mel of `wav` [B, samples] (float32, on wav's device) -> [B, n_mels, samples // hop]."""
    wav = wav.float()
    # Pad (n_fft - hop) / 2 per side and frame without centering: frame t then covers
    # samples [t*hop - 384, t*hop + 640), i.e. exactly samples // hop frames.
    pad = (n_fft - hop) // 2
    wav = F.pad(wav.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    window = torch.hann_window(win, device=wav.device)
    spec = torch.stft(wav, n_fft, hop_length=hop, win_length=win, window=window, center=False, return_complex=True)
    mag = (spec.real.square() + spec.imag.square() + MAG_EPS).sqrt()  # [B, n_fft // 2 + 1, frames]
    mel = _mel_basis(sample_rate, n_fft, n_mels, fmin, fmax).to(wav.device) @ mag
    return mel.clamp(min=MEL_LOG_FLOOR).log()


def _conv(in_ch: int, out_ch: int, kernel_size: int = 1, dilation: int = 1) -> nn.Conv1d:
    # Every conv of the official encoder is 'same'-length with reflect padding (no zero edges).
    return nn.Conv1d(in_ch, out_ch, kernel_size, dilation=dilation, padding="same", padding_mode="reflect")


class TDNN(nn.Module):
    """Dilated conv + ReLU (no BatchNorm in this checkpoint)."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        self.conv = _conv(in_ch, out_ch, kernel_size, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, C, T]
        return F.relu(self.conv(x))


class Res2Net(nn.Module):
    """Split channels into `scale` groups; group i>0 is convolved after adding group i-1's output."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(TDNN(width, width, kernel_size, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, *rest = x.chunk(self.scale, dim=1)
        outs, y = [first], None
        for part, block in zip(rest, self.blocks):
            y = block(part if y is None else part + y)
            outs.append(y)
        return torch.cat(outs, dim=1)


class SqueezeExcite(nn.Module):
    """Per-channel gate from the time-averaged features."""

    def __init__(self, channels: int, se_channels: int) -> None:
        super().__init__()
        self.conv1 = _conv(channels, se_channels)
        self.conv2 = _conv(se_channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.conv2(F.relu(self.conv1(x.mean(dim=2, keepdim=True)))).sigmoid()
        return x * gate


class SERes2NetBlock(nn.Module):
    def __init__(self, channels: int, scale: int, se_channels: int, kernel_size: int, dilation: int) -> None:
        super().__init__()
        self.tdnn1 = TDNN(channels, channels, 1, 1)
        self.res2net_block = Res2Net(channels, scale, kernel_size, dilation)
        self.tdnn2 = TDNN(channels, channels, 1, 1)
        self.se_block = SqueezeExcite(channels, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x))))


def _weighted_stats(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    # x: [B, C, T], w: [B or 1, C or 1, T] summing to 1 over T -> mean, std: [B, C]
    mean = (w * x).sum(dim=2)
    var = (w * (x - mean.unsqueeze(2)).square()).sum(dim=2)
    return mean, var.clamp(min=eps).sqrt()


class AttentiveStatsPool(nn.Module):
    """Attention over time conditioned on global mean/std; returns weighted mean and std."""

    def __init__(self, channels: int, attention_channels: int) -> None:
        super().__init__()
        self.tdnn = TDNN(3 * channels, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, C, T] -> [B, 2C, 1]
        # Inputs are never padded (one clip per call), so the global statistics use uniform weights.
        # 1/T is computed from T rounded to x.dtype, as the official code does: in bf16, T > 256 is
        # inexact and the reference embedding (what the talker was trained with) includes that.
        frames = x.new_full((1, 1, 1), x.shape[2])
        mean, std = _weighted_stats(x, x.new_ones(1, 1, x.shape[2]) / frames)
        context = torch.cat([x, mean.unsqueeze(2).expand_as(x), std.unsqueeze(2).expand_as(x)], dim=1)
        attn = self.conv(torch.tanh(self.tdnn(context))).softmax(dim=2)
        mean, std = _weighted_stats(x, attn)
        return torch.cat([mean, std], dim=1).unsqueeze(2)


class SpeakerEncoder(nn.Module):
    def __init__(self, config: SpeakerEncoderConfig) -> None:
        super().__init__()
        self.config = config
        ch, ks, dil = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
        self.blocks = nn.ModuleList([TDNN(config.mel_dim, ch[0], ks[0], dil[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(SERes2NetBlock(ch[i], config.enc_res2net_scale, config.enc_se_channels, ks[i], dil[i]))
        self.mfa = TDNN(ch[-1], ch[-1], ks[-1], dil[-1])  # multi-layer feature aggregation
        self.asp = AttentiveStatsPool(ch[-1], config.enc_attention_channels)
        self.fc = _conv(2 * ch[-1], config.enc_dim)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:  # mels: [B, frames, mel_dim] -> [B, enc_dim]
        x = mels.transpose(1, 2)
        features = []
        for block in self.blocks:
            x = block(x)
            features.append(x)
        x = self.mfa(torch.cat(features[1:], dim=1))  # the first TDNN's output is not aggregated
        return self.fc(self.asp(x)).squeeze(2)

    @torch.no_grad()
    def embed(self, wav: torch.Tensor) -> torch.Tensor:
        """Speaker embedding [enc_dim] of one 24 kHz clip `wav` [samples], in the module's dtype/device.

        The mel is computed in float32 on `wav`'s device (pass a CPU tensor to match the official
        package bit for bit); only the encoder runs in the module's dtype.
        """
        if wav.dim() != 1:
            raise ValueError(f"embed expects one mono waveform [samples], got shape {tuple(wav.shape)}")
        # Reflect padding needs more frames than the widest conv pads on one side.
        cfg = self.config
        min_frames = 1 + max((d * (k - 1) + 1) // 2 for k, d in zip(cfg.enc_kernel_sizes, cfg.enc_dilations))
        if wav.shape[0] // MEL_HOP < min_frames:
            raise ValueError(f"embed needs at least {min_frames * MEL_HOP} samples, got {wav.shape[0]}")
        mels = mel_spectrogram(wav[None], n_mels=self.config.mel_dim).transpose(1, 2)  # [1, frames, mel]
        weight = self.fc.weight
        return self(mels.to(device=weight.device, dtype=weight.dtype))[0]
