"""A long text is spoken whole: each segment has the checkpoint's frame limit of its own; when text
is still left out (a request's own frame limit reached before the last segment) the engine says how
much, and the CLI, the API and the app's panel pass that on."""
import base64
import html
import json
import re
import time
from pathlib import Path

import gradio as gr
import numpy as np
import pytest

from pipeline.request import SpeechRequest, split_text
from pipeline.tts import SAMPLES_PER_FRAME, TTS

SEGMENT_FRAMES = 10  # the test checkpoint's max_new_tokens - 1: each segment may speak at most this many frames
SENTENCE = "This sentence is one of many in a long text that is split into segments at its sentence ends. "
LONG_TEXT = SENTENCE * 12  # four segments of at most 300 characters
FORCED_LIMIT = 8  # frames (at most the checkpoint's limit): a request limit that ends the text in its first segment or so
UNSPOKEN = re.compile(r"reached (?:in|after) segment (\d) of 4: .*?the last (?:segment|(\d) segments) \(([\d,]+) characters\) of the text went unspoken")


@pytest.fixture(scope="module")
def short_segments(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny VoiceDesign checkpoint with a 10-frame limit per utterance (max_new_tokens 11), so
    that a text of several segments runs past it in a few seconds of CPU."""
    source = Path(tiny_checkpoints["voice_design"])
    directory = tmp_path_factory.mktemp("short-segments") / "voice_design"
    directory.mkdir()
    for item in source.iterdir():
        if item.name != "generation_config.json":
            (directory / item.name).symlink_to(item)
    config = json.loads((source / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps(config | {"max_new_tokens": SEGMENT_FRAMES + 1}))
    return directory


@pytest.fixture(scope="module")
def tts(short_segments) -> TTS:
    return TTS.from_pretrained(str(short_segments))


def segments() -> list[str]:
    return split_text(LONG_TEXT)


def unspoken_characters(warning: str) -> tuple[int, int]:
    """(segment the limit was reached in or after, characters it says went unspoken), checked against the text."""
    match = UNSPOKEN.search(warning)
    assert match, warning
    reached, chars = int(match.group(1)), int(match.group(3).replace(",", ""))
    return reached, chars


def assert_counts_the_rest_of_the_text(warnings: list[str]) -> None:
    found = [w for w in warnings if "went unspoken" in w]
    assert len(found) == 1, warnings
    reached, chars = unspoken_characters(found[0])
    assert reached < len(segments()) and chars == sum(len(s) for s in segments()[reached:])


def test_a_long_text_speaks_every_segment_with_a_frame_limit_of_its_own(tts):
    assert len(segments()) == 4
    handle = tts.submit(SpeechRequest(LONG_TEXT, instruct="Calm.", seed=1))
    audio = np.concatenate([chunk.audio for chunk in handle])
    # Every segment spoke, each up to its own limit: the first one's frames did not use up the others'.
    assert len(handle.codes) > SEGMENT_FRAMES
    assert len(handle.segment_frames) == 4 and all(1 <= n <= SEGMENT_FRAMES for n in handle.segment_frames)
    assert len(handle.codes) == sum(handle.segment_frames)
    assert audio.shape == (len(handle.codes) * SAMPLES_PER_FRAME,)
    assert not [w for w in handle.warnings if "went unspoken" in w]


def test_segments_cut_at_their_own_limit_are_named_in_one_warning(tts):
    handle = tts.submit(SpeechRequest(LONG_TEXT, instruct="Calm.", seed=1))
    list(handle)
    cut = [i + 1 for i, n in enumerate(handle.segment_frames) if n == SEGMENT_FRAMES]
    limit = [w for w in handle.warnings if "frame limit of one segment" in w]
    # Random weights rarely end a segment on their own: most or all of them are cut, and one warning names them.
    if len(cut) > 1:
        assert limit == [(f"{len(cut)} of 4 segments ({', '.join(map(str, cut))}) reached the frame limit of one segment "
                          f"({SEGMENT_FRAMES} frames, 1 s) and were cut there; shorter sentences avoid this.")]
    elif cut:
        assert limit == [(f"Segment {cut[0]} of 4 reached the frame limit of one segment ({SEGMENT_FRAMES} frames, 1 s) and was cut there; "
                          "shorter sentences avoid this.")]
    else:
        assert not limit


def test_a_request_limit_that_leaves_text_out_says_how_much(tts):
    handle = tts.submit(SpeechRequest(LONG_TEXT, instruct="Calm.", seed=1, max_frames=FORCED_LIMIT))
    list(handle)
    assert len(handle.codes) <= FORCED_LIMIT
    assert_counts_the_rest_of_the_text(handle.warnings)


def test_the_cli_prints_the_warning_on_stderr(short_segments, tmp_path, capsys):
    from pipeline.__main__ import main

    code = main(["synth", "--model", str(short_segments), "--text", LONG_TEXT, "--instruct", "Calm.", "--seed", "1",
                 "--max-frames", str(FORCED_LIMIT), "--out", str(tmp_path / "out.wav")])
    assert code == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ") and "went unspoken" in line]
    assert_counts_the_rest_of_the_text(lines)


@pytest.fixture(scope="module")
def api(short_segments):
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from pipeline.server import Access, speech_routes
    from pipeline.service import ModelService

    service = ModelService({"voice_design": (str(short_segments),)})
    return TestClient(Starlette(routes=speech_routes(service, Access()))), short_segments


def body(checkpoint: Path, **fields) -> dict:
    return {"input": LONG_TEXT, "model": str(checkpoint), "task_type": "VoiceDesign", "instructions": "Calm.", "seed": 1,
            "max_new_tokens": FORCED_LIMIT, "response_format": "pcm"} | fields


def test_the_api_says_so_in_a_header_of_a_whole_response(api):
    client, checkpoint = api
    response = client.post("/v1/audio/speech", json=body(checkpoint))
    assert response.status_code == 200 and len(response.content) <= FORCED_LIMIT * SAMPLES_PER_FRAME * 2
    assert_counts_the_rest_of_the_text(json.loads(response.headers["x-warnings"]))


def test_the_api_says_so_in_an_event_of_an_sse_stream(api):
    client, checkpoint = api
    with client.stream("POST", "/v1/audio/speech", json=body(checkpoint, stream_format="sse")) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
    kinds = [event["type"] for event in events]
    assert kinds[-1] == "speech.audio.done" and "speech.audio.delta" in kinds
    audio = b"".join(base64.b64decode(event["audio"]) for event in events if event["type"] == "speech.audio.delta")
    assert 0 < len(audio) <= FORCED_LIMIT * SAMPLES_PER_FRAME * 2
    assert_counts_the_rest_of_the_text([event["message"] for event in events if event["type"] == "speech.audio.warning"])


def test_the_api_takes_sse_for_pcm_only(api):
    client, checkpoint = api
    response = client.post("/v1/audio/speech", json=body(checkpoint, stream_format="sse", response_format="wav"))
    assert response.status_code == 400 and response.json()["error"]["message"] == "SSE events carry pcm audio, not wav."


def test_the_panel_warns_and_keeps_the_warning_in_its_summary(short_segments):
    from pipeline.service import ModelService
    from ui.latency import LatencyPanel

    service = ModelService({"voice_design": (str(short_segments),)})
    request = SpeechRequest(LONG_TEXT, instruct="Calm.", seed=1, max_frames=FORCED_LIMIT, model_type="voice_design")
    stream = service.stream(request, "panel")
    start = next(stream)
    with gr.Blocks():
        panel = LatencyPanel.create("long")
    with pytest.warns(UserWarning) as shown:  # gr.Warning outside a running app
        updates = list(panel.stream(start, stream, "", time.perf_counter(), stop=lambda: service.stop("panel")))
    assert_counts_the_rest_of_the_text([html.unescape(str(w.message)) for w in shown])  # toasts are escaped HTML
    summary = [u[panel.summary] for u in updates if panel.summary in u][-1]
    assert_counts_the_rest_of_the_text([html.unescape(w) for w in summary.split("**Warning:** ")[1:]])


def test_a_remote_ui_passes_the_backends_warning_on(api, short_segments):
    import threading

    import uvicorn
    from conftest import free_port
    from starlette.applications import Starlette

    from pipeline.engine import Chunk
    from pipeline.remote import RemoteService
    from pipeline.server import Access, speech_routes
    from pipeline.service import ModelService, StreamEnd

    service = ModelService({"voice_design": (str(short_segments),)})
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=speech_routes(service, Access())), host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        remote = RemoteService(f"http://127.0.0.1:{server.config.port}")
        request = SpeechRequest(LONG_TEXT, instruct="Calm.", seed=1, max_frames=FORCED_LIMIT, model_type="voice_design", checkpoint=str(short_segments))
        items = list(remote.stream(request))
    finally:
        server.should_exit = True
        thread.join(10)
    frames = sum(item.frames for item in items if isinstance(item, Chunk))
    assert 0 < frames <= FORCED_LIMIT and isinstance(items[-1], StreamEnd)
    assert_counts_the_rest_of_the_text(items[-1].warnings)
