"""The sparse mixture-of-experts MLP of Qwen3-Omni's talker, as a graph-safe step.

transformers' block loops over the experts that some token picked (`nonzero`, a host sync), so a
decode step that contains it cannot be captured in a CUDA graph. Here every shape is fixed: the
router picks `top_k` experts per token, their weights are gathered per token, and the token's
output is their weighted sum plus the gated shared expert. A token's result depends on its own
input only (no grouping of tokens by expert), so a row's numbers never depend on its neighbours.

Parameter names are transformers' (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
[E, H, I]); the released checkpoint stores each expert separately (`experts.{e}.gate_proj.weight`,
...), and a load pre-hook stacks those, as transformers' own conversion does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many tokens (the decode step's rows), each token's chosen experts' weights are gathered
# (~14 MB a token at the released talker's size); a prompt's tokens instead go through every expert
# at once and keep what they chose, which needs memory by the expert rather than by the token (a
# 512-token prompt gathered would ask for 7 GB).
GATHER_TOKENS = 16


class MLP(nn.Module):
    """The gated shared expert (names as the checkpoint's `shared_expert`)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden))


class Experts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, experts: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(experts, hidden, intermediate))
        self.register_load_state_dict_pre_hook(_stack_experts)


def _stack_experts(module: Experts, state_dict: dict, prefix: str, *args) -> None:
    """Per-expert tensors of the released checkpoint -> the stacked parameters."""
    experts = module.gate_up_proj.shape[0]
    names = [f"{prefix}{e}.{part}.weight" for e in range(experts) for part in ("gate_proj", "up_proj", "down_proj")]
    if not all(name in state_dict for name in names):
        return  # stacked already (or incomplete: load_state_dict then names what is missing)
    gate_up = [torch.cat([state_dict.pop(f"{prefix}{e}.gate_proj.weight"), state_dict.pop(f"{prefix}{e}.up_proj.weight")])
               for e in range(experts)]
    state_dict[f"{prefix}gate_up_proj"] = torch.stack(gate_up)
    state_dict[f"{prefix}down_proj"] = torch.stack([state_dict.pop(f"{prefix}{e}.down_proj.weight") for e in range(experts)])


class SparseMoeBlock(nn.Module):
    """x [..., H] -> [..., H]: softmax router in float32, top-k experts per token (their weights
    renormalised if `norm_topk_prob`), SiLU-gated experts, plus sigmoid-gated shared expert."""

    def __init__(self, hidden: int, moe_intermediate: int, experts: int, top_k: int, shared_intermediate: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob, self.intermediate = top_k, norm_topk_prob, moe_intermediate
        self.gate = Router(hidden, experts)
        self.experts = Experts(hidden, moe_intermediate, experts)
        self.shared_expert = MLP(hidden, shared_intermediate)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.linear(x, self.gate.weight).softmax(-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        routed = self._gathered(x, weights, chosen) if len(x) <= GATHER_TOKENS else self._through_every_expert(x, weights, chosen)
        out = routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each token's top-k experts, [N, H] -> [N, H], their weights gathered per token."""
        gate_up = self.experts.gate_up_proj[chosen]  # [N, k, 2I, H]
        h = torch.einsum("nkih,nh->nki", gate_up, x)
        gate, up = h.split(self.intermediate, dim=-1)
        routed = torch.einsum("nkhi,nki->nkh", self.experts.down_proj[chosen], F.silu(gate) * up)
        return (routed * weights[..., None]).sum(1)

    def _through_every_expert(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The same sum with every expert applied to every token and weighted 0 where not chosen."""
        h = torch.einsum("eih,nh->eni", self.experts.gate_up_proj, x)  # [E, N, 2I]
        gate, up = h.split(self.intermediate, dim=-1)
        routed = torch.einsum("ehi,eni->enh", self.experts.down_proj, F.silu(gate) * up)  # [E, N, H]
        mix = torch.zeros(len(x), routed.shape[0], dtype=x.dtype, device=x.device).scatter(1, chosen, weights)  # [N, E]
        return torch.einsum("enh,ne->nh", routed, mix)
