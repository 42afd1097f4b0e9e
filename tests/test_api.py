"""The speech API on the app's server (`POST /v1/audio/speech`, `GET /v1/models`) over real HTTP on
localhost with the tiny checkpoints: every task type, streamed and not, every format; the audio
equals what the engine gives the same request; bad requests get a JSON error with a 4xx status."""
import base64
import contextlib
import io
import json
import struct
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
import soundfile as sf

from pipeline.request import SpeechRequest
from pipeline.service import TINY
from pipeline.word_timings import IncrementalTokenizer, word_times


@pytest.fixture(scope="module")
def api(live_app):
    url, service, _ = live_app
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client, service


def expected_audio(service, model_type: str, **fields) -> np.ndarray:
    request = SpeechRequest(model_type=model_type, checkpoint=TINY, **fields).validate()
    return np.concatenate([c.audio for c in service.stream(request) if hasattr(c, "audio")])


def int16(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1, 1) * 32767.0).astype(np.int16)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


REF_TEXT = "Speak slowly."
HANG_GUARD_S = 600  # ends a wait for something that never comes; no wait decides pass or fail by its duration


def test_models_lists_what_is_served(api):
    client, _ = api
    data = client.get("/v1/models").json()["data"]
    assert {(m["id"], m["task_type"]) for m in data} == {(TINY, "Base"), (TINY, "CustomVoice"), (TINY, "VoiceDesign"), (TINY, "Omni")}


def test_models_describe_a_loaded_checkpoint_and_one_is_loaded_on_request(tiny_checkpoints):
    from pathlib import Path

    from pipeline.service import ModelService

    service = ModelService(tiny=True, tiny_dir=Path(tiny_checkpoints["base"]).parent)  # nothing loaded yet
    client = access_client(service)
    listed = {m["task_type"]: m for m in client.get("/v1/models").json()["data"]}
    assert not listed["CustomVoice"]["loaded"] and listed["CustomVoice"]["random_weights"] and "voices" not in listed["CustomVoice"]
    entry = client.get("/v1/models/tiny", params={"task_type": "CustomVoice"}).json()  # loads it, as a first request would
    info = service.info("custom_voice", TINY)
    assert entry["loaded"] and (entry["voices"], entry["languages"], entry["supports_instruct"]) == (info.speakers, info.languages, True)
    listed = {m["task_type"]: m for m in client.get("/v1/models").json()["data"]}
    assert listed["CustomVoice"]["voices"] == info.speakers and not listed["VoiceDesign"]["loaded"]
    ambiguous = client.get("/v1/models/tiny")
    assert ambiguous.status_code == 400 and "serves Base, CustomVoice, VoiceDesign, Omni: add ?task_type=" in ambiguous.json()["error"]["message"]
    assert client.get("/v1/models/Qwen%2Funknown").status_code == 404
    omni = client.get("/v1/models/tiny", params={"task_type": "Omni"}).json()  # Qwen3-Omni, served by /v1/chat/completions
    assert omni["voices"] == service.info("omni", TINY).speakers and omni["languages"] == [] and not omni["supports_instruct"]


@pytest.mark.parametrize("stream", [False, True])
def test_custom_voice_as_pcm_equals_the_engine(api, stream):
    client, service = api
    body = {"input": "Hello there, tiny model.", "voice": "ryan", "task_type": "CustomVoice", "response_format": "pcm", "stream": stream,
            "seed": 3, "max_new_tokens": 12}
    response = client.post("/v1/audio/speech", json=body)
    assert response.status_code == 200 and response.headers["content-type"] == "audio/pcm"
    audio = np.frombuffer(response.content, dtype="<i2")
    expected = int16(expected_audio(service, "custom_voice", text=body["input"], speaker="ryan", seed=3, max_frames=12))
    assert audio.shape == expected.shape == (12 * 1920,) and np.abs(audio.astype(int) - expected).max() <= 1


def test_vllm_omnis_stream_format_and_our_chunk_schedule(api):
    client, service = api
    body = {"input": "Hello there, tiny model.", "voice": "ryan", "response_format": "pcm", "stream_format": "audio", "seed": 3, "max_new_tokens": 12,
            "schedule": [3]}
    response = client.post("/v1/audio/speech", json=body)  # streamed although 'stream' is left out, as in vllm-omni
    assert response.status_code == 200 and response.headers.get("transfer-encoding") == "chunked"
    expected = int16(expected_audio(service, "custom_voice", text=body["input"], speaker="ryan", seed=3, max_frames=12))
    assert np.abs(np.frombuffer(response.content, dtype="<i2").astype(int) - expected).max() <= 1


def test_streamed_wav_has_an_open_length_header_then_pcm(api):
    client, service = api
    body = {"input": "Calm words.", "task_type": "VoiceDesign", "instructions": "A deep voice.", "response_format": "wav", "stream": True,
            "seed": 1, "max_new_tokens": 10}
    with client.stream("POST", "/v1/audio/speech", json=body) as response:
        assert response.status_code == 200
        data = b"".join(response.iter_bytes())
    assert data[:4] == b"RIFF" and struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    assert len(data) - 44 == 10 * 1920 * 2


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3"])
def test_every_format_as_one_file(api, fmt):
    client, _ = api
    body = {"input": "Good evening.", "voice": "vivian", "response_format": fmt, "seed": 2, "max_new_tokens": 8}
    response = client.post("/v1/audio/speech", json=body)
    assert response.status_code == 200
    audio, rate = sf.read(io.BytesIO(response.content))
    assert rate == 24000 and abs(len(audio) - 8 * 1920) <= (1152 * 2 if fmt == "mp3" else 0)  # mp3 pads to whole frames


def test_voice_clone_from_base64_reference(api, reference_wav):
    client, service = api
    encoded = base64.b64encode(reference_wav.read_bytes()).decode()
    body = {"input": "Now in that voice.", "task_type": "Base", "ref_audio": f"data:audio/wav;base64,{encoded}", "ref_text": "Speak slowly.",
            "response_format": "pcm", "seed": 4, "max_new_tokens": 10}
    response = client.post("/v1/audio/speech", json=body)
    assert response.status_code == 200 and len(response.content) == 10 * 1920 * 2


@pytest.fixture(scope="module")
def voice_file(api, reference_wav, tmp_path_factory):
    """A voice file of the served tiny Base checkpoint, made from `reference_wav` with REF_TEXT."""
    _, service = api
    tts = service.model("base", TINY)
    return tts.save_voice_prompt(tts.create_voice_prompt(str(reference_wav), REF_TEXT), tmp_path_factory.mktemp("voice") / "voice.safetensors")


@pytest.mark.parametrize("sampling", [{"seed": 4}, {"seed": 4, "temperature": 0.5, "top_k": 5}])
def test_a_saved_voice_speaks_as_its_reference_recording(api, reference_wav, voice_file, sampling):
    client, _ = api
    body = {"input": "Now in that voice.", "task_type": "Base", "response_format": "pcm", "max_new_tokens": 10, **sampling}
    from_reference = client.post("/v1/audio/speech", json={**body, "ref_audio": b64(reference_wav.read_bytes()), "ref_text": REF_TEXT})
    from_file = client.post("/v1/audio/speech", json={**body, "voice_prompt": f"data:application/octet-stream;base64,{b64(voice_file.read_bytes())}"})
    assert from_reference.status_code == from_file.status_code == 200
    assert len(from_file.content) == 10 * 1920 * 2 and from_file.content == from_reference.content


def rewritten_metadata(path, **fields) -> bytes:
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save

    with safe_open(path, "pt") as f:
        metadata = json.loads(f.metadata()["qwen3_tts_voice"])
    return save(load_file(path), metadata={"qwen3_tts_voice": json.dumps({**metadata, **fields})})


def test_bad_saved_voices_get_json_errors(api, voice_file, reference_wav):
    client, service = api
    base = {"input": "Hi.", "task_type": "Base"}
    other = rewritten_metadata(voice_file, checkpoint="Qwen/Qwen3-TTS-12Hz-1.7B-Base", fingerprint="0123456789abcdef", speaker_dim=2048)
    fingerprint = service.model("base", TINY).voice_space.fingerprint
    cases = [
        ({"voice_prompt": "not base64!"}, "'voice_prompt' is not valid base64."),
        ({"voice_prompt": str(voice_file)}, "'voice_prompt' is not valid base64."),  # a path is never opened
        ({"voice_prompt": 12}, "'voice_prompt' is a voice file as base64 (a data: URL or plain base64)."),
        ({"voice_prompt": b64(b"garbage bytes, no voice")}, "This is not a Qwen3-TTS voice file"),
        ({"voice_prompt": b64(voice_file.read_bytes()[:-10])}, "The voice file is cut short"),
        ({"voice_prompt": b64(other)}, "This voice was made with the checkpoint 'Qwen/Qwen3-TTS-12Hz-1.7B-Base' (weights 0123456789abcdef, "
                                       f"2048-dim speaker embedding) and cannot be used with '{service.model('base', TINY).name}' "
                                       f"(weights {fingerprint}, 64-dim)"),
        ({"voice_prompt": b64(voice_file.read_bytes()), "ref_audio": b64(reference_wav.read_bytes())},
         "Give either 'ref_audio' (a recording) or 'voice_prompt' (a saved voice), not both."),
        ({"voice_prompt": b64(voice_file.read_bytes()), "ref_text": "Hi."}, "A saved voice brings its own transcript and mode"),
    ]
    for fields, message in cases:
        response = client.post("/v1/audio/speech", json={**base, **fields})
        assert response.status_code == 400, fields
        assert message in response.json()["error"]["message"]
    response = client.post("/v1/audio/speech", json={"input": "Hi.", "voice": "ryan", "voice_prompt": b64(voice_file.read_bytes())})
    assert response.status_code == 400 and response.json()["error"]["message"] == "'voice_prompt' (a saved voice) is for task_type Base."


@pytest.mark.parametrize("body, status, message", [
    ({"voice": "ryan"}, 400, "'input' is required"),
    ({"input": "Hi.", "voice": "nobody"}, 400, "Unknown speaker"),
    ({"input": "Hi.", "voice": "ryan", "speed": 1.5}, 400, "'speed' is not supported"),
    ({"input": "Hi.", "voice": "ryan", "response_format": "ogg"}, 400, "'response_format' is one of pcm, wav, flac, mp3"),
    ({"input": "Hi.", "voice": "ryan", "response_format": "mp3", "stream": True}, 400, "A streamed response is pcm or wav"),
    ({"input": "Hi.", "task_type": "Base", "ref_audio": "not base64!"}, 400, "'ref_audio' is not valid base64."),
    ({"input": "Hi.", "task_type": "Base"}, 400, "Base (voice clone) needs 'ref_audio'"),
    ({"input": "Hi.", "task_type": "Base", "ref_audio": base64.b64encode(b"RIFF junk").decode(), "x_vector_only_mode": True}, 400,
     "The file ref_audio could not be read as audio"),
    ({"input": "Hi.", "model": "Qwen/unknown"}, 404, "Model 'Qwen/unknown' is not served here"),
    ({"input": "Hi.", "task_type": "Talking"}, 400, "'task_type' is one of Base, CustomVoice, VoiceDesign (default: CustomVoice)"),
    ({"input": "Hi.", "colour": "red"}, 400, "Unknown field 'colour'."),
    ({"input": "Hi.", "voice": "ryan", "temperature": -1}, 400, "temperature"),
    ({"input": "Hi.", "voice": "ryan", "response_format": "pcm", "stream_format": "events"}, 400, "'stream_format' is 'audio' (raw audio bytes) or 'sse'"),
    ({"input": "Hi.", "voice": "ryan", "schedule": "1, two"}, 400, "comma-separated list of frame counts"),
    ({"input": "Hi.", "voice": "ryan", "word_timestamps": True, "non_streaming_mode": False}, 400,
     "Word timestamps come as Server-Sent Events: add \"stream_format\": \"sse\""),
    ({"input": "Hi.", "voice": "ryan", "word_timestamps": True, "stream": True, "response_format": "pcm", "non_streaming_mode": False}, 400,
     "Word timestamps come as Server-Sent Events"),
    ({"input": "Hi.", "voice": "ryan", "word_timestamps": True, "stream_format": "sse"}, 400,
     "Word timestamps need the text fed one token per frame, and this request has the whole text in the prompt (CustomVoice puts it there by default)"),
    ({"input": "Hi.", "voice": "ryan", "word_timestamps": True, "stream_format": "sse", "non_streaming_mode": True}, 400,
     "(non_streaming_mode is true): set non_streaming_mode to false."),
])
def test_bad_requests_get_json_errors(api, body, status, message):
    client, _ = api
    response = client.post("/v1/audio/speech", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


def sse_events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.split("\n\n") if line.startswith("data: ")]


@pytest.mark.parametrize("task", ["CustomVoice", "Base"])
def test_word_timestamps_come_before_the_end_of_an_sse_stream(api, task, reference_wav):
    """Where the text is fed one token per frame, an SSE stream's words are those the library times for
    the same text (pipeline.word_timings), in order, within the audio."""
    client, service = api
    text = "Hello there, tiny model. It's 12345 o'clock."
    body = {"input": text, "task_type": task, "stream_format": "sse", "word_timestamps": True, "seed": 5, "max_new_tokens": 40}
    body |= {"voice": "ryan", "non_streaming_mode": False} if task == "CustomVoice" else {"ref_audio": b64(reference_wav.read_bytes()), "ref_text": REF_TEXT}
    response = client.post("/v1/audio/speech", json=body)
    assert response.status_code == 200, response.text
    events = sse_events(response)
    assert [e["type"] for e in events[-2:]] == ["speech.audio.words", "speech.audio.done"]
    audio_s = sum(len(base64.b64decode(e["audio"])) // 2 for e in events if e["type"] == "speech.audio.delta") / 24000
    words = events[-2]["words"]
    tts = service.model("custom_voice" if task == "CustomVoice" else "base", TINY)
    voice = tts.create_voice_prompt(str(reference_wav), REF_TEXT) if task == "Base" else None
    tokens = IncrementalTokenizer(tts.text_tokenizer)
    tokens.feed(text)
    tokens.finish()
    timed = [w.as_dict() for w in word_times(text, tokens.tokens, tts.text_layout(voice)) if w.start < audio_s]
    assert words == [{**w, "end": min(w["end"], round(audio_s, 3))} for w in timed] and words
    assert all(0 <= w["start"] < w["end"] <= audio_s for w in words)
    assert all(a["start"] <= b["start"] and a["end"] <= b["end"] for a, b in zip(words, words[1:]))


def test_a_body_that_is_not_json(api):
    client, _ = api
    response = client.post("/v1/audio/speech", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"] == "The request body is not JSON."


# A text of many segments, each with its own frame limit: a stream that outlasts whatever a test does while it runs.
LONG_TEXT = " ".join(["A long story that the listener will not wait for."] * 98)  # 4,899 characters, 17 segments


def test_a_client_that_goes_away_frees_its_row(api):
    import time

    client, service = api
    engine = service.model("custom_voice", TINY).engine
    body = {"input": LONG_TEXT, "voice": "ryan", "response_format": "pcm", "stream": True, "seed": 5}
    with client.stream("POST", "/v1/audio/speech", json=body) as response:
        first = next(response.iter_bytes())
        assert first and any(engine.slots)
        (held,) = [row.handle for row in engine.slots if row]
    deadline = time.monotonic() + HANG_GUARD_S
    while any(engine.slots):
        assert time.monotonic() < deadline, "the row of a client that went away is still taken"
        time.sleep(0.05)
    assert held.stopped  # stopped, not run to the end of its segments


def access_client(service, **access):
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from pipeline.server import Access, speech_routes

    return TestClient(Starlette(routes=speech_routes(service, Access(**access))))


BODY = {"input": "Hello there.", "voice": "ryan", "response_format": "pcm", "seed": 1, "max_new_tokens": 4}


def test_the_api_key(api):
    _, service = api
    client = access_client(service, key="s3cret", public=True)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        response = client.post("/v1/audio/speech", json=BODY, headers=headers)
        assert response.status_code == 401 and "Missing or wrong API key" in response.json()["error"]["message"]
    assert client.get("/v1/models").status_code == 401
    assert client.post("/v1/audio/speech", json=BODY, headers={"Authorization": "Bearer s3cret"}).status_code == 200


def test_a_public_server_without_a_key_keeps_the_api_off(api):
    _, service = api
    response = access_client(service, public=True).post("/v1/audio/speech", json=BODY)
    assert response.status_code == 403 and "started without --api-key" in response.json()["error"]["message"]


def test_requests_in_flight_per_client_are_limited(api):
    """A client's requests in flight, those waiting for a row included, are at most `per_client`; one
    that ends (its client went away) frees its place."""
    _, service = api
    with every_row_held(service), limited_server(service, per_client=1) as url:
        with httpx.stream("POST", f"{url}/v1/audio/speech", json=WAITING, timeout=60) as first:
            body = started(first)  # noqa: F841 - kept open: it waits for a row
            second = httpx.post(f"{url}/v1/audio/speech", json=BODY, timeout=60)
            assert second.status_code == 429 and "1 requests of this client are already running" in second.json()["error"]["message"]

        def accepted() -> bool:
            with httpx.stream("POST", f"{url}/v1/audio/speech", json=WAITING, timeout=60) as again:
                return again.status_code == 200

        wait_until(accepted, "the client's ended stream still counts against it")


def test_a_full_engine_queue_is_a_429_and_a_refused_request_leaves_no_file(api, tiny_checkpoints, reference_wav, tmp_path, monkeypatch):
    """The engine's bounded queue refusing a request is "try again" (429), not a bad request; a request
    refused by the per-client limit writes no reference file."""
    import base64
    import tempfile

    from pipeline.tts import TTS

    _, service = api
    service.register("custom_voice", "tiny-no-queue", TTS.from_pretrained(str(tiny_checkpoints["custom_voice"]), rows=1, max_queue=0))
    client = access_client(service, per_client=1)
    for stream in (False, True):
        refused = client.post("/v1/audio/speech", json={**BODY, "model": "tiny-no-queue", "stream": stream})
        assert refused.status_code == 429 and "requests ahead; try again shortly" in refused.json()["error"]["message"]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the server writes reference files
    clone = {"input": "Hi.", "task_type": "Base", "ref_audio": base64.b64encode(reference_wav.read_bytes()).decode(), "ref_text": "Hello."}
    with every_row_held(service), limited_server(service, per_client=1) as url:
        with httpx.stream("POST", f"{url}/v1/audio/speech", json=WAITING, timeout=60) as first:
            body = started(first)  # noqa: F841 - kept open: it waits for a row
            assert httpx.post(f"{url}/v1/audio/speech", json=clone, timeout=60).status_code == 429
            assert list(tmp_path.iterdir()) == []


WAITING = {**BODY, "response_format": "wav", "stream": True}  # a stream whose header is sent before its first chunk


def started(response: httpx.Response) -> Iterator[bytes]:
    """The body of a WAITING stream once its WAV header came, kept by the caller: an iterator over the
    body, once dropped, closes the connection, which ends the request."""
    body = response.iter_bytes()
    assert response.status_code == 200 and next(body)[:4] == b"RIFF"
    return body


@contextlib.contextmanager
def limited_server(service, **access):
    """The speech API of `service` on a real server (a client's place is held until its stream really ends)."""
    from conftest import serving
    from starlette.applications import Starlette

    from pipeline.server import Access, speech_routes

    with serving(Starlette(routes=speech_routes(service, Access(**access)))) as url:
        yield url


@contextlib.contextmanager
def every_row_held(service):
    """Every row of the tiny CustomVoice engine taken (hold_the_row), so that a request waits in its queue."""
    tts = service.model("custom_voice", TINY)
    holders = [hold_the_row(tts) for _ in range(tts.engine.rows)]
    try:
        yield
    finally:
        for holder in holders:
            holder.close()


# ---- a request waiting for a row holds no worker thread ----

THREADS = 2  # the worker threads the whole server has, here: fewer than the streams that wait


@pytest.fixture(scope="module")
def one_row(tiny_checkpoints):
    """The speech API alone on a real server whose engine has one row and whose event loop has
    THREADS worker threads: (url, the CustomVoice model)."""
    import contextlib
    from pathlib import Path

    import anyio
    from conftest import serving
    from starlette.applications import Starlette

    from pipeline.server import Access, speech_routes
    from pipeline.service import ModelService

    @contextlib.asynccontextmanager
    async def few_threads(app):
        anyio.to_thread.current_default_thread_limiter().total_tokens = THREADS
        yield

    service = ModelService(tiny=True, tiny_dir=Path(tiny_checkpoints["base"]).parent, rows=1)
    tts = service.model("custom_voice", TINY)
    with serving(Starlette(routes=speech_routes(service, Access(per_client=100)), lifespan=few_threads)) as url:
        yield url, tts


def hold_the_row(tts):
    """A real request whose text is still coming: it keeps the engine's one row, making no frames
    once its text is spoken, until it is closed."""
    job, _ = tts.prepare(SpeechRequest("Hello.", speaker="ryan", seed=1).validate())
    job.segments[-1].text_end = False
    return tts.engine.submit(job)


def wait_until(condition, what: str, timeout: float = 60) -> None:
    """Hang guard only: the condition holds within a moment when the code works."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_streams_waiting_for_a_row_hold_no_worker_thread(one_row):
    """More streams than the server has worker threads wait for the one row; a request that needs a
    thread (describing a model) is answered meanwhile, and the waiting streams' clients going away
    frees their places in the queue while the row is still taken."""
    import contextlib

    url, tts = one_row
    holder = hold_the_row(tts)
    waiting = THREADS + 3
    try:
        with contextlib.ExitStack() as streams:
            readers = []  # kept: a reader dropped closes its connection
            for _ in range(waiting):
                response = streams.enter_context(httpx.stream("POST", f"{url}/v1/audio/speech", timeout=60,
                                                              json={**BODY, "response_format": "wav", "stream": True, "max_new_tokens": 8}))
                readers.append(response.iter_bytes())
                assert response.status_code == 200 and next(readers[-1])[:4] == b"RIFF"  # then it waits for its first chunk
            assert len(tts.engine.waiting) == waiting
            described = httpx.get(f"{url}/v1/models/{TINY}", params={"task_type": "CustomVoice"}, timeout=60)
            assert described.status_code == 200 and described.json()["voices"] == tts.speakers
        wait_until(lambda: not tts.engine.waiting, "the queue still holds the streams whose clients went away")
        assert not holder.closed
    finally:
        holder.close()
    whole = httpx.post(f"{url}/v1/audio/speech", json={**BODY, "response_format": "pcm"}, timeout=60)
    assert whole.status_code == 200 and len(whole.content) > 0  # the row serves again


def test_whole_responses_waiting_for_a_row_hold_no_worker_thread(one_row):
    """The same for requests that are answered as one file once their audio is made."""
    import concurrent.futures

    url, tts = one_row
    holder = hold_the_row(tts)
    waiting = THREADS + 3
    with concurrent.futures.ThreadPoolExecutor(waiting) as clients:
        try:
            replies = [clients.submit(httpx.post, f"{url}/v1/audio/speech", json=BODY, timeout=120) for _ in range(waiting)]
            wait_until(lambda: len(tts.engine.waiting) == waiting, "the requests did not reach the engine's queue")
            described = httpx.get(f"{url}/v1/models/{TINY}", params={"task_type": "CustomVoice"}, timeout=60)
            assert described.status_code == 200 and not any(reply.done() for reply in replies)
        finally:
            holder.close()
        assert all(reply.result().status_code == 200 and reply.result().content for reply in replies)
