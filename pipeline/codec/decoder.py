"""The codec's decoder: codes [B, T, 16] -> 24 kHz waveform [B, 1, T * 1920].

RVQ lookup -> causal conv -> transformer with a 72-frame sliding window -> 2 x (transposed conv +
ConvNeXt) -> SnakeBeta conv vocoder. Every layer is causal and keeps its context in a
`StreamState`, so offline decoding, one stream decoded in chunks (`StreamingDecoder`) and many
streams sharing one decoder (`MultiStreamDecoder`) are the same code path and agree.

Parameter names are the official checkpoint's. Derived tensors (codebook table, fused
projections, SnakeBeta exponentials) are non-persistent buffers rebuilt after loading.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.codec.config import DecoderConfig
from pipeline.codec.convolution import residual_unit
from pipeline.codec.snake import snake_beta
from pipeline.codec.streaming import CausalConv1d, CausalConvTranspose1d, StreamState, derive_unless_meta_, exact_float32_convolutions, rederive_after_load
from pipeline.codec.transformer_kernels import FUSED_FRAMES, fused_transformer, transformer_kernels_available
from pipeline.graphs import CUDAGraphed
from pipeline.layers import LayerScale, RMSNorm, apply_rope, attention, rope_tables


class SnakeBeta(nn.Module):
    """x + 1/(exp(beta) + 1e-9) * sin(x * exp(alpha))^2, per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))
        self.register_load_state_dict_post_hook(rederive_after_load)
        derive_unless_meta_(self)

    def _derive_(self) -> None:
        # Same ops and dtype as the reference computes on every call, done once.
        self.register_buffer("alpha_exp", self.alpha.detach().exp()[:, None], persistent=False)
        self.register_buffer("inv_beta", (1.0 / (self.beta.detach().exp() + 1e-9))[:, None], persistent=False)

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        # `state` unused: stateless, but callable like its stateful neighbours in a ModuleList.
        return snake_beta(x, self.alpha_exp, self.inv_beta)


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
    """x + conv1x1(snake(conv7(snake(x)))): in three Triton kernels on CUDA (pipeline.codec.convolution)."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, 1)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        if self.conv1.runs_fused(x):
            return residual_unit(self, x, state)
        return x + self.conv2(self.act2(self.conv1(self.act1(x), state)), state)


class DecoderBlock(nn.Module):
    """SnakeBeta -> x`rate` transposed conv -> residual units with dilations 1, 3, 9. `transposed`:
    how the transposed conv is trimmed (Qwen3-Omni's code2wav looks one step ahead)."""

    def __init__(self, in_dim: int, out_dim: int, rate: int, transposed: type[nn.Module] = CausalConvTranspose1d):
        super().__init__()
        self.block = nn.ModuleList([SnakeBeta(in_dim), transposed(in_dim, out_dim, 2 * rate, rate)]
                                   + [ResidualUnit(out_dim, d) for d in (1, 3, 9)])

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        for layer in self.block:
            x = layer(x, state)
        return x


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
        self.register_load_state_dict_post_hook(rederive_after_load)
        derive_unless_meta_(self)

    def _derive_(self) -> None:
        weight, bias = _fused_weight(self.q_proj, self.k_proj, self.v_proj)  # one GEMM instead of three
        self.register_buffer("qkv_weight", weight, persistent=False)
        self.register_buffer("qkv_bias", bias, persistent=False)

    def init_state(self, batch_size: int, device, dtype):
        shape = (batch_size, self.kv_heads, self.history, self.head_dim)
        return torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                state: StreamState) -> torch.Tensor:
        # x: [B, T, hidden]; cos/sin: [history + T, head_dim]; mask: [B, T, history + T] (additive)
        b, t, _ = x.shape
        q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        k_tail, v_tail = state[self]
        k, v = torch.cat((k_tail, k), dim=2), torch.cat((v_tail, v), dim=2)
        state.update(k_tail, k[:, :, t:])
        state.update(v_tail, v[:, :, t:])
        q = apply_rope(q, cos[self.history:], sin[self.history:])
        k = apply_rope(k, cos, sin)
        out = attention(q, k, v, mask, self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DecoderMLP(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.register_load_state_dict_post_hook(rederive_after_load)
        derive_unless_meta_(self)

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
    """latent -> hidden -> sliding-window layers -> RMSNorm -> latent (`projected`; Qwen3-Omni's
    code2wav has no projections: hidden in, hidden out). Its own state is the number of frames
    each row has already seen ([batch], on the device), which hides the history slots that row
    has not filled yet.

    On CUDA its layers run in Triton kernels (pipeline.codec.transformer_kernels), 1 to 16 frames a
    pass, reading RoPE tables derived once (`rope_cos`, `rope_sin`: the window and 16 frames);
    `use_kernels` off keeps PyTorch's ops there (to compare the two)."""

    use_kernels = True

    def __init__(self, config: DecoderConfig, projected: bool = True):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_proj = nn.Linear(config.latent_dim, config.hidden_size) if projected else nn.Identity()
        self.output_proj = nn.Linear(config.hidden_size, config.latent_dim) if projected else nn.Identity()
        self.register_load_state_dict_post_hook(rederive_after_load)
        derive_unless_meta_(self)

    def _derive_(self) -> None:
        cos, sin = rope_tables(self.config.head_dim, self.config.rope_theta, self.config.sliding_window - 1 + FUSED_FRAMES, self.norm.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_state(self, batch_size: int, device, dtype):
        return torch.zeros(batch_size, device=device, dtype=torch.int64)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        # x: [B, T, latent_dim]
        if self.use_kernels and self.config.sliding_window > 1 and transformer_kernels_available(x):
            return fused_transformer(self, x, state)
        t, history = x.shape[1], self.config.sliding_window - 1
        x = self.input_proj(x)
        cos, sin = (c.to(x.dtype) for c in rope_tables(self.config.head_dim, self.config.rope_theta, history + t, x.device))
        seen = state[self]
        mask = self._attention_mask(seen, t)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, state)
        state.update(seen, seen + t)
        return self.output_proj(self.norm(x))

    def _attention_mask(self, seen: torch.Tensor, t: int) -> torch.Tensor:
        """[B, t, history + t], additive: causal, within the window, and only onto the history slots
        that row has filled (its last `seen` frames; zeros before a stream's first frame)."""
        window = self.config.sliding_window
        history = window - 1
        q_pos = torch.arange(history, history + t, device=seen.device)[:, None]
        k_pos = torch.arange(history + t, device=seen.device)[None, :]
        in_window = (k_pos <= q_pos) & (k_pos > q_pos - window)
        filled = k_pos >= (history - seen)[:, None, None]
        return torch.where(in_window & filled, 0.0, float("-inf"))


class DecoderCodebook(nn.Module):
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
        self._codebook = DecoderCodebook(size, dim)


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
        self.register_load_state_dict_post_hook(rederive_after_load)
        derive_unless_meta_(self)

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

    @property
    def device(self) -> torch.device:
        return self.quantizer.table.device

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


class StreamingDecoder:
    """One decoding stream: `decode_chunk(codes[n, 16])` -> exactly n * 1920 samples, and the
    concatenation over any chunking equals `SpeechTokenizer.decode` of all the codes."""

    def __init__(self, decoder: SpeechDecoder):
        self.decoder = decoder
        with torch.inference_mode():
            self.state = StreamState(decoder, batch_size=1)

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @torch.inference_mode()
    def prime(self, codes: torch.Tensor) -> None:
        """Feed context frames (e.g. the voice-clone reference codes) and emit nothing for them."""
        if len(codes):
            self.decoder(codes[None].to(self.device), self.state)

    @torch.inference_mode()
    def decode_chunk(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: LongTensor [n, 16] -> float32 waveform [n * 1920] (on the model's device)."""
        return self.decoder(codes[None].to(self.device), self.state)[0, 0].float()

    @torch.inference_mode()
    def reset(self) -> None:
        """Start a new stream, in place."""
        self.state.reset()


class MultiStreamDecoder:
    """Many decoding streams, one row of stored state each: `decode(row, codes, out)` loads the
    row's state into a one-stream working state, decodes n frames and stores the state back.
    Each row's audio over its calls equals `SpeechTokenizer.decode` of its codes; rows join
    (`reset_row`, from scratch or from a `primed_state`) and leave independently.

    One stream per call, in pieces of CALL_SIZES frames (a chunk of 13 is 8 + 4 + 1): a stream's
    audio then depends only on its own codes and chunk sizes, never on its neighbours or on when
    it was decoded, so the same request gives bit-identical audio alone or among others. (All
    rows in one call, one frame each, cost as much as one stream's 16-frame call: each row carries
    its own context through every layer.)

    `lanes` working states, each with its own graphs, can decode at the same time on different
    CUDA streams (a short call is a chain of ~700 small kernels that leaves most of the GPU idle).
    Any row may be decoded in any lane; the caller keeps the calls of one row in order.

    Batched lanes (`batch_lanes`, after the others): working states of `slots` streams that decode
    `slots` rows' chunks of BATCH_FRAMES frames in one call (`decode_batch`), padded with scratch
    rows where fewer are given. A call of 4 x 16 frames costs ~2.3x one of 16 frames on an H100, so
    under load a steady chunk costs about half the GPU time. A slot's arithmetic does not depend on
    the other slots or on its place among them (the convolutions and matmuls reduce each sample
    over its own stream's data, in an order fixed by the call's shape), so a chunk decoded in a
    batched call is the same whatever shares the call; it differs in the last bits from the same
    chunk decoded alone, so which chunks go to batched calls must depend on the request only.

    On CUDA with `use_cuda_graphs`, each piece size of each lane is one CUDA graph (captured by
    `capture`), the load and store of the rows included, replayed for any rows.
    """

    CALL_SIZES = (16, 8, 4, 2, 1)
    BATCH_FRAMES = CALL_SIZES[0]

    def __init__(self, decoder: SpeechDecoder, streams: int, use_cuda_graphs: bool = False, lanes: int = 1, batch_lanes: int = 0,
                 slots: int = 1):
        self.decoder, self.streams, self.lanes = decoder, streams, lanes
        self.batch_lanes, self.slots = (batch_lanes, slots) if slots > 1 else (0, 1)
        widths = [1] * lanes + [self.slots] * self.batch_lanes
        with torch.inference_mode():
            self.work = [StreamState(decoder, batch_size=width) for width in widths]
            # Rows [streams, streams + slots) are the padding slots' scratch state, never read as a stream.
            scratch = self.slots if self.batch_lanes else 0
            self.store = {dtype: torch.zeros(streams + scratch, t.shape[1], dtype=dtype, device=t.device) for dtype, t in self.work[0].flat.items()}
            self.row_in = [torch.zeros(width, dtype=torch.long, device=decoder.device) for width in widths]
        self.use_cuda_graphs = use_cuda_graphs and decoder.device.type == "cuda"
        self.graphs: dict[tuple[int, int, bool], tuple[CUDAGraphed, torch.Tensor]] = {}
        # A decoder whose output lags its input (Qwen3-Omni's code2wav) makes `lookahead` fewer
        # samples in a stream's first call; which rows have had theirs is known on the host.
        self.lookahead = getattr(decoder.config, "lookahead", 0)
        self.started = [False] * streams

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    def batched(self, lane: int) -> bool:
        return lane >= self.lanes

    @torch.inference_mode()
    def decode(self, row: int, codes: torch.Tensor, out: torch.Tensor, lane: int = 0) -> None:
        """codes: LongTensor [n, 16] (any device; pinned host memory copies without waiting) ->
        `out` [n * 1920] (float32, any device), the next n frames of `row`'s stream, decoded in `lane`."""
        if self.batched(lane):
            raise ValueError(f"Lane {lane} is batched: its calls go through decode_batch.")
        done, written = 0, 0
        for n in self.pieces(codes.shape[0]):
            first = self.lookahead > 0 and not self.started[row]
            graph, codes_in = self.graphs.get((lane, n, first)) or self.capture(n, lane, first)  # a capture moves row_in: set it after
            self.row_in[lane].fill_(row)
            codes_in[0].copy_(codes[done:done + n], non_blocking=True)
            samples = self._call_samples(n, first)
            out[written:written + samples].copy_(graph()[0], non_blocking=True)
            self.started[row] = True
            done, written = done + n, written + samples

    @torch.inference_mode()
    def decode_batch(self, rows: list[int], codes: list[torch.Tensor], outs: list[torch.Tensor], lane: int) -> None:
        """The next BATCH_FRAMES frames of each of `rows`' streams (codes [BATCH_FRAMES, 16] each, as
        `decode` takes them) into `outs` ([BATCH_FRAMES * 1920] each), in one call of batched `lane`."""
        if not self.batched(lane) or not 0 < len(rows) <= self.slots or len(set(rows)) != len(rows):
            raise ValueError(f"decode_batch takes 1 to {self.slots} distinct rows in a batched lane, got rows {rows} in lane {lane}.")
        if any(self.lookahead > 0 and not self.started[row] for row in rows) or any(len(c) != self.BATCH_FRAMES for c in codes):
            raise ValueError(f"decode_batch takes chunks of {self.BATCH_FRAMES} frames of streams past their first call.")
        graph, codes_in = self.graphs.get((lane, self.BATCH_FRAMES, False)) or self.capture(self.BATCH_FRAMES, lane)
        padding = range(self.streams, self.streams + self.slots - len(rows))
        for slot, row in enumerate([*rows, *padding]):  # fills, not a copy from the host: no wait for the lane's stream
            self.row_in[lane][slot].fill_(row)
        for slot, chunk in enumerate(codes):
            codes_in[slot].copy_(chunk, non_blocking=True)
        audio = graph()
        for slot, out in enumerate(outs):
            out.copy_(audio[slot], non_blocking=True)

    def output_samples(self, row: int, frames: int) -> int:
        """Samples that `decode(row, ...)` of `frames` frames writes now (before the call)."""
        return self._call_samples(frames, self.lookahead > 0 and not self.started[row])

    def _call_samples(self, frames: int, first: bool) -> int:
        return frames * self.decoder.config.upsample - (self.lookahead if first else 0)

    @classmethod
    def pieces(cls, frames: int) -> list[int]:
        """The call sizes a chunk of `frames` is decoded in (a fixed function of `frames`)."""
        sizes = []
        for size in cls.CALL_SIZES:
            while frames >= size:
                sizes.append(size)
                frames -= size
        return sizes

    def _decode_stored_row(self, codes_in: torch.Tensor, lane: int, first: bool) -> torch.Tensor:
        work, row_in = self.work[lane], self.row_in[lane]
        work.started = not first  # host side: chosen when the graph is captured
        for dtype, flat in work.flat.items():
            torch.index_select(self.store[dtype], 0, row_in, out=flat)
        audio = self.decoder(codes_in, work)[:, 0].float()
        for dtype, flat in work.flat.items():
            self.store[dtype].index_copy_(0, row_in, flat)
        return audio

    def captures(self) -> list[Callable[[], object]]:
        """The call of every size in every lane, stream's first call and later, and the batched lanes'
        one call, each to `capture` (at load)."""
        return [*(partial(self.capture, n, lane, first) for lane in range(self.lanes) for n in self.CALL_SIZES
                  for first in sorted({False, self.lookahead > 0})),
                *(partial(self.capture, self.BATCH_FRAMES, lane) for lane in range(self.lanes, self.lanes + self.batch_lanes))]

    @torch.inference_mode()
    def capture(self, frames: int, lane: int = 0, first: bool = False) -> tuple[CUDAGraphed, torch.Tensor]:
        """The call for `frames` frames in `lane` (`first`: a stream's first call, which differs where
        the decoder looks ahead), as a CUDA graph (captured now) where graphs are on. Capture runs
        the decoder for real on row 0, whose state is put back afterwards."""
        codes_in = torch.zeros(len(self.row_in[lane]), frames, self.decoder.config.num_quantizers, dtype=torch.long, device=self.device)
        graph = CUDAGraphed(lambda: self._decode_stored_row(codes_in, lane, first), self.use_cuda_graphs)
        if graph.enabled:
            self.row_in[lane].zero_()
            saved = {dtype: t[0].clone() for dtype, t in self.store.items()}
            graph.capture()
            for dtype, t in self.store.items():
                t[0].copy_(saved[dtype])
        self.graphs[(lane, frames, first)] = (graph, codes_in)
        return self.graphs[(lane, frames, first)]

    @torch.inference_mode()
    def reset_row(self, row: int, primed: list[torch.Tensor] | None = None) -> None:
        """Start a new stream in `row`: from scratch, or from a one-stream state (`primed_state`)."""
        self.started[row] = primed is not None
        if primed is None:
            for t in self.store.values():
                t[row].zero_()
            return
        # Checked before any copy, so a wrong state leaves the row as it was.
        if [tuple(v.shape) for v in primed] != [(1, t.shape[1]) for t in self.store.values()]:
            raise ValueError("reset_row needs a one-stream state of this model's decoder (primed_state)")
        for t, value in zip(self.store.values(), primed):
            t[row].copy_(value[0])

    @torch.inference_mode()
    def primed_state(self, codes: torch.Tensor) -> list[torch.Tensor]:
        """The one-stream state after decoding `codes` [frames, 16] without emitting them (e.g. a
        voice's reference codes): computed once per voice, loaded into any row."""
        stream = StreamingDecoder(self.decoder)
        stream.prime(codes)
        return stream.state.snapshot()

    @torch.inference_mode()
    def row_state(self, row: int) -> list[torch.Tensor]:
        """A copy of `row`'s stored state, as `primed_state` gives it."""
        return [t[row:row + 1].clone() for t in self.store.values()]
