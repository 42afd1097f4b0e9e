"""The vocoder's residual unit, x + conv1x1(snake(conv7(snake(x)))), in three Triton kernels on CUDA.

The residual units are ~80% of the vocoder's arithmetic (12 per decoder, 7-tap dilated convolutions
of 96 to 768 channels over up to 24,000 samples per second of audio). In PyTorch's ops a unit is
about ten kernels: SnakeBeta, the concatenation of the stream's history, the history update, a
float32 cuDNN convolution (SIMT: Hopper's tensor cores do not run float32), a second SnakeBeta, the
1x1 convolution and the residual add. Here it is three, plus the history update:

1. `_snake_history_kernel`: [stored history | snake(x)] in one channels-last buffer (the
   convolution's input);
2. `_conv_kernel` with 7 taps: the dilated convolution, its bias and the second SnakeBeta in the
   epilogue (channels-last out);
3. `_conv_kernel` with 1 tap: the 1x1 convolution, its bias and the residual add in the epilogue
   (channels-first out, as the next layer takes it).

The convolutions are implicit GEMMs on the tensor cores in 3xTF32 (each float32 operand split into
a TF32 high part and a TF32 remainder; three products): float32 accuracy at tensor-core speed
(measured on an H100 at the real size: 6.6e-7 from PyTorch's float32 convolutions), not the
10-bit mantissa of plain TF32 (9.6e-5 there). Tensor cores take float32 operands only with the
reduction (channel) dimension contiguous, hence channels-last activations inside the unit.
Every output sample sums its input-channel blocks and taps in one fixed order, whatever the call's
length; the vocoder's other layers (cuDNN's) round differently for calls of different lengths, so a
stream stays within ~2e-6 of its offline decode, as before, and is bit-identical run to run.
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

# Tiles from a sweep on an H100 (docs/BENCHMARKS.md, "the vocoder's residual units in Triton"): 16-frame call 4.35 ms,
# one-frame call 2.49 ms (PyTorch's ops: 5.46 / 3.20); 128-sample or 64-channel tiles were no faster.
BLOCK_CO = 32  # output channels per program
BLOCK_CI = 32  # input channels per step of the reduction
BLOCK_T = 64  # samples per program, at most
HISTORY_BLOCK = 32
TARGET_PROGRAMS = 264  # two per SM of an H100/H200: the time tile shrinks until a call has this many
PRECISION = "tf32x3"  # Triton's name for the split-TF32 dots


def fused_residual_available(x: torch.Tensor) -> bool:
    """Whether `residual_unit` runs for `x`: float32 activations where the fused decode kernels run
    (`pipeline.kernels.fused_available`: a CUDA GPU of compute capability 8.0 or newer, with TF32
    tensor cores, and Triton; an older GPU, e.g. a T4 Space, keeps PyTorch's ops). Triton's
    interpreter runs it anywhere, for the tests."""
    return x.dtype == torch.float32 and fused_available(x.device)


def residual_unit(unit: "ResidualUnit", x: torch.Tensor, state: "StreamState") -> torch.Tensor:
    """`unit` (a codec ResidualUnit) applied to x [B, C, T], advancing its stream state in `state`
    exactly as the module's own forward does (the stored history is conv1's input, snake(x)).

    The convolutions read channels-last activations ([B, T, C]: a tap's tile is then contiguous,
    and the tensor cores take float32 operands only with the reduction dimension contiguous)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    batch, channels, length = x.shape
    conv1 = unit.conv1
    context = conv1.context  # a 7-tap convolution: context > 0
    history = state[conv1]  # [B, C, context], channels first as the module keeps it
    window = torch.empty(batch, context + length, channels, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(context + length, HISTORY_BLOCK), triton.cdiv(channels, HISTORY_BLOCK), batch)
    launch(_snake_history_kernel, grid, x, history, unit.act1.alpha_exp, unit.act1.inv_beta, window, channels, length, context,
                                x.stride(0), x.stride(1), history.stride(0), BLOCK=HISTORY_BLOCK)
    state.update(history, window[:, length:].transpose(1, 2))
    hidden = _convolve(window, unit.conv1_taps, conv1.conv.bias, conv1.conv.dilation[0], length, snake=unit.act2)
    return _convolve(hidden, unit.conv2_taps, unit.conv2.conv.bias, 1, length, residual=x)


def _convolve(window: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor, dilation: int, length: int,
              snake: "SnakeBeta | None" = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """out[b, t, o] = bias[o] + sum_k,i taps[k, o, i] * window[b, t + k * dilation, i], for t < `length`
    (window channels-last), then SnakeBeta (`snake`'s parameters; out channels-last) or
    + residual[b, o, t] (out channels-first, [B, C, T] as the next layer takes it)."""
    n_taps, out_channels, in_channels = taps.shape
    batch = window.shape[0]
    shape = (batch, length, out_channels) if residual is None else (batch, out_channels, length)
    out = torch.empty(shape, device=window.device, dtype=window.dtype)
    block_t = _time_block(length, triton.cdiv(out_channels, BLOCK_CO) * batch)
    grid = (triton.cdiv(length, block_t), triton.cdiv(out_channels, BLOCK_CO), batch)
    # The kernel takes every pointer; those of an epilogue it does not run are never read.
    alpha, inv_beta = (snake.alpha_exp, snake.inv_beta) if snake is not None else (bias, bias)
    res = residual if residual is not None else out
    launch(_conv_kernel, grid, window, taps, bias, alpha, inv_beta, res, out, in_channels, out_channels, window.shape[1], length, dilation,
                       res.stride(0), res.stride(1),
                       TAPS=n_taps, SNAKE=snake is not None, RESIDUAL=residual is not None, PRECISION=PRECISION,
                       BLOCK_T=block_t, BLOCK_CO=BLOCK_CO, BLOCK_CI=BLOCK_CI, num_warps=4, num_stages=3)
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
    def _snake_history_kernel(x_ptr, history_ptr, alpha_ptr, inv_beta_ptr, out_ptr, channels, length, context,
                              x_stride_b, x_stride_c, history_stride_b, BLOCK: tl.constexpr):
        """out[b, j, c] = history[b, c, j] for j < context, else snake(x[b, c, j - context]): one
        [BLOCK, BLOCK] tile of the channels-last window per program."""
        offs_j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        offs_c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        b = tl.program_id(2)
        c_mask = offs_c < channels
        from_history = offs_j < context
        inside = (offs_j < context + length)[:, None] & c_mask[None, :]
        kept = tl.load(history_ptr + b * history_stride_b + offs_c[None, :] * context + offs_j[:, None],
                       mask=inside & from_history[:, None], other=0.0)
        x = tl.load(x_ptr + b * x_stride_b + offs_c[None, :] * x_stride_c + (offs_j - context)[:, None],
                    mask=inside & ~from_history[:, None], other=0.0)
        s = tl.sin(x * tl.load(alpha_ptr + offs_c, mask=c_mask, other=0.0)[None, :])
        y = tl.where(from_history[:, None], kept, x + tl.load(inv_beta_ptr + offs_c, mask=c_mask, other=0.0)[None, :] * (s * s))
        tl.store(out_ptr + b * (context + length) * channels + offs_j[:, None] * channels + offs_c[None, :], y, mask=inside)

    @triton.jit
    def _conv_kernel(x_ptr, w_ptr, bias_ptr, alpha_ptr, inv_beta_ptr, res_ptr, out_ptr, in_channels, out_channels, x_length, length,
                     dilation, res_stride_b, res_stride_c, TAPS: tl.constexpr, SNAKE: tl.constexpr, RESIDUAL: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_CO: tl.constexpr, BLOCK_CI: tl.constexpr):
        """One [BLOCK_T, BLOCK_CO] tile of a dilated convolution of a channels-last window [B, x_length, Ci]."""
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
        if RESIDUAL:  # channels-first output
            acc = tl.load(res_ptr + b * res_stride_b + offs_o[None, :] * res_stride_c + offs_t[:, None], mask=mask, other=0.0) + acc
            tl.store(out_ptr + b * out_channels * length + offs_o[None, :] * length + offs_t[:, None], acc, mask=mask)
        else:
            tl.store(out_ptr + b * length * out_channels + offs_t[:, None] * out_channels + offs_o[None, :], acc, mask=mask)
