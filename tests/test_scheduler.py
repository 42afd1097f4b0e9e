"""The engine's policy, driven frame by frame by hand: no model, no threads, no clock (time is passed
in). FIFO admission and queue positions, a cancel freeing its row for the next frame, chunk cuts,
vocoder lanes and batched vocoder calls, the ends of segments and requests with their warnings, rows waiting for text,
admission that keeps playing streams ahead and leaves frames fast enough for a new stream's first chunks, and the
runaway guard (frame budget, loops)."""
import itertools

import numpy as np
import pytest
import torch

from pipeline.codec.decoder import MultiStreamDecoder
from pipeline.contract.events import FRAMES_PER_SECOND
from pipeline.engine.core import Job, Segment
from pipeline.engine.scheduler import (
    BATCH_LEAD_S,
    BATCH_WAIT_FRAMES,
    EARLY_CHUNKS,
    FIRST_CHUNKS_MARGIN_S,
    LATE_EARLY_CHUNK_HOLD_S,
    LOOP_FRAMES,
    SHOWN_ROWS,
    Admission,
    Emit,
    Finish,
    LoopWatch,
    Request,
    Scheduler,
    StartSegment,
    StepOutput,
    VocodeBatch,
    chunk_sizes,
    frame_budget,
    keeps_ahead,
    longest_frame_period,
    vocoder_lane,
)
from pipeline.errors import EngineBusy

EOS = 2150
ROOM = 2000  # frames a row holds after any prompt here
BATCH_FRAMES = MultiStreamDecoder.BATCH_FRAMES  # frames of the vocoder's batched call
PROMPT = 10


class Listener:
    """Stands for a caller's handle: the scheduler only carries it."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


def segment(chars: int = 40, text_tokens: int = 10, trailing: int = 0, text_end: bool = True) -> Segment:
    return Segment(torch.zeros(1, PROMPT, 4), torch.zeros(trailing, 4), text_end, chars=chars, text_tokens=text_tokens)


def request(name: str, max_frames: int = 500, schedule=(1, 2, 4), segments: list[Segment] | None = None, segment_frames: int | None = None) -> Request:
    job = Job(segments or [segment()], None, 0, max_frames, tuple(schedule), segment_frames=segment_frames)
    return Request(Listener(name), job, list(job.segments))


def scheduler(rows: int = 2, lanes: int = 1, **options) -> Scheduler:
    return Scheduler(rows, lanes, EOS, lambda positions: ROOM - positions, **options)


class Frames:
    """Layer-0 codes that never repeat, as speech's do not: no loop to stop."""

    def __init__(self):
        self.next = 0

    def __call__(self) -> int:
        self.next += 1
        return self.next


def step(sched: Scheduler, schedule, codes: dict[int, int], now: float = 0.0, eos=(), prefill_ms=None) -> list:
    """The step's output: `codes` maps each row that made a frame to its layer-0 code; rows in `eos` end there."""
    rows = len(sched.rows)
    produced = np.zeros(rows, dtype=bool)
    frame = np.zeros((rows, 16), dtype=np.int64)
    tokens = np.full(rows, 7, dtype=np.int64)
    for row, code in codes.items():
        produced[row] = True
        frame[row] = code
    tokens[list(eos)] = EOS
    return sched.update_from_output(schedule, StepOutput(produced, frame, tokens, now, 1.0, prefill_ms or {}))


def run(sched: Scheduler, frames: int, codes=None, start: float = 0.0, period: float = 0.01) -> list:
    """`frames` frames in which every occupied row makes a frame; the actions of all of them."""
    codes = codes or Frames()
    actions = []
    for i in range(frames):
        schedule = sched.schedule(start + i * period)
        actions += step(sched, schedule, {row: codes() for row, epoch in enumerate(schedule.running) if epoch is not None}, start + i * period)
    return actions


def of(actions: list, kind, name: str | None = None) -> list:
    return [a for a in actions if isinstance(a, kind) and (name is None or a.handle.name == name)]


def test_admission_is_first_in_first_out_with_positions():
    sched = scheduler(rows=1)
    a, b, c = request("a"), request("b"), request("c")
    assert sched.add(a) is None  # a free row: no wait to announce
    assert sched.add(b) == 1 and sched.add(c) == 2
    first = sched.schedule(0.0)
    assert [(x.row, x.request) for x in first.admitted] == [(0, a)]
    assert first.positions == [(b.handle, 0), (c.handle, 1)]
    assert sched.schedule(0.01).admitted == [] and sched.schedule(0.01).positions == []  # nothing changed, nothing announced
    assert sched.cancel(b.handle) == Finish(None, b.handle)
    assert sched.positions() == [(c.handle, 0)]
    actions = step(sched, sched.schedule(0.02), {0: 1}, eos=[0])
    assert of(actions, Finish, "a")
    assert [x.request for x in sched.schedule(0.03).admitted] == [c]


def test_a_full_queue_refuses():
    sched = scheduler(rows=1, max_queue=2)
    sched.add(request("a"))
    sched.add(request("b"))
    with pytest.raises(EngineBusy, match="2 requests ahead; try again shortly"):
        sched.add(request("c"))


def test_a_cancel_frees_the_row_for_the_next_frame():
    sched = scheduler(rows=1)
    a, b = request("a"), request("b")
    sched.add(a)
    sched.add(b)
    schedule = sched.schedule(0.0)
    assert sched.cancel(a.handle).row == 0
    assert step(sched, schedule, {0: 1}) == []  # the frame in flight for it is dropped
    assert [(x.row, x.request) for x in sched.schedule(0.01).admitted] == [(0, b)]


def test_idle_admits_every_free_row_and_a_running_batch_a_few_per_frame():
    sched = scheduler(rows=8, prefills_per_frame=2)
    for name in "abcde":
        sched.add(request(name))
    assert len(sched.schedule(0.0).admitted) == 5
    for name in "fgh":
        sched.add(request(name))
    assert len(sched.schedule(0.01).admitted) == 2 and len(sched.schedule(0.02).admitted) == 1


def test_chunks_follow_the_schedule_and_the_last_one_takes_the_rest():
    sched = scheduler(rows=1)
    sched.add(request("a", schedule=(1, 2, 4)))
    actions = run(sched, 11)
    actions += step(sched, sched.schedule(1.0), {0: 999}, eos=[0])
    assert [len(e.codes) for e in of(actions, Emit)] == [1, 2, 4, 4, 1]
    assert [e.index for e in of(actions, Emit)] == [0, 1, 2, 3, 4]
    assert np.array_equal(np.concatenate([e.codes for e in of(actions, Emit)])[:, 0], [*range(1, 12), 999])
    assert isinstance(actions[-1], Finish) and actions[-1].warnings == [] and actions[-1].segment_frames == [12]


def test_first_chunks_and_steady_chunks_take_lanes_of_their_own():
    assert [vocoder_lane(row, 0, 4) for row in range(4)] == [0, 1, 0, 1]
    assert [vocoder_lane(row, EARLY_CHUNKS, 4) for row in range(4)] == [2, 3, 2, 3]
    assert [vocoder_lane(row, chunk, 3) for row in range(2) for chunk in (0, EARLY_CHUNKS)] == [0, 2, 1, 2]
    assert {vocoder_lane(row, chunk, 1) for row in range(3) for chunk in range(6)} == {0}
    sched = scheduler(rows=2, lanes=4)
    sched.add(request("a", schedule=(1,)))
    sched.add(request("b", schedule=(1,)))
    admitted = sched.schedule(0.0).admitted
    assert [x.lane for x in admitted] == [0, 1]  # each row's vocoder state is reset where its first chunk goes
    actions = run(sched, 6)
    assert [e.lane for e in of(actions, Emit, "a")] == [0, 0, 0, 0, 2, 2]
    assert [e.lane for e in of(actions, Emit, "b")] == [1, 1, 1, 1, 3, 3]


def test_a_row_out_of_text_waits_without_frames():
    sched = scheduler(rows=2)
    sched.add(request("a", schedule=(2,)))
    sched.add(request("b", schedule=(2,)))
    sched.schedule(0.0)
    actions = []
    for i in range(5):  # row 1 waits for text in frames 1 to 3
        actions += step(sched, sched.schedule(i * 0.01), {0: 10 + i} if i in (1, 2, 3) else {0: 10 + i, 1: 20 + i}, i * 0.01)
    assert [e.codes[:, 0].tolist() for e in of(actions, Emit, "b")] == [[20, 24]]  # its chunk spans the wait
    assert sched.rows[1].total == 2 and sched.rows[0].total == 5


def test_eos_ends_the_request_after_its_last_chunk():
    sched = scheduler(rows=1)
    a = request("a", schedule=(4,))
    sched.add(a)
    actions = run(sched, 2)
    actions += step(sched, sched.schedule(0.1), {0: 5}, eos=[0])
    assert [type(x) for x in actions] == [Emit, Finish]
    assert len(actions[0].codes) == 3 and actions[1] == Finish(0, a.handle, [], [3])
    assert sched.rows == [None]


def test_a_requests_own_frame_limit_leaves_later_segments_unspoken():
    sched = scheduler(rows=1)
    sched.add(request("a", max_frames=5, segments=[segment(chars=30), segment(chars=20), segment(chars=12)]))
    (finish,) = of(run(sched, 5), Finish)
    assert finish.segment_frames == [5]
    assert finish.warnings == ["The request's frame limit (5 frames, 0.4 s) was reached in segment 1 of 3: the rest of it and the last 2 segments "
                               "(32 characters) of the text went unspoken; raise the length limit or leave it at its default."]


def test_segments_cut_at_their_own_limit_are_named_and_the_next_segment_starts():
    sched = scheduler(rows=1)
    sched.add(request("a", segments=[segment(), segment(), segment()], segment_frames=3))
    starts = [x.start for x in sched.schedule(0.0).admitted]
    actions = []
    for i in range(8):
        schedule = sched.schedule(i * 0.01)
        actions += step(sched, schedule, {0: 100 + i}, i * 0.01, eos=[0] if i == 4 else [])
    starts += of(actions, StartSegment)
    assert [(s.segment, s.budget) for s in starts] == [(0, 3), (1, 3), (2, 3)]
    (finish,) = of(actions, Finish)
    assert finish.segment_frames == [3, 2, 3]
    assert finish.warnings == ["2 of 3 segments (1, 3) reached the frame limit of one segment (3 frames, 0 s) and were cut there; "
                               "shorter sentences avoid this."]


def test_a_step_launched_before_a_segment_ended_gives_the_next_segment_nothing():
    sched = scheduler(rows=1)
    sched.add(request("a", schedule=(1,), segments=[segment(), segment()]))
    first = sched.schedule(0.0)
    second = sched.schedule(0.01)  # launched before the first step's codes are read
    actions = step(sched, first, {0: 1}, eos=[0])
    assert of(actions, StartSegment) and sched.rows[0].segment == 1
    assert step(sched, second, {0: 2}) == []  # the old segment's frame
    assert [e.codes[0, 0] for e in of(step(sched, sched.schedule(0.02), {0: 3}), Emit)] == [3]


def test_the_text_budget_stops_a_segment_that_does_not_end():
    sched = scheduler(rows=1)
    sched.add(request("a", max_frames=1000, segments=[segment(text_tokens=3)]))
    budget = frame_budget(3)
    assert budget == 136
    actions = run(sched, budget)
    (finish,) = of(actions, Finish)
    assert finish.segment_frames == [budget] and sum(len(e.codes) for e in of(actions, Emit)) == budget
    assert finish.warnings == ["The model did not end the utterance; stopped after 10.9 s, 11.3x the expected length."]


def test_without_a_token_count_the_characters_stand_in():
    sched = scheduler(rows=1)
    sched.add(request("a", segments=[segment(chars=2, text_tokens=0)]))
    (finish,) = of(run(sched, frame_budget(2)), Finish)
    assert finish.segment_frames == [frame_budget(2)]


def test_streamed_text_grows_the_budget():
    sched = scheduler(rows=1)
    sched.add(request("a", max_frames=1000, segments=[segment(chars=0, text_tokens=0, trailing=1, text_end=False)]))
    sched.schedule(0.0)
    sched.text_arrived(0, 4)  # five text positions now: 160 frames
    actions = run(sched, frame_budget(1))
    assert not of(actions, Finish)
    (finish,) = of(run(sched, frame_budget(5) - frame_budget(1)), Finish)
    assert finish.segment_frames == [frame_budget(5)] and "did not end the utterance" in finish.warnings[0]


def test_a_runaway_segment_of_several_is_named_and_the_next_one_speaks():
    sched = scheduler(rows=1)
    sched.add(request("a", segments=[segment(text_tokens=1), segment(text_tokens=1)]))
    actions = run(sched, frame_budget(1) + 1)
    assert len(of(actions, StartSegment)) == 1 and not of(actions, Finish)
    (finish,) = of(run(sched, frame_budget(1) - 1), Finish)
    assert finish.warnings == ["The model did not end segment 1 of 2; stopped after 9.0 s, 28.0x the expected length.",
                               "The model did not end segment 2 of 2; stopped after 9.0 s, 28.0x the expected length."]


@pytest.mark.parametrize("period", [1, 3, 8])
def test_codes_in_a_loop_end_the_segment(period):
    sched = scheduler(rows=1)
    sched.add(request("a", segments=[segment(text_tokens=100)]))
    speech = Frames()
    actions = run(sched, 20, speech)
    pattern = [1000 + i for i in range(period)]
    looping = iter(pattern * LOOP_FRAMES)
    actions += run(sched, LOOP_FRAMES, lambda: next(looping))
    (finish,) = of(actions, Finish)
    assert finish.segment_frames == [20 + LOOP_FRAMES]
    what = "one frame" if period == 1 else f"a {period}-frame pattern"
    assert finish.warnings == [f"The speech fell into a loop ({what} repeated for {LOOP_FRAMES} frames, 6 s); stopped after 7.6 s."]


def test_the_loop_watch_needs_the_whole_span():
    watch = LoopWatch(period=4, frames=12)
    assert [watch.add(code) for code in [5, 6, 7] * 3 + [5, 6]] == [None] * 11
    assert watch.add(7) == 3
    watch = LoopWatch(period=4, frames=12)
    assert all(watch.add(code) is None for code in [1, 2, 3, 4, 5] * 10)  # a period longer than watched


def test_keeps_ahead_protects_a_stream_about_to_run_dry_and_only_it():
    margin, step_s, prefill_s = 0.05, 0.01, 0.03
    assert keeps_ahead([], 4, 4, step_s, prefill_s, margin)  # nothing playing yet: admit
    assert keeps_ahead([(1.5, 16), (2.0, 3)], 2, 2, step_s, prefill_s, margin)  # comfortable
    assert not keeps_ahead([(1.5, 16), (0.09, 1)], 2, 1, step_s, prefill_s, margin)  # 0.09 - 0.01 - 0.03 - 0.005 < 0.05
    assert keeps_ahead([(1.5, 16), (0.09, 1)], 2, 0, step_s, prefill_s, margin)
    assert keeps_ahead([(0.02, 1)], 1, 1, step_s, prefill_s, margin)  # under the margin whatever happens: holding the queue would not help
    assert keeps_ahead([(0.2, 4)], 1, 1, step_s, prefill_s, margin) and not keeps_ahead([(0.2, 4)], 1, 3, step_s, prefill_s, margin)


def test_a_request_waits_while_admitting_it_would_drain_a_playing_stream():
    sched = scheduler(rows=2)
    a, b = request("a", schedule=(1, 2)), request("b")
    sched.add(a)
    (admission,) = sched.schedule(0.0).admitted
    assert isinstance(admission, Admission)
    step(sched, sched.schedule(0.0), {0: 1}, 0.0, prefill_ms={0: 30.0})  # chunk 0 (80 ms of audio) plays from t = 0
    step(sched, sched.schedule(0.01), {0: 2}, 0.01)  # frames every 10 ms; chunk 1 needs one more
    assert (sched.step_s, sched.prefill_s) == (pytest.approx(0.01), pytest.approx(0.03))
    assert sched.add(b) is None
    held = sched.schedule(0.01)  # a's lead: 70 ms, 60 ms at its next chunk, 20 ms with b's prefill and a slower step
    assert held.admitted == [] and held.positions == [(b.handle, 0)]
    step(sched, held, {0: 3}, 0.02)  # chunk 1 lands: 240 ms given, 20 ms played
    admitted = sched.schedule(0.02)
    assert [x.request for x in admitted.admitted] == [b] and admitted.positions == []


def test_a_stream_without_its_first_chunk_does_not_hold_the_queue():
    sched = scheduler(rows=2)
    sched.add(request("a", schedule=(16,)))
    sched.schedule(0.0)
    run(sched, 5, start=0.0)
    sched.add(request("b"))
    assert len(sched.schedule(0.05).admitted) == 1


# ---- a new stream's first chunks ----------------------------------------------------------------

DEFAULT = (1, 2, 4, 8, 16)  # the engine's default schedule: the tightest first chunks
UNCUT = (500,)  # a running row without a first chunk in these tests: `keeps_ahead` has nothing to protect


def least_audio_left(schedule, period: float, chunks: int = 40) -> float:
    """The least audio a listener holds when a chunk of its stream lands (frames `period` apart,
    playback from the first chunk): the listener's side, counted chunk by chunk."""
    sizes = list(itertools.islice(chunk_sizes(schedule), chunks))
    cuts = list(itertools.accumulate(sizes))  # the frame that completes each chunk
    given = [frames / FRAMES_PER_SECOND for frames in cuts]
    return min(given[j - 1] - (cuts[j] - cuts[0]) * period for j in range(1, chunks))


def test_the_longest_frame_period_for_a_new_streams_first_chunks():
    margin = FIRST_CHUNKS_MARGIN_S
    assert longest_frame_period(DEFAULT) == pytest.approx((0.08 - margin) / 2) == pytest.approx(0.03)  # the second chunk, two frames after the first
    assert longest_frame_period(DEFAULT, 0.05) == pytest.approx(0.015)
    assert longest_frame_period((1,)) == pytest.approx(0.08 - margin)
    assert longest_frame_period((16,)) == pytest.approx((1.28 - margin) / 16)  # 78.75 ms: a second's audio buffered at once
    assert longest_frame_period((2, 3)) == pytest.approx((0.16 - margin) / 3)
    assert longest_frame_period((16, 1)) == pytest.approx(0.08)  # steady one-frame chunks: real time binds
    assert longest_frame_period((1,), 0.1) < 0  # no period lands the second chunk with 100 ms left
    with pytest.raises(ValueError, match="positive frame counts"):
        longest_frame_period(())


@pytest.mark.parametrize("schedule", [DEFAULT, (1,), (16,), (2, 3), (3, 7, 5), (1, 2, 4, 8, 16, 12, 16)])
def test_at_the_longest_frame_period_every_chunk_lands_with_the_margin_left(schedule):
    longest = longest_frame_period(schedule)
    assert least_audio_left(schedule, longest) == pytest.approx(FIRST_CHUNKS_MARGIN_S)
    assert least_audio_left(schedule, longest * 1.01) < FIRST_CHUNKS_MARGIN_S


def loaded(rows: int, running: int, shown: float, period: float, frames: int = 12, schedule=UNCUT) -> tuple[Scheduler, float]:
    """A scheduler with `running` rows busy (of `schedule`: by default no first chunk yet), whose frames
    took `shown` seconds, then `period`; returns it and the time of its next frame."""
    sched = scheduler(rows=rows)
    for n in range(running):
        sched.add(request(f"running{n}", schedule=schedule))
    run(sched, 4, period=shown)
    run(sched, frames, start=4 * shown, period=period)
    return sched, 4 * shown + frames * period


def test_a_new_stream_waits_while_the_frames_are_too_slow_for_its_first_chunks_then_joins():
    sched, now = loaded(rows=3, running=1, shown=0.01, period=0.05)  # a machine that has run 10 ms frames, now at 50 ms
    assert sched.fastest_s == pytest.approx(0.01) and sched.step_s > longest_frame_period(DEFAULT)
    b = request("b", schedule=DEFAULT)
    assert sched.add(b) is None  # a free row
    held = sched.schedule(now)
    assert held.admitted == [] and held.positions == [(b.handle, 0)]  # its place is announced as any wait's
    periods = []
    for i in range(40):  # frames of 10 ms again; the running stream goes on
        schedule = sched.schedule(now + i * 0.01)
        if schedule.admitted:
            break
        periods.append(sched.step_s)
        step(sched, schedule, {0: 100 + i}, now + i * 0.01)
    assert [x.request for x in schedule.admitted] == [b] and sched.rows[0].request.handle.name == "running0"
    # It joins once two rows' frames fit its bound, not before.
    assert sched.step_s * 2 <= longest_frame_period(DEFAULT) < periods[-1] * 2


def test_a_waiting_stream_joins_once_nothing_runs_however_slow_the_frames_were():
    sched, now = loaded(rows=3, running=1, shown=0.01, period=0.05)
    b = request("b", schedule=DEFAULT)
    sched.add(b)
    assert sched.schedule(now).admitted == []
    actions = step(sched, sched.schedule(now), {0: 1}, now, eos=[0])
    assert of(actions, Finish, "running0") and sched.step_s > longest_frame_period(DEFAULT)
    assert [x.request for x in sched.schedule(now + 0.05).admitted] == [b]


def test_a_machine_that_never_ran_fast_enough_is_never_held():
    """A CPU with a tiny model: its frames take longer than a new stream's first chunks allow even
    with one row, so the queue joins as `keeps_ahead` alone allows."""
    sched = scheduler(rows=4)
    sched.add(request("a", schedule=UNCUT))
    assert len(sched.schedule(0.0).admitted) == 1  # alone: admitted as soon as it comes
    run(sched, 12, period=0.06)
    assert sched.fastest_s * SHOWN_ROWS > longest_frame_period(DEFAULT)
    for name in "bc":
        sched.add(request(name, schedule=DEFAULT))
    assert [x.request.handle.name for x in sched.schedule(0.72).admitted] == ["b", "c"]


def test_an_early_chunk_that_landed_late_makes_first_chunks_wait_for_a_while():
    """A new stream's early chunk that reached its listener with under the margin of audio left (its
    vocoder call waited on a loaded GPU): new streams' first chunks wait for their second until that
    is LATE_EARLY_CHUNK_HOLD_S old; one that landed with the margin changes nothing. Admission goes on
    as before meanwhile."""
    sched, now = loaded(rows=3, running=1, shown=0.01, period=0.01)
    sched.early_chunk_landed(now - 0.2, 0.05)  # this machine lands early chunks in time
    assert not sched.starts_wait(now)
    sched.early_chunk_landed(now, FIRST_CHUNKS_MARGIN_S / 2)
    assert sched.starts_wait(now) and sched.starts_wait(now + LATE_EARLY_CHUNK_HOLD_S - 0.01)
    sched.add(request("b", schedule=DEFAULT))
    assert [x.request.handle.name for x in sched.schedule(now).admitted] == ["b"]
    assert not sched.starts_wait(now + LATE_EARLY_CHUNK_HOLD_S + 0.01)
    sched.early_chunk_landed(now + 0.6, FIRST_CHUNKS_MARGIN_S)
    assert not sched.starts_wait(now + 0.6) and len(sched.early_landings) == 1  # the old ones are forgotten


def test_late_early_chunks_change_nothing_where_none_ever_landed_in_time():
    """A machine that has never landed an early chunk with the margin (a CPU with a tiny model, whose
    every second chunk is late): first chunks never wait."""
    sched = scheduler(rows=2)
    sched.early_chunk_landed(0.0, -0.1)
    sched.early_chunk_landed(0.1, FIRST_CHUNKS_MARGIN_S / 2)
    assert not sched.starts_wait(0.1)


def test_the_watched_chunks_are_a_streams_early_ones_and_none_of_a_stream_paced_by_its_text():
    """The chunks whose landing the scheduler hears of: the second through the first repeat of the
    schedule's last size. The first chunk may wait for the second. Neither for a stream whose text
    streams in (its pace is the text's)."""
    sched = scheduler(rows=2)
    sched.add(request("a", schedule=(1, 2, 4)))
    sched.add(request("talker", schedule=(1, 2, 4), segments=[segment(text_end=False, trailing=40)]))
    sched.schedule(0.0)
    actions = run(sched, 30)
    assert [e.watched for e in of(actions, Emit, "a")] == [False, True, True, True, False, False, False, False]
    assert [e.may_wait for e in of(actions, Emit, "a")] == [True] + [False] * 7
    assert len(of(actions, Emit, "talker")) > 4
    assert not any(e.watched or e.may_wait for e in of(actions, Emit, "talker"))


def test_the_bound_is_the_waiting_requests_own_schedules_and_the_queue_stays_in_order():
    sched, now = loaded(rows=5, running=2, shown=0.01, period=0.035, frames=20)  # 35 ms frames
    tight, loose = request("tight", schedule=DEFAULT), request("loose", schedule=(16,))
    sched.add(tight)
    sched.add(loose)
    assert sched.schedule(now).admitted == []  # 30 ms for the first, the second does not overtake it
    sched, now = loaded(rows=5, running=2, shown=0.01, period=0.035, frames=20)
    sched.add(loose)
    sched.add(tight)
    schedule = sched.schedule(now)
    assert [x.request for x in schedule.admitted] == [loose]  # 35 ms x 3 / 2 rows is under its 78.75 ms
    assert schedule.positions == [(tight.handle, 0)]
    # 30 ms frames at best: too slow for the default schedule's bound with two rows, so it holds
    # nothing; 16-frame chunks hold it, and one row more fits their bound, two more do not. (The
    # running row is past its first chunks: it holds nothing either.)
    for schedule, joining in [(DEFAULT, ["x", "y", "z"]), ((16,), ["x"])]:
        sched, now = loaded(rows=4, running=1, shown=0.03, period=0.03, schedule=(1,))
        assert sched.rows[0].chunk_index > 1
        for name in "xyz":
            sched.add(request(name, schedule=schedule))
        assert [x.request.handle.name for x in sched.schedule(now).admitted] == joining


def test_a_running_stream_in_its_first_chunks_holds_the_queue_as_a_new_one_would():
    """Its second chunk is due 80 ms after its first: admissions that would slow the frames past its
    bound wait until it reaches its steady chunks, however little audio `keeps_ahead` sees it hold."""
    sched = scheduler(rows=4)
    sched.add(request("a", schedule=DEFAULT))
    assert len(sched.schedule(0.0).admitted) == 1
    run(sched, 3, period=0.01)  # shown 10 ms frames; its first chunk is out
    run(sched, 6, start=0.03, period=0.025)  # now 25 ms frames: a second row would make them ~50
    first = sched.rows[0]
    assert 1 <= first.chunk_index <= len(DEFAULT) and sched.step_s * 2 > longest_frame_period(DEFAULT)
    sched.add(request("b", schedule=(16,)))  # whose own bound, 78.75 ms, two rows fit
    now = 0.18
    for _ in range(60):
        schedule = sched.schedule(now)
        if schedule.admitted:
            break
        step(sched, schedule, {0: 7}, now)
        now += 0.025
    assert [x.request.handle.name for x in schedule.admitted] == ["b"]
    assert first.chunk_index > len(DEFAULT)  # not before "a" reached its steady chunks


def test_streams_paced_by_their_text_hold_no_queue_for_their_first_chunks():
    """A stream whose text streams in (Qwen3-Omni's talker, a text stream) gets its chunks at the text's
    pace: frames too slow for a new stream's first chunks hold neither its own admission nor, while it
    runs its first chunks, anyone else's; a stream of whole text is held as before."""
    sched, now = loaded(rows=4, running=1, shown=0.01, period=0.05)
    assert sched.step_s > longest_frame_period(DEFAULT)
    sched.add(request("spoken", schedule=DEFAULT))
    assert sched.schedule(now).admitted == []
    paced = scheduler(rows=4)
    paced.add(request("talker", schedule=DEFAULT, segments=[segment(text_end=False, trailing=40)]))
    assert len(paced.schedule(0.0).admitted) == 1
    run(paced, 3, period=0.01)
    run(paced, 6, start=0.03, period=0.05)  # in its first chunks, frames far slower than their bound
    assert 1 <= paced.rows[0].chunk_index <= len(DEFAULT) and paced.step_s > longest_frame_period(DEFAULT)
    paced.add(request("next talker", schedule=DEFAULT, segments=[segment(text_end=False, trailing=40)]))
    assert [x.request.handle.name for x in paced.schedule(0.33).admitted] == ["next talker"]


# ---- batched vocoder calls ---------------------------------------------------------------------

STEADY = (1, 2, 4, 8, BATCH_FRAMES)  # the default schedule: chunks 4 on are BATCH_FRAMES long
STEADY_AT = 1 + 2 + 4 + 8 + BATCH_FRAMES  # frames of a stream when its first steady chunk is cut


def batching(rows: int = 4, slots: int = 2) -> Scheduler:
    return scheduler(rows=rows, lanes=3, batch_lanes=2, slots=slots, batch_frames=BATCH_FRAMES)


def batches(actions: list) -> list[list[tuple[str, int]]]:
    return [[(emit.handle.name, emit.index) for emit in a.emits] for a in actions if isinstance(a, VocodeBatch)]


def test_steady_chunks_of_rows_cut_together_share_one_batched_call():
    sched = batching(rows=2, slots=2)
    sched.add(request("a", schedule=STEADY))
    sched.add(request("b", schedule=STEADY))
    actions = run(sched, STEADY_AT)
    assert [(e.handle.name, e.index, e.lane) for e in of(actions, Emit)] == [
        (name, index, vocoder_lane(row, index, 3)) for index in range(EARLY_CHUNKS) for row, name in enumerate("ab")]
    assert all(e.lane < 2 for e in of(actions, Emit))  # first chunks: the two first-chunk lanes of the three one-stream lanes
    assert batches(actions) == [[("a", EARLY_CHUNKS), ("b", EARLY_CHUNKS)]]
    call = of(actions, VocodeBatch)[0]
    assert call.lane in (3, 4) and all(len(e.codes) == BATCH_FRAMES for e in call.emits)
    assert actions[-1] is call  # cut in the last frame, and full: it goes at once


def test_a_lone_steady_chunk_waits_a_few_frames_for_company_then_goes_alone():
    sched = batching(rows=2, slots=2)
    sched.add(request("a", schedule=STEADY))
    assert batches(run(sched, STEADY_AT + BATCH_WAIT_FRAMES - 1)) == []
    actions = run(sched, 1, start=1.0)
    assert batches(actions) == [[("a", EARLY_CHUNKS)]]
    assert batches(run(sched, BATCH_FRAMES - 1, start=1.1)) == []  # the next one waits again
    second = of(run(sched, 1 + BATCH_WAIT_FRAMES, start=2.0), VocodeBatch)
    assert [(e.index, len(e.codes)) for call in second for e in call.emits] == [(EARLY_CHUNKS + 1, BATCH_FRAMES)]
    assert of(actions, VocodeBatch)[0].lane != second[0].lane  # the batched lanes take turns


def test_a_held_chunk_goes_before_its_rows_end_and_its_last_shorter_chunk():
    sched = batching(rows=2, slots=2)
    sched.add(request("a", schedule=STEADY))
    actions = run(sched, STEADY_AT + 3)
    actions += step(sched, sched.schedule(1.0), {0: 999}, eos=[0])
    tail = actions[-3:]
    assert batches(tail[:1]) == [[("a", EARLY_CHUNKS)]]
    assert isinstance(tail[1], Emit) and (tail[1].index, len(tail[1].codes)) == (EARLY_CHUNKS + 1, 4) and tail[1].lane < 3
    assert isinstance(tail[2], Finish)
    assert len(of(actions, Emit)) + sum(len(b) for b in batches(actions)) == EARLY_CHUNKS + 2


def test_a_cancelled_rows_held_chunk_is_dropped_and_its_row_reused_cleanly():
    sched = batching(rows=1, slots=2)
    sched.add(request("a", schedule=STEADY))
    run(sched, STEADY_AT)
    a = sched.rows[0].handle
    assert sched.cancel(a).row == 0
    sched.add(request("b", schedule=STEADY))
    actions = run(sched, STEADY_AT + BATCH_WAIT_FRAMES, start=1.0)
    assert batches(actions) == [[("b", EARLY_CHUNKS)]]


def test_a_listener_short_of_audio_gets_its_held_chunk_at_once():
    sched = batching(rows=2, slots=2)
    sched.add(request("a", schedule=STEADY))
    # Frames 100 ms apart: slower than real time, so by its first steady chunk the listener has
    # 15 frames (1.2 s) given over ~2.6 s, and less than BATCH_LEAD_S left once its chunk is cut.
    actions = run(sched, STEADY_AT, period=0.1)
    assert batches(actions) == [[("a", EARLY_CHUNKS)]]
    assert sched.rows[0].lead(0.1 * (STEADY_AT - 1)) - BATCH_FRAMES / 12.5 < BATCH_LEAD_S


def test_which_chunks_batch_depends_on_the_request_only():
    """Chunk index and length decide, not the neighbours: the same request's chunks take the same kind of call alone and among others."""
    def calls(names: str) -> list[tuple[int, int, str]]:
        sched = batching(rows=3, slots=3)
        for name in names:
            sched.add(request(name, schedule=(1, 2, 4, 8, 16, 12, 16)))
        actions = run(sched, 1 + 2 + 4 + 8 + 16 + 12 + 16 + 16 + BATCH_WAIT_FRAMES)
        kinds = [(e.index, len(e.codes), "one") for e in of(actions, Emit, "a")]
        kinds += [(e.index, len(e.codes), "batched") for call in of(actions, VocodeBatch) for e in call.emits if e.handle.name == "a"]
        return sorted(kinds)

    alone = calls("a")
    assert alone == calls("abc")
    assert [kind for _, _, kind in alone] == ["one"] * EARLY_CHUNKS + ["batched", "one", "batched", "batched"]


def test_without_slots_nothing_is_held():
    sched = scheduler(rows=1, lanes=4, batch_lanes=2, slots=1, batch_frames=BATCH_FRAMES)
    sched.add(request("a", schedule=STEADY))
    actions = run(sched, STEADY_AT)
    assert batches(actions) == [] and len(of(actions, Emit)) == EARLY_CHUNKS + 1
    assert of(actions, Emit)[-1].lane == vocoder_lane(0, EARLY_CHUNKS, 4)
