"""On a CUDA GPU (skipped elsewhere): once an engine is ready (built and warmed up as the app does),
nothing compiles any more. The first listeners after a start would otherwise wait for the compiler:
a burst of 16 requests, each on a row of its own, finds every Triton kernel variant and every
torch.compile graph it runs already built. Random weights at the real 0.6B size, bf16, as served."""
import json
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROWS = 16


def compiled_variants() -> dict[str, int]:
    """Each of the engine's Triton kernels: how many compiled variants (specializations) it holds."""
    from triton.runtime.jit import JITFunction

    from pipeline.codec import convolution, snake
    from pipeline.kernels import decode, sampling

    return {f"{module.__name__}.{name}": sum(len(entry[0]) for entry in kernel.device_caches.values())
            for module in (decode, sampling, convolution, snake) for name, kernel in vars(module).items() if isinstance(kernel, JITFunction)}


def torch_compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_a_burst_of_listeners_after_ready_compiles_nothing():
    from benchmarks.speed import random_tts, request

    with tempfile.TemporaryDirectory() as workdir:
        tts = random_tts("0.6B", "custom_voice", "cuda", torch.bfloat16, Path(workdir), rows=ROWS, compiled=True)
        tts.warm_up()
        kernels, graphs = compiled_variants(), torch_compiled_graphs()
        assert sum(kernels.values()) > 0
        done = []

        def listen(seed: int) -> None:
            done.append(sum(chunk.frames for chunk in tts.submit(request(12, seed=seed))))

        listeners = [threading.Thread(target=listen, args=(seed,)) for seed in range(ROWS)]
        for listener in listeners:
            listener.start()
        for listener in listeners:
            listener.join()
        assert done == [12] * ROWS
        assert compiled_variants() == kernels
        assert torch_compiled_graphs() == graphs


FIRST_CAPTURE = """
import json, tempfile, torch
from pathlib import Path
from benchmarks.speed import random_tts
from tests.test_gpu_start import compiled_variants
seen = []
with tempfile.TemporaryDirectory() as workdir:
    random_tts("0.6B", "custom_voice", "cuda", torch.bfloat16, Path(workdir), rows=4, compiled=True,
               progress=lambda done, total: seen.append(compiled_variants()))
print(json.dumps({"first": seen[0], "last": seen[-1], "captures": len(seen)}))
"""


def test_every_kernel_compiles_before_the_first_capture():
    """In a fresh process, the pass ahead of the captures (pipeline.ahead) compiles every kernel
    variant the engine's graphs launch: the first capture ends with all of them, and the other
    captures (every row block, prefill bucket and vocoder call) add none."""
    done = subprocess.run([sys.executable, "-c", FIRST_CAPTURE], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1])
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["captures"] > 10
    assert sum(found["first"].values()) > 20
    assert found["first"] == found["last"]
