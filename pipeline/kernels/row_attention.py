"""Attention of single query positions over a cache of rows, each query over the first `lengths[n]`
keys of its own row, deterministic and row-invariant: `decode_attention` (a decode step, one query
per row), `token_attention` (any queries, each naming its row) and `pack_attention` (the same for
a packed prefill, on tensor cores).

`token_attention`: a program per (query, head) walks its row's keys in fixed blocks with a float32
online softmax, so its result depends on its own query, keys and length only (not on the other
queries, their number or its place among them), and is the same on every run.

`pack_attention`: a program per (block of consecutive queries, head) takes the rows its queries
name one at a time, reads that row's keys once for all of them and scores them with tensor-core
products, a query's scores masked outside its own row and length. A row of such a product depends
on its own query only, and a pass over keys a query does not see leaves its softmax state exactly
as it was (its running maximum starts finite, so the rescale is exp(0) = 1 and the added terms 0):
a query's result is the same whichever queries share its block.
PyTorch's scaled_dot_product_attention (its default backend, bf16, the step's float mask) gave
results that changed from run to run on an H200 once a row had more than 64 keys, and a
conversation's reply drifted with them. Keys past a row's length are not read at all.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_KEYS = 64
PACK_BLOCK_QUERIES = 32  # queries a pack_attention program scores together


@triton.jit
def _token_attention_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, lengths_ptr, out_ptr, scaling, HEADS, KV_HEADS, MAX_KEYS, DIM,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(rows_ptr + token)
    kv_head = head // (HEADS // KV_HEADS)
    dims = tl.arange(0, BLOCK_D)
    in_d = dims < DIM
    q = tl.load(q_ptr + (token * HEADS + head) * DIM + dims, mask=in_d, other=0.0).to(tl.float32)
    length = tl.load(lengths_ptr + token)
    base = (row * KV_HEADS + kv_head).to(tl.int64) * MAX_KEYS * DIM
    best = tl.zeros([], dtype=tl.float32) - float("inf")
    total = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, length, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        valid = keys < length
        offsets = base + keys[:, None].to(tl.int64) * DIM + dims[None, :]
        both = valid[:, None] & in_d[None, :]
        k = tl.load(k_ptr + offsets, mask=both, other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scaling, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=0))
        rescale = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best)
        v = tl.load(v_ptr + offsets, mask=both, other=0.0).to(tl.float32)
        total = total * rescale + tl.sum(weights, axis=0)
        acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
        best = new_best
    tl.store(out_ptr + (token * HEADS + head) * DIM + dims, (acc / total).to(out_ptr.dtype.element_ty), mask=in_d)


@triton.jit
def _pack_attention_kernel(q_ptr, k_ptr, v_ptr, rows_ptr, lengths_ptr, out_ptr, scaling, TOKENS, HEADS, KV_HEADS, MAX_KEYS, DIM,
                           BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    head = tl.program_id(1)
    kv_head = head // (HEADS // KV_HEADS)
    queries = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    in_q = queries < TOKENS
    dims = tl.arange(0, BLOCK_D)
    in_d = dims < DIM
    q = tl.load(q_ptr + (queries[:, None] * HEADS + head) * DIM + dims[None, :], mask=in_q[:, None] & in_d[None, :], other=0.0)
    rows = tl.load(rows_ptr + queries, mask=in_q, other=0)
    lengths = tl.load(lengths_ptr + queries, mask=in_q, other=0)
    best = tl.full([BLOCK_Q], -1.0e30, dtype=tl.float32)
    total = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)
    remaining = in_q
    while tl.max(remaining.to(tl.int32), axis=0) > 0:
        row = tl.min(tl.where(remaining, rows, 2**30), axis=0)  # the lowest row still to take
        mine = remaining & (rows == row)
        end = tl.max(tl.where(mine, lengths, 0), axis=0)
        base = (row * KV_HEADS + kv_head).to(tl.int64) * MAX_KEYS * DIM
        for start in range(0, end, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            offsets = base + keys[:, None].to(tl.int64) * DIM + dims[None, :]
            in_kd = (keys < end)[:, None] & in_d[None, :]
            k = tl.load(k_ptr + offsets, mask=in_kd, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scaling
            scores = tl.where(mine[:, None] & (keys[None, :] < lengths[:, None]), scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            rescale = tl.exp(best - new_best)
            weights = tl.exp(scores - new_best[:, None])
            v = tl.load(v_ptr + offsets, mask=in_kd, other=0.0)
            total = total * rescale + tl.sum(weights, axis=1)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
            best = new_best
        remaining = remaining & (rows != row)
    out = acc / tl.where(in_q, total, 1.0)[:, None]  # a query past the end has no keys
    tl.store(out_ptr + (queries[:, None] * HEADS + head) * DIM + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=in_q[:, None] & in_d[None, :])


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: torch.Tensor, scaling: float) -> torch.Tensor:
    """query [B, H, 1, D], key and value [B, Hkv, L, D] (H a multiple of Hkv: grouped-query heads),
    lengths [B] (each row attends to keys 0..lengths[b]-1, at least one) -> [B, 1, H, D] in query's dtype."""
    rows, heads, positions, dim = query.shape
    if positions != 1:
        raise ValueError(f"decode_attention takes one query position per row; got query {tuple(query.shape)}.")
    rows_of = torch.arange(rows, device=query.device)
    return token_attention(query[:, :, 0], key, value, rows_of, lengths, scaling)[:, None]


def token_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """query [N, H, D] (N queries), key and value [B, Hkv, L, D] (H a multiple of Hkv: grouped-query heads),
    rows and lengths [N] (query n attends to keys 0..lengths[n]-1 of row rows[n], at least one) -> [N, H, D]
    in query's dtype."""
    tokens, heads, dim, kv_heads, max_keys = _shapes("token_attention", query, key, value)
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    out = torch.empty(tokens, heads, dim, dtype=query.dtype, device=query.device)
    _token_attention_kernel[(tokens, heads)](query, key, value, rows.contiguous(), lengths.contiguous(), out, float(scaling), heads, kv_heads,
                                             max_keys, dim, BLOCK_N=BLOCK_KEYS, BLOCK_D=triton.next_power_of_2(dim))
    return out


def pack_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
                   scaling: float) -> torch.Tensor:
    """`token_attention`'s result (to rounding) for many queries on tensor cores: query [N, H, D], key and value
    [B, Hkv, L, D], rows and lengths [N] -> [N, H, D] in query's dtype."""
    tokens, heads, dim, kv_heads, max_keys = _shapes("pack_attention", query, key, value)
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    out = torch.empty(tokens, heads, dim, dtype=query.dtype, device=query.device)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"  # float32 stays float32; half-precision products are exact
    _pack_attention_kernel[(triton.cdiv(tokens, PACK_BLOCK_QUERIES), heads)](
        query, key, value, rows.contiguous(), lengths.contiguous(), out, float(scaling), tokens, heads, kv_heads, max_keys, dim,
        BLOCK_Q=PACK_BLOCK_QUERIES, BLOCK_N=BLOCK_KEYS, BLOCK_D=max(16, triton.next_power_of_2(dim)), PRECISION=precision)
    return out


def _shapes(name: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(queries, heads, head dim, KV heads, cache positions) of queries [N, H, D] over a cache [B, Hkv, L, D]."""
    tokens, heads, dim = query.shape
    kv_heads, max_keys = key.shape[1], key.shape[2]
    if heads % kv_heads or value.shape != key.shape or key.shape[3] != dim:
        raise ValueError(f"{name} takes grouped heads over one cache; got query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}, value {tuple(value.shape)}.")
    return tokens, heads, dim, kv_heads, max_keys
