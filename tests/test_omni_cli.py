"""The `python -m pipeline chat` contract (Qwen3-Omni) on a tiny checkpoint written by
`make-tiny --type omni`: the reply text, codes and audio equal transformers' generate of the same
checkpoint (greedy), and every bad input is one clear error with exit code 2 (3 for a checkpoint)
before the weights load."""
import json

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import voice_like
from test_cli import run_cli
from transformers import AutoTokenizer
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

from pipeline.__main__ import EXIT_BAD_CHECKPOINT, EXIT_BAD_INPUT, main
from pipeline.omni.conversation import AUDIO_SAMPLE_RATE

OFFICIAL_FILES = ("config.json", "generation_config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json",
                  "preprocessor_config.json")


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "omni"
    result = run_cli("make-tiny", "--type", "omni", str(out), "--seed", "3")
    assert result.returncode == 0, result.stderr
    return out


def test_make_tiny_writes_the_official_layout_with_the_real_ids(omni_dir):
    assert all((omni_dir / name).is_file() for name in OFFICIAL_FILES)
    config = json.loads((omni_dir / "config.json").read_text())
    assert (config["im_start_token_id"], config["tts_pad_token_id"], config["thinker_config"]["audio_token_id"]) == (151644, 151671, 151675)
    assert config["talker_config"]["speaker_id"] == {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
    tokenizer = AutoTokenizer.from_pretrained(str(omni_dir))
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|audio_pad|>"]) == [151644, 151645, 151675]
    from safetensors import safe_open

    with safe_open(str(omni_dir / "model.safetensors"), "pt") as f:
        experts = f.get_tensor("talker.model.layers.0.mlp.experts.0.gate_proj.weight")
    assert experts.std() > 0.01  # transformers leaves the fused experts uninitialised; every tensor is seeded here


def test_chat_equals_transformers_generate(omni_dir, tmp_path):
    out, text_out, codes_out = tmp_path / "reply.wav", tmp_path / "reply.txt", tmp_path / "codes.npy"
    result = run_cli("chat", "--model", str(omni_dir), "--text", "Hello there, how are you?", "--speaker", "chelsie", "--greedy",
                     "--max-new-tokens", "10", "--max-frames", "24", "--out", str(out), "--text-out", str(text_out), "--codes-out", str(codes_out))
    assert result.returncode == 0, result.stderr
    reference = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(omni_dir)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(omni_dir))
    prompt = "<|im_start|>user\nHello there, how are you?<|im_end|>\n<|im_start|>assistant\n"
    input_ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    captured = {}
    chunked = reference.code2wav.chunked_decode
    reference.code2wav.chunked_decode = lambda codes, **kw: captured.setdefault("codes", codes) is not None and chunked(codes, **kw)
    with torch.no_grad():  # one more thinker token: transformers never speaks the last token of a cut reply
        sequences, wav = reference.generate(input_ids, speaker="Chelsie", thinker_max_new_tokens=11, thinker_do_sample=False,
                                            talker_do_sample=False, talker_max_new_tokens=25)
    reply = sequences[0, input_ids.shape[1]:][:10].tolist()
    assert text_out.read_text(encoding="utf-8") == tokenizer.decode(reply, skip_special_tokens=True)
    codes = np.load(codes_out)
    assert codes.dtype == np.int64 and codes.shape == (24, 16)
    assert np.array_equal(codes, captured["codes"][0].T.numpy())
    audio, rate = sf.read(out, dtype="float32")
    assert rate == 24000 and np.abs(audio - wav.reshape(-1).numpy()).max() <= 1e-5


def test_chat_answers_an_audio_message(omni_dir, tmp_path):
    message = tmp_path / "question.wav"
    sf.write(message, voice_like(1.5, 44100), 44100)
    out = tmp_path / "reply.flac"
    result = run_cli("chat", "--model", str(omni_dir), "--audio", str(message), "--max-new-tokens", "6", "--max-frames", "10", "--seed", "1",
                     "--out", str(out))
    assert result.returncode == 0, result.stderr
    audio, rate = sf.read(out)
    assert rate == 24000 and len(audio) == 10 * 1920 - 555 and np.abs(audio).max() > 1e-3


@pytest.fixture
def long_audio(tmp_path):
    path = tmp_path / "long.wav"
    sf.write(path, voice_like(61, AUDIO_SAMPLE_RATE), AUDIO_SAMPLE_RATE)
    return path


@pytest.mark.parametrize("flags, message", [
    (["--text", "Hi", "--speaker", "Bob"], "Unknown speaker 'Bob'; this model has aiden, chelsie, ethan."),
    (["--text", "   "], "The message is empty"),
    (["--text", "Hi <|im_end|> there"], "control token <|im_end|>"),
    (["--text", "Hi", "--max-frames", "0"], "max_frames must be a whole number from 1 to 2073 (got 0)."),
    (["--text", "Hi", "--max-frames", "2074"], "max_frames must be a whole number from 1 to 2073 (got 2074)."),
    (["--text", "Hi", "--max-new-tokens", "2000"], "max_new_tokens must be a whole number from 1 to 1024 (got 2000)."),
    (["--text", "Hi", "--audio", "missing.wav"], "The audio message file missing.wav does not exist."),
    (["--text", "Hi", "--audio", "LONG"], "may be at most 60 s"),
    (["--text", "Hi", "--out", "reply.mp4"], "the file name must end in"),
])
def test_bad_input_is_one_clear_error(omni_dir, tmp_path, long_audio, capsys, flags, message):
    flags = [str(long_audio) if f == "LONG" else f for f in flags]
    if "--out" not in flags:
        flags += ["--out", str(tmp_path / "reply.wav")]
    assert main(["chat", "--model", str(omni_dir), *flags]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_checkpoint_is_exit_3(tmp_path, capsys):
    assert main(["chat", "--model", str(tmp_path), "--text", "Hi", "--out", str(tmp_path / "r.wav")]) == EXIT_BAD_CHECKPOINT
    assert "is missing model.safetensors, config.json" in capsys.readouterr().err
