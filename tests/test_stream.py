"""Streaming: chunked audio equals offline decoding, ICL priming, cancellation, slow consumers, long text."""
import threading
import time

import numpy as np
import pytest
import torch

from pipeline.stream import AUDIO_AHEAD, parse_schedule, split_text
from pipeline.tts import SAMPLES_PER_FRAME, TTS

TEXT = "Hello there, this is the tiny streaming test voice."


@pytest.fixture(scope="module")
def design(tiny_checkpoints):
    return TTS.from_pretrained(str(tiny_checkpoints["voice_design"]))


@pytest.fixture(scope="module")
def base(tiny_checkpoints):
    return TTS.from_pretrained(str(tiny_checkpoints["base"]))


@pytest.mark.parametrize("schedule", [(1,), (1, 2, 4, 8, 16), (3, 7, 5), (64,)])
def test_streamed_audio_equals_offline_decode(design, schedule):
    run = design.stream(TEXT, instruct="Calm.", sampling=design.sampling(greedy=True), max_frames=40, schedule=schedule)
    chunks = list(run)
    codes = run.codes_out
    assert codes.shape == (40, 16)
    sizes = [c.frames for c in chunks]
    expected_sizes = list(schedule) + [schedule[-1]] * 40
    assert sizes[:-1] == expected_sizes[: len(sizes) - 1] and sum(sizes) == 40
    assert [c.index for c in chunks] == list(range(len(chunks)))
    audio = np.concatenate([c.audio for c in chunks])
    assert np.abs(audio - design.decode(codes)).max() <= 1e-5
    # Same codes as the frame-by-frame path that the parity tests check against the reference.
    request = design.prepare(TEXT, instruct="Calm.")
    assert torch.equal(torch.stack(list(design.generate_codes(request, design.sampling(greedy=True), max_frames=40))), codes)


def test_chunk_records_account_for_time_and_audio(design):
    chunks = list(design.stream(TEXT, instruct="Calm.", max_frames=20, seed=1))
    seconds = np.cumsum([c.frames * 0.08 for c in chunks])
    assert np.allclose([c.audio_seconds for c in chunks], seconds)
    assert all(c.audio.shape == (c.frames * SAMPLES_PER_FRAME,) and c.audio.dtype == np.float32 for c in chunks)
    elapsed = [c.elapsed_ms for c in chunks]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    assert all(c.generate_ms > 0 and c.vocode_ms > 0 for c in chunks)
    assert chunks[-1].rtf == pytest.approx(chunks[-1].elapsed_ms / 1000 / chunks[-1].audio_seconds)


def test_icl_stream_is_primed_with_the_reference_codes(base, reference_wav):
    voice = base.create_voice_prompt(str(reference_wav), "Speak slowly and warmly.")
    run = base.stream(TEXT, voice_prompt=voice, sampling=base.sampling(greedy=True), max_frames=24)
    audio = np.concatenate([c.audio for c in run])
    full = base.speech_tokenizer.decode(torch.cat([voice.ref_codes, run.codes_out])).numpy()
    assert audio.shape == (24 * SAMPLES_PER_FRAME,)
    assert np.abs(audio - full[len(voice.ref_codes) * SAMPLES_PER_FRAME :]).max() <= 1e-5


def test_closing_the_stream_stops_generation_and_frees_the_model(design):
    run = design.stream(TEXT, instruct="Calm.", max_frames=2000, schedule=(1,))
    first = next(iter(run))
    start = time.perf_counter()
    run.close()
    assert time.perf_counter() - start < 2.0
    assert not any(t.is_alive() for t in run.threads)
    frames_at_close = run.codes_out.shape[0]
    assert frames_at_close < 2000
    time.sleep(0.3)
    assert run.codes_out.shape[0] == frames_at_close, "generation went on after close()"
    assert design.lock.acquire(blocking=False), "the model slot was not freed"
    design.lock.release()
    assert first.index == 0


def test_a_waiting_request_can_be_cancelled_without_waiting_for_the_model(design):
    busy = design.stream(TEXT, instruct="Calm.", max_frames=2000, schedule=(1,))
    next(iter(busy))
    waiting = design.stream(TEXT, instruct="Calm.", max_frames=10)
    start = time.perf_counter()
    waiting.close()
    assert time.perf_counter() - start < 1.0
    busy.close()


def test_slow_consumer_does_not_stall_generation(design):
    run = design.stream(TEXT, instruct="Calm.", max_frames=30, schedule=(1,))
    iterator = iter(run)
    next(iterator)
    deadline = time.time() + 60
    while run.codes_out.shape[0] < 30 and time.time() < deadline:
        time.sleep(0.05)
    # All 30 frames exist although the consumer took one chunk: only audio waits, AUDIO_AHEAD chunks deep.
    assert run.codes_out.shape[0] == 30
    assert run.audio.qsize() <= AUDIO_AHEAD
    rest = list(iterator)
    assert 1 + len(rest) == 30


def test_long_text_streams_segment_after_segment_in_one_voice(design):
    sentence = "This sentence is one of many in a long text that must be split at sentence ends. "
    text = sentence * 6
    segments = split_text(text, limit=200)
    assert len(segments) == 3 and all(s.endswith(".") for s in segments)
    run = design.stream(text, instruct="Calm.", sampling=design.sampling(greedy=True), max_frames=60)
    assert len(run.requests) == len(split_text(text))
    chunks = list(run)
    assert run.codes_out.shape[0] == 60
    # One vocoder stream across segments: the audio is the decode of all codes, no seam.
    assert np.abs(np.concatenate([c.audio for c in chunks]) - design.decode(run.codes_out)).max() <= 1e-5


def test_split_text_keeps_short_text_whole_and_cuts_long_sentences_at_clause_breaks():
    assert split_text("One. Two! Three?") == ["One. Two! Three?"]
    long_sentence = " ".join(["word"] * 100) + "."
    pieces = split_text(long_sentence + " Next.", limit=50)
    assert all(len(p) <= 50 for p in pieces) and " ".join(pieces) == long_sentence + " Next."
    assert split_text("one, two, three, four.", limit=12) == ["one, two,", "three, four."]
    assert split_text("x" * 25, limit=10) == ["x" * 10, "x" * 10, "x" * 5]
    assert split_text("It costs 3.5 euros. Fine.", limit=20) == ["It costs 3.5 euros.", "Fine."]
    assert split_text("第一句。第二句！", limit=4) == ["第一句。", "第二句！"]


def test_parse_schedule():
    assert parse_schedule("1, 2, 4, 8, 16") == (1, 2, 4, 8, 16)
    assert parse_schedule("4") == (4,)
    for bad in ("", "1, two", "0, 4", "-1"):
        with pytest.raises(ValueError, match="schedule"):
            parse_schedule(bad)


def test_worker_errors_reach_the_consumer(design, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("vocoder exploded")

    monkeypatch.setattr(design.vocoder, "decode_chunk", broken)
    with pytest.raises(RuntimeError, match="vocoder exploded"):
        list(design.stream(TEXT, instruct="Calm.", max_frames=5))
    assert design.lock.acquire(blocking=False)
    design.lock.release()
    assert threading.active_count() < 20


def test_text_at_the_length_limit_without_punctuation_streams(design):
    from pipeline.tts import MAX_TEXT_CHARS

    text = ("word " * MAX_TEXT_CHARS)[: MAX_TEXT_CHARS - 1]
    run = design.stream(text, instruct="Calm.", max_frames=3)
    assert len(run.requests) == len(split_text(text)) > 10
    assert sum(c.frames for c in run) == 3
