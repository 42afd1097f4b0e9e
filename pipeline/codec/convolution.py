"""The vocoder's convolutions as Triton implicit GEMMs on the tensor cores, on CUDA.

Every dense convolution of the codec decoder and of Qwen3-Omni's code2wav runs here: the residual
units (x + conv1x1(snake(conv7(snake(x)))), ~80% of the vocoder's arithmetic), the transposed
convolutions that upsample, and the plain causal convolutions at either end. The ConvNeXt blocks'
depthwise convolutions stay PyTorch's. In
PyTorch's ops each is a concatenation of the stream's history, a history update and a float32
cuDNN convolution (SIMT: Hopper's tensor cores do not run float32; a transposed one in a slow
`dgrad` kernel); a residual unit is about ten kernels. Here a layer is:

1. `_window_kernel`: [stored history | x] in one channels-last buffer (the convolution's input),
   through a SnakeBeta where the layer starts with one (the residual unit's first);
2. `_conv_kernel`: the convolution, its bias and then a SnakeBeta (the residual unit's second) or
   a residual add (its end) in the epilogue, channels-last out.

A residual unit is three such kernels plus the history update. A transposed convolution of stride
s and kernel k (a multiple of s) is a convolution of k / s taps whose s x out_channels outputs are the
s phases of each input step's output (`transposed_taps`): its channels-last output [B, T, s x C] is
the upsampled [B, T x s, C], with no reordering. Where the kernels run, each layer keeps its weight
in that tap-major form only, the checkpoint's parameter a view of it (`conv_weight`,
`transposed_weight`): no second copy.

The convolutions run in 3xTF32 (each float32 operand split into a TF32 high part and a TF32
remainder; three products): float32 accuracy at tensor-core speed (a whole decode at the real size
on an H200: 2.3e-6 from PyTorch's float32 ops), not the 10-bit mantissa of plain TF32 (9.2e-5 there).
Tensor cores take float32 operands only with the reduction (channel) dimension contiguous, hence
channels-last activations: each layer returns its output as a [B, C, T] view of a
channels-last buffer, and reads its input in either layout. Every output sample sums its
input-channel blocks and taps in one fixed order, whatever the call's length, so these layers
round the same in a stream's chunks as in one offline call.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipeline.ahead import launch
from pipeline.kernels import fused_available

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

if TYPE_CHECKING:  # pipeline.codec.decoder imports this module
    from pipeline.codec.decoder import ResidualUnit, SnakeBeta
    from pipeline.codec.streaming import StreamState

# Tiles from sweeps on an H100 and an H200 (docs/notebook/benchmarks-history.md, "the vocoder's residual units in
# Triton", "the vocoder's other convolutions in Triton"): one stream's calls are fastest in 64 x 32 tiles (128-sample or 64-channel ones 1-7% slower);
# calls of several streams (the batched lanes') in 64 x 64 tiles, 7% faster for 4 streams, 10% for 16.
BLOCK_CO = 32  # output channels per program, one stream's calls
WIDE_BLOCK_CO = 64  # output channels per program, calls of several streams
BLOCK_CI = 32  # input channels per step of the reduction
BLOCK_T = 64  # samples per program, at most
HISTORY_BLOCK = 32
TARGET_PROGRAMS = 264  # two per SM of an H100/H200: the time tile shrinks until a call has this many
PRECISION = "tf32x3"  # Triton's name for the split-TF32 dots


def fused_convolutions_available(x: torch.Tensor) -> bool:
    """Whether the layers convolve `x` here: float32 activations where the fused decode kernels run
    (`pipeline.kernels.fused_available`: a CUDA GPU of compute capability 8.0 or newer, with TF32
    tensor cores, and Triton; an older GPU, e.g. a T4 Space, keeps PyTorch's ops). Triton's
    interpreter runs them anywhere, for the tests."""
    return x.dtype == torch.float32 and fused_available(x.device)


def conv_taps(weight: torch.Tensor) -> torch.Tensor:
    """A Conv1d weight [out, in, k] tap-major, as `_conv_kernel` reads it: [k, out, in] (a copy)."""
    return weight.detach().permute(2, 0, 1).contiguous()


def conv_weight(taps: torch.Tensor) -> torch.Tensor:
    """The Conv1d weight [out, in, k] that `taps` holds, as a view of it."""
    return taps.permute(1, 2, 0)


def transposed_taps(weight: torch.Tensor, stride: int) -> torch.Tensor:
    """A ConvTranspose1d weight [in, out, k], k a multiple of `stride`, as the taps of a convolution
    over its input steps, newest input first: [k / stride, stride x out, in] (a copy). Output phase r
    (sample t x stride + r) of input step t takes kernel tap r + j x stride from input t - j: tap j."""
    in_channels, out_channels, kernel = weight.shape
    taps = weight.detach().view(in_channels, out_channels, kernel // stride, stride).permute(2, 3, 1, 0)
    return taps.reshape(kernel // stride, stride * out_channels, in_channels).contiguous()


def transposed_weight(taps: torch.Tensor, stride: int) -> torch.Tensor:
    """The ConvTranspose1d weight [in, out, k] that `taps` holds, as a view of it."""
    n_taps, phases, in_channels = taps.shape
    out_channels = phases // stride
    return taps.view(n_taps, stride, out_channels, in_channels).permute(3, 2, 0, 1).view(in_channels, out_channels, n_taps * stride)


def causal_conv(x: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor, dilation: int, history: torch.Tensor | None,
                state: "StreamState") -> torch.Tensor:
    """A stride-1 causal convolution (taps [k, out, in]) of x [B, in, T], its left context the
    stream's `history` ([B, in, context], advanced in place; None for a 1-tap convolution): [B, out, T]."""
    window = _window(x, history, state)
    return _convolve(window, taps, bias, dilation, x.shape[2]).transpose(1, 2)


def transposed_conv(x: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor, stride: int, history: torch.Tensor | None,
                    state: "StreamState") -> torch.Tensor:
    """A causal transposed convolution (`transposed_taps`, its bias repeated for each of the `stride`
    phases) of x [B, in, T]: [B, out, T x stride]."""
    batch, _, length = x.shape
    window = _window(x, history, state)
    out = _convolve(window, taps, bias, 1, length, newest_first=True)  # [B, T, stride x out]
    return out.view(batch, length * stride, -1).transpose(1, 2)


def residual_unit(unit: "ResidualUnit", x: torch.Tensor, state: "StreamState") -> torch.Tensor:
    """`unit` (a codec ResidualUnit) applied to x [B, C, T], advancing its stream state in `state`
    exactly as the module's own forward does (the stored history is conv1's input, snake(x))."""
    conv1, conv2 = unit.conv1, unit.conv2
    window = _window(x, state[conv1], state, snake=unit.act1)  # a 7-tap convolution: it has a history
    hidden = _convolve(window, conv1.taps, conv1.conv.bias, conv1.conv.dilation[0], x.shape[2], snake=unit.act2)
    return _convolve(hidden, conv2.taps, conv2.conv.bias, 1, x.shape[2], residual=x).transpose(1, 2)


def _window(x: torch.Tensor, history: torch.Tensor | None, state: "StreamState", snake: "SnakeBeta | None" = None) -> torch.Tensor:
    """[history | snake(x)] channels-last, [B, context + T, C] (the convolution's input), and the
    window's last `context` steps stored as the new history."""
    batch, channels, length = x.shape
    context = 0 if history is None else history.shape[2]
    window = torch.empty(batch, context + length, channels, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(context + length, HISTORY_BLOCK), triton.cdiv(channels, HISTORY_BLOCK), batch)
    # The kernel takes every pointer; those of a part it does not run are never read.
    kept = history if history is not None else x
    alpha, inv_beta = (snake.alpha_exp, snake.inv_beta) if snake is not None else (x, x)
    launch(_window_kernel, grid, x, kept, alpha, inv_beta, window, channels, length, context,
           x.stride(0), x.stride(1), x.stride(2), kept.stride(0), SNAKE=snake is not None, BLOCK=HISTORY_BLOCK)
    if history is not None:
        state.update(history, window[:, length:].transpose(1, 2))
    return window


def _convolve(window: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor, dilation: int, length: int,
              snake: "SnakeBeta | None" = None, residual: torch.Tensor | None = None, newest_first: bool = False) -> torch.Tensor:
    """out[b, t, o] = bias[o] + sum_k,i taps[k, o, i] * window[b, t + k * dilation, i], for t < `length`
    (window and out channels-last), then SnakeBeta (`snake`'s parameters) or + residual[b, o, t].
    `newest_first`: tap k reads window[b, t + (taps - 1 - k) * dilation] instead."""
    n_taps, out_channels, in_channels = taps.shape
    batch, window_length = window.shape[:2]
    if newest_first:  # the kernel walks the window backwards from its last tap's step
        window, dilation = window[:, (n_taps - 1) * dilation:], -dilation
    out = torch.empty(batch, length, out_channels, device=window.device, dtype=window.dtype)
    block_co = WIDE_BLOCK_CO if batch > 1 else BLOCK_CO
    block_t = _time_block(length, triton.cdiv(out_channels, block_co) * batch)
    grid = (triton.cdiv(length, block_t), triton.cdiv(out_channels, block_co), batch)
    alpha, inv_beta = (snake.alpha_exp, snake.inv_beta) if snake is not None else (bias, bias)
    res = residual if residual is not None else out.transpose(1, 2)
    launch(_conv_kernel, grid, window, taps, bias, alpha, inv_beta, res, out, in_channels, out_channels, window_length, length, dilation,
           res.stride(0), res.stride(1), res.stride(2),
           TAPS=n_taps, SNAKE=snake is not None, RESIDUAL=residual is not None, PRECISION=PRECISION,
           BLOCK_T=block_t, BLOCK_CO=block_co, BLOCK_CI=BLOCK_CI, num_warps=4, num_stages=3)
    return out


def _time_block(length: int, other_programs: int) -> int:
    """The widest time tile, up to BLOCK_T, that still gives the call TARGET_PROGRAMS programs: long
    calls in wide tiles, a one-frame call spread over the SMs."""
    block = BLOCK_T
    while block > 32 and triton.cdiv(length, block) * other_programs < TARGET_PROGRAMS:
        block //= 2
    return block


if triton is not None:

    @triton.jit
    def _window_kernel(x_ptr, history_ptr, alpha_ptr, inv_beta_ptr, out_ptr, channels, length, context,
                       x_stride_b, x_stride_c, x_stride_t, history_stride_b, SNAKE: tl.constexpr, BLOCK: tl.constexpr):
        """out[b, j, c] = history[b, c, j] for j < context, else (snake of) x[b, c, j - context]: one
        [BLOCK, BLOCK] tile of the channels-last window per program."""
        offs_j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        offs_c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        b = tl.program_id(2)
        c_mask = offs_c < channels
        from_history = offs_j < context
        inside = (offs_j < context + length)[:, None] & c_mask[None, :]
        kept = tl.load(history_ptr + b * history_stride_b + offs_c[None, :] * context + offs_j[:, None],
                       mask=inside & from_history[:, None], other=0.0)
        x = tl.load(x_ptr + b * x_stride_b + offs_c[None, :] * x_stride_c + (offs_j - context)[:, None] * x_stride_t,
                    mask=inside & ~from_history[:, None], other=0.0)
        if SNAKE:
            s = tl.sin(x * tl.load(alpha_ptr + offs_c, mask=c_mask, other=0.0)[None, :])
            x = x + tl.load(inv_beta_ptr + offs_c, mask=c_mask, other=0.0)[None, :] * (s * s)
        y = tl.where(from_history[:, None], kept, x)
        tl.store(out_ptr + b * (context + length) * channels + offs_j[:, None] * channels + offs_c[None, :], y, mask=inside)

    @triton.jit
    def _conv_kernel(x_ptr, w_ptr, bias_ptr, alpha_ptr, inv_beta_ptr, res_ptr, out_ptr, in_channels, out_channels, x_length, length,
                     dilation, res_stride_b, res_stride_c, res_stride_t, TAPS: tl.constexpr, SNAKE: tl.constexpr,
                     RESIDUAL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_CO: tl.constexpr,
                     BLOCK_CI: tl.constexpr):
        """One [BLOCK_T, BLOCK_CO] tile of a dilated convolution of a channels-last window [B, x_length, Ci]
        (x_ptr at its step 0 of batch 0; a negative dilation reads the taps' steps backwards)."""
        offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_o = tl.program_id(1) * BLOCK_CO + tl.arange(0, BLOCK_CO)
        b = tl.program_id(2)
        t_mask, o_mask = offs_t < length, offs_o < out_channels
        x_base = x_ptr + b * x_length * in_channels
        acc = tl.zeros([BLOCK_T, BLOCK_CO], dtype=tl.float32)
        # One loop over (input-channel block, tap), so that the pipeline keeps two loads in flight.
        for step in range(tl.cdiv(in_channels, BLOCK_CI) * TAPS):
            tap = step % TAPS
            offs_i = (step // TAPS) * BLOCK_CI + tl.arange(0, BLOCK_CI)
            i_mask = offs_i < in_channels
            x = tl.load(x_base + (offs_t[:, None] + tap * dilation) * in_channels + offs_i[None, :],
                        mask=t_mask[:, None] & i_mask[None, :], other=0.0)
            w = tl.load(w_ptr + tap * out_channels * in_channels + offs_o[None, :] * in_channels + offs_i[:, None],
                        mask=i_mask[:, None] & o_mask[None, :], other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        acc += tl.load(bias_ptr + offs_o, mask=o_mask, other=0.0)[None, :]
        mask = t_mask[:, None] & o_mask[None, :]
        if SNAKE:
            s = tl.sin(acc * tl.load(alpha_ptr + offs_o, mask=o_mask, other=0.0)[None, :])
            acc = acc + tl.load(inv_beta_ptr + offs_o, mask=o_mask, other=0.0)[None, :] * (s * s)
        if RESIDUAL:
            acc = tl.load(res_ptr + b * res_stride_b + offs_o[None, :] * res_stride_c + offs_t[:, None] * res_stride_t,
                          mask=mask, other=0.0) + acc
        tl.store(out_ptr + b * length * out_channels + offs_t[:, None] * out_channels + offs_o[None, :], acc, mask=mask)
