"""On a CUDA GPU (skipped elsewhere): an engine of 64 rows, the most a TTS model gets from the memory plan,
keeps a row's codes and audio independent of its neighbours. The same request and seed, greedy and sampled,
give the same codes and bit-identical audio alone (a frame over a block of one row) and among 63 other
requests (every row occupied: frames over all 64; steady chunks vocoded in calls shared with other rows),
in the first row and in the last, while neighbours of other lengths leave. Random weights at the real 0.6B size, bf16, compiled and captured as served."""
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROWS = 64
FRAMES = 120


@pytest.fixture(scope="module")
def wide():
    from benchmarks.speed import random_tts

    with tempfile.TemporaryDirectory() as tmp:
        tts = random_tts("0.6B", "custom_voice", "cuda", torch.bfloat16, Path(tmp), rows=ROWS, compiled=True, max_queue=2 * ROWS)
        tts.warm_up()
        yield tts


def request(seed: int, frames: int = FRAMES, **fields):
    from benchmarks.speed import request as bench_request

    return bench_request(frames, seed=seed, **fields)


def neighbours(tts, count: int, first_seed: int, shortest: int = FRAMES // 2) -> list:
    """`count` requests of other seeds and lengths from `shortest` frames up (shorter than the target: they leave while it runs)."""
    return [tts.submit(request(first_seed + i, shortest + 7 * i, greedy=i % 3 == 0)) for i in range(count)]


def heard(handle, tts) -> tuple[np.ndarray, bool]:
    """The handle's audio, and whether every row of the engine was occupied when its first chunk arrived."""
    chunks = iter(handle)
    first = next(chunks)
    full = all(tts.engine.decoder.occupied)
    return np.concatenate([first.audio, *(c.audio for c in chunks)]), full


def test_the_engine_runs_frames_over_row_blocks_up_to_64(wide):
    assert wide.rows == ROWS
    assert wide.engine.decoder.block_sizes == [1, 2, 4, 8, 16, 32, 64]
    assert wide.engine.vocoder.batch_lanes == 2 and wide.engine.vocoder.slots == 4  # steady chunks share batched calls


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_a_row_gives_the_same_codes_and_audio_alone_and_among_63_others(wide, greedy):
    alone = wide.synthesize(request(1234, greedy=greedy))
    assert alone.codes.shape == (FRAMES, 16)
    # In the last row: 63 neighbours admitted before it (the engine fills the lowest free row first), each
    # longer than it, so that all 64 rows are busy when it speaks.
    before = neighbours(wide, ROWS - 1, 1, shortest=2 * FRAMES)
    target = wide.submit(request(1234, greedy=greedy))
    audio, full = heard(target, wide)
    assert full
    np.testing.assert_array_equal(target.codes.numpy(), alone.codes)
    np.testing.assert_array_equal(audio, alone.audio)
    for handle in before:
        list(handle)
    # In the first row: 63 neighbours admitted after it.
    target = wide.submit(request(1234, greedy=greedy))
    after = neighbours(wide, ROWS - 1, 100)
    audio, _ = heard(target, wide)
    np.testing.assert_array_equal(target.codes.numpy(), alone.codes)
    np.testing.assert_array_equal(audio, alone.audio)
    for handle in after:
        list(handle)


def test_every_one_of_64_requests_gets_the_codes_it_gets_alone(wide):
    """All rows at once, each request against itself alone: no row's numbers depend on which row it has."""
    requests = [request(500 + i, FRAMES // 4, greedy=i % 2 == 0) for i in range(ROWS)]
    handles = [wide.submit(r) for r in requests]
    together = []
    for handle in handles:
        list(handle)
        together.append(handle.codes.numpy())
    for i in range(0, ROWS, 9):  # a spread of rows, each checked alone
        np.testing.assert_array_equal(together[i], wide.synthesize(requests[i]).codes, err_msg=f"request {i}")
