"""The app's model service and event handlers, called directly (no server): loading once and
sharing, falling back to the tiny checkpoints with a reason, voice prompts reused, Stop, and the
one specific message per bad input."""
import threading
import time
from pathlib import Path

import gradio as gr
import numpy as np
import pytest
import soundfile as sf
from conftest import voice_like

from pipeline.contract.models import parse_models
from pipeline.engine import Chunk
from pipeline.errors import TTSInputError
from pipeline.service import TINY, ModelService, SpeechRequest, StreamEnd, check_reference_upload
from ui import controls
from ui.app import build_demo


@pytest.fixture(scope="module")
def service(tiny_checkpoints) -> ModelService:
    # The session's tiny checkpoints sit in <root>/<type>, the layout the service writes its own in.
    return ModelService(tiny=True, tiny_dir=Path(tiny_checkpoints["base"]).parent)


@pytest.fixture(scope="module")
def demo(service) -> gr.Blocks:
    return build_demo(service)


def handler(demo: gr.Blocks, api_name: str):
    return next(fn.fn for fn in demo.fns.values() if fn.api_name == api_name)


def run_handler(demo: gr.Blocks, api_name: str, *args) -> list[dict]:
    return list(handler(demo, api_name)(*args, gr.Request(), gr.Progress()))


def voice_status(demo: gr.Blocks, *args) -> tuple[str, dict]:
    """What the Voice clone tab's status line and Export button say once the voice is prepared (its last update)."""
    return list(handler(demo, "clone_voice")(*args))[-1]


ADVANCED = (0.9, 50, 1.0, 1.05, 7, "1, 2, 4, 8, 16", 2)  # temperature .. seed, schedule, max length 2 s
SPEECH = "Hello there, this is a test of the streaming demo."


def custom_args(service: ModelService, **overrides) -> tuple:
    speaker = service.info("custom_voice").speakers[0]
    values = dict(name=TINY, speaker=speaker, instruct="", text=SPEECH, language="auto")
    values.update(overrides)
    return (*values.values(), *ADVANCED, "")


def clone_args(reference: Path | None, transcript: str = "Speak slowly and warmly.", xvec: bool = False, text: str = SPEECH,
               voice_file: Path | None = None) -> tuple:
    return (TINY, None if reference is None else str(reference), transcript, xvec, None if voice_file is None else str(voice_file), text, "auto",
            *ADVANCED, "")


def table_rows(updates: list[dict]) -> list[list]:
    tables = [v for u in updates for k, v in u.items() if getattr(k, "elem_id", "").endswith("-table")]
    return tables[-1].values.tolist()


def test_parse_models_accepts_aliases_and_lists():
    assert parse_models(["clone=a/b", "custom=c,d", "voice_design=/x"]) == {"base": ("a/b",), "custom_voice": ("c", "d"), "voice_design": ("/x",)}
    with pytest.raises(ValueError, match="TYPE=CHECKPOINT"):
        parse_models(["nonsense"])
    with pytest.raises(ValueError, match="TYPE=CHECKPOINT"):
        parse_models(["speech=a/b"])


def test_each_tab_streams_chunks_fills_the_table_and_ends_with_the_wav(demo, service, reference_wav):
    for api_name, args in [
        ("custom_generate", custom_args(service)),
        ("design_generate", (TINY, "A calm, low female voice.", SPEECH, "auto", *ADVANCED, "")),
        ("clone_generate", clone_args(reference_wav)),
    ]:
        updates = run_handler(demo, api_name, *args)
        rows = table_rows(updates)
        assert len(rows) >= 3, api_name  # 2 s = 25 frames in chunks of 1, 2, 4, 8, 10 unless the model ends early
        assert [r[0] for r in rows] == list(range(len(rows)))
        frames = sum(r[1] for r in rows)
        sample_rate, wav = next(v for k, v in updates[-1].items() if k.elem_id.endswith("-audio"))
        assert sample_rate == 24000 and wav.dtype == np.int16 and len(wav) == frames * 1920
        summary = next(v for u in reversed(updates) for k, v in u.items() if k.elem_id.endswith("-summary"))
        assert "TTFA" in summary and "final RTF" in summary


def test_a_checkpoint_is_loaded_once_and_shared(service):
    assert service.model("custom_voice") is service.model("custom_voice", TINY)
    assert service.model("custom_voice") is not service.model("voice_design")
    results = []
    threads = [threading.Thread(target=lambda: results.append(service.model("base"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(m is results[0] for m in results)


def test_unavailable_checkpoint_falls_back_to_tiny_with_a_reason(tiny_checkpoints, tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    wrong_type = str(tiny_checkpoints["custom_voice"])
    service = ModelService({"base": (missing,), "voice_design": (wrong_type,)}, tiny_dir=Path(tiny_checkpoints["base"]).parent)
    assert controls.banner_markdown(service) == ""  # nothing known to be wrong before first use
    assert service.info("base").random_weights and service.model("base").model_type == "base"
    assert service.model("voice_design").model_type == "voice_design"
    banner = controls.banner_markdown(service)
    assert "Random weights: the audio is noise" in banner
    assert missing in banner and "neither a local directory nor a valid Hugging Face Hub id" in banner
    assert "it is a custom_voice checkpoint, not voice_design" in banner
    assert "--models" in banner and "network access" in banner


def test_tiny_mode_says_so_in_the_banner(service):
    assert "--tiny" in controls.banner_markdown(service)


def test_checkpoint_outside_the_apps_choices_is_refused(service):
    with pytest.raises(TTSInputError, match="is not one of this app's"):
        service.model("base", "/etc")


def test_voice_prompt_is_computed_once_per_reference(service, tmp_path):
    tts = service.model("base")
    reference_wav = write(tmp_path / "fresh.wav", voice_like(2.5, seed=11))  # audio no other test used
    calls = []
    original = tts.create_voice_prompt

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    tts.create_voice_prompt = counting
    try:
        copy = tmp_path / "same-audio.wav"
        copy.write_bytes(reference_wav.read_bytes())
        first = service.voice_prompt(tts, reference_wav, "Speak slowly.", False)
        again = service.voice_prompt(tts, copy, "Another transcript.", False)  # same content, new transcript
        assert len(calls) == 1
        assert again.ref_codes is first.ref_codes and again.ref_text == "Another transcript."
        service.voice_prompt(tts, reference_wav, None, True)
        service.voice_prompt(tts, reference_wav, None, True)
        assert len(calls) == 2  # x-vector-only is its own prompt, also computed once
        with pytest.raises(TTSInputError, match="needs the transcript"):
            service.voice_prompt(tts, reference_wav, "  ", False)
    finally:
        del tts.create_voice_prompt


def test_stop_ends_the_stream_within_a_frame_and_frees_the_model(service):
    speaker = service.info("custom_voice").speakers[0]
    request = SpeechRequest(SPEECH, model_type="custom_voice", speaker=speaker, seed=1, schedule="1",
                            max_frames=service.model("custom_voice").default_max_frames())
    stream = service.stream(request, "session:custom:run")
    next(stream)
    first = next(stream)
    assert isinstance(first, Chunk)
    (held,) = [row.handle for row in service.model("custom_voice").engine.slots if row]
    assert service.stop("session:custom:run")
    rest = list(stream)
    # Ended by the Stop, with at most the chunks made before it (one frame each): how many the engine
    # made while this thread waited for its turn depends on the machine, not on the Stop.
    assert held.stopped and 1 + len([c for c in rest if isinstance(c, Chunk)]) <= len(held.codes)
    assert isinstance(rest[-1], StreamEnd) and rest[-1].stopped
    assert not any(service.model("custom_voice").engine.slots)  # the row is free
    assert not service.stop("session:custom:run")  # nothing left to stop


def file_with(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def write(path: Path, audio: np.ndarray, rate: int = 24000) -> Path:
    sf.write(path, audio, rate)
    return path


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: None, "No reference audio: upload a recording, record one with the microphone, or pick a sample voice."),
        (lambda d: file_with(d / "empty.wav", b""), "The reference recording is empty"),
        (lambda d: write(d / "no-samples.wav", np.zeros(0, np.float32)), "The reference audio is empty"),  # a mic stopped at once
        (lambda d: file_with(d / "notes.wav", b"not audio at all"), "could not be read as audio"),
        (lambda d: write(d / "short.wav", voice_like(0.5)), "must be at least 1 s"),
        (lambda d: write(d / "silent.wav", np.zeros(48000, np.float32)), "The reference audio is silent"),
        (lambda d: write(d / "long.wav", voice_like(31.0)), "may be at most 30 s"),
    ],
)
def test_bad_reference_audio_gives_its_own_message(demo, tmp_path, make, message):
    with pytest.raises(gr.Error, match=message.replace("(", r"\(").replace(")", r"\)")):
        run_handler(demo, "clone_generate", *clone_args(make(tmp_path)))


def final_audio(updates: list[dict]) -> np.ndarray:
    return next(v for k, v in updates[-1].items() if k.elem_id.endswith("-audio"))[1]


def test_the_clone_tab_exports_a_voice_and_imports_it_instead_of_the_reference(demo, reference_wav):
    transcript = "Speak slowly and warmly."
    status, export = voice_status(demo, TINY, str(reference_wav), transcript, False, None)
    assert status.startswith("Voice ready") and export["interactive"] and export["value"].endswith(".safetensors")
    exported = export["value"]
    status, export = voice_status(demo, TINY, None, "", False, exported)  # imported; the reference inputs no longer matter
    assert status == (f"**Using the imported voice** `{Path(exported).name}` (ICL with 3.2 s of reference and its transcript); "
                      "the reference audio above is not used. Clear the file to use it again.")
    assert not export["interactive"] and export["value"] is None
    from_file = final_audio(run_handler(demo, "clone_generate", *clone_args(None, "", voice_file=exported)))
    from_reference = final_audio(run_handler(demo, "clone_generate", *clone_args(reference_wav, transcript)))
    assert len(from_file) > 0 and np.array_equal(from_file, from_reference)
    status, export = voice_status(demo, TINY, str(reference_wav), transcript, False, None)  # the file cleared: the reference again
    assert status.startswith("Voice ready") and export["value"] == exported


def test_an_x_vector_only_voice_round_trips_through_the_tab(demo, reference_wav):
    _, export = voice_status(demo, TINY, str(reference_wav), "", True, None)
    status, _ = voice_status(demo, TINY, None, "", False, export["value"])
    assert "(x-vector only)" in status
    from_file = final_audio(run_handler(demo, "clone_generate", *clone_args(None, "", voice_file=export["value"])))
    from_reference = final_audio(run_handler(demo, "clone_generate", *clone_args(reference_wav, "", xvec=True)))
    assert np.array_equal(from_file, from_reference)


def test_a_bad_voice_file_is_a_gr_error_with_its_sentence(demo, tmp_path):
    bad = file_with(tmp_path / "voice.safetensors", b"\x00" * 64)
    message = r"This is not a Qwen3-TTS voice file \(a .safetensors file made by Export voice or synth --save-voice-prompt\)."
    with pytest.raises(gr.Error, match=message):
        voice_status(demo, TINY, None, "", False, str(bad))
    with pytest.raises(gr.Error, match=message):
        run_handler(demo, "clone_generate", *clone_args(None, "", voice_file=bad))


def test_upload_over_50_mb_is_refused(tmp_path):
    big = tmp_path / "big.wav"
    with open(big, "wb") as f:
        f.truncate(51 * 2**20)
    with pytest.raises(TTSInputError, match="the limit is 50 MB"):
        check_reference_upload(big)


def test_icl_without_transcript(demo, reference_wav):
    with pytest.raises(gr.Error, match="needs the transcript of the reference audio"):
        run_handler(demo, "clone_generate", *clone_args(reference_wav, transcript=""))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(text="   "), "The text is empty"),
        (dict(text="a" * 5001), "the limit is 5000 characters"),
        (dict(speaker="nobody"), "Unknown speaker 'nobody'"),
        (dict(language="klingon"), "Unsupported language 'klingon'"),
    ],
)
def test_bad_text_speaker_language_give_their_message(demo, service, overrides, message):
    with pytest.raises(gr.Error, match=message):
        run_handler(demo, "custom_generate", *custom_args(service, **overrides))


def test_bad_schedule_gives_its_message(demo, service):
    args = list(custom_args(service))
    args[-3] = "1, two"
    with pytest.raises(gr.Error, match="comma-separated list of frame counts"):
        run_handler(demo, "custom_generate", *args)


def test_ignored_instruction_warns_and_still_speaks(tiny_checkpoints, tmp_path):
    # A 0.6B CustomVoice checkpoint takes no instruction: the tiny one, relabelled.
    checkpoint = tmp_path / "custom-0.6b"
    checkpoint.mkdir()
    for item in Path(tiny_checkpoints["custom_voice"]).iterdir():
        (checkpoint / item.name).symlink_to(item)
    (checkpoint / "config.json").unlink()
    config = (Path(tiny_checkpoints["custom_voice"]) / "config.json").read_text()
    import json

    data = json.loads(config)
    data["tts_model_size"] = "0b6"
    (checkpoint / "config.json").write_text(json.dumps(data))
    service = ModelService({"custom_voice": (str(checkpoint),)})
    demo = build_demo(service)
    speaker = service.info("custom_voice").speakers[0]
    args = (str(checkpoint), speaker, "Whisper it.", SPEECH, "auto", *ADVANCED, "")
    with pytest.warns(UserWarning, match="ignores instructions"):
        updates = run_handler(demo, "custom_generate", *args)
    assert table_rows(updates)


def panel_summaries(items: list) -> list[str]:
    from pipeline.service import StreamStart
    from ui.latency import LatencyPanel

    with gr.Blocks():
        panel = LatencyPanel.create("unit")
    updates = list(panel.stream(StreamStart(TINY, True), iter(items), "", time.perf_counter(), stop=lambda: None))
    return [u[panel.summary] for u in updates if panel.summary in u]


def test_the_panel_shows_the_queue_position_and_a_stop_before_any_audio_is_a_stop():
    from pipeline.engine import Queued

    summaries = panel_summaries([Queued(2), Queued(0), StreamEnd(stopped=True)])
    assert summaries[0] == "Every slot of the model is busy: waiting (2 requests ahead)…"
    assert summaries[1] == "Every slot of the model is busy: waiting (next in line)…"
    assert summaries[-1].startswith("**Stopped after ") and summaries[-1].endswith(" s**, before the first audio.")


def test_an_utterance_that_ends_without_audio_is_an_error_not_a_stop():
    with pytest.raises(gr.Error, match="ended the utterance before producing any audio"):
        panel_summaries([StreamEnd(stopped=False)])


def last_value(updates: list[dict], suffix: str):
    return next(v for u in reversed(updates) for k, v in u.items() if getattr(k, "elem_id", "").endswith(suffix))


def take_seed_shown(updates: list[dict]) -> int:
    import re

    return int(re.search(r"Seed \*\*(\d+)\*\*", last_value(updates, "-take")).group(1))


def test_an_empty_seed_is_a_new_take_shown_after_the_run_and_typing_it_repeats_the_take(demo, service):
    def run(seed: str) -> list[dict]:
        args = list(custom_args(service))
        args[-4] = seed  # the Seed field, after temperature, top-k, top-p and repetition penalty
        return run_handler(demo, "custom_generate", *args)

    first, second = run(""), run("")
    assert take_seed_shown(first) != take_seed_shown(second)
    assert not np.array_equal(final_audio(first), final_audio(second))
    again = run(str(take_seed_shown(first)))
    assert take_seed_shown(again) == take_seed_shown(first) and np.array_equal(final_audio(again), final_audio(first))


def test_a_seed_that_is_no_number_gets_the_apis_sentence():
    with pytest.raises(gr.Error) as refused:
        controls.take_seed("seven")
    assert refused.value.message == "seed must be a whole number from 0 to 4294967295 (got 'seven')."  # as the API says of "seed": "seven"


def test_a_run_clears_the_last_runs_table_and_wav_as_it_starts(demo, service):
    updates = run_handler(demo, "custom_generate", *custom_args(service))
    first = updates[0]
    audio = next(v for k, v in first.items() if k.elem_id.endswith("-audio"))
    table = next(v for k, v in first.items() if k.elem_id.endswith("-table"))
    summary = next(v for k, v in first.items() if k.elem_id.endswith("-summary"))
    assert audio is None and table.empty and summary == "Starting…"


def test_a_stopped_run_says_when_it_stopped_and_leaves_no_wav(service):
    from ui.latency import LatencyPanel

    speaker = service.info("custom_voice").speakers[0]
    request = SpeechRequest(SPEECH, model_type="custom_voice", speaker=speaker, seed=1, schedule="1",
                            max_frames=service.model("custom_voice").default_max_frames())
    stream = service.stream(request, "session:custom:stopped")
    start = next(stream)

    def stopped_after_two_chunks():
        chunks = 0
        for item in stream:
            chunks += isinstance(item, Chunk)
            if chunks == 2:
                service.stop("session:custom:stopped")
            yield item

    with gr.Blocks():
        panel = LatencyPanel.create("unit")
    updates = list(panel.stream(start, stopped_after_two_chunks(), "", time.perf_counter(), stop=lambda: None))
    assert "Stopped after" in updates[-1][panel.summary] and "a stopped run leaves no WAV" in updates[-1][panel.summary]
    assert updates[-1][panel.audio] is None and not any(u.get(panel.audio) is not None for u in updates)


def test_a_stop_while_the_checkpoint_loads_ends_the_run_before_it_streams(demo, service):
    """Stop reaches a run before its stream exists (while its checkpoint loads): the run ends there."""
    from ui.controls import STOPS, run_key

    request, run_id = gr.Request(), "stop-while-loading"
    run = handler(demo, "custom_generate")(*custom_args(service)[:-1], run_id, request, gr.Progress())
    next(run)  # the first update: the panel cleared, "Starting…"; the checkpoint is checked next
    STOPS.stop(run_key(request, "custom", run_id))
    updates = list(run)
    summary = next(v for k, v in updates[-1].items() if k.elem_id.endswith("-summary"))
    assert summary.startswith("**Stopped after ") and summary.endswith("before the first audio.")
    assert not any(getattr(k, "elem_id", "").endswith("-table") and len(v) for u in updates for k, v in u.items())


def test_a_checkpoint_that_could_not_be_had_is_shown_by_the_name_of_the_one_serving(tiny_checkpoints, tmp_path):
    missing = str(tmp_path / "no-such-checkpoint")
    service = ModelService({"voice_design": (missing,)}, tiny_dir=Path(tiny_checkpoints["base"]).parent)
    demo = build_demo(service)
    said = []

    class Shown(gr.Progress):  # what the load tells the page while it lasts
        def __call__(self, progress, desc=None, *args, **kwargs):
            said.append(desc)

    _, status, _, picker = handler(demo, "design_load")(missing, "auto", Shown())
    assert said == [f"Loading {missing} (first use of this checkpoint)…"]
    assert status.startswith(f"Ready: built-in tiny random checkpoint (in place of {missing})") and "random weights (noise)" in status
    assert picker["choices"] == [(f"built-in tiny random checkpoint (in place of {missing})", missing)]
    start = next(service.stream(SpeechRequest(SPEECH, model_type="voice_design", instruct="A calm voice.", seed=1)))
    assert start.checkpoint == missing and start.stand_in == TINY


def test_a_stop_that_cancels_its_run_reports_what_the_player_had():
    from ui.latency import LatencyPanel

    with gr.Blocks():
        panel = LatencyPanel.create("unit")
    update = panel.stopped_update({"after_s": 2.44, "audio_s": 1.52, "chunks": 6})
    assert update == {panel.summary: "**Stopped after 2.4 s**, with 1.52 s of audio in 6 chunks; a stopped run leaves no WAV.", panel.audio: None}
    assert panel.stopped_update(None) == {panel.summary: gr.skip(), panel.audio: gr.skip()}  # Stop after the end: the finished run stays


def test_a_service_leaves_no_scratch_directories_behind(tmp_path, monkeypatch):
    """The tiny checkpoints a service writes and its folder of voice files for download go with it
    (and at the latest with the process): `app.py --tiny` started a hundred times leaves nothing."""
    import gc
    import tempfile

    # A temporary folder of this test's own: the services and apps of other test processes (pytest -n)
    # make and remove their own qwen3-tts-* folders in the shared one meanwhile.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def scratch() -> set[Path]:
        return set(Path(tempfile.gettempdir()).glob("qwen3-tts-*"))

    before = scratch()
    service = ModelService(device="cpu", tiny=True)
    service.model("custom_voice").engine.shutdown()
    made = scratch() - before
    assert sorted(p.name.split("-")[2] for p in made) == ["tiny", "voices"]
    assert any((p / "custom_voice" / "config.json").is_file() for p in made)
    del service
    gc.collect()
    assert not [p for p in made if p.exists()]
