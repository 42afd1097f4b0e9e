"""The batched engine on CPU: batched results equal solo results (greedy and seeded sampling, mixed
modes and prompt lengths, requests joining mid-stream and others cancelled), text that arrives
while speaking, FIFO admission with a bounded queue, and Stop within a frame. Where a test needs the
engine to have had the chance to do something (and not done it), it waits for the engine's loop to
run more frames, never for a time (the policy itself is tested frame by frame in test_scheduler.py)."""
import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from pipeline.engine import Queued
from pipeline.errors import EngineBusy
from pipeline.request import SpeechRequest
from pipeline.tts import SAMPLES_PER_FRAME, TTS

ROWS = 3
HANG_GUARD_S = 600  # ends a wait for something that never comes; no wait decides pass or fail by its duration


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def run_frames(engine, frames: int = 3) -> None:
    """Return once the engine's loop has launched `frames` more decode steps (and so read at least
    `frames - 1` of them), or waits with no row able to make a frame: a row that could make a frame
    has made one by then."""
    target = engine.iteration + frames
    wait_until(lambda: engine.iteration >= target or engine.parked, "the engine's loop stopped running frames")


def frames_made(engine, handle) -> int:
    """The frames the engine has made for `handle`'s request so far (0 before it has a row)."""
    row = engine.scheduler.row_of(handle)
    return 0 if row is None else engine.slots[row].total


@pytest.fixture(scope="module")
def models(tiny_checkpoints):
    return {kind: TTS.from_pretrained(str(path), rows=ROWS) for kind, path in tiny_checkpoints.items()}


@pytest.fixture(scope="module")
def voices(models, reference_wav):
    base = models["base"]
    return {
        "icl": base.create_voice_prompt(str(reference_wav), "Speak slowly and warmly."),
        "xvec": base.create_voice_prompt(str(reference_wav), x_vector_only=True),
    }


def cases(voices):
    """(model type, request, voice): mixed modes, prompt lengths, greedy and seeded sampling."""
    return [
        ("custom_voice", SpeechRequest("Hello there, this is a test.", speaker="ryan", greedy=True, max_frames=30), None),
        ("custom_voice", SpeechRequest("A much longer sentence, so that this prompt is longer than the others are.", speaker="vivian", seed=3, max_frames=26), None),
        ("voice_design", SpeechRequest("Calm words.", instruct="A deep, gravelly male voice.", seed=11, max_frames=22), None),
        ("base", SpeechRequest("Cloned voice speaking now.", seed=5, max_frames=25), voices["icl"]),
        ("base", SpeechRequest("Only the embedding.", greedy=True, max_frames=20), voices["xvec"]),
    ]


def finish(handle):
    """Codes and audio of a handle, after its last chunk."""
    audio = np.concatenate([c.audio for c in handle])
    return handle.codes, audio


def solo(models, kind, request, voice):
    return finish(models[kind].submit(request, voice))


@pytest.fixture(scope="module")
def solo_results(models, voices):
    return [solo(models, kind, request, voice) for kind, request, voice in cases(voices)]


def assert_same(result, expected):
    """Identical codes and bit-identical audio: the vocoder decodes one row per call, so neighbours
    cannot change a request's audio."""
    codes, audio = result
    assert torch.equal(codes, expected[0])
    np.testing.assert_array_equal(audio, expected[1])


def test_batched_equals_solo_for_mixed_requests(models, voices, solo_results):
    # Two models share nothing; within each, the requests run together in one batch of ROWS rows.
    handles = [models[kind].submit(request, voice) for kind, request, voice in cases(voices)]
    for handle, expected in zip(handles, solo_results):
        assert_same(finish(handle), expected)


def test_more_requests_than_rows_join_as_rows_free_up(models, solo_results):
    design = models["custom_voice"]
    # Five requests for three rows: the last two join the running batch when the first ones end.
    requests = [SpeechRequest("Hello there, this is a test.", speaker="ryan", greedy=True, max_frames=n) for n in (8, 30, 12, 30, 30)]
    handles = [design.submit(r) for r in requests]
    full = solo_results[0][0]
    for handle, request in zip(handles, requests):
        assert torch.equal(finish(handle)[0], full[: request.max_frames])


def test_requests_joining_mid_stream_and_others_cancelled(models, voices, solo_results):
    kind, request, voice = cases(voices)[1]
    tts = models[kind]
    noise = [tts.submit(dataclasses.replace(request, seed=99, max_frames=tts.default_max_frames())) for _ in range(2)]
    listeners = [iter(h) for h in noise]
    next(listeners[0])  # the neighbours are mid-stream
    joining = tts.submit(request)
    next(listeners[1])
    noise[1].close()  # cancelled while the joining request runs
    assert_same(finish(joining), solo_results[1])
    noise[0].close()


def test_seeded_sampling_is_reproducible_and_seed_dependent(models):
    request = SpeechRequest("Seeds decide the take.", speaker="ryan", seed=42, max_frames=20)
    first, again = solo(models, "custom_voice", request, None), solo(models, "custom_voice", request, None)
    other = solo(models, "custom_voice", dataclasses.replace(request, seed=43), None)
    assert_same(again, first)
    assert not torch.equal(other[0], first[0])


def test_text_given_token_by_token_with_waits_equals_text_given_at_once(models, voices):
    tts = models["base"]
    # One frame per chunk, so that every frame made is handed out at once.
    request = SpeechRequest("Text that arrives while the voice already speaks.", greedy=True, max_frames=40, schedule=(1,))
    job, _ = tts.prepare(request, voices["xvec"])
    expected = finish(tts.engine.submit(job))[0]
    segment = job.segments[0]
    text = segment.trailing
    assert len(text) > 3  # voice cloning feeds its text one token per frame
    streamed_job = dataclasses.replace(job, segments=[dataclasses.replace(segment, trailing=text[:1], text_end=False)])
    handle = tts.engine.submit(streamed_job)
    events = handle.events()
    for n in range(1, len(text)):
        while len(handle.codes) < n:
            next(events)  # the row speaks as far as its text goes ...
        run_frames(tts.engine)
        assert frames_made(tts.engine, handle) == n  # ... and then waits: no frame without its text
        handle.append_text(text[n : n + 1], end=n == len(text) - 1)
    list(events)
    assert torch.equal(handle.codes, expected)


@pytest.mark.parametrize("awaits", [1, 3])
def test_prompt_given_in_two_parts_equals_the_whole_prompt(models, awaits):
    """A row admitted with its prompt's last positions still to come waits, its prefix prefilled;
    with them it speaks exactly as if the whole prompt had come at once."""
    tts = models["custom_voice"]
    request = SpeechRequest("Hello there, this is a test.", speaker="ryan", greedy=True, max_frames=24)
    job, _ = tts.prepare(request)
    expected = finish(tts.engine.submit(job))[0]
    segment = job.segments[0]
    prefix, rest = segment.prompt[:, :-awaits], segment.prompt[:, -awaits:]
    handle = tts.engine.submit(dataclasses.replace(job, segments=[dataclasses.replace(segment, prompt=prefix, awaits=awaits)]))
    wait_until(lambda: tts.engine.scheduler.row_of(handle) is not None, "the request never got a row")
    run_frames(tts.engine)  # admitted and prefilled, waiting
    assert frames_made(tts.engine, handle) == 0 and handle._items.empty()
    with pytest.raises(ValueError, match=f"awaits {awaits} positions, not {awaits + 1}"):
        handle.finish_prompt(segment.prompt[:, -awaits - 1:])
    handle.finish_prompt(rest)
    assert torch.equal(finish(handle)[0], expected)


def test_a_prompts_last_positions_given_while_it_waits_for_a_row_are_prefilled_apart(models, monkeypatch):
    """The rest of a prompt given while its request still waits for a row is prefilled after the prefix, in a
    prefill of its own, as when it comes after admission: a row's numbers never follow the timing (in bf16 on a
    GPU a prompt prefilled whole and one prefilled in two parts give different codes)."""
    tts = models["custom_voice"]
    engine = tts.engine
    job, _ = tts.prepare(SpeechRequest("Hello there, this is a test.", speaker="ryan", greedy=True, max_frames=24))
    segment = job.segments[0]
    held = dataclasses.replace(job, segments=[dataclasses.replace(segment, prompt=segment.prompt[:, :-1], awaits=1)])
    expected = engine.submit(held)
    wait_until(lambda: engine.scheduler.row_of(expected) is not None, "the request never got a row")
    expected.finish_prompt(segment.prompt[:, -1:])
    expected = finish(expected)[0]
    busy = [engine.submit(held) for _ in range(ROWS)]  # each holds its row, waiting for its last position
    prefix, rest = segment.prompt[:, :-1].clone(), segment.prompt[:, -1:].clone()  # the request's own tensors
    handle = engine.submit(dataclasses.replace(held, segments=[dataclasses.replace(held.segments[0], prompt=prefix)]))
    prefills = []  # the request's prefills: how many positions each
    start, finish_prompt = engine.decoder.start, engine.decoder.finish_prompt
    mine = lambda tensor: tensor.data_ptr() in (prefix.data_ptr(), rest.data_ptr())  # noqa: E731
    monkeypatch.setattr(engine.decoder, "start", lambda row, prompt, *args: (mine(prompt) and prefills.append(prompt.shape[1])) or start(row, prompt, *args))
    monkeypatch.setattr(engine.decoder, "finish_prompt", lambda row, part: (mine(part) and prefills.append(part.shape[1])) or finish_prompt(row, part))
    handle.finish_prompt(rest)
    assert engine.scheduler.waiting_request(handle) is not None
    for other in busy:
        other.close()
    assert torch.equal(finish(handle)[0], expected)
    assert prefills == [segment.prompt.shape[1] - 1, 1]


def test_no_step_runs_while_every_row_waits_for_text(models, voices):
    """A row out of text parks the loop: woken with nothing new it parks again without a step; the
    next text runs it on from where it was."""
    tts = models["base"]
    engine = tts.engine
    handle = engine.submit(held_row(tts, voices["xvec"]))
    events = handle.events()
    next(events)  # its one frame of text spoken
    wait_until(lambda: engine.parked, "the loop kept running with no text to speak")
    steps, parks = engine.iteration, engine.parks
    with engine.lock:
        engine.wake.notify()  # a wake-up that brings nothing
    wait_until(lambda: engine.parks > parks, "the loop did not park again")
    assert engine.iteration == steps and frames_made(engine, handle) == 1
    handle.append_text(held_row(tts, voices["xvec"]).segments[0].trailing, end=True)
    wait_until(lambda: frames_made(engine, handle) > 1, "the text that came did not run the row")
    handle.close()


def held_row(tts: TTS, voice):
    """A job that holds its row without end: its text stops after one token and never ends."""
    job, _ = tts.prepare(SpeechRequest("Held for as long as the test needs.", schedule=(1,), max_frames=50), voice)
    segment = job.segments[0]
    return dataclasses.replace(job, segments=[dataclasses.replace(segment, trailing=segment.trailing[:1], text_end=False)])


@pytest.mark.parametrize("greedy", [True, False])
def test_a_row_waiting_for_text_keeps_its_chunks_and_audio(models, voices, greedy):
    """Text that arrives late, a token at a time, gives the chunks, codes and audio (bit for bit) of
    the text given at once: a waiting row holds its frames until the schedule's chunk is full, so
    the audio depends on the codes and the schedule only, not on when the text came."""
    tts = models["base"]
    request = SpeechRequest("Text that arrives while the voice already speaks.", greedy=greedy, seed=5, max_frames=40, schedule=(2, 3))
    job, _ = tts.prepare(request, voices["xvec"])
    at_once = tts.engine.submit(job)
    expected = list(at_once)
    segment = job.segments[0]
    text = segment.trailing
    handle = tts.engine.submit(dataclasses.replace(job, segments=[dataclasses.replace(segment, trailing=text[:1], text_end=False)]))
    for n in range(1, len(text)):
        # The row runs out of text and waits, at every frame: each chunk is made across waits.
        wait_until(lambda n=n: frames_made(tts.engine, handle) == n, "the row did not speak its text")
        run_frames(tts.engine)
        handle.append_text(text[n : n + 1], end=n == len(text) - 1)
    late = list(handle)
    assert [c.frames for c in late] == [c.frames for c in expected]
    assert torch.equal(handle.codes, at_once.codes)
    np.testing.assert_array_equal(np.concatenate([c.audio for c in late]), np.concatenate([c.audio for c in expected]))


def test_fifo_admission_queue_limit_and_positions(tiny_checkpoints, reference_wav):
    tts = TTS.from_pretrained(str(tiny_checkpoints["base"]), rows=1, max_queue=2)
    voice = tts.create_voice_prompt(str(reference_wav), x_vector_only=True)
    holder = tts.engine.submit(held_row(tts, voice))
    held = iter(holder)  # kept: dropping a started iterator closes its request
    next(held)  # admitted and waiting for text: the queue is empty again
    short = SpeechRequest("Next in line.", seed=1, max_frames=3)
    job, _ = tts.prepare(short, voice)
    segment = job.segments[0]
    streamed = dataclasses.replace(job, segments=[dataclasses.replace(segment, trailing=segment.trailing[:1], text_end=False)])
    second = tts.engine.submit(streamed)
    second.append_text(segment.trailing[1:], end=True)  # while it waits: the engine's copy of its job gets the text
    assert len(streamed.segments[0].trailing) == 1 and not streamed.segments[0].text_end  # the caller's job is as it was
    third = tts.submit(short, voice)
    with pytest.raises(EngineBusy, match="2 requests ahead; try again shortly"):
        tts.submit(short, voice)
    finished = []
    threads = [threading.Thread(target=lambda h=h, i=i: (list(h), finished.append(i))) for i, h in ((2, second), (3, third))]
    for t in threads:
        t.start()
    run_frames(tts.engine)
    # Nothing overtakes the row that holds the engine.
    assert finished == [] and len(tts.engine.waiting) == 2 and frames_made(tts.engine, holder) == 1
    holder.close()
    for t in threads:
        t.join(HANG_GUARD_S)
    assert finished == [2, 3]
    assert second.codes.shape == (3, 16) and third.codes.shape == (3, 16)


def test_queued_requests_learn_their_position(tiny_checkpoints):
    tts = TTS.from_pretrained(str(tiny_checkpoints["custom_voice"]), rows=1)
    request = SpeechRequest("Hello there, this is a test.", speaker="ryan", seed=1, max_frames=6)
    handles = [tts.submit(request) for _ in range(3)]
    seen = [[e.ahead for e in h.events() if isinstance(e, Queued)] for h in handles]
    # The third waits behind the second (and, until the engine takes the first, behind it too).
    assert seen[2][0] >= 1 and seen[2][-1] == 0 and seen[1][-1] == 0
    assert seen[2] == sorted(seen[2], reverse=True)


def test_stop_frees_the_row_before_close_returns(models):
    tts = models["voice_design"]
    handle = tts.submit(SpeechRequest("Stop me.", instruct="Calm.", seed=2, max_frames=tts.default_max_frames(), schedule=(1,)))
    chunks = iter(handle)
    next(chunks)
    assert any(tts.engine.slots)
    handle.close()
    assert handle.stopped and not any(tts.engine.slots)
    frames = len(handle.codes)
    list(chunks)  # to the stream's end marker, which follows every chunk the engine made for it
    assert len(handle.codes) == frames


def test_stop_before_the_first_chunk_is_a_stop_not_an_empty_result(tiny_checkpoints):
    tts = TTS.from_pretrained(str(tiny_checkpoints["voice_design"]), rows=1)
    busy = tts.submit(SpeechRequest("Busy.", instruct="Calm.", seed=2, max_frames=tts.default_max_frames()))
    waiting = tts.submit(SpeechRequest("Waiting.", instruct="Calm.", seed=2, max_frames=5))
    waiting.close()
    assert waiting.stopped and list(waiting) == []
    busy.close()


def test_streamed_audio_equals_offline_decode_for_any_schedule(models):
    tts = models["voice_design"]
    request = SpeechRequest("Calm words, streamed.", instruct="Calm.", greedy=True, max_frames=40)
    for schedule in [(1,), (1, 2, 4, 8, 16), (3, 7, 5), (64,)]:
        handle = tts.submit(dataclasses.replace(request, schedule=schedule))
        chunks = list(handle)
        sizes = [c.frames for c in chunks]
        expected = list(schedule) + [schedule[-1]] * 40
        assert sizes[:-1] == expected[: len(sizes) - 1] and sum(sizes) == 40
        audio = np.concatenate([c.audio for c in chunks])
        assert audio.shape == (40 * SAMPLES_PER_FRAME,)
        assert np.abs(audio - tts.decode(handle.codes)).max() <= 1e-5


def test_the_scheduler_hears_what_audio_each_early_chunk_left_its_listener(models, monkeypatch):
    """Each chunk after a stream's first, through its schedule's length, reports when it reached the
    listener and how much of the audio before it was still to play (playback from the first chunk):
    less than all of it, later chunks later; the steady chunks after them report nothing."""
    tts = models["voice_design"]
    heard = []
    landed = tts.engine.scheduler.early_chunk_landed
    monkeypatch.setattr(tts.engine.scheduler, "early_chunk_landed", lambda at, left: (heard.append((at, left)), landed(at, left)))
    chunks = list(tts.submit(SpeechRequest("Calm words, watched.", instruct="Calm.", greedy=True, max_frames=40, schedule=(1, 2, 4))))
    assert [c.frames for c in chunks][:5] == [1, 2, 4, 4, 4]
    assert len(heard) == 3
    audio_before = np.cumsum([c.frames for c in chunks])[:3] / 12.5
    assert all(left < given for (_, left), given in zip(heard, audio_before))
    assert [at for at, _ in heard] == sorted(at for at, _ in heard)


def test_a_first_chunk_waits_for_the_second_while_early_chunks_land_late_and_the_audio_is_the_same(models):
    """While the scheduler has heard of an early chunk landing late, a new stream's first chunk reaches
    its listener with the second, both stamped with that moment; a stream of one chunk still gets it,
    at its end; the audio is the same as a stream whose first chunk went at once."""
    tts = models["voice_design"]
    request = SpeechRequest("Calm words, held back.", instruct="Calm.", greedy=True, max_frames=12, schedule=(1, 2, 4))
    scheduler = tts.engine.scheduler
    with tts.engine.lock:  # nothing heard yet (this module's earlier streams may have landed late on a busy CPU)
        shown = scheduler.best_early_left_s
        scheduler.best_early_left_s = -float("inf")
        scheduler.early_landings.clear()
    try:
        at_once = list(tts.submit(request))
        with tts.engine.lock:
            scheduler.best_early_left_s = 1.0  # as a GPU that has landed early chunks in time
            scheduler.early_landings.append((float("inf"), -0.01))  # one that landed late, never forgotten in this test
        counted = tts.engine.first_chunks_waited
        waited = list(tts.submit(request))
        alone = list(tts.submit(dataclasses.replace(request, max_frames=1)))
    finally:
        with tts.engine.lock:
            scheduler.best_early_left_s = shown
            scheduler.early_landings.clear()
    assert at_once[0].elapsed_ms < at_once[1].elapsed_ms
    assert waited[0].elapsed_ms == waited[1].elapsed_ms  # handed out together
    assert [c.frames for c in waited] == [c.frames for c in at_once]
    np.testing.assert_array_equal(np.concatenate([c.audio for c in waited]), np.concatenate([c.audio for c in at_once]))
    assert [c.frames for c in alone] == [1]
    assert tts.engine.first_chunks_waited == counted + 2
    path = next(p for p in tts.engine.take_first_chunk_paths() if p.sent_ms == waited[0].elapsed_ms)
    assert path.ready_ms < path.sent_ms  # its own audio was ready before the second chunk's


def test_each_stream_leaves_the_path_of_its_first_chunk_in_order(models):
    """Every stream's first chunk leaves one FirstChunkPath, its points in the order they happen, the
    last one the moment its listener was handed the chunk."""
    tts = models["custom_voice"]
    tts.engine.take_first_chunk_paths()  # earlier tests' streams
    requests = [SpeechRequest(f"Path number {i}.", speaker="ryan", seed=i, max_frames=6, schedule=(2, 4)) for i in range(ROWS + 2)]
    streams = [iter(tts.submit(r)) for r in requests]  # more than the rows: two wait in the queue
    firsts = [next(stream) for stream in streams]
    for stream in streams:
        assert list(stream)
    paths = tts.engine.take_first_chunk_paths()
    assert sorted(p.sent_ms for p in paths) == sorted(c.elapsed_ms for c in firsts)
    for p in paths:
        assert 0 <= p.admitted_ms <= p.first_frame_ms <= p.vocoding_ms <= p.ready_ms <= p.sent_ms
    assert tts.engine.take_first_chunk_paths() == []  # taken once


def test_vocoder_lanes_change_nothing_in_the_audio(tiny_checkpoints, models):
    """A stream's first chunks and its steady chunks run in different vocoder lanes (working states)
    when there are several, as on CUDA, and two streams' steady chunks in two lanes: each row's
    state passes between them intact."""
    laned = TTS.from_pretrained(str(tiny_checkpoints["voice_design"]), rows=2, vocoder_lanes=4)
    requests = [SpeechRequest("Calm words, in lanes.", instruct="Calm.", seed=seed, max_frames=60) for seed in (4, 5)]
    alone = [models["voice_design"].synthesize(r) for r in requests]
    handles = [laned.submit(r) for r in requests]
    audio = [np.concatenate([chunk.audio for chunk in handle]) for handle in handles]
    assert laned.engine.vocoder.lanes == 4
    for one, handle, laned_audio in zip(alone, handles, audio):
        np.testing.assert_array_equal(handle.codes.numpy(), one.codes)
        np.testing.assert_array_equal(laned_audio, one.audio)
    laned.engine.shutdown()


def test_batched_vocoder_calls_give_each_request_its_audio_alone_or_among_others(tiny_checkpoints):
    """With batched vocoder lanes (as on CUDA), a request's steady chunks share calls with other rows'
    when they come together; its codes and audio are the same bit for bit as when it runs alone (its
    own calls padded), its audio stays the offline decode of its codes, and its chunks arrive in order."""
    batched = TTS.from_pretrained(str(tiny_checkpoints["voice_design"]), rows=3, vocoder_lanes=3, vocoder_slots=2)
    calls = []
    decode_batch = batched.engine.vocoder.decode_batch
    batched.engine.vocoder.decode_batch = lambda rows, *args: (calls.append(list(rows)), decode_batch(rows, *args))
    requests = [SpeechRequest("Calm words, batched.", instruct="Calm.", seed=seed, max_frames=70) for seed in (4, 5, 6)]
    alone = batched.submit(requests[0])
    alone_chunks = list(alone)
    lone_calls, calls[:] = list(calls), []
    handles = [batched.submit(r) for r in requests]
    together = [list(handle) for handle in handles]
    assert lone_calls and all(len(rows) == 1 for rows in lone_calls)
    assert any(len(rows) == 2 for rows in calls)  # steady chunks cut in the same frames shared a call
    assert [c.index for c in together[0]] == list(range(len(together[0])))
    np.testing.assert_array_equal(handles[0].codes.numpy(), alone.codes.numpy())
    audio = np.concatenate([c.audio for c in together[0]])
    np.testing.assert_array_equal(audio, np.concatenate([c.audio for c in alone_chunks]))
    assert np.abs(audio - batched.decode(alone.codes)).max() <= 1e-5
    batched.engine.shutdown()


def test_a_load_reports_each_graph_captured_and_the_service_forgets_it_once_loaded(tiny_checkpoints):
    """The engine calls `progress(done, total)` after each graph it captures while it is built (on the CPU:
    the vocoder's calls, registered eager), in order up to the total; the service's record of a load under
    way is gone once the model is loaded."""
    from pipeline.service import ModelService

    seen = []
    tts = TTS.from_pretrained(tiny_checkpoints["custom_voice"], progress=lambda done, total: seen.append((done, total)))
    total = len(tts.engine.vocoder.captures())
    assert total > 0 and seen == [(done, total) for done in range(1, total + 1)]
    service = ModelService({"custom_voice": (str(tiny_checkpoints["custom_voice"]),)})
    assert service.load_progress("custom_voice") is None
    service.model("custom_voice")
    assert service.load_progress("custom_voice") is None and service.is_loaded("custom_voice")


def test_a_benchmark_runs_the_first_rows_of_an_engine_then_stops_every_one(models):
    """benchmarks.speed's `rows_running` (the decode step timed and profiled with n rows running): the first
    n rows hold a request, the rest stay idle, a step runs over them, and every row is free afterwards."""
    from benchmarks.speed import rows_running

    tts = models["custom_voice"]
    with rows_running(tts, 2) as decoder:
        assert list(decoder.occupied) == [True, True, False]
        decoder.step()
    assert not any(decoder.occupied)
