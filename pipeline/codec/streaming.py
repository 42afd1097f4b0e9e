"""Streaming state and the causal convolutions that keep it, shared by the codec's decoder layers.

Every stateful layer keeps the tail of its input in a preallocated `StreamState`, updated in place,
so chunked decoding equals offline decoding whatever the chunk sizes, and a CUDA graph captured
over the state stays valid. A state holds one row per stream; with an advance mask only some rows
move, so one call can decode streams that joined, paused or left at different times.
"""
from __future__ import annotations

import torch
from torch import nn


def rederive_after_load(module: nn.Module, incompatible_keys) -> None:
    """load_state_dict post-hook: rebuild `module`'s derived buffers from the loaded parameters."""
    module._derive_()


def derive_all_(module: nn.Module) -> None:
    """Rebuild every derived buffer below `module` (after changing parameters by hand)."""
    for m in module.modules():
        if hasattr(m, "_derive_"):
            m._derive_()


def exact_float32_convolutions():
    """cuDNN convolutions without TF32 (PyTorch's default allows it): with TF32, chunked and offline
    decoding round differently (~2e-3 on an H200) and encoded reference codes drift from the CPU's."""
    cudnn = torch.backends.cudnn
    return cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic, allow_tf32=False)


def _per_row(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`mask` [batch] shaped to broadcast over `like` [batch, ...]."""
    return mask.view(-1, *(1,) * (like.dim() - 1))


class StreamState:
    """The streaming state of every stateful layer below `root`, preallocated for `batch_size` rows.

    Each stateful layer defines `init_state(batch_size, device, dtype)` (its buffers, batch first),
    reads `state[self]` in forward and writes it through `update`. Every change is in place, so a
    CUDA graph captured with this object stays valid across calls, resets and row restores.

    Without an advance mask every row advances on each call. `set_active(mask)` makes `update`
    change only the rows where `active` is True; switch between masked and unmasked before a
    capture, since the two run different kernels.
    """

    def __init__(self, root: nn.Module, batch_size: int = 1):
        p = next(root.parameters())
        self.device = p.device
        self.active: torch.Tensor | None = None
        self._states = {}
        for m in root.modules():
            if hasattr(m, "init_state"):
                s = m.init_state(batch_size, p.device, p.dtype)
                if s is not None:
                    self._states[m] = s

    def __getitem__(self, layer: nn.Module):
        return self._states[layer]

    def _tensors(self) -> list[torch.Tensor]:
        return [t for s in self._states.values() for t in (s if isinstance(s, tuple) else (s,))]

    def set_active(self, mask: torch.Tensor | None) -> None:
        """Advance only the rows where `mask` (bool [batch]) is True from now on; None: every row.

        The mask is copied into `self.active`, which stays the same tensor: change it in place
        (`state.active.copy_(...)`) and a CUDA graph captured over this state sees the change."""
        if mask is None:
            self.active = None
        elif self.active is None:
            self.active = mask.to(device=self.device, dtype=torch.bool).clone()
        else:
            self.active.copy_(mask)

    def update(self, buffer: torch.Tensor, value: torch.Tensor) -> None:
        """`buffer` (one of this state's tensors) <- `value` in place, in the active rows only."""
        if self.active is None:
            buffer.copy_(value)
        else:
            buffer.copy_(torch.where(_per_row(self.active, buffer), value, buffer))

    def reset(self) -> None:
        for t in self._tensors():
            t.zero_()

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Zero the rows where `rows` (bool [batch]) is True, in place: each starts a new stream."""
        rows = rows.to(self.device)
        for t in self._tensors():
            t.masked_fill_(_per_row(rows, t), 0)

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self._tensors()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, value in zip(self._tensors(), saved, strict=True):
            t.copy_(value)

    def restore_row(self, row: int, saved: list[torch.Tensor]) -> None:
        """Copy a one-row snapshot (`StreamState(root, batch_size=1).snapshot()`, e.g. of a stream
        primed with a voice's reference codes) into `row`, in place; the other rows are untouched."""
        tensors = self._tensors()
        # Checked before any copy, so a wrong snapshot leaves the row as it was.
        if [tuple(v.shape) for v in saved] != [(1, *t.shape[1:]) for t in tensors]:
            raise ValueError("restore_row needs a one-row snapshot of this model's streaming state")
        for t, value in zip(tensors, saved):
            t[row].copy_(value[0])


def _history(layer: nn.Module, x: torch.Tensor, state: StreamState, context: int) -> torch.Tensor:
    """`x` [B, C, T] with the stream's previous `context` input steps prepended (zeros at the start
    of a stream: causal zero padding); the stored tail is advanced in place."""
    tail = state[layer]
    x = torch.cat((tail, x), dim=-1)
    state.update(tail, x[..., x.shape[-1] - context:])
    return x


class CausalConv1d(nn.Module):
    """Stride-1 conv whose left context is the stream's previous input (zeros at the start)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.context = (kernel_size - 1) * dilation

    def init_state(self, batch_size: int, device, dtype):
        if self.context:
            return torch.zeros(batch_size, self.conv.in_channels, self.context, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        if self.context:
            x = _history(self, x, state, self.context)
        return self.conv(x)


class CausalConvTranspose1d(nn.Module):
    """Transposed conv trimmed to exactly `stride` outputs per input step.

    Output step t depends on inputs t // stride and the (kernel-1) // stride inputs before it, so
    the layer keeps those inputs (not the output overlap) and recomputes the overlap: the same
    history mechanism as the convs, and the bias is added once per output sample.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.context = (kernel_size - 1) // stride

    def init_state(self, batch_size: int, device, dtype):
        if self.context:
            return torch.zeros(batch_size, self.conv.in_channels, self.context, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        n = x.shape[-1]
        if self.context:
            x = _history(self, x, state, self.context)
        start = self.context * self.stride
        return self.conv(x)[..., start:start + n * self.stride]
