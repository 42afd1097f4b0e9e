"""On a CUDA GPU (skipped elsewhere): the paths that other GPUs take, each run on this GPU.

- The fused kernels' configuration of each other architecture (`KernelConfig.for_architecture`: its
  tiles, no overlapped launches below sm_90, the talker attention's split), wherever this GPU has
  what that configuration uses (an H100 runs every one): the default path's greedy codes for 200
  frames, and the same audio for the same seed twice.
- The PyTorch-module step (fused=False: what GPUs below compute capability 8.0 run), compiled:
  the fused step's greedy codes for 200 frames in float32, and the same audio for the same seed
  twice in bfloat16.
- float16 (what GPUs without bfloat16 run), in the fused kernels and in the module step: the same
  audio for the same seed twice, and the fused step as close to float32 as the module step.

In bfloat16 and float16 two paths of other kernels cannot give the same codes on random weights:
their sums run in another order, and on near-flat logits a last-bit difference changes a code
within a few frames (docs/BENCHMARKS.md, "Numerics": the compiled module step against its own
eager run parts as soon as the fused one does). float32 compares the paths' arithmetic; in the
narrow dtypes the step is compared against float32, and each path against itself.

Random weights at the real 0.6B and 1.7B sizes, CUDA graphs, as served."""
import copy
import gc
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.engine.scheduler import LOOP_FRAMES
from pipeline.kernels.config import KernelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ARCHITECTURES = {"sm_80": (8, 0), "sm_86": (8, 6), "sm_89": (8, 9), "sm_120": (12, 0)}
FRAMES = 200


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def engine(workdir: Path, size: str, kernels: KernelConfig | None = None, dtype: torch.dtype = torch.bfloat16, fused: bool | None = None,
           compiled: bool = False):
    """A warm 2-row engine of the random custom-voice model of `size` in `dtype` on `kernels` (None:
    the GPU's own); `fused`: None where the GPU runs the fused kernels, False the modules' step."""
    from benchmarks.speed import random_tts

    tts = random_tts(size, "custom_voice", "cuda", dtype, workdir, rows=2, kernels=kernels, fused=fused, compiled=compiled)
    tts.warm_up()
    return tts


def request(seed: int, greedy: bool):
    from benchmarks.speed import request as bench_request

    return bench_request(FRAMES, seed=seed, greedy=greedy)


def greedy_codes(tts) -> np.ndarray:
    """Up to FRAMES greedy frames. Greedy decoding of random weights can fall into a loop of codes, which
    the runaway guard stops after LOOP_FRAMES frames of the pattern: two paths that agree stop at the
    same frame, so the comparisons hold the lengths equal too."""
    codes = tts.synthesize(request(7, greedy=True)).codes
    assert LOOP_FRAMES <= len(codes) <= FRAMES
    return codes


def assert_the_same_audio_twice(tts) -> None:
    first, second = (tts.synthesize(request(1234, greedy=False)) for _ in range(2))
    assert len(first.codes) == FRAMES
    np.testing.assert_array_equal(second.codes, first.codes)
    np.testing.assert_array_equal(second.audio, first.audio)


def release(tts) -> None:
    """Stop `tts`'s engine threads, which hold it (and its graphs' memory) while they run."""
    tts.engine.shutdown()


@pytest.fixture(autouse=True)
def free_gpu_memory():
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def default_codes(workdir) -> dict:
    """Each size's greedy codes on the GPU's own configuration."""
    found = {}
    for size in ("0.6B", "1.7B"):
        tts = engine(workdir, size)
        found[size] = greedy_codes(tts)
        release(tts)
    return found


@pytest.mark.parametrize("size", ["0.6B", "1.7B"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_another_architectures_kernels_give_the_default_greedy_codes_and_the_same_audio_twice(workdir, default_codes, size, arch):
    config = KernelConfig.for_architecture(ARCHITECTURES[arch])
    if not config.runs_on(torch.cuda.get_device_capability()):
        pytest.skip(f"this GPU lacks what {arch}'s configuration uses (shared memory or overlapped launches)")
    tts = engine(workdir, size, config)
    assert tts.engine.decoder.kernels == config and tts.engine.decoder.frame_kernels
    np.testing.assert_array_equal(greedy_codes(tts), default_codes[size])
    assert_the_same_audio_twice(tts)
    release(tts)


def test_a_configuration_the_gpu_cannot_run_is_refused_in_one_sentence(workdir):
    """An A100's tiles (163 KB of shared memory a block) on a GPU of 99 KB, or Hopper's overlapped
    launches below sm_90: the engine says so when it is built, before any kernel launches."""
    capability = torch.cuda.get_device_capability()
    foreign = next((KernelConfig.for_architecture(c) for c in ((9, 0), (8, 0)) if not KernelConfig.for_architecture(c).runs_on(capability)), None)
    if foreign is None:
        pytest.skip("this GPU runs every architecture's configuration")
    with pytest.raises(ValueError, match="does not run on this GPU"):
        engine(workdir, "0.6B", foreign)


def test_the_module_step_gives_the_fused_steps_greedy_codes_in_float32(workdir):
    """The path of GPUs below compute capability 8.0, chosen by configuration (fused=False): the
    modules' decode step, compiled, in CUDA graphs; float32, where both paths compute to float rounding."""
    fused = engine(workdir, "0.6B", dtype=torch.float32, compiled=True)
    assert fused.engine.decoder.fused and fused.engine.decoder.frame_kernels
    expected = greedy_codes(fused)
    release(fused)
    module = engine(workdir, "0.6B", dtype=torch.float32, fused=False, compiled=True)
    decoder = module.engine.decoder
    assert not decoder.fused and not decoder.frame_kernels and decoder.use_cuda_graphs
    np.testing.assert_array_equal(greedy_codes(module), expected)
    release(module)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_module_step_gives_the_same_audio_twice(workdir, dtype):
    """Compiled, in CUDA graphs, as the app serves it below compute capability 8.0 (float16 there)."""
    tts = engine(workdir, "0.6B", dtype=dtype, fused=False, compiled=True)
    assert not tts.engine.decoder.fused and tts.engine.decoder.use_cuda_graphs and tts.dtype == dtype
    assert_the_same_audio_twice(tts)
    release(tts)


def test_float16_in_the_fused_kernels_gives_the_same_audio_twice(workdir):
    tts = engine(workdir, "0.6B", dtype=torch.float16)
    assert tts.engine.decoder.fused and tts.engine.decoder.frame_kernels and tts.dtype == torch.float16
    assert_the_same_audio_twice(tts)
    release(tts)


@pytest.mark.parametrize("size", ["0.6B", "1.7B"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@torch.inference_mode()
def test_the_fused_step_is_as_close_to_float32_as_the_module_step(size, dtype):
    """The talker's 28 layers at the real size (random weights, as the benchmark draws them) over
    its 2,048-position cache, 4 rows at positions 0 to 1,500 (the attention's short and chunked
    contexts), 3 steps: in `dtype`, the fused step's distance from the same weights' float32 step is
    at most twice the module step's. A weight missed, a partial sum dropped or a value rounded
    twice would put it at the size of the values."""
    from pipeline.kernels import fused_decode
    from pipeline.model import Transformer
    from pipeline.released import SIZES

    torch.manual_seed(0)
    hidden = SIZES[size]["hidden_size"]
    module = Transformer(hidden, SIZES[size]["intermediate_size"], 28, 16, 8, 128, 1e-6, 1e6).to("cuda", dtype).eval()
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02)
    fused, exact = copy.deepcopy(module), copy.deepcopy(module).float()
    for model in (module, fused, exact):
        model.setup_caches(4, 2048)
    config = KernelConfig.for_device(torch.device("cuda"))
    positions = torch.tensor([[0], [7], [300], [1500]], device="cuda")
    for _ in range(3):
        x = torch.randn(4, 1, hidden, device="cuda").to(dtype)
        reference = exact.decode(x.float(), positions)
        distance = {name: float((out.float() - reference).norm() / reference.norm())
                    for name, out in (("module", module.decode(x, positions)), ("fused", fused_decode(fused, x, positions, config)))}
        assert 0 < distance["fused"] <= 2 * distance["module"], distance
        positions = positions + 1
