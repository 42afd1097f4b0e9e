"""Time to first audio of text that is still being written: `python -m benchmarks.ws_first_audio`.

A client of `WS /v1/audio/speech/stream` (the `websockets` library, on localhost; the app's routes on
uvicorn in this process) opens a session, waits for `audio.start` (its row taken and its prompt
prefilled), then sends a reply's words one `input.text` message at a time, paced like a language
model writing at TOKENS_PER_SECOND. Measured at the client, per run: from sending the first piece to
receiving the first binary audio message. A word is spoken once the text after it shows it complete,
so the first audio comes at the earliest with the second piece, one pause after the first. After the
first audio the client ends the session (`session.close`), which frees the row within a frame.

Runs one after the other on an idle engine (the first WARM_UP runs are left out), p50 and p95 over
`--runs`. Random weights at the real 0.6B and 1.7B CustomVoice sizes, compiled and captured as the
app serves them, with the rows the app plans (benchmarks.load's targets, its EOS row zeroed so that
the model never ends first); `--tiny`: the tiny random checkpoint on the CPU, to try the script.
Writes JSON and markdown into --out (GPU, torch, date, command).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.load import CHECKPOINT, LANGUAGE, SPEAKER, Target, precision, real_size_target, sizes_to_run, tiny_target
from benchmarks.ports import free_port
from benchmarks.speed import report_header, write_report
from pipeline.released import SIZES
from pipeline.server import Access, stream_routes
from pipeline.server.stream import PATH

TOKENS_PER_SECOND = 30.0  # a language model's writing pace, one piece per token
WARM_UP = 2  # runs before the measured ones: the server's thread pool, the connection, the first chunk's allocations
MAX_FRAMES = 200  # the row's limit: far past the first audio, which ends each run
HANG_GUARD_S = 600.0  # ends a wait for something that never comes
REPLY = ("Sure! The museum opens at ten on weekdays and at nine on Saturdays. It is closed on Mondays, and the last "
         "entry is one hour before closing, so plan to arrive by four if you want to see the whole collection.")


def pieces(text: str) -> list[str]:
    """The text as a language model streams it: a word (with the space before it) per piece."""
    return re.findall(r"\s*\S+", text)


def settings(seed: int) -> dict:
    return {"type": "session.config", "model": CHECKPOINT, "task_type": "CustomVoice", "voice": SPEAKER, "language": LANGUAGE, "seed": seed,
            "max_new_tokens": MAX_FRAMES}


async def first_audio_ms(url: str, seed: int, interval_s: float) -> float:
    """One session: the milliseconds from sending the first text piece to receiving the first audio."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async with connect(url, max_size=None, open_timeout=HANG_GUARD_S, close_timeout=HANG_GUARD_S) as ws:
        await ws.send(json.dumps(settings(seed)))
        started = json.loads(await asyncio.wait_for(ws.recv(), HANG_GUARD_S))
        if started.get("type") != "audio.start":
            raise RuntimeError(f"the session was refused: {started.get('message', started)}")
        sent_first: list[float] = []
        writer = asyncio.create_task(write(ws, pieces(REPLY), interval_s, sent_first))
        try:
            while not isinstance(message := await asyncio.wait_for(ws.recv(), HANG_GUARD_S), bytes):
                event = json.loads(message)
                if event.get("type") == "error":
                    raise RuntimeError(f"the session failed: {event['message']}")
            heard = time.perf_counter()
        finally:
            writer.cancel()
        await ws.send(json.dumps({"type": "session.close"}))
        try:
            while True:  # the rest of what was on its way, until the server closes
                await asyncio.wait_for(ws.recv(), HANG_GUARD_S)
        except ConnectionClosed:
            pass
    return (heard - sent_first[0]) * 1000.0


async def write(ws, text_pieces: list[str], interval_s: float, sent_first: list[float]) -> None:
    """The pieces at the writer's pace, then input.done; the time of the first piece into `sent_first`."""
    for index, piece in enumerate(text_pieces):
        if index:
            await asyncio.sleep(interval_s)
        else:
            sent_first.append(time.perf_counter())
        await ws.send(json.dumps({"type": "input.text", "text": piece}))
    await ws.send(json.dumps({"type": "input.done"}))


def serve(target: Target):
    """The app's WebSocket route for `target.service` on uvicorn, on a free localhost port in a thread of this process: (its URL, the server)."""
    import uvicorn
    from starlette.applications import Starlette

    port = free_port()
    app = Starlette(routes=stream_routes(target.service, Access(key=None, public=False, per_client=sys.maxsize)))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + HANG_GUARD_S
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    return f"ws://127.0.0.1:{port}{PATH}", server


def measure(url: str, runs: int, interval_s: float) -> list[float]:
    """First-audio times of `runs` sessions after WARM_UP unmeasured ones, seeds 0, 1, ..."""
    times = [asyncio.run(first_audio_ms(url, seed, interval_s)) for seed in range(WARM_UP + runs)]
    return times[WARM_UP:]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]  # nearest rank


def result(size: str, rows: int, times: list[float]) -> dict:
    return {"size": size, "rows": rows, "runs": len(times), "p50_ms": statistics.median(times), "p95_ms": percentile(times, 95),
            "min_ms": min(times), "max_ms": max(times), "times_ms": times}


def markdown(report: dict) -> str:
    lines = [f"# Time to first audio over the WebSocket ({report['gpu']}, {report['date']})", "",
             f"`{report['command']}` · torch {report['torch']} · {report['precision']} · a reply of {report['pieces']} words sent one "
             f"`input.text` a word at {report['tokens_per_second']:g} per second ({report['interval_ms']:.1f} ms apart), on localhost; "
             "from sending the first word to receiving the first audio, at the client.", "",
             "| model | rows | runs | p50 ms | p95 ms | min ms | max ms |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['size']} | {r['rows']} | {r['runs']} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | {r['min_ms']:.1f} | {r['max_ms']:.1f} |"
              for r in report["results"]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ws_first_audio", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES), help="CustomVoice sizes (default: all)")
    parser.add_argument("--runs", type=int, default=50, help="measured sessions per size (default 50)")
    parser.add_argument("--tokens-per-second", type=float, default=TOKENS_PER_SECOND, help="the writer's pace (default %(default)g)")
    parser.add_argument("--rows", type=int, default=None, help="rows of the engine (default: as the app plans them from the GPU's memory)")
    parser.add_argument("--tiny", action="store_true", help="the tiny random checkpoint on the CPU, to try the script (--sizes ignored)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"), help="where the JSON and markdown go (default docs/benchmarks)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.tokens_per_second <= 0:
        parser.error("--runs takes a whole number of at least 1, --tokens-per-second a pace above 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = sizes_to_run(args)
    if sizes is None:
        return 2
    interval_s = 1.0 / args.tokens_per_second
    report = {**report_header("benchmarks.ws_first_audio", argv, on_gpu=not args.tiny), "precision": precision(args.tiny),
              "tokens_per_second": args.tokens_per_second, "interval_ms": interval_s * 1000.0, "pieces": len(pieces(REPLY)), "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            target = tiny_target(args.rows, Path(tmp)) if args.tiny else real_size_target(size, args.rows, Path(tmp))
            url, server = serve(target)
            try:
                times = measure(url, args.runs, interval_s)
            finally:
                server.should_exit = True
                target.close()
            report["results"].append(result(size, target.tts.rows, times))
            del target
            if not args.tiny:
                torch.cuda.empty_cache()
    write_report(args.out, "ws-first-audio-" + "-".join(sizes), report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
