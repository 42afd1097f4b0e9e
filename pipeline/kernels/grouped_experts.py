"""Routed experts of a mixture-of-experts MLP for many tokens (a prompt's prefill, several prompts
packed), row-invariant: `grouped_experts`.

The (token, expert) pairs are sorted by expert on the device and each expert's pairs are cut into
tiles of BLOCK_M pairs, the last one padded; a program computes one fixed BLOCK_M x BLOCK_N tile of
one expert's projection with one fixed BLOCK_K loop over the whole reduction, so an expert's weights
are read once per tile rather than once per token. Every tile shape is a module constant: nothing
depends on the number of tokens or on how many pairs an expert gets (grouped GEMMs that choose their
tiles by those counts round a token's numbers by its neighbours' routing). A row of a tile's product
depends only on its own row of the input, so a token's output is bit-identical whatever the other
tokens are, how many, which experts they choose and where the token sits; padding rows are zeros.
Each pair's weighted output lands at the pair's own place and a token's k outputs are summed in a
fixed order.

Nothing reads a value back to the host (the call runs inside a CUDA graph): the tile plan is
sorts, searches and cumulative sums over a fixed upper bound of tiles, and programs past the real
tile count exit at once. Inactive rows' pairs sort after every real expert, are never computed,
and give zeros.

Layouts are transformers' stacked experts: `gate_up` [E, 2I, H] (gate rows first), `down` [E, H, I].
The arithmetic is `pipeline.kernels.experts.routed_experts`': each projection accumulates in float32
and is rounded to the weights' dtype, SiLU(gate) * up is rounded, and the k weighted outputs are
summed in float32 and rounded once.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Tiles for Hopper in bf16. The prefill reads every chosen expert's weights (about 9.4 MB an expert
# at the real sizes), so it is bound by memory until an expert gets hundreds of pairs. 64 pairs a
# tile give most experts one tile up to 512 tokens (32 pairs an expert on average at top-8 of 128);
# an expert's further tiles run beside its first (the grids' order) and find its weights in L2; the
# padding of short prompts costs tensor-core time only.
BLOCK_M = 64
GATE_UP_BLOCK_N, GATE_UP_BLOCK_K = 64, 64  # a program: 64 gate and 64 up columns of one expert
DOWN_BLOCK_N, DOWN_BLOCK_K = 128, 64  # a program: 128 output columns of one expert's down projection
SUM_ROWS, SUM_COLS = 16, 256  # a program of the final sum: 256 columns of 16 tokens
NUM_WARPS, NUM_STAGES = 4, 4


class TilePlan(NamedTuple):
    """Which pairs each tile computes, all on the device.

    `order`: pair indices (token * k + j) sorted by expert; `pair_start` [E + 1]: where each expert's
    pairs begin in `order` (the last entry ends the real ones); `tile_end` [E]: each expert's tiles
    end (cumulative); `tile_expert` [max_tiles]: the expert of each tile, E past the real tiles."""
    order: torch.Tensor
    pair_start: torch.Tensor
    tile_end: torch.Tensor
    tile_expert: torch.Tensor


def tile_plan(chosen: torch.Tensor, active: torch.Tensor | None, experts: int) -> TilePlan:
    """The tiles of `chosen` [N, k]: an expert's c pairs take ceil(c / BLOCK_M) consecutive tiles.
    At most ceil(N * k / BLOCK_M) + E tiles exist (each expert's last tile is the only partial one),
    and never more than N * k."""
    pairs = chosen.numel()
    expert_of_pair = chosen if active is None else torch.where(active[:, None], chosen, experts)  # E: no expert
    sorted_experts, order = torch.sort(expert_of_pair.reshape(-1), stable=True)  # a pair's place in its tiles follows token order
    bounds = torch.arange(experts + 1, device=chosen.device, dtype=sorted_experts.dtype)
    pair_start = torch.searchsorted(sorted_experts, bounds)
    tile_end = torch.cumsum((pair_start.diff() + BLOCK_M - 1) // BLOCK_M, 0)
    max_tiles = min(pairs, triton.cdiv(pairs, BLOCK_M) + experts)
    tiles = torch.arange(max_tiles, device=chosen.device, dtype=tile_end.dtype)
    return TilePlan(order, pair_start, tile_end, torch.searchsorted(tile_end, tiles, right=True))


@triton.jit
def _tile_pairs(tile, expert, order_ptr, pair_start_ptr, tile_end_ptr, BLOCK_M: tl.constexpr):
    """The tile's BLOCK_M pair indices (0 on padding rows) and which rows are real pairs."""
    start = tl.load(pair_start_ptr + expert)
    end = tl.load(pair_start_ptr + expert + 1)
    first_tile = tl.load(tile_end_ptr + expert) - tl.cdiv(end - start, BLOCK_M)
    slots = start + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    real = slots < end
    return tl.load(order_ptr + slots, mask=real, other=0), real


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, order_ptr, pair_start_ptr, tile_end_ptr, tile_expert_ptr, HIDDEN, INTER, EXPERTS,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act[pair, n-block] = SiLU(x[token] . gate[e]) * (x[token] . up[e]) for the tile's pairs of expert e."""
    tile = tl.program_id(0)  # tiles vary fastest: an expert's tiles of one column block run together and share its weights in L2
    expert = tl.load(tile_expert_ptr + tile)
    if expert == EXPERTS:
        return
    pairs, real = _tile_pairs(tile, expert, order_ptr, pair_start_ptr, tile_end_ptr, BLOCK_M)
    x_rows = x_ptr + (pairs // TOP_K)[:, None].to(tl.int64) * HIDDEN
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < INTER
    gate_cols = w_ptr + expert.to(tl.int64) * 2 * INTER * HIDDEN + cols[None, :].to(tl.int64) * HIDDEN
    up_cols = gate_cols + INTER * HIDDEN
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, HIDDEN, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        in_k = ks < HIDDEN
        a = tl.load(x_rows + ks[None, :], mask=real[:, None] & in_k[None, :], other=0.0)
        w_mask = in_k[:, None] & in_n[None, :]
        # "ieee" keeps float32 weights out of TF32; half-precision products are exact either way.
        gate = tl.dot(a, tl.load(gate_cols + ks[:, None], mask=w_mask, other=0.0), gate, input_precision="ieee")
        up = tl.dot(a, tl.load(up_cols + ks[:, None], mask=w_mask, other=0.0), up, input_precision="ieee")
    out_dtype = act_ptr.dtype.element_ty
    gate = gate.to(out_dtype).to(tl.float32)
    up = up.to(out_dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32)
    tl.store(act_ptr + pairs[:, None].to(tl.int64) * INTER + cols[None, :], (silu * up).to(out_dtype), mask=real[:, None] & in_n[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, weights_ptr, out_ptr, order_ptr, pair_start_ptr, tile_end_ptr, tile_expert_ptr, HIDDEN, INTER, EXPERTS,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, n-block] = weights[pair] * round(down[e] . act[pair]) in float32 for the tile's pairs of expert e."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert == EXPERTS:
        return
    pairs, real = _tile_pairs(tile, expert, order_ptr, pair_start_ptr, tile_end_ptr, BLOCK_M)
    act_rows = act_ptr + pairs[:, None].to(tl.int64) * INTER
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < HIDDEN
    w_cols = w_ptr + expert.to(tl.int64) * HIDDEN * INTER + cols[None, :].to(tl.int64) * INTER
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, INTER, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        in_k = ks < INTER
        a = tl.load(act_rows + ks[None, :], mask=real[:, None] & in_k[None, :], other=0.0)
        acc = tl.dot(a, tl.load(w_cols + ks[:, None], mask=in_k[:, None] & in_n[None, :], other=0.0), acc, input_precision="ieee")
    rounded = acc.to(act_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weights_ptr + pairs, mask=real, other=0.0).to(tl.float32)
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * HIDDEN + cols[None, :], rounded * weight[:, None], mask=real[:, None] & in_n[None, :])


@triton.jit
def _sum_pairs_kernel(pair_out_ptr, active_ptr, out_ptr, TOKENS, HIDDEN, TOP_K: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """out[n, h] = sum over j = 0, 1, ... k - 1 of pair_out[n * k + j, h], for a block of tokens and columns
    (zeros for an inactive row, whose pairs were never written)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    in_out = (rows < TOKENS)[:, None] & (cols < HIDDEN)[None, :]
    computed = in_out & (tl.load(active_ptr + rows, mask=rows < TOKENS, other=0) != 0)[:, None]
    total = tl.zeros([BLOCK_ROWS, BLOCK_COLS], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair_rows = (rows * TOP_K + j).to(tl.int64) * HIDDEN
        total += tl.load(pair_out_ptr + pair_rows[:, None] + cols[None, :], mask=computed, other=0.0)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * HIDDEN + cols[None, :], total.to(out_ptr.dtype.element_ty), mask=in_out)


def grouped_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    active: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, H], chosen and weights [N, k] (each token's distinct experts and their routing weights),
    `active` [N] (bool; None: every row) -> [N, H] in x's dtype: sum over j of weights[n, j] * expert
    chosen[n, j] of x[n] (zeros for inactive rows)."""
    tokens, hidden = x.shape
    top_k = chosen.shape[1]
    experts, _, intermediate = down.shape
    if gate_up.shape != (experts, 2 * intermediate, hidden) or down.shape[1] != hidden:
        raise ValueError(f"Expert weights {tuple(gate_up.shape)} and {tuple(down.shape)} do not fit tokens of {hidden}.")
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    plan = tile_plan(chosen, active, experts)
    max_tiles = plan.tile_expert.shape[0]
    inputs = x.to(gate_up.dtype).contiguous()  # tl.dot takes operands of one dtype, as transformers casts the input
    act = torch.empty(tokens * top_k, intermediate, dtype=gate_up.dtype, device=x.device)
    _gate_up_kernel[(max_tiles, triton.cdiv(intermediate, GATE_UP_BLOCK_N))](
        inputs, gate_up, act, *plan, hidden, intermediate, experts, TOP_K=top_k, BLOCK_M=BLOCK_M, BLOCK_N=GATE_UP_BLOCK_N,
        BLOCK_K=GATE_UP_BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    pair_out = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(max_tiles, triton.cdiv(hidden, DOWN_BLOCK_N))](
        act, down, weights.contiguous(), pair_out, *plan, hidden, intermediate, experts, BLOCK_M=BLOCK_M, BLOCK_N=DOWN_BLOCK_N,
        BLOCK_K=DOWN_BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    active = torch.ones(tokens, dtype=torch.bool, device=x.device) if active is None else active.contiguous()
    _sum_pairs_kernel[(triton.cdiv(tokens, SUM_ROWS), triton.cdiv(hidden, SUM_COLS))](
        pair_out, active, out, tokens, hidden, TOP_K=top_k, BLOCK_ROWS=SUM_ROWS, BLOCK_COLS=SUM_COLS)
    return out
