"""Autoregressive generation of codec frames: prefill, then one pure decode step per 80 ms frame.

`FrameDecoder.step()` reads and writes only static buffers (no `.item()`, no branching on tensor
values), so on CUDA one graph captures a whole frame: the 15 code-predictor steps with their
sampling, the next talker input, the talker step and the sampling of the next codebook-0 token.
The buffers live as long as the decoder; a request copies its prompt into them, so graphs are
captured once per sampling configuration and replayed by every later request.

Random draws come from a counter-based hash of (seed, frame, position) rather than a generator's
state: the same seed gives the same noise eagerly or in a graph, on CPU or GPU, and concurrent
models share no RNG state.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

from pipeline.model import Talker

MIN_NEW_TOKENS = 2  # the reference masks EOS for the first two codebook-0 tokens
PREFILL_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048)  # prompt lengths with a prefill CUDA graph
M32 = 0xFFFFFFFF


@dataclass(frozen=True)
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
        return dataclasses.replace(self, do_sample=False, subtalker_dosample=False)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # An integer hash on values < 2^32 held in int64; multipliers < 2^31 keep every product < 2^63.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & M32
    return x ^ (x >> 16)


def exponential_noise(seed_hash: torch.Tensor, start: torch.Tensor, count: int) -> torch.Tensor:
    """Exp(1) noise [count] for draw positions start..start+count-1 of the stream `seed_hash` names."""
    index = (start + torch.arange(count, device=start.device)) & M32
    bits = _mix32((_mix32(index ^ seed_hash) + seed_hash) & M32)
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # strictly inside (0, 1)
    return -torch.log(uniform)


def sample(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float, noise: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> token ids [B]; draws with exponential noise [V] (Gumbel-max), no host sync."""
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
    return (logits.softmax(-1) / noise).argmax(-1)


class FrameDecoder:
    """Static buffers for one utterance at a time, and the per-frame step over them."""

    def __init__(self, talker: Talker, max_seq: int, use_cuda_graphs: bool = True, compiled: bool = False):
        config = talker.config
        self.talker, self.max_seq = talker, max_seq
        weight = talker.codec_head.weight
        device = weight.device
        talker.model.setup_caches(1, max_seq)
        talker.code_predictor.model.setup_caches(1, config.num_code_groups)
        self.vocab = config.vocab_size
        self.sub_vocab = config.code_predictor_config.vocab_size
        self.sub_steps = config.num_code_groups - 1
        self.draws_per_frame = self.vocab + self.sub_steps * self.sub_vocab
        self.eos_id = config.codec_eos_token_id
        self.suppressed = torch.zeros(self.vocab, dtype=torch.bool, device=device)
        self.suppressed[self.vocab - 1024 :] = True
        self.suppressed[self.eos_id] = False
        self.seen = torch.zeros(self.vocab, dtype=torch.bool, device=device)
        self.trailing = torch.zeros(max_seq, config.hidden_size, dtype=weight.dtype, device=device)
        self.token = torch.zeros(1, dtype=torch.long, device=device)
        self.hidden = torch.zeros(1, config.hidden_size, dtype=weight.dtype, device=device)
        self.frame = torch.zeros((), dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.seed_hash = torch.zeros((), dtype=torch.long, device=device)
        self.codes = torch.zeros(config.num_code_groups, dtype=torch.long, device=device)
        self.cp_pos = torch.arange(config.num_code_groups, device=device)
        self.sampling = SamplingConfig()
        self.use_cuda_graphs = use_cuda_graphs and device.type == "cuda"
        self.graphs: dict[SamplingConfig, torch.cuda.CUDAGraph] = {}
        # Prefill graphs per prompt-length bucket: (graph, input embeddings [1, B, hidden], output [1, B, hidden], positions).
        self.prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # Compiled, the decode step fuses norms, RoPE, residuals and sampling into few kernels.
        self.talker_stack, self.predictor_stack = talker.model, talker.code_predictor.model
        self.sample, self.noise = sample, exponential_noise
        if compiled:
            # Every model in the process adds its own entries (talker step, predictor steps, sampling) to
            # the shared Transformer.forward; dynamo's default limit of 8 would stop the third model.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            options = dict(fullgraph=True, dynamic=False)
            self.talker_stack = torch.compile(talker.model, **options)
            self.predictor_stack = torch.compile(talker.code_predictor.model, **options)
            self.sample, self.noise = torch.compile(sample, **options), torch.compile(exponential_noise, **options)

    def max_frames(self, prompt_length: int) -> int:
        return self.max_seq - prompt_length - 1

    @torch.inference_mode()
    def reset(self, trailing_text: torch.Tensor, tts_pad: torch.Tensor, sampling: SamplingConfig, seed: int) -> None:
        """Copy a request into the static buffers: text fed alongside frame k (tts_pad once it runs out)."""
        self.trailing.copy_(tts_pad.expand_as(self.trailing))
        self.trailing[: trailing_text.shape[0]] = trailing_text
        self.seen.zero_()
        self.frame.zero_()
        self.seed_hash.copy_(_mix32(torch.tensor(seed & M32)))
        self.sampling = sampling

    def _noise(self, frame: torch.Tensor, offset: int, count: int) -> torch.Tensor:
        return self.noise(self.seed_hash, frame * self.draws_per_frame + offset, count)

    def _next_token(self, logits: torch.Tensor, frame: torch.Tensor) -> torch.Tensor:
        """Codebook-0 logits [1, V] of frame `frame` -> token [1], with the reference's logit processors."""
        s = self.sampling
        logits = logits.float()
        penalized = torch.where(logits < 0, logits * s.repetition_penalty, logits / s.repetition_penalty)
        logits = torch.where(self.seen, penalized, logits)
        logits = logits.masked_fill(self.suppressed, float("-inf"))
        logits[:, self.eos_id] = torch.where(frame < MIN_NEW_TOKENS, float("-inf"), logits[:, self.eos_id])
        noise = self._noise(frame, 0, self.vocab) if s.do_sample else None
        token = self.sample(logits, s.do_sample, s.temperature, s.top_k, s.top_p, noise)
        self.seen.index_fill_(0, token, True)
        return token

    @torch.inference_mode()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """prompt [1, L, hidden] -> first codebook-0 token [1]."""
        length = prompt.shape[1]
        if length + 1 > self.max_seq:
            raise ValueError(f"The prompt has {length} positions; this decoder holds at most {self.max_seq - 1}.")
        bucket = next((b for b in PREFILL_BUCKETS if length <= b <= self.max_seq), None)
        if self.use_cuda_graphs and bucket is not None:
            graph, embeds, out, _ = self.prefill_graphs.get(bucket) or self._capture_prefill(bucket)
            embeds.zero_()
            embeds[:, :length] = prompt
            graph.replay()
            hidden = out[:, length - 1]
            logits = self.talker.codec_head(hidden)
        else:
            hidden, logits = self.talker(prompt, torch.arange(length, device=prompt.device))
        self.hidden.copy_(hidden)
        self.pos.fill_(length)
        self.token.copy_(self._next_token(logits, self.frame))
        return self.token

    def predict_codebooks(self) -> torch.Tensor:
        """Codebooks 1..15 for the current codebook-0 token; returns all 16 codes [16]."""
        s = self.sampling
        predictor = self.talker.code_predictor
        noise = self._noise(self.frame, self.vocab, self.sub_steps * self.sub_vocab).view(self.sub_steps, -1) if s.subtalker_dosample else [None] * self.sub_steps

        def draw(logits: torch.Tensor, head: int) -> torch.Tensor:
            return self.sample(logits.float(), s.subtalker_dosample, s.subtalker_temperature, s.subtalker_top_k, s.subtalker_top_p, noise[head])

        first = torch.stack((self.hidden, self.talker.model.codec_embedding(self.token)), dim=1)
        token = draw(predictor(first, self.cp_pos[:2], head=0, stack=self.predictor_stack), 0)
        codes = [self.token, token]
        for head in range(1, self.sub_steps):
            embed = predictor.model.codec_embedding[head - 1](token)[:, None]
            token = draw(predictor(embed, self.cp_pos[head + 1 : head + 2], head=head, stack=self.predictor_stack), head)
            codes.append(token)
        return torch.cat(codes)

    def _step(self) -> None:
        self.codes.copy_(self.predict_codebooks())
        # index_select, not trailing[frame]: indexing by a 0-d tensor reads it on the host.
        embed = self.talker.embed_codes(self.codes) + self.trailing.index_select(0, self.frame.view(1))[0]
        hidden, logits = self.talker(embed.view(1, 1, -1), self.pos, stack=self.talker_stack)
        self.hidden.copy_(hidden)
        self.pos.add_(1)
        self.frame.add_(1)
        self.token.copy_(self._next_token(logits, self.frame))

    @torch.inference_mode()
    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One frame: its 16 codes, then the talker step that yields the next codebook-0 token.

        Returns (codes [16], next codebook-0 token [1]); both are static buffers, so clone to keep.
        """
        if self.use_cuda_graphs:
            self._graph().replay()
        else:
            self._step()
        return self.codes, self.token

    def _graph(self) -> torch.cuda.CUDAGraph:
        graph = self.graphs.get(self.sampling)
        if graph is None:
            graph = self.graphs[self.sampling] = self._capture()
        return graph

    def capture_prefill_graphs(self) -> None:
        """Capture every prompt-length bucket now (at load), not in a user's time to first audio."""
        if self.use_cuda_graphs:
            for bucket in PREFILL_BUCKETS:
                if bucket <= self.max_seq and bucket not in self.prefill_graphs:
                    self._capture_prefill(bucket)

    def _capture_prefill(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The talker stack over `bucket` positions as one graph. A shorter prompt is zero-padded at the
        end: causal attention keeps the padding out of the real positions, and the cache slots it
        fills are rewritten by the decode steps before any query can see them."""
        embeds = torch.zeros(1, bucket, self.hidden.shape[-1], dtype=self.hidden.dtype, device=self.hidden.device)
        positions = torch.arange(bucket, device=embeds.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.talker.model(embeds, positions)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.talker.model(embeds, positions)
        # `positions` is read by the graph at replay: it must live as long as the graph.
        self.prefill_graphs[bucket] = (graph, embeds, out, positions)
        return self.prefill_graphs[bucket]

    def _capture(self) -> torch.cuda.CUDAGraph:
        """Capture `_step` on the current buffers, leaving them as they were (warm-up runs on a copy of the state)."""
        state = [self.hidden, self.pos, self.frame, self.token, self.seen, self.codes]
        saved = [t.clone() for t in state]
        caches = [(layer.self_attn.kv_cache.k.clone(), layer.self_attn.kv_cache.v.clone()) for layer in self.talker.model.layers]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        for t, value in zip(state, saved):
            t.copy_(value)
        for layer, (k, v) in zip(self.talker.model.layers, caches):
            layer.self_attn.kv_cache.k.copy_(k)
            layer.self_attn.kv_cache.v.copy_(v)
        return graph


def generate_frames(decoder: FrameDecoder, prompt: torch.Tensor, max_frames: int) -> Iterator[torch.Tensor]:
    """Yield the codes [16] of each frame until codebook 0 says EOS or `max_frames` frames are out."""
    token = decoder.prefill(prompt)
    for _ in range(max_frames):
        if int(token) == decoder.eos_id:
            return
        codes, token = decoder.step()
        yield codes.clone()
