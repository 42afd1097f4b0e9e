"""Qwen3-Omni's batched thinker on the tiny checkpoint (CPU): conversations started at staggered
times, each in its own row of one decode step, give exactly the reply tokens and talker codes each
gives alone (greedy and seeded); a conversation that joins is prefilled between two steps of the
others, one prompt per step, so theirs go on while it joins."""
import threading

import numpy as np
import pytest
import torch

from pipeline.omni import ChatEnd, ChatRequest, OmniChat, TextDelta, Turn
from pipeline.omni.conversation import ThinkerInputs
from pipeline.omni.thinker import ThinkerReply, ThinkerSampling

ROWS = 3
HANG_GUARD_S = 120
MESSAGES = ("Hello there, how are you?", "Tell me about the fox and the lazy dog.", "Numbers 0 1 2 3, please.")


@pytest.fixture(scope="module")
def chat(tiny_omni) -> OmniChat:
    return OmniChat.from_pretrained(str(tiny_omni), rows=ROWS)


class Listener:
    """One conversation's stream read on its own thread: its events, and a flag once it has `tokens` reply tokens."""

    def __init__(self, chat: OmniChat, request: ChatRequest, tokens: int = 4):
        self.stream = chat.stream(request)
        self.events: list = []
        self.has_tokens = threading.Event()
        self.tokens = tokens
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        for event in self.stream:
            self.events.append(event)
            if isinstance(event, TextDelta) and event.last_token + 1 >= self.tokens:
                self.has_tokens.set()
        self.has_tokens.set()

    def end(self) -> ChatEnd:
        self.thread.join(HANG_GUARD_S)
        assert not self.thread.is_alive(), "the reply never ended"
        return self.events[-1]


def requests(greedy: bool) -> list[ChatRequest]:
    return [ChatRequest([Turn("user", text)], greedy=greedy, seed=None if greedy else 7 + i, max_new_tokens=16 + 4 * i, max_frames=24)
            for i, text in enumerate(MESSAGES)]


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_staggered_conversations_equal_each_alone(chat, greedy):
    alone = [chat.reply(request) for request in requests(greedy)]
    listeners = []
    for request in requests(greedy):  # each joins once the one before has written 4 tokens, while it still writes
        if listeners:
            assert listeners[-1].has_tokens.wait(HANG_GUARD_S)
        listeners.append(Listener(chat, request))
    together = [listener.end() for listener in listeners]
    for one, beside in zip(alone, together):
        assert isinstance(beside, ChatEnd) and not beside.stopped
        assert beside.tokens == one.tokens and len(one.tokens) >= 16
        assert len(one.codes) == 24 and np.array_equal(beside.codes, one.codes)
    assert len({tuple(reply.tokens) for reply in alone}) == len(alone)  # three different replies


def test_a_joining_conversation_is_prefilled_between_steps_of_the_running_ones(chat, monkeypatch):
    """One prompt per step: two conversations joining a running one are prefilled one at a time,
    each followed by a step of every conversation in the thinker, the running one included."""
    thinker = chat.thinker
    calls: list[tuple[str, frozenset]] = []
    prefill, step = thinker._prefill, thinker._step

    def logged_prefill(row, reply):
        calls.append(("prefill", frozenset(thinker.running)))
        return prefill(row, reply)

    def logged_step():
        calls.append(("step", frozenset(thinker.running)))
        return step()

    monkeypatch.setattr(thinker, "_prefill", logged_prefill)
    monkeypatch.setattr(thinker, "_step", logged_step)
    long = Listener(chat, ChatRequest([Turn("user", MESSAGES[0])], greedy=True, max_new_tokens=1024, speak=False))
    assert long.has_tokens.wait(HANG_GUARD_S)
    joining = [Listener(chat, ChatRequest([Turn("user", text)], greedy=True, max_new_tokens=6, speak=False)) for text in MESSAGES[1:]]
    replies = [listener.end() for listener in joining]
    long.stream.close()
    assert long.end().stopped and all(len(reply.tokens) == 6 for reply in replies)
    prefills = [i for i, (kind, _) in enumerate(calls) if kind == "prefill"]
    assert len(prefills) == 3 and calls[0] == ("prefill", frozenset())
    first_row = next(iter(calls[1][1]))
    for i in prefills[1:]:
        running = calls[i][1]
        assert first_row in running  # the long reply was running when the other joined
        kind, after = calls[i + 1]
        assert kind == "step" and after > running  # the next call is a step of all of them, the new one included



def test_the_steps_cuda_kernels_compute_what_transformers_kernels_compute(tiny_omni):
    """What the step runs on CUDA (the row-invariant experts and attention, here in Triton's interpreter)
    against what it runs on the CPU (transformers' batched_mm experts and sdpa): the same logits for two
    conversations of different lengths, one row idle."""
    from pipeline.omni import thinker as thinker_module

    thinker = OmniChat.from_pretrained(str(tiny_omni), rows=3).thinker
    g = torch.Generator().manual_seed(0)
    logits = []
    with torch.inference_mode():
        for row, length in enumerate((9, 70)):  # the second over more than one block of keys
            ids = torch.randint(0, thinker.vocab, (1, length), generator=g)
            thinker._prefill(row, ThinkerReply(ThinkerInputs(ids), thinker._input_embeds(ids, {}), ThinkerSampling(do_sample=False), 0, 8, -1,
                                               threading.Event(), None))
        hook = thinker.model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out[:2, -1].clone()))
        thinker._decode()
        thinker_module._register_row_kernels()
        thinker.step_kernels = (thinker_module.ROW_EXPERTS, thinker_module.ROW_ATTENTION)
        thinker._decode()
        hook.remove()
    assert logits[0].std() > 0.1 and torch.allclose(logits[1], logits[0], atol=1e-4, rtol=1e-4), (logits[1] - logits[0]).abs().max()
