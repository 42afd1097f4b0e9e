"""The command-line contract: `python -m pipeline synth` for every mode, `make-tiny`, and one clear error per bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import voice_like

from pipeline.__main__ import EXIT_BAD_CHECKPOINT, EXIT_BAD_INPUT, main
from pipeline.request import MAX_TEXT_CHARS, SpeechRequest
from pipeline.tts import SAMPLES_PER_FRAME, TTS

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )


MODE_FLAGS = {
    "custom_voice": ("custom_voice", ["--speaker", "Ryan", "--language", "English", "--instruct", "Cheerful."]),
    "voice_design": ("voice_design", ["--instruct", "A calm, low female voice."]),
    "icl_clone": ("base", ["--ref-text", "Speak slowly and warmly."]),
    "xvector_clone": ("base", ["--x-vector-only"]),
}


@pytest.mark.parametrize("mode", MODE_FLAGS)
def test_synth_writes_wav_and_codes_for_every_mode(mode, tiny_checkpoints, reference_wav, tmp_path):
    kind, flags = MODE_FLAGS[mode]
    if kind == "base":
        flags = ["--ref-audio", str(reference_wav), *flags]
    out, codes_out = tmp_path / "out.wav", tmp_path / "codes.npy"
    result = run_cli(
        "synth", "--model", str(tiny_checkpoints[kind]), "--text", "Hello there, tiny model.", *flags,
        "--greedy", "--max-frames", "12", "--out", str(out), "--codes-out", str(codes_out),
    )
    assert result.returncode == 0, result.stderr
    assert "frames: 12" in result.stdout and "RTF:" in result.stdout
    assert "to instantiate a model of type" not in result.stderr  # no alarming library warning on every synth
    audio, rate = sf.read(out, dtype="float32")
    codes = np.load(codes_out)
    assert rate == 24000 and audio.shape == (12 * SAMPLES_PER_FRAME,)
    assert codes.dtype == np.int64 and codes.shape == (12, 16)
    # The same request through the library gives the same codes: the CLI adds nothing of its own.
    tts = TTS.from_pretrained(str(tiny_checkpoints[kind]))
    voice = None
    if kind == "base":
        voice = tts.create_voice_prompt(str(reference_wav), "Speak slowly and warmly." if mode == "icl_clone" else None, mode == "xvector_clone")
    kwargs = dict(speaker="Ryan", language="English", instruct="Cheerful.") if kind == "custom_voice" else {}
    if kind == "voice_design":
        kwargs = dict(instruct="A calm, low female voice.")
    expected = tts.synthesize(SpeechRequest("Hello there, tiny model.", greedy=True, max_frames=12, **kwargs), voice)
    assert np.array_equal(codes, expected.codes)
    assert np.abs(audio - expected.audio).max() == 0


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_checkpoints):
    tts = TTS.from_pretrained(str(tiny_checkpoints["voice_design"]))
    def run(seed: int) -> np.ndarray:
        return tts.synthesize(SpeechRequest("Hello there.", instruct="Calm.", max_frames=10, seed=seed)).codes

    assert np.array_equal(run(3), run(3))
    assert not np.array_equal(run(3), run(4))


def test_make_tiny_writes_a_loadable_checkpoint(tmp_path, capsys):
    assert main(["make-tiny", "--type", "voice_design", str(tmp_path / "vd"), "--seed", "1"]) == 0
    tts = TTS.from_pretrained(str(tmp_path / "vd"))
    assert tts.model_type == "voice_design"


def cli_error(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.fixture
def synth_args(tiny_checkpoints, tmp_path):
    def make(kind: str, *extra: str) -> list[str]:
        return ["synth", "--model", str(tiny_checkpoints[kind]), "--out", str(tmp_path / "o.wav"), "--max-frames", "3", *extra]

    return make


def test_empty_and_whitespace_text(capsys, synth_args):
    for text in ("", "   \n\t"):
        code, err = cli_error(capsys, *synth_args("voice_design", "--text", text))
        assert code == EXIT_BAD_INPUT and "The text is empty" in err


def test_text_over_the_limit(capsys, synth_args):
    code, err = cli_error(capsys, *synth_args("voice_design", "--text", "a" * (MAX_TEXT_CHARS + 1)))
    assert code == EXIT_BAD_INPUT and f"the limit is {MAX_TEXT_CHARS} characters" in err


def test_unknown_speaker_lists_valid_ones(capsys, synth_args):
    code, err = cli_error(capsys, *synth_args("custom_voice", "--text", "Hi.", "--speaker", "Bob"))
    assert code == EXIT_BAD_INPUT and "Unknown speaker 'Bob'" in err and "ryan" in err and "vivian" in err


def test_missing_speaker_on_custom_voice(capsys, synth_args):
    code, err = cli_error(capsys, *synth_args("custom_voice", "--text", "Hi."))
    assert code == EXIT_BAD_INPUT and "needs a speaker" in err


def test_unsupported_language_lists_valid_ones(capsys, synth_args):
    code, err = cli_error(capsys, *synth_args("voice_design", "--text", "Hi.", "--instruct", "Calm.", "--language", "Klingon"))
    assert code == EXIT_BAD_INPUT and "Unsupported language 'Klingon'" in err and "english" in err
    assert "sichuan_dialect" not in err, "dialects are chosen through speakers, not offered as languages"


def test_instruction_on_a_checkpoint_that_ignores_it_warns(capsys, synth_args, reference_wav):
    code = main(synth_args("base", "--text", "Hi.", "--ref-audio", str(reference_wav), "--x-vector-only", "--instruct", "Whisper."))
    err = capsys.readouterr().err
    assert code == 0 and "ignores instructions; the instruction was not used" in err


def test_timings_out_writes_the_words_the_library_times(tiny_checkpoints, reference_wav, tmp_path):
    """Base feeds the text one token per frame by default: the file holds the words of
    `TTS.synthesize(..., word_timestamps=True)`, in order and within the audio."""
    out, timings = tmp_path / "out.wav", tmp_path / "words.json"
    text = "Hello there, tiny model. It's 12345 o'clock."
    result = run_cli("synth", "--model", str(tiny_checkpoints["base"]), "--text", text, "--ref-audio", str(reference_wav), "--ref-text", "Speak slowly.",
                     "--greedy", "--max-frames", "30", "--out", str(out), "--timings-out", str(timings))
    assert result.returncode == 0, result.stderr
    words = json.loads(timings.read_text())
    tts = TTS.from_pretrained(str(tiny_checkpoints["base"]))
    voice = tts.create_voice_prompt(str(reference_wav), "Speak slowly.")
    expected = tts.synthesize(SpeechRequest(text, greedy=True, max_frames=30, word_timestamps=True), voice)
    assert words == [w.as_dict() for w in expected.words] and words
    audio_s = len(sf.read(out)[0]) / 24000
    assert all(0 <= w["start"] < w["end"] <= audio_s for w in words)
    assert [w["word"] for w in words] == text.split()[:len(words)]


def test_timings_out_needs_the_streaming_text_layout_and_a_json_file(capsys, synth_args, tmp_path):
    code, err = cli_error(capsys, *synth_args("custom_voice", "--text", "Hi.", "--speaker", "ryan", "--timings-out", str(tmp_path / "w.json")))
    assert code == EXIT_BAD_INPUT and "Word timestamps need the text fed one token per frame" in err and "set non_streaming_mode to false" in err
    code = main(synth_args("custom_voice", "--text", "Hi.", "--speaker", "ryan", "--no-non-streaming-mode", "--timings-out", str(tmp_path / "w.json")))
    assert code == 0 and json.loads((tmp_path / "w.json").read_text())
    code, err = cli_error(capsys, *synth_args("custom_voice", "--text", "Hi.", "--speaker", "ryan", "--timings-out", str(tmp_path / "w.txt")))
    assert code == EXIT_BAD_INPUT and "Cannot write word timings to" in err and "ending in .json" in err


def test_speaker_on_base_and_reference_audio_on_custom_voice(capsys, synth_args, reference_wav):
    code, err = cli_error(capsys, *synth_args("base", "--text", "Hi.", "--ref-audio", str(reference_wav), "--x-vector-only", "--speaker", "ryan"))
    assert code == EXIT_BAD_INPUT and "Preset speakers exist only on CustomVoice checkpoints" in err
    code, err = cli_error(capsys, *synth_args("custom_voice", "--text", "Hi.", "--speaker", "ryan", "--ref-audio", str(reference_wav)))
    assert code == EXIT_BAD_INPUT and "Reference audio is for Base (voice clone) checkpoints" in err


def test_base_needs_reference_audio_and_icl_needs_transcript(capsys, synth_args, reference_wav):
    code, err = cli_error(capsys, *synth_args("base", "--text", "Hi."))
    assert code == EXIT_BAD_INPUT and "give reference audio" in err
    code, err = cli_error(capsys, *synth_args("base", "--text", "Hi.", "--ref-audio", str(reference_wav)))
    assert code == EXIT_BAD_INPUT and "needs the transcript of the reference audio" in err


@pytest.mark.parametrize(
    "make_file, message",
    [
        (lambda p: p.write_text("this is not audio"), "could not be read as audio"),
        (lambda p: sf.write(p, voice_like(0.5), 24000), "must be at least 1 s"),
        (lambda p: sf.write(p, np.zeros(48000, dtype=np.float32), 24000), "is silent"),
        (lambda p: sf.write(p, voice_like(31.0), 24000), "may be at most 30 s"),
    ],
)
def test_bad_reference_audio(capsys, synth_args, tmp_path, make_file, message):
    path = tmp_path / "ref.wav"
    make_file(path)
    code, err = cli_error(capsys, *synth_args("base", "--text", "Hi.", "--ref-audio", str(path), "--x-vector-only"))
    assert code == EXIT_BAD_INPUT and message in err


def test_missing_reference_file(capsys, synth_args, tmp_path):
    code, err = cli_error(capsys, *synth_args("base", "--text", "Hi.", "--ref-audio", str(tmp_path / "nope.wav"), "--x-vector-only"))
    assert code == EXIT_BAD_INPUT and "nope.wav" in err


def test_local_directory_missing_a_file_names_it(capsys, tiny_checkpoints, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in tiny_checkpoints["voice_design"].iterdir():
        if item.name != "generation_config.json":
            (broken / item.name).symlink_to(item)
    code, err = cli_error(capsys, "synth", "--model", str(broken), "--text", "Hi.", "--out", str(tmp_path / "o.wav"))
    assert code == EXIT_BAD_CHECKPOINT and "missing generation_config.json" in err


def test_invalid_hub_id(capsys, tmp_path):
    code, err = cli_error(capsys, "synth", "--model", "not//a valid id", "--text", "Hi.", "--out", str(tmp_path / "o.wav"))
    assert code == EXIT_BAD_CHECKPOINT and "neither a local directory nor a valid Hugging Face Hub id" in err


def test_unreachable_hub_and_empty_cache(tmp_path):
    result = run_cli(
        "synth", "--model", "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", "--text", "Hi.", "--out", str(tmp_path / "o.wav"),
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
    )
    assert result.returncode == EXIT_BAD_CHECKPOINT
    assert "unreachable" in result.stderr and "not in the local cache" in result.stderr
    assert "Traceback" not in result.stderr


def test_unwritable_output_and_bad_max_frames(capsys, synth_args, tmp_path):
    code, err = cli_error(capsys, *synth_args("voice_design", "--text", "Hi."), "--out", str(tmp_path / "no" / "such" / "dir.wav"))
    assert code == EXIT_BAD_INPUT and "does not exist" in err
    code, err = cli_error(capsys, *synth_args("voice_design", "--text", "Hi."), "--max-frames", "0")
    assert code == EXIT_BAD_INPUT and "at least 1" in err


def test_config_without_a_known_model_type_is_a_checkpoint_error(capsys, tiny_checkpoints, tmp_path):
    import json
    import shutil

    broken = tmp_path / "odd"
    shutil.copytree(tiny_checkpoints["voice_design"], broken)
    config = json.loads((broken / "config.json").read_text())
    config["tts_model_type"] = "singing_voice"
    (broken / "config.json").write_text(json.dumps(config))
    code, err = cli_error(capsys, "synth", "--model", str(broken), "--text", "Hi.", "--out", str(tmp_path / "o.wav"))
    assert code == EXIT_BAD_CHECKPOINT and "tts_model_type 'singing_voice'" in err


def test_unavailable_device_and_dtype(capsys, synth_args, tiny_checkpoints):
    import torch

    from pipeline.errors import TTSInputError

    if not torch.cuda.is_available():
        code, err = cli_error(capsys, *synth_args("voice_design", "--text", "Hi.", "--device", "cuda"))
        assert code == EXIT_BAD_INPUT and "no CUDA GPU is available" in err
    with pytest.raises(TTSInputError, match="Unsupported dtype 'float64'"):
        TTS.from_pretrained(str(tiny_checkpoints["voice_design"]), dtype="float64")


def test_synth_batch_equals_synth_per_request_and_reports_bad_lines(tiny_checkpoints, reference_wav, tmp_path, capsys):
    import json

    kind = "custom_voice"
    lines = [
        {"name": "greedy", "text": "Hello there, tiny model.", "speaker": "ryan", "greedy": True, "max_frames": 12},
        {"name": "sampled", "text": "A second voice, sampled.", "speaker": "vivian", "seed": 5, "max_frames": 15},
        {"name": "bad-speaker", "text": "Nobody.", "speaker": "nobody"},
        "not json at all",
        {"name": "bad-temperature", "text": "Hot.", "speaker": "ryan", "temperature": 0},
        {"name": "cold", "text": "The third one.", "speaker": "ryan", "seed": 9, "temperature": 0.5, "max_frames": 10},
    ]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    out_dir = tmp_path / "out"
    code = main(["synth-batch", "--model", str(tiny_checkpoints[kind]), "--requests", str(requests), "--out-dir", str(out_dir)])
    captured = capsys.readouterr()
    assert code == EXIT_BAD_INPUT  # some lines were bad; the others ran
    assert "line 3 (bad-speaker): Unknown speaker 'nobody'" in captured.err
    assert "line 4 (?): not valid JSON" in captured.err
    assert "line 5 (bad-temperature): temperature must be a number above 0" in captured.err
    for name in ("greedy", "sampled", "cold"):
        assert f"{name}: frames" in captured.out and "TTFA" in captured.out
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(
        f"{n}{ext}" for n in ("greedy", "sampled", "cold") for ext in (".wav", ".codes.npy"))
    # Each output equals what `synth` gives for that request alone.
    for line in (lines[0], lines[1], lines[5]):
        flags = ["--speaker", line["speaker"], "--max-frames", str(line["max_frames"])]
        flags += ["--greedy"] if line.get("greedy") else ["--seed", str(line["seed"])]
        if "temperature" in line:
            flags += ["--temperature", str(line["temperature"])]
        solo_wav, solo_codes = tmp_path / f"{line['name']}.wav", tmp_path / f"{line['name']}.npy"
        assert main(["synth", "--model", str(tiny_checkpoints[kind]), "--text", line["text"], *flags,
                     "--out", str(solo_wav), "--codes-out", str(solo_codes)]) == 0
        np.testing.assert_array_equal(np.load(out_dir / f"{line['name']}.codes.npy"), np.load(solo_codes))
        batch_audio, _ = sf.read(out_dir / f"{line['name']}.wav", dtype="float32")
        solo_audio, _ = sf.read(solo_wav, dtype="float32")
        np.testing.assert_array_equal(batch_audio, solo_audio)


def test_synth_batch_names_must_be_safe_and_unique(tiny_checkpoints, tmp_path, capsys):
    import json

    requests = tmp_path / "r.jsonl"
    requests.write_text("\n".join(json.dumps(d) for d in [
        {"name": "../escape", "text": "Hi.", "speaker": "ryan", "max_frames": 2},
        {"name": "same", "text": "Hi.", "speaker": "ryan", "max_frames": 2},
        {"name": "same", "text": "Hi.", "speaker": "ryan", "max_frames": 2},
    ]))
    code = main(["synth-batch", "--model", str(tiny_checkpoints["custom_voice"]), "--requests", str(requests), "--out-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT
    assert "line 1 (?): every request needs a 'name' made of letters" in err
    assert "line 3 (?): the name 'same' is used by an earlier line" in err
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["same.codes.npy", "same.wav"]
