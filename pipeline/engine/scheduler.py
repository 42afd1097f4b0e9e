"""The engine's policy, apart from its runtime (vLLM v1's `Scheduler` beside its `EngineCore`): which
waiting request gets which free row and when, where each row's chunks are cut and in which vocoder
lane they are vocoded, when a segment or a request ends and what its listener is told.

No threads, locks, devices or clocks: the engine (pipeline/engine/core.py) calls it under its lock,
passes the time in, carries tensors through it untouched and does what it returns. One frame:

    schedule(now) -> Schedule           the rows admitted (to prefill), queue positions, the rows the step is for
    (the engine prefills, runs the decode step, reads its codes)
    update_from_output(schedule, StepOutput) -> [Emit | VocodeBatch | StartSegment | Finish, ...] in the order to carry out
"""
from __future__ import annotations

import functools
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.contract.events import FRAME_SECONDS, FRAMES_PER_SECOND
from pipeline.errors import EngineBusy

if TYPE_CHECKING:
    from pipeline.engine.core import Handle, Job, Segment

EARLY_CHUNKS = 4  # a stream's first chunks (1, 2, 4 and 8 frames by default): little audio buffered yet

# Steady chunks of a batched vocoder call's length share such calls (see `Scheduler._cut`): one waits
# for others at most BATCH_WAIT_FRAMES frames, and not once its listener has less than BATCH_LEAD_S of
# audio left without it. Steady chunks come ~1 s or more ahead of playback, so the wait is inaudible.
BATCH_WAIT_FRAMES = 4
BATCH_LEAD_S = 0.5

# Admission that protects running streams (see `keeps_ahead`).
LEAD_MARGIN_S = 0.05  # audio a playing stream keeps buffered at least: the vocoding and delivery of a chunk, with room
SMOOTHING = 0.25  # weight of the newest measurement in the recent step and prefill times

# Admission that protects a new stream's own first chunks (see `longest_frame_period`). A chunk's
# vocoding and delivery delay the start of playback (the first chunk's) as much as each later chunk's
# arrival, so they cancel: the margin holds what differs from chunk to chunk. On an H100: a later,
# longer chunk's call (2-8 frames: 2.7-3.6 ms against 2.5 ms for one frame), a wait behind other
# streams' first chunks in the same lane (~3 ms a call), frames longer than the smoothed period (a
# frame with prefills, ~2 ms each), delivery jitter. 20 ms gives 30 ms for the default schedule, the
# frame period above which new streams stutter on an H100 at 20 requests/s. LEAD_MARGIN_S (50 ms)
# would give 15 ms, a period a loaded H100 runs far above (its 64-row decode step alone is ~9 ms).
FIRST_CHUNKS_MARGIN_S = 0.02
SHOWN_ROWS = 2  # the queue waits for the bound only where the machine's fastest period fits this many rows in it
# New streams' early chunks as their listeners get them (see `Scheduler.starts_wait`): one that landed
# with under FIRST_CHUNKS_MARGIN_S of audio left makes new streams' first chunks wait for their second
# this long.
LATE_EARLY_CHUNK_HOLD_S = 0.5

# The runaway guard (see `frame_budget`).
EXPECTED_FRAMES_PER_TOKEN = 4
BUDGET_FRAMES_PER_TOKEN = 12
BUDGET_FLOOR_FRAMES = 100
LOOP_PERIOD = 8  # patterns of 1 to 8 frames (80 to 640 ms)
LOOP_FRAMES = 75  # repeated for 6 s: longer than any pause in speech


def chunk_sizes(schedule: Sequence[int]) -> Iterator[int]:
    if not schedule or any(int(n) < 1 for n in schedule):
        raise ValueError(f"A chunk schedule is a list of positive frame counts, got {list(schedule)}.")
    return itertools.chain(schedule, itertools.repeat(schedule[-1]))


def vocoder_lane(row: int, chunk_index: int, lanes: int) -> int:
    """The one-stream lane of a chunk: a stream's first chunks in the first half of the lanes, its
    steady chunks in the others, by row: simultaneous arrivals vocode side by side, a new stream's
    second chunk (due 80 ms after its first) never waits behind a queue of 16-frame chunks, and two
    running streams' 16-frame chunks overlap (one call leaves part of an H200 idle: two calls at
    once take 1.6x one). Where batched lanes exist, steady chunks of their call's length go there instead."""
    if lanes == 1:
        return 0
    early = (lanes + 1) // 2
    return row % early if chunk_index < EARLY_CHUNKS else early + row % (lanes - early)


def longest_frame_period(schedule: Sequence[int], margin_s: float = FIRST_CHUNKS_MARGIN_S) -> float:
    """The longest frame period under which a new stream of this chunk schedule never runs dry: each
    of its chunks lands while its listener has at least `margin_s` of audio left (<= 0: none does).

    Playback starts with the first chunk (F_1 frames, F_j the frames of chunks 1 to j). Chunk j+1 is
    cut (F_{j+1} - F_1) frame periods P later, while the listener holds F_j frames of audio:
    F_j * 80 ms - (F_{j+1} - F_1) * P >= margin, for each j. A stream's first chunks are short, so
    these bounds are tight there; once the chunks are steady (the schedule's last size repeated) each
    further chunk's bound moves towards one frame's audio, 80 ms, the period of real time. Hence the
    minimum over the schedule's sizes and the first repeat of its last, and at most 80 ms. The
    default (1, 2, 4, 8, 16) with a 20 ms margin: (80 - 20) / 2 = 30 ms after the first chunk, then
    (240 - 20) / 6, (560 - 20) / 14, (1200 - 20) / 30, (2480 - 20) / 46 = 36.7, 38.6, 39.3, 53.5 ms."""
    made = list(itertools.accumulate(itertools.islice(chunk_sizes(schedule), len(schedule) + 1)))
    bounds = ((given * FRAME_SECONDS - margin_s) / (next_made - made[0]) for given, next_made in zip(made, made[1:]))
    return min(FRAME_SECONDS, *bounds)


@functools.lru_cache(maxsize=64)
def first_chunks_bound(schedule: tuple[int, ...]) -> tuple[float, int]:
    """A schedule's `longest_frame_period` and the frames that bound covers (a stream's first chunk to its
    first steady one), computed once per schedule: admission asks for them for every starting stream at
    every frame while requests wait."""
    return longest_frame_period(schedule), sum(schedule[1:]) + schedule[-1]


def keeps_ahead(leads: Sequence[tuple[float, int]], running: int, admitted: int, step_s: float, prefill_s: float,
                margin_s: float = LEAD_MARGIN_S) -> bool:
    """Whether `admitted` more rows leave every playing stream at least `margin_s` of audio ahead of its
    listener when its next chunk lands.

    `leads`: for each of the `running` rows whose listener has its first chunk, the audio it has been
    given minus the time since that first chunk (its playback started then), and the frames its next
    chunk still needs. Until that chunk, a stream's buffer drains: by one recent step (`step_s`, the
    loop's frame period) per frame, and by every prefill admitted meanwhile (`prefill_s`, recent). A
    step over more rows is assumed slower in proportion to its rows (the upper bound of a batched
    step's cost), so `admitted` rows cost each frame `step_s * admitted / running` more.

    A stream that falls under the margin even without admissions (the machine cannot keep this batch
    ahead) does not hold the queue: holding it would not keep that stream ahead, and the queue would
    starve. Streams without a first chunk have nothing playing: their wait is their time to first audio."""
    for lead, frames in leads:
        alone = lead - frames * step_s
        if alone < margin_s:
            continue
        if alone - admitted * prefill_s - frames * step_s * admitted / running < margin_s:
            return False
    return True


def frame_budget(text_units: int) -> int | None:
    """Frames a segment may speak for text of `text_units` tokens before it counts as a runaway (None: no
    length known, only the request's frame limits apply).

    The official code bounds every utterance by `max_new_tokens` alone (2048 frames, 164 s, whatever
    the text). Speech takes about EXPECTED_FRAMES_PER_TOKEN frames (0.32 s) per text token: English at
    ~2.7 words/s and ~1.3 tokens a word, Chinese at ~4.5 characters/s and ~1.5 characters a token.
    The budget is 3x that rate plus a floor of 8 s (a one-word text with its pauses): slow, expressive
    and instructed speech stays far inside it, a missed end of speech is stopped within seconds."""
    if text_units <= 0:
        return None
    return BUDGET_FLOOR_FRAMES + BUDGET_FRAMES_PER_TOKEN * text_units


class LoopWatch:
    """The layer-0 codes of one segment: `add(code)` returns the period p (1 to `period`) once the last
    `frames` codes are one p-frame pattern repeated, else None."""

    def __init__(self, period: int = LOOP_PERIOD, frames: int = LOOP_FRAMES):
        self.frames = frames
        self.recent: deque[int] = deque(maxlen=period)  # the newest last
        self.runs = [0] * period  # runs[p - 1]: how many codes in a row equal the code p frames before them

    def add(self, code: int) -> int | None:
        for p in range(1, len(self.runs) + 1):
            repeats = len(self.recent) >= p and self.recent[-p] == code
            self.runs[p - 1] = self.runs[p - 1] + 1 if repeats else 0
        self.recent.append(code)
        return next((p for p, run in enumerate(self.runs, 1) if run + p >= self.frames), None)


def cut_warning(cut: list[tuple[int, int]], segments: int) -> str:
    """What the user is told of the segments (index, frame budget) that reached their own frame limit."""
    budget = max(frames for _, frames in cut)
    limit = f"the frame limit of one segment ({budget} frames, {budget / FRAMES_PER_SECOND:.0f} s)"
    if len(cut) == 1:
        return f"Segment {cut[0][0] + 1} of {segments} reached {limit} and was cut there; shorter sentences avoid this."
    numbers = ", ".join(str(index + 1) for index, _ in cut)
    return f"{len(cut)} of {segments} segments ({numbers}) reached {limit} and were cut there; shorter sentences avoid this."


def unspoken_warning(segments: Sequence[Segment], max_frames: int, segment: int, by_eos: bool) -> str:
    """What the user is told when the request's frame total ends it in (or right after) `segment`, before its last one."""
    left = segments[segment + 1 :]
    chars = sum(s.chars for s in left)
    what = "the last segment" if len(left) == 1 else f"the last {len(left)} segments"
    what += f" ({chars:,} characters)" if chars else ""
    where = f"after segment {segment + 1}" if by_eos else f"in segment {segment + 1}"
    rest = "" if by_eos else "the rest of it and "
    return (f"The request's frame limit ({max_frames} frames, {max_frames / FRAMES_PER_SECOND:.1f} s) was reached {where} of "
            f"{len(segments)}: {rest}{what} of the text went unspoken; raise the length limit or leave it at its default.")


def runaway_warning(segment: int, segments: int, frames: int, text_units: int) -> str:
    what = "the utterance" if segments == 1 else f"segment {segment + 1} of {segments}"
    ratio = frames / (text_units * EXPECTED_FRAMES_PER_TOKEN)
    return f"The model did not end {what}; stopped after {frames / FRAMES_PER_SECOND:.1f} s, {ratio:.1f}x the expected length."


def loop_warning(segment: int, segments: int, frames: int, period: int) -> str:
    what = "The speech" if segments == 1 else f"The speech of segment {segment + 1} of {segments}"
    pattern = "one frame" if period == 1 else f"a {period}-frame pattern"
    return (f"{what} fell into a loop ({pattern} repeated for {LOOP_FRAMES} frames, {LOOP_FRAMES / FRAMES_PER_SECOND:.0f} s); "
            f"stopped after {frames / FRAMES_PER_SECOND:.1f} s.")


@dataclass(eq=False)
class Request:
    """The engine's own record of a submitted job. Its segments are the engine's: text and prompt
    positions that arrive before admission replace entries here, never in the caller's job."""

    handle: Handle
    job: Job  # the caller's, only read
    segments: list[Segment]
    ready: Any = None  # recorded on the caller's stream after it made the tensors (runtime; carried through)
    rest: Any = None  # the prompt's awaited last positions, when they come before admission (Handle.finish_prompt)
    ahead: int | None = None  # the queue position last announced

    @property
    def paced_by_text(self) -> bool:
        """Its text streams in while it speaks (Qwen3-Omni's talker, a text stream): its chunks come
        at the pace of the text, whatever the frames' pace."""
        return not self.segments[0].text_end


@dataclass(eq=False)
class RowState:
    """One occupied row: where its request is, its pending chunk, its listener's lead."""

    request: Request
    row: int
    sizes: Iterator[int]
    epoch: int = 0  # of the segment running; a step launched for another epoch gives this row nothing
    segment: int = 0
    frames: int = 0  # in this segment
    budget: int = 0  # frames the decoder lets this segment make
    limit: int = 0  # frames one segment may make (its budget, unless the job's total leaves it fewer)
    total: int = 0  # frames over all segments
    text_known: int = 0  # the segment's text length in tokens (or, where unknown, characters)
    text_rows: int = 0  # text positions received for the segment
    loop: LoopWatch = field(default_factory=LoopWatch)
    next_size: int = 0
    pending: list[np.ndarray] = field(default_factory=list)  # codes [16] of the chunk being made
    generate_ms: float = 0.0
    chunk_index: int = 0
    audio_s: float = 0.0  # audio given to the listener
    first_chunk_at: float | None = None  # its playback starts there
    cut: list[tuple[int, int]] = field(default_factory=list)  # (segment, frame budget) of the segments cut at their own limit
    warnings: list[str] = field(default_factory=list)
    segment_frames: list[int] = field(default_factory=list)  # frames of each segment that has ended

    @property
    def handle(self) -> Handle:
        return self.request.handle

    @property
    def text_units(self) -> int:
        return max(self.text_known, self.text_rows)

    def lead(self, now: float) -> float:
        return self.audio_s - (now - self.first_chunk_at)

    def frames_to_chunk(self) -> int:
        return max(self.next_size - len(self.pending), 1)


@dataclass
class StartSegment:
    """Prefill segment `segment` of the request into `row`; the decoder lets it make `budget` frames."""

    row: int
    request: Request
    segment: int
    budget: int
    epoch: int


@dataclass
class Admission:
    """A waiting request takes `row`: reset the row's vocoder state in `lane`, then start its first segment."""

    row: int
    request: Request
    lane: int
    start: StartSegment


@dataclass
class Emit:
    """Vocode `codes` [frames, 16] in vocoder `lane` as chunk `index` of the row's stream."""

    row: int
    handle: Handle
    index: int
    codes: np.ndarray
    lane: int
    generate_ms: float  # the decode steps of its frames, and the prefills before them
    # Of a request not paced by its text: a chunk after the stream's first, through its schedule's length,
    # whose landing the scheduler hears of; the first chunk, which may wait for the second (`Scheduler.starts_wait`).
    watched: bool = False
    may_wait: bool = False


@dataclass
class Finish:
    """The request is over: free its row (None: it never had one), then end its stream after its chunks."""

    row: int | None
    handle: Handle
    warnings: list[str] = field(default_factory=list)
    segment_frames: list[int] = field(default_factory=list)
    error: BaseException | None = None


@dataclass
class VocodeBatch:
    """Vocode the steady chunks `emits` (a batched call's frames each, distinct rows) in one call of batched vocoder `lane`."""

    lane: int
    emits: list[Emit]


Action = Emit | VocodeBatch | StartSegment | Finish


@dataclass
class Schedule:
    admitted: list[Admission]
    positions: list[tuple[Handle, int]]  # (waiting request, requests ahead of it) where that changed
    running: list[int | None]  # each row's segment epoch for this step (None: free)


@dataclass
class StepOutput:
    """What one decode step gave (host copies), when it was read and what it cost."""

    produced: np.ndarray  # bool [rows]: made a frame (False: free, ended or waiting for text)
    codes: np.ndarray  # int64 [rows, 16]
    tokens: np.ndarray  # int64 [rows]: the next frame's layer-0 code; EOS ends the segment
    now: float  # seconds, on the clock `schedule` gets
    step_ms: float = 0.0
    prefill_ms: dict[int, float] = field(default_factory=dict)  # rows whose segment's prefill time is known now


class Scheduler:
    """FIFO admission into `rows` rows, chunk cuts, vocoder lanes, segment and request ends."""

    def __init__(self, rows: int, lanes: int, eos: int, room: Callable[[int], int], max_queue: int = 64, prefills_per_frame: int = 4,
                 margin_s: float = LEAD_MARGIN_S, batch_lanes: int = 0, slots: int = 1, batch_frames: int = 0):
        """`room(positions)`: frames a row holds after a prompt of that many positions. `lanes`
        one-stream vocoder lanes, then `batch_lanes` lanes of `slots` streams a call, `batch_frames`
        frames each (none where `slots` is 1)."""
        self.lanes, self.eos, self.room = lanes, eos, room
        self.batch_lanes, self.slots = (batch_lanes, slots) if slots > 1 and batch_lanes > 0 and batch_frames > 0 else (0, 1)
        self.batch_frames = batch_frames
        self.held: list[tuple[int, Emit]] = []  # (frame it was cut at, chunk) waiting to share a batched call
        self.batch_turns = itertools.count()
        self.frame = 0
        self.max_queue, self.prefills_per_frame, self.margin_s = max_queue, prefills_per_frame, margin_s
        self.rows: list[RowState | None] = [None] * rows
        self.waiting: deque[Request] = deque()
        self.epochs = itertools.count(1)
        self.step_s = 0.0  # the loop's recent frame period
        self.fastest_s = math.inf  # the shortest recent frame period measured: what this machine has shown it can do
        self.prefill_s = 0.0  # a recent prefill
        self.last_frame_at: float | None = None
        self.early_landings: deque[tuple[float, float]] = deque()  # (when, audio left) of watched chunks, the last LATE_EARLY_CHUNK_HOLD_S
        self.best_early_left_s = -math.inf  # the most audio left that a watched chunk has landed with: what this machine has shown

    # ---- requests coming and going ---------------------------------------------------------

    def add(self, request: Request) -> int | None:
        """Queue `request` (FIFO); returns its position where it must wait (no free row or others first)."""
        if len(self.waiting) >= self.max_queue:
            raise EngineBusy(f"The server is busy: {len(self.waiting)} requests ahead; try again shortly.")
        self.waiting.append(request)
        if len(self.waiting) > 1 or all(self.rows):
            request.ahead = len(self.waiting) - 1
        return request.ahead

    def waiting_request(self, handle: Handle) -> Request | None:
        return next((request for request in self.waiting if request.handle is handle), None)

    def row_of(self, handle: Handle) -> int | None:
        return next((row for row, state in enumerate(self.rows) if state is not None and state.handle is handle), None)

    def cancel(self, handle: Handle) -> Finish | None:
        """Take the request out of the queue or free its row (for the next frame); None: neither holds it."""
        request = self.waiting_request(handle)
        if request is not None:
            self.waiting.remove(request)
            return Finish(None, handle)
        row = self.row_of(handle)
        if row is None:
            return None
        state = self.rows[row]
        self.rows[row] = None
        self.held = [(frame, emit) for frame, emit in self.held if emit.row != row]  # nobody listens to it any more
        return Finish(row, handle, state.warnings, state.segment_frames)

    def text_arrived(self, row: int, positions: int) -> None:
        """Streamed text: the segment's length, and with it its frame budget, grows."""
        self.rows[row].text_rows += positions

    def abort(self, row: int, error: BaseException) -> list[Action]:
        """The runtime failed the row (a prefill, a vocoder reset): its pending frames, then its end with `error`."""
        state = self.rows[row]
        actions: list[Action] = self._cut(state) if state.pending else []
        actions += self._release_held(row)
        self.rows[row] = None
        return [*actions, Finish(row, state.handle, state.warnings, state.segment_frames, error)]

    def fail_running(self, error: BaseException) -> list[Finish]:
        finished = [Finish(row, state.handle, state.warnings, state.segment_frames, error) for row, state in enumerate(self.rows) if state]
        self.rows = [None] * len(self.rows)
        self.held = []
        return finished

    def fail_waiting(self, error: BaseException) -> list[Finish]:
        finished = [Finish(None, request.handle, error=error) for request in self.waiting]
        self.waiting.clear()
        return finished

    def positions(self) -> list[tuple[Handle, int]]:
        """Waiting requests whose place in the queue is not the one last announced, with their place."""
        changed = []
        for ahead, request in enumerate(self.waiting):
            if request.ahead != ahead:
                request.ahead = ahead
                changed.append((request.handle, ahead))
        return changed

    # ---- one frame -------------------------------------------------------------------------

    def schedule(self, now: float) -> Schedule:
        """Admit waiting requests into free rows: every one that fits while nothing runs; else up to
        `prefills_per_frame`, and only as many as keep the playing streams ahead (`keeps_ahead`) and
        leave the frames fast enough for their own first chunks (`_first_chunks_in_time`)."""
        free = [row for row, state in enumerate(self.rows) if state is None]
        running = [state for state in self.rows if state is not None]
        count = min(len(free), len(self.waiting), self.prefills_per_frame if running else len(free))
        if running:
            leads = [(state.lead(now), state.frames_to_chunk()) for state in running if state.first_chunk_at is not None]
            count = next((k for k in range(count, 0, -1) if keeps_ahead(leads, len(running), k, self.step_s, self.prefill_s, self.margin_s)
                          and self._first_chunks_in_time(running, k)), 0)
        admitted = [self._admit(self.waiting.popleft(), row) for row in free[:count]]
        return Schedule(admitted, self.positions(), [state.epoch if state else None for state in self.rows])

    def _first_chunks_in_time(self, running: list[RowState], admitted: int) -> bool:
        """Whether `admitted` more rows leave the frames fast enough for the first chunks of the streams
        that have them ahead: the first `admitted` waiting requests, and the running rows not yet at
        their steady chunks. The frame period they would bring must stay within each one's
        `longest_frame_period` (a running stream's second chunk is due 80 ms after its first: it is the
        one `keeps_ahead`, whose margin is a steady chunk's, cannot protect).

        The period is `keeps_ahead`'s upper bound, the recent one times (running + admitted) / running,
        with the admitted prefills spread over the frames the bound covers (a stream's first chunk to
        its first steady one). A stream holds the queue only where this machine has shown a period
        that fits SHOWN_ROWS rows in its bound: there the frames get fast enough once running streams
        end, and a new stream fits beside another. Elsewhere (a CPU with a tiny model: 30-80 ms a
        frame) holding would run the queue one stream at a time, a far longer wait than the stalls it
        spares. When nothing runs `schedule` admits without asking, so no queue waits for ever. A
        stream paced by its text (`Request.paced_by_text`) holds nothing: faster frames would not bring
        its chunks sooner, and holding its own admission only delays its first audio."""
        slower = self.step_s * (len(running) + admitted) / len(running)
        starting = [state.request for state in running if state.chunk_index <= len(state.request.job.schedule)]
        for request in [*starting, *itertools.islice(self.waiting, admitted)]:
            longest, early_frames = first_chunks_bound(tuple(request.job.schedule))
            if self.fastest_s * SHOWN_ROWS > longest or request.paced_by_text:
                continue
            if slower + admitted * self.prefill_s / early_frames > longest:
                return False
        return True

    def early_chunk_landed(self, at: float, left_s: float) -> None:
        """A watched chunk (`Emit.watched`) reached its listener at `at` with `left_s` of the audio before
        it still to play (playback from its stream's first chunk; negative: the listener heard a gap)."""
        self.early_landings.append((at, left_s))
        self.best_early_left_s = max(self.best_early_left_s, left_s)
        self._forget_landings(at)

    def starts_wait(self, now: float) -> bool:
        """Whether a new stream's first chunk (`Emit.may_wait`) goes to its listener with its second
        rather than at once: while a watched chunk has landed within the last LATE_EARLY_CHUNK_HOLD_S
        with under FIRST_CHUNKS_MARGIN_S of audio left (the time counted from the first chunk's
        audio being ready, whether it waited or not). On a loaded GPU each early chunk's vocoder call
        waits behind the others' and the batched steady calls, which the frame-period bounds of
        admission do not see; playback that starts with two chunks has their audio to cover the
        third's wait, and the first audio comes that much later instead of a gap after it. The
        chunks are cut as ever: the audio is the same. Only where this machine has shown a watched
        chunk landing with the margin: elsewhere (a CPU with a tiny model) every one is late."""
        self._forget_landings(now)
        return self.best_early_left_s >= FIRST_CHUNKS_MARGIN_S and any(left < FIRST_CHUNKS_MARGIN_S for _, left in self.early_landings)

    def _forget_landings(self, now: float) -> None:
        while self.early_landings and self.early_landings[0][0] < now - LATE_EARLY_CHUNK_HOLD_S:
            self.early_landings.popleft()

    def update_from_output(self, schedule: Schedule, output: StepOutput) -> list[Action]:
        """Fold one step's frames into the rows it ran for; returns what to vocode, prefill and end, in order."""
        self._measure(output)
        self.frame += 1
        actions: list[Action] = []
        for row, epoch in enumerate(schedule.running):
            state = self.rows[row]
            if epoch is None or state is None or state.epoch != epoch:
                continue  # freed, or on to its next segment, since the step was launched
            if not output.produced[row]:
                # Running but no frame: it waits for more text. Its pending frames wait too: chunks cut
                # by the schedule alone keep a request's audio the same from run to run (the vocoder's
                # floating-point result depends on how the frames are split into calls).
                continue
            state.generate_ms += output.prefill_ms.get(row, 0.0) + output.step_ms
            codes = np.array(output.codes[row])
            actions += self._add_frame(state, codes, output.now)
            actions += self._check_end(state, int(codes[0]), int(output.tokens[row]), output.now)
        if self._batch_due(output.now):
            actions += self._flush()
        self.last_frame_at = output.now if any(self.rows) else None
        return actions

    def pause(self) -> None:
        """No step runs for a while (every row waits for text or the rest of its prompt): the period of the
        next step is not measured across the wait."""
        self.last_frame_at = None

    def flush_held(self) -> list[Action]:
        """The held steady chunks' call now (no step runs to make their partners)."""
        return self._flush() if self.held else []

    # ---- inside -------------------------------------------------------------------------------

    def _measure(self, output: StepOutput) -> None:
        if self.last_frame_at is not None:
            self.step_s = _recent(self.step_s, output.now - self.last_frame_at)
            self.fastest_s = min(self.fastest_s, self.step_s)
        for ms in output.prefill_ms.values():
            self.prefill_s = _recent(self.prefill_s, ms / 1000.0)

    def _admit(self, request: Request, row: int) -> Admission:
        state = RowState(request, row, chunk_sizes(request.job.schedule))
        self.rows[row] = state
        return Admission(row, request, vocoder_lane(row, 0, self.lanes), self._start_segment(state))

    def _start_segment(self, state: RowState) -> StartSegment:
        job, segment = state.request.job, state.request.segments[state.segment]
        room = self.room(segment.prompt.shape[1] + segment.awaits)
        state.limit = min(room, job.segment_frames or room)
        state.budget = min(job.max_frames - state.total, state.limit)
        state.frames = 0
        state.text_known = segment.text_tokens or segment.chars
        state.text_rows = len(segment.trailing)
        state.loop = LoopWatch()
        state.epoch = next(self.epochs)
        return StartSegment(state.row, state.request, state.segment, state.budget, state.epoch)

    def _add_frame(self, state: RowState, codes: np.ndarray, now: float) -> list[Action]:
        state.frames += 1
        state.total += 1
        state.pending.append(codes)
        if not state.next_size:
            state.next_size = next(state.sizes)
        return self._cut(state, now) if len(state.pending) >= state.next_size else []

    def _cut(self, state: RowState, now: float | None = None) -> list[Action]:
        """The row's pending frames as its next chunk: to vocode now (after the row's held chunk, if
        any), or held to share a batched call. Which chunks are batched depends on the request only
        (its chunk's index and length): a batched call's audio differs in the last bits from a
        one-stream call's, and the same request must give the same audio alone or among others."""
        emit = self._emit(state, now)
        actions = self._release_held(state.row)
        if self.slots > 1 and emit.index >= EARLY_CHUNKS and len(emit.codes) == self.batch_frames:
            self.held.append((self.frame, emit))
            return actions + (self._flush() if len(self.held) == self.slots else [])
        return [*actions, emit]

    def _release_held(self, row: int) -> list[Action]:
        """The held chunks' call now if `row` has one held (its later chunks and its end come after it)."""
        return self._flush() if any(emit.row == row for _, emit in self.held) else []

    def _batch_due(self, now: float) -> bool:
        """Whether the held chunks go now: the oldest has waited its frames, or a listener runs short."""
        if not self.held:
            return False
        if self.frame - self.held[0][0] >= BATCH_WAIT_FRAMES:
            return True
        return any(self.rows[emit.row].lead(now) - len(emit.codes) / FRAMES_PER_SECOND < BATCH_LEAD_S for _, emit in self.held)

    def _flush(self) -> list[Action]:
        lane = self.lanes + next(self.batch_turns) % self.batch_lanes
        emits, self.held = [emit for _, emit in self.held], []
        return [VocodeBatch(lane, emits)]

    def _emit(self, state: RowState, now: float | None = None) -> Emit:
        """The row's pending frames as its next chunk."""
        codes = np.stack(state.pending)
        early = not state.request.paced_by_text and state.chunk_index <= len(state.request.job.schedule)
        emit = Emit(state.row, state.handle, state.chunk_index, codes, vocoder_lane(state.row, state.chunk_index, self.lanes), state.generate_ms,
                    watched=early and state.chunk_index > 0, may_wait=early and state.chunk_index == 0)
        if state.first_chunk_at is None:
            state.first_chunk_at = now
        state.audio_s += len(codes) / FRAMES_PER_SECOND
        state.chunk_index += 1
        state.pending = []
        state.generate_ms = 0.0
        state.next_size = next(state.sizes)
        return emit

    def _check_end(self, state: RowState, code: int, token: int, now: float) -> list[Action]:
        """After a frame of layer-0 code `code`: end the segment on EOS (the next `token`), at its frame
        budget, past its text's frame budget or in a loop of codes."""
        if token == self.eos:
            return self._end_segment(state, now, by_eos=True)
        if state.frames >= state.budget:
            return self._end_segment(state, now, by_eos=False)
        segments = len(state.request.segments)
        text_budget = frame_budget(state.text_units)
        if text_budget is not None and state.frames >= text_budget:
            state.warnings.append(runaway_warning(state.segment, segments, state.frames, state.text_units))
            return self._end_segment(state, now, by_eos=True)
        period = state.loop.add(code)
        if period is not None:
            state.warnings.append(loop_warning(state.segment, segments, state.frames, period))
            return self._end_segment(state, now, by_eos=True)
        return []

    def _end_segment(self, state: RowState, now: float, by_eos: bool) -> list[Action]:
        """`by_eos`: the segment ended itself (or was stopped as a runaway), not at its frame budget."""
        request = state.request
        state.segment_frames.append(state.frames)
        last_segment = state.segment + 1 >= len(request.segments)
        last = last_segment or state.total >= request.job.max_frames
        if not by_eos and state.budget == state.limit:
            state.cut.append((state.segment, state.budget))
        if last and state.cut:
            state.warnings.append(cut_warning(state.cut, len(request.segments)))
        if last and not last_segment:
            state.warnings.append(unspoken_warning(request.segments, request.job.max_frames, state.segment, by_eos))
        if not last:
            state.segment += 1
            return [self._start_segment(state)]
        actions: list[Action] = self._cut(state, now) if state.pending else []
        actions += self._release_held(state.row)
        self.rows[state.row] = None
        return [*actions, Finish(state.row, state.handle, state.warnings, state.segment_frames)]


def _recent(average: float, value: float) -> float:
    return value if not average else average + SMOOTHING * (value - average)
