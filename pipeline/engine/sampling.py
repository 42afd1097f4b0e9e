"""Sampling as data: every row of the batch carries its own settings as device tensors, read inside
the decode step, so one CUDA graph serves every combination of sliders and none is captured at
request time.

Random draws come from a counter-based hash of (seed, frame, position) rather than a generator's
state: the same seed gives the same noise eagerly or in a graph, on CPU or GPU, in any row of any
batch, and rows share no RNG state.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.model import known_fields
from pipeline.request import shipped

M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling for the talker (codebook 0) and the sub-talker (codebooks 1..15); each field but the two
    switches is a sampling field of the request (pipeline.request), defaults as the reference's."""

    do_sample: bool = True
    temperature: float = shipped("temperature")
    top_k: int = shipped("top_k")
    top_p: float = shipped("top_p")
    repetition_penalty: float = shipped("repetition_penalty")
    subtalker_dosample: bool = True
    subtalker_temperature: float = shipped("subtalker_temperature")
    subtalker_top_k: int = shipped("subtalker_top_k")
    subtalker_top_p: float = shipped("subtalker_top_p")

    @classmethod
    def from_generation_config(cls, data: dict[str, Any], **overrides: Any) -> "SamplingConfig":
        """Checkpoint defaults (generation_config.json), then any override that is not None."""
        values = known_fields(cls, data)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def greedy(self) -> "SamplingConfig":
        """Sampling off for talker and sub-talker; the repetition penalty still applies, as in the reference."""
        return dataclasses.replace(self, do_sample=False, subtalker_dosample=False)


@dataclass
class RowSampling:
    """One sampler's settings for every row: [rows] device tensors."""

    do_sample: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    @classmethod
    def zeros(cls, rows: int, device: torch.device) -> "RowSampling":
        return cls(
            torch.zeros(rows, dtype=torch.bool, device=device),
            torch.ones(rows, device=device),
            torch.zeros(rows, dtype=torch.long, device=device),
            torch.ones(rows, device=device),
        )

    def set_row(self, row: int, do_sample: bool, temperature: float, top_k: int, top_p: float) -> None:
        self.do_sample[row].fill_(do_sample)
        self.temperature[row].fill_(temperature)
        self.top_k[row].fill_(top_k)
        self.top_p[row].fill_(top_p)

    def select(self, rows: slice) -> "RowSampling":
        return RowSampling(**{f.name: getattr(self, f.name)[rows] for f in dataclasses.fields(self)})


def mix32(x: torch.Tensor) -> torch.Tensor:
    """An integer hash on values < 2^32 held in int64; multipliers < 2^31 keep every product < 2^63."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & M32
    return x ^ (x >> 16)


def exponential_noise(seed_hash: torch.Tensor, start: torch.Tensor, count: int) -> torch.Tensor:
    """Exp(1) noise [rows, count] for draw positions start..start+count-1 of each row's stream."""
    index = (start[:, None] + torch.arange(count, device=start.device)) & M32
    seed = seed_hash[:, None]
    bits = mix32((mix32(index ^ seed) + seed) & M32)
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # strictly inside (0, 1)
    return -torch.log(uniform)


def sample_rows(logits: torch.Tensor, settings: RowSampling, noise: torch.Tensor) -> torch.Tensor:
    """logits [rows, V] (float32, processors applied) -> token ids [rows]; no host sync, no branch on values.

    Per row: greedy argmax, or temperature, then top-k (0 = off), then top-p (the reference's rule:
    drop the least likely tokens whose total mass is at most 1 - top_p, always keep the most likely),
    then a draw by the exponential race (argmax of p / Exp(1) noise).
    """
    vocab = logits.shape[-1]
    scaled = logits / settings.temperature[:, None]
    ordered = scaled.sort(dim=-1, descending=True).values
    k = torch.where(settings.top_k > 0, settings.top_k.clamp(max=vocab), vocab)
    kth = ordered.gather(-1, (k - 1)[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    tail_mass = ordered.softmax(-1).flip(-1).cumsum(-1).flip(-1)  # mass of each rank and all below it
    keep = tail_mass > (1.0 - settings.top_p)[:, None]
    keep[:, 0] = True
    cutoff = ordered.gather(-1, (keep.sum(-1) - 1)[:, None])  # keep is a prefix of the ranks
    scaled = scaled.masked_fill(scaled < cutoff, float("-inf"))
    drawn = (scaled.softmax(-1) / noise).argmax(-1)
    return torch.where(settings.do_sample, drawn, logits.argmax(-1))
