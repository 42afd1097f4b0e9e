"""Qwen3-Omni end to end on a tiny random checkpoint (CPU, fp32, greedy): our chat loop (the
checkpoint loaded by our loader; transformers' thinker driven token by token; our talker prompt,
batched decode step with text streamed in, and code2wav as the engine's vocoder) gives the same
reply, the same codec codes and the same waveform as `Qwen3OmniMoeForConditionalGeneration.generate`
of the same checkpoint."""
import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

from pipeline.omni import ChatRequest, OmniChat, Turn
from pipeline.omni.conversation import build_inputs
from tests.conftest import voice_like

TALKER_FRAMES = 29
SYSTEM = "You are a helpful voice assistant."


@pytest.fixture(scope="module")
def reference(tiny_omni) -> Qwen3OmniMoeForConditionalGeneration:
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(tiny_omni)).eval()
    model.code2wav.config._attn_implementation = "eager"  # equal to sdpa here; eager is the plainest
    return model


@pytest.fixture(scope="module")
def chat(tiny_omni) -> OmniChat:
    return OmniChat.from_pretrained(str(tiny_omni))


def _transformers(model, chat: OmniChat, request: ChatRequest, reply_tokens: int):
    """transformers' generate on the same ids and features; its codes are caught on the way to code2wav."""
    inputs = build_inputs(chat.tokenizer, chat.feature_extractor, request.turns, request.system, 4096)
    captured = {}
    chunked = model.code2wav.chunked_decode

    def capture(codes, **kwargs):
        captured["codes"] = codes
        return chunked(codes, **kwargs)

    model.code2wav.chunked_decode = capture
    try:
        sequences, wav = model.generate(inputs.input_ids, speaker=request.speaker, thinker_max_new_tokens=reply_tokens, thinker_do_sample=False,
                                        talker_do_sample=False, talker_max_new_tokens=request.max_frames + 1, **inputs.features)
    finally:
        model.code2wav.chunked_decode = chunked
    return sequences[0, inputs.input_ids.shape[1]:].tolist(), captured["codes"][0].T.numpy(), wav.reshape(-1).numpy()


def _request(*messages: str | tuple, speaker: str = "Ethan", system: str = SYSTEM, replies: tuple[str, ...] = (), reply_tokens: int = 12,
             frames: int = TALKER_FRAMES):
    turns = []
    for i, message in enumerate(messages):
        text, audio = (message, None) if isinstance(message, str) else message
        turns.append(Turn("user", text, audio))
        if i < len(replies):
            turns.append(Turn("assistant", replies[i]))
    return ChatRequest(turns, system=system, speaker=speaker, greedy=True, max_new_tokens=reply_tokens, max_frames=frames)


def _check(reference, chat, request, ended: bool):
    # A reply cut at N tokens is spoken whole by ours; transformers drops the last generated token
    # from the talker's text (it is never fed back to the thinker), so it is given one more.
    expected_tokens, codes, wav = _transformers(reference, chat, request, request.max_new_tokens + (0 if ended else 1))
    reply = chat.reply(request)
    assert reply.tokens == expected_tokens[:len(reply.tokens)]
    assert (reply.tokens[-1] == chat.im_end) == ended
    assert len(codes) > 5 and len(set(codes[:, 0].tolist())) > 3
    assert np.array_equal(reply.codes, codes)
    assert reply.audio.shape == wav.shape and np.abs(reply.audio - wav).max() <= 1e-5
    return reply


AUDIO = (voice_like(1.3, 16000, seed=3), )


@pytest.mark.parametrize("name, request_", [
    ("short message", _request("Hello there, how are you?")),
    ("no system prompt", _request("The quick brown fox.", system="")),
    ("second turn", _request("Hello there.", "Tell me more, please.", replies=("This is a tiny test voice.",), speaker="Aiden")),
    ("audio message", _request(("", AUDIO[0]))),
    ("audio then text", _request(("What did I say?", AUDIO[0]), speaker="Chelsie")),
    ("long answer", _request("Speak slowly and warmly.", reply_tokens=60, frames=80)),
])
def test_reply_codes_and_waveform_equal_transformers(reference, chat, name, request_):
    with torch.no_grad():
        reply = _check(reference, chat, request_, ended=False)
    assert len(reply.tokens) == request_.max_new_tokens


@pytest.mark.parametrize("speaker", ["Chelsie", "Ethan", "Aiden"])
def test_each_speaker_equals_transformers(reference, chat, speaker):
    with torch.no_grad():
        _check(reference, chat, _request("Numbers 0 1 2 3.", speaker=speaker), ended=False)


def test_speakers_give_different_speech(chat):
    codes = {name: chat.reply(_request("Numbers 0 1 2 3.", speaker=name)).codes for name in chat.speakers}
    assert not np.array_equal(codes["Chelsie"], codes["Ethan"]) and not np.array_equal(codes["Ethan"], codes["Aiden"])


@contextlib.contextmanager
def _reply_ends_after(models: list, chat: OmniChat, request: ChatRequest, tokens: int):
    """Set the thinker's <|im_end|> row of lm_head from its final states in this reply, so that the greedy reply is `tokens`
    tokens and then <|im_end|> (in every model given; undone after)."""
    heads = [m.lm_head for m in models]
    states = []
    hook = chat.thinker.model.lm_head.register_forward_hook(lambda module, args, out: states.append(args[0][0, -1].clone()))
    try:
        with torch.no_grad():
            chat.reply(dataclasses.replace(request, max_new_tokens=tokens + 1))
    finally:
        hook.remove()
    with torch.no_grad():
        # The row whose logit is the highest at reply token `tokens` and the lowest before it.
        logits = [heads[0](h[None])[0] for h in states[:tokens + 1]]
        wanted = torch.stack([lg.min() - 5.0 for lg in logits[:-1]] + [logits[-1].max() + 5.0])
        row = torch.linalg.pinv(torch.stack(states[:tokens + 1])) @ wanted
    saved = heads[0].weight[chat.im_end].clone()
    with torch.no_grad():
        for head in heads:
            head.weight[chat.im_end] = row
    try:
        yield
    finally:
        with torch.no_grad():
            for head in heads:
                head.weight[chat.im_end] = saved


@pytest.mark.parametrize("tokens", [1, 6])
def test_reply_ending_in_im_end_equals_transformers(reference, chat, tokens):
    """A one-token answer and a short one, each ended by the thinker's <|im_end|>, which is never spoken."""
    request = _request("Hello there, how are you?", reply_tokens=20)
    with _reply_ends_after([reference.thinker, chat.thinker.model], chat, request, tokens), torch.no_grad():
        reply = _check(reference, chat, request, ended=True)
    assert len(reply.tokens) == tokens + 1


def test_any_chunk_schedule_gives_the_offline_waveform(chat, tiny_omni):
    """The engine's code2wav calls (pieces of 16/8/4/2/1 frames, the first holding back the look-ahead)
    join to one offline decode of the same codes, whatever the chunk sizes."""
    from pipeline.omni import Code2Wav, decode

    request = _request("Hello there, how are you?", frames=40)
    replies = [chat.reply(dataclasses.replace(request, schedule=schedule)) for schedule in [(1, 2, 4, 8, 16), (3, 5, 7), (40,), (1,)]]
    offline = decode(Code2Wav.from_pretrained(tiny_omni), torch.from_numpy(replies[0].codes)).numpy()
    for reply in replies:
        assert np.array_equal(reply.codes, replies[0].codes)
        assert reply.audio.shape == offline.shape == (40 * 1920 - 555,) and np.abs(reply.audio - offline).max() <= 1e-5


def test_same_seed_same_reply_and_audio_when_sampling(chat):
    """Sampled thinker, talker and code predictor: the same seed gives the same reply, codes and audio,
    bit for bit (chunks are cut by the schedule alone, also while the talker waits for the thinker, so
    the vocoder's calls are the same each time)."""
    request = ChatRequest([Turn("user", "Tell me about the fox.")], system=SYSTEM, seed=11, max_new_tokens=10, max_frames=20)
    first, again, other = chat.reply(request), chat.reply(request), chat.reply(dataclasses.replace(request, seed=12))
    assert first.tokens == again.tokens and np.array_equal(first.codes, again.codes)
    assert np.array_equal(first.audio, again.audio)
    assert first.tokens != other.tokens or not np.array_equal(first.codes, other.codes)
