"""What the thinker reads of a chat (layout, audio placeholders, the context limit) and the clear
message of every bad input, checked before any work: empty message, control tokens, unreadable,
unsupported, silent or too long audio, an unknown speaker, a conversation too long for the
context, a machine too small for the weights."""
import json
import re
import threading

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import voice_like
from transformers import AutoTokenizer, WhisperFeatureExtractor

from pipeline.audio import load_message_audio
from pipeline.errors import CheckpointError, TTSInputError
from pipeline.omni import ChatRequest, OmniChat, Turn
from pipeline.omni.chat import check_memory
from pipeline.omni.conversation import AUDIO_SAMPLE_RATE, audio_positions, build_inputs, layout


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


class CountingTokenizer:
    """The checkpoint's tokenizer, counting how often each turn's text is tokenized (by its marker)."""

    def __init__(self, tokenizer, markers: list[str]):
        self.tokenizer, self.markers = tokenizer, markers
        self.counts = dict.fromkeys(markers, 0)

    def __call__(self, text, **options):
        for marker in re.findall(r"\[turn \d+\]", text):
            self.counts[marker] += 1
        return self.tokenizer(text, **options)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def long_conversation(turn_pairs: int, audio_every: int = 0) -> list[Turn]:
    turns = []
    for i in range(turn_pairs):
        audio = voice_like(1.0 + i % 3, AUDIO_SAMPLE_RATE, seed=i) if audio_every and i % audio_every == 0 else None
        turns += [Turn("user", f"[turn {2 * i}] Question {i}: the quick brown fox jumps over the lazy dog.", audio),
                  Turn("assistant", f"[turn {2 * i + 1}] A calm narrator reads answer {i} aloud.")]
    return turns + [Turn("user", f"[turn {2 * turn_pairs}] And the last one?")]


def kept_by_trying_each_start(tokenizer, features, turns: list[Turn], max_prompt: int) -> int:
    """The reference: the earliest start (the first turn or a user turn) whose whole prompt fits, each encoded in full."""
    starts = [i for i, turn in enumerate(turns) if i == 0 or turn.role == "user"]
    return next(i for i in starts if build_inputs(tokenizer, features, turns[i:], "Be brief.", 10**9).input_ids.shape[1] <= max_prompt)


def test_trimming_a_400_turn_conversation_tokenizes_each_turn_a_bounded_number_of_times(tokenizer, features):
    turns = long_conversation(200)
    counting = CountingTokenizer(tokenizer, [f"[turn {i}]" for i in range(len(turns))])
    inputs = build_inputs(counting, features, turns, "Be brief.", 2030)
    assert inputs.dropped_turns > 300 and inputs.input_ids.shape[1] <= 2030
    # Measured once, encoded once if kept; the dropped ones are never read in full again.
    assert max(counting.counts.values()) <= 2, max(counting.counts.items(), key=lambda item: item[1])
    assert inputs.dropped_turns == kept_by_trying_each_start(tokenizer, features, turns, 2030)


@pytest.mark.parametrize("max_prompt", [300, 700, 1100])
def test_trimming_keeps_what_encoding_every_start_keeps_audio_included(tokenizer, features, max_prompt):
    turns = long_conversation(12, audio_every=4)
    inputs = build_inputs(tokenizer, features, turns, "Be brief.", max_prompt)
    assert inputs.dropped_turns == kept_by_trying_each_start(tokenizer, features, turns, max_prompt)
    assert inputs.input_ids.shape[1] <= max_prompt


@pytest.fixture(scope="module")
def omni_service(tiny_omni, tmp_path_factory):
    from pipeline.service import ModelService

    service = ModelService({"omni": (str(tiny_omni),)}, tiny_dir=tmp_path_factory.mktemp("tiny-root"))
    service.model("omni")
    return service


def test_the_chat_api_says_how_many_turns_were_dropped(omni_service):
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from pipeline.omni.chat import MAX_PROMPT
    from pipeline.server import Access, chat_routes

    model = omni_service.model("omni")
    turns = long_conversation(40)
    dropped = build_inputs(model.tokenizer, model.feature_extractor, turns, "Be brief.", MAX_PROMPT).dropped_turns
    assert dropped > 0
    client = TestClient(Starlette(routes=chat_routes(omni_service, Access())))
    messages = [{"role": "system", "content": "Be brief."}] + [{"role": t.role, "content": t.text} for t in turns]
    body = {"messages": messages, "modalities": ["text"], "max_tokens": 2, "seed": 1}
    assert client.post("/v1/chat/completions", json=body).json()["dropped_turns"] == dropped
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as response:
        chunks = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] is not None and chunks[-1]["dropped_turns"] == dropped
    short = body | {"messages": [{"role": "user", "content": "Hi"}]}
    assert client.post("/v1/chat/completions", json=short).json()["dropped_turns"] == 0


def test_stop_before_the_reply_leaves_no_empty_bubble(omni_service):
    import gradio as gr

    from ui import omni_chat
    from ui.app import build_demo

    demo = build_demo(omni_service)
    send = next(fn.fn for fn in demo.fns.values() if fn.api_name == "omni_send")
    updates = send(omni_service.default_checkpoint("omni"), "Chelsie", "", 6, 3, "Hello there", None, [], "", "", "", gr.Request(), gr.Progress())
    def turns(update: dict) -> list | None:
        return next((v for k, v in update.items() if isinstance(k, gr.State) and isinstance(v, list)), None)

    first = next(update for update in updates if turns(update) is not None)  # the message taken, as the thinker starts to read it
    omni_service.stop(":omni:")  # Stop: the reply ends, and gradio cancels the handler
    updates.close()
    for thread in threading.enumerate():  # the stopped reply's thinker finishes the prefill it is in
        if thread.name.startswith("omni-"):
            thread.join()
    state = turns(first)
    assert state == [{"role": "user", "text": "Hello there", "audio": None}]  # the next message's context holds it
    assert omni_chat.chat_messages(state) == [{"role": "user", "content": "Hello there"}]  # the chat shows it, and no reply bubble
