"""The engine core: one loop per loaded model over a batch of rows, the runtime half of vLLM's engine
core (`EngineCore.step()`: schedule, one batched step, update from its output). The policy (which
request gets which row and when, chunk cuts, vocoder lanes, ends and warnings) is
pipeline/engine/scheduler.py's; this file carries it out on the devices.

Each loop iteration: apply commands (cancel, more text, the rest of a prompt), ask the scheduler
which waiting requests to admit (their prefill runs between two frames), launch one decode step for
every row, then read the previous step's codes (pinned host buffers, double-buffered) while the GPU
works on this one and hand them to the scheduler. No step is launched while no row can make a
frame (each waits for text, as Omni's talker for the thinker's next token, or for the rest of its
prompt): the loop parks until a command comes, and the GPU is the others' meanwhile. A chunk it cuts is vocoded on the vocoder's own
CUDA streams (lanes), overlapping the next decode steps: one row per call, or the steady chunks of
several rows in one batched call, where a row's audio does not depend on its neighbours either; a
delivery thread per lane hands each chunk to its listener as soon as its audio is on the host (a
chunk never waits behind another lane's longer call), each listener's chunks in order.

Callers `submit` a `Job` (never changed by the engine) and get a `Handle`: an iterator of `Chunk`s.
Closing it (Stop, the browser leaving) frees the row before the next frame.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.codec import MultiStreamDecoder
from pipeline.contract.events import DEFAULT_SCHEDULE, SAMPLE_RATE, Chunk, Queued, Waiting
from pipeline.engine.decoder import GENERATION_PRIORITY, BatchDecoder
from pipeline.engine.sampling import SamplingConfig
from pipeline.engine.scheduler import Action, Admission, Emit, Finish, Request, RowState, Schedule, Scheduler, StartSegment, StepOutput, VocodeBatch
from pipeline.graphs import capture_all

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0
FIRST_CHUNK_PATHS_KEPT = 10_000


@dataclass
class Segment:
    """One prefill and the text fed while it speaks; long texts are several segments in one voice."""

    prompt: torch.Tensor  # [1, L, hidden]
    trailing: torch.Tensor  # [T, hidden]
    text_end: bool = True  # False: more text arrives through Handle.append_text
    awaits: int = 0  # the prompt's last positions, still to come through Handle.finish_prompt (prefilled apart)
    chars: int = 0  # characters of the text it speaks, for the warning when it goes unspoken (0: not known, streamed text)
    text_tokens: int = 0  # text tokens it speaks, for its runaway budget (0: not known; `chars` stands in)


@dataclass
class Job:
    segments: list[Segment]
    sampling: SamplingConfig
    seed: int
    max_frames: int  # over all segments
    schedule: tuple[int, ...] = DEFAULT_SCHEDULE
    vocoder_state: list[torch.Tensor] | None = None  # the vocoder primed with reference codes (voice clone)
    segment_frames: int | None = None  # at most this many per segment (None: as many as the decoder has room for)


@dataclass(frozen=True)
class Cancel:
    handle: Handle


@dataclass(frozen=True)
class AppendText:
    handle: Handle
    embeds: torch.Tensor  # [n, hidden]
    end: bool
    ready: torch.cuda.Event | None


@dataclass(frozen=True)
class FinishPrompt:
    handle: Handle
    rest: torch.Tensor  # [1, n, hidden]
    ready: torch.cuda.Event | None


Command = Cancel | AppendText | FinishPrompt


@dataclass(frozen=True)
class FirstChunkPath:
    """Where a stream's time to its first audio went: host times in ms after `submit`, each step of
    the way of its first chunk. A stream whose first chunk waited for its second is `sent` later than
    `ready`; a stream paced by its text (Omni's talker) waits for that text between `admitted` and
    `first_frame` too."""

    admitted_ms: float  # a row taken: its prefill enqueued on the decode stream
    first_frame_ms: float  # its first frame on the host: the step that made it has completed
    vocoding_ms: float  # its first chunk's vocoder call enqueued
    ready_ms: float  # that chunk's audio on the host
    sent_ms: float  # handed to its listener


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
        self._first_ready_at: float | None = None  # when its first chunk's audio was ready: playback could start there
        self._audio_ready_s = 0.0  # audio of its chunks that were ready
        self._waiting_chunk: Chunk | None = None  # its first chunk, where it waits for the second (Scheduler.starts_wait)
        self._first_chunk_stamps: dict[str, float] = {}  # FirstChunkPath's fields so far, each written once by one thread

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
    def _stamp(self, point: str, now: float) -> None:
        """Note when its first chunk passed `point` (a FirstChunkPath field), the first time only; once
        it is `sent_ms`, the engine keeps the whole path."""
        if point in self._first_chunk_stamps:
            return
        self._first_chunk_stamps[point] = (now - self.submitted) * 1000.0
        if point == "sent_ms" and len(self._first_chunk_stamps) == len(dataclasses.fields(FirstChunkPath)):
            self.engine.first_chunk_paths.append(FirstChunkPath(**self._first_chunk_stamps))

    def _release_waiting_chunk(self, now: float) -> None:
        """Its first chunk to the listener at `now`, where it waited for the second (or for the end)."""
        if self._waiting_chunk is not None:
            chunk, self._waiting_chunk = self._waiting_chunk, None
            self._stamp("sent_ms", now)
            self._put(dataclasses.replace(chunk, elapsed_ms=(now - self.submitted) * 1000.0))

    def _put(self, item) -> None:
        self._items.put(item)

    def _finish(self, error: BaseException | None = None) -> None:
        if error is not None:
            self._items.put(error)
        self._released.set()  # before the end marker: a consumer that sees the end must see it released
        self._items.put(None)



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
class _Launch:
    slot: int
    schedule: Schedule  # the rows (and their segments) the step was launched for


@dataclass(kw_only=True)
class _Delivery:
    """Something a delivery thread hands to a listener once `after` (the delivery of the same row's
    item before it, in whatever lane) has happened; `delivered` is set once it has, or has failed."""

    after: threading.Event | None
    delivered: threading.Event = field(default_factory=threading.Event, init=False)

    def wait_for_previous(self) -> None:
        if self.after is not None:
            self.after.wait()


@dataclass
class _Vocoded(_Delivery):
    """A chunk whose audio is on its way to the host; delivered once `done` has completed."""

    handle: Handle
    index: int
    codes: np.ndarray
    audio: torch.Tensor  # pinned host memory on CUDA
    generate_ms: float
    timer: _Timer
    done: "torch.cuda.Event | None"
    audio_seconds: float
    watched: bool  # the scheduler hears how much audio its listener had left when it landed
    may_wait: bool  # a first chunk that goes out with the second where the scheduler says so

    def deliver(self) -> None:
        if self.done is not None:
            self.done.synchronize()  # releases the GIL while the GPU works
        self.wait_for_previous()
        handle = self.handle
        handle._code_blocks.append(self.codes)
        now = time.perf_counter()
        chunk = Chunk(self.index, self.audio.numpy().copy(), len(self.codes), self.generate_ms, self.timer.ms(), (now - handle.submitted) * 1000.0,
                      self.audio_seconds)
        if handle._first_ready_at is None:
            handle._first_ready_at = now
            handle._stamp("ready_ms", now)
        elif self.watched:
            handle.engine.early_chunk_landed(now, handle._audio_ready_s - (now - handle._first_ready_at))
        handle._audio_ready_s += self.audio.numel() / SAMPLE_RATE
        if self.may_wait and handle.engine.first_chunk_waits(now):
            handle._waiting_chunk = chunk
            return
        handle._release_waiting_chunk(now)
        handle._stamp("sent_ms", now)
        handle._put(chunk)


@dataclass
class _Finished(_Delivery):
    handle: Handle
    error: BaseException | None = None

    def deliver(self) -> None:
        self.wait_for_previous()
        self.handle._release_waiting_chunk(time.perf_counter())
        self.handle._finish(self.error)


_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _shutdown_engines() -> None:
    # An engine thread still inside a kernel launch when the interpreter finalizes aborts the process.
    for engine in list(_ENGINES):
        engine.shutdown(timeout=2.0)


class Engine:
    """Owns a model's decode state (BatchDecoder), its vocoder, a CUDA stream for the decode step and
    one per vocoder lane, the loop thread and a delivery thread per lane; its `scheduler` decides,
    under `lock`, what they do."""

    def __init__(self, decoder: BatchDecoder, vocoder: MultiStreamDecoder, max_queue: int = 64, prefills_per_frame: int = 4,
                 progress: Callable[[int, int], None] | None = None):
        """`progress(done, total)`: called after each CUDA graph captured at load (its first run compiles the kernels it launches)."""
        self.decoder, self.vocoder = decoder, vocoder
        self.rows = decoder.rows
        self.scheduler = Scheduler(self.rows, vocoder.lanes, decoder.eos_id, decoder.max_frames, max_queue, prefills_per_frame,
                                   batch_lanes=vocoder.batch_lanes, slots=vocoder.slots, batch_frames=vocoder.BATCH_FRAMES)
        self.device = decoder.codes.device
        self.cuda = self.device.type == "cuda"
        self.gen_stream = torch.cuda.Stream(self.device, priority=GENERATION_PRIORITY) if self.cuda else None
        # One stream per vocoder lane; a row's calls in different lanes are ordered by its event. Where
        # batched lanes take the steady chunks, which come well ahead of playback, the one-stream lanes
        # (a stream's first chunks: its time to first audio) run at the decode step's priority.
        lanes = vocoder.lanes + vocoder.batch_lanes
        self.voc_streams = [torch.cuda.Stream(self.device, priority=self._lane_priority(lane)) if self.cuda else None for lane in range(lanes)]
        self.row_lane: list[int | None] = [None] * self.rows
        self.row_vocoded = [torch.cuda.Event() if self.cuda else None for _ in range(self.rows)]
        self.row_samples = [0] * self.rows  # audio samples each row's stream has been given
        self.row_delivered: list[threading.Event | None] = [None] * self.rows  # set once the row's last item is delivered
        self.prefill_timers: dict[int, tuple[int, list[_Timer]]] = {}  # row -> (segment epoch, its prefills), read with its first frame
        self.commands: list[Command] = []
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.thread: threading.Thread | None = None
        self.deliveries: list[threading.Thread] = []
        # _Vocoded / _Finished per lane, in the order of the lane's calls, for its delivery thread.
        self.outboxes: list[queue.Queue] = [queue.Queue() for _ in range(lanes)]
        self.closing = False
        self.iteration = 0
        self.parked = False  # the loop waits for a command while its rows wait for text
        self.parks = 0  # times it has parked
        self.first_chunks_waited = 0  # first chunks that went out with their stream's second
        # The latest streams' FirstChunkPath (appended by the delivery threads), for `take_first_chunk_paths`.
        self.first_chunk_paths: deque[FirstChunkPath] = deque(maxlen=FIRST_CHUNK_PATHS_KEPT)
        self._allocate_buffers()
        # Capture now, every row idle: a capture's warm-up runs would advance live rows.
        capture_all(decoder.captures() + vocoder.captures(), progress)
        _ENGINES.add(self)

    def _lane_priority(self, lane: int) -> int:
        return GENERATION_PRIORITY if self.vocoder.batch_lanes and not self.vocoder.batched(lane) else 0

    def _allocate_buffers(self) -> None:
        rows, pin = self.rows, self.cuda
        self.host_codes = [torch.zeros(rows, 16, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.host_produced = [torch.zeros(rows, dtype=torch.bool, pin_memory=pin) for _ in range(2)]
        self.host_token = [torch.zeros(rows, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.gen_timer = [_Timer(self.cuda) for _ in range(2)]
        self.gen_done = [torch.cuda.Event() if self.cuda else None for _ in range(2)]

    @property
    def slots(self) -> list[RowState | None]:
        """Each row's occupant (its `handle`), None where free."""
        return self.scheduler.rows

    @property
    def waiting(self) -> list[Request]:
        """The requests waiting for a row, first in line first."""
        with self.lock:
            return list(self.scheduler.waiting)

    # ---- the caller's side ---------------------------------------------------------------------

    def submit(self, job: Job) -> Handle:
        """Queue `job` (FIFO); raises EngineBusy when the queue is full. The tensors in `job` must be
        made on the calling thread's current stream, before this call."""
        handle = Handle(self, job)
        request = Request(handle, job, list(job.segments), self._caller_ready())
        with self.lock:
            ahead = self.scheduler.add(request)
            if ahead is not None:
                handle._put(Queued(ahead))
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
            if self.scheduler.waiting_request(handle) is not None:  # never admitted: nothing of it is in the outbox
                self.scheduler.cancel(handle)
                handle._finish()
                self._announce(self.scheduler.positions())
                return
            self.commands.append(Cancel(handle))
            self.wake.notify()

    def append_text(self, handle: Handle, embeds: torch.Tensor, end: bool) -> None:
        with self.lock:
            request = self.scheduler.waiting_request(handle)
            if request is not None:  # not started: the text joins its last segment
                last = request.segments[-1]
                self._follow(request, last.trailing)
                request.segments[-1] = dataclasses.replace(last, trailing=torch.cat([last.trailing, embeds]), text_end=end)
                request.ready = self._caller_ready()
                return
            self.commands.append(AppendText(handle, embeds, end, self._caller_ready()))
            self.wake.notify()

    def finish_prompt(self, handle: Handle, rest: torch.Tensor) -> None:
        awaits = handle.job.segments[0].awaits
        if rest.shape[1] != awaits:
            raise ValueError(f"The prompt awaits {awaits} positions, not {rest.shape[1]}.")
        with self.lock:
            request = self.scheduler.waiting_request(handle)
            if request is not None:  # not admitted yet: prefilled apart all the same, right after the prefix
                self._follow(request)
                request.rest = rest
                request.ready = self._caller_ready()
                return
            self.commands.append(FinishPrompt(handle, rest, self._caller_ready()))
            self.wake.notify()

    def _follow(self, request: Request, *read: torch.Tensor) -> None:
        """The caller's stream waits for the tensors a waiting request holds (made on the stream that
        `request.ready` marks, perhaps another) before the caller's work that adds to them, which reads `read`."""
        if request.ready is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(request.ready)
            for tensor in read:
                tensor.record_stream(stream)

    def shutdown(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the loop after its current frame; requests still in flight end with an error."""
        with self.lock:
            self.closing = True
            self.wake.notify()
        for thread in (self.thread, *self.deliveries):  # the loop ends the delivery threads on its way out
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout)

    def take_first_chunk_paths(self) -> list[FirstChunkPath]:
        """The streams' first-chunk paths kept since the last call, oldest first; they are no longer kept.
        One at a time (a delivery thread may append meanwhile, which iterating the deque would not allow)."""
        taken = []
        with contextlib.suppress(IndexError):
            while True:
                taken.append(self.first_chunk_paths.popleft())
        return taken

    def early_chunk_landed(self, at: float, left_s: float) -> None:
        """A delivery thread has a watched chunk's audio for its listener (see `Scheduler.early_chunk_landed`)."""
        with self.lock:
            self.scheduler.early_chunk_landed(at, left_s)

    def first_chunk_waits(self, now: float) -> bool:
        """Whether a first chunk that may wait goes out with its stream's second (`Scheduler.starts_wait`), counted."""
        with self.lock:
            waits = self.scheduler.starts_wait(now)
            self.first_chunks_waited += waits
            return waits

    def _ensure_thread(self) -> None:
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self._run, name="tts-engine", daemon=True)
            self.thread.start()
            self.deliveries = [threading.Thread(target=self._deliver, args=(outbox,), name=f"tts-delivery-{lane}", daemon=True)
                               for lane, outbox in enumerate(self.outboxes)]
            for thread in self.deliveries:
                thread.start()

    def _deliver(self, outbox: queue.Queue) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        while (item := outbox.get()) is not None:
            try:
                item.deliver()
            except Exception as exc:  # e.g. a failed copy: the listener gets the error, not a hang
                log.exception("chunk delivery failed")
                item.handle._finish(exc)
            finally:
                item.delivered.set()

    @staticmethod
    def _announce(positions: list[tuple[Handle, int]]) -> None:
        for handle, ahead in positions:
            handle._put(Queued(ahead))

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
                    schedule = self._next_work(inflight is not None)
                    if self.closing:
                        break
                    for admission in schedule.admitted:
                        self._admit(admission)
                    launch = self._launch(schedule) if self._can_run() else None
                    if inflight is not None:
                        self._collect(inflight)
                    elif launch is None and self.scheduler.held:
                        self._flush_held()
                    inflight = launch
                except Exception as exc:  # a broken step: fail the requests in flight, keep serving
                    log.exception("engine step failed")
                    inflight = None
                    with self.lock:
                        finished = self.scheduler.fail_running(exc)
                    self._carry_out(finished)
            shut = RuntimeError("The speech engine shut down.")
            with self.lock:
                finished = self.scheduler.fail_running(shut)
                for finish in self.scheduler.fail_waiting(shut):
                    finish.handle._finish(finish.error)
            self._carry_out(finished)
        for outbox in self.outboxes:
            outbox.put(None)

    def _next_work(self, busy: bool) -> Schedule:
        """Apply commands, then the scheduler's admissions (all it can while idle, a few between frames so
        that the running rows are not stalled). Blocks while there is nothing to do: no row, or none that
        can make a frame (and no held chunk to vocode)."""
        with self.lock:
            while True:
                commands, self.commands = self.commands, []
                for command in commands:
                    self._apply(command)
                schedule = self.scheduler.schedule(time.perf_counter())
                self._announce(schedule.positions)
                if schedule.admitted or busy or self.closing or self.scheduler.held or self._can_run():
                    return schedule
                self.scheduler.pause()
                self.parked, self.parks = True, self.parks + 1
                self.wake.wait()
                self.parked = False

    def _can_run(self) -> bool:
        """Whether a step would make a frame: a row whose prompt is in has the text for its next frame (its
        frames made so far, without the step in flight: a step that turns out idle is possible, a skipped
        one that was needed is not)."""
        return any(state is not None and self.decoder.may_run(row, state.frames) for row, state in enumerate(self.scheduler.rows))

    def _flush_held(self) -> None:
        with self.lock:
            actions = self.scheduler.flush_held()
        self._carry_out(actions)

    def _apply(self, command: Command) -> None:
        """Carry out a caller's command (under the lock, on the loop thread)."""
        if isinstance(command, Cancel):
            finish = self.scheduler.cancel(command.handle)
            if finish is None:  # already over
                command.handle._released.set()
            else:
                self._release(finish)
            return
        row = self.scheduler.row_of(command.handle)
        if row is None:
            return
        tensor = command.embeds if isinstance(command, AppendText) else command.rest
        with self._stream(self.gen_stream):
            if command.ready is not None:
                self.gen_stream.wait_event(command.ready)
                tensor.record_stream(self.gen_stream)
            if isinstance(command, AppendText):
                self.decoder.append_text(row, command.embeds, command.end)
                self.scheduler.text_arrived(row, len(command.embeds))
            else:
                self._timed_prefill(row, lambda: self.decoder.finish_prompt(row, command.rest))

    def _admit(self, admission: Admission) -> None:
        row, request = admission.row, admission.request
        request.handle._stamp("admitted_ms", time.perf_counter())
        self.row_samples[row] = 0
        self.row_delivered[row] = None
        try:
            with self._vocoder_stream([row], admission.lane) as stream:
                if request.ready is not None:
                    stream.wait_event(request.ready)
                self.vocoder.reset_row(row, request.job.vocoder_state)
            self._start_segment(admission.start)
        except Exception as exc:
            with self.lock:
                actions = self.scheduler.abort(row, exc)
            self._carry_out(actions)

    def _start_segment(self, start: StartSegment) -> None:
        request = start.request
        job, segment = request.job, request.segments[start.segment]
        rest = request.rest if start.segment == 0 else None  # given while it waited
        self.prefill_timers[start.row] = (start.epoch, [])
        with self._stream(self.gen_stream):
            if request.ready is not None:
                self.gen_stream.wait_event(request.ready)
                for t in (segment.prompt, segment.trailing, rest):
                    if t is not None:
                        t.record_stream(self.gen_stream)  # made on the caller's stream, read on this one
            self._timed_prefill(start.row, lambda: self.decoder.start(start.row, segment.prompt, segment.trailing, segment.text_end, job.sampling,
                                                                       job.seed + start.segment, start.budget, segment.awaits))
            if rest is not None:  # prefilled apart, as when it comes after admission: a row's numbers never follow the timing
                self._timed_prefill(start.row, lambda: self.decoder.finish_prompt(start.row, rest))

    def _timed_prefill(self, row: int, prefill: Callable[[], None]) -> None:
        timer = _Timer(self.cuda)
        timer.start()
        prefill()
        timer.stop()
        self.prefill_timers[row][1].append(timer)

    def _launch(self, schedule: Schedule) -> _Launch:
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
        return _Launch(slot, schedule)

    def _collect(self, launch: _Launch) -> None:
        slot = launch.slot
        if self.cuda:
            self.gen_done[slot].synchronize()  # releases the GIL while the GPU works
        produced = self.host_produced[slot].numpy()
        output = StepOutput(produced, self.host_codes[slot].numpy(), self.host_token[slot].numpy(), time.perf_counter(), self.gen_timer[slot].ms(),
                            self._prefills_read(launch.schedule, produced))
        self._stamp_first_frames(output)
        with self.lock:
            actions = self.scheduler.update_from_output(launch.schedule, output)
        self._carry_out(actions)

    def _stamp_first_frames(self, output: StepOutput) -> None:
        """The rows whose segment made its first frame in this step (those whose prefill time was read)."""
        for row in output.prefill_ms:
            state = self.scheduler.rows[row]
            if state is not None:
                state.handle._stamp("first_frame_ms", output.now)

    def _prefills_read(self, schedule: Schedule, produced: np.ndarray) -> dict[int, float]:
        """The prefill time of each row whose segment made its first frame in this step (its prefills have completed)."""
        read = {}
        for row, epoch in enumerate(schedule.running):
            timers = self.prefill_timers.get(row)
            if produced[row] and timers is not None and timers[0] == epoch and timers[1]:
                read[row] = sum(timer.ms() for timer in timers[1])
                timers[1].clear()
        return read

    def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Emit):
                self._emit(action)
            elif isinstance(action, VocodeBatch):
                self._vocode_batch(action)
            elif isinstance(action, Finish):
                self._release(action)
            else:
                try:
                    self._start_segment(action)
                except Exception as exc:
                    with self.lock:
                        failed = self.scheduler.abort(action.row, exc)
                    self._carry_out(failed)

    def _emit(self, emit: Emit) -> None:
        """Vocode a chunk the scheduler cut; the delivery thread hands it out."""
        audio = self._audio_buffer(emit)
        timer, done = _Timer(self.cuda), torch.cuda.Event() if self.cuda else None
        with self._vocoder_stream([emit.row], emit.lane):
            timer.start()
            self.vocoder.decode(emit.row, self._host_codes(emit), audio, emit.lane)
            timer.stop()
            if done is not None:
                done.record()
        self._deliver_vocoded(emit, audio, timer, done)

    def _vocode_batch(self, batch: VocodeBatch) -> None:
        """Vocode the held steady chunks of several rows in one batched call; each is delivered as `_emit`'s."""
        rows, audio = [emit.row for emit in batch.emits], [self._audio_buffer(emit) for emit in batch.emits]
        timer, done = _Timer(self.cuda), torch.cuda.Event() if self.cuda else None
        with self._vocoder_stream(rows, batch.lane):
            timer.start()
            self.vocoder.decode_batch(rows, [self._host_codes(emit) for emit in batch.emits], audio, batch.lane)
            timer.stop()
            if done is not None:
                done.record()
        for emit, samples in zip(batch.emits, audio):
            self._deliver_vocoded(emit, samples, timer, done)

    def _audio_buffer(self, emit: Emit) -> torch.Tensor:
        return torch.empty(self.vocoder.output_samples(emit.row, len(emit.codes)), pin_memory=self.cuda)

    def _host_codes(self, emit: Emit) -> torch.Tensor:
        codes = torch.from_numpy(emit.codes)
        return codes.pin_memory() if self.cuda else codes

    def _deliver_vocoded(self, emit: Emit, audio: torch.Tensor, timer: "_Timer", done: "torch.cuda.Event | None") -> None:
        emit.handle._stamp("vocoding_ms", time.perf_counter())
        self.row_samples[emit.row] += audio.numel()
        self._post(emit.row, _Vocoded(emit.handle, emit.index, emit.codes, audio, emit.generate_ms, timer, done, self.row_samples[emit.row] / SAMPLE_RATE,
                                      emit.watched, emit.may_wait, after=self.row_delivered[emit.row]))

    def _post(self, row: int, item: "_Vocoded | _Finished") -> None:
        """Queue `item` behind the row's last vocoder call, in that call's lane, after the row's earlier items."""
        self.row_delivered[row] = item.delivered
        self.outboxes[self.row_lane[row] or 0].put(item)

    @contextlib.contextmanager
    def _vocoder_stream(self, rows: list[int], lane: int):
        """Run vocoder work of `rows` in `lane`'s stream, after each row's earlier vocoder work."""
        stream = self.voc_streams[lane]
        with self._stream(stream):
            if self.cuda:
                for row in rows:
                    if self.row_lane[row] not in (None, lane):
                        stream.wait_event(self.row_vocoded[row])
            yield stream
            if self.cuda:
                for row in rows:
                    self.row_vocoded[row].record()
        for row in rows:
            self.row_lane[row] = lane

    def _release(self, finish: Finish) -> None:
        """Free the row the scheduler let go of; the stream ends after the row's last chunk."""
        if finish.row is not None:
            with self._stream(self.gen_stream):
                self.decoder.stop(finish.row)
            self.prefill_timers.pop(finish.row, None)
        finish.handle.warnings.extend(finish.warnings)
        finish.handle.segment_frames.extend(finish.segment_frames)
        if finish.row is None:  # never admitted: nothing of it was queued
            self.outboxes[0].put(_Finished(finish.handle, finish.error, after=None))
            return
        self._post(finish.row, _Finished(finish.handle, finish.error, after=self.row_delivered[finish.row]))
        self.row_delivered[finish.row] = None
