"""Autoregressive generation of codec frames: prefill, then one pure decode step per 80 ms frame.

`FrameDecoder.step()` is a function of static buffers only (no `.item()`, no branching on tensor
values), so one CUDA graph can capture a whole frame: the 15 code-predictor steps with their
sampling, the next talker input, the talker step and the sampling of the next codebook-0 token.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

from pipeline.model import Talker

MIN_NEW_TOKENS = 2  # the reference masks EOS for the first two codebook-0 tokens


@dataclass
class SamplingConfig:
    """Sampling for the talker (codebook 0) and the sub-talker (codebooks 1..15); defaults as the reference's."""

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_dosample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0

    @classmethod
    def from_generation_config(cls, data: dict[str, Any], **overrides: Any) -> "SamplingConfig":
        """Checkpoint defaults (generation_config.json), then any override that is not None."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def greedy(self) -> "SamplingConfig":
        """Sampling off for talker and sub-talker; the repetition penalty still applies, as in the reference."""
        return SamplingConfig(**{**self.__dict__, "do_sample": False, "subtalker_dosample": False})


def sample(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]; draws with exponential noise (Gumbel-max), no host sync."""
    if not do_sample:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1.0 - top_p
        drop_sorted[..., -1] = False
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = logits.softmax(-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(-1)


class FrameDecoder:
    """Static buffers for one utterance and the per-frame step over them."""

    def __init__(self, talker: Talker, sampling: SamplingConfig, trailing_text: torch.Tensor, tts_pad: torch.Tensor, max_frames: int, generator: torch.Generator | None):
        config = talker.config
        self.talker, self.sampling, self.generator = talker, sampling, generator
        device = talker.codec_head.weight.device
        vocab = config.vocab_size
        self.eos_id = config.codec_eos_token_id
        self.suppressed = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.suppressed[vocab - 1024:] = True
        self.suppressed[self.eos_id] = False
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        # Text fed alongside frame k; tts_pad once the text has run out.
        steps = max(max_frames, trailing_text.shape[0])
        self.trailing = tts_pad.expand(steps, -1).clone()
        self.trailing[: trailing_text.shape[0]] = trailing_text
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.hidden = torch.zeros(1, config.hidden_size, dtype=talker.codec_head.weight.dtype, device=device)
        self.frame = torch.zeros((), dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.codes = torch.zeros(config.num_code_groups, dtype=torch.long, device=device)
        self.cp_pos = torch.arange(config.num_code_groups, device=device)

    def _next_token(self, logits: torch.Tensor, frame: torch.Tensor) -> torch.Tensor:
        """Codebook-0 logits [1, V] of frame `frame` -> token [1], with the reference's logit processors."""
        s = self.sampling
        logits = logits.float()
        penalized = torch.where(logits < 0, logits * s.repetition_penalty, logits / s.repetition_penalty)
        logits = torch.where(self.seen, penalized, logits)
        logits = logits.masked_fill(self.suppressed, float("-inf"))
        logits[:, self.eos_id] = torch.where(frame < MIN_NEW_TOKENS, float("-inf"), logits[:, self.eos_id])
        token = sample(logits, s.do_sample, s.temperature, s.top_k, s.top_p, self.generator)
        self.seen[token] = True
        return token

    def _sub_token(self, logits: torch.Tensor) -> torch.Tensor:
        s = self.sampling
        return sample(logits.float(), s.subtalker_dosample, s.subtalker_temperature, s.subtalker_top_k, s.subtalker_top_p, self.generator)

    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """prompt [1, L, hidden] -> first codebook-0 token [1]."""
        length = prompt.shape[1]
        hidden, logits = self.talker(prompt, torch.arange(length, device=prompt.device))
        self.hidden.copy_(hidden)
        self.pos.fill_(length)
        self.frame.zero_()
        self.token.copy_(self._next_token(logits, self.frame))
        return self.token

    def predict_codebooks(self) -> torch.Tensor:
        """Codebooks 1..15 for the current codebook-0 token; returns all 16 codes [16]."""
        predictor = self.talker.code_predictor
        first = torch.stack((self.hidden, self.talker.model.codec_embedding(self.token)), dim=1)
        token = self._sub_token(predictor(first, self.cp_pos[:2], head=0))
        codes = [self.token, token]
        for head in range(1, predictor.config.num_code_groups - 1):
            embed = predictor.model.codec_embedding[head - 1](token)[:, None]
            token = self._sub_token(predictor(embed, self.cp_pos[head + 1 : head + 2], head=head))
            codes.append(token)
        return torch.cat(codes)

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame: its 16 codes, then the talker step that yields the next codebook-0 token.

        Returns (codes [16], next codebook-0 token [1]); both are static buffers, so clone to keep.
        """
        self.codes.copy_(self.predict_codebooks())
        embed = self.talker.embed_codes(self.codes) + self.trailing[self.frame]
        hidden, logits = self.talker(embed.view(1, 1, -1), self.pos)
        self.hidden.copy_(hidden)
        self.pos.add_(1)
        self.frame.add_(1)
        self.token.copy_(self._next_token(logits, self.frame))
        return self.codes, self.token


def generate_frames(decoder: FrameDecoder, prompt: torch.Tensor, max_frames: int) -> Iterator[torch.Tensor]:
    """Yield the codes [16] of each frame until codebook 0 says EOS or `max_frames` frames are out."""
    token = decoder.prefill(prompt)
    for _ in range(max_frames):
        if int(token) == decoder.eos_id:
            return
        codes, token = decoder.step()
        yield codes.clone()
