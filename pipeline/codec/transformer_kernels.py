"""The codec's sliding-window transformer (`DecoderTransformer`) in Triton kernels, on CUDA.

A streaming call of the vocoder runs this transformer over 1 to 16 frames a stream. In PyTorch's
ops a layer is ~50 kernels (two RMSNorms, RoPE on q and on the window's keys, the window's
concatenation and history update, the mask, two batched matmuls and a softmax, three projections,
SiLU, two layer scales, two residual adds), each a few microseconds of launch and latency for a
few kilobytes of work: the transformer is most of the ~500 kernels of a one-frame call, which wait
for room on the SMs at each one when the decode step and other calls share the GPU. Here a layer is
five kernels:

1. input RMSNorm in the prologue of the fused q/k/v projection (`pipeline.kernels.decode.linear`);
2. `_window_attention_kernel`, one program per stream and KV head: RoPE on the queries and on
   the window's keys (the stored history, then the call's frames), the causal sliding-window mask
   over the history slots the stream has filled, the softmax, the values, and the history update
   (the window's last keys and values, before RoPE, as the PyTorch path stores them);
3. output projection, layer scale and residual add (`linear` in mode 1 with a scale);
4. post-attention RMSNorm, gate/up projection and SiLU(gate) * up (`linear` in mode 2);
5. down projection, layer scale and residual add.

Numerics are float32 throughout, every dot in 3xTF32 (float32 accuracy on the tensor cores, as the
vocoder's convolutions) and every rounding point where the PyTorch path has one; sums run in
another order than cuBLAS's, so results agree with the PyTorch path to float rounding. Each stream's arithmetic
depends only on its own frames and state, in an order fixed by the call's shape, so a stream's
audio does not depend on the other streams of a batched call.

A call of more than `FUSED_FRAMES` frames (offline decoding) runs the layers over pieces of that
many frames in turn, each piece attending to the ones before it through the stream state, as
streaming in chunks does: RoPE at chunk-relative positions (`SlidingWindowAttention`) makes that
the same computation.
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from pipeline.ahead import launch
from pipeline.kernels import fused_available, workspace_of
from pipeline.kernels.config import KernelConfig, Tiles

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

if TYPE_CHECKING:  # pipeline.codec.decoder imports this module
    from pipeline.codec.decoder import DecoderLayer, DecoderTransformer
    from pipeline.codec.streaming import StreamState
    from pipeline.kernels.decode import Workspace

FUSED_FRAMES = 16  # frames of a stream per pass through the layers: the largest vocoder call
BLOCK_T = 16  # query rows of an attention program (tl.dot's smallest tile): FUSED_FRAMES fit one
ATTENTION_WARPS = 8  # the window's rotated keys and values stay in registers (4 warps spill them)
# The projections' tiles: 16-row blocks (every launch of `linear`), 32 columns (96 programs for the
# 512 x 1536 q/k/v weight); 16 or 64 columns were within 0.1 ms a vocoder call of it on an H200.
CODEC_TILES = Tiles(block_n=32, block_k=64, num_warps=4, num_stages=2)
# Every dot in 3xTF32 on the tensor cores, as the vocoder's convolutions (pipeline.codec.convolution):
# float32 accuracy; exact float32 products ("ieee") run on the CUDA cores.
CODEC_PRECISION = "tf32x3"


def transformer_kernels_available(x: torch.Tensor) -> bool:
    """Whether the transformer runs here for `x`: float32 activations where the fused kernels run
    (`pipeline.kernels.fused_available`); Triton's interpreter runs them anywhere, for the tests."""
    return triton is not None and x.dtype == torch.float32 and fused_available(x.device)


@lru_cache(maxsize=None)
def _config(device: torch.device) -> KernelConfig:
    return KernelConfig.for_device(device)


def fused_transformer(module: "DecoderTransformer", x: torch.Tensor, state: "StreamState") -> torch.Tensor:
    """`module`'s forward (x [B, T, latent_dim] -> [B, T, latent_dim]) in these kernels; the stream
    state (each layer's history, the frames seen) advanced as the PyTorch path advances it."""
    from pipeline.kernels.decode import linear

    batch, frames, _ = x.shape
    # The split-K workspace `linear` takes: CODEC_TILES never split, so the vocoder's lanes, which run at
    # once on their streams, share the transformer's without touching it.
    workspace = workspace_of(module)
    h = module.input_proj(x).reshape(batch * frames, module.config.hidden_size)
    if h.data_ptr() == x.data_ptr():
        h = h.clone()  # the residual stream is updated in place; the caller's x is not
    if frames <= FUSED_FRAMES:
        _layers(module, h, batch, frames, state, workspace)
    else:
        pieces = []
        for start in range(0, frames, FUSED_FRAMES):
            piece = h.view(batch, frames, -1)[:, start:start + FUSED_FRAMES].contiguous().view(-1, h.shape[1])
            _layers(module, piece, batch, piece.shape[0] // batch, state, workspace)
            pieces.append(piece.view(batch, -1, h.shape[1]))
        h = torch.cat(pieces, dim=1).view(batch * frames, -1)
    if isinstance(module.output_proj, torch.nn.Linear):
        out = torch.empty(batch * frames, module.output_proj.out_features, dtype=h.dtype, device=h.device)
        linear(h, module.output_proj.weight, out, workspace, _config(h.device), norm=module.norm, bias=module.output_proj.bias,
               shape=CODEC_TILES, precision=CODEC_PRECISION)
        return out.view(batch, frames, -1)
    return module.output_proj(module.norm(h)).view(batch, frames, -1)


def _layers(module: "DecoderTransformer", h: torch.Tensor, batch: int, frames: int, state: "StreamState", workspace: "Workspace") -> None:
    """Every layer over the residual stream h [batch * frames, hidden] in place, then `frames` more seen."""
    seen = state[module]
    for layer in module.layers:
        _layer(layer, h, batch, frames, seen, module.rope_cos, module.rope_sin, state, workspace)
    state.update(seen, seen + frames)


def _layer(layer: "DecoderLayer", h: torch.Tensor, batch: int, frames: int, seen: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           state: "StreamState", workspace: "Workspace") -> None:
    from pipeline.kernels.decode import linear

    attn, mlp = layer.self_attn, layer.mlp
    config = _config(h.device)
    rows = h.shape[0]
    qkv = torch.empty(rows, attn.qkv_weight.shape[0], dtype=h.dtype, device=h.device)
    linear(h, attn.qkv_weight, qkv, workspace, config, norm=layer.input_layernorm, bias=attn.qkv_bias, shape=CODEC_TILES, precision=CODEC_PRECISION)
    attended = torch.empty(rows, attn.heads * attn.head_dim, dtype=h.dtype, device=h.device)
    window_attention(attn, qkv, state, seen, cos, sin, attended, batch, frames, config)
    linear(attended, attn.o_proj.weight, h, workspace, config, mode=1, residual=h, bias=attn.o_proj.bias,
           scale=layer.self_attn_layer_scale.scale, shape=CODEC_TILES, precision=CODEC_PRECISION)
    gated = torch.empty(rows, mlp.down_proj.weight.shape[1], dtype=h.dtype, device=h.device)
    linear(h, mlp.gate_up_weight, gated, workspace, config, norm=layer.post_attention_layernorm, mode=2, shape=CODEC_TILES, precision=CODEC_PRECISION)
    linear(gated, mlp.down_proj.weight, h, workspace, config, mode=1, residual=h, scale=layer.mlp_layer_scale.scale, shape=CODEC_TILES, precision=CODEC_PRECISION)


def window_attention(attn: torch.nn.Module, qkv: torch.Tensor, state: "StreamState", seen: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     out: torch.Tensor, batch: int, frames: int, config: KernelConfig) -> None:
    """out [batch * frames, heads * head_dim]: each stream's queries (in qkv [batch * frames, (heads +
    2 kv_heads) * head_dim]) over its window; the layer's stored history advanced by `frames`."""
    from pipeline.kernels.decode import launch_options

    if frames > BLOCK_T:
        raise ValueError(f"window_attention takes at most {BLOCK_T} frames a call, got {frames}")
    k_tail, v_tail = state[attn]
    assert k_tail.stride()[1:] == (attn.history * attn.head_dim, attn.head_dim, 1) and k_tail.stride() == v_tail.stride()
    half = attn.head_dim // 2
    launch(_window_attention_kernel, (batch, attn.kv_heads), qkv, k_tail, v_tail, k_tail.stride(0), seen, seen.stride(0), cos, sin, out, frames,
           attn.scale, HISTORY=attn.history, HEADS=attn.heads, KV_HEADS=attn.kv_heads, HEAD_DIM=attn.head_dim,
           HALF_BLOCK=max(16, triton.next_power_of_2(half)), DIM_BLOCK=max(16, triton.next_power_of_2(attn.head_dim)),
           BLOCK_T=BLOCK_T, BLOCK_S=max(16, triton.next_power_of_2(attn.history + BLOCK_T)), PRECISION=CODEC_PRECISION,
           num_warps=ATTENTION_WARPS, **launch_options(config, qkv.device))


if triton is not None:
    from pipeline.kernels.decode import wait_for_inputs

    @triton.jit
    def _window_columns(tail_ptr, qkv_ptr, tail_base, new_row, col, offs_s, offs_c, width, from_tail, from_new, QKV: tl.constexpr,
                        HEAD_DIM: tl.constexpr):
        """Columns offs_c (< width) of a head's keys or values at window slots offs_s: the stored
        history for the first slots, the call's frames (rows new_row of qkv, from column col) after them."""
        c_mask = offs_c[None, :] < width
        stored = tl.load(tail_ptr + tail_base + offs_s[:, None] * HEAD_DIM + offs_c[None, :], mask=from_tail[:, None] & c_mask, other=0.0)
        new = tl.load(qkv_ptr + new_row[:, None] * QKV + col + offs_c[None, :], mask=from_new[:, None] & c_mask, other=0.0)
        return tl.where(from_tail[:, None], stored, new)

    @triton.jit
    def _rotate(first, second, cos_ptr, sin_ptr, positions, offs_h, mask, HEAD_DIM: tl.constexpr):
        """RoPE of a head's two halves at `positions` (rotate_half pairs): (x1 cos - x2 sin, x2 cos + x1 sin)."""
        table = positions[:, None] * HEAD_DIM + offs_h[None, :]
        cos = tl.load(cos_ptr + table, mask=mask, other=0.0)
        sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
        return first * cos - second * sin, second * cos + first * sin

    @triton.jit
    def _window_attention_kernel(qkv_ptr, k_tail_ptr, v_tail_ptr, tail_stride, seen_ptr, seen_stride, cos_ptr, sin_ptr, out_ptr, T, scale,
                                 HISTORY: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                                 HALF_BLOCK: tl.constexpr, DIM_BLOCK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                                 PRECISION: tl.constexpr, OVERLAP: tl.constexpr):
        """Program (stream b, KV head): its query heads over the window [history | the call's T frames]
        (slot s is chunk-relative position s, query t is position HISTORY + t), then the history
        advanced: slots [T, T + HISTORY) of the window, before RoPE, become the stored history."""
        b, kv_head = tl.program_id(0), tl.program_id(1)
        wait_for_inputs(OVERLAP)
        HALF: tl.constexpr = HEAD_DIM // 2
        GROUP: tl.constexpr = HEADS // KV_HEADS
        QKV: tl.constexpr = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        offs_s = tl.arange(0, BLOCK_S)
        offs_t = tl.arange(0, BLOCK_T)
        offs_h = tl.arange(0, HALF_BLOCK)
        offs_d = tl.arange(0, DIM_BLOCK)
        from_tail = offs_s < HISTORY
        from_new = (offs_s >= HISTORY) & (offs_s < HISTORY + T)
        new_row = b * T + offs_s - HISTORY
        tail_base = b * tail_stride + kv_head * HISTORY * HEAD_DIM
        k_col = HEADS * HEAD_DIM + kv_head * HEAD_DIM
        k1 = _window_columns(k_tail_ptr, qkv_ptr, tail_base, new_row, k_col, offs_s, offs_h, HALF, from_tail, from_new, QKV, HEAD_DIM)
        k2 = _window_columns(k_tail_ptr + HALF, qkv_ptr, tail_base, new_row, k_col + HALF, offs_s, offs_h, HALF, from_tail, from_new, QKV, HEAD_DIM)
        v = _window_columns(v_tail_ptr, qkv_ptr, tail_base, new_row, k_col + KV_HEADS * HEAD_DIM, offs_s, offs_d, HEAD_DIM, from_tail, from_new,
                            QKV, HEAD_DIM)
        key_mask = (offs_s[:, None] < HISTORY + T) & (offs_h[None, :] < HALF)
        k1, k2 = _rotate(k1, k2, cos_ptr, sin_ptr, offs_s, offs_h, key_mask, HEAD_DIM)

        # Causal, within the window (the query's own slot and the HISTORY before it), and only onto the
        # history slots this stream has filled (its last `seen` frames).
        seen = tl.load(seen_ptr + b * seen_stride)
        q_pos = HISTORY + offs_t
        visible = ((offs_s[None, :] <= q_pos[:, None]) & (offs_s[None, :] >= q_pos[:, None] - HISTORY)
                   & (offs_s[None, :] >= HISTORY - seen))
        q_mask = (offs_t[:, None] < T) & (offs_h[None, :] < HALF)
        q_rows = (b * T + offs_t)[:, None] * QKV
        for g in tl.static_range(GROUP):
            head = kv_head * GROUP + g
            q1 = tl.load(qkv_ptr + q_rows + head * HEAD_DIM + offs_h[None, :], mask=q_mask, other=0.0)
            q2 = tl.load(qkv_ptr + q_rows + head * HEAD_DIM + HALF + offs_h[None, :], mask=q_mask, other=0.0)
            q1, q2 = _rotate(q1, q2, cos_ptr, sin_ptr, q_pos, offs_h, q_mask, HEAD_DIM)
            scores = tl.dot(q1, tl.trans(k1), input_precision=PRECISION) + tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
            scores = tl.where(visible, scores * scale, float("-inf"))
            weights = tl.exp(scores - tl.max(scores, axis=1)[:, None])
            probs = weights / tl.sum(weights, axis=1)[:, None]
            values = tl.dot(probs, v, input_precision=PRECISION)
            out_mask = (offs_t[:, None] < T) & (offs_d[None, :] < HEAD_DIM)
            tl.store(out_ptr + (b * T + offs_t)[:, None] * (HEADS * HEAD_DIM) + head * HEAD_DIM + offs_d[None, :], values, mask=out_mask)

        # The keys again before RoPE (not held through the attention: registers), then every thread's
        # read of the stored history done before it is overwritten.
        k1 = _window_columns(k_tail_ptr, qkv_ptr, tail_base, new_row, k_col, offs_s, offs_h, HALF, from_tail, from_new, QKV, HEAD_DIM)
        k2 = _window_columns(k_tail_ptr + HALF, qkv_ptr, tail_base, new_row, k_col + HALF, offs_s, offs_h, HALF, from_tail, from_new, QKV, HEAD_DIM)
        tl.debug_barrier()
        kept = (offs_s >= T) & (offs_s < T + HISTORY)
        slots = tail_base + (offs_s - T)[:, None] * HEAD_DIM
        half_mask = kept[:, None] & (offs_h[None, :] < HALF)
        tl.store(k_tail_ptr + slots + offs_h[None, :], k1, mask=half_mask)
        tl.store(k_tail_ptr + slots + HALF + offs_h[None, :], k2, mask=half_mask)
        tl.store(v_tail_ptr + slots + offs_d[None, :], v, mask=kept[:, None] & (offs_d[None, :] < HEAD_DIM))
