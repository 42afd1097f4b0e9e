"""The runaway guard's warning reaches the user at the doors not covered in test_runaway.py: the
WebSocket's session.done carries it, and the Custom voice tab shows it (a toast, and under the player).
The tiny CustomVoice checkpoint is edited to never end (test_runaway.never_ends), so the stream stops
at the text's frame budget, far inside the checkpoint's own frame limit."""
from __future__ import annotations

import json

import gradio as gr
import pytest
from conftest import serving
from starlette.applications import Starlette
from test_runaway import RELEASED_MAX_NEW_TOKENS, edited_checkpoint, never_ends
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from pipeline.contract.events import FRAME_SECONDS
from pipeline.server import Access, stream_routes
from pipeline.server.stream import PATH
from pipeline.service import ModelService
from ui.app import build_demo

TEXT = "Hello there."
HANG_GUARD_S = 300
SPEAKER = "ryan"


@pytest.fixture(scope="module")
def endless(tiny_checkpoints, tmp_path_factory):
    return edited_checkpoint(tiny_checkpoints["custom_voice"], tmp_path_factory.mktemp("endless") / "custom_voice", never_ends)


@pytest.fixture(scope="module")
def service(endless) -> ModelService:
    return ModelService({"custom_voice": (str(endless),)})


def assert_runaway_sentence(warning: str, frames: int) -> None:
    """The guard's sentence, stating the audio the user actually got."""
    assert warning.startswith(f"The model did not end the utterance; stopped after {frames * FRAME_SECONDS:.1f} s, ")
    assert warning.endswith("x the expected length.")


def test_the_websockets_session_done_carries_the_warning(service):
    settings = {"type": "session.config", "task_type": "CustomVoice", "voice": SPEAKER, "seed": 1}
    events, audio_bytes = [], 0
    with serving(Starlette(routes=stream_routes(service, Access()))) as url:
        with connect(url.replace("http://", "ws://") + PATH, open_timeout=HANG_GUARD_S, close_timeout=HANG_GUARD_S) as ws:
            for message in (settings, {"type": "input.text", "text": "Hello "}, {"type": "input.text", "text": "there."}, {"type": "input.done"}):
                ws.send(json.dumps(message))
            try:
                while True:
                    received = ws.recv(timeout=HANG_GUARD_S)
                    if isinstance(received, bytes):
                        audio_bytes += len(received)
                    else:
                        events.append(json.loads(received))
            except ConnectionClosed:
                pass
    assert ws.close_code == 1000 and [event["type"] for event in events][-2:] == ["audio.done", "session.done"]
    done = events[-1]
    assert done["total_bytes"] == audio_bytes and 0 < done["frames"] < RELEASED_MAX_NEW_TOKENS  # stopped by the guard, not the frame limit
    (warning,) = done["warnings"]
    assert_runaway_sentence(warning, done["frames"])


def test_the_custom_voice_tab_shows_the_warning(service, endless):
    demo = build_demo(service)
    run = next(fn.fn for fn in demo.fns.values() if fn.api_name == "custom_generate")
    max_seconds = 160  # the slider's right end: the text's budget ends the speech first
    args = (str(endless), SPEAKER, "", TEXT, "auto", 0.9, 50, 1.0, 1.05, 1, "1, 2, 4, 8, 16", max_seconds, "")
    with pytest.warns(UserWarning) as shown:  # gr.Warning outside a page: the toast's text as a Python warning
        updates = list(run(*args, gr.Request(), gr.Progress()))
    tables = [v for u in updates for k, v in u.items() if getattr(k, "elem_id", "").endswith("-table")]
    frames = sum(row[1] for row in tables[-1].values.tolist())  # the table's Frames column
    assert 0 < frames < max_seconds / FRAME_SECONDS
    (toast,) = [str(w.message) for w in shown if "did not end" in str(w.message)]
    assert_runaway_sentence(toast, frames)
    summary = next(v for u in reversed(updates) for k, v in u.items() if getattr(k, "elem_id", "").endswith("-summary"))
    assert f"**Warning:** {toast}" in summary  # it stays under the player after the toast fades
