"""Saved voices: a voice prompt written to a file and read back gives the same codes and audio as the
reference recording it was made from; every bad file gets its own sentence before any synthesis;
the CLI writes and reads them."""
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pipeline.__main__ import EXIT_BAD_INPUT, main
from pipeline.errors import TTSInputError
from pipeline.request import SpeechRequest
from pipeline.tiny import write_tiny_checkpoint
from pipeline.tts import TTS
from pipeline.voice_file import METADATA_KEY, VERSION

REF_TEXT = "Speak slowly and warmly."
TEXT = "Hello there, tiny model."


@pytest.fixture(scope="module")
def tts(tiny_checkpoints) -> TTS:
    return TTS.from_pretrained(str(tiny_checkpoints["base"]))


@pytest.fixture(scope="module")
def voices(tts, reference_wav) -> dict:
    return {"icl": tts.create_voice_prompt(str(reference_wav), REF_TEXT), "xvec": tts.create_voice_prompt(str(reference_wav), x_vector_only=True)}


@pytest.fixture(scope="module")
def icl_file(tts, voices, tmp_path_factory) -> Path:
    return tts.save_voice_prompt(voices["icl"], tmp_path_factory.mktemp("voice") / "icl.safetensors")


def rewritten(source: Path, target: Path, tensors: dict | None = None, **metadata) -> Path:
    """`source` with some tensors and metadata fields replaced (None removes a tensor)."""
    content = load_file(source)
    for name, tensor in (tensors or {}).items():
        if tensor is None:
            del content[name]
        else:
            content[name] = tensor
    with safe_open(source, "pt") as f:
        fields = json.loads(f.metadata()[METADATA_KEY])
    save_file(content, target, metadata={METADATA_KEY: json.dumps({**fields, **metadata})})
    return target


@pytest.mark.parametrize("mode", ["icl", "xvec"])
@pytest.mark.parametrize("greedy", [True, False])
def test_a_saved_voice_speaks_exactly_like_its_reference(tts, voices, reference_wav, tmp_path, mode, greedy):
    path = tts.save_voice_prompt(voices[mode], tmp_path / "voice.safetensors")
    request = dict(text=TEXT, greedy=greedy, seed=11, max_frames=15)
    reference = dict(ref_text=REF_TEXT) if mode == "icl" else dict(x_vector_only=True)
    direct = tts.synthesize(SpeechRequest(**request, ref_audio=str(reference_wav), **reference))
    from_file = tts.synthesize(SpeechRequest(**request, voice_prompt=str(path)))
    assert direct.codes.shape == (15, 16)
    assert np.array_equal(from_file.codes, direct.codes)
    assert np.array_equal(from_file.audio, direct.audio)


def test_the_file_holds_only_what_cannot_be_recomputed(tts, voices, icl_file):
    tensors = load_file(icl_file)
    assert set(tensors) == {"speaker_embedding", "ref_codes"}  # the primed vocoder state is recomputed
    assert tensors["ref_codes"].dtype == torch.int16 and tensors["speaker_embedding"].dtype == torch.float32
    assert icl_file.stat().st_size < 2 * tensors["ref_codes"].numel() + 4 * 64 + 1024
    loaded = tts.load_voice_prompt(icl_file.read_bytes())
    original = voices["icl"]
    assert loaded.ref_text == REF_TEXT and torch.equal(loaded.ref_codes, original.ref_codes)
    assert torch.equal(loaded.speaker_embedding, original.speaker_embedding)
    assert all(torch.equal(a, b) for a, b in zip(loaded.vocoder_state, original.vocoder_state, strict=True))


def test_the_checkpoint_identity_does_not_depend_on_the_dtype(tts, tiny_checkpoints):
    bf16 = TTS.from_pretrained(str(tiny_checkpoints["base"]), dtype="bfloat16")
    assert bf16.voice_space.fingerprint == tts.voice_space.fingerprint


@pytest.fixture(scope="module")
def other_checkpoint_file(tmp_path_factory, reference_wav) -> tuple[Path, TTS]:
    """A voice file of another Base checkpoint of the same sizes (other random weights)."""
    other = TTS.from_pretrained(str(write_tiny_checkpoint(tmp_path_factory.mktemp("other") / "base", "base", seed=1)))
    voice = other.create_voice_prompt(str(reference_wav), REF_TEXT)
    return other.save_voice_prompt(voice, tmp_path_factory.mktemp("voice") / "other.safetensors"), other


def test_a_voice_of_another_checkpoint_is_refused_naming_both(tts, other_checkpoint_file):
    path, other = other_checkpoint_file
    with pytest.raises(TTSInputError) as error:
        tts.load_voice_prompt(path)
    assert str(error.value) == (
        f"This voice was made with the checkpoint '{other.name}' (weights {other.voice_space.fingerprint}, 64-dim speaker embedding) "
        f"and cannot be used with '{tts.name}' (weights {tts.voice_space.fingerprint}, 64-dim): "
        "export it again from its reference audio with this checkpoint."
    )


BAD_FILES = [
    ("garbage", lambda good, d: d.joinpath("x.safetensors").write_bytes(b"\x00\x01garbage, not a voice" * 10),
     "This is not a Qwen3-TTS voice file (a .safetensors file made by Export voice or synth --save-voice-prompt)."),
    ("a wav", lambda good, d: d.joinpath("x.safetensors").write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(100)),
     "This is not a Qwen3-TTS voice file (a .safetensors file made by Export voice or synth --save-voice-prompt)."),
    ("empty", lambda good, d: d.joinpath("x.safetensors").write_bytes(b""), "The voice file is empty."),
    ("too big", lambda good, d: d.joinpath("x.safetensors").write_bytes(bytes(2 << 20)),
     "The file is 2.0 MB; a voice file is a few kB (at most 1024 kB), so this is not one."),
    ("cut in the tensors", lambda good, d: d.joinpath("x.safetensors").write_bytes(good.read_bytes()[:-100]),
     lambda good, name: f"The voice file is cut short: it has {good.stat().st_size - 100} bytes of at least {good.stat().st_size}; "
                  "download or export it again."),
    ("cut in the header", lambda good, d: d.joinpath("x.safetensors").write_bytes(good.read_bytes()[:40]),
     lambda good, name: f"The voice file is cut short: it has 40 bytes of at least {8 + int.from_bytes(good.read_bytes()[:8], 'little')}; "
                  "download or export it again."),
    ("plain safetensors", lambda good, d: save_file({"w": torch.zeros(3)}, d / "x.safetensors"),
     "This .safetensors file is not a Qwen3-TTS voice file: it has no voice metadata."),
    ("a newer version", lambda good, d: rewritten(good, d / "x.safetensors", version=VERSION + 1),
     f"The voice file has format version {VERSION + 1} and this program reads version {VERSION}: export the voice again from its reference audio."),
    ("damaged metadata", lambda good, d: rewritten(good, d / "x.safetensors", x_vector_only="no"),
     "The voice file's metadata is damaged: 'x_vector_only' is missing or of the wrong type."),
    ("embedding of another size", lambda good, d: rewritten(good, d / "x.safetensors", {"speaker_embedding": torch.zeros(63)}),
     lambda good, name: f"The voice file's speaker_embedding is float32 [63]; {name} needs a float vector of 64."),
    ("codes of another width", lambda good, d: rewritten(good, d / "x.safetensors", {"ref_codes": torch.zeros(40, 15, dtype=torch.int16)}),
     lambda good, name: f"The voice file's ref_codes are int16 [40, 15]; {name} needs integers shaped [frames, 16] with 1 to 375 frames."),
    ("codes out of the codebook", lambda good, d: rewritten(good, d / "x.safetensors", {"ref_codes": torch.full((40, 16), 2048, dtype=torch.int16)}),
     lambda good, name: f"The voice file's ref_codes hold 2048, outside the codebook of {name} (0 to 2047)."),
    ("no transcript", lambda good, d: rewritten(good, d / "x.safetensors", ref_text=" "),
     "The voice file is for ICL cloning but has no reference transcript."),
    ("no codes", lambda good, d: rewritten(good, d / "x.safetensors", {"ref_codes": None}),
     "The voice file is for ICL cloning but has no ref_codes."),
    ("a NaN embedding", lambda good, d: rewritten(good, d / "x.safetensors", {"speaker_embedding": torch.full((64,), float("nan"))}),
     "The voice file's speaker_embedding holds values that are not finite (NaN or infinity)."),
]


@pytest.mark.parametrize("make, message", [case[1:] for case in BAD_FILES], ids=[case[0] for case in BAD_FILES])
def test_each_bad_file_gets_its_sentence_before_any_synthesis(tts, icl_file, tmp_path, monkeypatch, make, message):
    make(icl_file, tmp_path)
    expected = message(icl_file, tts.name) if callable(message) else message
    monkeypatch.setattr(tts.engine, "submit", lambda job: pytest.fail("a bad voice file reached the engine"))
    for source in (tmp_path / "x.safetensors", (tmp_path / "x.safetensors").read_bytes()):
        with pytest.raises(TTSInputError) as error:
            tts.submit(SpeechRequest(TEXT, voice_prompt=source, max_frames=3))
        assert str(error.value) == expected


@pytest.mark.parametrize("fields, message", [
    (dict(voice_prompt="x.safetensors", ref_audio="ref.wav"), "Give either reference audio or a saved voice (voice_prompt), not both."),
    (dict(voice_prompt="x.safetensors", ref_text="Hi."),
     "A saved voice brings its own transcript and x-vector-only mode: leave ref_text and x_vector_only out."),
    (dict(voice_prompt="x.safetensors", x_vector_only=True), "A saved voice brings its own transcript and x-vector-only mode"),
    (dict(voice_prompt="  "), "voice_prompt is empty: give the path of a voice file."),
    (dict(voice_prompt=3), "voice_prompt is a voice file's path or its bytes, not int."),
])
def test_requests_with_a_saved_voice_are_checked_before_the_model(fields, message):
    with pytest.raises(TTSInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeechRequest(TEXT, **fields).validate()


def test_a_saved_voice_is_refused_by_other_checkpoint_types(tiny_checkpoints, icl_file):
    custom = TTS.from_pretrained(str(tiny_checkpoints["custom_voice"]))
    with pytest.raises(TTSInputError, match=r"A saved voice is for Base \(voice clone\) checkpoints; .* is a custom_voice checkpoint."):
        custom.prepare(SpeechRequest(TEXT, speaker="ryan", voice_prompt=str(icl_file)))


def test_the_cli_saves_a_voice_and_speaks_with_it(tiny_checkpoints, reference_wav, tmp_path, capsys):
    base = ["synth", "--model", str(tiny_checkpoints["base"]), "--text", TEXT, "--seed", "5", "--max-frames", "12"]
    voice = tmp_path / "me.safetensors"
    assert main([*base, "--ref-audio", str(reference_wav), "--ref-text", REF_TEXT, "--save-voice-prompt", str(voice),
                 "--out", str(tmp_path / "a.wav"), "--codes-out", str(tmp_path / "a.npy")]) == 0
    assert main([*base, "--voice-prompt", str(voice), "--out", str(tmp_path / "b.wav"), "--codes-out", str(tmp_path / "b.npy")]) == 0
    assert np.array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))
    assert np.array_equal(sf.read(tmp_path / "a.wav")[0], sf.read(tmp_path / "b.wav")[0])  # the files' PEAK chunks hold the time
    capsys.readouterr()
    assert main([*base, "--voice-prompt", str(voice), "--ref-audio", str(reference_wav), "--out", str(tmp_path / "c.wav")]) == EXIT_BAD_INPUT
    assert "Give either reference audio or a saved voice (voice_prompt), not both." in capsys.readouterr().err
    saving_again = ["--save-voice-prompt", str(tmp_path / "d.safetensors"), "--out", str(tmp_path / "d.wav")]
    assert main([*base, "--voice-prompt", str(voice), *saving_again]) == EXIT_BAD_INPUT
    assert "--save-voice-prompt saves the voice computed from --ref-audio" in capsys.readouterr().err
    assert main([*base, "--voice-prompt", str(tmp_path / "missing.safetensors"), "--out", str(tmp_path / "e.wav")]) == EXIT_BAD_INPUT
    assert f"The voice file {tmp_path / 'missing.safetensors'} does not exist." in capsys.readouterr().err
