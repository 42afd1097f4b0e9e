"""The fused decode step against the unfused one, on the GPU: `python -m benchmarks.kernels`.

Random weights at the real sizes (benchmarks.speed.random_tts), bf16, CUDA graphs. For each size:
the decode step's ms per frame and kernels per frame, unfused (the modules' step, torch.compile'd)
and fused (pipeline.kernels), in an engine of 1 row and of 16 rows at 1 / 8 / 16 rows running;
where the fused frame's time goes (kernel time by kind, and the launch gaps between kernels);
and how near the two are numerically: in float32 the codes must be identical, in bf16 the share
of equal codes and the waveform error over one utterance. `--ablation` times the fused step's
launch options and paths; `--sweep` times each kernel's tiles alone, `--step-sweep` in the whole
step (the tiles in pipeline.kernels.config.HOPPER_TILES come from it), `--wide-sweep` the columns and
stages of launches over more than 16 rows (HOPPER_WIDE_TILES); `--sampling` and `--attention`
time those kernels alone; `--profile` says where the step's time goes. Every variant is an engine
built with its own `KernelConfig` (the GPU's, `dataclasses.replace`d).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch

import pipeline.kernels.decode as kernels
from benchmarks.speed import RUNS, SIZES, kernels_per_frame, random_tts, report_header, request, rows_running, step_ms, write_report
from pipeline.kernels.config import KernelConfig, Tiles
from pipeline.tts import TTS

KINDS = (  # (kind, substrings of kernel names), first match wins
    ("q/k/v + norms + RoPE + cache write", ("_qkv_kernel",)),
    ("talker attention (its cache in chunks)", ("_attention_split",)),
    ("attention", ("_attention_",)),
    ("projections (o, gate/up, down)", ("_linear_kernel",)),
    ("final norms", ("_rms_norm_kernel",)),
    ("heads and embeddings (cuBLAS, gathers)", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "index", "embedding")),
    ("sampling (fused; the code draws also write the next input, the last token kernel commits the row state)",
     ("_sample_kernel", "_code_kernel", "_next_token_kernel")),
    ("step glue (inductor)", ("triton_", "sort", "scan", "softmax", "reduce")),
)


def step_kernels(tts: TTS) -> list[tuple[str, float, float, float]]:
    """One decode step's kernels as the profiler sees them: (name, start, end, GPU time), in us."""
    from torch.profiler import ProfilerActivity, profile

    decoder = tts.engine.decoder
    decoder.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decoder.step()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.start, e.time_range.end, e.device_time) for e in prof.events()
            if e.device_type.name == "CUDA" and "Memcpy" not in e.name and "Memset" not in e.name]


def profile_step(tts: TTS) -> dict:
    """Kernels of one decode step by kind: count and GPU ms; the rest of the step's time is launch gaps."""
    kinds: dict[str, list[float]] = {}
    for name, _, _, us in step_kernels(tts):
        kinds.setdefault(kind_of(name), []).append(us / 1000.0)
    return {k: {"kernels": len(v), "ms": sum(v)} for k, v in kinds.items()}


def kind_of(kernel: str) -> str:
    return next((k for k, names in KINDS if any(n in kernel for n in names)), "other")


def charge_in_order(kernels: list[tuple[str, float, float]]) -> dict:
    """Where an overlapped step's time goes: its kernels (name, start, end in us) in the order they
    start, each charged with how much later than every kernel before it it ends (a kernel launched
    early waits beside the previous one: only what it adds to the frame counts), by kind: kernels,
    ms of the frame, us each. The charges add up to the step's span."""
    kinds: dict[str, list[float]] = {}
    done = None
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        done = start if done is None else done
        kinds.setdefault(kind_of(name), []).append(max(end - done, 0.0))
        done = max(done, end)
    return {k: {"kernels": len(v), "ms": sum(v) / 1000.0, "us_each": sum(v) / len(v)} for k, v in kinds.items()}


def timeline_profile(tts: TTS) -> dict:
    """`charge_in_order` of one decode step as it runs (overlapped launches, CUDA graph)."""
    return charge_in_order([(name, start, end) for name, start, end, _ in step_kernels(tts)])


def frame_shares(size: str, workdir: Path, config: KernelConfig, rows: int = 1) -> dict:
    """`timeline_profile` of a fused engine of `rows` rows, every row running, with its step's ms per frame."""
    return on_own_engine(size, workdir, config, lambda tts: {"step_ms": step_ms(tts, rows), "kinds": running(tts, rows, timeline_profile)}, rows)


def running(tts: TTS, rows: int, measure):
    """`measure(tts)` with the engine's first `rows` rows running."""
    with rows_running(tts, rows):
        return measure(tts)


def profile_markdown(report: dict) -> str:
    lines = []
    for size, timeline in report["timeline"].items():
        rows = report.get("rows", 1)
        lines += [f"{size}, engine of {rows} row{'s' if rows > 1 else ''}, all running: {timeline['step_ms']:.3f} ms per frame. "
                  "Each kind's share of one overlapped step "
                  "(a kernel charged with how much later than the kernels before it it ends), and the kernels' own times with "
                  "overlapped launches off:", "",
                  "| kind | kernels | ms of the frame | us each | own ms, launches serial |", "|---|---|---|---|---|"]
        serial = report["profile"][size]
        for kind, v in sorted(timeline["kinds"].items(), key=lambda kv: -kv[1]["ms"]):
            own = serial.get(kind, {}).get("ms")
            lines.append(f"| {kind} | {v['kernels']} | {v['ms']:.3f} | {v['us_each']:.1f} | {'-' if own is None else f'{own:.3f}'} |")
        lines += [f"| **all** | {sum(v['kernels'] for v in timeline['kinds'].values())} | {sum(v['ms'] for v in timeline['kinds'].values()):.3f} | "
                  f"| {sum(v['ms'] for v in serial.values()):.3f} |", ""]
    return "\n".join(lines)


def fused_engine(size: str, workdir: Path, rows: int, config: KernelConfig) -> TTS:
    """The random custom-voice model of `size` in bf16 with the fused step on `config`, an engine of `rows` rows."""
    return random_tts(size, "custom_voice", "cuda", torch.bfloat16, workdir, rows=rows, fused=True, kernels=config)


def on_own_engine(size: str, workdir: Path, config: KernelConfig, measure, rows: int = 1):
    """`measure(tts)` of a fused engine of `rows` rows built for this measurement alone (freed after it)."""
    tts = fused_engine(size, workdir, rows, config)
    result = measure(tts)
    del tts
    torch.cuda.empty_cache()
    return result


def one_row_step_ms(size: str, workdir: Path, config: KernelConfig) -> float:
    return on_own_engine(size, workdir, config, lambda tts: step_ms(tts, 1))


def with_tiles(config: KernelConfig, key: tuple[str, int, int], t: Tiles) -> KernelConfig:
    """`config` with tiles `t` for weight shape `key`."""
    return dataclasses.replace(config, tuned=MappingProxyType({**config.tuned, key: t}))


def serial_profile(size: str, workdir: Path, config: KernelConfig, rows: int = 1) -> dict:
    """`profile_step` of the fused step with overlapped launches off (an engine of `rows` rows, all
    running): on, each kernel is launched while the previous one runs and its measured time would
    include its wait for it. Not compiled: the fused step runs no torch.compile'd code."""
    return on_own_engine(size, workdir, dataclasses.replace(config, overlap=False), lambda tts: running(tts, rows, profile_step), rows)


BEFORE_SWEEP = "the tiles before this run's sweep"
ROW_BLOCKS_LABEL = "row blocks (the default)"
ALL_ROWS_LABEL = "every frame over all 16 rows (row blocks off)"
# (label, KernelConfig fields changed from the GPU's configuration)
ABLATION = (
    ("overlapped launches off, prefetch off", dict(overlap=False, l2_prefetch_bytes=0)),
    ("overlapped launches on, prefetch off", dict(l2_prefetch_bytes=0)),
    ("overlapped launches on, prefetch on (the default)", {}),
)


def launch_ablation(size: str, workdir: Path, frames: int, config: KernelConfig, variants=ABLATION, repeats: int = 1) -> dict:
    """The fused step's ms per frame (engine of 1 row) with overlapped launches and the next
    weights' L2 prefetch off and on (and the prefetch alone off); kernels per frame; for the default
    the 16-row engine at 1 / 8 / 16 rows running, with row blocks on and off (every frame over all
    rows), and how near the bf16 codes of the 16-row engine are to the 1-row engine's (one sampled
    utterance, seed 7). Not compiled: with the fused kernels
    the step runs no torch.compile'd code (the prefill does). `repeats` > 1: the 1-row times again,
    an engine built anew each time, the variants taking turns (a difference of a few percent between
    two variants is only real where their runs do not overlap); the table shows the median."""
    result: dict = {"rows_1": {}, "kernels": {}, "rows_16": {}}
    outputs = {}
    for label, settings in variants:
        variant = dataclasses.replace(config, **settings)
        tts = fused_engine(size, workdir, 1, variant)
        result["rows_1"][label] = step_ms(tts, 1)
        result["kernels"][label] = kernels_per_frame(tts)
        if not settings:  # the default: its 16-row engine too, row blocks on and off
            outputs["1 row"] = codes_and_audio(tts, False, frames)
            del tts
            tts = fused_engine(size, workdir, 16, variant)
            result["rows_16"][ROW_BLOCKS_LABEL] = occupied_step_ms(tts)
            outputs["16 rows"] = codes_and_audio(tts, False, frames)
            del tts
            tts = fused_engine(size, workdir, 16, dataclasses.replace(variant, row_blocks=False))
            result["rows_16"][ALL_ROWS_LABEL] = occupied_step_ms(tts)
            outputs["16 rows, all rows"] = codes_and_audio(tts, False, frames)
        print(size, label, result["rows_1"][label], result["kernels"][label], flush=True)
        del tts
        torch.cuda.empty_cache()
    result["rows_1_runs"] = {label: [ms] for label, ms in result["rows_1"].items()}
    for _ in range(repeats - 1):
        for label, settings in variants:
            result["rows_1_runs"][label].append(one_row_step_ms(size, workdir, dataclasses.replace(config, **settings)))
    result["rows_1"] = {label: statistics.median(runs) for label, runs in result["rows_1_runs"].items()}
    result["bf16_16_rows_against_one_row"] = {
        "row blocks": nearness(outputs["1 row"], outputs["16 rows"]), "all rows": nearness(outputs["1 row"], outputs["16 rows, all rows"])}
    return result


SAMPLING_CASES = ((2048, 1, 50, 1.0), (2048, 1, 0, 1.0), (2048, 16, 50, 1.0), (3072, 1, 50, 1.0), (3072, 1, 0, 1.0), (2048, 1, 50, 0.8))


def sampling_us(config: KernelConfig, draws: int = 8) -> dict[str, float]:
    """The fused sampling kernel alone (CUDA graph), temperature 0.9, per vocabulary (the code
    predictor's 2,048, the talker's 3,072), rows, top-k (50, or 0: off, no search) and top-p: the
    median over `draws` logit draws (how soon the top-k search stops depends on the logits)."""
    from pipeline.engine.sampling import RowSampling, exponential_noise
    from pipeline.kernels import fused_sample

    result = {}
    for vocab, rows, top_k, top_p in SAMPLING_CASES:
        settings = RowSampling.zeros(rows, torch.device("cuda"))
        for row in range(rows):
            settings.set_row(row, True, 0.9, top_k, top_p)
        noise = exponential_noise(torch.arange(rows, device="cuda") + 1, torch.zeros(rows, dtype=torch.long, device="cuda"), vocab)
        times = []
        for seed in range(draws):
            # bf16-rounded, as the heads' logits are
            logits = (3 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))).bfloat16().float().cuda()
            times.append(graph_us(lambda: fused_sample(logits, settings, noise, config)))
        result[f"vocabulary {vocab}, {rows} rows, top-k {top_k}, top-p {top_p}"] = statistics.median(times)
    return result


def sampling_markdown(report: dict) -> str:
    lines = ["| sampling kernel alone (CUDA graph), temperature 0.9 | us per launch |", "|---|---|"]
    return "\n".join(lines + [f"| {case} | {us:.1f} |" for case, us in report["sampling_us"].items()]) + "\n"


def occupied_step_ms(tts: TTS) -> dict[int, float]:
    return {n: step_ms(tts, n) for n in sorted({1, 8, tts.rows}) if n <= tts.rows}


def codes_and_audio(tts: TTS, greedy: bool, frames: int) -> tuple[np.ndarray, np.ndarray]:
    result = tts.synthesize(request(frames, seed=7, greedy=greedy))
    return result.codes, result.audio


def nearness(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> dict:
    codes_a, codes_b = a[0], b[0]
    frames = min(len(codes_a), len(codes_b))
    differ = np.flatnonzero((codes_a[:frames] != codes_b[:frames]).any(axis=1))
    samples = min(len(a[1]), len(b[1]))
    error = np.linalg.norm(a[1][:samples] - b[1][:samples]) / max(np.linalg.norm(a[1][:samples]), 1e-12)
    return {
        "identical": bool(np.array_equal(codes_a, codes_b)),
        "equal_code_share": float((codes_a[:frames] == codes_b[:frames]).mean()),
        "first_differing_frame": int(differ[0]) if len(differ) else None,
        "waveform_relative_l2": float(error),
    }


def bench_size(size: str, workdir: Path, frames: int, variants: tuple[str, ...], config: KernelConfig) -> dict:
    """Step timings of each variant ("unfused", "fused": compiled, CUDA graphs) and the nearness of
    their bf16 codes; "unfused eager" (not compiled: other kernels, other rounding order) gives the
    spread that any change of kernels causes, against which the fused step's is read."""
    result: dict = {}
    outputs: dict = {}
    for name in variants:
        fused, compiled = name == "fused", name != "unfused eager"
        tts = random_tts(size, "custom_voice", "cuda", torch.bfloat16, workdir, rows=1, compiled=compiled, fused=fused, kernels=config)
        outputs[name] = {greedy: codes_and_audio(tts, greedy, frames) for greedy in (True, False)}
        if compiled:
            result[f"{name}_rows_1"] = step_ms(tts, 1)
            result[f"{name}_profile_rows_1"] = profile_step(tts) if not fused else serial_profile(size, workdir, config)
            del tts
            tts = random_tts(size, "custom_voice", "cuda", torch.bfloat16, workdir, rows=16, compiled=True, fused=fused, kernels=config)
            result[f"{name}_rows_16"] = occupied_step_ms(tts)
            print(size, name, result[f"{name}_rows_1"], result[f"{name}_rows_16"], flush=True)
        del tts
        torch.cuda.empty_cache()
    if "unfused" in outputs:
        result["bf16"] = {name: {("greedy" if g else "sampled"): nearness(outputs["unfused"][g], outputs[name][g]) for g in (True, False)}
                          for name in outputs if name != "unfused"}
    return result


def float32_identity(workdir: Path, frames: int) -> dict:
    """Codes of the unfused and the fused step in float32 (CUDA graphs, not compiled): must be identical."""
    outputs = {}
    for fused in (False, True):
        tts = random_tts("0.6B", "custom_voice", "cuda", torch.float32, workdir, rows=2, fused=fused)
        outputs[fused] = {greedy: codes_and_audio(tts, greedy, frames) for greedy in (True, False)}
        del tts
        torch.cuda.empty_cache()
    return {("greedy" if g else "sampled"): nearness(outputs[False][g], outputs[True][g]) for g in (True, False)}


def markdown(report: dict) -> str:
    sizes = report["sizes"]
    lines = [f"### {report['gpu']} — {report['date']}", "", f"torch {report['torch']}. Command: `{report['command']}`", "",
             "| decode step ms per frame (bf16, CUDA graph) | " + " | ".join(sizes) + " |", "|---|" + "---|" * len(sizes)]
    labels = [("engine of 1 row", "rows_1", None)] + [(f"engine of 16 rows, {n} running", "rows_16", n) for n in (1, 8, 16)]
    for name in ("unfused", "fused"):
        for label, key, n in labels:
            values = [r.get(f"{name}_{key}") for r in sizes.values()]
            if all(v is not None for v in values):
                lines.append(f"| {name}, {label} | " + " | ".join(f"{v if n is None else v[n]:.2f}" for v in values) + " |")
    for size, r in sizes.items():
        for name in ("unfused", "fused"):
            profile = r.get(f"{name}_profile_rows_1")
            if not profile:
                continue
            busy = sum(v["ms"] for v in profile.values())
            serial = " (profiled with overlapped launches off: the kernels' own times)" if name == "fused" else ""
            lines += ["", f"Where the {name} frame's time goes ({size}, engine of 1 row, {r[f'{name}_rows_1']:.2f} ms){serial}:", "",
                      "| kind | kernels | GPU ms |", "|---|---|---|"]
            for kind, v in sorted(profile.items(), key=lambda kv: -kv[1]["ms"]):
                lines.append(f"| {kind} | {v['kernels']} | {v['ms']:.3f} |")
            lines.append(f"| **all kernels** | {sum(v['kernels'] for v in profile.values())} | {busy:.3f} |")
            lines.append(f"| launch gaps (frame - kernel time) | | {r[f'{name}_rows_1'] - busy:.3f} |")
        lines.append("")
        for name, modes in r.get("bf16", {}).items():
            for mode, near in modes.items():
                lines.append(f"{size} bf16 {mode}, {name} against unfused (compiled): {100 * near['equal_code_share']:.1f}% of codes equal, "
                             f"first differing frame {near['first_differing_frame']}, waveform relative L2 {near['waveform_relative_l2']:.2e}.")
    if report.get("float32"):
        lines += ["", "float32 (0.6B): " + ", ".join(f"{mode}: codes {'identical' if n['identical'] else 'NOT identical'}"
                                                     for mode, n in report["float32"].items()), ""]
    return "\n".join(lines)


def sweep_markdown(swept: dict) -> list[str]:
    """The sweep's matmul winners against the tiles the run started with, us per launch from HBM."""
    rows = [(key, r) for key, r in swept.items() if isinstance(r, dict)]
    if not rows:
        return []
    lines = ["", "| kernel (kind, N, K): us per launch, weights from HBM | tile before the sweep | us | the sweep's best tile | us |",
             "|---|---|---|---|---|"]
    lines += [f"| {key} | {r['previous']} | {r['previous_us']:.2f} | {r['best']} | {r['us']:.2f} |" for key, r in rows]
    return lines + [""]


def ablation_markdown(report: dict) -> str:
    sizes = list(report["ablation"])
    runs = report["ablation"]
    lines = [f"### {report['gpu']} — {report['date']}", "", f"torch {report['torch']}. Command: `{report['command']}`", "",
             *sweep_markdown(report.get("sweep", {})),
             "| fused step, engine of 1 row: ms per frame (kernels per frame) | " + " | ".join(sizes) + " |", "|---|" + "---|" * len(sizes)]
    for label in runs[sizes[0]]["rows_1"]:
        lines.append(f"| {label} | " + " | ".join(f"{runs[s]['rows_1'][label]:.2f} ({runs[s]['kernels'][label]})" for s in sizes) + " |")
    if any(len(r) > 1 for s in sizes for r in runs[s].get("rows_1_runs", {}).values()):
        lines += ["", "Each run (median above), engines built anew, the variants taking turns:", ""]
        lines += [f"- {s}, {label}: " + " / ".join(f"{ms:.2f}" for ms in r) for s in sizes for label, r in runs[s]["rows_1_runs"].items()]
    lines += ["", "| engine of 16 rows, ms per frame at 1 / 8 / 16 rows running | " + " | ".join(sizes) + " |", "|---|" + "---|" * len(sizes)]
    for path in runs[sizes[0]]["rows_16"]:
        lines.append(f"| {path} | " + " | ".join(" / ".join(f"{ms:.2f}" for ms in runs[s]["rows_16"][path].values()) for s in sizes) + " |")
    lines.append("")
    for s in sizes:
        for blocks, near in runs[s]["bf16_16_rows_against_one_row"].items():
            lines.append(f"{s} bf16, sampled (seed 7), the 16-row engine ({blocks}) against the 1-row engine: codes "
                         f"{'identical' if near['identical'] else 'NOT identical'}, waveform relative L2 {near['waveform_relative_l2']:.2e}.")
    if report.get("profile"):
        for s, profile in report["profile"].items():
            lines += ["", f"Where the default step's time goes ({s}, engine of 1 row, overlapped launches off: the kernels' own times):", "",
                      "| kind | kernels | GPU ms |", "|---|---|---|"]
            for kind, v in sorted(profile.items(), key=lambda kv: -kv[1]["ms"]):
                lines.append(f"| {kind} | {v['kernels']} | {v['ms']:.3f} |")
            lines.append(f"| **all kernels** | {sum(v['kernels'] for v in profile.values())} | {sum(v['ms'] for v in profile.values()):.3f} |")
    return "\n".join(lines) + "\n\n" + sampling_markdown(report)


def weight_shape(text: str) -> tuple[str, int, int]:
    """`--shapes`' KIND,N,K (a key of `KernelConfig.tuned`)."""
    kind, n, k = text.split(",") if text.count(",") == 2 else ("", "", "")
    if kind not in ("qkv", "linear0", "linear1", "linear2") or not (n.isdigit() and k.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not KIND,N,K with KIND one of qkv, linear0, linear1, linear2 (e.g. linear2,6144,2048)")
    return kind, int(n), int(k)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--frames", type=int, default=200, help="frames of the utterance compared between the variants")
    parser.add_argument("--variants", nargs="+", default=["unfused", "unfused eager", "fused"], choices=["unfused", "unfused eager", "fused"])
    parser.add_argument("--sweep", action="store_true", help="time every candidate tile of each kernel first and use the fastest")
    parser.add_argument("--no-float32", dest="float32", action="store_false", help="skip the float32 identity check")
    parser.add_argument("--ablation", action="store_true",
                        help="only the fused step with overlapped launches and the L2 prefetch off and on, row blocks off and on, "
                             "its profile, and the sampling kernel alone")
    parser.add_argument("--repeats", type=int, default=1, help="with --ablation: time each variant's 1-row step this many times, taking turns")
    parser.add_argument("--step-sweep", action="store_true",
                        help="only tune the tiles in the step: each weight shape's alternatives timed in the whole decode step (1 row)")
    parser.add_argument("--shapes", nargs="+", type=weight_shape, metavar="KIND,N,K",
                        help="with --step-sweep or --wide-sweep: only these weight shapes (e.g. linear2,6144,2048); default every shape the step launches")
    parser.add_argument("--wide-sweep", action="store_true",
                        help="only the step at 17 / 32 / 64 rows running (engine of 64 rows) with each weight shape's launches over more than "
                             "16 rows in other columns or stages, one shape at a time")
    parser.add_argument("--sampling", action="store_true", help="only the sampling kernel alone, top-k on and off, per vocabulary")
    parser.add_argument("--attention", action="store_true", help="only the talker's attention alone, per chunking and context length")
    parser.add_argument("--profile", action="store_true",
                        help="only where the fused step's time goes (an engine of --rows rows, all running): each kernel kind's share of the "
                             "overlapped frame, and the kernels' own times with overlapped launches off")
    parser.add_argument("--rows", type=int, default=1, help="with --profile: the engine's rows, all running (default 1)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    args.shapes = set(args.shapes) if args.shapes else None
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, not {args.repeats}")
    if not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.attention:
        report = {**report_header("benchmarks.kernels", argv), "attention_us": attention_alone()}
        write_report(args.out, "attention", report, attention_markdown(report))
        return 0
    config = KernelConfig.for_device(torch.device("cuda"))
    if args.sampling:
        report = {**report_header("benchmarks.kernels", argv), "sampling_us": sampling_us(config)}
        write_report(args.out, "sampling", report, sampling_markdown(report))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.profile:
            report = {**report_header("benchmarks.kernels", argv), "rows": args.rows, "timeline": {}, "profile": {}}
            for size in args.sizes:
                report["timeline"][size] = frame_shares(size, workdir, config, args.rows)
                report["profile"][size] = serial_profile(size, workdir, config, args.rows)
            write_report(args.out, "profile-" + "-".join(args.sizes), report, profile_markdown(report))
            return 0
        if args.wide_sweep:
            report = {**report_header("benchmarks.kernels", argv), "wide_sweep": {}}
            for size in args.sizes:
                report["wide_sweep"][size] = wide_sweep(size, workdir, config, args.shapes)
                write_report(args.out, "wide-sweep-" + "-".join(args.sizes), report, wide_sweep_markdown(report))
            return 0
        if args.step_sweep:
            report = {**report_header("benchmarks.kernels", argv), "step_sweep": {}}
            for size in args.sizes:
                report["step_sweep"][size], config = step_sweep(size, workdir, config, args.shapes)
                write_report(args.out, "step-sweep-" + "-".join(args.sizes), report, step_sweep_markdown(report))
            return 0
        before_sweep = config
        swept, config = sweep(args.sizes, config) if args.sweep else ({}, config)
        if args.ablation:
            report = {**report_header("benchmarks.kernels", argv), "sweep": swept, "sampling_us": sampling_us(config), "ablation": {},
                      "profile": {}}
            variants = ABLATION
            if args.sweep:  # the step with the tiles and attention it started with, against the sweep's
                variants = ((BEFORE_SWEEP, {f.name: getattr(before_sweep, f.name) for f in dataclasses.fields(KernelConfig)}), *ABLATION)
            for size in args.sizes:
                report["ablation"][size] = launch_ablation(size, workdir, args.frames, config, variants, args.repeats)
                report["profile"][size] = serial_profile(size, workdir, config)
                write_report(args.out, "ablation-" + "-".join(args.sizes), report, ablation_markdown(report))
            return 0
        report = {
            **report_header("benchmarks.kernels", argv),
            "sweep": swept,
            "float32": float32_identity(workdir, 60) if args.float32 else {},
            "sizes": {},
        }
        for size in args.sizes:
            report["sizes"][size] = bench_size(size, workdir, args.frames, tuple(args.variants), config)
            write_report(args.out, "kernels-" + "-".join(args.sizes), report, markdown(report))
    return 0


# ---- tile sweep ---------------------------------------------------------------------------------

TALKER_CACHE = 2048  # positions of the talker's cache (pipeline.tts.DEFAULT_MAX_SEQ)
# A sweep times each kernel over copies of its weight that together are this many bytes at least:
# more than an H100's or H200's 50 MB of L2, so that every launch reads its weight from HBM as in
# the decode step (whose weights, 0.1-1 GB a frame, never stay in L2): one weight replayed would stay
# in L2 and time L2, not HBM.
COLD_BYTES = 128 << 20


def sweep_candidates(kind: str, k: int) -> list[Tiles]:
    """Tiles timed for a matmul kernel of reduction depth k: columns per program (the q/k/v kernel's
    are a head's), depth per iteration, warps and K splits; those that split K unevenly left out."""
    if kind == "qkv":
        shapes = [(16, block_k, warps, split) for block_k in (64, 128, 256) for warps in (4, 8) for split in (1, 2, 4, 8)]
    else:
        shapes = [(block_n, block_k, 4, split) for block_n in (16, 32) for block_k in (128, 256, 512) for split in (1, 2, 4, 8)]
    return [Tiles(n, block_k, warps, 3, split) for n, block_k, warps, split in shapes if k % (split * block_k) == 0]


# ---- tile sweep in the step ---------------------------------------------------------------------

# Where the step's kernels run: shapes in this order (q/k/v, gate/up, o and down, then the heads),
# the deepest reduction first within a kind. A kernel's time alone does not tell its time in the
# step (the next kernel launches while it runs and needs room on the SMs beside it; its weights
# come from L2 or HBM depending on its neighbours), so `step_sweep` times the whole step.
STEP_SWEEP_ORDER = {"qkv": 0, "linear2": 1, "linear1": 2}
STEP_SWEEP_GAIN = 0.004  # an alternative is kept only if the step is faster by more than this share (repeat noise ~0.3%)


def step_tile_alternatives(kind: str, k: int, current: Tiles) -> list[Tiles]:
    """Tiles that differ from `current` in one field (warps, pipeline stages, K splits, depth per
    iteration, columns per program; the q/k/v kernel's columns are a head's), and a narrower column
    block with twice the splits (the same programs); only those that split K into whole tiles."""
    r = dataclasses.replace
    found = [r(current, num_warps=w) for w in (2, 4, 8)] + [r(current, num_stages=s) for s in (1, 2, 3, 4)]
    found += [r(current, split_k=s) for s in (1, 2, 4, 8, 16)] + [r(current, block_k=b) for b in (64, 128, 256, 512)]
    if kind != "qkv":
        found += [r(current, block_n=b) for b in (16, 32, 64)]
        if current.block_n == 32:
            found.append(r(current, block_n=16, split_k=2 * current.split_k))
    unique = []
    for t in found:
        if t != current and t not in unique and kernels.splits_whole(k, t) and t.block_k <= 2 * k:
            unique.append(t)
    return unique


@dataclasses.dataclass(frozen=True)
class RecordingConfig(KernelConfig):
    """A KernelConfig that notes every weight shape whose tiles are asked for."""

    asked: set = dataclasses.field(default_factory=set, hash=False, compare=False)

    def tiles(self, kind: str, n: int, k: int, dtype: torch.dtype, rows: int = 1) -> Tiles:
        self.asked.add((kind, n, k))
        return super().tiles(kind, n, k, dtype, rows)


def step_sweep(size: str, workdir: Path, config: KernelConfig, shapes: set[tuple[str, int, int]] | None = None) -> tuple[dict, KernelConfig]:
    """Greedy tuning of the tiles in the decode step of `size` (engine of 1 row, bf16): for each weight
    shape the step launches (of `shapes` only, if given), in STEP_SWEEP_ORDER, every `step_tile_alternatives` tile timed in the
    whole step (an engine built anew for each), the fastest kept where it beats the best so far by
    STEP_SWEEP_GAIN. Returns the step's ms before and after, the tiles kept and every timing, and
    `config` with the tiles kept (for the rest of the run)."""
    recording = RecordingConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(KernelConfig)})
    base = one_row_step_ms(size, workdir, recording)
    used = recording.asked
    best, kept, log = base, {}, []
    for key in sorted(used if shapes is None else used & shapes, key=lambda key: (STEP_SWEEP_ORDER.get(key[0], len(STEP_SWEEP_ORDER)), -key[2])):
        kind, n, k = key
        current = config.tiles(kind, n, k, torch.bfloat16)
        winner = current
        for alternative in step_tile_alternatives(kind, k, current):
            ms = one_row_step_ms(size, workdir, with_tiles(config, key, alternative))
            log.append({"shape": list(key), "tiles": dataclasses.asdict(alternative), "ms": ms})
            print(size, key, alternative, f"{ms:.4f}", flush=True)
            if ms < best * (1 - STEP_SWEEP_GAIN):
                best, winner = ms, alternative
        config = with_tiles(config, key, winner)
        if winner != current:
            kept[",".join(map(str, key))] = {"before": dataclasses.asdict(current), "after": dataclasses.asdict(winner), "ms": best}
    return {"base_ms": base, "final_ms": one_row_step_ms(size, workdir, config), "kept": kept, "log": log}, config


def step_sweep_markdown(report: dict) -> str:
    lines = [f"# In-step tile sweep — {report['gpu']}, {report['date']}", "", f"`{report['command']}`", ""]
    for size, result in report["step_sweep"].items():
        lines += [f"## {size}: {result['base_ms']:.3f} -> {result['final_ms']:.3f} ms per frame (engine of 1 row)", "",
                  "| shape (kernel, N, K) | tiles before | tiles kept | step ms when kept |", "|---|---|---|---|"]
        lines += [f"| {shape} | {kept['before']} | {kept['after']} | {kept['ms']:.3f} |" for shape, kept in result["kept"].items()]
        lines.append("")
    return "\n".join(lines)


WIDE_ROWS_RUNNING = (17, 32, 64)


def wide_alternatives(current: Tiles) -> list[Tiles]:
    """Tiles for launches over more than 16 rows that keep a row's sums (`current`'s block_k and split_k):
    16, 32 or 64 columns, in the current stages or in 2."""
    found = {dataclasses.replace(current, block_n=n, num_stages=stages) for n in (16, 32, 64) for stages in {current.num_stages, 2}}
    return sorted(found - {current}, key=lambda t: (t.block_n, t.num_stages))


def wide_sweep(size: str, workdir: Path, config: KernelConfig, shapes: set[tuple[str, int, int]] | None = None) -> dict:
    """The step at WIDE_ROWS_RUNNING rows running (engine of 64 rows) with `config`, then with each matmul
    shape's wide launches (of `shapes` only, if given) in each `wide_alternatives` tile (the q/k/v kernel's
    columns are a head's: its stages only), one shape at a time, then `config` again (the spread of the
    measurement)."""
    recording = RecordingConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(KernelConfig)})
    on_own_engine(size, workdir, recording, lambda tts: None, 64)

    def timed(wide: dict) -> list[float]:
        engine_config = dataclasses.replace(config, wide=MappingProxyType({**config.wide, **wide}))
        return on_own_engine(size, workdir, engine_config, lambda tts: [step_ms(tts, n) for n in WIDE_ROWS_RUNNING], 64)

    result = {"rows": list(WIDE_ROWS_RUNNING), "base_ms": timed({}), "tiles": {}}
    for kind, n, k in sorted(recording.asked & shapes if shapes else recording.asked):
        current = config.tiles(kind, n, k, torch.bfloat16, rows=64)
        options = [t for t in wide_alternatives(current) if kind != "qkv" or t.block_n == current.block_n]
        result["tiles"][str((kind, n, k))] = {"current": str(current), "tried": {str(t): timed({(kind, n, k): t}) for t in options}}
    result["base_again_ms"] = timed({})
    return result


def wide_sweep_markdown(report: dict) -> str:
    lines = [f"# Tiles of launches over more than 16 rows — {report['gpu']}, {report['date']}", "", f"`{report['command']}`", ""]
    for size, result in report["wide_sweep"].items():
        rows = " / ".join(str(r) for r in result["rows"])
        lines += [f"## {size}: step ms at {rows} rows running (engine of 64 rows)", "", "| shape (kernel, N, K) | tiles | step ms |", "|---|---|---|",
                  f"| all as configured | | {' / '.join(f'{ms:.3f}' for ms in result['base_ms'])} |"]
        for shape, swept in result["tiles"].items():
            lines += [f"| {shape} | {tiles} | {' / '.join(f'{ms:.3f}' for ms in times)} |" for tiles, times in swept["tried"].items()]
        lines += [f"| all as configured, again | | {' / '.join(f'{ms:.3f}' for ms in result['base_again_ms'])} |", ""]
    return "\n".join(lines)


def graph_us(fn, launches: int = 20) -> float:
    """Microseconds per call of `fn` replayed `launches` times in one CUDA graph (as in the decode step)."""
    return graph_replay_us(lambda: [fn() for _ in range(launches)]) / launches


def graph_replay_us(fn) -> float:
    """Median microseconds of one replay of `fn`'s launches captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(RUNS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def best_tiles(candidates: list[Tiles], run, output: torch.Tensor, launches: int) -> tuple[Tiles, float, dict]:
    """The fastest candidate (us per launch; `run` launches the kernel `launches` times) whose
    `output` agrees with the default tile's (a wrong kernel is never the fastest one kept): bf16
    results may differ in the last bits (another summation order)."""
    run(Tiles())
    expected = output.float().clone()
    timed = {}
    for t in candidates:
        try:
            run(t)
            error = (output.float() - expected).abs().max().item()
            scale = expected.abs().max().item()
            if not error <= 0.02 * scale:
                raise ValueError(f"output differs from the default tile's by {error:.3g} (scale {scale:.3g})")
            timed[t] = graph_replay_us(lambda: run(t)) / launches
        except Exception as error:  # a tile that does not fit (shared memory, registers) is skipped
            timed[t] = float("inf")
            print("skipped", t, type(error).__name__, error, flush=True)
    best = min(timed, key=timed.get)
    return best, timed[best], {str(t): us for t, us in timed.items()}


# name -> (positions per chunk, warps, positions attended without exchange, programs per head there)
ATTENTION_VARIANTS = {"one program per head": (0, 0, 0, 0),
                      **{f"chunks of {c} x {w} warps": (c, w, c, 1) for c, w in ((64, 4), (128, 8), (256, 8), (256, 16))},
                      **{f"chunks of {c} x {w} warps, up to {whole} positions in {parts} parts": (c, w, whole, parts)
                         for c, w, whole, parts in ((256, 8, 256, 2), (256, 8, 256, 4), (256, 8, 256, 8), (256, 8, 512, 8), (128, 4, 256, 4))}}


def attention_sweep(attn, q, positions, out, workspace, hidden: int, config: KernelConfig, counts=(200, 1000)) -> tuple[dict, KernelConfig]:
    """The talker's attention (a cache of TALKER_CACHE positions) at `counts` positions: one program
    per head against the cache split in chunks (ATTENTION_VARIANTS). Returns the times and `config`
    with the variant whose slowest length is the fastest. (A code-predictor step, 16 positions, is
    one block either way.)"""
    report, timed = {}, {}
    for count in counts:
        positions.fill_(count - 1)
        for name, (chunk, warps, whole, parts) in ATTENTION_VARIANTS.items():
            us = graph_us(lambda: kernels.attention(attn, q, positions, 1, out, workspace, config, chunk=chunk, num_warps=warps or None,
                                                    parts=parts, whole=whole))
            timed.setdefault(name, []).append(us)
            report[f"attention hidden {hidden}, {count} positions, {name}"] = us
            print("attention", count, name, f"{us:.2f} us", flush=True)
    best = min(timed, key=lambda name: max(timed[name]))  # the best worst case: a long utterance must not slow down
    chunk, warps, whole, parts = ATTENTION_VARIANTS[best]
    chunks = MappingProxyType({**config.attention_chunks, TALKER_CACHE: (chunk, warps)})
    return report, dataclasses.replace(config, attention_chunks=chunks, attention_whole=whole, attention_parts=parts or 1)


ATTENTION_COUNTS = (50, 150, 256, 300, 1000, 2000)


@torch.inference_mode()
def attention_alone(rows: int = 1) -> dict:
    """`attention_sweep` of a talker layer's attention (16 query heads, 8 key/value heads of 128: both
    sizes' shapes) at ATTENTION_COUNTS positions, on the GPU's configuration."""
    from pipeline.model import Attention, KVCache

    with torch.device("cuda"):
        attn = Attention(1024, 16, 8, 128, 1e-6).to(torch.bfloat16)
        attn.kv_cache = KVCache(rows, 8, TALKER_CACHE, 128, torch.bfloat16, torch.device("cuda"))
        attn.kv_cache.k.normal_()
        attn.kv_cache.v.normal_()
        q = torch.randn(rows, 16, 128, dtype=torch.bfloat16)
        out = torch.empty(rows, 16 * 128, dtype=torch.bfloat16)
        positions = torch.zeros(rows, dtype=torch.long)
    return attention_sweep(attn, q, positions, out, kernels.Workspace(), 1024, KernelConfig.for_device(torch.device("cuda")), ATTENTION_COUNTS)[0]


def attention_markdown(report: dict) -> str:
    lines = ["| talker attention alone (CUDA graph), us | " + " | ".join(f"{c} positions" for c in ATTENTION_COUNTS) + " |",
             "|---" * (len(ATTENTION_COUNTS) + 1) + "|"]
    for name in ATTENTION_VARIANTS:
        times = [report["attention_us"][f"attention hidden 1024, {c} positions, {name}"] for c in ATTENTION_COUNTS]
        lines.append(f"| {name} | " + " | ".join(f"{us:.1f}" for us in times) + " |")
    return "\n".join(lines) + "\n"


@torch.inference_mode()
def sweep(sizes: list[str], config: KernelConfig, rows: int = 1) -> tuple[dict, KernelConfig]:
    """The fastest tiles of each matmul kernel at each layer shape of the `sizes`' talkers and of the
    code predictor (hidden 1,024 at every size), bf16, `rows` rows, each launch reading its weight
    from HBM (a chain of launches over copies of the weight, COLD_BYTES in all, each asking the next
    copy into L2 as the step asks for the next weight). Then the talker's attention variants. Returns
    the times and `config` with the fastest tiles and attention (for the rest of the run)."""
    from pipeline.model import DecoderLayer, KVCache

    workspace = kernels.Workspace()
    report = {}
    for hidden, intermediate in sorted({(1024, 3072)} | {(SIZES[s]["hidden_size"], SIZES[s]["intermediate_size"]) for s in sizes}):
        copies = -(-COLD_BYTES // (hidden * 2048 * 2))  # the smallest weight's (o's) copies: the others' are bigger
        with torch.device("cuda"):
            layers = [DecoderLayer(hidden, intermediate, 16, 8, 128, 1e-6).to(torch.bfloat16) for _ in range(copies)]
            for layer in layers:
                layer.self_attn.kv_cache = KVCache(rows, 8, TALKER_CACHE, 128, torch.bfloat16, torch.device("cuda"))
                for p in layer.parameters():
                    p.data.normal_(0.0, 0.02)
            h = torch.randn(rows, hidden, dtype=torch.bfloat16)
            positions = torch.full((rows,), 200)
            cos, sin = torch.randn(TALKER_CACHE, 128, dtype=torch.bfloat16), torch.randn(TALKER_CACHE, 128, dtype=torch.bfloat16)
            q = torch.empty(rows, 16, 128, dtype=torch.bfloat16)
            attended = torch.randn(rows, 2048, dtype=torch.bfloat16)
            gated = torch.randn(rows, intermediate, dtype=torch.bfloat16)
            out = torch.empty(rows, hidden, dtype=torch.bfloat16)

        def chain(launch, weight):
            """`launch(layer, t, following)` over the copies, each asking for the next copy's weight."""
            return lambda t: [launch(layer, t, weight(layers[(i + 1) % copies])) for i, layer in enumerate(layers)]

        shapes = {
            ("qkv", 4096, hidden): (q, chain(lambda layer, t, f: kernels.qkv_rope(layer, h, positions, 1, cos, sin, q, workspace, config, t,
                                                                               following=f),
                                              lambda layer: layer.self_attn.qkv_proj.weight)),
            ("linear1", hidden, 2048): (out, chain(lambda layer, t, f: kernels.linear(attended, layer.self_attn.o_proj.weight, out, workspace, config, mode=1,
                                                                                      residual=h, shape=t, following=f),
                                                   lambda layer: layer.self_attn.o_proj.weight)),
            ("linear2", intermediate, hidden): (gated, chain(lambda layer, t, f: kernels.linear(h, layer.mlp.gate_up_proj.weight, gated, workspace, config,
                                                                                                norm=layer.post_attention_layernorm, mode=2, shape=t,
                                                                                                following=f),
                                                             lambda layer: layer.mlp.gate_up_proj.weight)),
            ("linear1", hidden, intermediate): (out, chain(lambda layer, t, f: kernels.linear(gated, layer.mlp.down_proj.weight, out, workspace, config,
                                                                                              mode=1, residual=h, shape=t, following=f),
                                                           lambda layer: layer.mlp.down_proj.weight)),
        }
        for key, (output, run) in shapes.items():
            previous = config.tiles(*key, torch.bfloat16)
            candidates = list(dict.fromkeys([previous, *sweep_candidates(key[0], key[2])]))
            best, us, timed = best_tiles(candidates, run, output, copies)
            config = with_tiles(config, key, best)
            report[str(key)] = {"best": str(best), "us": us, "previous": str(previous), "previous_us": timed.get(str(previous)), "all": timed}
            print(key, best, f"{us:.2f} us (previous tile {previous}: {timed.get(str(previous))})", flush=True)
        times, config = attention_sweep(layers[0].self_attn, q, positions, attended, workspace, hidden, config)
        report.update(times)
        layers.clear()  # the copies' memory back before the next size's (the launches above hold the list)
        torch.cuda.empty_cache()
    return report, config


if __name__ == "__main__":
    sys.exit(main())
