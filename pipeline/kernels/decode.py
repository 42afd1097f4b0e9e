"""Triton kernels for the decode step: five kernels per transformer layer instead of ~12.

1. input RMSNorm in the prologue of the q/k/v projection, whose epilogue does the q/k RMSNorm,
   RoPE and the write of k and v into the cache slot (one program per head: RoPE's halves and
   the head's norm stay in the program);
2. attention of one query head over its row's cache up to the query's position (not the whole
   cache: a row reads only what it has written); for the talker's long cache, a short context
   attended without exchange (by `attention_parts` programs per head, each weighing a share of the
   value columns), a long one split in chunks of positions, a program each, whose softmax
   statistics the chunks exchange within the launch;
3. output projection with the residual add in the epilogue;
4. post-attention RMSNorm in the prologue of the gate/up projection, SiLU(gate) * up in its epilogue;
5. down projection with the residual add in the epilogue.

Numerics are the reference's: RMSNorm variance and RoPE in float32; every intermediate that the
unfused layer rounds to the activation dtype (projection outputs, normed activations, the
rotation's two products, the softmax probabilities) is rounded here at the same point. Sums run
in another order than cuBLAS's, so bf16 and float16 results can differ in the last bit; in float32 (exact
`ieee` dots) they agree with the unfused step to float rounding.

Batch invariance: every launch tiles the batch in blocks of BLOCK_M rows with one block size for
every batch, and a row's reductions run in a fixed order over its own data, so a row's result
does not depend on how many rows run beside it or what they hold.

Tiles per weight shape (`Tiles`, per architecture: `KernelConfig.tiles`) come from a measured sweep; a tile may split
the reduction over several programs (split-K, for narrow weights that leave SMs idle), whose
partial sums the last program to finish adds in a fixed order: deterministic, like the rest.

Weights ahead of time: each matmul kernel, once its own weight tiles are read, asks L2 for the
next matmul's weights (they do not depend on anything computed), its programs a share each, so the
next kernel reads them from L2, fetched while this kernel ends and the next one launches (not by a
kernel that streams more than `bandwidth_bound_bytes` itself: HBM is busy enough there).
And on Hopper and newer the kernels launch overlapped (programmatic dependent launch): a kernel is
launched while the previous one ends and waits for its results on the GPU. Neither changes the
arithmetic: results are bit-identical with or without them.

Every launch takes the engine's `KernelConfig` (pipeline.kernels.config): the tiles, the overlapped
launches and the prefetch budget of the architecture it runs on.

Each kernel is a chain of round trips to memory (the wait for the previous kernel, the
activations, the weights, the split-K partials), so loads that do not depend on each other leave
together: the RMS's blocks (unrolled), an epilogue's residual, bias and RoPE rows before the split
sums, the attention's values with its keys.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.ahead import launch
from pipeline.kernels.config import BLOCK_ROWS, KernelConfig, Tiles

BLOCK_M = BLOCK_ROWS  # rows of the batch per program, whatever the batch: a row's arithmetic never depends on the batch size
NORM_BLOCK = 256
ATTENTION_BLOCK = 128  # cache positions per iteration of the attention loop


@triton.jit
def _round(x, DT: tl.constexpr):
    """x rounded to the activation dtype, computed on in float32 (a no-op in float32)."""
    return x.to(DT).to(tl.float32)


@triton.jit
def wait_for_inputs(OVERLAP: tl.constexpr):
    """With overlapped launches: wait until the previous kernel has finished and its writes are
    visible, then let the next kernel launch (it waits in turn before reading anything we write)."""
    if OVERLAP:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _prefetch_l2(ptrs):
    """Bring the 128-byte lines at `ptrs` into L2: no registers held, nothing waited for."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_share(next_ptr, program, size, LINES: tl.constexpr, LINE: tl.constexpr):
    """Program `program`'s share of the next weight's first `size` elements into L2: lines
    [program * LINES, (program + 1) * LINES) of LINE elements."""
    if LINES > 0:
        offs = (program * LINES + tl.arange(0, LINES)) * LINE
        _prefetch_l2(next_ptr + tl.where(offs < size, offs, 0))


@triton.jit
def _inverse_rms(x_ptr, stride_x, offs_m, m_mask, K: tl.constexpr, eps, BLOCK_K: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of each row of x [M, K] (rows `stride_x` apart), in float32.
    Unrolled: every block's load is issued before the first sum (a loop waits for each in turn, a
    round trip to L2 a block on the kernel's critical path); the sums are added in the same order."""
    total = tl.zeros([offs_m.shape[0]], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        total += tl.sum(x * x, axis=1)
    return tl.rsqrt(total / K + eps)


@triton.jit
def _input_tile(x_ptr, stride_x, norm_ptr, inv_rms, offs_m, m_mask, offs_k, K: tl.constexpr, HAS_NORM: tl.constexpr):
    """A [BLOCK_M, BLOCK_K] tile of x, RMS-normed as the reference's RMSNorm: normed in float32,
    rounded, times the weight, rounded."""
    k_mask = offs_k < K
    x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    if HAS_NORM:
        dt = x.dtype
        weight = tl.load(norm_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        x = (weight[None, :] * _round(x.to(tl.float32) * inv_rms[:, None], dt)).to(dt)
    return x


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    # For float32 operands (bf16 / fp16 ones ignore it): "ieee" exact products (not TF32; the float32
    # parity path must match the eager one); "tf32x3" each operand a TF32 part and a TF32 remainder,
    # three tensor-core products (float32 accuracy, the codec's speed); "tf32" Triton's default.
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _project(x_ptr, stride_x, norm_ptr, w_ptr, inv_rms, offs_m, m_mask, rows, other_rows, rows_mask, pid_k, K: tl.constexpr, HAS_NORM: tl.constexpr,
             TWO: tl.constexpr, PRECISION: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr, normed_ptr, STORE_NORMED: tl.constexpr,
             first_block):
    """RMSNorm?(x) tile @ w[rows]^T (and @ w[other_rows]^T if TWO: gate and up, a head's two halves)
    over this program's part of K, in float32; with STORE_NORMED, the programs of the first column
    block (`first_block`) store the normed tiles into normed [M, K] too."""
    first = tl.zeros([offs_m.shape[0], rows.shape[0]], dtype=tl.float32)
    second = tl.zeros([offs_m.shape[0], rows.shape[0]], dtype=tl.float32)
    K_SPLIT: tl.constexpr = K // SPLIT_K
    for k0 in range(pid_k * K_SPLIT, (pid_k + 1) * K_SPLIT, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = _input_tile(x_ptr, stride_x, norm_ptr, inv_rms, offs_m, m_mask, offs_k, K, HAS_NORM)
        if STORE_NORMED:  # a compile-time branch: no matmul without the side output pays for it
            if first_block:
                tl.store(normed_ptr + offs_m[:, None] * K + offs_k[None, :], a, mask=m_mask[:, None] & (offs_k[None, :] < K))
        w_mask = rows_mask[:, None] & (offs_k[None, :] < K)
        w = tl.load(w_ptr + rows[:, None] * K + offs_k[None, :], mask=w_mask, other=0.0)
        first += _dot(a, tl.trans(w), PRECISION)
        if TWO:
            w = tl.load(w_ptr + other_rows[:, None] * K + offs_k[None, :], mask=w_mask, other=0.0)
            second += _dot(a, tl.trans(w), PRECISION)
    return first, second


@triton.jit
def _sum_splits(a, b, partial_ptr, lock_ptr, tile, split, arrivals, rows_mask, SPLIT_K: tl.constexpr, TWO: tl.constexpr):
    """Split-K: each of the `arrivals` (<= SPLIT_K) programs of a tile stores its partial sums (a,
    and b if TWO) of the rows in `rows_mask` (the batch's: a lone row's tile of 16 moves 1/16 of the
    bytes); the last to arrive adds all of them in split order (the same order whichever program
    is last: deterministic) and gets (sums, True); the others get (a, b, False). Resets the tile's lock."""
    size: tl.constexpr = a.shape[0] * a.shape[1]
    offs = tl.arange(0, a.shape[0])[:, None] * a.shape[1] + tl.arange(0, a.shape[1])[None, :]
    mask = rows_mask[:, None]
    tile_ptr = partial_ptr + tile * (SPLIT_K * 2 * size)
    tl.store(tile_ptr + split * 2 * size + offs, a, mask=mask)
    if TWO:
        tl.store(tile_ptr + split * 2 * size + size + offs, b, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the program announces it
    last = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel") == arrivals - 1
    if last:
        a = tl.zeros(a.shape, dtype=tl.float32)
        b = tl.zeros(b.shape, dtype=tl.float32)
        # Unrolled to SPLIT_K, the partials past `arrivals` left out: every load leaves at once (a loop
        # over a count known only at run time waits for each load in turn); the same sums in split order.
        for k in tl.static_range(SPLIT_K):
            arrived = k < arrivals
            a = tl.where(arrived, a + tl.load(tile_ptr + k * 2 * size + offs, mask=mask & arrived, other=0.0, cache_modifier=".cg"), a)
            if TWO:
                b = tl.where(arrived, b + tl.load(tile_ptr + k * 2 * size + size + offs, mask=mask & arrived, other=0.0, cache_modifier=".cg"), b)
        # relaxed: the next use of the counter is in a later launch, which sees it after this one ends (an
        # acq_rel exchange would put a GPU-wide fence between the sums and the tile's store)
        tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed")
    return a, b, last


# The row count M is not specialized on (Triton would compile M == 1, M % 16 == 0 and the rest
# apart): one variant serves every row block, 15 fewer compiles in a cold start of the 0.6B; the
# same step times on an H100.
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, stride_x, norm_ptr, normed_ptr, w_ptr, bias_ptr, scale_ptr, res_ptr, out_ptr, partial_ptr, lock_ptr, M, N: tl.constexpr,
                   K: tl.constexpr, eps, HAS_NORM: tl.constexpr, STORE_NORMED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
                   MODE: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   next_ptr, next_size, OVERLAP: tl.constexpr, NEXT_LINES: tl.constexpr, LINE: tl.constexpr):
    """out [M, N] = epilogue(RMSNorm?(x) [M, K] @ w^T); program (row block, column block, K split).

    x's rows are `stride_x` apart. normed (STORE_NORMED, with HAS_NORM): the normed x [M, K], written
    by the programs of the first column block. HAS_BIAS: bias [N] added as a Linear adds it.
    HAS_SCALE: the result times scale [N] (a residual branch's per-channel gain), before MODE 1's add.

    MODE 0: plain (out may be float32 for activations in a narrower dtype: the result is rounded
    to the activations' dtype first, as `F.linear(...).float()`); 1: out = residual + result
    (res_ptr may be out_ptr: the program that finishes a tile reads its residual before writing
    it); 2: w holds gate rows [0, N) then up rows [N, 2N): out = SiLU(gate) * up."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    wait_for_inputs(OVERLAP)
    acc, up = _linear_sums(x_ptr, stride_x, norm_ptr, normed_ptr, w_ptr, M, N, K, eps, HAS_NORM, STORE_NORMED, MODE, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                           SPLIT_K, pid_m, pid_n, pid_k)
    _prefetch_share(next_ptr, (pid_m * tl.num_programs(1) + pid_n) * SPLIT_K + pid_k, next_size, NEXT_LINES, LINE)
    _linear_finish(acc, up, bias_ptr, HAS_BIAS, scale_ptr, HAS_SCALE, res_ptr, out_ptr, partial_ptr, lock_ptr, M, N, MODE, BLOCK_M, BLOCK_N, SPLIT_K,
                   pid_m, pid_n, pid_k, tl.num_programs(1), x_ptr.dtype.element_ty)


@triton.jit
def _linear_sums(x_ptr, stride_x, norm_ptr, normed_ptr, w_ptr, M, N: tl.constexpr, K: tl.constexpr, eps, HAS_NORM: tl.constexpr,
                 STORE_NORMED: tl.constexpr, MODE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, pid_m, pid_n, pid_k):
    """Tile (pid_m, pid_n)'s sums over K split pid_k (see _linear_kernel): (acc, up), up for MODE 2."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    inv_rms = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM:
        inv_rms = _inverse_rms(x_ptr, stride_x, offs_m, m_mask, K, eps, BLOCK_K)
    return _project(x_ptr, stride_x, norm_ptr, w_ptr, inv_rms, offs_m, m_mask, offs_n, N + offs_n, n_mask, pid_k, K, HAS_NORM, MODE == 2, PRECISION,
                    SPLIT_K, BLOCK_K, normed_ptr, STORE_NORMED, pid_n == 0)


@triton.jit
def _linear_finish(acc, up, bias_ptr, HAS_BIAS: tl.constexpr, scale_ptr, HAS_SCALE: tl.constexpr, res_ptr, out_ptr, partial_ptr, lock_ptr, M,
                   N: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, pid_m, pid_n, pid_k,
                   col_blocks, dt):
    """The tile's split sums added (split-K: by the last of its programs) and its epilogue stored.
    The epilogue's bias, scale and residual are loaded first: their round trip to L2 overlaps the split
    sums' (every program of a split tile loads them, the last one uses them)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    out_offs = offs_m[:, None] * N + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    scale = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    residual = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MODE == 1:
        residual = tl.load(res_ptr + out_offs, mask=out_mask, other=0.0).to(tl.float32)
    if SPLIT_K > 1:
        acc, up, last = _sum_splits(acc, up, partial_ptr, lock_ptr, pid_m * col_blocks + pid_n, pid_k, SPLIT_K, m_mask, SPLIT_K, MODE == 2)
        if last:
            _linear_epilogue(acc, up, bias, HAS_BIAS, scale, HAS_SCALE, residual, out_ptr, out_offs, out_mask, MODE, dt)
    else:
        _linear_epilogue(acc, up, bias, HAS_BIAS, scale, HAS_SCALE, residual, out_ptr, out_offs, out_mask, MODE, dt)


@triton.jit
def _linear_epilogue(acc, up, bias, HAS_BIAS: tl.constexpr, scale, HAS_SCALE: tl.constexpr, residual, out_ptr, out_offs, out_mask,
                     MODE: tl.constexpr, dt):
    """`dt`: the activation dtype, to which the product is rounded as the unfused matmul rounds it
    (stored in out's dtype, which may be wider: float32 logits). HAS_BIAS: the bias [BLOCK_N] is
    added before that rounding, as a Linear with a bias adds it; HAS_SCALE: the rounded result times
    the scale [BLOCK_N], rounded, as a LayerScale after the Linear; MODE 1: the residual after it."""
    if HAS_BIAS:
        acc = acc + bias[None, :]
    out = _round(acc, dt)
    if HAS_SCALE:
        out = _round(out * scale[None, :], dt)
    if MODE == 1:
        out = out + residual
    if MODE == 2:
        # silu in float32 on the rounded gate, rounded, times the rounded up projection: as F.silu(gate) * up
        out = _round(out * tl.sigmoid(out), dt) * _round(up, dt)
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M"])  # as _linear_kernel
def _qkv_kernel(x_ptr, norm_ptr, w_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                partial_ptr, lock_ptr, M, K: tl.constexpr, L, eps, head_eps, cache_row, cache_head, cache_pos,
                HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                next_ptr, next_size, OVERLAP: tl.constexpr, NEXT_LINES: tl.constexpr, LINE: tl.constexpr):
    """One head's projection of RMSNorm(x): program (block of rows, head), heads ordered q, k, v.

    q and k heads: RMSNorm over the head, then RoPE at each row's position; q goes to q [M, HEADS,
    HEAD_DIM], k and v into the cache at (row m // L, position). RoPE rotates the head's first half
    against its second, so the two halves are accumulated apart. Program (row block, head, K split)."""
    pid_m, head, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    wait_for_inputs(OVERLAP)
    first, second = _qkv_sums(x_ptr, norm_ptr, w_ptr, M, K, eps, HEAD_DIM, PRECISION, BLOCK_M, BLOCK_K, SPLIT_K, pid_m, head, pid_k)
    _prefetch_share(next_ptr, (pid_m * tl.num_programs(1) + head) * SPLIT_K + pid_k, next_size, NEXT_LINES, LINE)
    _qkv_finish(first, second, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_cache_ptr, v_cache_ptr, partial_ptr, lock_ptr, M, L,
                head_eps, cache_row, cache_head, cache_pos, HEADS, KV_HEADS, HEAD_DIM, BLOCK_M, SPLIT_K, pid_m, head, pid_k)


@triton.jit
def _qkv_sums(x_ptr, norm_ptr, w_ptr, M, K: tl.constexpr, eps, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, pid_m, head, pid_k):
    """Head `head`'s two halves of RMSNorm(x) @ w^T for row block pid_m, over K split pid_k."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    inv_rms = _inverse_rms(x_ptr, K, offs_m, m_mask, K, eps, BLOCK_K)
    j = tl.arange(0, HALF)
    return _project(x_ptr, K, norm_ptr, w_ptr, inv_rms, offs_m, m_mask, head * HEAD_DIM + j, head * HEAD_DIM + HALF + j, j < HALF, pid_k,
                    K, True, True, PRECISION, SPLIT_K, BLOCK_K, x_ptr, False, False)


@triton.jit
def _qkv_finish(first, second, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_cache_ptr, v_cache_ptr, partial_ptr, lock_ptr, M, L,
                head_eps, cache_row, cache_head, cache_pos, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr, pid_m, head, pid_k):
    """The head's split sums added (split-K: by the last of its programs), then its epilogue. The
    epilogue's positions, norm weights and RoPE rows are loaded first: their round trips to L2
    overlap the split sums' (every program of a split head loads them, the last one uses them)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    tables = _qkv_tables(q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, offs_m, m_mask, head, HEADS, HEAD_DIM)
    if SPLIT_K > 1:
        first, second, last = _sum_splits(first, second, partial_ptr, lock_ptr, pid_m * (HEADS + 2 * KV_HEADS) + head, pid_k, SPLIT_K, m_mask,
                                          SPLIT_K, True)
        if last:
            _qkv_epilogue(first, second, tables, q_ptr, k_cache_ptr, v_cache_ptr, offs_m, m_mask, head, L, head_eps, cache_row, cache_head,
                          cache_pos, HEADS, KV_HEADS, HEAD_DIM)
    else:
        _qkv_epilogue(first, second, tables, q_ptr, k_cache_ptr, v_cache_ptr, offs_m, m_mask, head, L, head_eps, cache_row, cache_head, cache_pos,
                      HEADS, KV_HEADS, HEAD_DIM)


@triton.jit
def _qkv_tables(q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, offs_m, m_mask, head, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """What a head's epilogue reads besides its sums: the rows' positions, the head's norm weight
    halves (q's or k's) and the RoPE rows at the positions (cos, sin: each half), in their dtypes."""
    HALF: tl.constexpr = HEAD_DIM // 2
    j = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + offs_m, mask=m_mask, other=0)
    norm_ptr = tl.where(head < HEADS, q_norm_ptr, k_norm_ptr)
    table = pos[:, None] * HEAD_DIM + j[None, :]
    return (pos, tl.load(norm_ptr + j), tl.load(norm_ptr + HALF + j), tl.load(cos_ptr + table, mask=m_mask[:, None], other=0.0),
            tl.load(cos_ptr + table + HALF, mask=m_mask[:, None], other=0.0), tl.load(sin_ptr + table, mask=m_mask[:, None], other=0.0),
            tl.load(sin_ptr + table + HALF, mask=m_mask[:, None], other=0.0))


@triton.jit
def _qkv_epilogue(first, second, tables, q_ptr, k_cache_ptr, v_cache_ptr, offs_m, m_mask, head, L, head_eps, cache_row, cache_head, cache_pos,
                  HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    dt = q_ptr.dtype.element_ty
    j = tl.arange(0, HALF)
    first, second = _round(first, dt), _round(second, dt)
    pos, g1, g2, cos1, cos2, sin1, sin2 = tables
    g1, g2 = g1.to(tl.float32), g2.to(tl.float32)
    cos1, cos2, sin1, sin2 = cos1.to(tl.float32), cos2.to(tl.float32), sin1.to(tl.float32), sin2.to(tl.float32)
    row = offs_m // L
    if head < HEADS + KV_HEADS:
        is_q = head < HEADS
        inv = tl.rsqrt((tl.sum(first * first, axis=1) + tl.sum(second * second, axis=1)) / HEAD_DIM + head_eps)
        first = _round(g1[None, :] * _round(first * inv[:, None], dt), dt)
        second = _round(g2[None, :] * _round(second * inv[:, None], dt), dt)
        # x * cos + rotate_half(x) * sin, each product rounded, as the unfused RoPE in the activation dtype
        rotated1 = _round(first * cos1, dt) + _round(-second * sin1, dt)
        rotated2 = _round(second * cos2, dt) + _round(first * sin2, dt)
        if is_q:
            dest = q_ptr + (offs_m * HEADS + head)[:, None] * HEAD_DIM + j[None, :]
        else:
            dest = k_cache_ptr + (row * cache_row + (head - HEADS) * cache_head + pos * cache_pos)[:, None] + j[None, :]
        tl.store(dest, rotated1.to(dt), mask=m_mask[:, None])
        tl.store(dest + HALF, rotated2.to(dt), mask=m_mask[:, None])
    else:
        dest = v_cache_ptr + (row * cache_row + (head - HEADS - KV_HEADS) * cache_head + pos * cache_pos)[:, None] + j[None, :]
        tl.store(dest, first.to(dt), mask=m_mask[:, None])
        tl.store(dest + HALF, second.to(dt), mask=m_mask[:, None])


@triton.jit
def _scores(k_ptr, q, offs_s, count, d, scale, HEAD_DIM: tl.constexpr):
    keys = tl.load(k_ptr + offs_s[:, None] * HEAD_DIM + d[None, :], mask=(offs_s < count)[:, None], other=0.0).to(tl.float32)
    return tl.where(offs_s < count, tl.sum(keys * q[None, :], axis=1) * scale, float("-inf"))


@triton.jit
def _attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, out_ptr, L, scale, cache_row, cache_head,
                      HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, OVERLAP: tl.constexpr):
    wait_for_inputs(OVERLAP)
    _attend(q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, out_ptr, L, scale, cache_row, cache_head, tl.program_id(0), tl.program_id(1),
            HEADS, GROUP, HEAD_DIM, BLOCK_S)


@triton.jit
def _attend(q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, out_ptr, L, scale, cache_row, cache_head, m, head,
            HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr):
    """Row m's query head `head`: softmax(q k^T * scale) v over cache positions 0..pos of row m // L.

    Two passes, as the reference's softmax: the maximum and the sum first, then probabilities
    exp(s - max) / sum rounded to the activation dtype before they weigh the values."""
    dt = out_ptr.dtype.element_ty
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (m * HEADS + head) * HEAD_DIM + d).to(tl.float32)
    count = tl.load(pos_ptr + m) + 1
    base = (m // L) * cache_row + (head // GROUP) * cache_head
    k_ptr, v_ptr = k_cache_ptr + base, v_cache_ptr + base
    if count <= BLOCK_S:
        # One block (every code-predictor step, short talker contexts): keys and values read once,
        # the values' load issued with the keys' (not after the softmax: one round trip, not two).
        # The same arithmetic as the loop below makes for one block, so results do not depend on the path.
        offs_s = tl.arange(0, BLOCK_S)
        values = tl.load(v_ptr + offs_s[:, None] * HEAD_DIM + d[None, :], mask=(offs_s < count)[:, None], other=0.0)
        s = _scores(k_ptr, q, offs_s, count, d, scale, HEAD_DIM)
        top = tl.max(s, axis=0)
        p = _round(tl.exp(s - top) / tl.sum(tl.exp(s - top), axis=0), dt)
        acc = tl.sum(p[:, None] * values.to(tl.float32), axis=0)
    else:
        top = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)
        for s0 in range(0, count, BLOCK_S):
            s = _scores(k_ptr, q, s0 + tl.arange(0, BLOCK_S), count, d, scale, HEAD_DIM)
            new_top = tl.maximum(top, tl.max(s, axis=0))
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(s - new_top), axis=0)
            top = new_top
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for s0 in range(0, count, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            p = _round(tl.exp(_scores(k_ptr, q, offs_s, count, d, scale, HEAD_DIM) - top) / total, dt)
            values = tl.load(v_ptr + offs_s[:, None] * HEAD_DIM + d[None, :], mask=(offs_s < count)[:, None], other=0.0).to(tl.float32)
            acc += tl.sum(p[:, None] * values, axis=0)
    tl.store(out_ptr + (m * HEADS + head) * HEAD_DIM + d, acc.to(dt))


@triton.jit
def _chunk_scores(q_ptr, k_cache_ptr, m, head, chunk, count, L, scale, cache_row, cache_head,
                  HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr):
    """Scores of row m's query head over chunk `chunk` of the cache positions, -inf past the query's position."""
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (m * HEADS + head) * HEAD_DIM + d).to(tl.float32)
    base = (m // L) * cache_row + (head // GROUP) * cache_head
    offs_s = chunk * CHUNK + tl.arange(0, CHUNK)
    return _scores(k_cache_ptr + base, q, offs_s, count, d, scale, HEAD_DIM), offs_s, base


@triton.jit
def arrive_and_wait(counter_ptr, target):
    """Count this program in at `counter_ptr` (its stores released to the whole GPU first), then
    wait until `target` programs are in (their stores acquired). One thread polls (a scalar
    atomic); the program's other threads wait for it at the barrier after."""
    tl.debug_barrier()  # every thread's stores precede the arrival
    tl.atomic_add(counter_ptr, 1, sem="release")
    while tl.atomic_add(counter_ptr, 0, sem="acquire") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _attention_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, stats_ptr, partial_ptr, lock_ptr, arrival_ptr, out_ptr, L, scale, cache_row,
                            cache_head, HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr,
                            CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, WHOLE: tl.constexpr, GROUPS: tl.constexpr, PARTS: tl.constexpr,
                            PASSES: tl.constexpr, OVERLAP: tl.constexpr):
    """Attention over a cache split in chunks of CHUNK positions: program (chunk, query head, row m),
    chunks past the query's position doing nothing (a row's cache is read up to its own position only).

    First pass: the chunk's maximum score and its sum of exp(score - maximum). Second: the softmax's
    maximum and sum from every chunk's (in chunk order), the chunk's probabilities rounded as the
    reference's, their weighted values; the last chunk to finish adds the chunks' values in chunk order.
    A context of WHOLE positions at most needs neither: the first PARTS programs each compute all its
    scores and a share of the value columns.

    PASSES 3: both in one launch, each program waiting between them until every chunk of its head
    has stored its statistics (`arrive_and_wait`). The chunks are the grid's first dimension, so a
    head's programs are launched together, after every earlier head's: the programs a waiting one
    waits for are already running or done. 1 or 2: the first or the second pass alone, in two launches
    (Triton's interpreter runs one program after another: a program cannot wait for a later one)."""
    wait_for_inputs(OVERLAP)
    chunk, head, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(pos_ptr + m) + 1
    active = tl.cdiv(count, CHUNK)
    group = m * HEADS + head
    if count <= WHOLE:
        # A short context (WHOLE positions at most): the head's first PARTS programs (idle otherwise)
        # each compute every score, so each has the softmax's statistics with nothing to exchange, and
        # weigh a share of the value columns: each reads a share of the values, not all of them. The
        # columns are weighed in GROUPS groups whatever PARTS is (a program takes GROUPS / PARTS of
        # them): the same sums in the same tiles, so the bits need not depend on PARTS.
        if chunk < PARTS and PASSES != 1:
            s, offs_s, base = _chunk_scores(q_ptr, k_cache_ptr, m, head, 0, count, L, scale, cache_row, cache_head, HEADS, GROUP, HEAD_DIM, WHOLE)
            top = tl.max(s, axis=0)
            p = tl.where(offs_s < count, tl.exp(s - top), 0.0)
            p = _round(p / tl.sum(p, axis=0), out_ptr.dtype.element_ty)
            WIDTH: tl.constexpr = HEAD_DIM // GROUPS
            for j in tl.static_range(GROUPS // PARTS):
                d = (chunk * (GROUPS // PARTS) + j) * WIDTH + tl.arange(0, WIDTH)
                values = tl.load(v_cache_ptr + base + offs_s[:, None] * HEAD_DIM + d[None, :], mask=(offs_s < count)[:, None], other=0.0)
                tl.store(out_ptr + group * HEAD_DIM + d, tl.sum(p[:, None] * values.to(tl.float32), axis=0).to(out_ptr.dtype.element_ty))
    elif chunk < active:
        s, offs_s, base = _chunk_scores(q_ptr, k_cache_ptr, m, head, chunk, count, L, scale, cache_row, cache_head, HEADS, GROUP, HEAD_DIM, CHUNK)
        top = tl.max(s, axis=0)  # finite: the chunk's first position is at or before the query's
        total = tl.sum(tl.where(offs_s < count, tl.exp(s - top), 0.0), axis=0)
        if PASSES != 2:
            slot = (group * CHUNKS + chunk) * 2
            tl.store(stats_ptr + slot, top)
            tl.store(stats_ptr + slot + 1, total)
        if PASSES == 3:
            arrive_and_wait(arrival_ptr + group, active)
        if PASSES != 1:
            # The values are loaded after the exchange, when the keys' registers are free. Loaded with
            # the keys (their round trip overlapping the exchange) they spilled 264 bytes a thread on
            # sm_90 and 1.2 KB on sm_80; on an H100 the 16-row step at 1,000 positions took 5.54 ms
            # (0.6B) and 6.34 (1.7B) that way, against 4.88 and 5.68 now (0.02 ms more with one row).
            values = _chunk_values_tile(v_cache_ptr + base, offs_s, count, HEAD_DIM)
            _chunk_values(s, offs_s, values, count, active, stats_ptr, partial_ptr, lock_ptr, arrival_ptr, out_ptr, group, chunk,
                          HEAD_DIM, CHUNKS, CHUNKS_P2, PASSES == 3)


@triton.jit
def _chunk_values_tile(v_ptr, offs_s, count, HEAD_DIM: tl.constexpr):
    d = tl.arange(0, HEAD_DIM)
    return tl.load(v_ptr + offs_s[:, None] * HEAD_DIM + d[None, :], mask=(offs_s < count)[:, None], other=0.0)


@triton.jit
def _chunk_values(s, offs_s, values, count, active, stats_ptr, partial_ptr, lock_ptr, arrival_ptr, out_ptr, group, chunk,
                  HEAD_DIM: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr, RESET_ARRIVALS: tl.constexpr):
    """The second pass of `_attention_split_kernel` for one chunk (its scores s, its values [CHUNK,
    HEAD_DIM]). The statistics are read past L1 (.cg): in one launch another program wrote them
    after this SM may have cached the lines."""
    dt = out_ptr.dtype.element_ty
    c = tl.arange(0, CHUNKS_P2)
    slots = (group * CHUNKS + c) * 2
    tops = tl.load(stats_ptr + slots, mask=c < active, other=float("-inf"), cache_modifier=".cg")
    top = tl.max(tops, axis=0)
    total = tl.sum(tl.load(stats_ptr + slots + 1, mask=c < active, other=0.0, cache_modifier=".cg") * tl.exp(tops - top), axis=0)
    p = _round(tl.where(offs_s < count, tl.exp(s - top), 0.0) / total, dt)
    d = tl.arange(0, HEAD_DIM)
    acc = tl.sum(p[:, None] * values.to(tl.float32), axis=0)[None, :]
    acc, _, last = _sum_splits(acc, acc, partial_ptr, lock_ptr, group, chunk, active, tl.full([1], True, tl.int1), CHUNKS, False)
    if last:
        if RESET_ARRIVALS:  # every chunk has passed its wait: it arrived here after it
            tl.atomic_xchg(arrival_ptr + group, 0, sem="relaxed")
        tl.store(out_ptr + group * HEAD_DIM + d[None, :], acc.to(dt))


@triton.jit
def _rms_norm_kernel(x_ptr, norm_ptr, out_ptr, K: tl.constexpr, eps, BLOCK_K: tl.constexpr, OVERLAP: tl.constexpr):
    wait_for_inputs(OVERLAP)
    m = tl.program_id(0)
    offs_m = m + tl.arange(0, 1)
    inv_rms = _inverse_rms(x_ptr, K, offs_m, offs_m >= 0, K, eps, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = _input_tile(x_ptr, K, norm_ptr, inv_rms, offs_m, offs_m >= 0, offs_k, K, True)
        tl.store(out_ptr + offs_m[:, None] * K + offs_k[None, :], x, mask=offs_k[None, :] < K)


# ---- launches ----------------------------------------------------------------------------------

class Workspace:
    """Split-K partial sums and per-tile arrival counters of one model's decode step. Its kernels
    run one after another on one stream and each leaves its counters at zero; two models' steps may
    run at once, so each model has its own.

    A buffer handed out is never freed while the workspace lives, even when a larger one replaces
    it: a CUDA graph captured with it (the decoder's graph over fewer rows) keeps its address."""

    def __init__(self) -> None:
        self.partial: torch.Tensor | None = None
        self.locks: torch.Tensor | None = None
        self.softmax_stats: torch.Tensor | None = None
        self.stats_arrivals: torch.Tensor | None = None
        self.replaced: list[torch.Tensor] = []

    def get(self, tiles: int, split_k: int, tile_floats: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for `split_k` partials (two accumulators of `tile_floats` each) of `tiles` tiles, and their counters."""
        self.partial = self._room(self.partial, tiles * split_k * 2 * tile_floats, torch.float32, device)
        self.locks = self._room(self.locks, tiles, torch.int32, device)
        return self.partial, self.locks

    def stats(self, floats: int, device: torch.device) -> torch.Tensor:
        """Split attention's per-chunk softmax maximum and sum."""
        self.softmax_stats = self._room(self.softmax_stats, floats, torch.float32, device)
        return self.softmax_stats

    def arrivals(self, heads: int, device: torch.device) -> torch.Tensor:
        """Split attention's per-head counters of chunks whose statistics are stored (each left at zero)."""
        self.stats_arrivals = self._room(self.stats_arrivals, heads, torch.int32, device)
        return self.stats_arrivals

    def _room(self, buffer: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`buffer` if it holds `numel` elements, else a larger zeroed one (counters start at zero), `buffer` kept alive."""
        if buffer is not None and buffer.numel() >= numel:
            return buffer
        if buffer is not None:
            self.replaced.append(buffer)
        return torch.zeros(numel, dtype=dtype, device=device)


def exact_precision(dtype: torch.dtype) -> str:
    """The dots' precision that rounds as the unfused path: exact products in float32 (other dtypes' dots ignore it)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_options(config: KernelConfig, device: torch.device) -> dict:
    """Launch arguments of a kernel that waits with `wait_for_inputs`: overlapped (programmatic
    dependent launch) where `config` has it, on CUDA (Triton's interpreter launches one by one)."""
    on = config.overlap and device.type == "cuda"
    return dict(OVERLAP=on, launch_pdl=on)


def _prefetch(config: KernelConfig, following: torch.Tensor | None, programs: int, weight: torch.Tensor) -> dict:
    """Launch arguments of a matmul kernel's prefetch of the `following` weight by its `programs`
    programs (None: nothing; the kernel's own `weight` then stands in as the unused pointer). On
    CUDA only: a prefetch is a PTX instruction, Triton's interpreter has none."""
    if following is None or not following.is_cuda or weight.numel() * weight.element_size() > config.bandwidth_bound_bytes:
        return dict(next_ptr=weight, next_size=0, NEXT_LINES=0, LINE=1)
    size, lines, line = prefetch_shares(following.numel(), following.element_size(), programs, config.l2_prefetch_bytes)
    return dict(next_ptr=following, next_size=size, NEXT_LINES=lines, LINE=line)


def prefetch_shares(numel: int, element_size: int, programs: int, budget: int) -> tuple[int, int, int]:
    """(elements asked into L2, 128-byte lines per program, elements per line): the weight's first
    `budget` bytes at most, in equal power-of-two shares of lines over the programs."""
    line = 128 // element_size
    size = min(numel, budget // element_size)
    return size, triton.next_power_of_2(triton.cdiv(triton.cdiv(size, line), programs)) if size else 0, line


def splits_whole(k: int, t: Tiles) -> bool:
    """Whether `t` splits a reduction of k columns into parts of whole tiles (one part masks its tail: any K)."""
    return t.split_k == 1 or k % (t.split_k * t.block_k) == 0


def _check_split(k: int, t: Tiles) -> None:
    if not splits_whole(k, t):
        raise ValueError(f"split-K: {k} columns do not split into {t.split_k} parts of whole {t.block_k}-column tiles")


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, workspace: Workspace, config: KernelConfig,
           norm: torch.nn.Module | None = None, mode: int = 0,
           residual: torch.Tensor | None = None, shape: Tiles | None = None, following: torch.Tensor | None = None,
           normed: torch.Tensor | None = None, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
           precision: str | None = None) -> torch.Tensor:
    """out [M, N] = epilogue(RMSNorm?(x) [M, K] @ weight^T (+ bias) (* scale)); see _linear_kernel for `mode`.
    x's rows may be apart (x[:, -1] of [M, L, K]). `following`: the weight of the next matmul, asked
    into L2 ahead of it. `normed` [M, K] (with `norm`): receives RMSNorm(x). `precision`: the dots'
    (`_dot`; default `exact_precision`)."""
    m, k = x.shape
    assert x.stride(1) == 1 and (normed is None or (norm is not None and normed.is_contiguous()))
    n = out.shape[1]
    t = shape or config.tiles(f"linear{mode}", n, k, x.dtype, m)
    _check_split(k, t)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, t.block_n), t.split_k)
    partial, locks = workspace.get(grid[0] * grid[1], t.split_k, BLOCK_M * t.block_n, x.device)
    launch(_linear_kernel, grid,
        x, x.stride(0), norm.weight if norm is not None else weight, normed if normed is not None else x, weight,
        bias if bias is not None else weight, scale if scale is not None else weight, residual if residual is not None else out, out, partial,
        locks, m, n, k, norm.eps if norm is not None else 0.0, HAS_NORM=norm is not None, STORE_NORMED=normed is not None,
        HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, MODE=mode, PRECISION=precision if precision is not None else exact_precision(x.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT_K=t.split_k, num_warps=t.num_warps, num_stages=t.num_stages,
        **launch_options(config, x.device), **_prefetch(config, following, grid[0] * grid[1] * grid[2], weight))
    return out


def qkv_rope(layer: torch.nn.Module, h: torch.Tensor, positions: torch.Tensor, length: int, cos: torch.Tensor, sin: torch.Tensor,
             q: torch.Tensor, workspace: Workspace, config: KernelConfig, shape: Tiles | None = None,
             following: torch.Tensor | None = None) -> None:
    """q/k/v of RMSNorm(h) with q/k norms and RoPE; q into `q` [M, heads, head_dim], k and v into the
    layer's cache. `following`: the weight of the next matmul, asked into L2 ahead of it."""
    attn = layer.self_attn
    cache = attn.kv_cache
    m, hidden = h.shape
    t = shape or config.tiles("qkv", attn.qkv_proj.weight.shape[0], hidden, h.dtype, m)
    _check_split(hidden, t)
    grid = (triton.cdiv(m, BLOCK_M), attn.heads + 2 * attn.kv_heads, t.split_k)
    partial, locks = workspace.get(grid[0] * grid[1], t.split_k, BLOCK_M * attn.head_dim // 2, h.device)
    launch(_qkv_kernel, grid,
        h, layer.input_layernorm.weight, attn.qkv_proj.weight, attn.q_norm.weight, attn.k_norm.weight, cos, sin, positions,
        q, cache.k, cache.v, partial, locks, m, hidden, length, layer.input_layernorm.eps, attn.q_norm.eps, *cache.k.stride()[:3],
        HEADS=attn.heads, KV_HEADS=attn.kv_heads, HEAD_DIM=attn.head_dim, PRECISION=exact_precision(h.dtype), BLOCK_M=BLOCK_M,
        BLOCK_K=t.block_k, SPLIT_K=t.split_k, num_warps=t.num_warps, num_stages=t.num_stages, **launch_options(config, h.device),
        **_prefetch(config, following, grid[0] * grid[1] * grid[2], attn.qkv_proj.weight))


def attention(attn: torch.nn.Module, q: torch.Tensor, positions: torch.Tensor, length: int, out: torch.Tensor, workspace: Workspace,
              config: KernelConfig, block_s: int | None = None, num_warps: int | None = None, chunk: int | None = None, one_launch: bool | None = None,
              parts: int = 0, whole: int = 0) -> None:
    """out [M, heads * head_dim]: each query head over its row's cache, positions 0..its own.

    `chunk`: split the cache in chunks of that many positions, one program each (two passes: the
    softmax's statistics, then the values; in one launch on a GPU, in two with `one_launch` off and
    in Triton's interpreter), where one program per head would leave SMs idle; a context of `whole`
    positions at most attended by `parts` programs per head instead, each weighing a share of the
    value columns (defaults `config.attention_whole`, at least a chunk, and `config.attention_parts`;
    the columns are weighed in max(parts, config.attention_parts) groups). Without `chunk` (and
    without one in `config.attention_chunks` for the cache's length), one program per head loops
    over blocks of `block_s` positions."""
    cache = attn.kv_cache
    scale, strides = attn.head_dim**-0.5, cache.k.stride()[:2]
    shape = dict(HEADS=attn.heads, GROUP=attn.heads // attn.kv_heads, HEAD_DIM=attn.head_dim)
    if chunk is None:
        chunk, warps = config.attention_chunks.get(cache.k.shape[2], (0, 0))
        num_warps = num_warps or warps
    if chunk:
        chunks = triton.cdiv(cache.k.shape[2], chunk)
        grid = (chunks, attn.heads, q.shape[0])
        heads = q.shape[0] * attn.heads
        partial, locks = workspace.get(heads, chunks, attn.head_dim, q.device)
        stats, arrivals = workspace.stats(heads * chunks * 2, q.device), workspace.arrivals(heads, q.device)
        one_launch = q.is_cuda if one_launch is None else one_launch
        groups = max(parts, min(config.attention_parts, attn.head_dim, 1 << (chunks.bit_length() - 1)))
        parts = parts or groups
        assert groups % parts == 0 and parts <= min(chunks, attn.head_dim), f"{parts} programs per head: not a power of two up to {groups}"
        for passes in (3,) if one_launch else (1, 2):
            launch(_attention_split_kernel, grid, q, cache.k, cache.v, positions, stats, partial, locks, arrivals, out, length, scale, *strides, **shape,
                                          CHUNK=chunk, CHUNKS=chunks, CHUNKS_P2=triton.next_power_of_2(chunks),
                                          WHOLE=whole or max(chunk, config.attention_whole), GROUPS=groups, PARTS=parts, PASSES=passes,
                                          num_warps=num_warps or 4, **launch_options(config, q.device))
        return
    # Blocks as long as the cache up to 128 positions: a code-predictor step (16 positions) is one
    # block. Measured on an H200 at 200 positions: 128 x 8 warps 9.7 us, 64 x 4 warps 14.1 us.
    block = block_s or attention_block(cache.k.shape[2])
    launch(_attention_kernel, (q.shape[0], attn.heads), q, cache.k, cache.v, positions, out, length, scale, *strides, **shape, BLOCK_S=block,
                                                num_warps=num_warps or attention_warps(block), **launch_options(config, q.device))


def attention_block(cache_length: int) -> int:
    """Positions per iteration of one program per head: the whole cache up to ATTENTION_BLOCK."""
    return min(ATTENTION_BLOCK, triton.next_power_of_2(cache_length))


def attention_warps(block: int) -> int:
    return 8 if block >= 128 else 2


def rms_norm(x: torch.Tensor, norm: torch.nn.Module, config: KernelConfig) -> torch.Tensor:
    out = torch.empty_like(x)
    launch(_rms_norm_kernel, (x.shape[0],), x, norm.weight, out, x.shape[1], norm.eps, BLOCK_K=min(NORM_BLOCK, triton.next_power_of_2(x.shape[1])),
                                    **launch_options(config, x.device))
    return out


def decoder_layer(layer: torch.nn.Module, x: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, length: int, cos: torch.Tensor,
                  sin: torch.Tensor, workspace: Workspace, config: KernelConfig, following: torch.Tensor | None = None) -> None:
    """One Qwen3 decoder layer: input x [M, hidden], output into h (which may be x); token m is
    position positions[m] of cache row m // length. `following`: the weight of the matmul after the
    layer (the next layer's q/k/v, an output head), asked into L2 during the layer's last kernel."""
    attn, mlp = layer.self_attn, layer.mlp
    m = x.shape[0]
    heads, head_dim = attn.heads, attn.head_dim
    q = torch.empty(m, heads, head_dim, dtype=x.dtype, device=x.device)
    qkv_rope(layer, x, positions, length, cos, sin, q, workspace, config, following=attn.o_proj.weight)
    attended = torch.empty(m, heads * head_dim, dtype=x.dtype, device=x.device)
    attention(attn, q, positions, length, attended, workspace, config)
    linear(attended, attn.o_proj.weight, h, workspace, config, mode=1, residual=x, following=mlp.gate_up_proj.weight)
    gated = torch.empty(m, mlp.intermediate, dtype=x.dtype, device=x.device)
    linear(h, mlp.gate_up_proj.weight, gated, workspace, config, norm=layer.post_attention_layernorm, mode=2, following=mlp.down_proj.weight)
    linear(gated, mlp.down_proj.weight, h, workspace, config, mode=1, residual=h, following=following)
