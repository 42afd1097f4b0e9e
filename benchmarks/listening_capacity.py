"""How many listeners the Listen view carries: `python app.py --tiny` serves an AB session of real
5 s clips (the first seconds of the repo's sample voices, as folder systems), and N listeners, each
its own gradio_client session, do the whole flow at once: open their trial, hear A and B to the end
(waiting each clip's length, then sending its `played` event, as the browser does), vote, and on to
the next trial. Reported: the time from sending a vote to its acknowledgement (the next trial
arriving; the next trial's clips are fetched after it, as the players do), p50 / p95 / max, and the
server's CPU seconds; first for one listener alone (what the machine gives at its present load),
then for N together on the same server. gradio runs ffprobe only where it is on PATH (as in the
Docker image and the Space): put it there to measure what they do.

    python -m benchmarks.listening_capacity [--listeners 20] [--trials 3] [--clip-seconds 5]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import soundfile as sf

from benchmarks.ports import free_port

REPO = Path(__file__).resolve().parents[1]
VOICES = sorted((REPO / "assets" / "voices").glob("*.wav"))
SYSTEMS = {"early": 0.0, "late": 1.0}  # each system's clip of an item starts this many seconds into the voice


def write_session(root: Path, clip_seconds: float, trials: int) -> str:
    """Folder systems under `root` with one clip of `clip_seconds` per item; the session file's text."""
    items = []
    for voice in VOICES:
        audio, rate = sf.read(voice, dtype="float32")
        for system, start in SYSTEMS.items():
            clip = audio[int(start * rate):int((start + clip_seconds) * rate)]
            if len(clip) < int(clip_seconds * rate):
                raise SystemExit(f"{voice.name} is shorter than {start + clip_seconds} s.")
            (root / system).mkdir(parents=True, exist_ok=True)
            sf.write(root / system / f"{voice.stem}.wav", clip, rate)
        items.append(voice.stem)
    systems = "".join(f"  - {{name: {s}, folder: {s}}}\n" for s in SYSTEMS)
    things = "".join(f"  - {{name: {i}, text: The sample voice {i}.}}\n" for i in items)
    return f"name: capacity\ntest: ab\ntrials_per_listener: {trials}\nsystems:\n{systems}items:\n{things}"




def start_app(sessions: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "app.py", "--tiny", "--port", str(port), "--sessions", str(sessions)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def connect(url: str, server: subprocess.Popen, timeout_s: float = 300):
    """A gradio_client session that, like a browser, gets a trial's clips as URLs (fetched while listening)."""
    from gradio_client import Client

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(url, verbose=False, download_files=False)
        except (httpx.HTTPError, OSError):  # not serving yet
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the app did not start") from None
            time.sleep(1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its reaped children (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def clip_urls(outputs) -> list[str]:
    """The URLs of the audio files among a trial's outputs."""
    if isinstance(outputs, dict):
        own = [outputs["url"]] if str(outputs.get("path", "")).endswith(".wav") and outputs.get("url") else []
        return own + [u for v in outputs.values() for u in clip_urls(v)]
    if isinstance(outputs, (list, tuple)):
        return [u for v in outputs for u in clip_urls(v)]
    return []


def listener(client, who: str, trials: int, clip_seconds: float, times: dict, errors: list) -> None:
    """One listener's whole flow; the time of each call until its answer goes to `times`."""

    def timed(kind: str, *args, api_name: str):
        began = time.perf_counter()
        outputs = client.predict(*args, api_name=api_name)
        times[kind].append(time.perf_counter() - began)
        for url in clip_urls(outputs):  # the players load the clips (after the answer: not part of it)
            httpx.get(url, timeout=60).raise_for_status()
            times["clips"].append(url)

    try:
        time.sleep(random.uniform(0, clip_seconds))  # listeners arrive over the first clip's length
        timed("start", "capacity", who, api_name="/listen_start")
        for _ in range(trials):
            for key in ("0", "1"):
                time.sleep(clip_seconds)  # hearing the clip to the end
                timed("played", api_name=f"/listen_played_{key}")
            timed("vote", "capacity", who, "A", None, "", *[50] * 8, api_name="/listen_vote")
    except Exception as exc:  # noqa: BLE001 - counted and reported: one failed listener must not hide the others' figures
        errors.append(f"{who}: {exc!r}")


def percentile(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 3) if values else float("nan")


def crowd(url: str, server: subprocess.Popen, prefix: str, listeners: int, trials: int, clip_seconds: float) -> dict:
    """`listeners` at once through their whole sessions; their acknowledgement times and the server's CPU."""
    times: dict[str, list] = {"start": [], "played": [], "vote": [], "clips": []}
    errors: list[str] = []
    clients = [connect(url, server) for _ in range(listeners)]  # each its own gradio session, connected before the clock starts
    threads = [threading.Thread(target=listener, args=(client, f"{prefix}-{n}", trials, clip_seconds, times, errors))
               for n, client in enumerate(clients)]
    cpu_before, wall_before = cpu_seconds(server.pid), time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cpu, wall = cpu_seconds(server.pid) - cpu_before, time.perf_counter() - wall_before
    votes = times["vote"]
    return {
        "listeners": listeners, "votes": len(votes), "clips_fetched": len(times["clips"]), "errors": errors,
        "vote_ack_s": {"p50": percentile(votes, 50), "p95": percentile(votes, 95), "max": round(max(votes, default=float("nan")), 3)},
        "start_ack_s": {"p50": percentile(times["start"], 50), "p95": percentile(times["start"], 95)},
        "played_ack_s": {"p50": percentile(times["played"], 50), "p95": percentile(times["played"], 95)},
        "server_cpu_s": round(cpu, 2), "wall_s": round(wall, 1), "load_average_1min_at_end": round(os.getloadavg()[0], 1),
    }


def run(listeners: int, trials: int, clip_seconds: float) -> dict:
    """One listener alone (the machine's own latency), then `listeners` at once, on one server."""
    with tempfile.TemporaryDirectory(prefix="listening-capacity-") as folder:
        root = Path(folder)
        session_text = write_session(root, clip_seconds, trials)
        port = free_port()
        url = f"http://127.0.0.1:{port}/"
        server = start_app(root, port)
        try:
            connect(url, server).predict(session_text, api_name="/session_save")  # renders: loudness-matches the folders' clips
            alone = crowd(url, server, "alone", 1, trials, clip_seconds)
            together = crowd(url, server, "crowd", listeners, trials, clip_seconds)
        finally:
            server.kill()
            server.wait()
    return {
        "clip_seconds": clip_seconds, "trials_per_listener": trials, "one_listener": alone, "crowd": together,
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs", "ffprobe_on_path": shutil.which("ffprobe") is not None,
        "date": datetime.date.today().isoformat(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.listening_capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listeners", type=int, default=20)
    parser.add_argument("--trials", type=int, default=3, help="trials each listener answers (default %(default)s)")
    parser.add_argument("--clip-seconds", type=float, default=5.0)
    args = parser.parse_args(argv)
    result = run(args.listeners, args.trials, args.clip_seconds)
    print(json.dumps(result, indent=2))
    return 1 if result["one_listener"]["errors"] or result["crowd"]["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
