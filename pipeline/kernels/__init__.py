"""Fused Triton kernels for the decode step: `fused_decode` (five kernels per transformer layer),
`fused_decode_logits` (the same, then the final norm and an output head in one kernel, optionally
writing the normed state too), `fused_sample` (the sampling chain in one kernel) and
`fused_prefill` (a prompt's prefill without torch.compile) are the entry points;
`pipeline.kernels.sampling` also has the frame's glue as kernels (`code_step`, `next_token`).

`fused_decode` computes what `Transformer.decode` computes, for every cache row at once, reading
the same modules' weights and writing the same KV caches, so the rest of the engine is unchanged.

Every entry point takes the engine's `KernelConfig` (pipeline.kernels.config: the tiles and launch
options of the GPU's architecture, chosen when the engine is built).

This package imports Triton only when a kernel runs (its submodules do, at their import): a
CPU-only install has no Triton (PyTorch's CUDA wheels bring it), and the engine imports this package
and the row state below whatever its device."""
from __future__ import annotations

import importlib.util
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from pipeline.kernels.config import KernelConfig
from pipeline.model import MLP, Transformer

if TYPE_CHECKING:  # pipeline.engine imports this package
    from pipeline.engine.sampling import RowSampling
    from pipeline.kernels.decode import Workspace


class FrameText(NamedTuple):
    """The talker's text per row: trailing [rows, max_seq, H] (row r's text for frame f at [r, f]),
    length [rows] (positions written), pad [H] (fed once the text is used up)."""

    trailing: torch.Tensor
    length: torch.Tensor
    pad: torch.Tensor


@dataclass(frozen=True)
class RowState:
    """The per-row decode state that the end of a frame reads and advances ([rows] tensors; seen [rows, V])."""

    seed_hash: torch.Tensor
    frame: torch.Tensor
    seen: torch.Tensor
    penalty: torch.Tensor
    active: torch.Tensor
    token: torch.Tensor
    max_frame: torch.Tensor
    text_len: torch.Tensor
    text_end: torch.Tensor
    pos: torch.Tensor
    produced: torch.Tensor


_WORKSPACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its split-K workspace


def fused_available(device: torch.device) -> bool:
    """Whether the fused kernels are the default on `device`: CUDA GPUs of compute capability 8.0 or
    newer (Triton's bf16 tensor-core dots) with Triton installed. Elsewhere only Triton's
    interpreter (TRITON_INTERPRET=1, the CPU tests) runs them."""
    return (device.type == "cuda" and importlib.util.find_spec("triton") is not None
            and torch.cuda.get_device_capability(device) >= (8, 0))


def fused_supported(model: Transformer) -> bool:
    """Dense Qwen3 layers with power-of-two head sizes (the kernels tile a head in two halves), of
    at least 16 columns a half in bf16/fp16 (tensor-core tiles; float32 dots run exact, on any
    size); a sparse-MoE stack (Qwen3-Omni's talker) keeps the unfused step."""
    head_dim = model.layers[0].self_attn.head_dim
    half_precision = model.norm.weight.dtype != torch.float32
    return (all(isinstance(layer.mlp, MLP) for layer in model.layers) and head_dim >= 2 and head_dim & (head_dim - 1) == 0
            and (head_dim >= 32 or not half_precision))


@torch.inference_mode()
def fused_decode(model: Transformer, x: torch.Tensor, positions: torch.Tensor, config: KernelConfig) -> torch.Tensor:
    """`model.decode(x, positions)` in fused kernels: x [rows, L, hidden] for every cache row at `positions` [rows, L]."""
    from pipeline.kernels.decode import rms_norm

    rows, length, hidden = x.shape
    return rms_norm(_layers(model, x, positions, config), model.norm, config).view(rows, length, hidden)


@torch.inference_mode()
def fused_decode_logits(model: Transformer, x: torch.Tensor, positions: torch.Tensor, head: torch.Tensor, config: KernelConfig,
                        normed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(model.decode(x, positions)[:, -1], head).float()` in fused kernels: the final RMSNorm
    of the last position in the prologue of the head's matmul, float32 logits [rows, vocab] out of its
    epilogue (one kernel for the three; the code predictor runs it 15 times a frame). `normed`
    [rows, hidden]: receives `model.decode(x, positions)[:, -1]` too (the talker's next hidden state)."""
    from pipeline.kernels.decode import linear

    rows, length, hidden = x.shape
    last = _layers(model, x, positions, config, following=head).view(rows, length, hidden)[:, -1]
    logits = torch.empty(rows, head.shape[0], dtype=torch.float32, device=x.device)
    return linear(last, head, logits, workspace_of(model), config, norm=model.norm, normed=normed)


@torch.inference_mode()
def fused_linear(model: Transformer, module: torch.nn.Linear, x: torch.Tensor, out: torch.Tensor, config: KernelConfig) -> torch.Tensor:
    """`module(x)` into out [rows, L, out_features] in the decode step's matmul kernel (x [rows, L,
    in_features], contiguous), on `model`'s workspace: the step that runs before `model`'s layers (the
    1.7B's code-predictor input projection). Its arithmetic does not depend on the number of rows,
    as cuBLAS's does (it picks its algorithm by M)."""
    from pipeline.kernels.decode import linear

    rows, length, features = x.shape
    linear(x.view(rows * length, features), module.weight, out.view(rows * length, -1), workspace_of(model), config, bias=module.bias,
           following=model.layers[0].self_attn.qkv_proj.weight)
    return out


def _layers(model: Transformer, x: torch.Tensor, positions: torch.Tensor, config: KernelConfig,
            following: torch.Tensor | None = None) -> torch.Tensor:
    """The residual stream [rows * L, hidden] after every layer of `model` (before the final norm);
    `following`: the weight of the matmul after the last layer (an output head)."""
    from pipeline.kernels.decode import decoder_layer

    workspace = workspace_of(model)
    rows, length, hidden = x.shape
    source = x.reshape(rows * length, hidden).contiguous()
    # The residual stream: the first layer reads x and writes it, the others update it in place (no copy of x).
    h = torch.empty_like(source)
    flat_positions = positions.reshape(-1).contiguous()
    after = [layer.self_attn.qkv_proj.weight for layer in model.layers[1:]] + [following]
    for layer, weight in zip(model.layers, after):
        decoder_layer(layer, source, h, flat_positions, length, model.rope_cos, model.rope_sin, workspace, config, following=weight)
        source = h
    return h


def workspace_of(model: torch.nn.Module) -> "Workspace":
    """`model`'s split-K workspace (one per model: two models' steps may run at once)."""
    from pipeline.kernels.decode import Workspace

    workspace = _WORKSPACES.get(model)
    return workspace if workspace is not None else _WORKSPACES.setdefault(model, Workspace())


def fused_prefill(model: Transformer, x: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """`model.prefill(x, row)` in pipeline.kernels.prefill's kernels, cuBLAS's matmuls and SDPA's attention."""
    from pipeline.kernels.prefill import prefill

    return prefill(model, x, row)


def fused_sample(logits: torch.Tensor, settings: "RowSampling", noise: torch.Tensor, config: KernelConfig) -> torch.Tensor:
    """`pipeline.engine.sampling.sample_rows` in one kernel (CUDA; Triton's interpreter on CPU)."""
    from pipeline.kernels.sampling import sample

    return sample(logits, settings, noise, config)
