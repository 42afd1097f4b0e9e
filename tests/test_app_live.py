"""The app served on localhost with the tiny checkpoints, driven through `gradio_client` and the PCM
route: every tab streams, every bad input gets its own message and the app keeps serving, Stop
frees the engine's row at once, and several sessions are served at the same time; listening
sessions take 20 voters at once and keep every acknowledged vote through a killed server.

No test asserts a duration: each waits for what it checks, and HANG_GUARD_S only ends a wait that
would never end, so a slow or busy machine makes them slower, never red."""
import os
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from conftest import read_pcm, tables, voice_like
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

from pipeline.service import TINY

SPEECH = "Hello there, this is a test of the streaming demo."
SHORT = (0.9, 50, 1.0, 1.05, 7, "1, 2, 4, 8, 16", 2)  # sampling, seed 7, schedule, 2 s max
LONG = (0.9, 50, 1.0, 1.05, 7, "1", 160)  # one frame per chunk, up to 160 s: runs until stopped
HANG_GUARD_S = 600  # ends a wait for something that never comes; no wait decides pass or fail by its duration
LISTENING_CLIP_S = 6 * 0.08  # the listening sessions below render at most 6 frames of 80 ms a clip


def hear(clips: int) -> None:
    """What a listener does between a trial's showing and the vote: hear its clips to the end, one after
    another (the server refuses a vote sooner than that; the tiny model's clips are at most this long)."""
    time.sleep(clips * LISTENING_CLIP_S)


def connect(url: str) -> Client:
    """A gradio_client session whose HTTP calls wait as long as the server needs (httpx's default is 5 s)."""
    return Client(url, verbose=False, httpx_kwargs={"timeout": HANG_GUARD_S})


@pytest.fixture(scope="module")
def server(live_app):
    url, service, _ = live_app
    return {"url": url, "service": service}


@pytest.fixture()
def client(server) -> Client:
    return connect(server["url"])


@pytest.fixture(scope="module")
def speaker(server) -> str:
    return server["service"].info("custom_voice").speakers[0]


@pytest.mark.parametrize("tab", ["clone", "custom", "design"])
def test_each_tab_streams_chunks_to_the_table_and_the_pcm_route(server, client, speaker, reference_wav, tab):
    run_id = f"{tab}-test-{time.time_ns()}"
    inputs = {
        "clone": (TINY, handle_file(str(reference_wav)), "Speak slowly and warmly.", False, None, SPEECH, "auto"),
        "custom": (TINY, speaker, "", SPEECH, "english"),
        "design": (TINY, "A calm, low female voice.", SPEECH, "auto"),
    }[tab]
    frames, opened = [], threading.Event()
    reader = threading.Thread(target=read_pcm, args=(server["url"], run_id, frames, opened))
    reader.start()
    assert opened.wait(HANG_GUARD_S)
    outputs = list(client.submit(*inputs, *SHORT, run_id, api_name=f"/{tab}_generate"))
    reader.join(HANG_GUARD_S)
    rows = tables(outputs)[-1]
    assert len(rows) >= 3 and [r[0] for r in rows] == list(range(len(rows)))
    total_frames = sum(r[1] for r in rows)
    pcm = [f for _, f in frames if f]
    assert len(pcm) == len(rows)  # one PCM frame per chunk, none lost or merged
    assert sum(len(f) for f in pcm) == total_frames * 1920 * 2  # 16-bit samples
    wav_path = outputs[-1][3]
    audio, rate = sf.read(wav_path, dtype="int16")
    assert rate == 24000 and np.array_equal(audio, np.frombuffer(b"".join(pcm), "<i2"))
    summary = [o[0] for o in outputs if isinstance(o[0], str)][-1]
    assert "TTFA" in summary and "final RTF" in summary


def test_errors_have_specific_messages_and_the_app_keeps_serving(server, client, speaker, reference_wav, tmp_path):
    notes = tmp_path / "notes.wav"
    notes.write_text("this is not audio")
    silent = tmp_path / "silent.wav"
    sf.write(silent, np.zeros(48000, np.float32), 24000)
    short = tmp_path / "short.wav"
    sf.write(short, voice_like(0.4), 24000)
    cases = [
        ("/custom_generate", (TINY, speaker, "", "   ", "auto"), "The text is empty"),
        ("/custom_generate", (TINY, speaker, "", "x" * 5001, "auto"), "the limit is 5000 characters"),
        ("/custom_generate", (TINY, "nobody", "", SPEECH, "auto"), "Unknown speaker 'nobody'"),
        ("/design_generate", (TINY, "A calm voice.", SPEECH, "klingon"), "Unsupported language 'klingon'"),
        ("/clone_generate", (TINY, None, "", False, None, SPEECH, "auto"), "No reference audio"),
        ("/clone_generate", (TINY, handle_file(str(reference_wav)), "", False, None, SPEECH, "auto"), "needs the transcript"),
        ("/clone_generate", (TINY, handle_file(str(notes)), "Hi.", False, None, SPEECH, "auto"), "could not be read as audio"),
        ("/clone_generate", (TINY, handle_file(str(silent)), "Hi.", False, None, SPEECH, "auto"), "is silent"),
        ("/clone_generate", (TINY, handle_file(str(short)), "Hi.", False, None, SPEECH, "auto"), "must be at least 1 s"),
    ]
    for api_name, inputs, message in cases:
        with pytest.raises(AppError, match=message):
            client.predict(*inputs, *SHORT, "", api_name=api_name)
    # Still serving, on the same model the errors went to.
    outputs = list(client.submit(TINY, speaker, "", SPEECH, "auto", *SHORT, "", api_name="/custom_generate"))
    assert len(tables(outputs)[-1]) >= 3


def test_upload_over_50_mb_is_refused_with_the_limit(server, client, tmp_path):
    big = tmp_path / "big.wav"
    with open(big, "wb") as f:
        f.truncate(51 * 2**20)
    with pytest.raises(Exception, match="exceeds the maximum file size of 52428800 bytes"):
        client.predict(TINY, handle_file(str(big)), "Hi.", False, None, SPEECH, "auto", *SHORT, "", api_name="/clone_generate")
    # The server refuses it too, before storing it, whatever the client checked.
    with open(big, "rb") as f:
        response = httpx.post(f"{server['url']}gradio_api/upload", files={"files": ("big.wav", f)}, timeout=60)
    assert response.status_code == 413 and "maximum allowed size" in response.text


def wait_until(condition, what: str) -> None:
    """Poll until `condition()` holds (HANG_GUARD_S ends a wait that never would)."""
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def test_sessions_on_one_model_share_its_batch_and_stop_frees_the_row(server, speaker):
    first, second = connect(server["url"]), connect(server["url"])
    engine = server["service"].model("custom_voice").engine
    run_id = f"stop-test-{time.time_ns()}"
    long_job = first.submit(TINY, speaker, "", SPEECH, "auto", *LONG, run_id, api_name="/custom_generate")
    wait_until(lambda: long_job.outputs() and any(engine.slots), "the long session's first update and its row")
    (held,) = [row.handle for row in engine.slots if row]
    # The model's engine batches utterances: a second session on the same model streams while the
    # first, which runs until stopped, still holds its row (one after the other, it would wait for the stop).
    other = second.submit(TINY, speaker, "", SPEECH, "auto", *SHORT, "", api_name="/custom_generate")
    wait_until(other.outputs, "the second session's first update")
    assert not long_job.done() and not held.stopped
    first.predict(run_id, api_name="/custom_stop")
    long_job.result(timeout=HANG_GUARD_S)
    assert len(tables(list(other))[-1]) >= 3
    wait_until(lambda: not any(engine.slots), "the rows freed")
    assert held.stopped  # the long session's row was freed by the Stop, not by the utterance's end


def test_sessions_on_different_models_stream_at_the_same_time(server, speaker, reference_wav):
    clients = [connect(server["url"]) for _ in range(3)]
    jobs = [
        clients[0].submit(TINY, speaker, "", SPEECH, "auto", *SHORT, "", api_name="/custom_generate"),
        clients[1].submit(TINY, "A calm, low female voice.", SPEECH, "auto", *SHORT, "", api_name="/design_generate"),
        clients[2].submit(TINY, handle_file(str(reference_wav)), "Hi.", True, None, SPEECH, "auto", *SHORT, "", api_name="/clone_generate"),
    ]
    for job in jobs:
        assert len(tables(list(job))[-1]) >= 3


def test_twenty_listeners_voting_at_once_through_gradio_client_lose_no_vote(live_app):
    """Each simulated listener is its own gradio_client session: start, hear both clips, vote, all
    at once; every vote is stored once, and a vote sent twice is refused, not duplicated."""
    url, _, sessions = live_app
    sessions.save("name: crowd\ntest: ab\ntrials_per_listener: 3\nsystems:\n"
                  "  - {name: p, checkpoint: tiny, mode: voice_design, seed: 1, settings: {max_frames: 6}}\n"
                  "  - {name: q, checkpoint: tiny, mode: voice_design, seed: 2, settings: {max_frames: 6}}\n"
                  "items:\n  - {name: one, text: Hello there., instruct: A calm voice.}\n")
    sessions.render("crowd")
    errors = []

    def listener(n: int) -> None:
        try:
            client = connect(url)
            client.predict("crowd", f"l{n}", api_name="/listen_start")
            for _ in range(3):
                client.predict(api_name="/listen_played_0")
                client.predict(api_name="/listen_played_1")
                hear(2)
                client.predict("crowd", f"l{n}", "B", None, "", *[50] * 8, api_name="/listen_vote")
        except Exception as exc:  # collected: an assert in a thread would not fail the test
            errors.append(exc)

    threads = [threading.Thread(target=listener, args=(n,)) for n in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD_S)
    assert not any(t.is_alive() for t in threads), "a listener never finished"
    assert not errors, errors[:3]
    votes = sessions.store.votes(sessions.session("crowd"))
    assert len(votes) == 60 and len({(v["listener"], v["trial"]) for v in votes}) == 60


def test_killing_the_server_mid_session_keeps_every_acknowledged_vote(tmp_path):
    """`python app.py` as its own process: votes go in through the API, the process is killed with
    SIGKILL mid-session, a new one starts on the same sessions folder, and the listener resumes
    exactly after the last acknowledged vote."""
    import signal
    import subprocess
    import sys
    import time as clock

    from conftest import free_port

    repo = Path(__file__).resolve().parents[1]
    sessions_dir = tmp_path / "sessions"
    session_text = ("name: durable\ntest: ab\ntrials_per_listener: 6\nsystems:\n"
                    "  - {name: p, checkpoint: tiny, mode: voice_design, seed: 1, settings: {max_frames: 6}}\n"
                    "  - {name: q, checkpoint: tiny, mode: voice_design, seed: 2, settings: {max_frames: 6}}\n"
                    "items:\n  - {name: one, text: Hello there., instruct: A calm voice.}\n")

    def start() -> tuple[subprocess.Popen, Client]:
        port = free_port()
        server = subprocess.Popen([sys.executable, "app.py", "--tiny", "--port", str(port), "--sessions", str(sessions_dir)], cwd=repo,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        deadline = clock.monotonic() + HANG_GUARD_S
        while True:
            try:
                return server, connect(f"http://127.0.0.1:{port}/")
            except Exception:
                if clock.monotonic() > deadline or server.poll() is not None:
                    server.kill()
                    raise
                clock.sleep(1)

    server, client = start()
    try:
        client.predict(session_text, api_name="/session_save")
        client.predict("durable", "ann", api_name="/listen_start")
        for _ in range(4):
            client.predict(api_name="/listen_played_0")
            client.predict(api_name="/listen_played_1")
            hear(2)
            client.predict("durable", "ann", "A", None, "", *[50] * 8, api_name="/listen_vote")  # acknowledged on return
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
    server, client = start()
    try:
        progress = client.predict("durable", "ann", api_name="/listen_start")[0]
        assert "Trial **5** of 6" in progress
    finally:
        server.kill()
        server.wait()
    from pipeline.listening import Sessions

    votes = Sessions(sessions_dir, None).store.votes(Sessions(sessions_dir, None).session("durable"))
    assert [v["trial"] for v in votes] == [0, 1, 2, 3]


def test_one_listener_in_two_tabs_votes_each_trial_once(live_app):
    url, _, sessions = live_app
    sessions.save("name: tabs\ntest: ab\ntrials_per_listener: 2\nsystems:\n"
                  "  - {name: p, checkpoint: tiny, mode: voice_design, seed: 1, settings: {max_frames: 6}}\n"
                  "  - {name: q, checkpoint: tiny, mode: voice_design, seed: 2, settings: {max_frames: 6}}\n"
                  "items:\n  - {name: one, text: Hello there., instruct: A calm voice.}\n")
    sessions.render("tabs")
    first, second = connect(url), connect(url)
    for tab in (first, second):
        assert "Trial **1** of 2" in tab.predict("tabs", "ann", api_name="/listen_start")[0]
    with pytest.raises(AppError, match="Play A and B to the end before voting."):
        first.predict("tabs", "ann", "A", None, "", *[50] * 8, api_name="/listen_vote")
    for tab in (first, second):
        tab.predict(api_name="/listen_played_0")
        tab.predict(api_name="/listen_played_1")
    hear(2)
    assert "Trial **2** of 2" in first.predict("tabs", "ann", "A", None, "", *[50] * 8, api_name="/listen_vote")[0]
    # The second tab still shows trial 1: its vote is refused, not stored twice, and it moves on to trial 2.
    assert "Trial **2** of 2" in second.predict("tabs", "ann", "B", None, "", *[50] * 8, api_name="/listen_vote")[0]
    votes = sessions.store.votes(sessions.session("tabs"))
    assert [(v["trial"], v["choice"]) for v in votes] == [(0, votes[0]["clips"][0])]



def test_an_abx_listener_through_the_api(live_app):
    """ABX: A, B and X must each be heard; the answer is stored with the system X was."""
    url, _, sessions = live_app
    sessions.save("name: abx-api\ntest: abx\ntrials_per_listener: 2\nsystems:\n"
                  "  - {name: p, checkpoint: tiny, mode: voice_design, seed: 1, settings: {max_frames: 6}}\n"
                  "  - {name: q, checkpoint: tiny, mode: voice_design, seed: 2, settings: {max_frames: 6}}\n"
                  "items:\n  - {name: one, text: Hello there., instruct: A calm voice.}\n")
    sessions.render("abx-api")
    client = connect(url)
    client.predict("abx-api", "ann", api_name="/listen_start")
    client.predict(api_name="/listen_played_0")
    client.predict(api_name="/listen_played_1")
    with pytest.raises(AppError, match="Play X to the end before voting."):
        client.predict("abx-api", "ann", "A", None, "", *[50] * 8, api_name="/listen_vote")
    client.predict(api_name="/listen_played_x")
    hear(3)
    client.predict("abx-api", "ann", "A", "4", "", *[50] * 8, api_name="/listen_vote")
    (vote,) = sessions.store.votes(sessions.session("abx-api"))
    assert vote["choice"] == vote["clips"][0] and vote["x"] in vote["clips"] and vote["confidence"] == 4
    result = sessions.results("abx-api")["abx"]["listeners"]["ann"]
    assert result["trials"] == 1 and result["correct"] == int(vote["x"] == vote["choice"])
