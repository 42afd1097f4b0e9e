"""Smoke run of the app as the README installs it: `python app.py --tiny` started with the Python that
runs this script (.ci/run builds its environment with the README's "Without a GPU" commands), then
through the HTTP API one speech generation and one Omni chat turn, each checked for real audio (a
valid WAV, not empty, not silent) and the chat turn for its text. Any failure exits 1 with one line
saying what failed and the tail of the app's log. Standard library only: it runs before the test
requirements are installed anywhere."""
from __future__ import annotations

import base64
import io
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import wave
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 600  # a first start imports torch and gradio; a busy CI machine takes minutes
REQUEST_TIMEOUT_S = 600  # a request loads its tiny checkpoint (written on first use) before it generates
POLL_INTERVAL_S = 1.0
LOG_TAIL_LINES = 60
SPEECH_TEXT = "Hello from the README's CPU install."
CHAT_MESSAGE = "Hi! Say something short."
SAMPLE_RATE = 24000


class SmokeFailure(Exception):
    """One sentence: what the installed app did wrong."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(port: int, log: Path, sessions: Path) -> subprocess.Popen:
    """`python app.py --tiny` on `port`, its output in `log` (listening sessions in a scratch folder)."""
    command = [sys.executable, "app.py", "--tiny", "--port", str(port), "--sessions", str(sessions)]
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def wait_until_answering(app: subprocess.Popen, url: str) -> float:
    """Seconds until `GET url` answers 200; a failure if the app exits or the deadline passes first."""
    started = time.monotonic()
    while time.monotonic() - started < START_TIMEOUT_S:
        if app.poll() is not None:
            raise SmokeFailure(f"python app.py --tiny exited with code {app.returncode} before it answered.")
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, OSError):
            pass  # not listening yet
        time.sleep(POLL_INTERVAL_S)
    raise SmokeFailure(f"python app.py --tiny did not answer GET {url} within {START_TIMEOUT_S} s.")


def call(url: str, body: dict | None = None) -> tuple[bytes, str]:
    """GET (no body) or POST a JSON body: the response's bytes and content type; any HTTP error is a failure naming it."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        raise SmokeFailure(f"{request.get_method()} {url} answered HTTP {exc.code}: {exc.read()[:1000].decode(errors='replace')}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise SmokeFailure(f"{request.get_method()} {url} failed: {exc}") from None


def call_json(url: str, body: dict | None = None) -> dict:
    data, content_type = call(url, body)
    try:
        return json.loads(data)
    except ValueError:
        raise SmokeFailure(f"{url} answered {content_type or 'no content type'}, not JSON: {data[:200]!r}") from None


def check_wav(data: bytes, what: str) -> float:
    """Seconds of audio in `data`, a 16-bit mono 24 kHz WAV with at least one sample that is not zero."""
    try:
        with wave.open(io.BytesIO(data)) as wav:
            shape = (wav.getnchannels(), wav.getsampwidth(), wav.getframerate())
            frames = wav.readframes(wav.getnframes())
    except (wave.Error, EOFError) as exc:
        raise SmokeFailure(f"{what} is not a valid WAV file ({exc}; {len(data)} bytes).") from None
    if shape != (1, 2, SAMPLE_RATE):
        raise SmokeFailure(f"{what} is a WAV of {shape[0]} channel(s), {8 * shape[1]} bits, {shape[2]} Hz; expected mono 16-bit {SAMPLE_RATE} Hz.")
    if not frames:
        raise SmokeFailure(f"{what} holds no audio.")
    if not any(frames):  # every byte zero: every sample is silence
        raise SmokeFailure(f"{what} is silent ({len(frames) // 2} samples, all zero).")
    return len(frames) / 2 / SAMPLE_RATE


def voices(base: str, task_type: str) -> list[str]:
    """The voices of the tiny checkpoint of `task_type` (loading it, as the first request would)."""
    entry = call_json(f"{base}/v1/models/tiny?task_type={task_type}")
    if not entry.get("voices"):
        raise SmokeFailure(f"GET /v1/models/tiny?task_type={task_type} lists no voices: {entry}")
    return entry["voices"]


def speak(base: str) -> str:
    body = {"input": SPEECH_TEXT, "task_type": "CustomVoice", "voice": voices(base, "CustomVoice")[0], "response_format": "wav", "seed": 1,
            "max_new_tokens": 25}
    data, _ = call(f"{base}/v1/audio/speech", body)
    return f"speech: {check_wav(data, 'The WAV from POST /v1/audio/speech'):.2f} s of audio"


def chat(base: str) -> str:
    body = {"messages": [{"role": "user", "content": CHAT_MESSAGE}], "audio": {"voice": voices(base, "Omni")[0], "format": "wav"}, "seed": 1,
            "max_tokens": 16}
    completion = call_json(f"{base}/v1/chat/completions", body)
    try:
        message = completion["choices"][0]["message"]
        text, audio = message["content"], message["audio"]["data"]
    except (KeyError, IndexError, TypeError):
        raise SmokeFailure(f"POST /v1/chat/completions answered without text and audio: {json.dumps(completion)[:1000]}") from None
    if not isinstance(text, str) or not text.strip():
        raise SmokeFailure(f"POST /v1/chat/completions answered no text (content {text!r}).")
    seconds = check_wav(base64.b64decode(audio), "The reply's audio from POST /v1/chat/completions")
    return f"Omni chat: {len(text)} characters of text, {seconds:.2f} s of audio"


def log_tail(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(lines[-LOG_TAIL_LINES:]) or "(the app wrote nothing)"


def main() -> int:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="readme-smoke-") as scratch:
        log = Path(scratch) / "app.log"
        app = start_app(port, log, Path(scratch) / "listening")
        try:
            print(f"smoke: python app.py --tiny answered after {wait_until_answering(app, base + '/'):.0f} s", flush=True)
            for step in (speak, chat):
                print(f"smoke: {step(base)}", flush=True)
        except SmokeFailure as failure:
            print(f"README install smoke run FAILED: {failure}\n--- last lines of the app's log ---\n{log_tail(log)}", file=sys.stderr)
            return 1
        finally:
            app.terminate()
            try:
                app.wait(timeout=30)
            except subprocess.TimeoutExpired:
                app.kill()
                app.wait()
    print("smoke: the README's CPU install serves speech and Omni chat")
    return 0


if __name__ == "__main__":
    sys.exit(main())
