"""The routed experts of a prompt's prefill on the GPU, the row-invariant grouped kernel against
transformers' grouped_mm experts: `python -m benchmarks.grouped_experts [--tokens 64 128 256 512 1024]`.

One MoE layer of Qwen3-Omni's thinker at the real size (hidden 2048, expert intermediate 768, 128
experts, top-8, bf16) with random weights and random routing (top-8 of a softmax over random router
logits, renormalised). For each number of tokens: microseconds per call of
`pipeline.kernels.grouped_experts.grouped_experts`, of transformers' `grouped_mm_experts_forward`
and, up to 64 tokens, of the decode step's `pipeline.kernels.experts.routed_experts`, each captured
as a CUDA graph and timed by replaying it (median of 5 rounds of 20 replays); the expert weights
the grouped kernel reads per second (each chosen expert's once); the largest difference from
grouped_mm (bf16 rounding in another order); and whether a token's output is bit-identical alone
and in the batch. Writes JSON and markdown into --out.
"""
from __future__ import annotations

import argparse
import statistics
from functools import partial
from pathlib import Path

import torch
import triton
from transformers.integrations.moe import grouped_mm_experts_forward
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextExperts

from benchmarks.speed import cuda_ms, report_header, write_report
from pipeline.graphs import CUDAGraphed
from pipeline.kernels.experts import routed_experts
from pipeline.kernels.grouped_experts import grouped_experts

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 2048, 768, 128, 8
ROUNDS, REPLAYS = 5, 20
ROUTED_UP_TO = 64  # routed_experts reads each token's experts separately: a decode step's few rows, not a prompt
INVARIANCE_TOKENS = 4  # tokens of each batch also computed alone


def thinker_experts() -> Qwen3OmniMoeThinkerTextExperts:
    config = Qwen3OmniMoeThinkerConfig(text_config=dict(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=EXPERTS,
                                                        num_experts_per_tok=TOP_K)).text_config
    with torch.device("cuda"):
        experts = Qwen3OmniMoeThinkerTextExperts(config).to(torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=0.02)
        experts.down_proj.normal_(std=0.02)
    return experts


def random_routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    probabilities = torch.randn(tokens, EXPERTS, generator=g, device="cuda").softmax(-1)
    weights, chosen = probabilities.topk(TOP_K, dim=-1)
    return x, chosen, (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)


def graph_us(fn) -> tuple[float, torch.Tensor]:
    graph = CUDAGraphed(fn, enabled=True)
    out = graph()
    return statistics.median(cuda_ms(graph, REPLAYS) for _ in range(ROUNDS)) * 1000.0, out.clone()


def row_invariant(experts: Qwen3OmniMoeThinkerTextExperts, x, chosen, weights, batch_out: torch.Tensor) -> bool:
    """Whether tokens spread over the batch give bit-identical outputs computed alone."""
    picks = torch.linspace(0, x.shape[0] - 1, INVARIANCE_TOKENS).long().tolist()
    return all(torch.equal(grouped_experts(x[i:i + 1], chosen[i:i + 1], weights[i:i + 1], experts.gate_up_proj, experts.down_proj)[0],
                           batch_out[i]) for i in picks)


@torch.inference_mode()
def measure(experts: Qwen3OmniMoeThinkerTextExperts, tokens: int) -> dict:
    x, chosen, weights = random_routing(tokens, tokens)
    weights_per_expert = (experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()) * experts.down_proj.element_size()
    experts_read = int(chosen.unique().numel())
    ours_us, ours = graph_us(partial(grouped_experts, x, chosen, weights, experts.gate_up_proj, experts.down_proj))
    grouped_mm_us, reference = graph_us(partial(grouped_mm_experts_forward, experts, x, chosen, weights))
    routed_us = None
    if tokens <= ROUTED_UP_TO:
        routed_us, _ = graph_us(partial(routed_experts, x, chosen, weights, experts.gate_up_proj, experts.down_proj))
    row = {"tokens": tokens, "grouped_experts_us": ours_us, "grouped_mm_us": grouped_mm_us, "routed_experts_us": routed_us,
           "experts_read": experts_read, "weights_gb_per_s": experts_read * weights_per_expert / ours_us / 1000.0,
           "max_difference": (ours.float() - reference.float()).abs().max().item(),
           "row_invariant": row_invariant(experts, x, chosen, weights, ours)}
    print(row, flush=True)
    return row


def table(report: dict) -> str:
    lines = [f"# Routed experts of a prefill ({report['gpu']}, {report['date']})", "",
             f"`{report['command']}` · torch {report['torch']} · triton {report['triton']} · one MoE layer of the thinker "
             f"(hidden {HIDDEN}, intermediate {INTERMEDIATE}, {EXPERTS} experts, top-{TOP_K}), bf16, random routing, "
             f"one CUDA graph per call, median of {ROUNDS} x {REPLAYS} replays", "",
             "| tokens | grouped_experts µs | grouped_mm µs | routed_experts µs | experts read | their weights GB/s "
             "| largest difference | a token alone = in the batch |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        routed = "" if r["routed_experts_us"] is None else f"{r['routed_experts_us']:.1f}"
        lines.append(f"| {r['tokens']} | {r['grouped_experts_us']:.1f} | {r['grouped_mm_us']:.1f} | {routed} | {r['experts_read']} "
                     f"| {r['weights_gb_per_s']:.0f} | {r['max_difference']:.3g} | {'yes' if r['row_invariant'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[64, 128, 256, 512, 1024])
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the grouped experts benchmark needs a CUDA GPU")
    report = report_header("benchmarks.grouped_experts", argv) | {"triton": triton.__version__}
    experts = thinker_experts()
    report["rows"] = [measure(experts, tokens) for tokens in args.tokens]
    write_report(args.out, "grouped-experts", report, table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
