"""Qwen3-Omni's `POST /v1/chat/completions` on the app's server, over real HTTP on localhost with the
tiny random Omni checkpoint: streamed and whole replies carry the text and the speech that
`ModelService.chat` gives the same request and seed; text only speaks nothing; audio messages,
a system prompt and earlier replies reach the model; every bad request gets its 4xx and sentence;
a client that goes away frees its engine row; the API key applies."""
import base64
import io
import json
import time

import httpx
import numpy as np
import pytest
import soundfile as sf
from conftest import free_port, voice_like

from pipeline.engine import Chunk
from pipeline.omni.conversation import AUDIO_SAMPLE_RATE
from pipeline.service import ChatEnd, ChatRequest, ModelService, TextDelta, Turn

QUESTION = "Hello there, how are you?"
HANG_GUARD_S = 600  # ends a wait for something that never comes; no wait decides pass or fail by its duration


@pytest.fixture(scope="module")
def served(tiny_omni, tmp_path_factory):
    """The app on a free localhost port, its Omni checkpoint the tiny one (named by its directory, loaded
    up front); the TTS tabs keep their Hub ids, which these tests never load."""
    from pipeline.listening import Sessions
    from ui.app import build_demo, launch_options

    service = ModelService({"omni": (str(tiny_omni),)}, tiny_dir=tmp_path_factory.mktemp("tiny-root"))
    service.model("omni")
    demo = build_demo(service, Sessions(tmp_path_factory.mktemp("listening"), service))
    demo.queue(default_concurrency_limit=None)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **launch_options(service))
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        yield client, service
    demo.close()


def wait_until(condition, what: str) -> None:
    """Poll until `condition()` holds; HANG_GUARD_S only ends a wait that would never end."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def body(content=QUESTION, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "seed": 3, "max_tokens": 6, **fields}


def engine_reply(service: ModelService, request: ChatRequest) -> tuple[str, np.ndarray]:
    """The reply's text and speech straight from the model service."""
    events = list(service.chat(request))
    end = next(e for e in events if isinstance(e, ChatEnd))
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == end.text
    return end.text, np.concatenate([e.audio for e in events if isinstance(e, Chunk)] or [np.zeros(0, np.float32)])


def decode(data: str, audio_format: str) -> np.ndarray:
    """Base64 audio as samples: raw 16-bit ones for pcm, floats read from the file otherwise."""
    raw = base64.b64decode(data)
    return np.frombuffer(raw, dtype="<i2") if audio_format == "pcm" else sf.read(io.BytesIO(raw))[0]


def events(response: httpx.Response) -> list[dict]:
    """The Server-Sent Events of a streamed reply, which end with [DONE]."""
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def streamed(client: httpx.Client, request: dict) -> list[dict]:
    with client.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as response:
        return events(response)


def test_streamed_and_whole_replies_equal_the_engine(served):
    client, service = served
    text, audio = engine_reply(service, ChatRequest([Turn("user", QUESTION)], speaker="Chelsie", seed=3, max_new_tokens=6))
    assert text and len(audio) > 0

    whole = client.post("/v1/chat/completions", json=body(audio={"voice": "chelsie", "format": "wav"}))
    assert whole.status_code == 200 and whole.headers["x-random-weights"] == "false"
    reply = whole.json()
    assert reply["object"] == "chat.completion" and reply["id"].startswith("chatcmpl-") and len(reply["choices"]) == 1
    choice = reply["choices"][0]
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] == text and message["audio"]["transcript"] == text
    assert choice["finish_reason"] == "length"  # 6 tokens, and the tiny model has not ended its reply
    whole_audio = decode(message["audio"]["data"], "wav")
    assert choice["audio_metadata"] == {"format": "wav", "sample_rate_hz": 24000, "frame_count": len(whole_audio), "channels": 1}
    assert whole_audio.shape == audio.shape and np.abs(whole_audio - audio).max() <= 1 / 32768  # 16-bit WAV

    chunks = streamed(client, body(speaker="Chelsie", audio={"format": "wav"}))  # vllm-omni's top-level speaker names the voice too
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["modality"] == "text" and chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    texts = [c["choices"][0]["delta"]["content"] for c in chunks[1:] if c.get("modality") == "text"]
    pieces = [c["choices"][0] for c in chunks if c.get("modality") == "audio"]
    assert len(texts) > 1 and len(pieces) > 1  # streamed in pieces, not one at the end
    assert "".join(texts) == text
    decoded = [decode(p["delta"]["content"], "wav") for p in pieces]
    assert [p["audio_metadata"]["frame_count"] for p in pieces] == [len(d) for d in decoded]
    assert np.array_equal(np.concatenate(decoded), whole_audio)
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)


def test_streamed_pcm16_is_raw_samples(served):
    client, service = served
    _, audio = engine_reply(service, ChatRequest([Turn("user", QUESTION)], seed=3, max_new_tokens=6))
    pieces = [c["choices"][0] for c in streamed(client, body(audio={"format": "pcm16"})) if c.get("modality") == "audio"]
    assert {p["audio_metadata"]["format"] for p in pieces} == {"pcm"}
    assert np.array_equal(np.concatenate([decode(p["delta"]["content"], "pcm") for p in pieces]), (np.clip(audio, -1, 1) * 32767).astype("<i2"))


def test_text_only_speaks_nothing_and_says_the_same(served):
    client, service = served
    text, _ = engine_reply(service, ChatRequest([Turn("user", QUESTION)], seed=3, max_new_tokens=6))
    reply = client.post("/v1/chat/completions", json=body(modalities=["text"])).json()
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": text} and "audio_metadata" not in reply["choices"][0]
    chunks = streamed(client, body(modalities=["text"]))
    assert {c.get("modality") for c in chunks} == {"text", None}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text


@pytest.mark.parametrize("part", ["input_audio", "audio_url"])
def test_an_audio_message(served, tmp_path, part):
    client, service = served
    path = tmp_path / "question.wav"
    sf.write(path, voice_like(1.5, 44100), 44100)
    encoded = base64.b64encode(path.read_bytes()).decode()
    audio_part = ({"type": "input_audio", "input_audio": {"data": encoded, "format": "wav"}} if part == "input_audio"
                  else {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{encoded}"}})
    content = [audio_part, {"type": "text", "text": "What did I say?"}]
    reply = client.post("/v1/chat/completions", json=body(content, modalities=["text"]))
    assert reply.status_code == 200
    text, _ = engine_reply(service, ChatRequest([Turn("user", "What did I say?", str(path))], seed=3, max_new_tokens=6, speak=False))
    assert reply.json()["choices"][0]["message"]["content"] == text
    without_audio, _ = engine_reply(service, ChatRequest([Turn("user", "What did I say?")], seed=3, max_new_tokens=6, speak=False))
    assert text != without_audio  # the audio reached the thinker


def test_system_prompt_earlier_replies_and_sampling_reach_the_model(served):
    client, service = served
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": [{"type": "text", "text": "Hi."}]},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And now?"}]
    sampling = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 4}
    reply = client.post("/v1/chat/completions", json={"messages": messages, "modalities": ["text"], "max_completion_tokens": 5, **sampling})
    turns = [Turn("user", "Hi."), Turn("assistant", "Hello!"), Turn("user", "And now?")]
    text, _ = engine_reply(service, ChatRequest(turns, system="Answer in one word.", max_new_tokens=5, speak=False, **sampling))
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == text
    greedy = [client.post("/v1/chat/completions", json=body(modalities=["text"], temperature=0, seed=seed)).json() for seed in (1, 2)]
    text, _ = engine_reply(service, ChatRequest([Turn("user", QUESTION)], greedy=True, max_new_tokens=6, speak=False))
    assert [g["choices"][0]["message"]["content"] for g in greedy] == [text, text]  # temperature 0: the seed does not matter


def audio_part(seconds: float = 1.0, rate: int = AUDIO_SAMPLE_RATE) -> dict:
    out = io.BytesIO()
    sf.write(out, voice_like(seconds, rate), rate, format="WAV")
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(out.getvalue()).decode(), "format": "wav"}}


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


AUDIO, LONG = audio_part(), audio_part(61.0)


BAD_REQUESTS = [
    ({}, 400, "'messages' is required: a list of chat messages that ends with the user's."),
    ({"messages": []}, 400, "'messages' is required"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}, 400, "The last message must be the user's"),
    ({"messages": [{"role": "tool", "content": "42"}]}, 400, 'Message 1 has role "tool"; this server takes system, user and assistant'),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}, 400,
     "Message 2 is a system message; only the first message may be one."),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "Message 1's 'content' is a string or a list of content parts."),
    ({"messages": [{"role": "assistant"}, {"role": "user", "content": "Hi"}]}, 400, "Message 1 has no 'content'"),
    ({"messages": user({"type": "file", "file": {}})}, 400, 'Message 1 has a content part of type "file"'),
    ({"messages": user({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})}, 400,
     "images and video are not supported here, only text and audio"),
    ({"messages": user({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}})}, 400, "images and video are not supported"),
    ({"messages": user({"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}})}, 400,
     "Message 1's audio is not valid base64."),
    ({"messages": user({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF junk").decode(), "format": "wav"}})}, 400,
     "Message 1's audio could not be read; send WAV, FLAC, OGG or MP3."),
    ({"messages": user({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}})}, 400, "is not a data: URL"),
    ({"messages": user(LONG)}, 400, "may be at most 60 s"),
    ({"messages": user(AUDIO, AUDIO)}, 400, "Message 1 has 2 audio parts; a message takes at most one."),
    ({"messages": [{"role": "assistant", "content": [AUDIO]}, {"role": "user", "content": "Hi"}]}, 400,
     "only user messages may carry audio"),
    ({"messages": user({"type": "text", "text": "Hi <|im_end|> there"})}, 400, "control token <|im_end|>"),
    ({"messages": [{"role": "user", "content": " "}]}, 400, "The message is empty"),
    (body(audio={"voice": "Bob"}), 400, "Unknown speaker 'Bob'; this model has aiden, chelsie, ethan."),
    (body(speaker="Bob"), 400, "Unknown speaker 'Bob'"),
    (body(audio={"format": "aac"}), 400, "'audio.format' is one of wav, pcm16, pcm, flac, mp3, not \"aac\"."),
    (body(modalities=["text", "image"]), 400, "Output modality 'image' is not supported"),
    (body(modalities="audio"), 400, "'modalities' is a list of 'text' and 'audio'."),
    (body(temperature="hot"), 400, "temperature must be a number from 0 to 100 (0: always the most likely token) (got 'hot')."),
    (body(temperature=-1), 400, "temperature must be a number from 0 to 100"),
    (body(top_p=1.5), 400, "top_p must be a number in (0, 1] (got 1.5)."),
    (body(top_k=2.5), 400, "top_k must be a whole number from 0 to 2147483647 (got 2.5)."),
    (body(top_k=-2), 400, "top_k must be a whole number from 0"),
    (body(seed="x"), 400, "seed must be a whole number from 0 to 4294967295 (got 'x')."),
    (body(seed=-1), 400, "seed must be a whole number from 0 to 4294967295 (got -1)."),
    (body(seed=2**64), 400, "seed must be a whole number from 0 to 4294967295 (got 18446744073709551616)."),
    (body(max_tokens=0), 400, "'max_tokens' is from 1 to 1024, not 0."),
    (body(max_tokens=1025), 400, "'max_tokens' is from 1 to 1024, not 1025."),
    (body(stream="yes"), 400, "'stream' is true or false."),
    (body(tools=[]), 400, "Unknown field 'tools'."),
    (body(model="Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice"), 400, "is a Qwen3-TTS model; chat completions need a Qwen3-Omni model"),
    (body(model="Qwen/unknown"), 404, "Model 'Qwen/unknown' is not served here"),
]


@pytest.mark.parametrize("request_body, status, message", BAD_REQUESTS)
def test_bad_requests_get_json_errors(served, request_body, status, message):
    client, service = served
    response = client.post("/v1/chat/completions", json=request_body)
    assert response.status_code == status
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error" and error["code"] == status
    assert not any(service.model("omni").engine.slots)


def test_a_body_that_is_not_json(served):
    client, _ = served
    response = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["message"] == "The request body is not JSON."


def test_a_client_that_goes_away_frees_its_row(served):
    client, service = served
    engine = service.model("omni").engine
    with client.stream("POST", "/v1/chat/completions", json=body(stream=True, max_tokens=1000)) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line.removeprefix("data: ")).get("modality") == "audio":
                break  # the talker's row is speaking
        (held,) = [row.handle for row in engine.slots if row]
    wait_until(lambda: not any(engine.slots), "the row of a client that went away is still taken")
    assert held.stopped  # stopped, not run to its ~4000 frames


def test_a_client_that_gives_up_on_a_whole_reply_frees_its_row(served):
    """A reply asked for in one piece is stopped when its client disconnects before it is ready,
    rather than speaking its ~2,000 frames for nobody. The client hangs up once the talker's row
    speaks (whenever that is on this machine), before any byte of the reply."""
    import socket

    client, service = served
    engine = service.model("omni").engine
    payload = json.dumps(body(max_tokens=1000)).encode()
    with socket.create_connection((client.base_url.host, client.base_url.port)) as asking:
        asking.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        wait_until(lambda: any(engine.slots), "the talker's row never spoke")
        (held,) = [row.handle for row in engine.slots if row]
    wait_until(lambda: not any(engine.slots), "the row of a client that hung up is still taken")
    assert held.stopped


def test_the_api_key_and_a_public_server(served):
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from pipeline.server import Access, chat_routes

    _, service = served
    client = TestClient(Starlette(routes=chat_routes(service, Access(key="s3cret", public=True))))
    request = body(modalities=["text"], max_tokens=2)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = client.post("/v1/chat/completions", json=request, headers=headers)
        assert response.status_code == 401 and "Missing or wrong API key" in response.json()["error"]["message"]
    assert client.post("/v1/chat/completions", json=request, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    response = TestClient(Starlette(routes=chat_routes(service, Access(public=True)))).post("/v1/chat/completions", json=request)
    assert response.status_code == 403 and "started without --api-key" in response.json()["error"]["message"]
