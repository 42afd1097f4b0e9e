"""The vocoder alone: `python -m benchmarks.vocoder`.

The released codec's decoder with random weights (speed does not depend on the values), as the
engine runs it (`MultiStreamDecoder`, each call a CUDA graph): one stream's call of each piece size,
and batched calls of `--slots` streams' steady 16-frame chunks. Then where a batched call's GPU time
goes, kernel by kernel (torch.profiler, eager), and the numerics: a stream decoded in chunks against
one offline call, and against the same decoder in float64. `--tiny`: the tiny codec
on the CPU (PyTorch's ops, no graphs), to try the script.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.speed import RUNS, cuda_ms, random_codec, report_header, write_report
from pipeline.codec import SpeechTokenizer
from pipeline.codec.decoder import MultiStreamDecoder, SpeechDecoder, StreamingDecoder
from pipeline.tiny import write_tiny_speech_tokenizer

CHUNKS = (1, 2, 4, 16, 16, 25)  # a stream of 64 frames cut as the engine's first chunks and steady ones


def tiny_decoder(workdir: Path) -> SpeechDecoder:
    write_tiny_speech_tokenizer(workdir, seed=0)
    return SpeechTokenizer.from_pretrained(workdir).decoder


def random_codes(decoder: SpeechDecoder, frames: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, decoder.config.codebook_size, (frames, decoder.config.num_quantizers), generator=g).to(decoder.device)


def timed_ms(fn, calls: int, device: torch.device) -> float:
    """ms per call of `fn` running on `device`: CUDA events on a GPU, the host clock elsewhere."""
    if device.type == "cuda":
        return statistics.median(cuda_ms(fn, calls) for _ in range(RUNS))
    import time

    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) * 1000.0 / calls


@torch.inference_mode()
def call_ms(decoder: SpeechDecoder, slots: list[int], calls: int) -> dict[str, float]:
    """ms per call: one stream's call of each piece size, and a batched call of each slot count."""
    codes = random_codes(decoder, 32)
    frames = MultiStreamDecoder.BATCH_FRAMES
    graphs = decoder.device.type == "cuda"
    result = {}
    single = MultiStreamDecoder(decoder, 1, use_cuda_graphs=graphs)
    for n in MultiStreamDecoder.CALL_SIZES:
        out = torch.empty(n * decoder.config.upsample, device=decoder.device)
        result[f"1 stream, {n} frame{'s' if n > 1 else ''}"] = timed_ms(lambda: single.decode(0, codes[:n], out), calls, decoder.device)
    for count in slots:
        vocoder = MultiStreamDecoder(decoder, count, use_cuda_graphs=graphs, batch_lanes=1, slots=count)
        outs = [torch.empty(frames * decoder.config.upsample, device=decoder.device) for _ in range(count)]
        for row in range(count):  # past their first call, as steady chunks are
            vocoder.decode(row, codes[:1], outs[row][:decoder.config.upsample])
        rows, chunks = list(range(count)), [codes[1:1 + frames]] * count
        result[f"{count} streams x {frames} frames"] = timed_ms(lambda: vocoder.decode_batch(rows, chunks, outs, 1), calls, decoder.device)
    return result


def pytorch_transformer_ms(decoder: SpeechDecoder, args: argparse.Namespace) -> dict[str, float]:
    """`call_ms` with the transformer in PyTorch's ops (`DecoderTransformer.use_kernels` off), in the same process."""
    decoder.pre_transformer.use_kernels = False
    try:
        return call_ms(decoder, args.slots, args.calls)
    finally:
        decoder.pre_transformer.use_kernels = True


@torch.inference_mode()
def kernel_profile(decoder: SpeechDecoder, slots: int, top: int = 12) -> dict:
    """GPU time per kernel name of one batched call of `slots` streams (eager, the mean of 5 calls)."""
    from torch.profiler import ProfilerActivity, profile

    frames = MultiStreamDecoder.BATCH_FRAMES
    codes = random_codes(decoder, frames + 1)
    vocoder = MultiStreamDecoder(decoder, slots, batch_lanes=1, slots=slots)
    outs = [torch.empty(frames * decoder.config.upsample, device=decoder.device) for _ in range(slots)]
    for row in range(slots):
        vocoder.decode(row, codes[:1], outs[row][:decoder.config.upsample])
    call = lambda: vocoder.decode_batch(list(range(slots)), [codes[1:]] * slots, outs, 1)  # noqa: E731
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            entry = kernels.setdefault(event.name[:80], [0.0, 0.0])
            entry[0] += event.device_time / 5 / 1000.0
            entry[1] += 1 / 5
    ranked = sorted(kernels.items(), key=lambda item: -item[1][0])
    return {"slots": slots, "kernel_ms": sum(ms for ms, _ in kernels.values()), "launches": round(sum(n for _, n in kernels.values())),
            "top": [{"kernel": name, "ms": ms, "launches": round(n)} for name, (ms, n) in ranked[:top]]}


@torch.inference_mode()
def numerics(decoder: SpeechDecoder) -> dict[str, float]:
    """Max abs differences: a stream decoded in chunks against one offline call, and the offline call
    against the same decoder in float64 (PyTorch's ops: the kernels run float32 only)."""
    codes = random_codes(decoder, sum(CHUNKS))
    offline = StreamingDecoder(decoder).decode_chunk(codes)
    stream, parts, done = StreamingDecoder(decoder), [], 0
    for n in CHUNKS:
        parts.append(stream.decode_chunk(codes[done:done + n]))
        done += n
    exact = StreamingDecoder(copy.deepcopy(decoder).double()).decode_chunk(codes)
    return {"streamed_vs_offline": (torch.cat(parts) - offline).abs().max().item(),
            "offline_vs_float64": (offline - exact).abs().max().item()}


def markdown(report: dict) -> str:
    timing = (f"each call a CUDA graph, the median of {RUNS} runs of {report['calls']} calls" if report["codec"] == "released"
              else f"PyTorch's ops, the mean of {report['calls']} calls")
    lines = [f"### {report['gpu']} — {report['date']}: the vocoder", "",
             f"torch {report['torch']}; `{report['command']}`; {report['codec']} codec, random weights, float32; {timing}.", ""]
    columns = {"ms": report["calls_ms"]}
    if report.get("pytorch_transformer_calls_ms"):
        columns["ms, transformer in PyTorch's ops"] = report["pytorch_transformer_calls_ms"]
    lines += ["| call | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{times[name]:.2f}" for times in columns.values()) + " |" for name in report["calls_ms"]]
    if report.get("profile"):
        p = report["profile"]
        lines += ["", f"One batched call of {p['slots']} streams, eager: {p['kernel_ms']:.2f} ms of kernels in {p['launches']} launches.", "",
                  "| kernel | ms | launches |", "|---|---|---|"]
        lines += [f"| `{k['kernel']}` | {k['ms']:.3f} | {k['launches']} |" for k in p["top"]]
    lines += ["", "Numerics, max abs: " + ", ".join(f"{name} {value:.2g}" for name, value in report["numerics"].items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vocoder")
    parser.add_argument("--slots", type=int, nargs="+", default=[4, 16], help="streams per batched call (default 4 16)")
    parser.add_argument("--calls", type=int, default=20, help="calls per timing (default 20)")
    parser.add_argument("--tiny", action="store_true", help="the tiny codec on the CPU, to try the script")
    parser.add_argument("--pytorch-transformer", action="store_true",
                        help="also time the calls with the codec's transformer in PyTorch's ops instead of its Triton kernels")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU (--tiny runs the tiny codec on the CPU)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        decoder = tiny_decoder(Path(tmp)) if args.tiny else random_codec("cuda").decoder
        report = {**report_header("benchmarks.vocoder", argv, on_gpu=not args.tiny), "codec": "tiny" if args.tiny else "released",
                  "calls": args.calls,
                  "calls_ms": call_ms(decoder, args.slots, args.calls),
                  "pytorch_transformer_calls_ms": pytorch_transformer_ms(decoder, args) if args.pytorch_transformer else None,
                  "profile": None if args.tiny else kernel_profile(decoder, args.slots[0]),
                  "numerics": numerics(decoder)}
    write_report(args.out, "vocoder-tiny" if args.tiny else "vocoder", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
