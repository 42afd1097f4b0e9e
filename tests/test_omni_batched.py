"""Qwen3-Omni's batched thinker on the tiny checkpoint (CPU): conversations started at staggered
times, each in its own row of one decode step, give exactly the reply tokens and talker codes each
gives alone (greedy and seeded); prompts that arrive together share a pack, cut wherever the pack
ends, and still give each alone's reply; the running conversations get a step after every pack;
the pack's and the step's CUDA kernels compute what transformers' kernels compute."""
import dataclasses
import threading

import numpy as np
import pytest
import torch

from pipeline.omni import ChatEnd, ChatRequest, OmniChat, TextDelta, Turn
from pipeline.omni.conversation import ThinkerInputs
from pipeline.omni.thinker import Thinker, ThinkerReply, ThinkerSampling

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


def test_prompts_arriving_together_share_a_pack_between_steps_of_the_running_ones(chat, monkeypatch):
    """Two conversations that arrive while one runs: their prompts fill the next packs in arrival order (the
    second starting in the first's pack where it has room), and every pack is followed by a step of the
    running ones, the long reply included."""
    thinker = chat.thinker
    calls: list[tuple[str, list, frozenset]] = []
    pack_through, step = thinker._pack_through, thinker._step

    def logged_pack(packed):
        calls.append(("pack", [(reply.row, first, count, reply.length) for reply, first, count in packed], frozenset(thinker.running)))
        return pack_through(packed)

    def logged_step():
        calls.append(("step", [], frozenset(thinker.running)))
        return step()

    monkeypatch.setattr(thinker, "_pack_through", logged_pack)
    monkeypatch.setattr(thinker, "_step", logged_step)
    long = Listener(chat, ChatRequest([Turn("user", MESSAGES[0])], greedy=True, max_new_tokens=1024, speak=False))
    assert long.has_tokens.wait(HANG_GUARD_S)
    long_row = next(iter(thinker.running))
    with thinker.lock:  # the scheduler waits: both arrive before its next pack
        joining = [Listener(chat, ChatRequest([Turn("user", text)], greedy=True, max_new_tokens=6, speak=False)) for text in MESSAGES[1:]]
        with thinker.changed:
            assert thinker.changed.wait_for(lambda: len(thinker.waiting) == 2, HANG_GUARD_S)
        packs_before = sum(kind == "pack" for kind, _, _ in calls)
    replies = [listener.end() for listener in joining]
    long.stream.close()
    assert long.end().stopped and all(len(reply.tokens) == 6 for reply in replies)
    packs = [i for i, (kind, _, _) in enumerate(calls) if kind == "pack"][packs_before:]
    positions = [(row, first, count, length) for i in packs for row, first, count, length in calls[i][1]]
    (first_row, _, _, first_length), (second_row, _, _, second_length) = positions[0], positions[-1]
    assert len(positions) == len(packs) + 1 and first_row != second_row  # exactly one pack holds both prompts
    rows = [row for row, *_ in positions]
    assert rows == sorted(rows, key=[first_row, second_row].index)  # arrival order
    done = {first_row: 0, second_row: 0}
    for row, first, count, _ in positions:  # each prompt's positions in order, none twice
        assert first == done[row]
        done[row] += count
    assert done == {first_row: first_length, second_row: second_length}
    for i in packs:
        assert sum(count for _, _, count, _ in calls[i][1]) == thinker.pack_tokens or i == packs[-1]  # packs are filled
        kind, _, running = calls[i + 1]
        assert kind == "step" and long_row in running and long_row in calls[i][2]  # the long reply goes on after every pack


@pytest.mark.parametrize("lead", [4, 0], ids=["lead-4", "no-lead"])
def test_a_prompt_arriving_beside_a_young_reply_waits_for_its_lead_tokens(tiny_omni, lead):
    """The scheduler's turns driven on this thread: a reply with `lead` lead tokens runs alone; a prompt that
    arrives after its first token is packed only once it has written them (a step each), at once without a
    lead; its reply is the same either way."""
    thinker = Thinker.from_pretrained(tiny_omni, torch.device("cpu"), torch.float32, 1, rows=2, max_len=96)
    g = torch.Generator().manual_seed(5)
    first = dataclasses.replace(_reply(thinker, torch.randint(0, thinker.vocab, (1, 9), generator=g), 1, tokens=12), lead_tokens=lead)
    second = _reply(thinker, torch.randint(0, thinker.vocab, (1, 14), generator=g), 2, tokens=6)
    _prefill_now(thinker, [first])
    assert first.written == 1
    thinker.waiting.append(second)
    turns = 0
    while thinker.waiting or thinker.prefilling:
        thinker._admit()
        assert (second.prefilled == 0) == (first.written < lead)  # its pack runs exactly once the lead is written
        thinker._step_all()
        turns += 1
    assert turns == max(lead, 1) and first.written == max(lead, 1) + 1  # a step after every turn, the pack in the last
    while thinker.running:
        thinker._step_all()
    assert list(second) == list(_reply_alone(thinker, second))


def test_a_spoken_reply_leads_by_the_tokens_of_its_first_two_chunks(chat, monkeypatch):
    """The talker's frame k reads the thinker's token k + 1: a spoken reply's lead is 1 + its first two chunks'
    frames (4 by the default schedule 1, 2, ...; 6 by 2, 3, ...); a reply without speech has none."""
    leads = []
    start = chat.thinker.start

    def recorded(*args):
        leads.append(args[-1])
        return start(*args)

    monkeypatch.setattr(chat.thinker, "start", recorded)
    for request in (ChatRequest([Turn("user", MESSAGES[0])], greedy=True, max_new_tokens=3, max_frames=4),
                    ChatRequest([Turn("user", MESSAGES[0])], greedy=True, max_new_tokens=3, max_frames=4, schedule=(2, 3, 8)),
                    ChatRequest([Turn("user", MESSAGES[0])], greedy=True, max_new_tokens=3, speak=False)):
        chat.reply(request)
    assert leads == [4, 6, 0]


def _reply_alone(thinker, reply: ThinkerReply) -> ThinkerReply:
    """`reply`'s prompt and settings again, written alone."""
    again = _reply(thinker, reply.inputs.input_ids, reply.seed, tokens=reply.max_new_tokens)
    _prefill_now(thinker, [again])
    while thinker.running:
        thinker._step_all()
    return again


def _prefill_now(thinker, replies: list[ThinkerReply]) -> None:
    """The replies' prompts through the thinker on this thread, pack by pack (no scheduler thread)."""
    thinker.waiting.extend(replies)
    while thinker.waiting or thinker.prefilling:
        thinker._admit()


def _reply(thinker, ids: torch.Tensor, seed: int, greedy: bool = True, tokens: int = 8) -> ThinkerReply:
    sampling = ThinkerSampling(do_sample=not greedy)
    return ThinkerReply(ThinkerInputs(ids), thinker._input_embeds(ids, {}), sampling, seed, tokens, -1, threading.Event(), None)


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_prompts_cut_anywhere_by_the_packs_give_each_alones_reply(tiny_omni, greedy):
    """Packs of 16 positions: three prompts of 9, 23 and 30 positions alone (the longer ones cut at 16), then
    together (cut at other places: 16 = 9 + 7, 32 = 16 + 16 ...): the same reply tokens."""
    thinker = Thinker.from_pretrained(tiny_omni, torch.device("cpu"), torch.float32, 1, rows=3, max_len=96, pack_tokens=16)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, thinker.vocab, (1, length), generator=g) for length in (9, 23, 30)]

    def replies_of(group: list[int]) -> list[list[int]]:
        with thinker.lock:  # all of them waiting before the scheduler's first pack
            replies = [thinker.start(ThinkerInputs(prompts[i]), ThinkerSampling(do_sample=not greedy), 11 + i, 12, -1, threading.Event())
                       for i in group]
        return [list(reply) for reply in replies]

    alone = [replies_of([i])[0] for i in range(len(prompts))]
    assert replies_of(list(range(len(prompts)))) == alone and all(len(tokens) == 12 for tokens in alone)
    assert len({tuple(tokens) for tokens in alone}) == 3


def test_the_packs_and_steps_cuda_kernels_compute_what_transformers_kernels_compute(tiny_omni):
    """What the pack and the step run on CUDA (the fixed-tile grouped experts, the row-invariant experts and
    attention, here in Triton's interpreter) against what they run on the CPU (transformers' batched_mm experts,
    SDPA): the same first-token logits for two prompts of different lengths in packs of 32 (the longer over
    more than one block of keys and two packs), then the same step logits, one row idle."""
    from pipeline.omni import thinker as thinker_module

    thinker = Thinker.from_pretrained(tiny_omni, torch.device("cpu"), torch.float32, 1, rows=3, max_len=128, pack_tokens=32)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, thinker.vocab, (1, length), generator=g) for length in (9, 70)]
    outputs: list[torch.Tensor] = []
    hook = thinker.model.lm_head.register_forward_hook(lambda module, args, out: outputs.append(out.reshape(thinker.rows, -1).clone()))
    results = {}
    with torch.inference_mode():
        for kernels in ("cpu", "cuda"):
            if kernels == "cuda":
                for row in list(thinker.running):
                    thinker._finish(row)
                thinker.step_kernels = (thinker_module.ROW_EXPERTS, thinker_module.ROW_ATTENTION)
                thinker.pack_kernels = (thinker_module.PACK_EXPERTS, thinker_module.PACK_ATTENTION)
            outputs.clear()
            _prefill_now(thinker, [_reply(thinker, ids, 0) for ids in prompts])
            thinker._decode()
            assert len(outputs) == 4  # packs of 9 + 23, 32 and 15 positions, then the step
            results[kernels] = (torch.stack([outputs[0][0], outputs[2][1]]), outputs[3][:2])
    hook.remove()
    for ours, expected in zip(results["cuda"], results["cpu"]):
        assert expected.std() > 0.1 and torch.allclose(ours, expected, atol=1e-4, rtol=1e-4), (ours - expected).abs().max()


def test_a_talker_that_refuses_the_reply_ends_it_with_its_sentence_and_frees_the_thinkers_row(tiny_omni, monkeypatch):
    """The talker's queue refuses the speech (built on the thinker's hand-off thread): the reply raises the
    engine's one sentence, the thinker stops writing it at once, and the next conversation is served."""
    from pipeline.errors import EngineBusy

    chat = OmniChat.from_pretrained(str(tiny_omni), rows=1, max_queue=0)
    started: list[ThinkerReply] = []
    start = chat.thinker.start
    monkeypatch.setattr(chat.thinker, "start", lambda *args, **kwargs: started.append(start(*args, **kwargs)) or started[-1])
    with pytest.raises(EngineBusy, match="The server is busy: 0 requests ahead; try again shortly."):
        chat.reply(ChatRequest([Turn("user", MESSAGES[0])], greedy=True, max_new_tokens=1000, max_frames=8))
    list(started[0])  # its reply ends ...
    assert started[0].written < 1000  # ... long before its limit
    text_only = chat.reply(ChatRequest([Turn("user", MESSAGES[1])], greedy=True, max_new_tokens=5, speak=False))
    assert len(text_only.tokens) == 5


def test_a_talker_that_refuses_one_reply_ends_that_one_alone(tiny_omni, monkeypatch):
    """Two prompts in one pack, the talker refusing the first one's speech (its queue full): that reply raises
    the engine's one sentence and the thinker stops writing it; the other, in the same pack, is served in full."""
    from pipeline.errors import EngineBusy

    chat = OmniChat.from_pretrained(str(tiny_omni), rows=2, max_queue=0)
    thinker = chat.thinker
    started: list[ThinkerReply] = []
    start = thinker.start
    monkeypatch.setattr(thinker, "start", lambda *args, **kwargs: started.append(start(*args, **kwargs)) or started[-1])
    refusals: list[EngineBusy] = []

    def speak() -> None:
        try:
            chat.reply(ChatRequest([Turn("user", MESSAGES[0])], greedy=True, max_new_tokens=1000, max_frames=8))
        except EngineBusy as exc:
            refusals.append(exc)

    spoken = threading.Thread(target=speak)
    with thinker.lock:  # both waiting before the scheduler's next pack
        spoken.start()
        with thinker.changed:
            assert thinker.changed.wait_for(lambda: len(thinker.waiting) == 1, HANG_GUARD_S)
        text = Listener(chat, ChatRequest([Turn("user", MESSAGES[1])], greedy=True, max_new_tokens=5, speak=False))
        with thinker.changed:
            assert thinker.changed.wait_for(lambda: len(thinker.waiting) == 2, HANG_GUARD_S)
    spoken.join(HANG_GUARD_S)
    assert [str(exc) for exc in refusals] == ["The server is busy: 0 requests ahead; try again shortly."]
    reply = text.end()
    assert len(reply.tokens) == 5 and not reply.stopped
    list(started[0])  # the refused reply ends long before its limit
    assert started[0].written < 1000 and started[1].written == 5
    assert not thinker.running and not thinker.prefilling
