"""GPU benchmark on random weights at the real 0.6B and 1.7B sizes: `python -m benchmarks.speed`.

Weight values do not change speed, so no download is needed. Random weights would end utterances
at random frames; the EOS row of the codec head is zeroed so that EOS never reaches the top-k and
every run produces exactly the frames asked for.

Measures: the decode step per frame at each occupancy of the batch, the vocoder per call size, many concurrent
streams through the engine (arriving together and staggered: aggregate x real time, time to first
audio, gaps between chunks against the audio already buffered), and the determinism checks (the
same seed alone and among other requests, graph against eager). Writes JSON and a markdown table
(GPU, torch version, date, command next to the numbers).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.codec import SpeechTokenizer, SpeechTokenizerConfig
from pipeline.loading import load_text_tokenizer
from pipeline.model import Qwen3TTS, TTSConfig
from pipeline.released import SIZES, real_size_config
from pipeline.request import SpeechRequest
from pipeline.tiny import GENERATION_CONFIG, randomize_speech_tokenizer_, write_tiny_text_tokenizer
from pipeline.tts import TTS

TEXT_20_WORDS = "The quick brown fox jumps over the lazy dog while the patient narrator reads every word of this sentence aloud."
RUNS = 5
FRAME_S = 0.08


@torch.no_grad()
def random_tts(size: str, model_type: str, device: str, dtype: torch.dtype, workdir: Path, **options) -> TTS:
    special_ids = write_tiny_text_tokenizer(workdir)
    config = TTSConfig.from_dict(real_size_config(size, model_type, special_ids))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3TTS(config).to(dtype).eval()
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
        model.talker.codec_head.weight[config.talker_config.codec_eos_token_id].zero_()
    codec = random_codec(device)
    generation = dict(GENERATION_CONFIG, max_new_tokens=4096)
    return TTS(model, load_text_tokenizer(workdir), codec, generation, f"random {size} {model_type}", **options)


def random_codec(device: str) -> SpeechTokenizer:
    """The released speech tokenizer with random weights, float32 on `device`, as TTS.from_pretrained loads it."""
    codec = SpeechTokenizer(SpeechTokenizerConfig())
    randomize_speech_tokenizer_(codec, torch.Generator().manual_seed(0))
    return codec.to(device=device).eval()


def request(frames: int, seed: int = 0, **fields) -> SpeechRequest:
    return SpeechRequest(TEXT_20_WORDS, speaker="ryan", language="english", seed=seed, max_frames=frames, **fields)


def report_header(prog: str, argv: list[str] | None, on_gpu: bool = True) -> dict:
    """What every benchmark report starts with: the GPU (or CPU), torch's version, the date and the command line."""
    return {
        "gpu": torch.cuda.get_device_name() if on_gpu else "CPU",
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "command": f"python -m {prog} " + " ".join(argv if argv is not None else sys.argv[1:]),
    }


def cuda_ms(fn, repeat: int = 1) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000.0 / repeat


@contextlib.contextmanager
def rows_running(tts: TTS, occupied: int):
    """The engine's decoder with its first `occupied` rows running one short request each (the rest idle),
    for stepping it directly (in inference mode, as the engine does); every row stopped afterwards."""
    decoder = tts.engine.decoder
    with torch.inference_mode():
        job, _ = tts.prepare(request(1))
        segment = job.segments[0]
        frames_room = decoder.max_frames(segment.prompt.shape[1])
        for row in range(occupied):
            decoder.start(row, segment.prompt, segment.trailing, True, job.sampling, row, frames_room)
        try:
            yield decoder
        finally:
            for row in range(decoder.rows):
                decoder.stop(row)


def step_ms(tts: TTS, occupied: int, frames: int = 50) -> float:
    """The decode step alone, with `occupied` rows running (the rest idle)."""
    with rows_running(tts, occupied) as decoder:
        decoder.step()
        return statistics.median(cuda_ms(decoder.step, frames) for _ in range(RUNS))


@torch.inference_mode()
def vocoder_ms(tts: TTS, calls: int = 20) -> dict[int, float]:
    """One vocoder call (one stream) per piece size, ms; the engine decodes a chunk in such pieces."""
    vocoder = tts.engine.vocoder
    result = {}
    for n in vocoder.CALL_SIZES:
        codes = torch.randint(0, 2048, (n, 16), device=tts.device)
        out = torch.empty(n * vocoder.decoder.config.upsample, device=tts.device)
        result[n] = statistics.median(cuda_ms(lambda: vocoder.decode(0, codes, out), calls) for _ in range(RUNS))
    vocoder.reset_row(0)
    return result


@torch.inference_mode()
def vocoder_batch_ms(tts: TTS, calls: int = 20) -> dict[str, float] | None:
    """One batched vocoder call (its `slots` streams' 16-frame chunks, padded where fewer run), ms; None without batched lanes."""
    vocoder = tts.engine.vocoder
    if not vocoder.batch_lanes:
        return None
    frames = vocoder.BATCH_FRAMES
    codes = torch.randint(0, 2048, (frames, 16), device=tts.device)
    out = torch.empty(frames * vocoder.decoder.config.upsample, device=tts.device)
    vocoder.decode(0, codes[:1], out[:vocoder.decoder.config.upsample])  # past its first call, as a steady chunk is
    ms = statistics.median(cuda_ms(lambda: vocoder.decode_batch([0], [codes], [out], vocoder.lanes), calls) for _ in range(RUNS))
    vocoder.reset_row(0)
    return {"slots": vocoder.slots, "frames": frames, "ms": ms}


def kernels_per_frame(tts: TTS) -> int:
    from torch.profiler import ProfilerActivity, profile

    tts.engine.decoder.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        tts.engine.decoder.step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" not in e.name and "Memset" not in e.name)


def run_streams(tts: TTS, streams: int, frames: int, stagger_s: float) -> dict:
    """`streams` requests through the engine, the i-th submitted at i * stagger_s; each consumed on
    its own thread, as the app's visitors are. Client-side playback starts at the first chunk."""
    results: list[dict] = [{} for _ in range(streams)]
    start = time.perf_counter()

    def listen(i: int) -> None:
        time.sleep(max(0.0, start + i * stagger_s - time.perf_counter()))
        submitted = time.perf_counter()
        arrivals, audio = [], []
        for chunk in tts.submit(request(frames, seed=i)):
            arrivals.append(time.perf_counter() - submitted)
            audio.append(chunk.frames * FRAME_S)
        results[i] = {"arrivals": arrivals, "audio": audio, "ttfa_ms": arrivals[0] * 1000.0}

    threads = [threading.Thread(target=listen, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    gaps, stutters = [], 0
    for r in results:
        buffered = 0.0  # audio received and not yet played, at each arrival
        played_from = r["arrivals"][0]
        for k in range(1, len(r["arrivals"])):
            gap = r["arrivals"][k] - r["arrivals"][k - 1]
            gaps.append(gap * 1000.0)
            buffered = sum(r["audio"][:k]) - (r["arrivals"][k] - played_from)
            stutters += buffered < 0
    ttfa = sorted(r["ttfa_ms"] for r in results)
    return {
        "streams": streams,
        "stagger_ms": stagger_s * 1000.0,
        "aggregate_x_real_time": streams * frames * FRAME_S / wall,
        "ttfa_p50_ms": float(np.percentile(ttfa, 50)),
        "ttfa_p95_ms": float(np.percentile(ttfa, 95)),
        "gap_p95_ms": float(np.percentile(gaps, 95)) if gaps else 0.0,
        "gap_max_ms": max(gaps) if gaps else 0.0,
        "stutters": int(stutters),
    }


def codes_of(tts: TTS, req: SpeechRequest) -> torch.Tensor:
    return tts.synthesize(req).codes


def determinism(tts: TTS, frames: int = 120) -> dict:
    """The same request and seed: twice alone, and among 7 other requests that start at other times."""
    target = request(frames, seed=1234)
    alone = [tts.synthesize(target) for _ in range(2)]
    neighbours = [request(frames + 40 * i, seed=i) for i in range(1, 8)]
    handles = [tts.submit(neighbours[i]) for i in range(3)]
    time.sleep(0.2)
    in_batch = tts.submit(target)
    handles += [tts.submit(n) for n in neighbours[3:]]
    audio = np.concatenate([c.audio for c in in_batch])
    for h in handles:
        list(h)
    return {
        "same_seed_twice_alone_codes_equal": bool(np.array_equal(alone[0].codes, alone[1].codes)),
        "same_seed_twice_alone_audio_equal": bool(np.array_equal(alone[0].audio, alone[1].audio)),
        "same_seed_in_batch_of_8_codes_equal": bool(np.array_equal(alone[0].codes, in_batch.codes.numpy())),
        "same_seed_in_batch_of_8_audio_equal": bool(np.array_equal(alone[0].audio, audio)),
        "streamed_vs_offline_max_abs": float(np.abs(alone[0].audio - tts.decode(torch.from_numpy(alone[0].codes).to(tts.device))).max()),
    }


def graph_equals_eager(size: str, workdir: Path, dtype: torch.dtype, frames: int = 60) -> dict:
    """Codes of the same seeded request through the CUDA-graph engine and the eager one."""
    out = {}
    codes = {}
    for graphs in (False, True):
        tts = random_tts(size, "custom_voice", "cuda", dtype, workdir, rows=8, use_cuda_graphs=graphs)
        codes[graphs] = [codes_of(tts, request(frames, seed=7, greedy=greedy)) for greedy in (True, False)]
        del tts
    for i, name in enumerate(("greedy", "sampled")):
        out[f"{name}, {str(dtype).removeprefix('torch.')}"] = bool(np.array_equal(codes[False][i], codes[True][i]))
    return out


def bench_size(size: str, workdir: Path, rows: int, streams: list[int], frames: int) -> dict:
    result = {}
    single = random_tts(size, "custom_voice", "cuda", torch.bfloat16, workdir, rows=1, compiled=True)
    single.warm_up()
    result["rows_1"] = step_ms(single, 1)
    result["vocoder_ms"] = vocoder_ms(single)
    result["vocoder_batch_ms"] = vocoder_batch_ms(single)
    del single
    torch.cuda.empty_cache()
    start = time.perf_counter()
    tts = random_tts(size, "custom_voice", "cuda", torch.bfloat16, workdir, rows=rows, compiled=True, max_queue=256)
    tts.warm_up()
    result["load_capture_compile_s"] = time.perf_counter() - start  # random weights: no file reading
    result["kernels_per_frame"] = kernels_per_frame(tts)
    result[f"rows_{rows}"] = {n: step_ms(tts, n) for n in sorted({1, 8, rows})}
    result["determinism"] = determinism(tts)
    result["together"] = [run_streams(tts, n, frames, 0.0) for n in streams if n <= 2 * rows]
    result["staggered"] = [run_streams(tts, n, frames, 0.25) for n in streams if n <= 2 * rows]
    return result


def markdown(report: dict) -> str:
    lines = [f"### {report['gpu']} — {report['date']}", "",
             f"torch {report['torch']}, talker bf16 (compiled + CUDA graph), codec float32, random weights at real size, "
             f"engine of {report['rows']} rows, {report['frames']}-frame utterances. Command: `{report['command']}`", ""]
    for size, r in report["sizes"].items():
        lines += [f"#### {size}", "", "| rows running | decode step ms |", "|---|---|"]
        lines.append(f"| 1 (engine of 1 row) | {r['rows_1']:.2f} |")
        for n, t in r[f"rows_{report['rows']}"].items():
            lines.append(f"| {n} (engine of {report['rows']} rows) | {t:.2f} |")
        lines += ["", "| vocoder call, frames | " + " | ".join(str(n) for n in r["vocoder_ms"]) + " |",
                  "|---|" + "---|" * len(r["vocoder_ms"]),
                  "| ms per call | " + " | ".join(f"{t:.2f}" for t in r["vocoder_ms"].values()) + " |",
                  "| ms per frame | " + " | ".join(f"{t / n:.2f}" for n, t in r["vocoder_ms"].items()) + " |"]
        if r.get("vocoder_batch_ms"):
            batch = r["vocoder_batch_ms"]
            lines += ["", f"Batched vocoder call, {batch['slots']} streams x {batch['frames']} frames: {batch['ms']:.2f} ms "
                          f"({batch['ms'] / batch['slots']:.2f} ms a chunk)."]
        lines += ["", f"Kernels per decode step: {r['kernels_per_frame']}. Build, capture and compile of the engine: {r['load_capture_compile_s']:.0f} s.", "",
                  "| streams | arrival | aggregate x real time | TTFA p50 ms | TTFA p95 ms | gap p95 ms | gap max ms | stutters |",
                  "|---|---|---|---|---|---|---|---|"]
        for kind in ("together", "staggered"):
            for s in r[kind]:
                arrival = "together" if kind == "together" else f"every {s['stagger_ms']:.0f} ms"
                lines.append(f"| {s['streams']} | {arrival} | {s['aggregate_x_real_time']:.1f} | {s['ttfa_p50_ms']:.0f} | "
                             f"{s['ttfa_p95_ms']:.0f} | {s['gap_p95_ms']:.0f} | {s['gap_max_ms']:.0f} | {s['stutters']} |")
        d = r["determinism"]
        lines += ["", "Determinism (bf16, compiled graph): " + ", ".join(f"{k}: {v}" for k, v in d.items()), ""]
    if report["graph_equals_eager"]:
        lines += ["Graph vs eager codes (0.6B, 60 frames, seed 7): " + ", ".join(f"{k}: {'identical' if v else 'DIFFERENT'}" for k, v in report["graph_equals_eager"].items()), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speed")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--rows", type=int, default=16, help="rows of the engine (its batch)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--frames", type=int, default=250, help="frames per utterance (250 = 20 s)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--no-checks", dest="checks", action="store_false", help="skip the graph-vs-eager code comparison")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        report = {
            **report_header("benchmarks.speed", argv),
            "rows": args.rows,
            "frames": args.frames,
            "graph_equals_eager": {**graph_equals_eager("0.6B", workdir, torch.float32), **graph_equals_eager("0.6B", workdir, torch.bfloat16)}
            if args.checks else {},
            "sizes": {},
        }
        print("graph vs eager:", report["graph_equals_eager"], flush=True)
        for size in args.sizes:
            report["sizes"][size] = bench_size(size, workdir, args.rows, args.streams, args.frames)
            print(size, json.dumps(report["sizes"][size]), flush=True)
            torch.cuda.empty_cache()
    write_report(args.out, "-".join(args.sizes), report, markdown(report))
    return 0


def save_figure(fig, axes, title: str, path: Path, legend_size: int = 8) -> bool:
    """Grid and legend on every axis, the title over them all, the figure written to `path` and closed."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=legend_size)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(out: Path, name: str, report: dict, table: str) -> None:
    """DATE-GPU-NAME.json and .md in `out`; the table also on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{report['date']}-{report['gpu'].replace(' ', '_')}-{name}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    (out / f"{stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    sys.exit(main())
