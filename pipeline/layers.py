"""Building blocks whose numerics must match the reference in every model: float32 RMSNorm
variance and RoPE tables computed in float32 (shared/reference: vllm-omni PR 2277)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Variance in float32 whatever the activation dtype: the reference does, and bf16 here is audible.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rope_tables(head_dim: int, theta: float, max_positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, head_dim] in float32 ("rotate_half" layout); callers cast them to the activation dtype."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, L, D]; cos, sin: [L, D] already in x's dtype; pairs are (first half, second half)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
