"""Whether the page stays fast while API streams wait for a row: `python app.py --tiny --rows 1`
serves, N streamed `POST /v1/audio/speech` requests are opened at once (half CustomVoice, half
VoiceDesign: each model's one row runs one of them, the others wait in its queue; each client
address has one, as the API allows a client a few requests in flight), and while they wait the
page is loaded again and again: `GET /` and every script the page names. Reported: the page's and
its scripts' load time, p50 / max, idle and with the streams waiting, and how many streams were
still waiting for their first audio at each load.

    python -m benchmarks.waiting_streams [--streams 100] [--loads 10]
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urljoin

import httpx

from benchmarks.ports import free_port

REPO = Path(__file__).resolve().parents[1]
TEXT = ("The streaming demo speaks while it is still writing the rest of the sentence, and the page that shows it "
        "should answer at once, however many listeners wait for their turn. ") * 3
TASKS = ({"task_type": "CustomVoice", "voice": "ryan"}, {"task_type": "VoiceDesign", "instructions": "A calm, low female voice."})




def start_app(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "app.py", "--tiny", "--rows", "1", "--port", str(port), "--sessions", tempfile.mkdtemp(prefix="sessions-")],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def wait_ready(url: str, app: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and app.poll() is None:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("The app did not start.")


def body(task: dict) -> dict:
    return {"input": TEXT, "response_format": "pcm", "stream": True, "seed": 1, **task}


async def load_page(client: httpx.AsyncClient, url: str, timeout: float) -> tuple[float, float | None, int]:
    """Seconds to GET /, seconds to then get every script it names (one after the other; None if the
    page did not come), how many scripts; a load that takes longer than `timeout` counts as `timeout`."""
    start = time.perf_counter()
    try:
        page = (await client.get(url, timeout=timeout)).raise_for_status()
    except httpx.TimeoutException:
        return timeout, None, 0
    page_s = time.perf_counter() - start
    scripts = sorted(set(re.findall(r'<script[^>]*\bsrc="([^"]+)"', page.text)) | set(re.findall(r'<link[^>]*\bhref="([^"]+\.js)"', page.text)))
    start = time.perf_counter()
    try:
        for script in scripts:
            (await client.get(urljoin(url, script), timeout=timeout)).raise_for_status()
    except httpx.TimeoutException:
        return page_s, timeout, len(scripts)
    return page_s, time.perf_counter() - start, len(scripts)


class Streams:
    """N streamed requests, each from its own loopback address, held open; which have had audio."""

    def __init__(self, url: str, count: int):
        self.url, self.count = url, count
        self.heard = [False] * count
        self.answered = [False] * count
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._one(n)) for n in range(self.count)]

    async def _one(self, n: int) -> None:
        address = f"127.0.{1 + (n + 1) // 250}.{1 + (n + 1) % 250}"
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address=address), timeout=None) as client:
            async with client.stream("POST", f"{self.url}v1/audio/speech", json=body(TASKS[n % len(TASKS)])) as response:
                self.answered[n] = response.status_code == 200
                async for _ in response.aiter_bytes():
                    self.heard[n] = True

    @property
    def waiting(self) -> int:
        return sum(1 for task, heard in zip(self.tasks, self.heard) if not heard and not task.done())

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def summary(values: list[float | None], timeout: float) -> str:
    values = [value for value in values if value is not None]
    if not values:
        return "not measured"
    late = sum(value >= timeout for value in values)
    return f"p50 {statistics.median(values) * 1000:.0f} ms, max {max(values) * 1000:.0f} ms" + (f" ({late} of {len(values)} timed out)" if late else "")


async def measure(url: str, streams: int, loads: int, timeout: float) -> dict:
    async with httpx.AsyncClient() as client:
        for task in TASKS:  # load both models now: the streams then wait for rows, not for loading
            (await client.post(f"{url}v1/audio/speech", json={**body(task), "stream": False, "max_new_tokens": 2}, timeout=300)).raise_for_status()
        idle = [await load_page(client, url, timeout) for _ in range(loads)]
        waiting = Streams(url, streams)
        waiting.start()
        await asyncio.sleep(3.0)  # the requests reach the server and the engines' queues
        busy, counts = [], []
        for _ in range(loads):
            counts.append(waiting.waiting)
            busy.append(await load_page(client, url, timeout))
        answered = sum(waiting.answered)
        await waiting.close()
    return {"idle_page": summary([load[0] for load in idle], timeout), "idle_scripts": summary([load[1] for load in idle], timeout),
            "busy_page": summary([load[0] for load in busy], timeout), "busy_scripts": summary([load[1] for load in busy], timeout),
            "scripts_per_load": max(load[2] for load in idle), "waiting_at_loads": f"{min(counts)}-{max(counts)}", "streams_answered_200": answered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=100, help="streams opened at once (default %(default)s)")
    parser.add_argument("--loads", type=int, default=10, help="page loads measured, idle and with the streams waiting (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds after which a load counts as that long (default %(default)s)")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    app = start_app(port)
    try:
        wait_ready(url, app)
        result = asyncio.run(measure(url, args.streams, args.loads, args.timeout))
    finally:
        app.kill()
        app.wait()
    result.update(streams=args.streams, loads=args.loads, date=datetime.date.today().isoformat(),
                  machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python {platform.python_version()}",
                  command=f"python -m benchmarks.waiting_streams --streams {args.streams} --loads {args.loads} --timeout {args.timeout:g}")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
