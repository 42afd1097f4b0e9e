"""Building blocks shared by the talker and the codec: float32 RMSNorm variance and RoPE tables
computed in float32, as the reference (shared/reference: vllm-omni PR 2277), and a batch-invariant,
deterministic attention."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention import SDPBackend


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


# SDPA backends whose forward pass is deterministic. cuDNN's is not, and torch 2.11 picks it by
# default on an H200 for masked grouped-query attention: with it, the same request's codes differ run to run.
DETERMINISTIC_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [N, M, D] @ k [N, S, D]^T in float32 (float64 stays float64): half-precision inputs keep their
    float32 accumulation (as SDPA's kernels do) rather than being rounded to bf16 before the softmax."""
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        return torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
    scores = torch.bmm(q, k.transpose(1, 2))
    return scores if scores.dtype == torch.float64 else scores.float()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, L, D] over keys and values [B, H_kv, S, D]; mask [B, L, S] additive float32 -> [B, H, L, D].

    Written out rather than SDPA: each row's result depends on its own inputs only, whatever the
    other rows hold (batch invariance; SDPA's CPU kernel does not give that, and on an H200 its
    default pick for masked grouped-query attention is cuDNN's, which is not deterministic), and
    with grouped KV heads SDPA's masked kernels copy the whole cache to repeat it per query head."""
    b, heads, length, dim = q.shape
    kv_heads, seq = k.shape[1], k.shape[2]
    group = heads // kv_heads
    q = q.reshape(b * kv_heads, group * length, dim)  # query heads of one KV head share its keys
    scores = _scores(q, k.reshape(b * kv_heads, seq, dim)).view(b, kv_heads, group * length, seq)
    scores = scores * scale + mask.repeat(1, group, 1)[:, None]
    probs = scores.softmax(-1).to(v.dtype).view(b * kv_heads, group * length, seq)
    return torch.bmm(probs, v.reshape(b * kv_heads, seq, dim)).view(b, heads, length, dim)


class LayerScale(nn.Module):
    """A learned per-channel gain on a residual branch (the codec's transformers)."""

    def __init__(self, dim: int, initial: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), initial))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x
