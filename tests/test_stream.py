"""Streaming through the engine: ICL priming, slow consumers, long text in segments, the frame
budget of a segment, engine errors reaching the consumer, and the text helpers."""
import threading

import numpy as np
import pytest
import torch

from pipeline.errors import TTSInputError
from pipeline.request import MAX_TEXT_CHARS, SpeechRequest, parse_schedule, split_text
from pipeline.tts import SAMPLES_PER_FRAME, TTS

TEXT = "Hello there, this is the tiny streaming test voice."


@pytest.fixture(scope="module")
def design(tiny_checkpoints):
    return TTS.from_pretrained(str(tiny_checkpoints["voice_design"]))


@pytest.fixture(scope="module")
def base(tiny_checkpoints):
    return TTS.from_pretrained(str(tiny_checkpoints["base"]))


def calm(**fields) -> SpeechRequest:
    return SpeechRequest(TEXT, instruct="Calm.", **fields)


def test_chunk_records_account_for_time_and_audio(design):
    chunks = list(design.submit(calm(max_frames=20, seed=1)))
    seconds = np.cumsum([c.frames * 0.08 for c in chunks])
    assert np.allclose([c.audio_seconds for c in chunks], seconds)
    assert all(c.audio.shape == (c.frames * SAMPLES_PER_FRAME,) and c.audio.dtype == np.float32 for c in chunks)
    elapsed = [c.elapsed_ms for c in chunks]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    assert all(c.generate_ms > 0 and c.vocode_ms > 0 for c in chunks)
    assert chunks[-1].rtf == pytest.approx(chunks[-1].elapsed_ms / 1000 / chunks[-1].audio_seconds)


def test_icl_stream_is_primed_with_the_reference_codes(base, reference_wav):
    voice = base.create_voice_prompt(str(reference_wav), "Speak slowly and warmly.")
    handle = base.submit(SpeechRequest(TEXT, greedy=True, max_frames=24), voice)
    audio = np.concatenate([c.audio for c in handle])
    full = base.speech_tokenizer.decode(torch.cat([voice.ref_codes, handle.codes])).numpy()
    assert audio.shape == (24 * SAMPLES_PER_FRAME,)
    assert np.abs(audio - full[len(voice.ref_codes) * SAMPLES_PER_FRAME :]).max() <= 1e-5


def test_slow_consumer_does_not_stall_generation(design):
    handle = design.submit(calm(max_frames=30, schedule=(1,), seed=1))
    events = handle.events()
    next(events)
    # Every chunk is made and handed over although the consumer took one: the engine never waits for a
    # listener (were it to, the request would never end; the guard only ends the wait, a slow machine
    # only waits longer). However many frames the request makes before its end, one a chunk.
    assert handle._released.wait(600), f"{handle._items.qsize()} chunks made while the consumer waits, the request not ended"
    frames = handle.codes.shape[0]
    assert frames > 1 and 1 + len(list(events)) == frames


def test_long_text_streams_segment_after_segment_in_one_voice(design):
    sentence = "This sentence is one of many in a long text that must be split at sentence ends. "
    text = sentence * 6
    segments = split_text(text, limit=200)
    assert len(segments) == 3 and all(s.endswith(".") for s in segments)
    job, _ = design.prepare(SpeechRequest(text, instruct="Calm.", greedy=True, max_frames=60))
    assert len(job.segments) == len(split_text(text))
    handle = design.engine.submit(job)
    chunks = list(handle)
    assert handle.codes.shape[0] == 60
    # One vocoder stream across segments: the audio is the decode of all codes, no seam.
    assert np.abs(np.concatenate([c.audio for c in chunks]) - design.decode(handle.codes)).max() <= 1e-5


def test_a_segment_cut_at_its_frame_budget_says_so(tiny_checkpoints):
    small = TTS.from_pretrained(str(tiny_checkpoints["voice_design"]), max_seq=90)
    handle = small.submit(calm(seed=3))
    list(handle)
    assert any("frame limit of one segment" in w for w in handle.warnings)


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
    assert parse_schedule((2, 4)) == (2, 4)
    for bad in ("", "1, two", "0, 4", "-1", "1, 5000"):
        with pytest.raises(TTSInputError, match="schedule"):
            parse_schedule(bad)


def test_engine_errors_reach_the_consumer_and_the_engine_keeps_serving(design, monkeypatch):
    vocoder = design.engine.vocoder

    def broken(*args, **kwargs):
        raise RuntimeError("vocoder exploded")

    list(design.submit(calm(max_frames=2, seed=1)))  # the engine's thread is up
    threads = threading.active_count()
    monkeypatch.setattr(vocoder, "decode", broken)
    with pytest.raises(RuntimeError, match="vocoder exploded"):
        list(design.submit(calm(max_frames=5)))
    monkeypatch.undo()
    assert sum(c.frames for c in design.submit(calm(max_frames=5, seed=1))) == 5
    assert not any(design.engine.slots)
    assert threading.active_count() <= threads  # one engine thread per model, none per request


def test_text_at_the_length_limit_without_punctuation_streams(design):
    text = ("word " * MAX_TEXT_CHARS)[: MAX_TEXT_CHARS - 1]
    job, _ = design.prepare(SpeechRequest(text, instruct="Calm.", max_frames=3))
    assert len(job.segments) == len(split_text(text)) > 10
    assert sum(c.frames for c in design.engine.submit(job)) == 3


@pytest.mark.parametrize("model", ["design", "base"])
def test_non_streaming_mode_puts_the_text_in_the_prompt_or_feeds_it_frame_by_frame(model, request, reference_wav):
    """None is the model type's default: the whole text in the prompt for voice design, fed one token
    per frame for voice cloning (the reference's defaults)."""
    tts = request.getfixturevalue(model)
    fields = dict(instruct="Calm.") if model == "design" else dict(ref_audio=str(reference_wav), x_vector_only=True)
    voice = tts.create_voice_prompt(str(reference_wav), None, True) if model == "base" else None

    def segment(mode):
        job, _ = tts.prepare(SpeechRequest(TEXT, non_streaming_mode=mode, **fields), voice)
        return job.segments[0].prompt.shape[1], job.segments[0].trailing.shape[0]

    whole, fed = segment(True), segment(False)
    assert whole[0] > fed[0] and whole[1] < fed[1]  # the text moves from the trailing feed into the prompt
    assert segment(None) == (whole if model == "design" else fed)
