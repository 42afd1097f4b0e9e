"""The one helper for CUDA-graph capture, used by every graphed call site (decode step, prefill, vocoder)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipeline.ahead import compile_ahead, compiling_ahead


class GraphPool:
    """One memory pool and one capture stream for graphs that never replay at the same time (their
    callers serialise them): a graph captured into it reuses the memory the graphs captured before it
    needed only while they ran, rather than holding its own. The allocator hands a freed block only to
    the stream it was freed on, so sharing the memory means sharing the stream (and its cuBLAS
    workspace, which is safe for graphs that never overlap)."""

    def __init__(self, priority: int = 0):
        self.priority = priority
        self.handle: Any = None
        self.stream: torch.cuda.Stream | None = None

    def open(self) -> tuple[Any, torch.cuda.Stream]:
        if self.stream is None:
            self.handle, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(priority=self.priority)
        return self.handle, self.stream


class CUDAGraphed:
    """`fn()` over static buffers: eager where graphs are off, else captured on the first call
    (after warm-up runs on a side stream, as capture requires) and replayed from then on.

    `priority` (lower is more urgent, as CUDA's) is given to the graph's kernels.
    `shared`: the pool (and stream) of graphs this one never overlaps; None: its own.
    `fn` takes no arguments: it reads and writes tensors that live as long as this object, so a
    replay sees whatever the caller copied into them. Its return value (tensors, possibly nested
    in tuples) is static too: the next call overwrites it. Warm-up runs execute `fn` for real, so
    callers capture while its writes are harmless (e.g. every row of the batch inactive).
    `ahead`: whether `fn` may run once with its Triton kernels not launched, to compile them ahead
    (pipeline.ahead); not where a PyTorch operation in it indexes with what a kernel wrote (an
    unwritten index would read out of bounds), whose kernels then compile at its capture.
    """

    def __init__(self, fn: Callable[[], Any], enabled: bool, warmup: int = 1, priority: int = 0, shared: GraphPool | None = None,
                 ahead: bool = True):
        self.fn, self.enabled, self.warmup, self.priority, self.shared = fn, enabled, warmup, priority, shared
        self.ahead = ahead
        self.graph: torch.cuda.CUDAGraph | None = None
        self.stream: torch.cuda.Stream | None = None
        self.output: Any = None

    def __call__(self) -> Any:
        if not self.enabled:
            return self.fn()
        if self.graph is None:
            self.capture()
        self.graph.replay()
        return self.output

    def capture(self) -> None:
        if compiling_ahead():  # only reach the kernels' launches, which compile meanwhile (pipeline.ahead)
            if self.ahead:
                self.fn()
            return
        # Warm-up and capture on a stream of this graph's own. cuBLAS keeps one workspace per
        # stream, and a graph replays the workspace of the stream it was captured on: graphs
        # captured on torch's shared default capture stream share one workspace, and two of them
        # replayed at once on two streams (the decode step and the vocoder) race in it. That race
        # made the same seed give different codes from run to run.
        # The graph's kernels keep the priority of the stream they were captured on.
        pool, stream = self.shared.open() if self.shared else (None, torch.cuda.Stream(priority=self.priority))
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                self.fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self.output = self.fn()
        self.graph, self.stream = graph, stream  # the stream (and its workspace) lives as long as the graph


def capture_all(captures: Sequence[Callable[[], Any]], progress: Callable[[int, int], None] | None = None) -> None:
    """Run every capture (each makes one or more graphs; see `captures()` of the engine's decoder and
    vocoder): first once with the kernels compiling ahead, all at once (pipeline.ahead), then for
    real, calling `progress(done, total)` after each."""
    with compile_ahead() as ahead:
        if ahead:
            for capture in captures:
                capture()
    for done, capture in enumerate(captures, 1):
        capture()
        if progress is not None:
            progress(done, len(captures))
