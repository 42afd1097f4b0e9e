"""Triton kernels for a prompt's prefill: what `Transformer.prefill` computes for one sequence from
position 0, in nine kernels per layer, none of them compiled by torch.compile.

The matmuls and the attention stay cuBLAS's and SDPA's (a prefill is hundreds of positions, their
best case); the elementwise work between them is three kernels:

1. RMSNorm of each position, with the residual add before it where there is one (`_norm_kernel`);
2. the q/k RMSNorm, RoPE and the write of k and v into the prompt's cache row, from the fused
   q/k/v projection's output (`_qkv_kernel`: the decode step's epilogue, on a tile read from memory),
   and k and v once more, contiguous, for the attention;
3. SiLU(gate) * up (`_silu_mul_kernel`).

Numerics are the module's: each intermediate that the unfused layer rounds to the activation dtype
is rounded here at the same point (pipeline.kernels.decode's conventions), the variance in float32.
With no inductor in the prefill, an engine's start compiles these three kernels (a few seconds,
ahead, on the compile threads) instead of tracing and compiling a layer with torch.compile.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import sdpa_kernel

from pipeline.ahead import launch
from pipeline.kernels.decode import _qkv_epilogue, _qkv_tables, _round
from pipeline.layers import DETERMINISTIC_ATTENTION
from pipeline.model import Transformer

BLOCK_M = 16  # positions per program of the q/k/v kernel
BLOCK_N = 1024  # columns per program of SiLU(gate) * up


@triton.jit(do_not_specialize=["M"])
def _norm_kernel(x_ptr, y_ptr, h_ptr, norm_ptr, out_ptr, M, K: tl.constexpr, eps, ADD: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row m of out = RMSNorm(h) with h = x + y written to h_ptr (ADD), or h = x."""
    m = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < K
    x = tl.load(x_ptr + m * K + offs, mask=mask, other=0.0)
    dt = x.dtype
    h = x.to(tl.float32)
    if ADD:
        h = _round(h + tl.load(y_ptr + m * K + offs, mask=mask, other=0.0).to(tl.float32), dt)
        tl.store(h_ptr + m * K + offs, h.to(dt), mask=mask)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / K + eps)
    weight = tl.load(norm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * K + offs, (weight * _round(h * inv_rms, dt)).to(dt), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _qkv_kernel(qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, row_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_ptr, v_ptr, M,
                head_eps, cache_row, cache_head, cache_pos, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """One head's q/k/v of BLOCK_M positions from the projection's output [M, (HEADS + 2 KV_HEADS) HEAD_DIM]:
    q into q [M, HEADS, HEAD_DIM]; k and v into the cache row `row_ptr` holds and into k, v [KV_HEADS, M, HEAD_DIM]."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pid_m, head = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    j = tl.arange(0, HALF)
    tile = qkv_ptr + offs_m[:, None] * ((HEADS + 2 * KV_HEADS) * HEAD_DIM) + head * HEAD_DIM + j[None, :]
    first = tl.load(tile, mask=m_mask[:, None], other=0.0).to(tl.float32)
    second = tl.load(tile + HALF, mask=m_mask[:, None], other=0.0).to(tl.float32)
    tables = _qkv_tables(q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, offs_m, m_mask, head, HEADS, HEAD_DIM)
    # The epilogue's row of position m is m // M (0 here): the cache pointers start at the prompt's row.
    row = tl.load(row_ptr)
    _qkv_epilogue(first, second, tables, q_ptr, k_cache_ptr + row * cache_row, v_cache_ptr + row * cache_row, offs_m, m_mask, head, M,
                  head_eps, cache_row, cache_head, cache_pos, HEADS, KV_HEADS, HEAD_DIM)
    if head >= HEADS:  # the same k or v for the attention: positions are 0..M-1, so position m goes to column block m
        _qkv_epilogue(first, second, tables, q_ptr, k_ptr, v_ptr, offs_m, m_mask, head, M, head_eps, 0, M * HEAD_DIM, HEAD_DIM,
                      HEADS, KV_HEADS, HEAD_DIM)


@triton.jit(do_not_specialize=["M"])
def _silu_mul_kernel(gate_up_ptr, out_ptr, M, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """out [M, N] = SiLU(gate) * up of gate_up [M, 2N] (gate first), each rounded as the module's two operations."""
    m, block = tl.program_id(0), tl.program_id(1)
    offs = block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    gate = tl.load(gate_up_ptr + m * 2 * N + offs, mask=mask, other=0.0)
    dt = gate.dtype
    gate = gate.to(tl.float32)
    up = tl.load(gate_up_ptr + m * 2 * N + N + offs, mask=mask, other=0.0).to(tl.float32)
    silu = _round(gate / (1.0 + tl.exp(-gate)), dt)
    tl.store(out_ptr + m * N + offs, (silu * up).to(dt), mask=mask)


def _norm(x: torch.Tensor, norm: torch.nn.Module, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, RMSNorm(h)) of x [M, K], h = residual + x where there is a residual (else x itself)."""
    m, k = x.shape
    out = torch.empty_like(x)
    h = x if residual is None else torch.empty_like(x)
    launch(_norm_kernel, (m,), x if residual is None else residual, x, h, norm.weight, out, m, k, norm.eps, ADD=residual is not None,
           BLOCK_K=triton.next_power_of_2(k), num_warps=4 if k <= 1024 else 8)
    return h, out


def _attention(layer: torch.nn.Module, normed: torch.Tensor, positions: torch.Tensor, row: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    """The layer's attention output [M, hidden] for the prompt RMSNorm-ed in `normed`; its k and v into cache row `row`."""
    attn = layer.self_attn
    cache = attn.kv_cache
    m = normed.shape[0]
    heads, kv_heads, head_dim = attn.heads, attn.kv_heads, attn.head_dim
    qkv = F.linear(normed, attn.qkv_proj.weight)
    q = torch.empty(m, heads, head_dim, dtype=normed.dtype, device=normed.device)
    k = torch.empty(1, kv_heads, m, head_dim, dtype=normed.dtype, device=normed.device)
    v = torch.empty_like(k)
    launch(_qkv_kernel, (triton.cdiv(m, BLOCK_M), heads + 2 * kv_heads), qkv, attn.q_norm.weight, attn.k_norm.weight, cos, sin, positions,
           row, q, cache.k, cache.v, k, v, m, attn.q_norm.eps, *cache.k.stride()[:3], HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
           BLOCK_M=BLOCK_M, num_warps=4)
    # Never cuDNN's attention (not deterministic), as the module's prefill.
    with sdpa_kernel(DETERMINISTIC_ATTENTION):
        out = F.scaled_dot_product_attention(q.view(1, m, heads, head_dim).transpose(1, 2), k, v, is_causal=True,
                                             enable_gqa=heads != kv_heads)
    return F.linear(out.transpose(1, 2).reshape(m, heads * head_dim), attn.o_proj.weight)


def _mlp(mlp: torch.nn.Module, normed: torch.Tensor) -> torch.Tensor:
    m = normed.shape[0]
    gate_up = F.linear(normed, mlp.gate_up_proj.weight)
    gated = torch.empty(m, mlp.intermediate, dtype=normed.dtype, device=normed.device)
    launch(_silu_mul_kernel, (m, triton.cdiv(mlp.intermediate, BLOCK_N)), gate_up, gated, m, mlp.intermediate, BLOCK_N=BLOCK_N, num_warps=4)
    return F.linear(gated, mlp.down_proj.weight)


@torch.inference_mode()
def prefill(model: Transformer, x: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """`model.prefill(x, row)`: x [1, L, hidden], one sequence from position 0 written into cache row
    `row` [1] (a device tensor); returns the final-normed states [1, L, hidden]."""
    _, length, hidden = x.shape
    positions = model.key_pos[:length]
    layers = list(model.layers)
    residual, normed = _norm(x.reshape(length, hidden).contiguous(), layers[0].input_layernorm)
    for layer, following in zip(layers, [*(next_layer.input_layernorm for next_layer in layers[1:]), model.norm]):
        h, normed = _norm(_attention(layer, normed, positions, row, model.rope_cos, model.rope_sin), layer.post_attention_layernorm, residual)
        residual, normed = _norm(_mlp(layer.mlp, normed), following, h)
    return normed.view(1, length, hidden)
