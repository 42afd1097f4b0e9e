"""The code predictor's whole frame in one persistent kernel: 15 steps, each its input projection
(where the talker is wider), five decoder layers, the final norm and head, and the draw of one
codebook with the next step's input; after the last, the talker's input (`CodePredictorKernel`).
One launch a frame instead of 405 (0.6B; 406 for the 1.7B): the step's kernels per frame go from 547 (548) to 143.

Its programs, one per SM, walk through the frame's stages together: each takes its share of a
stage's tiles (the same tiles, the same arithmetic as the kernel-per-stage path in `decode` and
`sampling`: those kernels' bodies are the functions called here), then waits at a grid barrier
until every program has finished the stage.

Not the default (`KernelConfig.persistent`): measured on an H100, it is slower than the kernel-per-stage path,
whose launches are already overlapped (programmatic dependent launch inside a CUDA graph): the
code predictor alone 2.98-3.11 ms a frame against 2.61 (0.6B, 1 row), the whole step 4.27 against
3.70 ms. A grid barrier (an atomic add, then a wait on L2) costs about what an overlapped kernel
boundary costs, and one kernel for every stage holds the registers of the largest (254 a thread:
one program of 8 warps per SM; two per SM or fewer programs were slower still). docs/BENCHMARKS.md
has the runs.

Every program must be resident at once (they wait for each other): one program per SM, a kernel
whose resources fit one per SM. Triton's interpreter runs programs one after another, so there the
kernel runs as one program, which needs no barrier: the CPU tests run the same stages, tiles and
sums; only the barrier itself is GPU-only.

Results do not depend on the number of programs: a tile's sums (and a split tile's partial sums,
added by the last of its programs in split order) are the same whichever program computes it. At
the 0.6B's real size (bf16, 60 sampled frames) its codes and audio were identical to the
kernel-per-stage path's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pipeline.kernels import FrameText
from pipeline.kernels.config import KernelConfig, Tiles
from pipeline.kernels.decode import (BLOCK_M, Workspace, _attend, _check_split, _linear_finish, _linear_sums, _qkv_finish, _qkv_sums,
                                     arrive_and_wait, attention_block, launch_options, wait_for_inputs)
from pipeline.kernels.sampling import CANDIDATES, _row_block, code_row_block, draw_code

if TYPE_CHECKING:
    from pipeline.engine.sampling import RowSampling
    from pipeline.model import CodePredictor, Transformer

LAYER_WEIGHTS = ("input_layernorm.weight", "self_attn.qkv_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight")
NUM_WARPS = 8  # the q/k/v tiles' and the 2,048-code draw's (the kernels of the per-stage path that need the most)


@triton.jit
def _grid_barrier(barrier_ptr, target, GRID_SYNC: tl.constexpr):
    """Wait until the barrier's count reaches `target` (every program arrived `target / programs`
    times): this program's writes are released before its arrival, everyone's acquired after. One
    thread a program polls (a scalar atomic), not all of them: on an H100, 3.11 against 3.21 ms a
    frame's code predictor with every thread polling an acquire load."""
    if GRID_SYNC:
        arrive_and_wait(barrier_ptr, target)


@triton.jit
def _linear_stage(x_ptr, stride_x, norm_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, partial_ptr, lock_ptr, M, N: tl.constexpr, K: tl.constexpr, eps,
                  HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, MODE: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, program, programs):
    """This program's tiles of `_linear_kernel`'s grid (row block, column block, K split)."""
    COLS: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    for tile in range(program, tl.cdiv(M, BLOCK_M) * COLS * SPLIT_K, programs):
        pid_k = tile % SPLIT_K
        pid_n = (tile // SPLIT_K) % COLS
        pid_m = tile // (SPLIT_K * COLS)
        acc, up = _linear_sums(x_ptr, stride_x, norm_ptr, x_ptr, w_ptr, M, N, K, eps, HAS_NORM, False, MODE, IEEE, BLOCK_M, BLOCK_N, BLOCK_K,
                               SPLIT_K, pid_m, pid_n, pid_k)
        _linear_finish(acc, up, bias_ptr, HAS_BIAS, res_ptr, out_ptr, partial_ptr, lock_ptr, M, N, MODE, BLOCK_M, BLOCK_N, SPLIT_K, pid_m, pid_n,
                       pid_k, COLS, x_ptr.dtype.element_ty)


@triton.jit
def _qkv_stage(x_ptr, norm_ptr, w_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_cache_ptr, v_cache_ptr, partial_ptr, lock_ptr,
               M, K: tl.constexpr, L, eps, head_eps, cache_row, cache_head, cache_pos, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
               HEAD_DIM: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, program, programs):
    """This program's tiles of `_qkv_kernel`'s grid (row block, head, K split)."""
    ALL: tl.constexpr = HEADS + 2 * KV_HEADS
    for tile in range(program, tl.cdiv(M, BLOCK_M) * ALL * SPLIT_K, programs):
        pid_k = tile % SPLIT_K
        head = (tile // SPLIT_K) % ALL
        pid_m = tile // (SPLIT_K * ALL)
        first, second = _qkv_sums(x_ptr, norm_ptr, w_ptr, M, K, eps, HEAD_DIM, IEEE, BLOCK_M, BLOCK_K, SPLIT_K, pid_m, head, pid_k)
        _qkv_finish(first, second, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr, k_cache_ptr, v_cache_ptr, partial_ptr, lock_ptr, M, L,
                    head_eps, cache_row, cache_head, cache_pos, HEADS, KV_HEADS, HEAD_DIM, BLOCK_M, SPLIT_K, pid_m, head, pid_k)


@triton.jit
def _attention_stage(q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, out_ptr, M, L, scale, cache_row, cache_head, HEADS: tl.constexpr, GROUP: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, program, programs):
    for tile in range(program, M * HEADS, programs):
        _attend(q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, out_ptr, L, scale, cache_row, cache_head, tile // HEADS, tile % HEADS, HEADS, GROUP,
                HEAD_DIM, BLOCK_S)


@triton.jit
def _code_predictor_kernel(
        first_ptr, next_ptr, talker_in_ptr, proj_w_ptr, proj_b_ptr,
        in_norm_ptr, qkv_w_ptr, q_norm_ptr, k_norm_ptr, o_w_ptr, post_norm_ptr, gate_up_w_ptr, down_w_ptr, final_norm_ptr, head_w_ptr,
        k_cache_ptr, v_cache_ptr, cos_ptr, sin_ptr, pos_ptr,
        x_ptr, h_ptr, q_ptr, att_ptr, gated_ptr, logits_ptr, partial_ptr, lock_ptr, barrier_ptr,
        do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, frame_ptr, draws_per_frame, first_draw,
        codes_ptr, tables_ptr, table_start_ptr, token_ptr, text_ptr, text_len_ptr, pad_ptr, max_seq,
        rows, eps, head_eps, final_eps, scale, cache_layer, cache_row, cache_head, cache_pos,
        E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        LAYERS: tl.constexpr, STEPS: tl.constexpr, V: tl.constexpr, CODES: tl.constexpr, PROJECT: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, C: tl.constexpr,
        P_BN: tl.constexpr, P_BK: tl.constexpr, P_SPLIT: tl.constexpr, QKV_BK: tl.constexpr, QKV_SPLIT: tl.constexpr,
        O_BN: tl.constexpr, O_BK: tl.constexpr, O_SPLIT: tl.constexpr, GU_BN: tl.constexpr, GU_BK: tl.constexpr, GU_SPLIT: tl.constexpr,
        D_BN: tl.constexpr, D_BK: tl.constexpr, D_SPLIT: tl.constexpr, HD_BN: tl.constexpr, HD_BK: tl.constexpr, HD_SPLIT: tl.constexpr,
        GRID_SYNC: tl.constexpr, OVERLAP: tl.constexpr):
    """See CodePredictorKernel. Step s's tokens: 2 a row for s = 0 (the talker's state, codebook 0's
    embedding), 1 after; token m is position pos[m] of cache row m // L. Layer weights and caches
    are stacked ([LAYERS, ...]); the heads too ([STEPS, V, H])."""
    program, programs = tl.program_id(0), tl.num_programs(0)
    wait_for_inputs(OVERLAP)
    QKV_N: tl.constexpr = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    ATT: tl.constexpr = HEADS * HEAD_DIM
    target = 0
    for step in range(STEPS):
        if step == 0:
            source, pos, L = first_ptr, pos_ptr, 2
        else:
            source, pos, L = next_ptr, pos_ptr + rows * (step + 1), 1
        M = rows * L
        if PROJECT:
            _linear_stage(source, E, proj_w_ptr, proj_w_ptr, proj_b_ptr, x_ptr, x_ptr, partial_ptr, lock_ptr, M, H, E, 0.0, False, True, 0, IEEE,
                          BLOCK_M, P_BN, P_BK, P_SPLIT, program, programs)
            target += programs
            _grid_barrier(barrier_ptr, target, GRID_SYNC)
            source = x_ptr
        for layer in range(LAYERS):
            if layer == 0:
                src = source
            else:
                src = h_ptr
            k_cache, v_cache = k_cache_ptr + layer * cache_layer, v_cache_ptr + layer * cache_layer
            _qkv_stage(src, in_norm_ptr + layer * H, qkv_w_ptr + layer * QKV_N * H, q_norm_ptr + layer * HEAD_DIM, k_norm_ptr + layer * HEAD_DIM,
                       cos_ptr, sin_ptr, pos, q_ptr, k_cache, v_cache, partial_ptr, lock_ptr, M, H, L, eps, head_eps, cache_row, cache_head,
                       cache_pos, HEADS, KV_HEADS, HEAD_DIM, IEEE, BLOCK_M, QKV_BK, QKV_SPLIT, program, programs)
            target += programs
            _grid_barrier(barrier_ptr, target, GRID_SYNC)
            _attention_stage(q_ptr, k_cache, v_cache, pos, att_ptr, M, L, scale, cache_row, cache_head, HEADS, HEADS // KV_HEADS, HEAD_DIM, BLOCK_S,
                             program, programs)
            target += programs
            _grid_barrier(barrier_ptr, target, GRID_SYNC)
            _linear_stage(att_ptr, ATT, o_w_ptr, o_w_ptr + layer * H * ATT, o_w_ptr, src, h_ptr, partial_ptr, lock_ptr, M, H, ATT, 0.0, False, False,
                          1, IEEE, BLOCK_M, O_BN, O_BK, O_SPLIT, program, programs)
            target += programs
            _grid_barrier(barrier_ptr, target, GRID_SYNC)
            _linear_stage(h_ptr, H, post_norm_ptr + layer * H, gate_up_w_ptr + layer * 2 * I * H, gate_up_w_ptr, gated_ptr, gated_ptr, partial_ptr,
                          lock_ptr, M, I, H, eps, True, False, 2, IEEE, BLOCK_M, GU_BN, GU_BK, GU_SPLIT, program, programs)
            target += programs
            _grid_barrier(barrier_ptr, target, GRID_SYNC)
            _linear_stage(gated_ptr, I, down_w_ptr, down_w_ptr + layer * H * I, down_w_ptr, h_ptr, h_ptr, partial_ptr, lock_ptr, M, H, I, 0.0, False,
                          False, 1, IEEE, BLOCK_M, D_BN, D_BK, D_SPLIT, program, programs)
            target += programs
            _grid_barrier(barrier_ptr, target, GRID_SYNC)
        # the final norm and the step's head over each row's last token: float32 logits [rows, V]
        _linear_stage(h_ptr + (L - 1) * H, L * H, final_norm_ptr, head_w_ptr + step * V * H, head_w_ptr, logits_ptr, logits_ptr, partial_ptr,
                      lock_ptr, rows, V, H, final_eps, True, False, 0, IEEE, BLOCK_M, HD_BN, HD_BK, HD_SPLIT, program, programs)
        target += programs
        _grid_barrier(barrier_ptr, target, GRID_SYNC)
        for row in range(program, rows, programs):
            if step == STEPS - 1:
                draw_code(row, logits_ptr, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, frame_ptr, draws_per_frame,
                          first_draw + step * V, V, codes_ptr, step + 1, CODES, tables_ptr, table_start_ptr, talker_in_ptr, E, token_ptr, text_ptr,
                          text_len_ptr, pad_ptr, max_seq, True, BLOCK, BLOCK_T, C)
            else:
                draw_code(row, logits_ptr, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, frame_ptr, draws_per_frame,
                          first_draw + step * V, V, codes_ptr, step + 1, CODES, tables_ptr, table_start_ptr, next_ptr, E, token_ptr, text_ptr,
                          text_len_ptr, pad_ptr, max_seq, False, BLOCK, BLOCK_E, C)
        if step < STEPS - 1:
            target += programs
            _grid_barrier(barrier_ptr, target, GRID_SYNC)
    if GRID_SYNC:
        # The last program out resets the counts for the next frame: every other one has passed every barrier.
        if tl.atomic_add(barrier_ptr + 1, 1, sem="acq_rel") == programs - 1:
            tl.atomic_xchg(barrier_ptr, 0)
            tl.atomic_xchg(barrier_ptr + 1, 0)


def stack_parameters(modules: list[torch.nn.Module], name: str) -> torch.Tensor:
    """Parameter `name` of every module as one tensor [len(modules), ...], the modules' parameters
    made views of it (no copy kept): a kernel reaches layer l's at a fixed offset from one pointer."""
    params = [module.get_parameter(name) for module in modules]
    stacked = torch.stack([p.detach() for p in params])
    for param, view in zip(params, stacked):
        param.data = view
    return stacked


def stack_caches(model: "Transformer") -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's KV cache as one key and one value tensor [layers, rows, kv_heads, length, head_dim], the caches made views of them."""
    caches = [layer.self_attn.kv_cache for layer in model.layers]
    keys, values = torch.stack([c.k for c in caches]), torch.stack([c.v for c in caches])
    for i, cache in enumerate(caches):
        cache.k, cache.v = keys[i], values[i]
    return keys, values


def stage_tiles(config: KernelConfig, shape: dict, dtype: torch.dtype) -> dict[str, Tiles]:
    """The tiles of each stage of `_code_predictor_kernel` with shape constants `shape` (its E, H, I,
    HEADS, KV_HEADS, HEAD_DIM, V): the configuration's, as the kernel-per-stage path picks them."""
    s, tiles = shape, config.tiles
    qkv_rows = (s["HEADS"] + 2 * s["KV_HEADS"]) * s["HEAD_DIM"]
    stage = dict(P=tiles("linear0", s["H"], s["E"], dtype), QKV=tiles("qkv", qkv_rows, s["H"], dtype),
                 O=tiles("linear1", s["H"], s["HEADS"] * s["HEAD_DIM"], dtype), GU=tiles("linear2", s["I"], s["H"], dtype),
                 D=tiles("linear1", s["H"], s["I"], dtype), HD=tiles("linear0", s["V"], s["H"], dtype))
    depth = dict(P=s["E"], QKV=s["H"], O=s["HEADS"] * s["HEAD_DIM"], GU=s["H"], D=s["I"], HD=s["H"])
    for name, t in stage.items():
        _check_split(depth[name], t)
    return stage


def stage_launch(stage: dict[str, Tiles]) -> dict:
    """`_code_predictor_kernel`'s tile arguments (P_BN, P_BK, P_SPLIT, ...) for the stages' tiles."""
    launch = {}
    for name, t in stage.items():
        launch.update({f"{name}_BN": t.block_n, f"{name}_BK": t.block_k, f"{name}_SPLIT": t.split_k})
    del launch["QKV_BN"]  # q/k/v tiles are heads
    return launch


class CodePredictorKernel:
    """Codebooks 1..15 of every row's frame in one launch (see the module's docstring): the same
    arithmetic, in the same tiles, as the per-step path of `BatchDecoder._frame_in_kernels` (the
    predictor's layers and head per step, then `code_step`), the 1.7B's input projection included
    (each step here; the per-step path reads the later steps' from tables projected once: the same bits).

    Building it stacks the predictor's layer weights, heads and caches (the modules' tensors become
    views: nothing is copied twice) and allocates its scratch for `rows` rows. `config`: its stages'
    tiles and launch. `programs`: how many run (default: one per SM on CUDA; one in Triton's interpreter)."""

    def __init__(self, predictor: "CodePredictor", rows: int, config: KernelConfig, programs: int | None = None):
        model = predictor.model
        attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
        weight = model.norm.weight
        device, dtype = weight.device, weight.dtype
        self.predictor, self.rows, self.config = predictor, rows, config
        self.weights = {name: stack_parameters(list(model.layers), name) for name in LAYER_WEIGHTS}
        self.heads = stack_parameters(list(predictor.lm_head), "weight")
        self.keys, self.values = stack_caches(model)
        project = predictor.small_to_mtp_projection
        self.project = isinstance(project, torch.nn.Linear)
        hidden, steps = weight.shape[0], len(predictor.lm_head)
        embed = project.in_features if self.project else hidden
        self.shape = dict(E=embed, H=hidden, I=mlp.intermediate, HEADS=attn.heads, KV_HEADS=attn.kv_heads, HEAD_DIM=attn.head_dim,
                          LAYERS=len(model.layers), STEPS=steps, V=self.heads.shape[1], PROJECT=self.project, IEEE=dtype == torch.float32)
        # Step 0 has two tokens a row (rows 2r, 2r + 1 at positions 0, 1); step s >= 1 one, at position s + 1.
        first = torch.arange(2, device=device).repeat(rows)
        later = torch.arange(2, steps + 1, device=device).repeat_interleave(rows)
        self.positions = torch.cat((first, later))

        def scratch(*shape, dtype=dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        tokens = 2 * rows
        self.x, self.h = scratch(tokens, hidden), scratch(tokens, hidden)
        self.q, self.attended = scratch(tokens, attn.heads, attn.head_dim), scratch(tokens, attn.heads * attn.head_dim)
        self.gated, self.logits = scratch(tokens, mlp.intermediate), scratch(rows, self.shape["V"], dtype=torch.float32)
        self.barrier = scratch(2, dtype=torch.int32)
        self.programs = programs or (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1)
        self.stage_tiles, self.launch = self._plan(tokens)

    def _plan(self, tokens: int) -> tuple[dict, dict]:
        """Each stage's tiles (`stage_tiles`), its launch arguments, and the split-K room."""
        s = self.shape
        stage = stage_tiles(self.config, s, self.heads.dtype)
        row_blocks = triton.cdiv(tokens, BLOCK_M)
        columns = dict(P=s["H"], O=s["H"], GU=s["I"], D=s["H"], HD=s["V"])
        blocks = {name: row_blocks * triton.cdiv(n, stage[name].block_n) for name, n in columns.items()}
        blocks["QKV"] = row_blocks * (s["HEADS"] + 2 * s["KV_HEADS"])
        workspace = Workspace()  # room for the largest stage's split-K partials and counters
        for name, t in stage.items():
            workspace.get(blocks[name], t.split_k, BLOCK_M * (s["HEAD_DIM"] // 2 if name == "QKV" else t.block_n), self.heads.device)
        self.partial, self.locks = workspace.partial, workspace.locks
        return stage, stage_launch(stage)

    @torch.inference_mode()
    def __call__(self, first: torch.Tensor, next_input: torch.Tensor, talker_input: torch.Tensor, sampling: "RowSampling", seed_hash: torch.Tensor,
                 frame: torch.Tensor, draws_per_frame: int, first_draw: int, codes: torch.Tensor, tables: torch.Tensor, table_starts: torch.Tensor,
                 token: torch.Tensor, text: FrameText) -> None:
        """Codes 1..15 of every row's frame into codes [rows, 16] (codebook 0 from `token`) and the
        talker's next input into talker_input [rows, 1, E], from `first` [rows, 2, E] (the talker's
        state and codebook 0's embedding); `next_input` [rows, 1, E]: the steps' inputs between.
        Draw positions as `code_step`'s: step s draws at frame * draws_per_frame + first_draw + s * V."""
        predictor, model, s, w = self.predictor, self.predictor.model, self.shape, self.weights
        attn = model.layers[0].self_attn
        project = predictor.small_to_mtp_projection
        proj_w, proj_b = (project.weight, project.bias) if self.project else (self.heads, self.heads)
        e = s["E"]
        _code_predictor_kernel[(self.programs,)](
            first, next_input, talker_input, proj_w, proj_b,
            w["input_layernorm.weight"], w["self_attn.qkv_proj.weight"], w["self_attn.q_norm.weight"], w["self_attn.k_norm.weight"],
            w["self_attn.o_proj.weight"], w["post_attention_layernorm.weight"], w["mlp.gate_up_proj.weight"], w["mlp.down_proj.weight"],
            model.norm.weight, self.heads, self.keys, self.values, model.rope_cos, model.rope_sin, self.positions,
            self.x, self.h, self.q, self.attended, self.gated, self.logits, self.partial, self.locks, self.barrier,
            sampling.do_sample, sampling.temperature, sampling.top_k, sampling.top_p, seed_hash, frame, draws_per_frame, first_draw,
            codes, tables, table_starts, token, text.trailing, text.length, text.pad, text.trailing.shape[1],
            self.rows, model.layers[0].input_layernorm.eps, attn.q_norm.eps, model.norm.eps, attn.head_dim**-0.5, *self.keys.stride()[:4],
            **s, CODES=codes.shape[1], BLOCK_M=BLOCK_M, BLOCK_S=attention_block(self.keys.shape[3]),
            BLOCK=triton.next_power_of_2(s["V"]), BLOCK_E=_row_block(e), BLOCK_T=code_row_block(e, codes.shape[1], True), C=CANDIDATES,
            **self.launch, GRID_SYNC=self.programs > 1, num_warps=NUM_WARPS, num_stages=self.stage_tiles["QKV"].num_stages,
            **launch_options(self.config, first.device))
