"""Reference-audio loading: parity with the official wrapper's loading/resampling, and clear errors."""
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf

from pipeline.audio import SAMPLE_RATE, load_reference_audio
from pipeline.errors import TTSInputError


def _tone(seconds: float, sr: int, channels: int = 1, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    left = 0.4 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.size)
    right = 0.3 * np.sin(2 * np.pi * 330 * t + 1.0) + 0.05 * rng.standard_normal(t.size)
    wav = np.stack([left, right][:channels] + [left] * (channels - 2), axis=1) if channels > 1 else left
    return wav.astype(np.float32)


def _reference_load(source) -> np.ndarray:
    """What the official create_voice_clone_prompt hands to extract_speaker_embedding."""
    from qwen_tts.inference.qwen3_tts_model import Qwen3TTSModel

    seen = []
    fake_model = SimpleNamespace(
        device="cpu",
        tts_model_type="base",
        speaker_encoder_sample_rate=SAMPLE_RATE,
        speech_tokenizer=SimpleNamespace(encode=lambda wavs, sr: SimpleNamespace(audio_codes=[None] * len(wavs))),
        extract_speaker_embedding=lambda audio, sr: seen.append((audio, sr)),
    )
    Qwen3TTSModel(fake_model, processor=None).create_voice_clone_prompt(source, x_vector_only_mode=True)
    (wav, sr), = seen
    assert sr == SAMPLE_RATE
    return wav


def _message(source) -> str:
    with pytest.raises(TTSInputError) as info:
        load_reference_audio(source)
    return str(info.value)


def test_stereo_44k_file_matches_reference(tmp_path: Path):
    path = tmp_path / "voice.wav"
    sf.write(path, _tone(2.5, 44100, channels=2), 44100, subtype="FLOAT")
    ours = load_reference_audio(path)
    ref = _reference_load(str(path))
    assert ours.dtype == np.float32 and ours.ndim == 1
    # librosa computes the length as ceil(n * (24000 / 44100)), whose float rounding gives 60001
    # samples for exactly 2.5 s; the codec frame count depends on it, so we must match it too.
    assert ours.shape == ref.shape == (int(2.5 * SAMPLE_RATE) + 1,)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(load_reference_audio(str(path)), ours)  # str and Path agree


def test_16bit_pcm_and_flac_files_match_reference(tmp_path: Path):
    for name, subtype in [("a.wav", "PCM_16"), ("b.flac", "PCM_24")]:
        path = tmp_path / name
        sf.write(path, _tone(1.5, 16000), 16000, subtype=subtype)
        np.testing.assert_allclose(load_reference_audio(path), _reference_load(str(path)), rtol=0, atol=1e-6)


def test_mp3_file_loads(tmp_path: Path):
    path = tmp_path / "voice.mp3"
    sf.write(path, _tone(2.0, 44100), 44100, format="MP3")
    wav = load_reference_audio(path)
    assert abs(wav.size - 2 * SAMPLE_RATE) < 0.05 * SAMPLE_RATE and np.abs(wav).max() > 0.1


def test_librosa_fallback_when_soundfile_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "voice.wav"
    sf.write(path, _tone(1.5, 44100, channels=2), 44100, subtype="FLOAT")
    expected = load_reference_audio(path)

    def unreadable(*args, **kwargs):
        raise sf.LibsndfileError(1, "Format not recognised: ")

    monkeypatch.setattr(sf, "read", unreadable)
    np.testing.assert_array_equal(load_reference_audio(path), expected)


def test_in_memory_tuples_match_reference():
    stereo = _tone(2.0, 22050, channels=2)  # [samples, channels]
    ours = load_reference_audio((stereo, 22050))
    # The official wrapper crashes on a 2-D (array, sr) tuple (it assigns into the tuple), so its
    # reference is the mono mix we pass it ourselves.
    ref = _reference_load((stereo.mean(axis=1), 22050))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(load_reference_audio((22050, stereo)), ours)  # Gradio order
    np.testing.assert_array_equal(load_reference_audio((stereo.T.copy(), 22050)), ours)  # channels-first


def test_int16_is_scaled_and_24k_passes_through():
    wav = _tone(1.2, SAMPLE_RATE)
    np.testing.assert_array_equal(load_reference_audio((wav, SAMPLE_RATE)), wav)
    pcm = (wav * 32767).astype(np.int16)
    np.testing.assert_allclose(load_reference_audio((SAMPLE_RATE, pcm)), pcm / 32768.0, rtol=0, atol=1e-7)


def test_missing_file(tmp_path: Path):
    assert _message(tmp_path / "nope.wav") == f"The reference audio file {tmp_path / 'nope.wav'} does not exist."
    assert "is a directory" in _message(tmp_path)


def test_not_audio(tmp_path: Path):
    path = tmp_path / "notes.wav"
    path.write_text("this is a text file, not a recording\n" * 50)
    assert _message(path) == "The file notes.wav could not be read as audio; upload a WAV, FLAC, OGG or MP3 recording."


def test_too_short(tmp_path: Path):
    path = tmp_path / "short.wav"
    sf.write(path, _tone(0.5, 44100), 44100)
    assert _message(path) == (
        "The reference audio is 0.50 s long but must be at least 1 s; use 3-20 s of clear speech."
    )
    assert "0.99 s long" in _message((_tone(0.999, SAMPLE_RATE), SAMPLE_RATE))  # never shown as "1.00"


def test_too_long():
    msg = _message((_tone(31.0, 16000), 16000))
    assert msg == "The reference audio is 31.00 s long but may be at most 30 s; trim it to 3-20 s of clear speech."
    assert "30.01 s long" in _message((np.full(30 * 16000 + 1, 0.1, np.float32), 16000))


def test_silent(tmp_path: Path):
    path = tmp_path / "silence.wav"
    sf.write(path, np.zeros(3 * SAMPLE_RATE, np.float32), SAMPLE_RATE)
    assert _message(path).startswith("The reference audio is silent (peak amplitude 0.0e+00, below 1e-04)")
    assert "silent" in _message((np.full(SAMPLE_RATE * 2, 5e-5, np.float32), SAMPLE_RATE))


def test_empty(tmp_path: Path):
    assert _message((np.zeros(0, np.float32), SAMPLE_RATE)) == "The reference audio is empty (it has no samples)."
    path = tmp_path / "empty.wav"
    sf.write(path, np.zeros((0, 2), np.float32), SAMPLE_RATE)
    assert "empty" in _message(path)


def test_bad_in_memory_input():
    assert "NaN" in _message((np.full(SAMPLE_RATE * 2, np.nan, np.float32), SAMPLE_RATE))
    assert "sample rate" in _message((_tone(2.0, SAMPLE_RATE), 0))
    assert "shape" in _message((np.zeros((2, 2, SAMPLE_RATE), np.float32), SAMPLE_RATE))
