"""WS /v1/audio/speech/stream on a real server (uvicorn) over the tiny checkpoints, driven with the
`websockets` client: text given in pieces with pauses speaks exactly what the whole text speaks in the
same (streaming-text) layout; every bad message gets one error sentence and a close code while the
server keeps serving; a client that goes away or falls silent frees its engine row."""
from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import serving
from starlette.applications import Starlette
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from pipeline.engine import Job, Segment
from pipeline.request import SpeechRequest
from pipeline.server import Access, speech_routes, stream_routes
from pipeline.server.common import pcm16
from pipeline.server.stream import MAX_MESSAGE_CHARS, PATH
from pipeline.service import ModelService

TEXT = "Hello there, world! It's 12345 o'clock; don't worry."
PIECES = ["Hel", "lo th", "ere, wor", "ld! It", "'", "s 123", "45 o'cl", "ock; don", "'t worry."]
FRAMES = 24
SETTINGS = {"type": "session.config", "task_type": "CustomVoice", "top_k": 1, "subtalker_top_k": 1, "seed": 0, "max_new_tokens": FRAMES}
HANG_GUARD_S = 120


@pytest.fixture(scope="module")
def service(tiny_checkpoints):
    service = ModelService(tiny=True, tiny_dir=Path(tiny_checkpoints["base"]).parent, rows=1)  # one row: a row not freed blocks the next client
    service.preload()
    return service


@pytest.fixture(scope="module")
def server(service):
    access = Access()
    with serving(Starlette(routes=[*stream_routes(service, access), *speech_routes(service, access)])) as url:
        yield url


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + PATH


def session(url: str, messages: list, pause_s: float = 0.0) -> tuple[bytes, list[dict], int]:
    """Send the messages (dicts as JSON, str as it is, bytes as binary) with a pause after each text
    piece; return the audio received, the JSON events, and the close code."""
    with connect(ws_url(url), open_timeout=HANG_GUARD_S, close_timeout=HANG_GUARD_S) as ws:
        for message in messages:
            ws.send(json.dumps(message) if isinstance(message, dict) else message)
            if isinstance(message, dict) and message.get("type") == "input.text":
                time.sleep(pause_s)
        audio, events = read_until_closed(ws)
        return audio, events, ws.close_code


def read_until_closed(ws) -> tuple[bytes, list[dict]]:
    """What the server sends until it closes: the binary audio joined, and the JSON events in order."""
    audio, events = bytearray(), []
    try:
        while True:
            received = ws.recv(timeout=HANG_GUARD_S)
            if isinstance(received, bytes):
                audio += received
            else:
                events.append(json.loads(received))
    except ConnectionClosed:
        pass
    return bytes(audio), events


def whole_text_reference(service: ModelService, text: str) -> tuple[torch.Tensor, np.ndarray]:
    """Codes and audio of `text` given at once in the official streaming-text layout (its prompt built
    by the TTS's own prompt builder), with the sampling and seed of SETTINGS."""
    tts = service.model("custom_voice")
    request = SpeechRequest(text, speaker=tts.speakers[0], top_k=1, subtalker_top_k=1, seed=0, max_frames=FRAMES).validate()
    prompt = tts.prompt(text, "auto", request.speaker, "", None, non_streaming=False)
    job = Job([Segment(prompt.prefill, prompt.trailing_text, True)], tts.sampling(False, **request.sampling_overrides()), 0, FRAMES,
              segment_frames=tts.default_max_frames())
    handle = tts.engine.submit(job)
    audio = np.concatenate([chunk.audio for chunk in handle])
    return handle.codes, audio


def settings_for(service: ModelService) -> dict:
    return {**SETTINGS, "voice": service.model("custom_voice").speakers[0]}


def test_pieces_with_pauses_speak_what_the_whole_text_speaks(service):
    codes, audio = whole_text_reference(service, TEXT)
    tts = service.model("custom_voice")
    stream = tts.open_text_stream(SpeechRequest(".", speaker=tts.speakers[0], top_k=1, subtalker_top_k=1, seed=0, max_frames=FRAMES))
    for piece in PIECES:
        stream.append(piece)
        time.sleep(0.05)  # the row runs out of text and waits
    stream.finish()
    streamed = np.concatenate([chunk.audio for chunk in stream.handle])
    ids = tts._ids(f"<|im_start|>assistant\n{TEXT}<|im_end|>\n<|im_start|>assistant\n")[0, 3:-5].tolist()
    assert [t.id for t in stream.tokens] == ids
    assert torch.equal(stream.handle.codes, codes)
    assert np.array_equal(streamed, audio)


def test_voice_clone_pieces_speak_what_the_whole_text_speaks(service, reference_wav):
    """A voice-clone prompt lays the text against the reference frames: the row starts once the text covers them."""
    tts = service.model("base")
    voice = tts.create_voice_prompt(str(reference_wav), "A short reference transcript.")
    request = SpeechRequest(".", top_k=1, subtalker_top_k=1, seed=0, max_frames=FRAMES, model_type="base").validate()
    text = "Cloned speech, given one piece at a time, all the way to the end of this sentence and beyond it."
    prompt = tts.prompt(text, "auto", None, "", voice, non_streaming=False)
    job = Job([Segment(prompt.prefill, prompt.trailing_text, True)], tts.sampling(False, **request.sampling_overrides()), 0, FRAMES,
              vocoder_state=voice.vocoder_state, segment_frames=tts.default_max_frames())
    handle = tts.engine.submit(job)
    audio = np.concatenate([chunk.audio for chunk in handle])
    stream = tts.open_text_stream(request, voice)
    for start in range(0, len(text), 7):
        stream.append(text[start:start + 7])
    stream.finish()
    streamed = np.concatenate([chunk.audio for chunk in stream.handle])
    assert torch.equal(stream.handle.codes, handle.codes)
    assert np.array_equal(streamed, audio)


def test_websocket_streams_the_audio_of_the_whole_text(service, server):
    _, audio = whole_text_reference(service, TEXT)
    messages = [settings_for(service), *({"type": "input.text", "text": piece} for piece in PIECES), {"type": "input.done"}]
    received, events, code = session(server, messages, pause_s=0.05)
    kinds = [event["type"] for event in events]
    assert code == 1000 and "error" not in kinds
    assert received == pcm16(audio)
    assert kinds[0] == "audio.start" and events[0]["sample_rate"] == 24000 and events[0]["format"] == "pcm"
    assert kinds[-2:] == ["audio.done", "session.done"]
    done = events[-1]
    assert done["frames"] == FRAMES and done["total_bytes"] == len(received) and done["text_complete"]
    words = [w for event in events if event["type"] == "word.timings" for w in event["words"]]
    assert [w["word"] for w in words] == TEXT.split()
    assert all(a["start"] <= a["end"] <= b["start"] for a, b in zip(words, words[1:]))
    assert sum(event["frames"] for event in events if event["type"] == "chunk.timing") == FRAMES


def test_settings_are_checked_as_post_speech_checks_them(service, server):
    body = {"task_type": "CustomVoice", "voice": "nobody"}
    post = httpx.post(f"{server}/v1/audio/speech", json={**body, "input": "Hi."}, timeout=HANG_GUARD_S).json()["error"]["message"]
    _, events, code = session(server, [{"type": "session.config", **body}])
    assert events == [{"type": "error", "message": post}] and code == 1008


def bad_sessions(settings: dict) -> dict[str, tuple[list, int, str]]:
    """Each bad client: its messages, the close code and a phrase of the error sentence."""
    text = {"type": "input.text", "text": "Hello."}
    return {
        "text before the settings": ([text], 1008, "first message must be session.config"),
        "a second session.config": ([settings, settings], 1008, "comes once"),
        "a binary message": ([settings, b"\x00\x01"], 1003, "binary message"),
        "a message over the size limit": ([settings, {"type": "input.text", "text": "a" * MAX_MESSAGE_CHARS}], 1009, "the limit is"),
        "an unknown event type": ([settings, {"type": "input.audio"}], 1008, "Unknown message type 'input.audio'"),
        "text after input.done": ([settings, text, {"type": "input.done"}, text], 1008, "No message may follow input.done"),
        "no text before input.done": ([settings, {"type": "input.done"}], 1008, "input.done came before any text"),
        "not JSON": ([settings, "{oops"], 1008, "not JSON"),
        "a field of POST only": ([{**settings, "input": "Hi."}], 1008, "takes no 'input'"),
        "a format other than pcm": ([{**settings, "response_format": "wav"}], 1008, "response_format is 'pcm'"),
    }


@pytest.mark.parametrize("case", list(bad_sessions({})))
def test_each_bad_message_gets_one_error_and_a_close_code(service, server, case):
    messages, close_code, phrase = bad_sessions(settings_for(service))[case]
    _, events, code = session(server, messages)
    errors = [event for event in events if event["type"] == "error"]
    assert len(errors) == 1 and phrase in errors[0]["message"] and code == close_code
    assert "session.done" not in [event["type"] for event in events]
    assert_served(service, server)  # the server goes on serving others


def assert_served(service: ModelService, url: str) -> None:
    """A client's text is spoken to the end of its utterance."""
    received, events, code = session(url, [settings_for(service), {"type": "input.text", "text": "Next."}, {"type": "input.done"}])
    assert code == 1000 and received and events[-1]["type"] == "session.done" and len(received) == events[-1]["total_bytes"]


def test_a_client_that_goes_away_frees_its_row(service, server):
    with connect(ws_url(server), open_timeout=HANG_GUARD_S) as ws:
        ws.send(json.dumps(settings_for(service)))
        ws.send(json.dumps({"type": "input.text", "text": "This text never ends, "}))
        while not isinstance(ws.recv(timeout=HANG_GUARD_S), bytes):  # speaking: the only row is taken
            pass
    # Gone mid-utterance, its text never finished: the next client (one row in all) is served to its end.
    assert_served(service, server)


def test_an_idle_client_is_told_and_its_row_freed(service):
    access = Access()
    with serving(Starlette(routes=stream_routes(service, access, idle_timeout_s=0.5))) as url:
        _, events, code = session(url, [settings_for(service), {"type": "input.text", "text": "Half a sen"}])
        assert events[-1] == {"type": "error", "message": "No message came for 0.5 s: the session timed out and its engine row was freed."}
        assert code == 1001
        assert_served(service, url)


def test_a_page_of_another_site_is_refused(service, server):
    with connect(ws_url(server), origin="http://evil.example", open_timeout=HANG_GUARD_S) as ws:
        event = json.loads(ws.recv(timeout=HANG_GUARD_S))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=HANG_GUARD_S)
    assert event["type"] == "error" and "http://evil.example" in event["message"] and ws.close_code == 1008


def test_a_saved_voice_or_reference_clones_as_over_post(service, server, reference_wav):
    """Base: the reference recording comes as base64 in session.config, as in POST /v1/audio/speech."""
    ref = base64.b64encode(Path(reference_wav).read_bytes()).decode()
    settings = {"type": "session.config", "task_type": "Base", "ref_audio": ref, "x_vector_only_mode": True, "seed": 0, "max_new_tokens": FRAMES}
    received, events, code = session(server, [settings, {"type": "input.text", "text": "Cloned."}, {"type": "input.done"}])
    assert code == 1000 and received and events[-1]["type"] == "session.done"


def test_the_first_audio_benchmark_runs_on_the_tiny_checkpoint(tmp_path):
    """benchmarks/ws_first_audio.py end to end on the CPU: a report per size with its runs (structure only, no timings)."""
    from benchmarks.ws_first_audio import main, pieces

    assert main(["--tiny", "--runs", "2", "--out", str(tmp_path)]) == 0
    (report_file,) = tmp_path.glob("*-ws-first-audio-tiny.json")
    report = json.loads(report_file.read_text())
    (result,) = report["results"]
    assert result["size"] == "tiny" and result["runs"] == len(result["times_ms"]) == 2 and all(t > 0 for t in result["times_ms"])
    assert report["pieces"] > 1 and "| tiny |" in report_file.with_suffix(".md").read_text()
    assert "".join(pieces("Hello there,  world!")) == "Hello there,  world!"
