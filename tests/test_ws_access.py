"""WS /v1/audio/speech/stream keeps the HTTP API's access rules and limits, on a real server (uvicorn)
over the tiny checkpoints, driven with the `websockets` client: a missing or wrong key gets the sentence
POST /v1/audio/speech gives; a client over its limit of sessions in flight (counted with its HTTP
requests) is told so and closed with 1013; text over the total limit, given in pieces, is one error
naming the limit. After each refusal the server serves a good session to its end (one engine row: a
row not freed would keep the next session waiting)."""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import httpx
import pytest
from conftest import serving
from starlette.applications import Starlette
from test_ws_stream import read_until_closed
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from pipeline.request import MAX_TEXT_CHARS
from pipeline.server import Access, speech_routes, stream_routes
from pipeline.server.stream import PATH
from pipeline.service import ModelService

KEY = "s3cret"
FRAMES = 8
HANG_GUARD_S = 120


@pytest.fixture(scope="module")
def service(tiny_checkpoints):
    return ModelService(tiny=True, tiny_dir=Path(tiny_checkpoints["base"]).parent, rows=1)


@contextlib.contextmanager
def both_routes(service: ModelService, **access):
    """The WebSocket and POST /v1/audio/speech on one real server, under one Access."""
    rules = Access(**access)
    with serving(Starlette(routes=[*stream_routes(service, rules), *speech_routes(service, rules)])) as url:
        yield url


def voice(service: ModelService) -> str:
    return service.model("custom_voice").speakers[0]


def settings(service: ModelService) -> dict:
    return {"type": "session.config", "task_type": "CustomVoice", "voice": voice(service), "seed": 0, "max_new_tokens": FRAMES}


def post_body(service: ModelService, text: str = "Hello there.") -> dict:
    return {"input": text, "task_type": "CustomVoice", "voice": voice(service), "response_format": "pcm", "seed": 0, "max_new_tokens": FRAMES}


def post_error(url: str, body: dict, headers: dict | None = None) -> tuple[int, str]:
    response = httpx.post(f"{url}/v1/audio/speech", json=body, headers=headers or {}, timeout=HANG_GUARD_S)
    return response.status_code, response.json()["error"]["message"]


def session(url: str, messages: list[dict], headers: dict | None = None) -> tuple[bytes, list[dict], int]:
    """Send the messages, then read until the server closes: the audio, the JSON events and the close code.
    A server that refuses at once may close before the messages are sent: what it said is still read."""
    with connect(url.replace("http://", "ws://") + PATH, additional_headers=headers, open_timeout=HANG_GUARD_S,
                 close_timeout=HANG_GUARD_S) as ws:
        with contextlib.suppress(ConnectionClosed):
            for message in messages:
                ws.send(json.dumps(message))
        audio, events = read_until_closed(ws)
        return audio, events, ws.close_code


def good_session(service: ModelService, url: str, headers: dict | None = None) -> tuple[bytes, list[dict], int]:
    return session(url, [settings(service), {"type": "input.text", "text": "Next."}, {"type": "input.done"}], headers)


def assert_served(service: ModelService, url: str, headers: dict | None = None) -> None:
    assert_good(*good_session(service, url, headers))


def assert_good(received: bytes, events: list[dict], code: int) -> None:
    """A good session: its text spoken to the end, its totals, the normal close."""
    assert code == 1000 and "error" not in [event["type"] for event in events]
    assert received and events[-1]["type"] == "session.done" and events[-1]["total_bytes"] == len(received)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}], ids=["missing", "wrong", "no Bearer"])
def test_a_missing_or_wrong_key_gets_the_sentence_post_gives(service, headers):
    with both_routes(service, key=KEY, public=True) as url:
        status, sentence = post_error(url, post_body(service), headers)
        assert status == 401 and sentence == "Missing or wrong API key: send the header 'Authorization: Bearer KEY'."
        received, events, code = session(url, [settings(service)], headers)
        assert events == [{"type": "error", "message": sentence}] and code == 1008 and received == b""
        assert_served(service, url, {"Authorization": f"Bearer {KEY}"})


def test_a_public_server_without_a_key_keeps_the_route_off_as_it_keeps_post_off(service):
    with both_routes(service, public=True) as url:
        status, sentence = post_error(url, post_body(service))
        assert status == 403 and "started without --api-key" in sentence
        received, events, code = session(url, [settings(service)])
        assert events == [{"type": "error", "message": sentence}] and code == 1008 and received == b""


def test_sessions_over_the_clients_limit_are_refused_with_1013_and_count_with_its_requests(service):
    with both_routes(service, per_client=1) as url:
        with connect(url.replace("http://", "ws://") + PATH, open_timeout=HANG_GUARD_S) as first:
            first.send(json.dumps(settings(service)))
            first.send(json.dumps({"type": "input.text", "text": "This text is still being written, "}))
            while not isinstance(first.recv(timeout=HANG_GUARD_S), bytes):  # speaking: the client's one place is taken
                pass
            status, sentence = post_error(url, post_body(service))
            assert status == 429 and sentence == "1 requests of this client are already running; wait for one to end."
            received, events, code = session(url, [settings(service)])
            assert events == [{"type": "error", "message": sentence}] and code == 1013 and received == b""
        # The first client went away: its place comes back once the server has seen it go.
        deadline = time.monotonic() + HANG_GUARD_S
        while (served := good_session(service, url))[2] == 1013:
            assert time.monotonic() < deadline, "the place of a client that went away is still taken"
            time.sleep(0.05)
        assert_good(*served)


def test_text_over_the_limit_in_pieces_is_one_error_naming_it_and_frees_the_row(service):
    pieces = ["Hello there ", "a" * (MAX_TEXT_CHARS // 2), "b" * (MAX_TEXT_CHARS // 2)]  # a word still held: no piece speaks far
    with both_routes(service) as url:
        status, sentence = post_error(url, post_body(service, "".join(pieces)))
        assert status == 400 and sentence == f"The text is {len(''.join(pieces))} characters long; the limit is {MAX_TEXT_CHARS} characters."
        _, events, code = session(url, [settings(service), *({"type": "input.text", "text": piece} for piece in pieces)])
        errors = [event for event in events if event["type"] == "error"]
        assert errors == [{"type": "error", "message": sentence}] and events[-1] == errors[0] and code == 1008
        assert "session.done" not in [event["type"] for event in events]
        assert_served(service, url)  # the engine's one row is free again
