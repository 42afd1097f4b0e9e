"""On a CUDA GPU (skipped elsewhere): Qwen3-Omni's batched thinker, its step and its prompt packs
CUDA graphs, gives each conversation started beside others (joining one after another, or
arriving together and sharing packs) the reply tokens and talker codes it gives alone, greedy and
seeded: on the tiny checkpoint (fp32), and at the real 30B-A3B size with random weights in bf16
(an 80 GB card, as benchmarks.omni)."""
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.omni import ChatRequest, OmniChat, Turn
from tests.test_omni_batched import Listener

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
REAL_SIZE_GIB = 75  # the real-size model with 8 rows (benchmarks.omni)
MESSAGES = ("Hello there, how are you?", "Tell me about the fox and the lazy dog.", "Numbers 0 1 2 3, please.", "What is the weather like?",
            "Sing me something short.", "Where is Lisbon?", "Count to five.", "Good night!")


def requests(count: int, greedy: bool, tokens: int, frames: int) -> list[ChatRequest]:
    return [ChatRequest([Turn("user", MESSAGES[i])], greedy=greedy, seed=None if greedy else 21 + i, max_new_tokens=tokens + 2 * i, max_frames=frames)
            for i in range(count)]


def check_equal_alone(chat: OmniChat, made: list[ChatRequest], again: list[ChatRequest], together: list[ChatRequest]) -> None:
    """`made` one at a time; then `again` (the same requests) each joining once the one before has written 4
    tokens; then `together` (the same again), all waiting before the thinker's next pack."""
    alone = [chat.reply(request) for request in made]
    listeners = []
    for request in again:
        if listeners:
            assert listeners[-1].has_tokens.wait(300)
        listeners.append(Listener(chat, request))
    check_replies(alone, listeners)
    thinker = chat.thinker
    with thinker.lock:
        listeners = [Listener(chat, request) for request in together]
        with thinker.changed:
            assert thinker.changed.wait_for(lambda: len(thinker.waiting) == len(together), 300)
    check_replies(alone, listeners)


def check_replies(alone: list, listeners: list[Listener]) -> None:
    for one, listener in zip(alone, listeners, strict=True):
        beside = listener.end()
        assert not beside.stopped and beside.tokens == one.tokens
        assert np.array_equal(beside.codes, one.codes)


@pytest.fixture(scope="module")
def tiny_cuda(tiny_omni) -> OmniChat:
    return OmniChat.from_pretrained(str(tiny_omni), device="cuda", rows=4, vocoder_lanes=2)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_tiny_graphed_batched_thinker_is_batch_invariant(tiny_cuda, greedy):
    check_equal_alone(tiny_cuda, *(requests(4, greedy, 20, 30) for _ in range(3)))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < REAL_SIZE_GIB * 2**30,
                    reason="the real-size model needs an 80 GB card")
def test_real_size_batched_thinker_is_batch_invariant():
    from benchmarks.omni import random_omni

    with tempfile.TemporaryDirectory() as tmp:
        chat, _ = random_omni(Path(tmp), torch.bfloat16, rows=8, compiled=False)
        for greedy in (True, False):
            check_equal_alone(chat, *(requests(8, greedy, 24, 40) for _ in range(3)))
