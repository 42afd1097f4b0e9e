"""examples/llm_to_speech.py, run as a user runs it: against the app (Gradio and its API on one server,
tiny checkpoints) and a minimal OpenAI-compatible chat server standing in for the language model; the
WAV it writes is the speech of the whole reply given at once in the same layout."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import free_port, serving
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from pipeline.engine import Job, Segment
from pipeline.request import SpeechRequest
from pipeline.server import stream_routes
from pipeline.server.common import pcm16
from pipeline.server.stream import PATH
from pipeline.service import ModelService

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llm_to_speech.py"
REPLY = ["Stream", "ing te", "xt, spo", "ken as it", " is writ", "ten."]
FRAMES = 24
HANG_GUARD_S = 300


def chat_stand_in() -> Starlette:
    """The language model's side: the reply's pieces as OpenAI chat completion chunks (Server-Sent Events)."""

    async def completions(request) -> StreamingResponse:
        body = await request.json()
        assert body["stream"] is True and body["messages"][-1]["role"] == "user"

        async def events():
            for piece in REPLY:
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': piece}}]})}\n\n"
                await asyncio.sleep(0.05)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])


@pytest.fixture(scope="module")
def app(tiny_checkpoints, tmp_path_factory):
    """The app on a free port, its WebSocket route included: (url, service)."""
    from pipeline.listening import Sessions
    from ui.app import build_demo, launch_options

    service = ModelService(tiny=True, tiny_dir=Path(tiny_checkpoints["base"]).parent)
    service.preload()
    demo = build_demo(service, Sessions(tmp_path_factory.mktemp("listening"), service.model))
    demo.queue(default_concurrency_limit=None)
    options = launch_options(service)
    routes = options["app_kwargs"]["routes"]
    if not any(getattr(route, "path", None) == PATH for route in routes):
        routes.append(*stream_routes(service))
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **options)
    yield f"http://127.0.0.1:{port}", service
    demo.close()


def test_help_needs_no_server():
    result = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "OpenAI-compatible" in result.stdout and "--tts" in result.stdout


def test_a_streamed_reply_is_spoken_as_the_whole_reply(app, tmp_path):
    url, service = app
    tts = service.model("custom_voice")
    out = tmp_path / "reply.wav"
    with serving(chat_stand_in()) as llm:
        result = subprocess.run([sys.executable, str(EXAMPLE), "Say something.", "--llm", llm, "--tts", url, "--voice", tts.speakers[0],
                                 "--seed", "0", "--max-new-tokens", str(FRAMES), "--out", str(out)],
                                capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "".join(REPLY)
    audio, rate = sf.read(out, dtype="int16")
    text = "".join(REPLY)
    request = SpeechRequest(text, speaker=tts.speakers[0], seed=0, max_frames=FRAMES).validate()
    prompt = tts.prompt(text, "auto", request.speaker, "", None, non_streaming=False)
    handle = tts.engine.submit(Job([Segment(prompt.prefill, prompt.trailing_text, True)], tts.sampling(), 0, FRAMES,
                                   segment_frames=tts.default_max_frames()))
    expected = np.concatenate([chunk.audio for chunk in handle])
    assert rate == 24000 and audio.tobytes() == pcm16(expected)
