"""Streaming state and the causal convolutions that keep it, shared by the codec's decoder layers.

Every stateful layer keeps the tail of its input in a preallocated `StreamState`, updated in place,
so chunked decoding equals offline decoding whatever the chunk sizes, and a CUDA graph captured
over the state stays valid. On a GPU with the fused kernels the convolutions run in
pipeline.codec.convolution, reading the same state and weights.
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.codec.convolution import causal_conv, conv_taps, conv_weight, fused_convolutions_available, transposed_conv, transposed_taps, transposed_weight


def rederive_after_load(module: nn.Module, incompatible_keys) -> None:
    """load_state_dict post-hook: rebuild `module`'s derived buffers from the loaded parameters."""
    module._derive_()


def derive_unless_meta_(module: nn.Module) -> None:
    """Build `module`'s derived buffers now, except on the meta device, where the loaders build modules
    and the load's post-hook (`rederive_after_load`) derives them from the loaded tensors: an operation on
    meta tensors imports torch._dynamo, seconds of a start."""
    if torch.empty(0).device.type != "meta":  # the device modules are being built on
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


class StreamState:
    """The streaming state of every stateful layer below `root`, for `batch_size` rows.

    Each stateful layer defines `init_state(batch_size, device, dtype)` (zeroed buffers, batch
    first), reads `state[self]` in forward and writes it through `update`. The buffers are views
    into one flat tensor per dtype (`flat`, [batch_size, n]), so a row of the whole state is one
    slice: saved, restored or swapped with one copy. Every change is in place, so a CUDA graph
    captured with this object stays valid. `started` (host side) is False until the stream's
    first call has ended (`LookaheadConvTranspose1d` trims that call differently).
    """

    def __init__(self, root: nn.Module, batch_size: int = 1):
        p = next(root.parameters())
        states = {}
        for m in root.modules():
            if hasattr(m, "init_state"):
                s = m.init_state(batch_size, p.device, p.dtype)
                if s is not None:
                    states[m] = s
        tensors = [t for s in states.values() for t in (s if isinstance(s, tuple) else (s,))]
        self.flat: dict[torch.dtype, torch.Tensor] = {}
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            width = sum(t[0].numel() for t in tensors if t.dtype == dtype)
            self.flat[dtype] = torch.zeros(batch_size, width, device=p.device, dtype=dtype)
        offsets = dict.fromkeys(self.flat, 0)

        def view(t: torch.Tensor) -> torch.Tensor:
            start, n = offsets[t.dtype], t[0].numel()
            offsets[t.dtype] += n
            return self.flat[t.dtype][:, start:start + n].view(t.shape)

        self._states = {m: tuple(map(view, s)) if isinstance(s, tuple) else view(s) for m, s in states.items()}
        self.started = False

    def __getitem__(self, layer: nn.Module):
        return self._states[layer]

    def update(self, buffer: torch.Tensor, value: torch.Tensor) -> None:
        """`buffer` (one of this state's tensors) <- `value`, in place."""
        buffer.copy_(value)

    def reset(self) -> None:
        for t in self.flat.values():
            t.zero_()
        self.started = False

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.flat.values()]


def _history(layer: nn.Module, x: torch.Tensor, state: StreamState, context: int) -> torch.Tensor:
    """`x` [B, C, T] with the stream's previous `context` input steps prepended (zeros at the start
    of a stream: causal zero padding); the stored tail is advanced in place."""
    tail = state[layer]
    x = torch.cat((tail, x), dim=-1)
    state.update(tail, x[..., x.shape[-1] - context:])
    return x


class _KeepsInputs(nn.Module):
    """A conv layer whose stream state is its last `context` inputs (zeros at a stream's start).

    Where the fused kernels run (`fused_convolutions_available` for its weight), a layer that has a
    fused form keeps its weight tap-major (`taps`), the checkpoint's parameter a view of it; elsewhere
    `taps` is None and the parameter is plain. `_derive_` builds either after a load and after any
    move or cast of the module (`_apply`)."""

    conv: nn.Module
    context: int
    taps: torch.Tensor | None

    def init_state(self, batch_size: int, device, dtype):
        if self.context:
            return torch.zeros(batch_size, self.conv.in_channels, self.context, device=device, dtype=dtype)

    def _derive_(self) -> None:
        weight = self.conv.weight
        taps = self._taps(weight) if self.fusable and fused_convolutions_available(weight) else None
        # Set through .data: the parameter object (and its name in the state dict) stays.
        weight.data = self._weight(taps) if taps is not None else weight.data.contiguous()
        self.register_buffer("taps", taps, persistent=False)

    def runs_fused(self, x: torch.Tensor) -> bool:
        """Whether a call on `x` runs in the fused kernels: the layer holds its taps and they run for `x`."""
        return self.taps is not None and fused_convolutions_available(x)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._derive_()  # on the new device or dtype the kernels may run or not
        return self


class CausalConv1d(_KeepsInputs):
    """Stride-1 conv whose left context is the stream's previous input (zeros at the start). Dense
    ones (groups=1) read their weight tap-major (`taps` [k, out, in]) in the fused kernels."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.context = (kernel_size - 1) * dilation
        self.fusable = groups == 1
        self.register_buffer("taps", None, persistent=False)
        self.register_load_state_dict_post_hook(rederive_after_load)
        derive_unless_meta_(self)

    @staticmethod
    def _taps(weight: torch.Tensor) -> torch.Tensor:
        return conv_taps(weight)

    @staticmethod
    def _weight(taps: torch.Tensor) -> torch.Tensor:
        return conv_weight(taps)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        if self.runs_fused(x):
            return causal_conv(x, self.taps, self.conv.bias, self.conv.dilation[0], state[self] if self.context else None, state)
        if self.context:
            x = _history(self, x, state, self.context)
        return self.conv(x)


class CausalConvTranspose1d(_KeepsInputs):
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
        self.fusable = kernel_size % stride == 0  # the fused form's taps are whole strides of the kernel
        self.register_buffer("taps", None, persistent=False)
        self.register_load_state_dict_post_hook(rederive_after_load)
        derive_unless_meta_(self)

    def _taps(self, weight: torch.Tensor) -> torch.Tensor:
        # The fused kernels' form: a convolution over input steps whose outputs are the stride phases.
        return transposed_taps(weight, self.stride)

    def _weight(self, taps: torch.Tensor) -> torch.Tensor:
        return transposed_weight(taps, self.stride)

    def _derive_(self) -> None:
        super()._derive_()
        self.register_buffer("phase_bias", self.conv.bias.detach().repeat(self.stride), persistent=False)

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        if self.runs_fused(x):
            return transposed_conv(x, self.taps, self.phase_bias, self.stride, state[self] if self.context else None, state)
        n = x.shape[-1]
        if self.context:
            x = _history(self, x, state, self.context)
        start = self.context * self.stride
        return self.conv(x)[..., start:start + n * self.stride]


class LookaheadConvTranspose1d(CausalConvTranspose1d):
    """Transposed conv trimmed by kernel - stride on both sides, as Qwen3-Omni's code2wav: output
    step t depends on input t // stride and the `context` inputs before or after it, so offline
    decoding never makes the last (kernel - stride) outputs, and a stream's output lags its input
    by the same amount (the look-ahead). Streaming keeps the last `context` inputs and emits, per
    call, exactly the outputs that no later input can change: stride outputs per input, the causal
    transposed conv's, less the first kernel - stride in a stream's first call. Concatenated, they
    equal the offline output.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        if kernel_size > 2 * stride:
            raise ValueError("a look-ahead transposed conv needs kernel_size <= 2 * stride")
        super().__init__(in_channels, out_channels, kernel_size, stride)
        self.trim = kernel_size - stride

    def forward(self, x: torch.Tensor, state: StreamState) -> torch.Tensor:
        out = super().forward(x, state)
        return out if state.started else out[..., self.trim:]
