"""What the thinker reads of a chat (layout, audio placeholders, the context limit) and the clear
message of every bad input, checked before any work: empty message, control tokens, unreadable,
unsupported, silent or too long audio, an unknown speaker, a conversation too long for the
context, a machine too small for the weights."""
import numpy as np
import pytest
import soundfile as sf
import torch
from transformers import AutoTokenizer, WhisperFeatureExtractor

from pipeline.audio import load_message_audio
from pipeline.errors import CheckpointError, TTSInputError
from pipeline.omni import ChatRequest, OmniChat, Turn
from pipeline.omni.chat import check_memory
from pipeline.omni.conversation import AUDIO_SAMPLE_RATE, audio_positions, build_inputs, layout
from conftest import voice_like


@pytest.fixture(scope="module")
def tokenizer(tiny_omni):
    return AutoTokenizer.from_pretrained(str(tiny_omni))


@pytest.fixture(scope="module")
def features(tiny_omni):
    return WhisperFeatureExtractor.from_pretrained(str(tiny_omni))


def test_layout_is_the_chat_template_with_audio_first():
    turns = [Turn("user", "Hi", np.zeros(16000, np.float32)), Turn("assistant", "Hello!"), Turn("user", "Bye")]
    assert layout(turns, "Be brief.") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>Hi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n")


def test_audio_placeholder_is_expanded_to_the_encoder_positions(tokenizer, features):
    audio = voice_like(2.5, AUDIO_SAMPLE_RATE)
    inputs = build_inputs(tokenizer, features, [Turn("user", "What is this?", audio)], "", 2030)
    ids = inputs.input_ids[0].tolist()
    mel_frames = int(inputs.features["feature_attention_mask"].sum())
    assert mel_frames == 250 and ids.count(151675) == audio_positions(mel_frames) == 33
    start = ids.index(151669)
    assert ids[start + 1:start + 34] == [151675] * 33 and ids[start + 34] == 151670


def test_too_long_conversation_drops_the_oldest_turns(tokenizer, features):
    turns = []
    for i in range(6):
        turns += [Turn("user", f"Question {i}: the quick brown fox jumps over the lazy dog."), Turn("assistant", "A calm narrator reads it.")]
    turns.append(Turn("user", "And the last one?"))
    full = build_inputs(tokenizer, features, turns, "", 10_000).input_ids.shape[1]
    cut = build_inputs(tokenizer, features, turns, "", full - 5)
    assert cut.dropped_turns == 2 and cut.input_ids.shape[1] <= full - 5  # one user turn and its reply
    assert tokenizer.decode(cut.input_ids[0]).startswith("<|im_start|>user\nQuestion 1:")
    with pytest.raises(TTSInputError, match="the model takes at most 5"):
        build_inputs(tokenizer, features, turns, "", 5)


@pytest.mark.parametrize("turns, message", [
    ([Turn("user", " \n ")], "The message is empty"),
    ([Turn("assistant", "Hi")], "must end with a user message"),
    ([Turn("user", "Say <|audio_pad|> twice")], "control token <|audio_pad|>"),
])
def test_bad_turns(tokenizer, features, turns, message):
    with pytest.raises(TTSInputError, match=message):
        build_inputs(tokenizer, features, turns, "", 2030)


def test_bad_audio_messages(tmp_path):
    text = tmp_path / "notes.wav"
    text.write_text("not audio at all")
    with pytest.raises(TTSInputError, match="could not be read as audio"):
        load_message_audio(text, 16000, 60)
    silent = tmp_path / "silent.wav"
    sf.write(silent, np.zeros(16000, np.float32), 16000)
    with pytest.raises(TTSInputError, match="silent"):
        load_message_audio(silent, 16000, 60)
    with pytest.raises(TTSInputError, match="empty or shorter than 0.1 s"):
        load_message_audio((np.zeros(0, np.float32), 16000), 16000, 60)
    with pytest.raises(TTSInputError, match="61.0 s long but may be at most 60 s"):
        load_message_audio((voice_like(61, 8000), 8000), 16000, 60)
    wav = load_message_audio((voice_like(1.0, 48000), 48000), 16000, 60)
    assert wav.dtype == np.float32 and wav.shape == (16000,)


def test_unknown_speaker_lists_the_voices_before_any_work(tiny_omni):
    chat = OmniChat.from_pretrained(str(tiny_omni))
    with pytest.raises(TTSInputError, match="Unknown speaker 'Serena'; this model has aiden, chelsie, ethan."):
        chat.stream(ChatRequest([Turn("user", "Hi")], speaker="Serena"))
    with pytest.raises(TTSInputError, match="audio message file .*gone.wav does not exist"):
        chat.stream(ChatRequest([Turn("user", "Hi", "gone.wav")]))


def test_a_machine_too_small_is_told_what_is_needed():
    with pytest.raises(CheckpointError, match=r"needs about \d+ GiB of memory in bfloat16; this machine has \d+ GiB of free memory"):
        check_memory(None, torch.device("cpu"), torch.bfloat16, parameters=10**15)
    check_memory(None, torch.device("cpu"), torch.float32, parameters=1000)
