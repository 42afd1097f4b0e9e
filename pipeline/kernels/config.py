"""What the fused kernels are launched with, chosen once per engine from the GPU it runs on
(`KernelConfig.for_device`) and handed to every launch: the matmul tiles per weight shape, whether
kernels launch overlapped (programmatic dependent launch), the L2 prefetch budget, the talker
attention's split and the engine's frame paths. A benchmark that tries other settings builds
another configuration (`dataclasses.replace`); nothing here is a module setting that others patch.

Per architecture: a matmul tile's pipeline stages are buffers in shared memory, whose size per block
differs (SHARED_MEMORY_PER_BLOCK), so each architecture gets the tiles that fit it; overlapped
launches exist from compute capability 9.0 (Hopper) only. `tests/test_kernel_architectures.py`
compiles every kernel for sm_80, sm_86, sm_89, sm_90 and sm_120 with the configuration each gets,
at the real models' shapes, within its shared memory and without register spills.

No Triton here: the engine builds a configuration on any device."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch


@dataclass(frozen=True)
class Tiles:
    """Launch shape of a matmul kernel: columns and reduction depth per program, warps, pipeline
    stages, and programs that share a tile's reduction (split-K: more programs for narrow weights)."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1


# Shared memory a block may use (bytes, with the kernel's opt-in above the 48 KB default), per compute
# capability: the CUDA C++ Programming Guide, "Technical Specifications per Compute Capability"
# (docs.nvidia.com/cuda/cuda-programming-guide, appendix "Compute Capabilities", Table 31): 8.0 and
# 8.7 163 KB, 8.6 / 8.9 / 12.x 99 KB, 9.0 / 10.x 227 KB.
SHARED_MEMORY_PER_BLOCK: dict[tuple[int, int], int] = {
    (8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024, (8, 9): 99 * 1024, (9, 0): 227 * 1024,
    (10, 0): 227 * 1024, (12, 0): 99 * 1024,
}


def shared_memory_per_block(capability: tuple[int, int]) -> int:
    """The table's figure for `capability`, or the nearest older one's of the same major version
    (the smallest of all for an unknown major version)."""
    same_major = [c for c in SHARED_MEMORY_PER_BLOCK if c[0] == capability[0] and c <= capability]
    return SHARED_MEMORY_PER_BLOCK[max(same_major)] if same_major else min(SHARED_MEMORY_PER_BLOCK.values())


# Tiles per (kernel, N, K), bf16, on Hopper (227 KB of shared memory a block); 16 x 256 tiles, 4 warps,
# 3 stages elsewhere. Split-K wins wherever a weight has few column blocks (q/k/v: 32 heads; o and
# down: 1,024-2,048 columns). A row's sums (block_k, split_k) depend on the weight's shape only, never on the batch.
# Chosen in the whole decode step (`python -m benchmarks.kernels --step-sweep`, H200), not by timing
# each kernel alone (`--sweep`): a kernel's time in the step depends on its neighbours, which launch
# while it runs and share its SMs. Against the tiles fastest alone, the frame takes 3.25 ms instead of
# 3.54 (0.6B) and 3.96 instead of 4.28 (1.7B); docs/BENCHMARKS.md has the runs.
HOPPER_TILES: dict[tuple[str, int, int], Tiles] = {
    ("qkv", 4096, 1024): Tiles(block_k=128, num_warps=8, num_stages=1, split_k=8),
    ("qkv", 4096, 2048): Tiles(block_k=128, num_warps=8, split_k=8),
    ("linear1", 1024, 2048): Tiles(block_n=32, block_k=128, split_k=4),  # o projection, 0.6B and every code predictor
    ("linear0", 1024, 2048): Tiles(block_n=32, block_k=128, split_k=4),  # the 1.7B's code-predictor input projection: the o projection's shape
    ("linear1", 1024, 3072): Tiles(block_n=32, block_k=128, num_stages=2, split_k=8),  # down, 0.6B and every code predictor
    ("linear2", 3072, 1024): Tiles(block_n=32, num_stages=4),  # gate/up, 0.6B and every code predictor
    ("linear1", 2048, 2048): Tiles(block_n=32, block_k=128, split_k=4),  # o projection, 1.7B
    ("linear1", 2048, 6144): Tiles(block_n=32, split_k=8),  # down, 1.7B
    ("linear2", 6144, 2048): Tiles(block_n=64),  # gate/up, 1.7B (64 columns: 3.415 ms a frame against 32's 3.436 in the step sweep, H200)
    ("linear0", 2048, 1024): Tiles(block_n=32),  # the code predictor's heads
    ("linear0", 3072, 1024): Tiles(num_stages=4),  # the 0.6B's talker head
}
# Tiles per (kernel, N, K) of a launch over more than BLOCK_ROWS rows (several 16-row blocks), where they
# differ from the shape's: only the columns a program takes and its pipeline stages, which do not change
# a sum (columns are tiled apart; stages only prefetch), never block_k or split_k, which order a row's sums:
# a row keeps its bits alone and among others. Chosen with `python -m benchmarks.kernels --wide-sweep` (H200,
# one shape at a time; step ms at 17 / 32 / 64 rows running, 1.7B 5.95 / 6.02 / 8.89 as tuned for 16 rows):
HOPPER_WIDE_TILES: dict[tuple[str, int, int], Tiles] = {
    # gate/up of every code predictor and the 0.6B talker: 5.83 / 5.90 / 8.63 (0.6B 5.09 / 5.15 / 7.34 -> 4.96 / 5.04 / 7.01)
    ("linear2", 3072, 1024): Tiles(block_n=32, num_stages=2),
    # o projection, 0.6B and every code predictor: 5.93 / 5.98 / 8.80 (0.6B -> 4.99 / 5.06 / 7.26)
    ("linear1", 1024, 2048): Tiles(block_n=64, block_k=128, split_k=4),
}
BLOCK_ROWS = 16  # rows of the batch a matmul program takes (pipeline.kernels.decode.BLOCK_M)

# Where Hopper's choices do not fit another architecture (each compiled for it by
# tests/test_kernel_architectures.py; not timed on those GPUs). The 1.7B's gate/up tile 32 columns wide
# (64 spill registers on sm_80; 32 measured 0.02 ms a frame slower on an H200); with 99 KB, the 0.6B's gate/up in 3 stages, not 4 (106 KB: two weight tiles a stage).
A100_TILES: dict[tuple[str, int, int], Tiles] = {("linear2", 6144, 2048): Tiles(block_n=32)}
SMALL_SHARED_TILES: dict[tuple[str, int, int], Tiles] = {**A100_TILES, ("linear2", 3072, 1024): Tiles(block_n=32, num_stages=3)}


@dataclass(frozen=True)
class KernelConfig:
    """The fused kernels' launch choices for one architecture (see the module's docstring).

    `tuned`: bf16 / fp16 tiles per (kernel, N, K) (others: `Tiles(block_k=...)`, the default); `wide`:
    those of launches over more than BLOCK_ROWS rows, where they differ (same block_k and split_k);
    `overlap`: overlapped launches (programmatic dependent launch, compute capability 9.0 on);
    `l2_prefetch_bytes`: at most this much of the next matmul's weights asked into L2 ahead of
    time; `bandwidth_bound_bytes`: a matmul that reads more than this of its own weights asks for
    nothing; `attention_chunks`: cache length -> (positions per chunk, warps) of the split attention;
    `attention_whole` / `attention_parts`: its short contexts, attended without exchange by that many
    programs per head; `row_blocks`: each frame over the smallest block of first rows holding every occupied row;
    `wide_sampling_warps`: the warps of a sampling kernel over more than 2,048 codes."""

    capability: tuple[int, int] = (9, 0)
    tuned: Mapping[tuple[str, int, int], Tiles] = field(default_factory=lambda: MappingProxyType(HOPPER_TILES), hash=False)
    wide: Mapping[tuple[str, int, int], Tiles] = field(default_factory=lambda: MappingProxyType(HOPPER_WIDE_TILES), hash=False)
    overlap: bool = True
    # Under half the L2 of an H100 / H200 (50 MB), so lines are not pushed out before they are read.
    l2_prefetch_bytes: int = 24 << 20
    # Measured on an H100 (1.7B step, 1 row): no bound 4.89 ms, 16 MB 4.79, 8 MB 4.83, no prefetch
    # 4.83; the 0.6B (every weight under 16 MB): 3.81 / 3.80 ms, 3.91 without prefetch.
    bandwidth_bound_bytes: int = 16 << 20
    # The talker's cache (2,048 positions) split in chunks of 256 positions x 8 warps. Measured on an
    # H200 (`python -m benchmarks.kernels --attention`, us at 50 / 200 / 300 / 1,000 / 2,000
    # positions): chunks of 256 x 8 warps 4.7 / 4.8 / 8.2 / 8.5 / 9.2; of 64 x 4 warps 3.4 / 7.0 / 7.7 /
    # 10.4 / 14.0; of 128 x 8 warps 4.8 / 8.3 / 8.7 / 9.3 / 10.3; one program per head looping over the
    # context 3.6 / 10.4 / 14.7 / 41.7 / 81.8. In the whole step (0.6B, 1 row) 3.01 -> 2.95 ms.
    # Every architecture gets these chunks and warps: another chunking sums in another order, and the
    # same request would give other codes on another GPU.
    attention_chunks: Mapping[int, tuple[int, int]] = field(default_factory=lambda: MappingProxyType({2048: (256, 8)}), hash=False)
    # A context of 256 positions at most (the first ~17 s of an utterance) needs no exchange. H200, us at
    # 50 / 150 / 256 positions: 1 part 4.7 / 4.8 / 4.8, 2 parts 4.1 / 4.2 / 4.4, 4 parts 3.6 / 3.7 / 3.9,
    # 8 parts 3.7 / 3.8 / 4.0; a whole of 512 positions (8 parts) 5.3 / 5.4 / 5.5 and 5.6 at 300
    # (against 7.4 exchanging): slower where most steps are. In the step: 0.6B 2.842 -> 2.819 ms.
    attention_whole: int = 256
    # One part: 4 parts made the 1-row step 0.02 ms faster (0.6B 2.842 -> 2.819 ms, 1.7B 3.446 -> 3.420)
    # but the 16-row engine slower at 8 and 16 rows running (3.48 / 4.06 ms against 3.36 / 3.76): 1,024
    # programs at 16 rows, one per SM at a time (the kernel's registers). A power of two.
    attention_parts: int = 1
    # Measured on an H100 (benchmarks.kernels --ablation, 0.6B, engine of 16 rows): 3.59 ms a
    # frame with one row running against 4.14 over all rows, the same codes.
    row_blocks: bool = True
    # Warps of a sampling program that holds 4,096 logits (the talker's 3,072 codes): 8 keep them in
    # registers up to sm_90; ptxas for sm_120 spills the end of the frame's 16 bytes a thread with 8.
    wide_sampling_warps: int = 8

    @classmethod
    def for_architecture(cls, capability: tuple[int, int]) -> "KernelConfig":
        """The configuration for a GPU of compute capability `capability` (on any GPU that has at
        least as much: an H100 runs the sm_80 or sm_89 choices too, for tests)."""
        capability = tuple(capability)
        overlap = capability >= (9, 0)
        shared = shared_memory_per_block(capability)
        if shared >= SHARED_MEMORY_PER_BLOCK[(9, 0)]:
            return cls(capability=capability, overlap=overlap)
        changed = A100_TILES if shared >= SHARED_MEMORY_PER_BLOCK[(8, 0)] else SMALL_SHARED_TILES
        return cls(capability=capability, tuned=MappingProxyType({**HOPPER_TILES, **changed}), overlap=overlap,
                   wide_sampling_warps=16 if capability >= (12, 0) else 8)

    @classmethod
    def for_device(cls, device: torch.device) -> "KernelConfig":
        """The configuration for `device`: its architecture's, the L2 prefetch within half its L2
        (24 MB on an H100 / H200, 3 MB on an RTX 3090's 6 MB). Off CUDA (Triton's interpreter):
        the default (Hopper's tiles; no overlapped launch, no prefetch runs there)."""
        if device.type != "cuda":
            return cls()
        config = cls.for_architecture(torch.cuda.get_device_capability(device))
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        return dataclasses.replace(config, l2_prefetch_bytes=min(config.l2_prefetch_bytes, l2 // 2))

    def runs_on(self, capability: tuple[int, int]) -> bool:
        """Whether a GPU of compute capability `capability` has what this configuration uses: the
        shared memory of its architecture's tiles, and overlapped launches where they are on."""
        return ((not self.overlap or tuple(capability) >= (9, 0))
                and shared_memory_per_block(self.capability) <= shared_memory_per_block(tuple(capability)))

    def tiles(self, kind: str, n: int, k: int, dtype: torch.dtype, rows: int = 1) -> Tiles:
        """The tiles of matmul kernel `kind` ("qkv", "linear0/1/2": its epilogue mode) for a weight [n, k],
        in a launch over `rows` rows."""
        if dtype == torch.float32:
            # float32 runs for parity (GPU checks, the CPU tests in Triton's interpreter, whose time grows
            # with the programs of a launch), never for speed: wide column blocks, few programs (gate/up's
            # two weight tiles half as wide: registers, no spills). Its tiles are twice the bytes: the
            # q/k/v kernel's pipelined weight tiles must fit in shared memory.
            widest = 64 if kind == "linear2" else 128
            return Tiles(block_n=min(widest, max(16, _next_power_of_2(n))), block_k=min(64, _next_power_of_2(k)), num_stages=2)
        wide = self.wide.get((kind, n, k)) if rows > BLOCK_ROWS else None
        if wide is not None:
            return wide
        found = self.tuned.get((kind, n, k))
        return found if found is not None else Tiles(block_k=min(256, _next_power_of_2(k)))


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1
