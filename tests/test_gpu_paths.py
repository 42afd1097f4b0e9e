"""On a CUDA GPU (skipped elsewhere): the fused kernels' configuration of each other architecture
(`KernelConfig.for_architecture`: its tiles, no overlapped launches below sm_90, the talker
attention's split) run on this GPU, wherever it has what that configuration uses (an H100 runs every
one): the default path's greedy codes for 200 frames, and the same audio for the same seed twice.
Random weights at the real 0.6B and 1.7B sizes, bf16, CUDA graphs, as served."""
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.kernels.config import KernelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ARCHITECTURES = {"sm_80": (8, 0), "sm_86": (8, 6), "sm_89": (8, 9), "sm_120": (12, 0)}
FRAMES = 200


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def engine(workdir: Path, size: str, kernels: KernelConfig | None = None):
    """A warm 2-row engine of the random custom-voice model of `size` on `kernels` (None: the GPU's own)."""
    from pipeline.bench import random_tts

    tts = random_tts(size, "custom_voice", "cuda", torch.bfloat16, workdir, rows=2, kernels=kernels)
    tts.warm_up()
    return tts


def request(seed: int, greedy: bool):
    from pipeline.bench import request as bench_request

    return bench_request(FRAMES, seed=seed, greedy=greedy)


@pytest.fixture(scope="module")
def default_codes(workdir) -> dict:
    """Each size's greedy codes on the GPU's own configuration."""
    found = {}
    for size in ("0.6B", "1.7B"):
        tts = engine(workdir, size)
        found[size] = tts.synthesize(request(7, greedy=True)).codes
        del tts
        torch.cuda.empty_cache()
    return found


@pytest.mark.parametrize("size", ["0.6B", "1.7B"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_another_architectures_kernels_give_the_default_greedy_codes_and_the_same_audio_twice(workdir, default_codes, size, arch):
    config = KernelConfig.for_architecture(ARCHITECTURES[arch])
    if not config.runs_on(torch.cuda.get_device_capability()):
        pytest.skip(f"this GPU lacks what {arch}'s configuration uses (shared memory or overlapped launches)")
    tts = engine(workdir, size, config)
    assert tts.engine.decoder.kernels == config and tts.engine.decoder.frame_kernels
    greedy = tts.synthesize(request(7, greedy=True))
    assert len(greedy.codes) == len(default_codes[size]) > 0
    np.testing.assert_array_equal(greedy.codes, default_codes[size])
    first, second = (tts.synthesize(request(1234, greedy=False)) for _ in range(2))
    np.testing.assert_array_equal(second.codes, first.codes)
    np.testing.assert_array_equal(second.audio, first.audio)
    del tts
    torch.cuda.empty_cache()


def test_a_configuration_the_gpu_cannot_run_is_refused_in_one_sentence(workdir):
    """An A100's tiles (163 KB of shared memory a block) on a GPU of 99 KB, or Hopper's overlapped
    launches below sm_90: the engine says so when it is built, before any kernel launches."""
    capability = torch.cuda.get_device_capability()
    foreign = next((KernelConfig.for_architecture(c) for c in ((9, 0), (8, 0)) if not KernelConfig.for_architecture(c).runs_on(capability)), None)
    if foreign is None:
        pytest.skip("this GPU runs every architecture's configuration")
    with pytest.raises(ValueError, match="does not run on this GPU"):
        engine(workdir, "0.6B", foreign)
