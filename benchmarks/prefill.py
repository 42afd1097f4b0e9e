"""A prompt's prefill on the GPU, the engine's Triton-kernel prefill against the module's prefill with its
layer torch.compile'd: `python -m benchmarks.prefill [--sizes 0.6B 1.7B] [--buckets 32 64 128 256 512]`.

Both run on the same random-weight talker at the real size (bf16), each captured as a CUDA graph per
bucket as the engine serves it, and are timed by replaying the graph (median of 5 rounds of 20
replays); the time a prefill takes from the running rows' decode steps. Also reported: how far apart
their final states are (bf16 rounding in another order). Writes JSON and markdown into --out.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from functools import partial
from pathlib import Path

import torch

from benchmarks.speed import cuda_ms, random_tts, report_header, write_report
from pipeline.graphs import CUDAGraphed
from pipeline.kernels import fused_prefill
from pipeline.model import prefill_layer
from pipeline.released import SIZES

ROUNDS, REPLAYS = 5, 20


def graph_ms(fn) -> tuple[float, torch.Tensor]:
    graph = CUDAGraphed(fn, enabled=True)
    out = graph()
    return statistics.median(cuda_ms(graph, REPLAYS) for _ in range(ROUNDS)), out.clone()


@torch.inference_mode()
def measure(size: str, buckets: list[int], workdir: Path) -> list[dict]:
    workdir.mkdir(parents=True, exist_ok=True)
    tts = random_tts(size, "custom_voice", "cuda", torch.bfloat16, workdir, rows=1)
    model = tts.model.talker.model
    compiled = torch.compile(prefill_layer, fullgraph=True, dynamic=True)
    row = torch.zeros(1, dtype=torch.long, device="cuda")
    rows = []
    for bucket in buckets:
        x = torch.randn(1, bucket, model.norm.weight.shape[0], device="cuda", dtype=torch.bfloat16)
        kernels_ms, kernels_out = graph_ms(partial(fused_prefill, model, x, row))
        compiled_ms, compiled_out = graph_ms(partial(model.prefill, x, row, layer_step=compiled))
        rows.append({"size": size, "bucket": bucket, "kernels_ms": kernels_ms, "compiled_ms": compiled_ms,
                     "max_difference": (kernels_out.float() - compiled_out.float()).abs().max().item()})
        print(rows[-1], flush=True)
    return rows


def table(report: dict) -> str:
    lines = [f"# A prompt's prefill ({report['gpu']}, {report['date']})", "", f"`{report['command']}` · torch {report['torch']} · bf16, "
             f"one CUDA graph per bucket, median of {ROUNDS} x {REPLAYS} replays", "",
             "| model | positions | Triton kernels ms | torch.compile'd layer ms | largest difference |", "|---|---|---|---|---|"]
    lines += [f"| {r['size']} | {r['bucket']} | {r['kernels_ms']:.3f} | {r['compiled_ms']:.3f} | {r['max_difference']:.3g} |" for r in report["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["0.6B", "1.7B"], choices=list(SIZES))
    parser.add_argument("--buckets", nargs="+", type=int, default=[32, 64, 128, 256, 512])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the prefill benchmark needs a CUDA GPU")
    report = report_header("benchmarks.prefill", argv)
    with tempfile.TemporaryDirectory() as workdir:
        report["rows"] = [row for size in args.sizes for row in measure(size, args.buckets, Path(workdir) / size)]
    write_report(args.out, "prefill", report, table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
