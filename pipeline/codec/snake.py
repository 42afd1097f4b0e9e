"""SnakeBeta, x + 1/(exp(beta) + 1e-9) * sin(x * exp(alpha))^2 per channel, as one CUDA kernel.

In PyTorch's ops it is five kernels over the whole activation (the largest tensors of the vocoder,
up to 96 channels x 24,000 samples per second of audio), and the vocoder applies it 30 times:
one pass instead of five saves 8% of a 16-frame vocoder call on an H200 (docs/BENCHMARKS.md).
Triton ships with PyTorch's CUDA builds; elsewhere (CPU) the module uses the plain ops.
"""
from __future__ import annotations

import torch

from pipeline.ahead import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK = 1024


def snake_beta(x: torch.Tensor, alpha_exp: torch.Tensor, inv_beta: torch.Tensor) -> torch.Tensor:
    """x [B, C, T], channels first or a view of a channels-last buffer (the fused convolutions' output),
    y in the same layout; alpha_exp, inv_beta [C, 1] (exp(alpha), 1/(exp(beta) + 1e-9))."""
    if triton is None or not x.is_cuda:
        return x + inv_beta * torch.sin(x * alpha_exp).pow(2)
    if not (x.is_contiguous() or x.transpose(1, 2).is_contiguous()):
        x = x.contiguous()
    y = torch.empty_like(x)  # x's strides
    n = x.numel()
    # In either layout, element `offset` of the buffer is of channel (offset // x.stride(1)) % C.
    launch(_snake_beta_kernel, (triton.cdiv(n, BLOCK),), x, alpha_exp, inv_beta, y, n, x.stride(1), x.shape[1], BLOCK=BLOCK)
    return y


if triton is not None:

    @triton.jit
    def _snake_beta_kernel(x_ptr, alpha_ptr, inv_beta_ptr, y_ptr, n, channel_stride, channels, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        channel = (offsets // channel_stride) % channels
        x = tl.load(x_ptr + offsets, mask=inside)
        s = tl.sin(x * tl.load(alpha_ptr + channel, mask=inside))
        tl.store(y_ptr + offsets, x + tl.load(inv_beta_ptr + channel, mask=inside) * (s * s), mask=inside)
