"""Time from a fresh process to a ready engine, with empty compile caches and again with the caches
that run left behind, and the first burst of listeners after ready: `python -m benchmarks.cold_start`.

Each start runs in a process of its own, with TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR pointing
at one fresh directory per model size (the cold start fills it, the warm start reads it), and loads
a checkpoint in the official layout with random weights at the real size (weight values change no
compile or capture) as the app does (`TTS.from_pretrained`, then the warm-up). Reported per start:
the phases (imports, load: weights read, kernels compiled and graphs captured; warm-up) with torch.compile's time inside them and the kernels compiled
in each (the new .cubin files in Triton's cache, inductor's included), and then the first burst of
listeners arriving together: their time to first audio and what compiled during it (nothing should).

    python -m benchmarks.cold_start [--sizes 0.6B 1.7B] [--listeners 16] [--profile] [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULT = "RESULT "


class KernelCache:
    """The kernels in Triton's cache directory (ours and inductor's, one KERNEL_NAME.cubin each): which
    appeared since the last look, so each phase is charged with the kernels compiled in it."""

    def __init__(self):
        self.seen = self.cubins()

    @staticmethod
    def cubins() -> set[Path]:
        return set(Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin")) if os.environ.get("TRITON_CACHE_DIR") else set()

    def new_kernels(self) -> list[str]:
        now = self.cubins()
        new, self.seen = sorted(c.stem for c in now - self.seen), now
        return new


def dynamo_seconds() -> float:
    """Seconds torch.compile has spent so far (dynamo, AOT and inductor), from dynamo's own timers;
    0 where nothing imported dynamo (importing it here would add its import to the start measured)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0.0
    compilation_time_metrics = utils.compilation_time_metrics
    return sum(sum(times) for name, times in compilation_time_metrics.items() if name in ("_compile.compile_inner", "compile_inner"))


def child(checkpoint: str, size: str, listeners: int, frames: int, profile: bool) -> dict:
    cache = KernelCache()
    started = time.perf_counter()
    phases: dict[str, dict] = {}

    def phase(name: str, since: float, dynamo_before: float) -> float:
        now = time.perf_counter()
        kernels = cache.new_kernels()
        phases[name] = {"s": now - since, "torch_compile_s": dynamo_seconds() - dynamo_before, "new_cubins": len(kernels), "kernels": kernels}
        return now

    import torch

    from benchmarks.speed import run_streams
    from pipeline.tts import TTS
    import_done = phase("import", started, 0.0)

    captured: list[float] = []  # when each graph's capture ended (the engine's progress)
    profiler = cProfile.Profile() if profile else contextlib.nullcontext()
    with profiler:
        tts = TTS.from_pretrained(checkpoint, device="cuda", dtype="bfloat16", compiled=True,
                                  progress=lambda done, total: captured.append(time.perf_counter()))
        torch.cuda.synchronize()
    built = phase("load", import_done, 0.0)
    phases["load"].update(until_first_capture_s=captured[0] - import_done, captures=len(captured), capture_s=captured[-1] - captured[0])
    before = dynamo_seconds()
    tts.warm_up()
    torch.cuda.synchronize()
    ready = phase("warm_up", built, before)
    before = dynamo_seconds()
    burst = run_streams(tts, listeners, frames, 0.0)
    phase("burst", ready, before)
    found = {"size": size, "ready_s": ready - started, "phases": phases, "burst": burst, "compiled_during_burst": phases["burst"]["kernels"],
             "gpu": torch.cuda.get_device_name(), "torch_compiles": sys.modules["torch._dynamo.utils"].compile_times(repr="str") if "torch._dynamo.utils" in sys.modules else ""}
    if profile:
        found["profile"] = profile_lines(profiler)
    return found


def profile_lines(profiler: cProfile.Profile, top: int = 60) -> list[str]:
    """The calls that took the load's time: the project's own functions by cumulative time (what a
    phase is made of), then every function by its own time (where the time is spent)."""
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(r"pipeline|torch/_dynamo/eval_frame|torch/_inductor/compile_fx|safetensors|tokeniz", top)
    stats.sort_stats("tottime").print_stats(30)
    return out.getvalue().splitlines()


def start(checkpoint: Path, size: str, caches: Path, listeners: int, frames: int, profile: bool = False) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(caches / "triton"), TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"))
    args = [sys.executable, "-m", "benchmarks.cold_start", "--child", str(checkpoint), "--size", size, "--listeners", str(listeners),
            "--frames", str(frames)] + (["--profile"] if profile else [])
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the {size} start failed:\n{done.stderr[-4000:]}")
    for line in done.stderr.splitlines():  # what TORCH_LOGS=recompiles says, when set
        if "ecompil" in line:
            print(line[:400])
    return json.loads(lines[-1][len(RESULT):])


def summary(found: dict) -> str:
    p = found["phases"]
    parts = ", ".join(f"{name} {v['s']:.1f} s ({v['new_cubins']} kernels compiled, torch.compile {v['torch_compile_s']:.1f} s)"
                      for name, v in p.items())
    e = p["load"]
    parts += (f"; the load until its first graph {e['until_first_capture_s']:.1f} s (weights, kernels compiled ahead, "
              f"torch.compile), then {e['captures']} captures in {e['capture_s']:.1f} s")
    b = found["burst"]
    return (f"{found['size']} {found['start']}: ready in {found['ready_s']:.1f} s; {parts}; burst of {b['streams']}: TTFA p50 "
            f"{b['ttfa_p50_ms']:.0f} ms, p95 {b['ttfa_p95_ms']:.0f} ms; compiled during the burst: {found['compiled_during_burst'] or 'nothing'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["0.6B", "1.7B"])
    parser.add_argument("--listeners", type=int, default=16)
    parser.add_argument("--frames", type=int, default=100, help="frames each listener asks for")
    parser.add_argument("--starts", nargs="+", default=["cold", "warm"], choices=["cold", "warm"], help="cold: empty caches; warm: after a cold start")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help="one more warm start under cProfile: where the load's time goes")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.child:
        print(RESULT + json.dumps(child(args.child, args.size, args.listeners, args.frames, args.profile)), flush=True)
        return 0
    from benchmarks.compare import write_real_size_checkpoint

    results = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory() as caches, tempfile.TemporaryDirectory() as workdir:
            checkpoint = write_real_size_checkpoint(Path(workdir), size, "custom_voice")
            for kind in args.starts:
                found = dict(start(checkpoint, size, Path(caches), args.listeners, args.frames), start=kind)
                results.append(found)
                print(summary(found), flush=True)
            if args.profile:
                found = dict(start(checkpoint, size, Path(caches), args.listeners, args.frames, profile=True), start="warm, profiled")
                results.append(found)
                print("\n".join(found["profile"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "command": "python -m benchmarks.cold_start " + " ".join(argv or sys.argv[1:]),
                                         "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
