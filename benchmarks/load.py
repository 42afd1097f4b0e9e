"""Requests arriving at a rate, as a service sees them: `python -m benchmarks.load`.

For each request rate, Poisson arrivals for a fixed time (seeded); each request speaks a sentence of
SENTENCES (a seeded choice), which at the speaking rate of CHARS_PER_SECOND gives 3-20 s of speech,
and asks for that many frames. Two clients, each on a run of its own with the same arrivals: in
process (`ModelService.stream`, the UI's path) and through the HTTP API (`POST /v1/audio/speech`,
streamed PCM read with httpx from the app's own routes, served by uvicorn in this process; the HTTP
clients run in a process of their own, as a service's clients do).

Measured at the client, per rate: time to first audio (p50 / p95 / p99) from the request to its first
audio; the share of streams that stutter (a piece of audio arriving after the audio received before
it has played: playback starts at the first piece, and resumes with the piece that ends a stall);
audio-seconds delivered per second of the run; in the engine, the most requests waiting for a row,
the most rows busy and where the streams' first chunks spent their time (pipeline.engine's
FirstChunkPath); GPU memory at its peak (allocated, reserved). A sweep over rates stops after
the first rate whose p95 time to first audio is over 100 ms, where a stream stutters, or where a
request fails or is cut (`--keep-going` runs every rate). `--repeats N` runs each rate N times with the
same arrivals, one after another, to show the spread from run to run; a rate holds only where every run
of it holds. `--profile`: torch.profiler over a window of
each run's arrivals (PROFILE_AT_S in, PROFILE_FOR_S long), reporting GPU kernel time per CUDA stream
(the decode step's and each vocoder lane's) and the share of the window some kernel ran; the
profiler slows the run, so a profiled run's other figures are not comparable with an unprofiled one's.

Random weights at the real 0.6B and 1.7B CustomVoice sizes (benchmarks.speed's `random_tts`: the
codec head's EOS row is zeroed, so every request makes the frames its text asks for), compiled and
captured as the app serves them, with the rows the app plans from the GPU's memory
(pipeline.memory_plan) unless `--rows`. `--tiny`: the tiny random checkpoint on the CPU, to try the
script. Writes JSON, markdown and a PNG (with matplotlib) into --out (GPU, torch, date, command).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from benchmarks.ports import free_port
from benchmarks.speed import random_tts, report_header, save_figure, write_report
from pipeline.engine import Chunk
from pipeline.engine.core import FirstChunkPath
from pipeline.released import SIZES
from pipeline.request import SpeechRequest
from pipeline.server import Access, speech_routes
from pipeline.service import ModelService
from pipeline.tts import DEFAULT_MAX_SEQ, SAMPLES_PER_FRAME, TTS

SAMPLE_RATE = 24000
FRAMES_PER_SECOND = 12.5
CHARS_PER_SECOND = 15.0  # English read aloud: ~150 words a minute, ~6 characters a word with its space
SPEAKER, LANGUAGE = "ryan", "english"
CHECKPOINT = "random-CustomVoice"  # the name the service and the API serve the benchmark's model under
TTFA_LIMIT_MS = 100.0  # a rate holds with p95 time to first audio at most this and no stream stuttering
PATHS = ("process", "http")
SAMPLE_EVERY_S = 0.005  # how often the engine's queue is looked at
JOIN_GUARD_S = 60.0  # a client that has not ended this long after its stream was cut is a hang
PROFILE_AT_S, PROFILE_FOR_S = 5.0, 2.0  # the profiled window of a run (--profile), from its first arrival

# 3-20 s of speech at CHARS_PER_SECOND (45-300 characters), spread over that range.
SENTENCES = (
    "Your table for two is ready now; please follow me.",
    "The train to Boston leaves from platform nine.",
    "Please remember to water the tomatoes before you leave.",
    "Thank you for calling; all of our agents are busy with other customers right now.",
    "The museum opens at ten on weekdays and at nine on Saturdays, and it is closed on Mondays.",
    "Turn left at the second traffic light, then keep going straight until you see the old stone bridge over the river.",
    "Our quarterly results exceeded expectations, driven mostly by strong demand in Europe and a steady recovery in the Asian markets.",
    "Before you start the installation, make sure the power is switched off at the main breaker and that you have the right screwdriver at hand.",
    "The storm is expected to reach the coast late tonight, bringing heavy rain, strong winds and a "
    "chance of flooding in the low-lying areas near the harbour.",
    "She opened the letter slowly, read the first line twice, and then sat down by the window, "
    "watching the rain run in thin silver lines down the glass.",
    "To reset your password, open the settings page, choose security, and follow the link we send to "
    "your email address; the link stays valid for thirty minutes.",
    "In the morning session we will review the budget, discuss the timeline for the new warehouse, and hear "
    "a short update from the marketing team about the spring campaign.",
    "The first settlers arrived in the valley more than three hundred years ago, drawn by the fertile soil and the "
    "river, which gave them water, fish and a road to the sea in the same gift.",
    "When the orchestra finally began to play, the whole hall fell silent, and for a few minutes nobody moved, as if "
    "everyone were afraid that a single breath might break the spell of the music.",
    "Your order has been shipped and should arrive within three to five business days; you can follow its progress with the "
    "tracking number in the confirmation email we sent you this morning, and call us any time.",
    "The committee has reviewed every application with great care, and although the decision was difficult, we are pleased to tell "
    "you that your project has been selected for funding in the coming year, starting in March.",
    "Scientists studying the glacier found that it had retreated almost two kilometres in the last fifty years, and their models suggest "
    "that at the current rate of warming it could disappear entirely before the end of the century.",
    "Good evening and welcome to the show; tonight we have a wonderful lineup for you, including a conversation with the author of this "
    "year's most talked-about novel, a performance by a young jazz quartet, and, as always, your letters.",
    "It was late in the autumn when the travellers reached the inn at the edge of the forest, tired, cold and hungry after many days on the "
    "road, and the innkeeper, a kind old woman with bright eyes, gave them soup, bread and a warm fire.",
    "Ladies and gentlemen, the captain has turned on the fasten seat belt sign; we are now starting our descent into Chicago, so please "
    "return to your seats, make sure your tray tables are stowed, and that your seat backs are fully upright.",
    "This is a reminder that the library will be closed next Monday for the public holiday; books due that day can be returned on Tuesday without a fine, and the "
    "online catalogue, the e-book lending service and the research help desk will all stay open as usual throughout the long weekend.",
    "After three long years of planning, fundraising and construction, the new children's hospital finally opened its doors this morning, with two hundred beds, a rooftop "
    "garden, a school for long-stay patients, and over a thousand doctors, nurses and volunteers ready to welcome the first families.",
)


def speech_frames(text: str) -> int:
    """Frames of speech `text` takes when read at CHARS_PER_SECOND."""
    return round(len(text) / CHARS_PER_SECOND * FRAMES_PER_SECOND)


@dataclass(frozen=True)
class Arrival:
    """One request of a run: when it is sent (s after the run starts), what it says and how many frames it asks for."""

    index: int
    at: float
    text: str
    frames: int

    @property
    def samples(self) -> int:
        return self.frames * SAMPLES_PER_FRAME


def workload(rate: float, duration: float, seed: int) -> list[Arrival]:
    """Poisson arrivals at `rate` requests a second during `duration` seconds, each with a sentence drawn from SENTENCES."""
    rng = np.random.default_rng(seed)
    arrivals, at = [], rng.exponential(1.0 / rate)
    while at < duration:
        text = SENTENCES[rng.integers(len(SENTENCES))]
        arrivals.append(Arrival(len(arrivals), float(at), text, speech_frames(text)))
        at += rng.exponential(1.0 / rate)
    return arrivals


def stalls(times: list[float], seconds: list[float]) -> list[float]:
    """Where playback runs dry: pieces of audio of `seconds` arriving at `times` (s), played from the first
    arrival on; each piece that arrives after the audio before it has played is a stall (its length, s), and
    playback resumes with it."""
    return [length for _, length in stall_points(times, seconds)]


def stall_points(times: list[float], seconds: list[float]) -> list[tuple[float, float]]:
    """`stalls` with where each happened: (seconds of audio received before the late piece, stall length)."""
    if not times:
        return []
    found, played_until, received = [], times[0] + seconds[0], seconds[0]
    for at, length in zip(times[1:], seconds[1:], strict=True):
        if at > played_until:
            found.append((received, at - played_until))
            played_until = at
        played_until += length
        received += length
    return found


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50, p95, p99 and the largest of `values` (linear interpolation, as numpy's); None for each where there are none."""
    if not values:
        return {"p50": None, "p95": None, "p99": None, "max": None}
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "max": float(max(values))}


@dataclass
class Stream:
    """What one client received: when each piece of audio arrived (s after the request was sent) and its length (s)."""

    arrival: Arrival
    times: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    samples: int = 0
    error: str | None = None

    def add(self, at: float, samples: int) -> None:
        self.times.append(at)
        self.seconds.append(samples / SAMPLE_RATE)
        self.samples += samples

    @property
    def complete(self) -> bool:
        return self.error is None and self.samples == self.arrival.samples

    def record(self) -> dict:
        points = stall_points(self.times, self.seconds)
        return {"at_s": round(self.arrival.at, 4), "frames": self.arrival.frames, "complete": self.complete, "error": self.error,
                "ttfa_ms": self.times[0] * 1000.0 if self.times else None, "stalls_ms": [length * 1000.0 for _, length in points],
                "stalls_after_audio_s": [round(at, 3) for at, _ in points]}


# ---- the two clients -----------------------------------------------------------------------------

def speech_request(arrival: Arrival) -> SpeechRequest:
    return SpeechRequest(arrival.text, speaker=SPEAKER, language=LANGUAGE, seed=arrival.index, max_frames=arrival.frames,
                         model_type="custom_voice", checkpoint=CHECKPOINT)


def listen_in_process(service: ModelService, arrival: Arrival, cut: threading.Event) -> Stream:
    """The request through `ModelService.stream` (under a key of its own: a stream replaces the one before it
    under the same key), its chunks timed as they reach this thread."""
    stream, sent = Stream(arrival), time.perf_counter()
    events = service.stream(speech_request(arrival), key=f"load-{arrival.index}")
    try:
        for item in events:
            if isinstance(item, Chunk):
                stream.add(time.perf_counter() - sent, item.audio.size)
            if cut.is_set():
                break
    except Exception as exc:  # a full queue or a failed request: the run counts it
        stream.error = f"{type(exc).__name__}: {exc}"
    finally:
        events.close()
    return stream


def listen_http(client, url: str, arrival: Arrival, cut: threading.Event) -> Stream:
    """The request as `POST /v1/audio/speech` with streamed 16-bit PCM, its bytes timed as httpx hands them over."""
    request = speech_request(arrival)
    body = {"model": CHECKPOINT, "task_type": "CustomVoice", "input": request.text, "voice": request.speaker, "language": request.language,
            "response_format": "pcm", "stream": True, "seed": request.seed, "max_new_tokens": request.max_frames}
    stream, sent, received = Stream(arrival), time.perf_counter(), 0
    try:
        with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                stream.error = f"HTTP {response.status_code}: {response.read().decode(errors='replace')}"
                return stream
            for data in response.iter_bytes():
                if data:  # the samples this piece completes (a piece may end inside a sample)
                    stream.add(time.perf_counter() - sent, (received + len(data)) // 2 - received // 2)
                    received += len(data)
                if cut.is_set():
                    break
    except Exception as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    return stream


# ---- one run -------------------------------------------------------------------------------------

@dataclass
class Target:
    """A model served for the runs: in process, and over HTTP at `url` (None: not served)."""

    name: str
    tts: TTS
    service: ModelService
    url: str | None = None
    server: object = None
    client: object = None

    def listener(self, path: str) -> Callable[[Arrival, threading.Event], Stream]:
        if path == "process":
            return lambda arrival, cut: listen_in_process(self.service, arrival, cut)
        return lambda arrival, cut: listen_http(self.client, self.url, arrival, cut)

    def close(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.client.close()
        self.tts.engine.shutdown()


class QueueWatch:
    """The engine's queue, looked at every SAMPLE_EVERY_S on a thread of its own: the most requests waiting
    for a row and the most rows busy at once."""

    def __init__(self, tts: TTS):
        self.engine, self.max_waiting, self.max_busy = tts.engine, 0, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.wait(SAMPLE_EVERY_S):
            self.max_waiting = max(self.max_waiting, len(self.engine.waiting))
            self.max_busy = max(self.max_busy, sum(self.engine.decoder.occupied))

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def cut_waiting(tts: TTS) -> None:
    """End every request still waiting for a row (its client then sees its stream end)."""
    for request in tts.engine.waiting:
        tts.engine.cancel(request.handle)


class KernelWindow:
    """torch.profiler over the GPU's kernels from `at` seconds into a run, for `seconds` (`tick` with the
    run's elapsed time starts and stops it); `summary()` after the run."""

    def __init__(self, at: float = PROFILE_AT_S, seconds: float = PROFILE_FOR_S):
        self.at, self.seconds = at, seconds
        self.profiler = None
        self.started_at = None
        self.stopped = False

    def tick(self, elapsed: float) -> None:
        if self.profiler is None and elapsed >= self.at:
            from torch.profiler import ProfilerActivity, profile

            self.profiler = profile(activities=[ProfilerActivity.CUDA])
            self.profiler.start()
            self.started_at = time.perf_counter()
        elif not self.stopped and self.profiler is not None and time.perf_counter() - self.started_at >= self.seconds:
            self.stop()  # timed from the profiler's start, which itself takes seconds the first time

    def stop(self) -> None:
        if self.profiler is not None and not self.stopped:
            self.profiler.stop()
            self.stopped = True

    def summary(self) -> dict | None:
        """Kernel time per CUDA stream over the window (None: the run ended before it began)."""
        self.stop()
        if self.profiler is None:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            self.profiler.export_chrome_trace(str(trace))
            events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
        return kernel_summary(events)


def kernel_summary(events: list[dict]) -> dict:
    """Chrome-trace kernel events (`ts`, `dur` in us, `args.stream`, `name`): per stream its kernel time, kernel
    count and longest-running kernel, heaviest first; the window from the first kernel's start to the last one's
    end, and the share of it that at least one kernel ran (overlapping kernels of different streams counted once)."""
    per_stream: dict[int, dict] = {}
    for e in events:
        stream = per_stream.setdefault(e["args"].get("stream"), {"kernel_ms": 0.0, "kernels": 0, "by_name": {}})
        stream["kernel_ms"] += e["dur"] / 1000.0
        stream["kernels"] += 1
        stream["by_name"][e["name"]] = stream["by_name"].get(e["name"], 0.0) + e["dur"]
    busy_us, end = 0.0, None
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        if end is None or start > end:
            busy_us, end = busy_us + (stop - start), stop
        elif stop > end:
            busy_us, end = busy_us + (stop - end), stop
    streams = [{"stream": stream, "kernel_ms": v["kernel_ms"], "kernels": v["kernels"], "top": max(v["by_name"], key=v["by_name"].get)}
               for stream, v in per_stream.items()]
    window_us = max((e["ts"] + e["dur"] for e in events), default=0.0) - min((e["ts"] for e in events), default=0.0)
    return {"window_s": window_us / 1e6, "busy_share": busy_us / window_us if window_us else 0.0,
            "streams": sorted(streams, key=lambda s: -s["kernel_ms"])}


def run_rate(target: Target, path: str, rate: float, duration: float, seed: int, drain: float, profile: bool = False) -> dict:
    """One run: the arrivals of `workload(rate, duration, seed)` sent through `path`, each on its own thread at
    its time; after the last one, `drain` seconds at most for the streams to end, then the rest are cut.
    The HTTP clients run in a process of their own, as a service's clients do: their threads do not share
    this process's interpreter with the engine and the server. `profile`: a KernelWindow over the
    arrivals, its summary in the result's `gpu_profile`."""
    arrivals = workload(rate, duration, seed)
    if target.tts.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    waited_before = target.tts.engine.first_chunks_waited
    target.tts.engine.take_first_chunk_paths()  # those of earlier runs
    watch = QueueWatch(target.tts)
    window = KernelWindow() if profile else None
    if path == "process":
        streams, was_cut, wall = send(arrivals, lambda arrival, cut: listen_in_process(target.service, arrival, cut), duration + drain,
                                      on_cut=lambda: cut_waiting(target.tts), tick=window.tick if window is not None else None)
    else:
        streams, was_cut, wall = send_from_a_client_process(target, arrivals, duration + drain, window)
    gpu_profile = window.summary() if window is not None else None
    watch.stop()
    result = summary([s for s in streams if s is not None], len(arrivals), wall, duration)
    result.update(size=target.name, path=path, rate=rate, duration_s=duration, seed=seed, cut=was_cut,
                  max_waiting=watch.max_waiting, max_rows_busy=watch.max_busy, first_chunks_waited=target.tts.engine.first_chunks_waited - waited_before,
                  first_chunk_path=first_chunk_stages(target.tts.engine.take_first_chunk_paths()),
                  gpu_profile=gpu_profile, **gpu_peaks(target.tts))
    result["held"] = holds(result)
    return result


# The stages of a stream's first chunk in the engine (FirstChunkPath's points, ms after submission):
# (name, its start point or None for the submission, its end point).
FIRST_CHUNK_STAGES = (
    ("queue", None, "admitted_ms"),
    ("prefill and first step", "admitted_ms", "first_frame_ms"),
    ("to the vocoder", "first_frame_ms", "vocoding_ms"),
    ("vocoder and copy", "vocoding_ms", "ready_ms"),
    ("held for the second", "ready_ms", "sent_ms"),
    ("sent by the engine", None, "sent_ms"),
)


def first_chunk_stages(paths: list[FirstChunkPath]) -> dict[str, dict[str, float | None]]:
    """p50 / p95 / p99 / max ms of each FIRST_CHUNK_STAGES stage over the streams' first chunks."""
    def duration(path: FirstChunkPath, start: str | None, end: str) -> float:
        return getattr(path, end) - (getattr(path, start) if start else 0.0)
    return {name: percentiles([duration(p, start, end) for p in paths]) for name, start, end in FIRST_CHUNK_STAGES}


def send(arrivals: list[Arrival], listen: Callable[[Arrival, threading.Event], Stream], horizon_s: float,
         on_cut: Callable[[], None] | None = None, tick: Callable[[float], None] | None = None) -> tuple[list[Stream | None], bool, float]:
    """Each arrival through `listen` on a thread of its own at its time (s after this call); the streams
    given `horizon_s` from the start to end, then cut (`on_cut` ends the requests still waiting for a row).
    `tick(elapsed)` at each arrival. Returns the streams, whether any was cut, and the run's wall time."""
    streams: list[Stream | None] = [None] * len(arrivals)
    cut = threading.Event()

    def client(arrival: Arrival) -> None:
        streams[arrival.index] = listen(arrival, cut)

    threads, start = [], time.perf_counter()
    for arrival in arrivals:
        time.sleep(max(0.0, start + arrival.at - time.perf_counter()))
        if tick is not None:
            tick(time.perf_counter() - start)
        threads.append(threading.Thread(target=client, args=(arrival,), daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join(max(0.0, start + horizon_s - time.perf_counter()))
    was_cut = any(thread.is_alive() for thread in threads)
    if was_cut:
        cut.set()
        if on_cut is not None:
            on_cut()
        for thread in threads:
            thread.join(JOIN_GUARD_S)
    return streams, was_cut, time.perf_counter() - start


def send_from_a_client_process(target: Target, arrivals: list[Arrival], horizon_s: float,
                               window: "KernelWindow | None") -> tuple[list[Stream | None], bool, float]:
    """`send` over HTTP from a process of its own (`http_clients`); meanwhile this process ticks the kernel
    window and, once the horizon has passed, ends the requests still waiting for a row."""
    import multiprocessing
    import queue

    context = multiprocessing.get_context("spawn")
    ready, results = context.Event(), context.Queue()
    process = context.Process(target=http_clients, args=(target.url, arrivals, horizon_s, ready, results), daemon=True)
    process.start()
    if not ready.wait(JOIN_GUARD_S):
        process.kill()
        raise RuntimeError("the HTTP client process did not start")
    start, waiting_cut = time.perf_counter(), False
    while True:
        try:
            found = results.get(timeout=SAMPLE_EVERY_S * 10)
            break
        except queue.Empty:
            if not process.is_alive():
                raise RuntimeError(f"the HTTP client process ended without its streams (exit code {process.exitcode})") from None
            if window is not None:
                window.tick(time.perf_counter() - start)
            if not waiting_cut and time.perf_counter() - start > horizon_s:
                cut_waiting(target.tts)
                waiting_cut = True
    process.join()
    return found


def http_clients(url: str, arrivals: list[Arrival], horizon_s: float, ready, results) -> None:
    """A client process's side of `send_from_a_client_process`: the arrivals sent with `send` through one
    httpx client; (streams, whether any was cut, wall time) put on `results`."""
    import httpx

    with httpx.Client(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)) as client:
        ready.set()
        results.put(send(arrivals, lambda arrival, cut: listen_http(client, url, arrival, cut), horizon_s))


def summary(streams: list[Stream], sent: int, wall: float, duration: float) -> dict:
    """The run's figures from what its clients received (`sent` requests, the run `wall` seconds long)."""
    ttfa = [s.times[0] * 1000.0 for s in streams if s.times]
    stutter = [stalls(s.times, s.seconds) for s in streams]
    audio = sum(s.samples for s in streams) / SAMPLE_RATE
    return {
        "requests": sent,
        "ended": len(streams),
        "completed": sum(s.complete for s in streams),
        "errors": sum(s.error is not None for s in streams),
        "no_audio": sum(not s.times for s in streams),
        "ttfa_ms": percentiles(ttfa),
        "stuttering_streams": sum(bool(found) for found in stutter),
        "stutter_share": sum(bool(found) for found in stutter) / len(streams) if streams else 0.0,
        "stall_ms_max": max((max(found) * 1000.0 for found in stutter if found), default=0.0),
        "audio_s": audio,
        "offered_audio_s_per_s": sum(s.arrival.samples for s in streams) / SAMPLE_RATE / duration,
        "audio_s_per_s": audio / wall,
        "wall_s": wall,
        "streams": [s.record() for s in streams],
    }


def holds(result: dict) -> bool:
    """Every request completed, p95 time to first audio at most TTFA_LIMIT_MS and no stream stuttering."""
    p95 = result["ttfa_ms"]["p95"]
    return (result["completed"] == result["requests"] and p95 is not None and p95 <= TTFA_LIMIT_MS
            and result["stuttering_streams"] == 0)


def gpu_peaks(tts: TTS) -> dict:
    if tts.device.type != "cuda":
        return {"gpu_peak_allocated_gib": None, "gpu_peak_reserved_gib": None}
    return {"gpu_peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30, "gpu_peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}


def sweep(target: Target, paths: list[str], rates: list[float], duration: float, seed: int, drain: float, keep_going: bool,
          on_result: Callable[[dict], None], profile: bool = False, repeats: int = 1) -> None:
    """Every path at each rate in turn, `repeats` runs of the same arrivals each (the spread from run to run),
    until a rate where one of them does not hold (unless `keep_going`)."""
    for rate in rates:
        held = True
        for repeat in range(repeats):
            for path in paths:
                result = run_rate(target, path, rate, duration, seed, drain, profile)
                result["repeat"] = repeat
                on_result(result)
                held = held and result["held"]
        if not held and not keep_going:
            return


# ---- the models ----------------------------------------------------------------------------------



def serve(target: Target) -> None:
    """The app's speech routes for `target.service` on uvicorn, on a free localhost port in a thread of this
    process, with no limit of requests per client (every request of a run comes from this one address)."""
    import httpx
    import uvicorn
    from starlette.applications import Starlette

    port = free_port()
    app = Starlette(routes=speech_routes(target.service, Access(key=None, public=False, per_client=sys.maxsize)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    target.server, target.url = server, f"http://127.0.0.1:{port}/v1/audio/speech"
    target.client = httpx.Client(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


def app_rows(size: str, rows: int | None) -> int:
    """The rows the app gives this size's CustomVoice on this GPU (pipeline.memory_plan), or `rows` where they fit."""
    from pipeline import memory_plan

    device = torch.device("cuda")
    cap = memory_plan.tts_row_cap(torch.cuda.get_device_properties(device).total_memory, torch.bfloat16, DEFAULT_MAX_SEQ)
    plan = replace(memory_plan.released_tts_plan(size, "custom_voice", torch.bfloat16, DEFAULT_MAX_SEQ), max_rows=cap)
    return plan.choose_rows(rows, memory_plan.free_memory(device))


def real_size_target(size: str, rows: int | None, workdir: Path) -> Target:
    rows = app_rows(size, rows)
    tts = random_tts(size, "custom_voice", "cuda", torch.bfloat16, workdir, rows=rows, compiled=True, max_queue=sys.maxsize)
    tts.warm_up()
    service = ModelService(device="cuda", dtype="bfloat16", compiled=True)
    service.register("custom_voice", CHECKPOINT, tts)
    return Target(size, tts, service)


def tiny_target(rows: int | None, workdir: Path) -> Target:
    """The tiny CustomVoice checkpoint on the CPU, its EOS row zeroed as `random_tts` does and room for 20 s of speech."""
    from pipeline.tiny import write_tiny_checkpoint

    directory = write_tiny_checkpoint(workdir / "tiny-custom-voice", "custom_voice")
    generation = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps(dict(generation, max_new_tokens=4096)))
    tts = TTS.from_pretrained(str(directory), rows=rows, max_queue=sys.maxsize)
    with torch.no_grad():
        tts.model.talker.codec_head.weight[tts.config.talker_config.codec_eos_token_id].zero_()
    service = ModelService(device="cpu", dtype="float32", compiled=False)
    service.register("custom_voice", CHECKPOINT, tts)
    return Target("tiny", tts, service)


def warm_paths(target: Target, paths: list[str]) -> None:
    """One short request through each path first: the server's thread pool, the connection, the first chunk's allocations."""
    short = Arrival(0, 0.0, SENTENCES[0], 3)
    for path in paths:
        stream = target.listener(path)(short, threading.Event())
        if not stream.complete:
            raise RuntimeError(f"the warm-up request through {path} failed: {stream.error or 'its audio was cut short'}")


# ---- the report ----------------------------------------------------------------------------------

def number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown(report: dict) -> str:
    lines = [f"### {report['gpu']} — {report['date']}: requests arriving at a rate", "",
             f"torch {report['torch']}; `{report['command']}`; {report['duration_s']:.0f} s of Poisson arrivals per rate (seed {report['seed']}), "
             f"sentences of 3-20 s of speech; random CustomVoice weights, {report['precision']}; time to first audio at the client.", "",
             "| model | rows | path | req/s | requests (completed) | TTFA p50 / p95 / p99 ms | streams stuttering | longest stall ms | "
             "audio-s per s (offered) | most waiting | most rows busy | first chunks sent with the second | peak GPU GiB alloc / reserved | holds |",
             "|---" * 14 + "|"]
    for r in report["results"]:
        t = r["ttfa_ms"]
        lines.append(f"| {r['size']} | {report['rows'][r['size']]} | {r['path']} | {rate_cell(r, report)} | {r['requests']} ({r['completed']}) | "
                     f"{number(t['p50'])} / {number(t['p95'])} / {number(t['p99'])} | {r['stuttering_streams']} ({r['stutter_share']:.0%}) | "
                     f"{number(r['stall_ms_max'])} | {number(r['audio_s_per_s'], 1)} ({number(r['offered_audio_s_per_s'], 1)}) | {r['max_waiting']} | "
                     f"{r['max_rows_busy']} | {r.get('first_chunks_waited', '-')} | {number(r['gpu_peak_allocated_gib'], 1)} / {number(r['gpu_peak_reserved_gib'], 1)} | "
                     f"{'yes' if r['held'] else 'no'} |")
    lines += ["", f"Highest rate holding p95 TTFA ≤ {TTFA_LIMIT_MS:.0f} ms with every request completed and no stream stuttering:"]
    for (size, path), rate in highest_held(report["results"]).items():
        lines.append(f"- {size}, {path}: {'none of those run' if rate is None else f'{rate:g} requests/s'}")
    lines += ["", "Where the first audio's time goes in the engine (host clocks, ms after submission; p50 / p95), beside the client's "
              "time to first audio:", "",
              "| model | path | req/s | " + " | ".join(name for name, _, _ in FIRST_CHUNK_STAGES) + " | at the client |",
              "|---" * (len(FIRST_CHUNK_STAGES) + 4) + "|"]
    for r in report["results"]:
        stages = r.get("first_chunk_path") or {}
        cells = [f"{number(stages[name]['p50'], 1)} / {number(stages[name]['p95'], 1)}" if name in stages else "-" for name, _, _ in FIRST_CHUNK_STAGES]
        lines.append(f"| {r['size']} | {r['path']} | {rate_cell(r, report)} | " + " | ".join(cells) +
                     f" | {number(r['ttfa_ms']['p50'], 1)} / {number(r['ttfa_ms']['p95'], 1)} |")
    profiled = [r for r in report["results"] if r.get("gpu_profile")]
    if profiled:
        lines += ["", "GPU kernels in a profiled window of each run (the profiler slows the run), ms per CUDA stream (its heaviest kernel):"]
    for r in profiled:
        g = r["gpu_profile"]
        streams = ", ".join(f"{s['kernel_ms']:,.0f} ({s['top'][:40]})" for s in g["streams"])
        lines.append(f"- {r['size']} {r['path']} {r['rate']:g}/s: busy {g['busy_share']:.0%} of {g['window_s']:.1f} s; {streams}")
    return "\n".join(lines) + "\n"


def rate_cell(result: dict, report: dict) -> str:
    """The run's rate, and which of the rate's runs it is where each rate ran more than once."""
    return f"{result['rate']:g}" + (f" (run {result['repeat'] + 1})" if report.get("repeats", 1) > 1 else "")


def highest_held(results: list[dict]) -> dict[tuple[str, str], float | None]:
    """Per model and path, the highest rate whose every run held, with every run of every lower rate holding
    too (None: not even the lowest)."""
    runs: dict[tuple[str, str], dict[float, bool]] = {}
    for r in results:
        by_rate = runs.setdefault((r["size"], r["path"]), {})
        by_rate[r["rate"]] = by_rate.get(r["rate"], True) and r["held"]
    best: dict[tuple[str, str], float | None] = {}
    for key, by_rate in runs.items():
        held = list(itertools.takewhile(lambda rate: by_rate[rate], sorted(by_rate)))
        best[key] = held[-1] if held else None
    return best


def plot(report: dict, path: Path) -> bool:
    """Per model: time to first audio (p50, p95, p99) against the rate for each path, and audio-seconds
    delivered per second against those offered. False (and no file) without matplotlib or results."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["size"] for r in report["results"]))
    if not sizes:
        return False
    fig, axes = plt.subplots(len(sizes), 2, figsize=(12, 4.2 * len(sizes)), squeeze=False)
    for size, (latency, throughput) in zip(sizes, axes, strict=True):
        for client, color in zip(PATHS, ("tab:blue", "tab:orange"), strict=True):
            runs = sorted((r for r in report["results"] if r["size"] == size and r["path"] == client), key=lambda r: r["rate"])
            if not runs:
                continue
            rates = sorted({r["rate"] for r in runs})
            for q, style in (("p50", ":"), ("p95", "-"), ("p99", "--")):
                latency.plot(rates, median_per_rate(runs, rates, lambda r: r["ttfa_ms"][q]), style, color=color, label=f"{client} {q}")
                latency.scatter([r["rate"] for r in runs], [r["ttfa_ms"][q] for r in runs], marker=".", color=color)
            throughput.plot(rates, median_per_rate(runs, rates, lambda r: r["audio_s_per_s"]), color=color, label=f"{client} delivered")
            throughput.scatter([r["rate"] for r in runs], [r["audio_s_per_s"] for r in runs], marker=".", color=color)
            stuttered = [r for r in runs if r["stuttering_streams"]]
            latency.scatter([r["rate"] for r in stuttered], [r["ttfa_ms"]["p95"] for r in stuttered], marker="x", s=60, color="red",
                            label="a stream stuttered" if client == PATHS[0] else None, zorder=3)
        offered = sorted({(r["rate"], r["offered_audio_s_per_s"]) for r in report["results"] if r["size"] == size})
        throughput.plot(*zip(*offered, strict=True), color="grey", linestyle="--", label="offered")
        latency.axhline(TTFA_LIMIT_MS, color="grey", linewidth=0.8)
        latency.set(xlabel="requests per second", ylabel="time to first audio, ms", title=f"{size}: time to first audio", yscale="log")
        throughput.set(xlabel="requests per second", ylabel="audio-seconds per second", title=f"{size}: audio delivered")
    return save_figure(fig, axes.flat, f"{report['gpu']}, {report['date']}: {report['duration_s']:.0f} s of Poisson arrivals per rate", path, 7)


def median_per_rate(runs: list[dict], rates: list[float], value: Callable[[dict], float | None]) -> list[float]:
    """The median of `value` over each rate's runs (NaN where none has a value: no line there)."""
    def median(rate: float) -> float:
        values = [v for r in runs if r["rate"] == rate and (v := value(r)) is not None]
        return float(np.median(values)) if values else float("nan")
    return [median(rate) for rate in rates]


def report_stem(report: dict, name: str) -> str:
    """The file name write_report gives the JSON and markdown, without the extension (the PNG takes it too)."""
    return f"{report['date']}-{report['gpu'].replace(' ', '_')}-{name}"


# ---- main ----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES), help="CustomVoice sizes (default: all)")
    parser.add_argument("--rates", type=rates_arg, default=[5.0, 10.0, 20.0, 40.0, 60.0, 80.0],
                        help="requests per second, comma-separated, in sweep order (default 5,10,20,40,60,80)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate (default 20)")
    parser.add_argument("--drain", type=float, default=60.0,
                        help="seconds after the last arrival for the streams to end before the rest are cut (default 60)")
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS, help="clients: in process, over HTTP (default both)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrivals and the sentences (default 0)")
    parser.add_argument("--rows", type=int, default=None, help="rows of the engine (default: as the app plans them from the GPU's memory)")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="runs of each rate, the same arrivals each time, to show the spread from run to run (default 1)")
    parser.add_argument("--keep-going", action="store_true", help="run every rate, past the first that does not hold")
    parser.add_argument("--profile", action="store_true",
                        help=f"GPU kernel time per CUDA stream over {PROFILE_FOR_S:g} s of each run, from {PROFILE_AT_S:g} s in (slows the run)")
    parser.add_argument("--tiny", action="store_true", help="the tiny random checkpoint on the CPU, to try the script (--sizes ignored)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="where the JSON, markdown and PNG go (default docs/benchmarks)")
    return parser.parse_args(argv)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number of at least 1, not {text!r}")
    return value


def rates_arg(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rates takes numbers separated by commas (e.g. 5,10,20), not {text!r}") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError(f"--rates takes request rates above 0, not {text!r}")
    return rates


def sizes_to_run(args: argparse.Namespace) -> list[str] | None:
    """The model sizes a run covers (["tiny"] with --tiny), or None after saying that it needs a CUDA GPU."""
    if not args.tiny and not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU (or --tiny to try it on the CPU)", file=sys.stderr)
        return None
    return ["tiny"] if args.tiny else args.sizes


def precision(tiny: bool) -> str:
    return "float32, eager, on the CPU" if tiny else "bf16, compiled and captured"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = sizes_to_run(args)
    if sizes is None:
        return 2
    if args.profile and not torch.cuda.is_available():
        print("error: --profile measures GPU kernels and needs a CUDA GPU", file=sys.stderr)
        return 2
    report = {**report_header("benchmarks.load", argv, on_gpu=not args.tiny), "duration_s": args.duration, "seed": args.seed, "rates": args.rates,
              "repeats": args.repeats,
              "paths": args.paths, "precision": precision(args.tiny),
              "chars_per_second": CHARS_PER_SECOND, "rows": {}, "results": []}
    name = "load-" + "-".join(sizes)
    stem = report_stem(report, name)

    def on_result(result: dict) -> None:
        report["results"].append(result)
        t = result["ttfa_ms"]
        print(f"{result['size']} {result['path']} {result['rate']:g}/s: {result['completed']}/{result['requests']} completed, TTFA p50/p95/p99 "
              f"{number(t['p50'])}/{number(t['p95'])}/{number(t['p99'])} ms, {result['stuttering_streams']} stuttering, "
              f"{result['audio_s_per_s']:.1f} audio-s/s, {result['max_waiting']} waiting at most", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            target = tiny_target(args.rows, Path(tmp)) if args.tiny else real_size_target(size, args.rows, Path(tmp))
            report["rows"][size] = target.tts.rows
            try:
                if "http" in args.paths:
                    serve(target)
                warm_paths(target, args.paths)
                sweep(target, args.paths, args.rates, args.duration, args.seed, args.drain, args.keep_going, on_result, args.profile, args.repeats)
            finally:
                target.close()
            del target
            if not args.tiny:
                torch.cuda.empty_cache()
    write_report(args.out, name, report, markdown(report))
    if not plot(report, args.out / f"{stem}.png"):
        print("no PNG: matplotlib is missing or no rate ran", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
