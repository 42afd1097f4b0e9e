"""Routed experts of a mixture-of-experts MLP for a few tokens (a decode step's rows), row-invariant:
`routed_experts`.

Each token's top-k experts are applied to that token alone, every product a fixed-order dot over
the expert's weight rows read in place; nothing groups tokens by expert. Grouped GEMMs choose their
tiles by the number of tokens each expert gets, so a token's rounding follows which experts its
neighbours chose, and a conversation's reply would change with the others in the batch. Here a
row's numbers depend on its own input only, and rows marked inactive cost nothing (the decode step
runs over a fixed number of rows, most of them idle when few conversations run).

Layouts are transformers' stacked experts: `gate_up` [E, 2I, H] (gate rows first), `down` [E, H, I].
The arithmetic follows transformers' experts: each projection accumulates in float32 and is
rounded to the weights' dtype, SiLU(gate) * up is rounded, and the k weighted outputs are summed in
float32 and rounded once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GATE_UP_BLOCK_I, GATE_UP_BLOCK_H = 32, 256  # a program: 32 gate and 32 up rows of one expert, read 256 columns at a time
DOWN_BLOCK_H, DOWN_BLOCK_I = 32, 256  # a program: 32 output rows of one expert's down projection


@triton.jit
def _gate_up_kernel(x_ptr, chosen_ptr, active_ptr, w_ptr, act_ptr, HIDDEN, INTER,
                    TOP_K: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr):
    """act[n, j, i-block] = SiLU(x[n] . gate[e]) * (x[n] . up[e]) for e = chosen[n, j]."""
    pair = tl.program_id(0)
    row = pair // TOP_K
    if tl.load(active_ptr + row) == 0:
        return
    expert = tl.load(chosen_ptr + pair).to(tl.int64)
    out_dtype = act_ptr.dtype.element_ty
    rows_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    in_i = rows_i < INTER
    gate_rows = w_ptr + expert * 2 * INTER * HIDDEN + rows_i[:, None].to(tl.int64) * HIDDEN
    up_rows = gate_rows + INTER * HIDDEN
    gate = tl.zeros([BLOCK_I], dtype=tl.float32)
    up = tl.zeros([BLOCK_I], dtype=tl.float32)
    for start in range(0, HIDDEN, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        in_h = cols < HIDDEN
        x = tl.load(x_ptr + row * HIDDEN + cols, mask=in_h, other=0.0).to(tl.float32)
        both = in_i[:, None] & in_h[None, :]
        gate += tl.sum(tl.load(gate_rows + cols[None, :], mask=both, other=0.0).to(tl.float32) * x[None, :], axis=1)
        up += tl.sum(tl.load(up_rows + cols[None, :], mask=both, other=0.0).to(tl.float32) * x[None, :], axis=1)
    gate = gate.to(out_dtype).to(tl.float32)
    up = up.to(out_dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32)
    tl.store(act_ptr + pair * INTER + rows_i, (silu * up).to(out_dtype), mask=in_i)


@triton.jit
def _down_kernel(act_ptr, chosen_ptr, weights_ptr, active_ptr, w_ptr, out_ptr, HIDDEN, INTER,
                 TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr):
    """out[n, j, h-block] = weights[n, j] * round(down[e] . act[n, j]) in float32 (0 for an inactive row)."""
    pair = tl.program_id(0)
    row = pair // TOP_K
    rows_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = rows_h < HIDDEN
    if tl.load(active_ptr + row) == 0:
        tl.store(out_ptr + pair * HIDDEN + rows_h, tl.zeros([BLOCK_H], dtype=tl.float32), mask=in_h)
        return
    expert = tl.load(chosen_ptr + pair).to(tl.int64)
    w_rows = w_ptr + expert * HIDDEN * INTER + rows_h[:, None].to(tl.int64) * INTER
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, INTER, BLOCK_I):
        cols = start + tl.arange(0, BLOCK_I)
        in_i = cols < INTER
        act = tl.load(act_ptr + pair * INTER + cols, mask=in_i, other=0.0).to(tl.float32)
        acc += tl.sum(tl.load(w_rows + cols[None, :], mask=in_h[:, None] & in_i[None, :], other=0.0).to(tl.float32) * act[None, :], axis=1)
    rounded = acc.to(act_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + pair * HIDDEN + rows_h, rounded * tl.load(weights_ptr + pair).to(tl.float32), mask=in_h)


def routed_experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   active: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, H], chosen and weights [N, k] (each token's experts and their routing weights), `active` [N]
    (bool; None: every row) -> [N, H] in x's dtype: sum over j of weights[n, j] * expert chosen[n, j] of x[n]
    (zeros for inactive rows)."""
    tokens, hidden = x.shape
    top_k = chosen.shape[1]
    intermediate = down.shape[2]
    if gate_up.shape[1:] != (2 * intermediate, hidden) or down.shape[1] != hidden:
        raise ValueError(f"Expert weights {tuple(gate_up.shape)} and {tuple(down.shape)} do not fit tokens of {hidden}.")
    active = torch.ones(tokens, dtype=torch.bool, device=x.device) if active is None else active
    x, chosen, weights = x.contiguous(), chosen.contiguous(), weights.contiguous()
    act = torch.empty(tokens * top_k, intermediate, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(tokens * top_k, triton.cdiv(intermediate, GATE_UP_BLOCK_I))](
        x, chosen, active, gate_up, act, hidden, intermediate, TOP_K=top_k, BLOCK_I=GATE_UP_BLOCK_I, BLOCK_H=GATE_UP_BLOCK_H)
    weighted = torch.empty(tokens, top_k, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(tokens * top_k, triton.cdiv(hidden, DOWN_BLOCK_H))](
        act, chosen, weights, active, down, weighted, hidden, intermediate, TOP_K=top_k, BLOCK_H=DOWN_BLOCK_H, BLOCK_I=DOWN_BLOCK_I)
    return weighted.sum(1).to(x.dtype)
