"""The Omni thinker's row-invariant pieces: the experts and attention functions it registers with
transformers' interfaces for its decode step and its prompt packs, and the row caches they write. A
position's numbers depend only on its own inputs and its own row, whatever else the step or the pack
holds (see pipeline/omni/thinker.py)."""
from __future__ import annotations

import torch

# The decode step's and the pack's experts and attention, under these names in transformers' interfaces.
ROW_EXPERTS = "row_invariant"
ROW_ATTENTION = "row_invariant_decode"
PACK_EXPERTS = "row_invariant_grouped"
PACK_ATTENTION = "row_invariant_packed"
PACK_SDPA = "row_invariant_packed_sdpa"


def _row_experts_forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward (stacked `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) through the
    row-invariant kernels, skipping the rows its thinker marks inactive (`experts.active_rows`)."""
    from pipeline.kernels.experts import routed_experts

    return routed_experts(hidden_states, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj, experts.active_rows)


def _row_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                           scaling: float, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function for the decode step: each row attends to the prefix of keys its
    mask leaves open (the step's mask is causal, so that prefix is every key it attends to)."""
    from pipeline.kernels.row_attention import decode_attention

    lengths = (attention_mask[:, 0, -1] == 0).sum(-1)
    return decode_attention(query, key, value, lengths, scaling), None


def _pack_experts_forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward for a pack through the fixed-tile grouped kernel, skipping the pack's
    unused positions (`experts.active_tokens`)."""
    from pipeline.kernels.grouped_experts import grouped_experts

    return grouped_experts(hidden_states, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj, experts.active_tokens)


def _pack_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float, token_rows: torch.Tensor, token_lengths: torch.Tensor, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function for a pack: query [1, H, T, D], key and value the layer's whole
    cache [rows, Hkv, positions, D]; position t attends to the first `token_lengths[t]` keys of row
    `token_rows[t]` (its prompt's keys up to itself, this pack's included: they are written first)."""
    from pipeline.kernels.row_attention import pack_attention

    return pack_attention(query[0].transpose(0, 1), key, value, token_rows, token_lengths, scaling)[None], None


def _pack_sdpa_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                       scaling: float, token_rows: torch.Tensor, token_lengths: torch.Tensor, **kwargs) -> tuple[torch.Tensor, None]:
    """The same through PyTorch's SDPA (the CPU's): each position as a decode row of its own, its row's keys
    gathered and the keys past its length masked (every call the same shape: the whole cache)."""
    keys, values = key[token_rows], value[token_rows]
    open_keys = torch.arange(key.shape[2], device=key.device)[None] < token_lengths[:, None]
    mask = torch.where(open_keys, 0.0, torch.finfo(query.dtype).min).to(query.dtype)[:, None, None]
    out = torch.nn.functional.scaled_dot_product_attention(query[0].transpose(0, 1)[:, :, None], keys, values, attn_mask=mask,
                                                           scale=scaling, enable_gqa=True)
    return out[:, :, 0][None], None


def register_row_kernels() -> None:
    """Make the functions above known to transformers' interfaces under their names (again is harmless)."""
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(ROW_EXPERTS, _row_experts_forward)
    AttentionInterface.register(ROW_ATTENTION, _row_attention_forward)
    ExpertsInterface.register(PACK_EXPERTS, _pack_experts_forward)
    AttentionInterface.register(PACK_ATTENTION, _pack_attention_forward)
    AttentionInterface.register(PACK_SDPA, _pack_sdpa_forward)


class RowKV:
    """Keys and values of every layer for every row, [layers, rows, heads, max_len + 1, head_dim]; each
    `update` (called by transformers' attention in the decode step) writes row r's one new key at
    `write_at[r]`, a device tensor (its position, or the sink `max_len` for a row that holds no
    conversation), so a graph replay writes where each row stands."""

    def __init__(self, layers: int, rows: int, heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.keys = torch.zeros(layers, rows, heads, max_len + 1, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.sink = max_len
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)  # where each row's next key goes
        self.write_at = torch.zeros(rows, dtype=torch.long, device=device)
        self.row_ids = torch.arange(rows, device=device)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        # key, value: [rows, heads, 1, head_dim]
        self.keys[layer_idx][self.row_ids, :, self.write_at] = key[:, :, 0]
        self.values[layer_idx][self.row_ids, :, self.write_at] = value[:, :, 0]
        return self.keys[layer_idx], self.values[layer_idx]


class PackKV:
    """A pack's writes into the rows' caches: position t's key and value go to row `rows[t]` at `write_at[t]`
    (its place in its prompt; the sink for an unused position), device tensors: `rows` set before each pack,
    `write_at` derived at its start (in its graph) from the pack's positions."""

    def __init__(self, kv: RowKV, tokens: int):
        self.kv = kv
        self.rows = torch.zeros(tokens, dtype=torch.long, device=kv.keys.device)
        self.write_at = torch.full((tokens,), kv.sink, dtype=torch.long, device=kv.keys.device)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        # key, value: [1, heads, tokens, head_dim]
        self.kv.keys[layer_idx][self.rows, :, self.write_at] = key[0].transpose(0, 1)
        self.kv.values[layer_idx][self.rows, :, self.write_at] = value[0].transpose(0, 1)
        return self.kv.keys[layer_idx], self.kv.values[layer_idx]
