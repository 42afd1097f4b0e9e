"""`sample_rows` (pipeline.engine.sampling) as one Triton kernel: one program per row holds the
row's whole vocabulary (2,048 or 3,072 logits) and does temperature, top-k, top-p and the
exponential race in registers. In PyTorch's ops the chain is a sort, two softmaxes, a cumulative
sum and an argmax over [rows, vocab] per sampled codebook (16 per frame): ~5 kernels and, for 16
rows of the code predictor's 2,048 codes, a 20 us segmented sort each time.

The rules are the same step for step (see sample_rows); sums run in another order than PyTorch's
kernels, so a probability can differ in the last bit, which changes a draw only where two
candidates tie to that bit.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from pipeline.engine.sampling import RowSampling


@triton.jit
def _softmax(x):
    e = tl.exp(x - tl.max(x, axis=0))
    return e / tl.sum(e, axis=0)


@triton.jit
def _sample_kernel(logits_ptr, noise_ptr, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, out_ptr, V, stride_logits, stride_noise,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inside = offs < V
    logits = tl.load(logits_ptr + row * stride_logits + offs, mask=inside, other=float("-inf"))
    greedy = tl.argmax(logits, axis=0)
    scaled = logits / tl.load(temperature_ptr + row)
    ordered = tl.sort(scaled, descending=True)  # the padding (-inf) sorts last, with any -inf logits
    top_k = tl.load(top_k_ptr + row)
    k = tl.where(top_k > 0, tl.minimum(top_k, V), V)
    kth = tl.max(tl.where(offs == k - 1, ordered, float("-inf")), axis=0)
    ordered = tl.where(ordered < kth, float("-inf"), ordered)
    tail_mass = tl.cumsum(_softmax(ordered), axis=0, reverse=True)  # mass of each rank and all below it
    keep = (tail_mass > 1.0 - tl.load(top_p_ptr + row)) | (offs == 0)
    kept = tl.sum(keep.to(tl.int32), axis=0)  # keep is a prefix of the ranks
    cutoff = tl.max(tl.where(offs == kept - 1, ordered, float("-inf")), axis=0)
    scaled = tl.where(scaled < cutoff, float("-inf"), scaled)
    noise = tl.load(noise_ptr + row * stride_noise + offs, mask=inside, other=1.0)
    drawn = tl.argmax(_softmax(scaled) / noise, axis=0)
    tl.store(out_ptr + row, tl.where(tl.load(do_sample_ptr + row) != 0, drawn, greedy).to(tl.int64))


def sample(logits: torch.Tensor, settings: "RowSampling", noise: torch.Tensor) -> torch.Tensor:
    """`sample_rows(logits, settings, noise)` in one kernel: logits, noise [rows, V] float32 -> token ids [rows]."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    block = triton.next_power_of_2(vocab)
    _sample_kernel[(rows,)](logits, noise, settings.do_sample, settings.temperature, settings.top_k, settings.top_p, out, vocab,
                           logits.stride(0), noise.stride(0), BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return out
