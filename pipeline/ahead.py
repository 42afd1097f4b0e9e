"""Every Triton kernel a model launches compiled before its first run, many at once.

A kernel compiles at its first launch with a new specialization, one after another: on an H100 the
0.6B's engine spent ~30 s of a cold start compiling ~50 kernels this way. Inside `compile_ahead`,
every kernel launch (`launch`) starts its compile on a thread pool instead of running (Triton's
`AsyncCompileMode`), and a graph's capture (`pipeline.graphs.CUDAGraphed.capture`) runs its function
once to reach those launches, without capturing; meanwhile what PyTorch compiles (torch.compile'd
functions, where the engine has any) compiles in this thread. On leaving, every compile has finished and sits in its
kernel's cache, so the captures that follow compile nothing.

The pass runs the graphs' functions with their kernels not launched: the PyTorch operations between
them run on values no kernel wrote, as a capture's warm-up runs do on idle rows; nothing reads them.
The mode is per thread (context variables): another engine of the process that launches a kernel
meanwhile compiles and runs it as usual. Without `AsyncCompileMode` (Triton before 3.4), the pass is
skipped and the captures compile as they go."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar

# Inside `compile_ahead`: the launches already handed to the compile threads in this pass (`_launch_key`).
_AHEAD: ContextVar[set | None] = ContextVar("compile_ahead", default=None)


def compiling_ahead() -> bool:
    """Whether this thread is inside `compile_ahead` (launches compile, captures only run once)."""
    return _AHEAD.get() is not None


def launch(kernel, grid, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`; inside `compile_ahead`, its compile started instead, once per
    specialization: each hand-over costs ~0.4 ms of Triton's Python even when the kernel is cached,
    and the pass reaches the same launch once per layer and per graph."""
    handed = _AHEAD.get()
    if handed is None:
        kernel[grid](*args, **kwargs)
        return
    key = _launch_key(kernel, args, kwargs)
    if key in handed:
        return
    handed.add(key)
    kernel.warmup(*args, grid=grid, **kwargs)


def _launch_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """What tells two launches of `kernel` apart at least as finely as Triton's specialization does:
    each tensor's dtype, device and 16-byte alignment, every other argument's value (Triton keys
    integers by divisibility, a class of values; floats by type)."""
    def part(value):
        if hasattr(value, "data_ptr"):
            return value.dtype, value.device, value.data_ptr() % 16 == 0
        if isinstance(value, float):
            return float
        return value if isinstance(value, (bool, int, str, type(None))) else repr(value)

    return kernel, *(part(value) for value in args), *((name, part(value)) for name, value in sorted(kwargs.items()))


def compile_workers() -> int:
    """Threads that compile: the CPU cores this process may use (ptxas and LLVM's passes run outside the GIL)."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


@contextlib.contextmanager
def compile_ahead(workers: int | None = None) -> Iterator[bool]:
    """Inside: this thread's kernel launches compile on `workers` threads instead of running. Yields
    whether the pass compiles anything ahead (False without Triton's asynchronous compile: callers skip it)."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        yield False
        return
    with ThreadPoolExecutor(workers or compile_workers(), thread_name_prefix="compile") as pool, AsyncCompileMode(pool):
        token = _AHEAD.set(set())
        try:
            yield True
        finally:
            _AHEAD.reset(token)
