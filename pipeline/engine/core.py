"""The engine core: one scheduler loop per loaded model over a batch of rows (vLLM's engine core
has this shape: admit, one batched step, hand out results).

Each loop iteration: apply commands (cancel, more text), admit waiting requests into free rows
(FIFO; their prefill runs between two frames), launch one decode step for every row, then read
the previous step's codes (pinned host buffers, double-buffered) while the GPU works on this one.
A row whose chunk is complete has it vocoded on the vocoder's own CUDA streams (lanes), overlapping
the next decode steps, one row per vocoder call (so that its audio never depends on its
neighbours); a delivery thread hands each chunk to its listener as soon as its audio is on the host.

Callers `submit` a `Job` and get a `Handle`: an iterator of `Chunk`s. Closing it (Stop, the
browser leaving) frees the row before the next frame.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.codec import MultiStreamDecoder
from pipeline.engine.decoder import GENERATION_PRIORITY, BatchDecoder
from pipeline.engine.sampling import SamplingConfig
from pipeline.errors import EngineBusy

log = logging.getLogger(__name__)

DEFAULT_SCHEDULE = (1, 2, 4, 8, 16)  # frames per chunk; the last size repeats
SAMPLE_RATE = 24000
FRAMES_PER_SECOND = 12.5
CLOSE_TIMEOUT_S = 10.0
EARLY_CHUNKS = 4  # a stream's first chunks (1, 2, 4 and 8 frames by default): little audio buffered yet


@dataclass
class Chunk:
    """One piece of streamed audio and where its time went."""

    index: int
    audio: np.ndarray  # float32 [samples] at 24 kHz
    frames: int
    # None where the figure is not known: a remote backend streams audio without its generation timings.
    generate_ms: float | None  # GPU time of the decode steps of this chunk's frames (the first chunk adds the prefill)
    vocode_ms: float | None  # GPU time of the vocoder for them
    elapsed_ms: float  # since the request was submitted, when this chunk was ready; chunk 0's is the TTFA
    audio_seconds: float  # audio streamed so far, this chunk included
    sample_rate: int = SAMPLE_RATE

    @property
    def rtf(self) -> float:
        """Running real-time factor: wall time so far over audio so far (below 1 is faster than real time)."""
        return self.elapsed_ms / 1000.0 / self.audio_seconds if self.audio_seconds else float("inf")


@dataclass
class Queued:
    """The request waits for a free row; `ahead` requests are before it."""

    ahead: int


@dataclass
class Segment:
    """One prefill and the text fed while it speaks; long texts are several segments in one voice."""

    prompt: torch.Tensor  # [1, L, hidden]
    trailing: torch.Tensor  # [T, hidden]
    text_end: bool = True  # False: more text arrives through Handle.append_text
    awaits: int = 0  # the prompt's last positions, still to come through Handle.finish_prompt (prefilled apart)
    chars: int = 0  # characters of the text it speaks, for the warning when it goes unspoken (0: not known, streamed text)


@dataclass
class Job:
    segments: list[Segment]
    sampling: SamplingConfig
    seed: int
    max_frames: int  # over all segments
    schedule: tuple[int, ...] = DEFAULT_SCHEDULE
    vocoder_state: list[torch.Tensor] | None = None  # the vocoder primed with reference codes (voice clone)
    ready: "torch.cuda.Event | None" = None  # recorded after the caller made the tensors above
    segment_frames: int | None = None  # at most this many per segment (None: as many as the decoder has room for)


class Mailbox(queue.Queue):
    """Items from producer threads to one consumer, who either blocks in `get` or, without a thread
    of its own (an event loop), asks to be called back once an item is there (`when_ready`)."""

    def __init__(self) -> None:
        super().__init__()
        self._listeners: list[Callable[[], None]] = []  # guarded by self.mutex

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        with self.mutex:
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener()

    def when_ready(self, listener: Callable[[], None]) -> None:
        """Call `listener()` (from the producer's thread, or here if an item is there already) once an item can be got."""
        with self.mutex:
            if not self._qsize():
                self._listeners.append(listener)
                return
        listener()


@dataclass
class Waiting:
    """Yielded, instead of blocking, by a stream asked not to wait: nothing is ready yet.
    `when_ready(listener)` calls `listener()` once the next item is (see Mailbox)."""

    when_ready: Callable[[Callable[[], None]], None]


def chunk_sizes(schedule: Sequence[int]) -> Iterator[int]:
    if not schedule or any(int(n) < 1 for n in schedule):
        raise ValueError(f"A chunk schedule is a list of positive frame counts, got {list(schedule)}.")
    return itertools.chain(schedule, itertools.repeat(schedule[-1]))


def vocoder_lane(row: int, chunk_index: int, lanes: int) -> int:
    """A stream's first chunks in the first half of the lanes, its steady chunks in the others, by
    row: simultaneous arrivals vocode side by side, a new stream's second chunk (due 80 ms after
    its first) never waits behind a queue of 16-frame chunks, and two running streams' 16-frame
    chunks overlap (one call leaves part of an H200 idle: two calls at once take 1.6x one)."""
    if lanes == 1:
        return 0
    early = (lanes + 1) // 2
    return row % early if chunk_index < EARLY_CHUNKS else early + row % (lanes - early)


class Handle:
    """A submitted request: iterate for `Chunk`s, `close()` to cancel. `events()` also yields
    `Queued` records while the request waits for a row; `events(wait=False)` yields a `Waiting`
    where it would block, so that an event loop can wait for a row without holding a thread."""

    def __init__(self, engine: "Engine", job: Job):
        self.engine, self.job = engine, job
        self.submitted = time.perf_counter()
        self.warnings: list[str] = []
        self.segment_frames: list[int] = []  # frames made by each segment that has ended
        self.stopped = False  # closed by the caller before the end
        self._items = Mailbox()
        self._code_blocks: list[np.ndarray] = []
        self._closed = threading.Event()
        self._released = threading.Event()  # the engine holds nothing of this request any more

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def codes(self) -> torch.Tensor:
        """int64 [frames, 16]: every frame generated so far (all of them once iteration has ended)."""
        if not self._code_blocks:
            return torch.zeros(0, 16, dtype=torch.long)
        return torch.from_numpy(np.concatenate(self._code_blocks))

    def events(self, wait: bool = True) -> Iterator[Chunk | Queued | Waiting]:
        try:
            while True:
                if not wait and self._items.empty():
                    yield Waiting(self._items.when_ready)
                    continue
                item = self._items.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.close()

    def __iter__(self) -> Iterator[Chunk]:
        return (item for item in self.events() if isinstance(item, Chunk))

    def append_text(self, embeds: torch.Tensor, end: bool) -> None:
        """More conditioning text [n, hidden] for the last segment (talker input for the frames to come)."""
        self.engine.append_text(self, embeds, end)

    def finish_prompt(self, rest: torch.Tensor) -> None:
        """The last positions [1, n, hidden] of a prompt submitted with `Segment.awaits` = n: the row,
        its prefix already prefilled, starts speaking."""
        self.engine.finish_prompt(self, rest)

    def close(self) -> None:
        """Cancel (if still running) and wait until the engine has let go of the request."""
        if not self._closed.is_set():
            self.stopped = not self._released.is_set()
            self._closed.set()
            self.engine.cancel(self)
        if threading.current_thread() is not self.engine.thread:
            self._released.wait(CLOSE_TIMEOUT_S)

    # engine side
    def _put(self, item) -> None:
        self._items.put(item)

    def _finish(self, error: BaseException | None = None) -> None:
        if error is not None:
            self._items.put(error)
        self._released.set()  # before the end marker: a consumer that sees the end must see it released
        self._items.put(None)


def cut_warning(cut: list[tuple[int, int]], segments: int) -> str:
    """What the user is told of the segments (index, frame budget) that reached their own frame limit."""
    budget = max(frames for _, frames in cut)
    limit = f"the frame limit of one segment ({budget} frames, {budget / FRAMES_PER_SECOND:.0f} s)"
    if len(cut) == 1:
        return f"Segment {cut[0][0] + 1} of {segments} reached {limit} and was cut there; shorter sentences avoid this."
    numbers = ", ".join(str(index + 1) for index, _ in cut)
    return f"{len(cut)} of {segments} segments ({numbers}) reached {limit} and were cut there; shorter sentences avoid this."


def unspoken_warning(job: Job, segment: int, by_eos: bool) -> str:
    """What the user is told when the job's frame total ends it in (or right after) `segment`, before its last one."""
    left = job.segments[segment + 1 :]
    chars = sum(s.chars for s in left)
    what = "the last segment" if len(left) == 1 else f"the last {len(left)} segments"
    what += f" ({chars:,} characters)" if chars else ""
    where = f"after segment {segment + 1}" if by_eos else f"in segment {segment + 1}"
    rest = "" if by_eos else "the rest of it and "
    return (f"The request's frame limit ({job.max_frames} frames, {job.max_frames / FRAMES_PER_SECOND:.1f} s) was reached {where} of "
            f"{len(job.segments)}: {rest}{what} of the text went unspoken; raise the length limit or leave it at its default.")


class _Timer:
    """GPU time between two points of a stream (CUDA events), or host time on CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.begin = torch.cuda.Event(enable_timing=True) if cuda else None
        self.end = torch.cuda.Event(enable_timing=True) if cuda else None
        self.t0 = self.t1 = 0.0

    def start(self) -> None:
        if self.cuda:
            self.begin.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def ms(self) -> float:
        """After `end` has completed."""
        return self.begin.elapsed_time(self.end) if self.cuda else (self.t1 - self.t0) * 1000.0


@dataclass
class _Row:
    """The engine's bookkeeping of one occupied row."""

    handle: Handle
    row: int
    sizes: Iterator[int]
    segment: int = 0
    frames: int = 0  # in this segment
    budget: int = 0  # frames this segment may make
    limit: int = 0  # frames one segment may make (its budget, unless the job's total leaves it fewer)
    total: int = 0  # frames over all segments
    next_size: int = 0
    codes: list[np.ndarray] = field(default_factory=list)  # of the chunk being made
    generate_ms: float = 0.0
    chunk_index: int = 0
    samples: int = 0
    prefill_timers: list[_Timer] = field(default_factory=list)  # read with the segment's first frame
    cut: list[tuple[int, int]] = field(default_factory=list)  # (segment, frame budget) of the segments cut at their own limit


@dataclass
class _Launch:
    slot: int
    owners: list[_Row | None]


@dataclass
class _Vocoded:
    """A chunk whose audio is on its way to the host; delivered once `done` has completed."""

    handle: Handle
    index: int
    codes: np.ndarray
    audio: torch.Tensor  # pinned host memory on CUDA
    generate_ms: float
    timer: _Timer
    done: "torch.cuda.Event | None"
    audio_seconds: float

    def deliver(self) -> None:
        if self.done is not None:
            self.done.synchronize()  # releases the GIL while the GPU works
        handle = self.handle
        handle._code_blocks.append(self.codes)
        elapsed = (time.perf_counter() - handle.submitted) * 1000.0
        handle._put(Chunk(self.index, self.audio.numpy().copy(), len(self.codes), self.generate_ms, self.timer.ms(), elapsed, self.audio_seconds))


@dataclass
class _Finished:
    handle: Handle
    error: BaseException | None = None

    def deliver(self) -> None:
        self.handle._finish(self.error)


_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _shutdown_engines() -> None:
    # An engine thread still inside a kernel launch when the interpreter finalizes aborts the process.
    for engine in list(_ENGINES):
        engine.shutdown(timeout=2.0)


class Engine:
    """Owns a model's decode state (BatchDecoder), its vocoder streams, two CUDA streams, the
    scheduler thread and the delivery thread."""

    def __init__(self, decoder: BatchDecoder, vocoder: MultiStreamDecoder, max_queue: int = 64, prefills_per_frame: int = 4,
                 progress: Callable[[int, int], None] | None = None):
        """`progress(done, total)`: called after each CUDA graph captured at load (its first run compiles the kernels it launches)."""
        self.decoder, self.vocoder = decoder, vocoder
        self.rows = decoder.rows
        self.max_queue, self.prefills_per_frame = max_queue, prefills_per_frame
        self.device = decoder.codes.device
        self.cuda = self.device.type == "cuda"
        self.gen_stream = torch.cuda.Stream(self.device, priority=GENERATION_PRIORITY) if self.cuda else None
        # One stream per vocoder lane; a row's calls in different lanes are ordered by its event.
        self.voc_streams = [torch.cuda.Stream(self.device) if self.cuda else None for _ in range(vocoder.lanes)]
        self.row_lane: list[int | None] = [None] * self.rows
        self.row_vocoded = [torch.cuda.Event() if self.cuda else None for _ in range(self.rows)]
        self.slots: list[_Row | None] = [None] * self.rows
        self.waiting: deque[Handle] = deque()
        self.commands: deque = deque()
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.thread: threading.Thread | None = None
        self.delivery: threading.Thread | None = None
        self.outbox: queue.Queue = queue.Queue()  # _Vocoded / _Finished, in order, for the delivery thread
        self.closing = False
        self.iteration = 0
        self._allocate_buffers()
        # Capture now, every row idle: a capture's warm-up runs would advance live rows.
        captures = decoder.captures() + vocoder.captures()
        for done, capture in enumerate(captures, 1):
            capture()
            if progress is not None:
                progress(done, len(captures))
        _ENGINES.add(self)

    def _allocate_buffers(self) -> None:
        rows, pin = self.rows, self.cuda
        self.host_codes = [torch.zeros(rows, 16, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.host_produced = [torch.zeros(rows, dtype=torch.bool, pin_memory=pin) for _ in range(2)]
        self.host_token = [torch.zeros(rows, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.gen_timer = [_Timer(self.cuda) for _ in range(2)]
        self.gen_done = [torch.cuda.Event() if self.cuda else None for _ in range(2)]

    # ---- the caller's side ---------------------------------------------------------------------

    def submit(self, job: Job) -> Handle:
        """Queue `job` (FIFO); raises EngineBusy when the queue is full. The tensors in `job` must be
        made on the calling thread's current stream, before this call."""
        job.ready = self._caller_ready()
        handle = Handle(self, job)
        with self.lock:
            if len(self.waiting) >= self.max_queue:
                raise EngineBusy(f"The server is busy: {len(self.waiting)} requests ahead; try again shortly.")
            self.waiting.append(handle)
            if len(self.waiting) > 1 or all(self.slots):
                handle._put(Queued(len(self.waiting) - 1))
            self._ensure_thread()
            self.wake.notify()
        return handle

    def _caller_ready(self) -> "torch.cuda.Event | None":
        """An event on the caller's current stream: the engine's streams wait for it before reading
        tensors the caller has just made (None on the CPU)."""
        if not self.cuda:
            return None
        ready = torch.cuda.Event()
        ready.record()
        return ready

    def cancel(self, handle: Handle) -> None:
        with self.lock:
            if handle in self.waiting:  # never admitted: nothing of it is in the outbox
                self.waiting.remove(handle)
                handle._finish()
                self._announce_positions()
                return
            self.commands.append(("cancel", handle, None))
            self.wake.notify()

    def append_text(self, handle: Handle, embeds: torch.Tensor, end: bool) -> None:
        ready = self._caller_ready()
        with self.lock:
            if handle in self.waiting:  # not started: the text joins its last segment
                segment = handle.job.segments[-1]
                segment.trailing = torch.cat([segment.trailing, embeds])
                segment.text_end = end
                return
            self.commands.append(("text", handle, (embeds, end, ready)))
            self.wake.notify()

    def finish_prompt(self, handle: Handle, rest: torch.Tensor) -> None:
        ready = self._caller_ready()
        with self.lock:
            segment = handle.job.segments[0]
            if rest.shape[1] != segment.awaits:
                raise ValueError(f"The prompt awaits {segment.awaits} positions, not {rest.shape[1]}.")
            if handle in self.waiting:  # not admitted yet: it starts with its whole prompt
                segment.prompt, segment.awaits = torch.cat([segment.prompt, rest], dim=1), 0
                return
            self.commands.append(("prompt", handle, (rest, ready)))
            self.wake.notify()

    def shutdown(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the loop after its current frame; requests still in flight end with an error."""
        with self.lock:
            self.closing = True
            self.wake.notify()
        for thread in (self.thread, self.delivery):  # the loop ends the delivery thread on its way out
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)

    def _ensure_thread(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._run, name="tts-engine", daemon=True)
            self.thread.start()
            self.delivery = threading.Thread(target=self._deliver, name="tts-delivery", daemon=True)
            self.delivery.start()

    def _deliver(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        while (item := self.outbox.get()) is not None:
            try:
                item.deliver()
            except Exception as exc:  # e.g. a failed copy: the listener gets the error, not a hang
                log.exception("chunk delivery failed")
                item.handle._finish(exc)

    # ---- the loop ------------------------------------------------------------------------------

    def _stream(self, stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _run(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        with torch.inference_mode():
            inflight: _Launch | None = None
            while not self.closing:
                try:
                    admitted = self._next_work(inflight is not None)
                    if self.closing:
                        break
                    for handle in admitted:
                        self._admit(handle)
                    launch = self._launch() if any(self.slots) else None
                    if inflight is not None:
                        self._collect(inflight)
                    inflight = launch
                except Exception as exc:  # a broken step: fail the requests in flight, keep serving
                    log.exception("engine step failed")
                    inflight = None
                    self._fail_all(exc)
            self._fail_all(RuntimeError("The speech engine shut down."))
            with self.lock:
                for handle in self.waiting:
                    handle._finish(RuntimeError("The speech engine shut down."))
                self.waiting.clear()
        self.outbox.put(None)

    def _next_work(self, busy: bool) -> list[Handle]:
        """Apply commands; take waiting requests into free rows (all of them while idle, a few
        between frames so that the running rows are not stalled). Blocks while there is nothing to do."""
        with self.lock:
            while True:
                self._apply_commands()
                free = [row for row, state in enumerate(self.slots) if state is None]
                running = any(self.slots)
                limit = len(free) if not running else min(len(free), self.prefills_per_frame)
                admitted = [self.waiting.popleft() for _ in range(min(limit, len(self.waiting)))]
                if admitted:
                    self._announce_positions()
                if admitted or running or busy or self.closing:
                    break
                self.wake.wait()
        for handle, row in zip(admitted, free):
            self.slots[row] = _Row(handle, row, chunk_sizes(handle.job.schedule))
        return admitted

    def _announce_positions(self) -> None:
        for ahead, handle in enumerate(self.waiting):
            handle._put(Queued(ahead))

    def _apply_commands(self) -> None:
        while self.commands:
            kind, handle, payload = self.commands.popleft()
            row = self._row_of(handle)
            if row is None:
                if kind == "cancel":
                    handle._released.set()
                continue
            if kind == "cancel":
                self._release(row, self.slots[row])
                continue
            *tensors, ready = payload
            with self._stream(self.gen_stream):
                if ready is not None:
                    self.gen_stream.wait_event(ready)
                    tensors[0].record_stream(self.gen_stream)
                if kind == "text":
                    self.decoder.append_text(row, *tensors)
                else:
                    self._finish_prompt(row, self.slots[row], tensors[0])

    def _row_of(self, handle: Handle) -> int | None:
        return next((row for row, state in enumerate(self.slots) if state is not None and state.handle is handle), None)

    def _admit(self, handle: Handle) -> None:
        row = self._row_of(handle)
        state = self.slots[row]
        job = handle.job
        try:
            with self._vocoder_stream(row, vocoder_lane(state.row, state.chunk_index, self.vocoder.lanes)) as stream:
                if job.ready is not None:
                    stream.wait_event(job.ready)
                self.vocoder.reset_row(row, job.vocoder_state)
            self._start_segment(row, state)
        except Exception as exc:
            self._release(row, state, exc)

    def _start_segment(self, row: int, state: _Row) -> None:
        job = state.handle.job
        segment = job.segments[state.segment]
        remaining = job.max_frames - state.total
        room = self.decoder.max_frames(segment.prompt.shape[1] + segment.awaits)
        state.limit = min(room, job.segment_frames or room)
        state.budget = min(remaining, state.limit)
        state.frames = 0
        timer = _Timer(self.cuda)
        with self._stream(self.gen_stream):
            if job.ready is not None:
                self.gen_stream.wait_event(job.ready)
                for t in (segment.prompt, segment.trailing):
                    t.record_stream(self.gen_stream)  # made on the caller's stream, read on this one
            timer.start()
            self.decoder.start(row, segment.prompt, segment.trailing, segment.text_end, job.sampling, job.seed + state.segment, state.budget,
                               segment.awaits)
            timer.stop()
        state.prefill_timers = [timer]

    def _finish_prompt(self, row: int, state: _Row, rest: torch.Tensor) -> None:
        timer = _Timer(self.cuda)
        timer.start()
        self.decoder.finish_prompt(row, rest)
        timer.stop()
        state.prefill_timers.append(timer)

    def _launch(self) -> _Launch:
        slot = self.iteration % 2
        self.iteration += 1
        with self._stream(self.gen_stream):
            self.gen_timer[slot].start()
            produced, codes, token = self.decoder.step()
            self.gen_timer[slot].stop()
            self.host_codes[slot].copy_(codes, non_blocking=True)
            self.host_produced[slot].copy_(produced, non_blocking=True)
            self.host_token[slot].copy_(token, non_blocking=True)
            if self.cuda:
                self.gen_done[slot].record()
        return _Launch(slot, list(self.slots))

    def _collect(self, launch: _Launch) -> None:
        slot = launch.slot
        if self.cuda:
            self.gen_done[slot].synchronize()  # releases the GIL while the GPU works
        produced = self.host_produced[slot].numpy()
        tokens = self.host_token[slot].numpy()
        codes = self.host_codes[slot].numpy()
        step_ms = self.gen_timer[slot].ms()
        for row, state in enumerate(launch.owners):
            if state is None or state.handle.closed or self.slots[row] is not state:
                continue
            if not produced[row]:
                # Running but no frame: it waits for more text. Its pending frames wait too: chunks cut
                # by the schedule alone keep a request's audio the same from run to run (the vocoder's
                # floating-point result depends on how the frames are split into calls).
                continue
            self._add_frame(state, codes[row].copy(), step_ms)
            if tokens[row] == self.decoder.eos_id or state.frames >= state.budget:
                self._end_segment(row, state, tokens[row] == self.decoder.eos_id)

    def _add_frame(self, state: _Row, codes: np.ndarray, step_ms: float) -> None:
        state.generate_ms += sum(timer.ms() for timer in state.prefill_timers)
        state.prefill_timers = []
        state.frames += 1
        state.total += 1
        state.codes.append(codes)
        state.generate_ms += step_ms
        if not state.next_size:
            state.next_size = next(state.sizes)
        if len(state.codes) >= state.next_size:
            self._emit(state)

    def _emit(self, state: _Row) -> None:
        """Vocode the row's pending frames as its next chunk; the delivery thread hands it out."""
        if not state.codes:
            return
        codes = np.stack(state.codes)
        audio = torch.empty(self.vocoder.output_samples(state.row, len(codes)), pin_memory=self.cuda)
        timer, done = _Timer(self.cuda), torch.cuda.Event() if self.cuda else None
        lane = vocoder_lane(state.row, state.chunk_index, self.vocoder.lanes)
        with self._vocoder_stream(state.row, lane):
            timer.start()
            self.vocoder.decode(state.row, torch.from_numpy(codes).pin_memory() if self.cuda else torch.from_numpy(codes), audio, lane)
            timer.stop()
            if done is not None:
                done.record()
        state.samples += audio.numel()
        self.outbox.put(_Vocoded(state.handle, state.chunk_index, codes, audio, state.generate_ms, timer, done, state.samples / SAMPLE_RATE))
        state.chunk_index += 1
        state.codes = []
        state.generate_ms = 0.0
        state.next_size = next(state.sizes)

    @contextlib.contextmanager
    def _vocoder_stream(self, row: int, lane: int):
        """Run vocoder work of `row` in `lane`'s stream, after the row's earlier vocoder work."""
        stream = self.voc_streams[lane]
        with self._stream(stream):
            if self.cuda and self.row_lane[row] not in (None, lane):
                stream.wait_event(self.row_vocoded[row])
            yield stream
            if self.cuda:
                self.row_vocoded[row].record()
        self.row_lane[row] = lane

    def _end_segment(self, row: int, state: _Row, by_eos: bool) -> None:
        job = state.handle.job
        state.handle.segment_frames.append(state.frames)
        last = state.segment + 1 >= len(job.segments) or state.total >= job.max_frames
        if not by_eos and state.budget == state.limit:
            state.cut.append((state.segment, state.budget))
        if last and state.cut:
            state.handle.warnings.append(cut_warning(state.cut, len(job.segments)))
        if last and state.segment + 1 < len(job.segments):
            state.handle.warnings.append(unspoken_warning(job, state.segment, by_eos))
        if not last:
            state.segment += 1
            try:
                self._start_segment(row, state)
                return
            except Exception as exc:
                self._emit(state)
                self._release(row, state, exc)
                return
        self._emit(state)
        self._release(row, state)

    def _release(self, row: int, state: _Row, error: BaseException | None = None) -> None:
        with self._stream(self.gen_stream):
            self.decoder.stop(row)
        self.slots[row] = None
        self.outbox.put(_Finished(state.handle, error))  # after the row's last chunk

    def _fail_all(self, exc: BaseException) -> None:
        for row, state in enumerate(self.slots):
            if state is not None:
                self._release(row, state, exc)
