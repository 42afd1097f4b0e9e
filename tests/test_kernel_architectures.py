"""Every fused kernel compiled for each GPU architecture the engine runs its kernels on (sm_80,
sm_86, sm_89, sm_90, sm_120), with the configuration the engine picks there
(`KernelConfig.for_architecture`), at the real models' shapes (the 0.6B's and 1.7B's talkers and
code predictors, Qwen3-Omni's code predictor and talker vocabulary): within the architecture's
shared memory per block, without register spills on the hot path beyond the bounded ones below,
with overlapped launches (griddepcontrol) only from sm_90 on. A kernel that used an instruction the
architecture lacks would not compile for it: ptxas refuses it.

Triton ships ptxas and cuobjdump, so this runs on a CPU-only machine, in a process without
TRITON_INTERPRET (this module run as a script: `python -m tests.test_kernel_architectures sm_89`
prints what it found as JSON), a process per CPU core. Each distinct (kernel, constexpr arguments) is
compiled once per architecture; a matmul whose weight is followed by weights of other sizes is
compiled with its largest L2 prefetch share (the most registers)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

ARCHITECTURES = {"sm_80": (8, 0), "sm_86": (8, 6), "sm_89": (8, 9), "sm_90": (9, 0), "sm_120": (12, 0)}
# Shared memory per block with the kernel's opt-in, from NVIDIA's CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability" (appendix "Compute Capabilities", Table 31): A100 163 KB;
# RTX 30xx / A10G, RTX 40xx / L4, RTX 50xx 99 KB; H100 / H200 227 KB.
SHARED_MEMORY_LIMIT = {(8, 0): 166_912, (8, 6): 101_376, (8, 9): 101_376, (9, 0): 232_448, (12, 0): 101_376}
# Choices that spill registers, kept for what they give. The 1.7B's 64-column gate/up tile on Hopper
# (208 bytes a thread; 3.436 -> 3.415 ms a frame against 32 columns, which do not spill; H200). The
# talker attention's chunks of 256 positions x 8 warps on every architecture (Triton 3.9's ptxas: 32
# bytes a thread on sm_80, 104 on sm_90, 112 on sm_89, 168 on sm_120): the same chunks everywhere sum
# in the same order, so a request gives the same codes on every GPU; smaller chunks, which spill
# nothing, sum in another order. Bounded, so that a change that spills more fails here.
# Qwen3-Omni code2wav's float32 gate/up tile on sm_120 (8 bytes a thread, Triton 3.6's ptxas).
MEASURED_SPILLS = {(9, 0): {"linear2 BLOCK_K=256,BLOCK_N=64,K=2048,N=6144,SPLIT_K=1": 256}, (12, 0): {"codec linear2 N=3072,K=1024": 8}}
ATTENTION_SPILL_BOUND = 256

TALKERS = {"0.6B": (1024, 3072), "1.7B": (2048, 6144)}  # hidden, FFN; 16 query heads, 8 key/value heads of 128
PREDICTOR = dict(H=1024, I=3072, V=2048)  # every model's code predictor (Qwen3-Omni's too); 5 layers
HEADS, KV_HEADS, HEAD_DIM, TALKER_VOCAB, TALKER_CACHE, CODES = 16, 8, 128, 3072, 2048, 16


def compiled(fn, types: dict, constants: dict, capability: tuple[int, int], num_warps: int = 4, num_stages: int = 3):
    """`fn` compiled for `capability`: arguments typed by `types` (the rest constexpr), pointers 16-byte aligned as torch's tensors are."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=aligned)
    return compile(source, target=GPUTarget("cuda", capability[0] * 10 + capability[1], 32), options={"num_warps": num_warps, "num_stages": num_stages})


def stack_bytes(cubin: bytes) -> int:
    """The kernel's stack frame (spilled registers live there), from Triton's cuobjdump."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"STACK:(\d+)", usage).group(1))


def matmul_launches(config) -> dict:
    """(kernel, constexprs) -> launch of every q/k/v and matmul kernel the models' decode steps make
    with `config`, at one row (one block of rows: the most prefetch lines per program) and, where their
    tiles differ (`KernelConfig.wide`), at 64 rows."""
    import torch

    from pipeline.kernels.decode import BLOCK_M, prefetch_shares

    found: dict = {}

    def add(kind: str, n: int, k: int, rows: int, following: int, *, norm=False, normed=False, bias=False, logits=False):
        """A launch over `rows` tokens of weight [n, k] (kind "qkv" or "linear<mode>"), then a weight of `following` elements."""
        t = config.tiles(kind, n, k, torch.bfloat16, rows)
        wide = t != config.tiles(kind, n, k, torch.bfloat16)
        if rows > BLOCK_M and not wide:
            return
        row_blocks = -(-rows // BLOCK_M)
        programs = row_blocks * (HEADS + 2 * KV_HEADS if kind == "qkv" else -(-n // t.block_n)) * t.split_k
        weight_bytes = n * k * 2 * (2 if kind == "linear2" else 1)
        lines = 0
        if following and weight_bytes <= config.bandwidth_bound_bytes:
            lines = prefetch_shares(following, 2, programs, config.l2_prefetch_bytes)[1]
        if kind == "qkv":
            constants = dict(K=k, HEADS=HEADS, KV_HEADS=KV_HEADS, HEAD_DIM=HEAD_DIM, PRECISION="tf32", BLOCK_M=BLOCK_M, BLOCK_K=t.block_k,
                             SPLIT_K=t.split_k, wide=wide)
        else:
            mode = int(kind[-1])
            constants = dict(N=n, K=k, HAS_NORM=norm, STORE_NORMED=normed, HAS_BIAS=bias, HAS_SCALE=False, MODE=mode, PRECISION="tf32", BLOCK_M=BLOCK_M,
                             BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT_K=t.split_k, out=logits, wide=wide)
        key = (kind, tuple(sorted(constants.items())), t.num_warps, t.num_stages)
        found[key] = max(found.get(key, 0), lines)

    for rows in (1, 64):
        for hidden, ffn in TALKERS.values():
            qkv, o, gate_up, down = 4096 * hidden, hidden * 2048, 2 * ffn * hidden, hidden * ffn
            add("qkv", 4096, hidden, rows, o)
            add("linear1", hidden, 2048, rows, gate_up)
            add("linear2", ffn, hidden, rows, down, norm=True)
            add("linear1", hidden, ffn, rows, max(qkv, TALKER_VOCAB * hidden))
            add("linear0", TALKER_VOCAB, hidden, rows, 0, norm=True, normed=True, logits=True)
        h, i = PREDICTOR["H"], PREDICTOR["I"]
        for tokens in (2, 1):  # a frame's first step (the talker's state and codebook 0), then one token a step
            add("linear0", h, 2048, rows * tokens, 4096 * h, bias=True)  # the 1.7B's input projection
            add("qkv", 4096, h, rows * tokens, h * 2048)
            add("linear1", h, 2048, rows * tokens, 2 * i * h)
            add("linear2", i, h, rows * tokens, h * i, norm=True)
            add("linear1", h, i, rows * tokens, max(4096 * h, PREDICTOR["V"] * h))
        add("linear0", PREDICTOR["V"], h, rows, 0, norm=True, logits=True)
    return found


def launches(capability: tuple[int, int]) -> list[tuple[str, object, dict, dict, int, int, bool]]:
    """(name, kernel, argument types, constexprs, warps, stages, whether it must not spill registers: the hot
    path's kernels) of every distinct launch at the real shapes."""
    import torch

    from pipeline.kernels import decode
    from pipeline.kernels.config import KernelConfig
    from pipeline.kernels.sampling import CANDIDATES, _code_kernel, _next_token_kernel, _sample_kernel, code_row_block, sampling_warps

    config = KernelConfig.for_architecture(capability)
    overlap = dict(OVERLAP=config.overlap)
    found = []
    matmul = {**dict.fromkeys(["x_ptr", "norm_ptr", "normed_ptr", "w_ptr", "bias_ptr", "scale_ptr", "res_ptr", "next_ptr", "q_norm_ptr", "k_norm_ptr", "cos_ptr",
                               "sin_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr"], "*bf16"),
              "partial_ptr": "*fp32", "lock_ptr": "*i32", "pos_ptr": "*i64", "stride_x": "i32", "M": "i32", "L": "i32", "eps": "fp32",
              "head_eps": "fp32", "next_size": "i32", "cache_row": "i32", "cache_head": "i32", "cache_pos": "i32"}
    for (kind, constants, warps, stages), lines in matmul_launches(config).items():
        constants = dict(constants)
        out = "*fp32" if constants.pop("out", False) else "*bf16"
        wide = constants.pop("wide")
        fn = decode._qkv_kernel if kind == "qkv" else decode._linear_kernel
        name = f"{kind} " + ",".join(f"{k}={v}" for k, v in constants.items() if k in ("N", "K", "SPLIT_K", "BLOCK_N", "BLOCK_K"))
        name += f", over more than {decode.BLOCK_M} rows in {stages} stages" if wide else ""
        found.append((name, fn, {**matmul, "out_ptr": out}, {**constants, **overlap, "NEXT_LINES": lines, "LINE": 64}, warps, stages, True))
    # float32 (parity runs, never for speed): wide column blocks, twice the bytes a tile; spill-free on
    # Hopper, where the GPU tests run them (on sm_80 they spill 32-128 bytes a thread)
    exact = {**matmul, **{name: "*fp32" for name, t in matmul.items() if t == "*bf16"}, "out_ptr": "*fp32"}
    for mode, n, k in ((0, 2048, 1024), (0, 3072, 2048), (1, 1024, 3072), (1, 2048, 6144), (2, 3072, 1024), (2, 6144, 2048)):
        t = config.tiles(f"linear{mode}", n, k, torch.float32)
        found.append((f"float32 linear{mode} N={n},K={k}", decode._linear_kernel, exact,
                      dict(N=n, K=k, HAS_NORM=mode != 1, STORE_NORMED=False, HAS_BIAS=False, HAS_SCALE=False, MODE=mode, PRECISION="ieee",
                           BLOCK_M=decode.BLOCK_M, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT_K=t.split_k, **overlap, NEXT_LINES=0, LINE=32),
                      t.num_warps, t.num_stages, capability == (9, 0)))
    found += codec_transformer_launches(config, exact)

    attention = {**dict.fromkeys(["q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr"], "*bf16"), "pos_ptr": "*i64", "stats_ptr": "*fp32",
                 "partial_ptr": "*fp32", "lock_ptr": "*i32", "arrival_ptr": "*i32", "L": "i32", "scale": "fp32", "cache_row": "i32",
                 "cache_head": "i32"}
    shape = dict(HEADS=HEADS, GROUP=HEADS // KV_HEADS, HEAD_DIM=HEAD_DIM)
    chunk, warps = config.attention_chunks[TALKER_CACHE]
    chunks = TALKER_CACHE // chunk
    groups = min(config.attention_parts, HEAD_DIM, 1 << (chunks.bit_length() - 1))
    found.append(("talker attention, split", decode._attention_split_kernel, attention,
                  dict(**shape, CHUNK=chunk, CHUNKS=chunks, CHUNKS_P2=chunks, WHOLE=max(chunk, config.attention_whole), GROUPS=groups, PARTS=groups,
                       PASSES=3, **overlap), warps, 3, True))
    block = decode.attention_block(CODES)  # the code predictor's cache
    found.append(("code predictor attention", decode._attention_kernel, attention, dict(**shape, BLOCK_S=block, **overlap),
                  decode.attention_warps(block), 3, True))
    for hidden in sorted({h for h, _ in TALKERS.values()}):
        found.append((f"rms norm {hidden}", decode._rms_norm_kernel, {"x_ptr": "*bf16", "norm_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"},
                      dict(K=hidden, BLOCK_K=decode.NORM_BLOCK, **overlap), 4, 3, True))

    rows = {"do_sample_ptr": "*i1", "temperature_ptr": "*fp32", "top_k_ptr": "*i64", "top_p_ptr": "*fp32", "seed_ptr": "*i64", "frame_ptr": "*i64",
            "logits_ptr": "*fp32", "draws_per_frame": "i32", "V": "i32", "H": "i32"}
    for vocab in (PREDICTOR["V"], TALKER_VOCAB):  # Qwen3-Omni's code predictor and talker (its frame's glue stays PyTorch's)
        block = 1 << (vocab - 1).bit_length()
        found.append((f"sample {vocab}", _sample_kernel, {**rows, "noise_ptr": "*fp32", "out_ptr": "*i64", "stride_logits": "i32", "stride_noise": "i32"},
                      dict(BLOCK=block, C=CANDIDATES, **overlap), sampling_warps(block, config), 3, True))
    code = {**rows, "first_draw": "i32", "codes_ptr": "*i64", "column": "i32", "tables_ptr": "*bf16", "table_start_ptr": "*i64", "next_ptr": "*bf16",
            "token_ptr": "*i64", "text_ptr": "*bf16", "text_len_ptr": "*i64", "pad_ptr": "*bf16", "max_seq": "i32"}
    block = PREDICTOR["V"]
    for last in (False, True):
        found.append((f"code step, last {last}", _code_kernel, code,
                      dict(CODES=CODES, LAST=last, BLOCK=block, BLOCK_H=code_row_block(PREDICTOR["H"], CODES, last), C=CANDIDATES, **overlap),
                      sampling_warps(block, config), 3, True))
    token = {**rows, **dict.fromkeys(["active_ptr", "text_end_ptr", "produced_ptr", "seen_ptr", "suppressed_ptr"], "*i1"),
             **dict.fromkeys(["token_ptr", "max_frame_ptr", "text_len_ptr", "pos_ptr"], "*i64"), "penalty_ptr": "*fp32", "eos": "i32",
             "min_new_tokens": "i32", "normed_ptr": "*bf16", "state_ptr": "*bf16", "table_ptr": "*bf16"}
    block = 1 << (TALKER_VOCAB - 1).bit_length()
    found.append(("next token", _next_token_kernel, token, dict(BLOCK=block, BLOCK_H=min(1024, PREDICTOR["H"]), C=CANDIDATES, **overlap),
                  sampling_warps(block, config), 3, True))

    return found


def codec_transformer_launches(config, exact: dict) -> list:
    """The vocoder transformer's kernels (pipeline.codec.transformer_kernels) at the Qwen3-TTS codec's and
    Qwen3-Omni code2wav's shapes (hidden 512 / 1024, FFN 1024 / 3072, 16 heads of 64, a 72-frame window):
    every vocoder call runs them, so none spills."""
    from pipeline.codec.transformer_kernels import ATTENTION_WARPS, BLOCK_T, CODEC_PRECISION, CODEC_TILES, _window_attention_kernel
    from pipeline.kernels import decode

    found = []
    t = CODEC_TILES
    heads, head_dim, history = 16, 64, 71
    for hidden, ffn in ((512, 1024), (1024, 3072)):
        width = heads * head_dim
        for mode, n, k, norm, bias, scale in ((0, 3 * width, hidden, True, False, False), (1, hidden, width, False, False, True),
                                              (2, ffn, hidden, True, False, False), (1, hidden, ffn, False, False, True),
                                              (0, 1024, hidden, True, True, False)):
            found.append((f"codec linear{mode} N={n},K={k}", decode._linear_kernel, exact,
                          dict(N=n, K=k, HAS_NORM=norm, STORE_NORMED=False, HAS_BIAS=bias, HAS_SCALE=scale, MODE=mode, PRECISION=CODEC_PRECISION,
                               BLOCK_M=decode.BLOCK_M, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT_K=t.split_k, OVERLAP=config.overlap,
                               NEXT_LINES=0, LINE=32), t.num_warps, t.num_stages, True))
    types = {**dict.fromkeys(["qkv_ptr", "k_tail_ptr", "v_tail_ptr", "cos_ptr", "sin_ptr", "out_ptr"], "*fp32"), "seen_ptr": "*i64",
             "tail_stride": "i32", "seen_stride": "i32", "T": "i32", "scale": "fp32"}
    found.append(("codec window attention", _window_attention_kernel, types,
                  dict(HISTORY=history, HEADS=heads, KV_HEADS=heads, HEAD_DIM=head_dim, HALF_BLOCK=head_dim // 2, DIM_BLOCK=head_dim,
                       BLOCK_T=BLOCK_T, BLOCK_S=128, PRECISION=CODEC_PRECISION, OVERLAP=config.overlap), ATTENTION_WARPS, 3, True))
    return found


BARRIER_ARRIVE = re.compile(r"(red|atom)[.][.a-z]*release[.a-z]*[.]add")
BARRIER_WAIT = re.compile(r"(ld|atom)[.][.a-z]*acquire")


def compile_launch(capability: tuple[int, int], index: int) -> tuple[str, dict]:
    """Launch `index` of `launches(capability)` compiled: its name, shared memory, stack frame and the instructions the test looks for."""
    name, fn, types, constants, warps, stages, spill_free = launches(capability)[index]
    kernel = compiled(fn, types, constants, capability, warps, stages)
    ptx = kernel.asm["ptx"]
    return name, {
        "shared": kernel.metadata.shared, "stack": stack_bytes(kernel.asm["cubin"]), "spill_free": spill_free,
        "wait": "griddepcontrol.wait" in ptx, "release": "griddepcontrol.launch_dependents" in ptx,
        "prefetch": "prefetch.global.L2" in ptx, "prefetch_lines": constants.get("NEXT_LINES", 0),
        "split_k": constants.get("SPLIT_K", 1), "split_k_atomics": [line.split()[1] for line in ptx.splitlines() if " atom." in line],
        "barrier": BARRIER_ARRIVE.search(ptx) is not None and BARRIER_WAIT.search(ptx) is not None, "cg_loads": "ld.global.cg" in ptx,
    }


def main(arch: str) -> None:
    """Compile every launch for `arch` (a process per CPU core) and print what `compile_launch` found, as one JSON line."""
    capability = ARCHITECTURES[arch]
    count = len(launches(capability))
    with ProcessPoolExecutor(max_workers=min(count, os.cpu_count() or 1)) as pool:
        report = dict(pool.map(compile_launch, [capability] * count, range(count)))
    print(json.dumps(report))


def test_the_configuration_states_the_guides_shared_memory_per_block():
    """The engine's table (pipeline.kernels.config) holds the figures stated above, for every architecture tested."""
    from pipeline.kernels.config import shared_memory_per_block

    assert {c: shared_memory_per_block(c) for c in ARCHITECTURES.values()} == SHARED_MEMORY_LIMIT
    assert shared_memory_per_block((8, 7)) == SHARED_MEMORY_LIMIT[(8, 0)] and shared_memory_per_block((12, 1)) == SHARED_MEMORY_LIMIT[(12, 0)]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_launches_over_many_rows_keep_the_order_of_a_rows_sums(arch):
    """Every architecture's tiles for a launch over more than 16 rows differ from the shape's own in
    columns and stages only: the same depth per iteration and K splits, so a row's sums are added in the
    same order alone and among others; and the wide sweep tries no other."""
    import torch

    from benchmarks.kernels import wide_alternatives
    from pipeline.kernels.config import KernelConfig

    config = KernelConfig.for_architecture(ARCHITECTURES[arch])
    assert config.wide
    for kind, n, k in config.wide:
        narrow, wide = config.tiles(kind, n, k, torch.bfloat16), config.tiles(kind, n, k, torch.bfloat16, rows=17)
        assert wide != narrow and (wide.block_k, wide.split_k) == (narrow.block_k, narrow.split_k), (kind, n, k)
        assert config.tiles(kind, n, k, torch.bfloat16, rows=16) == narrow
        for t in wide_alternatives(narrow):
            assert (t.block_k, t.split_k, t.num_warps) == (narrow.block_k, narrow.split_k, narrow.num_warps) and t != narrow


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_kernel_compiles_for_the_architecture_within_its_shared_memory_and_without_spills(arch):
    """Each launch at the real shapes with the architecture's configuration: it compiles; its shared
    memory fits a block; the hot path's kernels keep every value in registers (no stack frame; the
    float32 parity kernels on Hopper too);
    kernels wait for the previous one and release the next (griddepcontrol) exactly from sm_90 on;
    a matmul that prefetches asks L2 for the next weights (prefetch.global.L2); a split-K tile's
    arrival releases the partial sums and acquires the others' (its counter's reset orders nothing:
    an acq_rel exchange put a GPU-wide fence before every split tile's store, 0.12 ms of the 0.6B's
    frame on an H200); the split attention's chunks exchange their statistics inside one launch
    (released, acquired, read past L1)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.test_kernel_architectures", arch], capture_output=True, text=True, env=env, timeout=1800,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    capability = ARCHITECTURES[arch]
    overlapped = capability >= (9, 0)
    for name, kernel in found.items():
        assert kernel["shared"] <= SHARED_MEMORY_LIMIT[capability], (arch, name, kernel["shared"])
        if kernel["spill_free"]:
            bound = ATTENTION_SPILL_BOUND if name == "talker attention, split" else MEASURED_SPILLS.get(capability, {}).get(name, 0)
            assert kernel["stack"] <= bound, (arch, name, f"{kernel['stack']} bytes of spilled registers")
        assert kernel["wait"] == overlapped and kernel["release"] == overlapped, (arch, name)
        assert kernel["prefetch"] == (kernel["prefetch_lines"] > 0), (arch, name)
        if kernel["split_k"] > 1:
            assert kernel["split_k_atomics"] == ["atom.global.gpu.acq_rel.add.u32", "atom.global.gpu.relaxed.exch.b32"], (arch, name)
    assert any(kernel["prefetch"] for kernel in found.values())
    assert found["talker attention, split"]["barrier"] and found["talker attention, split"]["cg_loads"]


if __name__ == "__main__":
    main(sys.argv[1])
