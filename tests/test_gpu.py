"""On a CUDA GPU (skipped elsewhere): the CUDA-graph engine gives the eager engine's codes, the same
seed gives the same audio run after run, alone and among other requests, and streamed audio
equals offline decoding. Random weights at the real 0.6B size, bf16, as served."""
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FRAMES = 120


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def engine(workdir, graphs: bool, dtype=torch.bfloat16, kernels=None):
    from benchmarks.speed import random_tts

    tts = random_tts("0.6B", "custom_voice", "cuda", dtype, workdir, rows=8, use_cuda_graphs=graphs, kernels=kernels)
    if graphs:
        tts.warm_up()
    return tts


@pytest.fixture(scope="module")
def graphed(workdir):
    return engine(workdir, graphs=True)


def request(seed: int, frames: int = FRAMES, **fields):
    from benchmarks.speed import request as bench_request

    return bench_request(frames, seed=seed, **fields)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_equals_eager_codes(workdir, dtype):
    results = []
    for graphs in (False, True):
        tts = engine(workdir, graphs, dtype)
        results.append([tts.synthesize(request(7, 60, greedy=greedy)).codes for greedy in (True, False)])
        del tts
    for eager, graphed in zip(*results):
        np.testing.assert_array_equal(graphed, eager)


def test_same_seed_same_audio_alone_and_in_a_batch_of_8(graphed):
    alone = [graphed.synthesize(request(1234)) for _ in range(3)]
    for again in alone[1:]:
        np.testing.assert_array_equal(again.codes, alone[0].codes)
        np.testing.assert_array_equal(again.audio, alone[0].audio)
    for shift in (0.05, 0.3):  # different neighbours, joining at other frames
        neighbours = [graphed.submit(request(i, FRAMES + 30 * i)) for i in range(1, 4)]
        time.sleep(shift)
        target = graphed.submit(request(1234))
        neighbours += [graphed.submit(request(i + 10, FRAMES + 20 * i)) for i in range(4)]
        audio = np.concatenate([c.audio for c in target])
        np.testing.assert_array_equal(target.codes.numpy(), alone[0].codes)
        np.testing.assert_array_equal(audio, alone[0].audio)
        for h in neighbours:
            list(h)


def test_row_blocks_give_the_audio_of_all_rows_alone_and_as_neighbours_come_and_go(workdir, graphed):
    """Row blocks (the default: each frame over the first rows that hold every occupied one, a graph
    per block): the codes and audio of the engine that runs all 8 rows every frame, alone (a block
    of 1) and while three neighbours join and leave (the block grows to 4 and shrinks back under
    the request)."""
    import dataclasses

    from pipeline.kernels.config import KernelConfig

    assert graphed.engine.decoder.block_sizes == [1, 2, 4, 8]
    every_row = dataclasses.replace(KernelConfig.for_device(torch.device("cuda")), row_blocks=False)
    expected = engine(workdir, graphs=True, kernels=every_row).synthesize(request(1234))
    alone = graphed.synthesize(request(1234))
    np.testing.assert_array_equal(alone.codes, expected.codes)
    np.testing.assert_array_equal(alone.audio, expected.audio)
    target = graphed.submit(request(1234))
    neighbours = [graphed.submit(request(i, 20 * i)) for i in range(1, 4)]
    audio = np.concatenate([c.audio for c in target])
    np.testing.assert_array_equal(target.codes.numpy(), expected.codes)
    np.testing.assert_array_equal(audio, expected.audio)
    for h in neighbours:
        list(h)


def test_a_waiting_requests_parts_made_on_other_streams_join_once_ready(graphed):
    """A caller may make a request's parts on different streams (Omni's talker prompt on the thinker's
    hand-off stream, its last position and its text on the conversation's): parts given while the
    request waits for a row join the earlier ones after those are written, and it speaks as when its
    last position comes after its row's prefill."""
    import dataclasses

    engine = graphed.engine
    job, _ = graphed.prepare(request(77, 60))
    segment = job.segments[0]
    prefix, rest = segment.prompt[:, :-1], segment.prompt[:, -1:]
    held = dataclasses.replace(segment, prompt=prefix, trailing=segment.trailing[:0], text_end=False, awaits=1)
    with torch.inference_mode():
        expected = engine.submit(dataclasses.replace(job, segments=[held]))
        deadline = time.monotonic() + 60
        while engine.scheduler.row_of(expected) is None and time.monotonic() < deadline:
            time.sleep(0.001)
        assert engine.scheduler.row_of(expected) is not None  # its last position comes after its row's prefill
        expected.finish_prompt(rest)
        expected.append_text(segment.trailing, True)
        expected_audio = np.concatenate([c.audio for c in expected])
    busy = [graphed.submit(request(i)) for i in range(engine.decoder.rows)]  # the next request waits for a row
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # the prefix is written ~0.1 s of GPU time later
        late = dataclasses.replace(held, prompt=prefix.clone(), trailing=segment.trailing[:0].clone())
        handle = engine.submit(dataclasses.replace(job, segments=[late]))
    assert engine.scheduler.waiting_request(handle) is not None
    with torch.inference_mode():
        handle.finish_prompt(rest.clone())
        handle.append_text(segment.trailing.clone(), True)
    for other in busy:
        other.close()
    audio = np.concatenate([c.audio for c in handle])
    np.testing.assert_array_equal(handle.codes.numpy(), expected.codes.numpy())
    np.testing.assert_array_equal(audio, expected_audio)


def test_streamed_equals_offline(graphed):
    result = graphed.synthesize(request(5))
    offline = graphed.decode(torch.from_numpy(result.codes).cuda())
    assert np.abs(result.audio - offline).max() < 1e-4


def test_fused_snake_beta_equals_the_formula():
    from pipeline.codec.snake import snake_beta

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 96, 5000, device="cuda", generator=g) * 30  # sin of large arguments too
    alpha_exp = torch.randn(96, 1, device="cuda", generator=g).exp()
    inv_beta = 1.0 / (torch.randn(96, 1, device="cuda", generator=g).exp() + 1e-9)
    expected = x + inv_beta * torch.sin(x * alpha_exp).pow(2)
    strided = torch.randn(2, 5000, 96, device="cuda", generator=g).transpose(1, 2)  # not contiguous
    for inputs, reference in ((x, expected), (strided, strided + inv_beta * torch.sin(strided * alpha_exp).pow(2))):
        torch.testing.assert_close(snake_beta(inputs, alpha_exp, inv_beta), reference, rtol=1e-6, atol=1e-5)


def test_admission_never_waits_for_the_gpu(graphed):
    """Starting, feeding and stopping a row launches work and returns: a host-device sync there would
    hold the engine's loop until the frames in flight are done."""
    decoder = graphed.engine.decoder
    job, _ = graphed.prepare(request(1))
    segment = job.segments[0]
    row = decoder.rows - 1
    with torch.inference_mode():
        torch.cuda.set_sync_debug_mode("error")
        try:
            decoder.start(row, segment.prompt, segment.trailing, False, job.sampling, 3, 50)
            decoder.append_text(row, segment.trailing, True)
            decoder.stop(row)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(scope="module")
def omni_cuda(tiny_omni):
    from pipeline.omni import OmniChat

    return OmniChat.from_pretrained(str(tiny_omni), device="cuda", vocoder_lanes=3)


def test_omni_reply_is_reproducible_and_streamed_equals_offline(omni_cuda, tiny_omni):
    """Qwen3-Omni on CUDA graphs (fp32 tiny checkpoint): the same seed gives the same reply, codes
    and audio; the streamed code2wav (first call holding back its look-ahead) equals one offline decode."""
    from pipeline.omni import ChatRequest, Code2Wav, Turn, decode

    request = ChatRequest([Turn("user", "Hello there, how are you?")], max_new_tokens=20, max_frames=45, seed=5)
    first, second = omni_cuda.reply(request), omni_cuda.reply(request)
    assert first.tokens == second.tokens and np.array_equal(first.codes, second.codes) and np.array_equal(first.audio, second.audio)
    assert len(first.codes) == 45
    offline = decode(Code2Wav.from_pretrained(tiny_omni, "cpu"), torch.from_numpy(first.codes)).numpy()
    assert first.audio.shape == offline.shape and np.abs(first.audio - offline).max() <= 1e-4


def test_omni_graphed_thinker_and_talker_equal_eager(omni_cuda, tiny_omni):
    """The thinker's one-token step replayed as a CUDA graph over its slot's static cache (and the
    talker's graphs) give the eager run's reply and codes, greedy and sampled."""
    from pipeline.omni import ChatRequest, OmniChat, Turn

    eager = OmniChat.from_pretrained(str(tiny_omni), device="cuda", use_cuda_graphs=False)
    for greedy in (True, False):
        request = ChatRequest([Turn("user", "Tell me a short story about a lighthouse.")], greedy=greedy, max_new_tokens=30, max_frames=30, seed=11)
        graphed, plain = omni_cuda.reply(request), eager.reply(request)
        assert graphed.tokens == plain.tokens
        np.testing.assert_array_equal(graphed.codes, plain.codes)
