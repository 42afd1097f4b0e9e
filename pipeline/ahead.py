"""Every Triton kernel a model launches compiled before its first run, many at once.

A kernel compiles at its first launch with a new specialization, one after another: on an H100 the
0.6B's engine spent ~30 s of a cold start compiling ~50 kernels this way. Inside `compile_ahead`,
every kernel launch (`launch`) starts its compile on a thread pool instead of running (Triton's
`AsyncCompileMode`), and a graph's capture (`pipeline.graphs.CUDAGraphed.capture`) runs its function
once to reach those launches, without capturing; meanwhile what PyTorch compiles (torch.compile's
prefill layer) compiles in this thread. On leaving, every compile has finished and sits in its
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

_AHEAD: ContextVar[bool] = ContextVar("compile_ahead", default=False)


def compiling_ahead() -> bool:
    """Whether this thread is inside `compile_ahead` (launches compile, captures only run once)."""
    return _AHEAD.get()


def launch(kernel, grid, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`; inside `compile_ahead`, its compile started instead."""
    if _AHEAD.get():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


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
        token = _AHEAD.set(True)
        try:
            yield True
        finally:
            _AHEAD.reset(token)
