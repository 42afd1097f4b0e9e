"""The remote backend: the UI's entry point `RemoteService` against this app's API server (tiny
checkpoints, real HTTP on localhost), and `python app.py --backend URL` driven through gradio_client.
The audio and the words' times equal the backend's engine's for the same seed, Stop frees the backend's row, the server's
messages reach the user verbatim, and a backend that is unreachable, killed mid-stream or given a
wrong key is named in a clear message while the UI keeps serving."""
import base64
import html
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from conftest import free_port, read_pcm, tables, voice_like
from gradio_client import Client
from gradio_client.exceptions import AppError

from pipeline.engine import Chunk
from pipeline.errors import BackendUnavailable, TTSInputError
from pipeline.remote import RemoteService
from pipeline.service import TINY, ChatEnd, ChatRequest, ModelService, SpeechRequest, StreamEnd, StreamStart, TextDelta, Turn
from ui.latency import words_html

REPO = Path(__file__).resolve().parents[1]
KEY = "s3cret"
SPEECH = "Hello there, this is a test of the streaming demo."
SHORT = (0.9, 50, 1.0, 1.05, 7, "1, 2, 4, 8, 16", 2)  # sampling, seed 7, schedule, 2 s max
LONG = (0.9, 50, 1.0, 1.05, 7, "1", 160)  # one frame per chunk, up to 160 s: runs until stopped
ROOT = Path(__file__).resolve().parent.parent
HANG_GUARD_S = 600  # ends a wait for something that never comes; no wait decides pass or fail by its duration


@pytest.fixture(scope="module")
def backend(live_app):
    """The app's server in this process (its engines at hand) and a RemoteService pointed at it."""
    url, service, _ = live_app
    return RemoteService(url), service


def pcm16(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype(np.int16)


def audio_of(items) -> np.ndarray:
    return np.concatenate([item.audio for item in items if isinstance(item, Chunk)])


def requests_for(reference_wav: Path) -> dict[str, dict]:
    return {
        "custom_voice": dict(text=SPEECH, speaker="ryan", language="english", instruct="Warmly."),
        "voice_design": dict(text=SPEECH, instruct="A calm, low female voice."),
        "base": dict(text=SPEECH, ref_audio=str(reference_wav), ref_text="Speak slowly and warmly."),
    }


def test_the_tabs_and_their_choices_come_from_the_backend(backend):
    remote, service = backend
    assert remote.ours and remote.choices == {"base": (TINY,), "custom_voice": (TINY,), "voice_design": (TINY,), "omni": (TINY,)}
    for model_type in remote.choices:  # the Omni one is loaded by this first use, on the backend
        assert remote.info(model_type) == service.info(model_type)  # speakers, languages, instruct, random weights


@pytest.mark.parametrize("model_type", ["custom_voice", "voice_design", "base"])
def test_the_audio_equals_the_backends_engine_for_the_same_seed(backend, reference_wav, model_type):
    remote, service = backend
    fields = dict(requests_for(reference_wav)[model_type], model_type=model_type, checkpoint=TINY, seed=11, max_frames=30)
    items = list(remote.stream(SpeechRequest(**fields)))
    start, chunks, end = items[0], items[1:-1], items[-1]
    assert isinstance(start, StreamStart) and start.backend == remote.url and start.random_weights
    assert chunks and all(isinstance(c, Chunk) and c.generate_ms is None and c.vocode_ms is None for c in chunks)  # not reported, not made up
    assert [c.index for c in chunks] == list(range(len(chunks))) and all(a.elapsed_ms <= b.elapsed_ms for a, b in zip(chunks, chunks[1:]))
    assert isinstance(end, StreamEnd) and not end.stopped and end.words is None  # no word timestamps asked for
    expected = pcm16(audio_of(service.stream(SpeechRequest(**fields))))
    assert len(expected) == 30 * 1920 and np.array_equal(pcm16(audio_of(chunks)), expected)


def test_a_saved_voice_goes_to_the_backend_and_speaks_as_its_reference(backend, reference_wav, tmp_path):
    """A voice file exported by the backend's checkpoint is sent with the request (nothing to export
    over a backend: the voice is made there); a damaged one is refused before anything is sent."""
    remote, service = backend
    fields = dict(text=SPEECH, model_type="base", checkpoint=TINY, seed=3, max_frames=20)
    exported = service.export_voice(TINY, str(reference_wav), "Speak slowly and warmly.", False)
    assert remote.export_voice(TINY, str(reference_wav), "Speak slowly and warmly.", False) is None
    info = remote.load_voice_file(TINY, exported)
    assert not info.x_vector_only and info.ref_text == "Speak slowly and warmly." and info.ref_seconds > 0
    saved = pcm16(audio_of(remote.stream(SpeechRequest(**fields, voice_prompt=str(exported)))))
    expected = pcm16(audio_of(service.stream(SpeechRequest(**fields, ref_audio=str(reference_wav), ref_text="Speak slowly and warmly."))))
    assert len(expected) == 20 * 1920 and np.array_equal(saved, expected)
    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(Path(exported).read_bytes()[:100])
    with pytest.raises(TTSInputError, match="cut short"):
        list(remote.stream(SpeechRequest(**fields, voice_prompt=str(damaged))))


@pytest.mark.parametrize("model_type, max_frames", [("base", 30), ("custom_voice", 30), ("voice_design", 30), ("custom_voice", 6)])
def test_the_words_and_their_times_equal_the_backends_engines(backend, reference_wav, model_type, max_frames):
    """The text fed one token per frame (Base's default layout, the others' on request): the backend's
    word timings reach the StreamEnd as the local service gives them, words cut off by max_frames
    left out alike."""
    remote, service = backend
    fields = dict(requests_for(reference_wav)[model_type], model_type=model_type, checkpoint=TINY, seed=11, max_frames=max_frames,
                  non_streaming_mode=False, word_timestamps=True)
    end = list(remote.stream(SpeechRequest(**fields)))[-1]
    local = list(service.stream(SpeechRequest(**fields)))[-1]
    assert isinstance(end, StreamEnd) and not end.stopped and isinstance(local, StreamEnd)
    assert end.words == local.words and end.words  # each word's text, start and end
    spoken = [word["word"] for word in end.words]
    assert spoken == SPEECH.split()[:len(spoken)] and (len(spoken) < len(SPEECH.split())) == (max_frames == 6)


def wait_for_free_rows(engine, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while any(engine.slots):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_stop_closes_the_stream_and_frees_the_backends_row(backend):
    remote, service = backend
    engine = service.model("custom_voice", TINY).engine
    request = SpeechRequest(" ".join([SPEECH] * 30), speaker="ryan", model_type="custom_voice", seed=1, schedule="1")  # many segments: outlasts the test
    stream = remote.stream(request, "session:custom:run")
    assert isinstance(next(stream), StreamStart) and isinstance(next(stream), Chunk)
    (held,) = [row.handle for row in engine.slots if row]
    assert remote.stop("session:custom:run")
    rest = list(stream)
    assert isinstance(rest[-1], StreamEnd) and rest[-1].stopped
    wait_for_free_rows(engine, "the backend kept the row of a closed stream")
    assert held.stopped  # freed because its stream closed, not by the utterance's end
    assert not remote.stop("session:custom:run")


def local_message(service: ModelService, request: SpeechRequest) -> str:
    with pytest.raises(TTSInputError) as raised:
        next(service.stream(request))
    return str(raised.value)


@pytest.mark.parametrize("fields", [
    dict(model_type="custom_voice", speaker="nobody"),
    dict(model_type="voice_design", instruct="A calm voice.", language="klingon"),
    dict(model_type="base", ref_text="Hi.", ref_audio="SHORT"),
])
def test_a_bad_request_gets_the_servers_message_verbatim(backend, tmp_path, fields):
    remote, service = backend
    if fields.get("ref_audio") == "SHORT":  # decoded on the backend only
        sf.write(tmp_path / "short.wav", voice_like(0.5), 24000)
        fields = dict(fields, ref_audio=str(tmp_path / "short.wav"))
    request = dict(fields, text=SPEECH, checkpoint=TINY, seed=1, max_frames=4)
    with pytest.raises(TTSInputError) as raised:
        next(remote.stream(SpeechRequest(**request)))
    assert str(raised.value) == local_message(service, SpeechRequest(**request))


def chat_request(recording: Path | None = None, **fields) -> ChatRequest:
    turns = [Turn("user", "Hello there, how are you?")]
    if recording is not None:  # an earlier reply, then a spoken message
        turns += [Turn("assistant", "Fine, thanks."), Turn("user", "And this?", str(recording))]
    return ChatRequest(turns, **{"speaker": "Chelsie", "seed": 3, "max_new_tokens": 6, **fields})


@pytest.mark.parametrize("spoken", [False, True])
def test_an_omni_reply_equals_the_backends(backend, reference_wav, spoken):
    remote, service = backend
    request = chat_request(reference_wav if spoken else None)
    items = list(remote.chat(request, TINY))
    deltas = [i for i in items if isinstance(i, TextDelta)]
    chunks = [i for i in items if isinstance(i, Chunk)]
    end = next(i for i in items if isinstance(i, ChatEnd))
    assert isinstance(items[0], StreamStart) and items[0].backend == remote.url and isinstance(items[-1], StreamEnd) and not items[-1].stopped
    assert [(d.first_token, d.last_token) for d in deltas] == [(k, k) for k in range(len(deltas))]  # a streamed piece taken as a token
    assert chunks and all(c.generate_ms is None and c.vocode_ms is None for c in chunks)
    assert end.tokens == [] and end.codes.size == 0 and end.first_text_ms is not None and end.first_audio_ms is not None  # nothing made up
    local = list(service.chat(request, TINY))
    assert end.text == next(i for i in local if isinstance(i, ChatEnd)).text == "".join(d.text for d in deltas) != ""
    assert np.array_equal(pcm16(audio_of(chunks)), pcm16(audio_of(local)))


def test_stop_ends_an_omni_reply_and_frees_the_talker_row(backend):
    remote, service = backend
    engine = service.model("omni", TINY).engine
    stream = remote.chat(chat_request(max_new_tokens=1000), TINY, "session:omni:run")
    next(item for item in stream if isinstance(item, Chunk))  # the talker's row speaks
    (held,) = [row.handle for row in engine.slots if row]
    assert remote.stop("session:omni:run")
    rest = list(stream)
    assert next(i for i in rest if isinstance(i, ChatEnd)).stopped and isinstance(rest[-1], StreamEnd) and rest[-1].stopped
    wait_for_free_rows(engine, "the backend kept the talker's row of a closed reply")
    assert held.stopped


def test_a_bad_chat_gets_the_servers_message_verbatim(backend):
    remote, service = backend
    request = chat_request(speaker="Nobody")
    with pytest.raises(TTSInputError) as raised:
        next(remote.chat(request, TINY))
    with pytest.raises(TTSInputError) as local:
        next(service.chat(request, TINY))
    assert str(raised.value) == str(local.value) and "Nobody" in str(raised.value)


def test_an_unreachable_backend_is_named():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(BackendUnavailable, match=f"The backend at {url} is not answering .*Connection refused.*check the URL given to --backend"):
        RemoteService(url)


# ---- `python app.py`: a backend with a key in its own process, and the UI started with --backend ----


def start_app(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "app.py", *args], cwd=REPO, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def wait_for(ready, process: subprocess.Popen, what: str, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ready()
        except Exception:
            if time.monotonic() > deadline or process.poll() is not None:
                raise AssertionError(f"{what} did not start") from None
            time.sleep(0.5)


class Backend:
    """`python app.py --tiny --api-key KEY` on a fixed port, to be killed and started again."""

    def __init__(self, tmp: Path):
        self.port, self.log, self.process = free_port(), tmp / "backend.log", None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = start_app(["--tiny", "--port", str(self.port), "--api-key", KEY], self.log)
        headers = {"Authorization": f"Bearer {KEY}"}
        wait_for(lambda: httpx.get(f"{self.url}/v1/models", headers=headers, timeout=5).raise_for_status(), self.process, "the backend")

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()


@pytest.fixture(scope="module")
def remote_app(tmp_path_factory):
    """(backend, url of the UI started with --backend, the UI's process)."""
    tmp = tmp_path_factory.mktemp("remote")
    backend = Backend(tmp)
    backend.start()
    port = free_port()
    ui = start_app(["--backend", backend.url, "--backend-key", KEY, "--port", str(port), "--sessions", str(tmp / "sessions")], tmp / "ui.log")
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_for(lambda: Client(url, verbose=False), ui, "the UI")
        yield backend, url, ui
    finally:
        for process in (ui, backend.process):
            process.kill()
            process.wait()


def run_app(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "app.py", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_the_app_refuses_to_start_without_its_backend():
    url = f"http://127.0.0.1:{free_port()}"
    result = run_app(["--backend", url])
    assert result.returncode == 2 and f"The backend at {url} is not answering" in result.stderr
    result = run_app(["--backend", url, "--tiny"])
    assert result.returncode == 2 and "--tiny configure models in this process" in result.stderr


def test_a_wrong_key_is_named(remote_app):
    backend, _, _ = remote_app
    message = f"The backend at {backend.url} refused the key (401: Missing or wrong API key"
    with pytest.raises(TTSInputError, match=r"refused the key \(401: Missing or wrong API key.*--backend-key"):
        RemoteService(backend.url, "wrong")
    result = run_app(["--backend", backend.url, "--backend-key", "wrong"])
    assert result.returncode == 2 and message in result.stderr and "QWEN_TTS_BACKEND_KEY" in result.stderr


def test_the_ui_streams_the_backends_audio_to_the_player_and_the_panel(remote_app, backend):
    _, url, _ = remote_app
    client = Client(url, verbose=False)
    run_id = f"custom-remote-{time.time_ns()}"
    frames, opened = [], threading.Event()
    reader = threading.Thread(target=read_pcm, args=(url, run_id, frames, opened))
    reader.start()
    assert opened.wait(10)
    outputs = list(client.submit(TINY, "ryan", "", SPEECH, "english", *SHORT, run_id, api_name="/custom_generate"))
    reader.join(10)
    rows = tables(outputs)[-1]
    assert all(r[2] == "–" and r[3] == "–" for r in rows)  # generate / vocode ms: not reported by the backend
    summary = [o[0] for o in outputs if isinstance(o[0], str)][-1]
    assert "measured here: first audio bytes from" in summary and "final RTF" in summary
    audio, rate = sf.read(outputs[-1][3], dtype="int16")
    assert rate == 24000 and np.array_equal(audio, np.frombuffer(b"".join(f for _, f in frames if f), "<i2"))  # the player heard the WAV
    # The backend's tiny checkpoint is the one the tests write (same seed): an engine here gives the same audio.
    _, service = backend
    request = SpeechRequest(SPEECH, speaker="ryan", language="english", model_type="custom_voice", seed=7, schedule="1, 2, 4, 8, 16", max_frames=25,
                            temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05)
    assert np.array_equal(audio, pcm16(audio_of(service.stream(request))))


def test_a_tab_over_the_backend_shows_the_words_its_engine_times(remote_app, backend):
    """With the text fed one token per frame (Advanced → Text layout), the tab asks the backend
    for the words' times and shows them for the player to highlight, as a tab over an engine here does."""
    _, url, _ = remote_app
    outputs = list(Client(url, verbose=False).submit(TINY, "ryan", "", SPEECH, "english", *SHORT, "", "One token per frame",
                                                     api_name="/custom_generate"))
    shown = [o[-1] for o in outputs if isinstance(o[-1], str) and "pcm-words" in o[-1]][-1]  # the words box, last update
    _, service = backend
    request = SpeechRequest(SPEECH, speaker="ryan", language="english", model_type="custom_voice", seed=7, schedule="1, 2, 4, 8, 16", max_frames=25,
                            temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05, non_streaming_mode=False, word_timestamps=True)
    words = list(service.stream(request))[-1].words
    assert len({word["start"] for word in words}) > 1 and shown == words_html(words)


def test_the_ui_names_a_backend_killed_mid_stream_and_serves_again_once_it_is_back(remote_app):
    backend, url, _ = remote_app
    client = Client(url, verbose=False)
    with pytest.raises(AppError, match="Unknown speaker 'nobody'"):  # the server's message, verbatim
        client.predict(TINY, "nobody", "", SPEECH, "auto", *SHORT, "", api_name="/custom_generate")
    job = client.submit(TINY, "ryan", "", SPEECH, "auto", *LONG, "", api_name="/custom_generate")
    deadline = time.monotonic() + HANG_GUARD_S
    while not job.outputs():
        assert time.monotonic() < deadline, "no update from the job"
        time.sleep(0.05)
    assert not job.done()
    backend.kill()
    with pytest.raises(AppError, match=f"The backend at {backend.url} stopped answering after .* s of audio"):
        job.result(timeout=30)
    with pytest.raises(AppError, match=f"The backend at {backend.url} is not answering"):
        client.predict(TINY, "ryan", "", SPEECH, "auto", *SHORT, "", api_name="/custom_generate")
    backend.start()
    outputs = list(client.submit(TINY, "ryan", "", SPEECH, "auto", *SHORT, "", api_name="/custom_generate"))
    assert len(tables(outputs)[-1]) >= 3


def test_the_omni_tab_over_the_backend(remote_app, backend):
    _, url, _ = remote_app
    _, service = backend
    outputs = list(Client(url, verbose=False).submit(TINY, "Chelsie", "You are brief.", 6, "3", "Hello there", None, "", "", api_name="/omni_send"))
    # outputs: message, voice input, the live reply (HTML), stats, then the panel: summary, table, plot, WAV, take
    reply = [html.unescape(re.sub("<[^>]+>", "", o[2])) for o in outputs if isinstance(o[2], str) and o[2]][-1].strip()
    stats = [o[3] for o in outputs if isinstance(o[3], str) and o[3]][-1]
    summary = [o[4] for o in outputs if isinstance(o[4], str)][-1]  # the conversation state is not an output of the API
    assert "(measured here)" in stats and "tokens" not in stats and "measured here: first audio bytes from" in summary
    local = service.chat(ChatRequest([Turn("user", "Hello there")], system="You are brief.", speaker="Chelsie", seed=3, max_new_tokens=6))
    assert reply == next(i for i in local if isinstance(i, ChatEnd)).text.strip() != ""  # the same weights here and on the backend


# ---- vLLM-Omni: stand-ins that answer as its documented API does (docs/serving/speech_api.md, and its
# serving_chat.py: SSE chunks with a top-level `modality`, each audio delta a base64 WAV) ----

VLLM_TTS = "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"
VLLM_OMNI = "Qwen/Qwen3-Omni-30B-A3B-Instruct"
VLLM_PCM = pcm16(np.sin(np.arange(7 * 1920) / 9.0).astype(np.float32) * 0.5).astype("<i2").tobytes()  # 7 frames


@contextmanager
def stand_in(model: str, routes: list):
    """A vLLM-shaped server of one model with `routes` besides /v1/models, on a free port: its URL."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "vllm", "root": model}]})

    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/models", models), *routes]), host="127.0.0.1", port=free_port(),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(10)


def bad_request(message: str):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}, status_code=400)


@pytest.fixture(scope="module")
def vllm_tts():
    """vLLM-Omni serving Qwen3-TTS CustomVoice (presets at /v1/audio/voices, raw PCM for stream_format
    'audio', its 400s): (url, the bodies it received)."""
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    bodies = []

    async def voices(request):
        return JSONResponse({"voices": ["aiden", "ryan", "vivian", "my_upload"], "uploaded_voices": [{"name": "my_upload"}]})

    async def speech(request):
        body = await request.json()
        bodies.append(body)
        if body.get("voice") not in ("aiden", "ryan", "vivian"):
            return bad_request(f"Invalid voice '{body.get('voice')}'. Supported: aiden, ryan, vivian")
        assert body["stream_format"] == "audio"  # else current vLLM-Omni answers with SSE events

        async def pieces():  # sizes that cut frames and samples in two: the client must join them again
            for start in range(0, len(VLLM_PCM), 1001):
                yield VLLM_PCM[start:start + 1001]

        return StreamingResponse(pieces(), media_type="audio/pcm")

    with stand_in(VLLM_TTS, [Route("/v1/audio/voices", voices), Route("/v1/audio/speech", speech, methods=["POST"])]) as url:
        yield url, bodies


def test_a_vllm_omni_tts_backend_gives_what_it_reports_and_says_what_it_does_not(vllm_tts):
    url, bodies = vllm_tts
    remote = RemoteService(url)
    assert not remote.ours and remote.choices == {"custom_voice": (VLLM_TTS,)}  # the task read from the model's name
    info = remote.info("custom_voice")
    assert info.speakers == ["aiden", "ryan", "vivian"] and info.languages == ["auto"] and info.supports_instruct and not info.random_weights
    request = SpeechRequest(SPEECH, model_type="custom_voice", speaker="ryan", seed=5, max_frames=7, temperature=0.5, schedule="2, 4")
    items = list(remote.stream(request))
    start, chunks = items[0], [i for i in items if isinstance(i, Chunk)]
    assert start.warnings == ["vLLM-Omni takes no temperature, chunk schedule per request (its deploy config sets them): "
                              "they were not applied; seed and length were."]
    assert all(len(c.audio) % 1920 == 0 for c in chunks) and sum(c.frames for c in chunks) == 7
    assert np.array_equal(pcm16(audio_of(chunks)).astype("<i2").tobytes(), VLLM_PCM)
    assert bodies[-1] == {"input": SPEECH, "model": VLLM_TTS, "task_type": "CustomVoice", "language": "auto", "voice": "ryan", "response_format": "pcm",
                          "stream": True, "stream_format": "audio", "seed": 5, "max_new_tokens": 7}  # nothing it would refuse or ignore
    with pytest.raises(TTSInputError, match=r"^Invalid voice 'nobody'\. Supported: aiden, ryan, vivian$"):
        next(remote.stream(SpeechRequest(SPEECH, model_type="custom_voice", speaker="nobody")))


@pytest.fixture(scope="module")
def vllm_omni_chat():
    """vLLM-Omni serving Qwen3-Omni: streamed chat completions, text deltas then audio deltas (each a
    base64 WAV of 2 frames), the finish reason on the last chunk: (url, the bodies it received)."""
    import io as bytes_io

    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    bodies = []

    def event(modality: str, content: str, finish_reason: str | None = None) -> bytes:
        chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": VLLM_OMNI, "modality": modality,
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": content}, "finish_reason": finish_reason}]}
        return f"data: {json.dumps(chunk)}\n\n".encode()

    def wav(pcm: bytes) -> str:
        out = bytes_io.BytesIO()
        sf.write(out, np.frombuffer(pcm, "<i2"), 24000, format="WAV", subtype="PCM_16")
        return base64.b64encode(out.getvalue()).decode()

    async def completions(request):
        body = await request.json()
        bodies.append(body)
        if body.get("speaker") not in ("Aiden", "Chelsie", "Ethan"):
            return bad_request(f"Unknown speaker {body.get('speaker')}")

        async def events():
            for word in ("Hello", " there", "!"):
                yield event("text", word)
            pieces = [VLLM_PCM[i:i + 2 * 3840] for i in range(0, len(VLLM_PCM), 2 * 3840)]
            for n, piece in enumerate(pieces):
                yield event("audio", wav(piece), "stop" if n == len(pieces) - 1 else None)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    with stand_in(VLLM_OMNI, [Route("/v1/chat/completions", completions, methods=["POST"])]) as url:
        yield url, bodies


def test_a_vllm_omni_chat_backend(vllm_omni_chat, reference_wav):
    url, bodies = vllm_omni_chat
    remote = RemoteService(url)
    assert remote.choices == {"omni": (VLLM_OMNI,)} and remote.info("omni").speakers == ["Aiden", "Chelsie", "Ethan"]  # not listed by it
    request = ChatRequest([Turn("user", "Hi!"), Turn("assistant", "Hello."), Turn("user", "", str(reference_wav))], system="Be brief.",
                          speaker="Ethan", seed=2, max_new_tokens=9)
    items = list(remote.chat(request))
    assert [(d.first_token, d.text) for d in items if isinstance(d, TextDelta)] == [(0, "Hello"), (1, " there"), (2, "!")]
    assert np.array_equal(pcm16(audio_of(items)).astype("<i2").tobytes(), VLLM_PCM)  # the WAV pieces joined
    end = next(i for i in items if isinstance(i, ChatEnd))
    assert end.text == "Hello there!" and end.frames == 7 and not end.stopped and isinstance(items[-1], StreamEnd)
    body = bodies[-1]
    assert body["messages"][:3] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                                    {"role": "assistant", "content": "Hello."}]
    (spoken,) = body["messages"][3]["content"]  # a spoken message without text: its recording alone
    assert spoken["type"] == "input_audio" and base64.b64decode(spoken["input_audio"]["data"]) == reference_wav.read_bytes()
    assert {k: body[k] for k in ("model", "modalities", "speaker", "stream", "max_tokens", "seed")} == {
        "model": VLLM_OMNI, "modalities": ["text", "audio"], "speaker": "Ethan", "stream": True, "max_tokens": 9, "seed": 2}
    with pytest.raises(TTSInputError, match="^Unknown speaker Nobody$"):
        next(remote.chat(ChatRequest([Turn("user", "Hi!")], speaker="Nobody")))


# ---- a backend that stalls once its audio has started ----


class StallingBackend:
    """A real HTTP server in vLLM-Omni's shape (one TTS and one Omni model) whose streams send one
    valid 80 ms audio chunk (a chat's after a text event), then nothing until the client goes away:
    a hung backend. Raw sockets, so that what is sent is exactly that."""

    TTS, OMNI = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", "Qwen/Qwen3-Omni-30B-A3B-Instruct"

    def __init__(self):
        import socket

        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._answer, args=(client,), daemon=True).start()

    def _answer(self, client) -> None:
        with client, client.makefile("rb") as reader:
            request_line = reader.readline().decode()
            headers = {}
            while (line := reader.readline().decode().strip()):
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            reader.read(int(headers.get("content-length", 0)))
            if request_line.startswith("GET /v1/models"):
                body = json.dumps({"object": "list", "data": [{"id": self.TTS, "object": "model"}, {"id": self.OMNI, "object": "model"}]}).encode()
                client.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                return
            pcm = pcm16(0.3 * voice_like(0.08)).tobytes()  # one 80 ms frame
            if request_line.startswith("POST /v1/chat/completions"):
                events = [{"choices": [{"delta": {"content": "Hello"}}], "modality": "text"},
                          {"choices": [{"delta": {"content": base64.b64encode(pcm).decode()}}], "modality": "audio"}]
                data, kind = b"".join(b"data: %s\n\n" % json.dumps(e).encode() for e in events), b"text/event-stream"
            else:
                data, kind = pcm, b"audio/pcm"
            client.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (kind, len(data), data))
            reader.read()  # then silence, until the client goes away

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize("kind", ["speech", "chat"])
def test_a_backend_that_stalls_after_its_audio_started_is_named(kind):
    """No audio for longer than the stall rule allows, once audio has started: the stream ends with a
    sentence that says the backend stalled and states the rule (its constants made small here)."""
    from pipeline.remote import StallRule

    backend = StallingBackend()
    try:
        service = RemoteService(backend.url, stall=StallRule(floor_s=0.5, gaps=2.0))
        if kind == "speech":
            stream = service.stream(SpeechRequest(SPEECH, speaker="ryan", model_type="custom_voice", checkpoint=backend.TTS, seed=7))
        else:
            stream = service.chat(ChatRequest([Turn("user", "Hi.")], seed=7), backend.OMNI)
        received = []
        with pytest.raises(BackendUnavailable) as failure:
            for item in stream:
                received.append(item)
        assert sum(isinstance(item, Chunk) for item in received) == 1
        assert (f"The backend at {backend.url} stalled: it sent no audio for 0.5 s after 0.1 s of it "
                "(the limit once audio has started: 2 times its slowest chunk so far, at least 0.5 s)") in str(failure.value)
    finally:
        backend.close()


def test_a_ui_over_a_backend_runs_without_torch(backend):
    """`app.py --backend URL`'s own path: the service from the backend, the whole page built (every tab,
    Omni's included), the launch options; nothing of it imports torch, the engine or Triton."""
    remote, _ = backend
    code = (
        "import sys, app\n"
        f"args = app.build_parser().parse_args(['--backend', {remote.url!r}])\n"
        "service = app.remote_service(args, app.build_parser())\n"
        "from ui.app import build_demo, launch_options\n"
        "build_demo(service)\n"
        "launch_options(None)\n"
        "print(sorted(service.choices), sorted(m for m in ('torch', 'triton', 'pipeline.engine', 'pipeline.service') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "['base', 'custom_voice', 'omni', 'voice_design'] []"
