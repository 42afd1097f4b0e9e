"""The 12 Hz speech tokenizer: parity with the reference `qwen_tts` package on a tiny random
checkpoint, and exactness of the streaming decoder against offline decoding."""
import json
import math
from pathlib import Path

import pytest
import torch

from pipeline.errors import CheckpointError
from pipeline.speech_tokenizer import SpeechTokenizer, write_tiny_speech_tokenizer

SR = 24000
HOP = 1920  # samples per code frame
TOL = 1e-5  # max abs difference, float32

def _load_reference(path: Path):
    """qwen_tts.Qwen3TTSTokenizer for `path`.

    Needs transformers 5.15.x (pinned in requirements-test.txt): later releases split MimiModel
    into encoder and decoder halves, which the reference's 12 Hz encoder cannot build on.
    """
    import qwen_tts

    return qwen_tts.Qwen3TTSTokenizer.from_pretrained(str(path))


def _codes(frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2048, (frames, 16), generator=g)


def _chirp_with_noise(seconds: float) -> torch.Tensor:
    t = torch.arange(int(seconds * SR)) / SR
    g = torch.Generator().manual_seed(1)
    return 0.4 * torch.sin(2 * math.pi * (100 * t + 300 * t ** 2)) + 0.05 * torch.randn(len(t), generator=g)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny")
    write_tiny_speech_tokenizer(directory, seed=0)
    return directory


@pytest.fixture(scope="module")
def ours(checkpoint) -> SpeechTokenizer:
    return SpeechTokenizer.from_pretrained(checkpoint, "cpu", torch.float32)


@pytest.fixture(scope="module")
def reference(checkpoint):
    return _load_reference(checkpoint / "speech_tokenizer")


def test_parameter_names_are_the_official_ones(ours, reference):
    # Strict both ways: every parameter of ours is one of the reference's and none is missing.
    reference.model.load_state_dict(ours.state_dict(), strict=True)


def test_encode_matches_reference(ours, reference):
    wav = _chirp_with_noise(3.03)  # not a whole number of frames: ceil(samples / 1920) frames
    codes = ours.encode(wav)
    expected = reference.encode(wav.numpy(), sr=SR).audio_codes[0]
    assert codes.dtype == torch.long and codes.shape == (math.ceil(len(wav) / HOP), 16)
    assert torch.equal(codes.cpu(), expected.cpu())
    # A checkpoint that maps all audio to a few codes would make the equality vacuous.
    assert min(len(codes[:, q].unique()) for q in range(16)) > 5


def test_decode_matches_reference(ours, reference):
    codes = _codes(120, seed=2)  # longer than the 72-frame attention window
    wav = ours.decode(codes)
    expected = torch.from_numpy(reference.decode({"audio_codes": [codes]})[0][0])
    assert wav.dtype == torch.float32 and wav.shape == (120 * HOP,)
    assert _max_diff(wav, expected) < TOL
    # Non-trivial and unclipped, or the comparison would prove little (the reference clamps).
    assert wav.std() > 1e-3 and wav.abs().max() < 0.9


def test_decode_beyond_300_frames_is_one_causal_pass(ours, reference):
    # Beyond 300 frames the reference's decode() works in windows of 300 frames with 25 frames of
    # left context, so its frames 300.. differ from what the model computes over the whole
    # sequence (the 72-frame attention and the convs see a truncated past). Ours decodes all
    # frames causally at once, so the oracle is the reference decoder module's own full forward.
    codes = _codes(340, seed=3)
    wav = ours.decode(codes)
    with torch.inference_mode():
        full = reference.model.decoder(codes.T[None])[0, 0]
    assert _max_diff(wav, full) < TOL
    windowed = torch.from_numpy(reference.decode({"audio_codes": [codes]})[0][0])
    assert _max_diff(wav[:300 * HOP], windowed[:300 * HOP]) < TOL
    assert _max_diff(wav[300 * HOP:], windowed[300 * HOP:]) > 1e-3  # the windowing is audible


SCHEDULES = {
    "one_frame": [1] * 100,
    "ramp": [1, 2, 4, 8, 16, 16, 16, 16, 16, 5],
    "irregular": [3, 7, 5] * 6 + [10],
    "whole": [100],
}


@pytest.fixture(scope="module")
def long_codes() -> torch.Tensor:
    return _codes(100, seed=4)


@pytest.fixture(scope="module")
def offline_wav(ours, long_codes) -> torch.Tensor:
    return ours.decode(long_codes)


def _stream(stream, codes: torch.Tensor, schedule: list[int]) -> torch.Tensor:
    assert sum(schedule) == len(codes)
    parts, start = [], 0
    for n in schedule:
        part = stream.decode_chunk(codes[start:start + n])
        assert part.shape == (n * HOP,)
        parts.append(part)
        start += n
    return torch.cat(parts)


@pytest.mark.parametrize("schedule", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_streaming_equals_offline(ours, long_codes, offline_wav, schedule):
    assert _max_diff(_stream(ours.stream_decoder(), long_codes, schedule), offline_wav) < TOL


def test_reset_starts_a_new_stream(ours, long_codes, offline_wav):
    stream = ours.stream_decoder()
    _stream(stream, long_codes[:90], [30, 60])  # past the window, so every state is dirty
    stream.reset()
    assert _max_diff(_stream(stream, long_codes, SCHEDULES["ramp"]), offline_wav) < TOL


@pytest.mark.parametrize("ref_frames", [5, 80])  # shorter / longer than what prime() vocodes
def test_primed_stream_equals_offline_without_the_reference_part(ours, reference, ref_frames):
    # Voice clone: the reference codes are decoder context, and exactly their frames are removed.
    ref_codes, new_codes = _codes(ref_frames, seed=5), _codes(30, seed=6)
    stream = ours.stream_decoder()
    stream.prime(ref_codes)
    wav = _stream(stream, new_codes, [1, 2, 4, 8, 15])
    both = torch.cat([ref_codes, new_codes])
    expected = torch.from_numpy(reference.decode({"audio_codes": [both]})[0][0])[ref_frames * HOP:]
    assert _max_diff(wav, expected) < TOL
    assert _max_diff(wav, ours.decode(both)[ref_frames * HOP:]) < TOL


def test_bfloat16_runs_close_to_float32(checkpoint, ours, long_codes, offline_wav):
    model = SpeechTokenizer.from_pretrained(checkpoint, "cpu", torch.bfloat16)
    wav = model.decode(long_codes[:40])
    assert wav.dtype == torch.float32
    assert _max_diff(wav, offline_wav[:40 * HOP]) < 0.05
    streamed = _stream(model.stream_decoder(), long_codes[:40], [1, 3, 36])
    assert _max_diff(streamed, wav) < 0.05
    audio = _chirp_with_noise(1.0)
    assert model.encode(audio).shape == ours.encode(audio).shape


def test_missing_weights_name_the_file(checkpoint, tmp_path):
    (tmp_path / "speech_tokenizer").mkdir()
    config = json.loads((checkpoint / "speech_tokenizer" / "config.json").read_text())
    (tmp_path / "speech_tokenizer" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        SpeechTokenizer.from_pretrained(tmp_path)
