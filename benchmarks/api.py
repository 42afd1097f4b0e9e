"""Time to first audio through the HTTP API, next to the same request in process:
`python -m benchmarks.api`.

The app's speech route (POST /v1/audio/speech, streamed PCM) is served by uvicorn on localhost in
front of the real-size model with random weights (as `benchmarks.speed` builds it); a client with
httpx reads the stream. The difference between the two is what the HTTP path adds: request
parsing, the thread hand-offs of a streamed response, and the socket. Writes JSON and markdown
(GPU, torch, date and command next to the numbers).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from benchmarks.speed import random_tts, report_header, request, write_report
from pipeline.server import Access, speech_routes
from pipeline.service import ModelService

CHECKPOINT = "random-0.6B-CustomVoice"


def serve(service: ModelService, port: int):
    """The API routes on a uvicorn server in a thread of this process; returns the server (stop with should_exit)."""
    import uvicorn
    from starlette.applications import Starlette

    server = uvicorn.Server(uvicorn.Config(Starlette(routes=speech_routes(service, Access(key=None, public=False))),
                                           host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server


def in_process_ttfa(service: ModelService, seed: int, frames: int) -> float:
    """Host time from the call to the first audio chunk, through ModelService.stream (the UI's path)."""
    started = time.perf_counter()
    stream = service.stream(request(frames, seed=seed, model_type="custom_voice", checkpoint=CHECKPOINT))
    for item in stream:
        if hasattr(item, "audio"):
            ttfa = (time.perf_counter() - started) * 1000.0
            break
    stream.close()
    return ttfa


def api_ttfa(client: httpx.Client, url: str, seed: int, frames: int) -> float:
    """Client time from sending the request to the first PCM bytes of the streamed response."""
    same = request(frames)  # the request the in-process path makes
    body = {"model": CHECKPOINT, "task_type": "CustomVoice", "input": same.text, "voice": same.speaker, "language": same.language, "response_format": "pcm",
            "stream": True, "seed": seed, "max_new_tokens": frames}
    started = time.perf_counter()
    with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        for data in response.iter_bytes():
            if data:
                return (time.perf_counter() - started) * 1000.0
    raise RuntimeError("the API returned no audio")


def together(url: str, clients: int, frames: int) -> list[float]:
    """`clients` API requests sent at once (each its own connection), their TTFAs sorted."""
    results: list[float] = [0.0] * clients

    def one(i: int) -> None:
        with httpx.Client(timeout=120) as client:
            results[i] = api_ttfa(client, url, 100 + i, frames)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(results)


def markdown(report: dict) -> str:
    rows = [f"### HTTP API path, random Qwen3-TTS 0.6B weights ({report['gpu']}, torch {report['torch']}, {report['date']})", "",
            f"Command: `{report['command']}`; time to first audio, median of {report['repeats']} requests of {report['frames']} frames, "
            f"custom voice, {report['precision']}.", "",
            "| path | TTFA median (ms) | min (ms) | max (ms) |", "|---|---|---|---|"]
    for name in ("in_process", "api"):
        values = report[name]
        rows.append(f"| {name.replace('_', ' ')} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} |")
    rows += ["", f"{len(report['api_together'])} API clients at once: TTFA " + ", ".join(f"{v:.0f}" for v in report["api_together"]) + " ms.", ""]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.api")
    parser.add_argument("--repeats", type=int, default=20, help="requests per path (default 20)")
    parser.add_argument("--frames", type=int, default=25, help="frames per request (default 25 = 2 s)")
    parser.add_argument("--together", type=int, default=4, help="API clients at once (default 4, the per-client limit)")
    parser.add_argument("--port", type=int, default=7871, help="localhost port of the API server (default 7871)")
    parser.add_argument("--device", default="cuda", help="default cuda; cpu only to try the script")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU (or --device cpu to try it)", file=sys.stderr)
        return 2
    cuda = args.device == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        tts = random_tts("0.6B", "custom_voice", args.device, torch.bfloat16 if cuda else torch.float32, Path(tmp), rows=16, compiled=cuda)
        if cuda:
            tts.warm_up()
        service = ModelService(device=args.device, dtype="bfloat16" if cuda else "float32", compiled=cuda)
        service.register("custom_voice", CHECKPOINT, tts)
        server = serve(service, args.port)
        url = f"http://127.0.0.1:{args.port}/v1/audio/speech"
        try:
            with httpx.Client(timeout=120) as client:
                api_ttfa(client, url, 0, args.frames)  # warm-up: connection, thread pool
                in_process_ttfa(service, 0, args.frames)
                # Alternated, so that both paths see the same state of the machine.
                in_process, api = [], []
                for i in range(args.repeats):
                    in_process.append(in_process_ttfa(service, i, args.frames))
                    api.append(api_ttfa(client, url, i, args.frames))
            report = {**report_header("benchmarks.api", argv, on_gpu=cuda),
                      "repeats": args.repeats, "frames": args.frames, "in_process": in_process, "api": api,
                      "precision": "bf16, compiled decode step" if cuda else "float32, eager",
                      "api_together": together(url, args.together, args.frames)}
        finally:
            server.should_exit = True
    print(markdown(report), flush=True)
    write_report(args.out, "api", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
