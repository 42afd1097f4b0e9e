import atexit
import importlib.util
import os
import platform
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

if platform.machine() in ("x86_64", "AMD64"):
    # Triton's interpreter (below) computes a kernel's tl.dot with numpy, whose OpenBLAS picks its
    # float32 GEMM kernel by the CPU. With those for AVX2 (Haswell; Zen, seen on an AMD EPYC) a row's
    # product takes other bits depending on the rows beside it in the tile, so the CPU tests of the
    # kernels' batch invariance passed or failed by the machine. With the Sandy Bridge kernel (AVX, on
    # every x86-64 CI machine) they pass. Set before numpy loads OpenBLAS; a value set outside is kept.
    os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

import numpy as np  # noqa: E402 - after OPENBLAS_CORETYPE
import pytest
import soundfile as sf
import torch

# One CPU thread per PyTorch op, here and in every process the tests start (OMP_NUM_THREADS is
# inherited): the tiny models' ops last microseconds, and a second OpenMP thread per op costs more in
# waiting than it saves. On a 2-core machine shared with other work, writing a tiny checkpoint took
# 6.6 CPU-s with two threads against 0.8 with one, and the official code's 48 frames 10 s against 3.
# A value set outside is kept.
torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))

if "GRADIO_TEMP_DIR" not in os.environ:
    # Gradio's file cache (uploads, outputs) in a folder of this process's own, which the apps it starts
    # inherit: an app that closes deletes the cached files it created, and with a shared cache a test
    # process beside this one (pytest -n 2) that caches the same content (the same reference recording,
    # the same seeded audio) would lose them mid-test. A value set outside is kept.
    os.environ["GRADIO_TEMP_DIR"] = tempfile.mkdtemp(prefix="gradio-tests-")
    atexit.register(shutil.rmtree, os.environ["GRADIO_TEMP_DIR"], True)

if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    # The fused decode kernels (pipeline/kernels) run in Triton's interpreter on a machine without a GPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("torchaudio") is None:
    # Import-only placeholder for the reference package; see tests/reference_shims/torchaudio/__init__.py.
    sys.path.append(str(Path(__file__).parent / "reference_shims"))


@pytest.fixture(autouse=True)
def rope_registry_left_as_found():
    """The official qwen_tts, imported in-process by the speaker-encoder and audio parity tests, registers
    a "default" RoPE initializer reading `config.rope_theta`, which transformers' own Qwen3-Omni then
    calls (and fails on: its config keeps RoPE in rope_parameters); every test leaves the registry as it
    found it, and lets qwen_tts register it again when it next needs it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    before = dict(ROPE_INIT_FUNCTIONS)
    yield
    ROPE_INIT_FUNCTIONS.clear()
    ROPE_INIT_FUNCTIONS.update(before)
    compat = sys.modules.get("qwen_tts._transformers_compat")
    if compat is not None:
        compat._PATCHED = False


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Tiny random checkpoints in the official layout, one per model type, written once per session."""
    from pipeline.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {kind: write_tiny_checkpoint(root / kind, kind, seed=0) for kind in ("base", "custom_voice", "voice_design")}


@pytest.fixture(scope="session")
def official_runner():
    """The official qwen_tts code in a process of its own, on the transformers it needs (tests/reference_runner.py)."""
    from reference_runner import Reference

    runner = Reference()
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def tiny_omni(tmp_path_factory) -> Path:
    """A tiny random Qwen3-Omni checkpoint in the official layout, written once per session."""
    from pipeline.tiny import write_tiny_omni_checkpoint

    return write_tiny_omni_checkpoint(tmp_path_factory.mktemp("tiny") / "omni", seed=0)


def voice_like(seconds: float, sample_rate: int = 24000, seed: int = 0) -> np.ndarray:
    """A deterministic voice-like test signal: a gliding harmonic series with noise and syllable-rate envelope."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    wave = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    return (0.2 * envelope * wave + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


@pytest.fixture(scope="session")
def reference_wav(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("audio") / "reference.wav"
    sf.write(path, voice_like(3.2), 24000, subtype="FLOAT")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def live_app(tiny_checkpoints, tmp_path_factory):
    """The app on a free localhost port, serving the tiny checkpoints with every model loaded: (url, service, listening sessions)."""
    from pipeline.listening import Sessions
    from pipeline.service import ModelService
    from ui.app import build_demo, launch_options

    service = ModelService(tiny=True, tiny_dir=Path(tiny_checkpoints["base"]).parent)
    service.preload()  # loading is tested elsewhere; here every request should find its model ready
    sessions = Sessions(tmp_path_factory.mktemp("listening"), service)
    demo = build_demo(service, sessions)
    demo.queue(default_concurrency_limit=None)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **launch_options(service))
    yield f"http://127.0.0.1:{port}/", service, sessions
    demo.close()


def read_pcm(url: str, run_id: str, out: list, opened: threading.Event) -> None:
    """The browser's side of the audio path: the run's PCM stream asked for (`opened` is set once the
    request is sent: as the page's, it reaches the server before its run starts, and is answered when
    the run starts), then its frames as they arrive."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request("GET", f"{parts.path}pcm/{run_id}")
        opened.set()
        response = connection.getresponse()
        buffer = b""
        while data := response.read1(1 << 16):
            buffer += data
            while len(buffer) >= 4 and len(buffer) >= 4 + struct.unpack("<I", buffer[:4])[0]:
                length = struct.unpack("<I", buffer[:4])[0]
                out.append((time.perf_counter(), buffer[4 : 4 + length]))
                buffer = buffer[4 + length :]
    finally:
        connection.close()


@contextmanager
def serving(app):
    """`app` (ASGI) on a real server on a free localhost port, in a thread of this process: its URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started and thread.is_alive():  # hang guard: the thread ends if the server cannot start
        time.sleep(0.02)
    assert server.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(30)


def tables(outputs: list) -> list[list]:
    """The latency tables among a gradio_client job's outputs."""
    return [o[1]["data"] for o in outputs if isinstance(o[1], dict) and o[1].get("data")]


@pytest.fixture(scope="module")
def app_url(live_app):
    return live_app[0]


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium, one per test module (see tests/browser.py)."""
    from browser import CHROMIUM, CHROMIUM_ARGS, browser_missing

    assert browser_missing() is None, browser_missing()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture()
def page(browser, app_url):
    """The app's page on a desktop-sized window, opened and ready."""
    from browser import HANG_GUARD_MS

    page = browser.new_page(viewport={"width": 1400, "height": 1500})
    page.set_default_timeout(HANG_GUARD_MS)
    page.set_default_navigation_timeout(HANG_GUARD_MS)
    page.goto(app_url)
    page.wait_for_selector("#clone-generate")
    yield page
    page.close()
