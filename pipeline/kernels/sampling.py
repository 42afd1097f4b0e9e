"""`sample_rows` (pipeline.engine.sampling) as one Triton kernel (`sample`), and the two kernels that
carry the decode step's glue with it (`code_step`: a code-predictor step's draw, the code stored and
the next input written; `next_token`: the talker's draw with the reference's logit processors and
the commit of every row's state), each drawing its own Exp(1) noise as `exponential_noise` does
(counter-based: no tensor of noise). In each, one program per row holds the
row's whole vocabulary (2,048 or 3,072 logits) and does temperature, top-k, top-p and the
exponential race in registers. In PyTorch's ops the chain is a sort, two softmaxes, a cumulative
sum and an argmax over [rows, vocab] per sampled codebook (16 per frame).

Nothing is sorted: the rules need two values only, the k-th largest logit (top-k) and the smallest
kept one (top-p), and each is found by a search over the logits' float bits read as integers in
the same order (`_keys`): thresholds in an interval that shrinks each round. Top-k counts the keys
at or above 5 thresholds a round (4 for the talker's 3,072) in one sum, the counts packed into one
integer per key, and stops once a threshold keeps exactly k keys; top-p sums the mass at or below
8 thresholds a round. Measured on an H100 (CUDA graph, top-k 50), the first version (8 thresholds, a
sum each, to the last bit): 13 us a launch for 2,048 codes against 20 us sorting, 17 us for 3,072
(the talker's) against 68; 3.4 us with top-k off. With the counts packed, the first round's
thresholds a few binades below the largest key and the early stop, on an H200 (`python -m
benchmarks.kernels --sampling`, the median over 8 logit draws): 12.2 -> 5.0 us for 2,048 codes,
17.2 -> 6.5 for 3,072; 2.9 / 3.4 us with top-k off. A search is skipped where its rule is off
(top-k 0 or at least the vocabulary, top-p 1, greedy rows).

The rules are the same step for step (see sample_rows). The top-p rule keeps the tokens of rank r
where the mass of ranks r and below exceeds 1 - top_p; the mass of the ranks below a value's first
copy is the mass of the values at most that value, so the cutoff is the smallest value v whose
mass(values <= v) exceeds 1 - top_p (ties at v all kept, as the reference's value cutoff keeps
them). Sums run in another order than PyTorch's cumulative sum, so a mass can differ in the last
bit, which changes a draw only where it decides the cutoff to that bit.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from pipeline.ahead import launch
from pipeline.kernels import FrameText, RowState
from pipeline.kernels.config import KernelConfig
from pipeline.kernels.decode import launch_options, wait_for_inputs

if TYPE_CHECKING:
    from pipeline.engine.sampling import RowSampling


CANDIDATES = 8  # thresholds per round of the top-p search, the interval shrinking 8-fold (on an H100: 13 / 15 / 22 us with 8 / 16 / 32)


@triton.jit
def _softmax(x, largest):
    """softmax(x) given x's largest value (as the reference's softmax: exp(x - max) / sum)."""
    e = tl.exp(x - largest)
    return e / tl.sum(e, axis=0)


@triton.jit
def _value(key):
    """The float32 value of a key (`_keys`' inverse)."""
    key = key.to(tl.int32)
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _keys(x):
    """int32 keys ordered as the float32 values x: a float's bits, the negative ones mirrored (x has
    no -0.0: the caller adds +0.0 first, so the keys of equal values are equal)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _candidates(lo, hi, C: tl.constexpr):
    """C int32 thresholds lo, lo + step, ... over [lo, hi] (int64 scalars in int32's range, hi > lo + 1;
    thresholds past hi are hi: they decide nothing)."""
    step = (hi - lo + C - 1) // C
    return tl.minimum(lo + step * tl.arange(0, C).to(tl.int64), hi).to(tl.int32)


@triton.jit
def _threshold(lo, hi, step, top, first, j: tl.constexpr, T: tl.constexpr):
    """Threshold j of a round, in (lo, hi]: evenly spaced, or in the first round 2^22, 2^23.5, ...
    keys below the largest key (a key step of 2^23 is a factor 2 in value: the first round brackets
    the k-th largest within a few binades of the largest, where an even split would take ~3 rounds)."""
    t = tl.where(first, top - (1 << (22 + (3 * (T - 1 - j)) // 2)), lo + (j + 1) * step)
    return tl.minimum(tl.maximum(t, lo + 1), hi)


@triton.jit
def _kth_largest(keys, top, k):
    """A key t whose kept set {keys >= t} is the top k's, {keys >= the k-th largest key}, given the
    largest key `top` (and 0 < k < the keys' count). Each round counts the keys at or above T
    thresholds in an interval [lo, hi] with count(keys >= lo) >= k > count(keys >= hi) in one
    sum: the counts, FIELD bits each (a count of up to BLOCK keys fits), packed side by side into
    one int64 per key. The search stops as soon as a threshold keeps exactly k keys: then no key
    lies between it and the k-th largest, and the remaining bits of the k-th largest decide nothing."""
    FIELD: tl.constexpr = 12 if keys.shape[0] <= 2048 else (13 if keys.shape[0] <= 4096 else 17)
    tl.static_assert(keys.shape[0] <= 65536)
    T: tl.constexpr = 63 // FIELD
    MASK: tl.constexpr = (1 << FIELD) - 1
    lo = tl.full([], -2147483647, tl.int64)  # every key but the padding's (-2^31)
    hi = top + 1
    first = True
    while hi - lo > 1:
        step = (hi - lo + T) // (T + 1)
        packed = tl.zeros(keys.shape, dtype=tl.int64)
        for j in tl.static_range(T):
            packed += (keys >= _threshold(lo, hi, step, top, first, j, T).to(tl.int32)).to(tl.int64) << (FIELD * j)
        counts = tl.sum(packed, axis=0)
        new_lo, new_hi, exact = lo, hi, False
        for j in tl.static_range(T):  # counts fall as thresholds rise: the last with >= k, the first with < k
            count = (counts >> (FIELD * j)) & MASK
            new_lo = tl.where(count >= k, _threshold(lo, hi, step, top, first, j, T), new_lo)
            exact = exact | (count == k)
        for j in tl.static_range(T - 1, -1, -1):
            new_hi = tl.where(((counts >> (FIELD * j)) & MASK) < k, _threshold(lo, hi, step, top, first, j, T), new_hi)
        lo = new_lo
        hi = tl.where(exact, new_lo + 1, new_hi)
        first = False
    return lo


@triton.jit
def _mass_cutoff(keys, p, lo, hi, mass, C: tl.constexpr):
    """The smallest key t with sum(p where keys <= t) > mass, given it fails at lo and holds at hi (or
    hi is the largest key: the most likely token is always kept)."""
    while hi - lo > 1:
        t = _candidates(lo, hi, C)
        over = tl.sum(tl.where(keys[None, :] <= t[:, None], p[None, :], 0.0), axis=1) > mass
        hi = tl.min(tl.where(over & (t > lo), t, hi), axis=0)
        lo = tl.max(tl.where(over | (t >= hi), lo, t), axis=0)
    return hi


@triton.jit
def _choose(logits, inside, noise, row, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, V, C: tl.constexpr):
    """Row `row`'s token from its logits [BLOCK] (-inf past V) and Exp(1) noise, with its settings
    (RowSampling's tensors): see sample_rows."""
    if tl.load(do_sample_ptr + row) != 0:
        scaled = logits / tl.load(temperature_ptr + row) + 0.0
        # The padding's key is below every value's, -inf's included: never counted.
        keys = tl.where(inside, _keys(scaled), -2147483648)
        top = tl.max(keys, axis=0).to(tl.int64)
        largest = _value(top)  # every cutoff keeps the largest value: the kept values' maximum
        cutoff = tl.full([], -2147483647, tl.int64)  # top-k off: every token (the padding's key is -2^31)
        top_k = tl.load(top_k_ptr + row)
        if (top_k > 0) & (top_k < V):
            cutoff = _kth_largest(keys, top, top_k)
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:
            p = _softmax(tl.where(keys >= cutoff, scaled, float("-inf")), largest)
            cutoff = _mass_cutoff(keys, p, cutoff - 1, top, 1.0 - top_p, C)
        race = _softmax(tl.where(keys >= cutoff, scaled, float("-inf")), largest) / noise
        token = tl.argmax(race, axis=0)
    else:
        token = tl.argmax(logits, axis=0)
    return token


@triton.jit
def _mix32(x):
    """pipeline.engine.sampling.mix32 in uint32 arithmetic (products wrap modulo 2^32, as its `& M32` keeps them)."""
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x2C1B3C6D, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _exponential_noise(seed_hash, start, offs):
    """pipeline.engine.sampling.exponential_noise of one row (seed_hash, start: int64 scalars) at draw positions start + offs."""
    index = (start + offs.to(tl.int64)).to(tl.uint32)  # modulo 2^32, as its `& M32`
    seed = seed_hash.to(tl.uint32)
    bits = _mix32(_mix32(index ^ seed) + seed)
    uniform = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / (1 << 24))
    return -tl.log(uniform)


# A row's settings are views into the engine's per-row tensors (the first token of row r reads them
# from element r): their alignment must not pick a compiled variant, or the first requests after a
# start would compile one per alignment while they wait for their first audio.
@triton.jit(do_not_specialize_on_alignment=["do_sample_ptr", "temperature_ptr", "top_k_ptr", "top_p_ptr"])
def _sample_kernel(logits_ptr, noise_ptr, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, out_ptr, V, stride_logits, stride_noise,
                   BLOCK: tl.constexpr, C: tl.constexpr, OVERLAP: tl.constexpr):
    wait_for_inputs(OVERLAP)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inside = offs < V
    logits = tl.load(logits_ptr + row * stride_logits + offs, mask=inside, other=float("-inf"))
    noise = tl.load(noise_ptr + row * stride_noise + offs, mask=inside, other=1.0)
    token = _choose(logits, inside, noise, row, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, V, C)
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _copy_row(src_ptr, dst_ptr, H, BLOCK_H: tl.constexpr):
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < H), mask=offs < H)


@triton.jit
def _code_kernel(logits_ptr, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, frame_ptr, draws_per_frame, first_draw, V,
                 codes_ptr, column, CODES: tl.constexpr, tables_ptr, table_start_ptr, next_ptr, H,
                 token_ptr, text_ptr, text_len_ptr, pad_ptr, max_seq, LAST: tl.constexpr,
                 BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, C: tl.constexpr, OVERLAP: tl.constexpr):
    wait_for_inputs(OVERLAP)
    draw_code(tl.program_id(0), logits_ptr, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, frame_ptr, draws_per_frame, first_draw,
              V, codes_ptr, column, CODES, tables_ptr, table_start_ptr, next_ptr, H, token_ptr, text_ptr, text_len_ptr, pad_ptr, max_seq, LAST,
              BLOCK, BLOCK_H, C)


@triton.jit
def draw_code(row, logits_ptr, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, frame_ptr, draws_per_frame, first_draw, V,
              codes_ptr, column, CODES: tl.constexpr, tables_ptr, table_start_ptr, next_ptr, H,
              token_ptr, text_ptr, text_len_ptr, pad_ptr, max_seq, LAST: tl.constexpr,
              BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, C: tl.constexpr):
    """Codebook `column` of row `row`'s frame (a code-predictor step): drawn as sample_rows
    draws it (its noise computed here, as exponential_noise computes it), stored in codes [rows,
    CODES], and what comes next written for the row: the code's embedding (its table: rows from
    table_start[column]) as the next step's input [rows, H], or, after the last codebook (LAST),
    the talker's next input: the sum of the frame's CODES code embeddings (codebook 0 from
    `token`) plus the row's text for this frame (or tts_pad when its text is used up), as
    `Talker.embed_codes(codes) + text`."""
    offs = tl.arange(0, BLOCK)
    inside = offs < V
    logits = tl.load(logits_ptr + row * V + offs, mask=inside, other=float("-inf"))
    frame = tl.load(frame_ptr + row)
    noise = _exponential_noise(tl.load(seed_ptr + row), frame * draws_per_frame + first_draw, offs)
    token = _choose(logits, inside, noise, row, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, V, C).to(tl.int64)
    tl.store(codes_ptr + row * CODES + column, token)
    if LAST:
        code0 = tl.load(token_ptr + row)
        tl.store(codes_ptr + row * CODES, code0)
        c = tl.arange(0, CODES)
        codes = tl.load(codes_ptr + row * CODES + c, mask=c != column, other=0)
        codes = tl.where(c == 0, code0, tl.where(c == column, token, codes))
        table_rows = tl.load(table_start_ptr + c) + codes
        text_len = tl.load(text_len_ptr + row)
        dt = next_ptr.dtype.element_ty
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_mask = offs_h < H
            embeds = tl.load(tables_ptr + table_rows[:, None] * H + offs_h[None, :], mask=h_mask[None, :], other=0.0).to(tl.float32)
            total = tl.sum(embeds, axis=0).to(dt).to(tl.float32)
            has_text = (offs_h * 0 + frame) < text_len
            text = tl.load(text_ptr + (row * max_seq + tl.minimum(frame, max_seq - 1)) * H + offs_h, mask=h_mask & has_text, other=0.0)
            text = tl.where(has_text, text.to(tl.float32), tl.load(pad_ptr + offs_h, mask=h_mask, other=0.0).to(tl.float32))
            tl.store(next_ptr + row * H + offs_h, (total + text).to(dt), mask=h_mask)
    else:
        _copy_row(tables_ptr + (tl.load(table_start_ptr + column) + token) * H, next_ptr + row * H, H, BLOCK_H)


@triton.jit
def _next_token_kernel(logits_ptr, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seed_ptr, frame_ptr, draws_per_frame, V,
                       seen_ptr, penalty_ptr, suppressed_ptr, eos, min_new_tokens, active_ptr, token_ptr, max_frame_ptr, text_len_ptr,
                       text_end_ptr, pos_ptr, produced_ptr, normed_ptr, state_ptr, table_ptr, H,
                       BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, C: tl.constexpr, OVERLAP: tl.constexpr):
    """The end of row program_id(0)'s frame: its next codebook-0 token from the talker's logits
    with the reference's processors (repetition penalty over the codes it has produced, the
    suppressed control ids, EOS masked before min_new_tokens), drawn with its noise; then, if the
    row ran this frame (occupied, not ended, under its frame limit, its text available), its state
    advances: token, seen codes, position, frame count, and the code predictor's next input,
    `state` [rows, 2, H]: the talker's normed output and the token's embedding. A row that did
    not run keeps its state exactly. produced[row]: whether it ran."""
    wait_for_inputs(OVERLAP)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inside = offs < V
    frame = tl.load(frame_ptr + row)
    logits = tl.load(logits_ptr + row * V + offs, mask=inside, other=float("-inf"))
    seen = tl.load(seen_ptr + row * V + offs, mask=inside, other=0) != 0
    penalty = tl.load(penalty_ptr + row)
    logits = tl.where(seen, tl.where(logits < 0, logits * penalty, logits / penalty), logits)
    suppressed = (tl.load(suppressed_ptr + offs, mask=inside, other=0) != 0) | ((offs == eos) & (frame + 1 < min_new_tokens))
    logits = tl.where(suppressed, float("-inf"), logits)
    noise = _exponential_noise(tl.load(seed_ptr + row), (frame + 1) * draws_per_frame, offs)
    token = _choose(logits, inside, noise, row, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, V, C).to(tl.int64)
    run = ((tl.load(active_ptr + row) != 0) & (tl.load(token_ptr + row) != eos) & (frame < tl.load(max_frame_ptr + row))
           & ((frame < tl.load(text_len_ptr + row)) | (tl.load(text_end_ptr + row) != 0)))
    tl.store(produced_ptr + row, run)
    if run:
        tl.store(token_ptr + row, token)
        tl.store(seen_ptr + row * V + token, 1)
        tl.store(pos_ptr + row, tl.load(pos_ptr + row) + 1)
        tl.store(frame_ptr + row, frame + 1)
        _copy_row(normed_ptr + row * H, state_ptr + row * 2 * H, H, BLOCK_H)
        _copy_row(table_ptr + token * H, state_ptr + (row * 2 + 1) * H, H, BLOCK_H)


def sample(logits: torch.Tensor, settings: "RowSampling", noise: torch.Tensor, config: KernelConfig) -> torch.Tensor:
    """`sample_rows(logits, settings, noise)` in one kernel: logits, noise [rows, V] float32 -> token ids [rows]."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    block = triton.next_power_of_2(vocab)
    launch(_sample_kernel, (rows,), logits, noise, settings.do_sample, settings.temperature, settings.top_k, settings.top_p, out, vocab,
                           logits.stride(0), noise.stride(0), BLOCK=block, C=CANDIDATES, num_warps=sampling_warps(block, config),
                           **launch_options(config, logits.device))
    return out


def sampling_warps(block: int, config: KernelConfig) -> int:
    """Warps of a program that holds a row's `block` logits."""
    return config.wide_sampling_warps if block > 2048 else (8 if block == 2048 else 4)


def _row_block(width: int) -> int:
    return min(1024, triton.next_power_of_2(width))


def code_row_block(hidden: int, codes: int, last: bool) -> int:
    """Columns per iteration of `draw_code`'s copy (or, after the last codebook, its sum of `codes`
    embeddings: codes x columns in registers at once) of a row of `hidden`."""
    return min(_row_block(hidden), 4096 // codes) if last else _row_block(hidden)


def code_step(logits: torch.Tensor, settings: "RowSampling", seed_hash: torch.Tensor, frame: torch.Tensor, draws_per_frame: int, first_draw: int,
              codes: torch.Tensor, column: int, tables: torch.Tensor, table_starts: torch.Tensor, next_input: torch.Tensor,
              config: KernelConfig, text: "FrameText | None" = None, token: torch.Tensor | None = None) -> None:
    """Codebook `column` of every row's frame into codes [rows, CODES] (see _code_kernel), and the
    row's next input [rows, H] into `next_input`: the code's embedding from `tables` (all codebooks'
    tables stacked, codebook c's from row table_starts[c]); after the last codebook (`text` given),
    the talker's next input: the frame's code embeddings summed plus the row's text, codebook 0
    from `token`."""
    rows, vocab = logits.shape
    hidden = next_input.shape[-1]
    last = text is not None
    trailing, text_len, pad, max_seq = (text.trailing, text.length, text.pad, text.trailing.shape[1]) if last else (next_input, frame, next_input, 1)
    block = triton.next_power_of_2(vocab)
    launch(_code_kernel, (rows,), logits, settings.do_sample, settings.temperature, settings.top_k, settings.top_p, seed_hash, frame, draws_per_frame,
                          first_draw, vocab, codes, column, codes.shape[1], tables, table_starts, next_input, hidden,
                          token if last else frame, trailing, text_len, pad, max_seq, LAST=last, BLOCK=block,
                          BLOCK_H=code_row_block(hidden, codes.shape[1], last), C=CANDIDATES, num_warps=sampling_warps(block, config),
                          **launch_options(config, logits.device))


def next_token(logits: torch.Tensor, settings: "RowSampling", state: "RowState", draws_per_frame: int, suppressed: torch.Tensor, eos: int,
               min_new_tokens: int, normed: torch.Tensor, code_predictor_input: torch.Tensor, table: torch.Tensor, config: KernelConfig) -> None:
    """Every row's next codebook-0 token drawn from the talker's logits [rows, V] with the reference's
    processors, and the state of the rows that ran advanced (see _next_token_kernel)."""
    rows, vocab = logits.shape
    hidden = normed.shape[-1]
    block = triton.next_power_of_2(vocab)
    launch(_next_token_kernel, (rows,), logits, settings.do_sample, settings.temperature, settings.top_k, settings.top_p, state.seed_hash, state.frame,
                                draws_per_frame, vocab, state.seen, state.penalty, suppressed, eos, min_new_tokens, state.active, state.token,
                                state.max_frame, state.text_len, state.text_end, state.pos, state.produced, normed, code_predictor_input, table,
                                hidden, BLOCK=block, BLOCK_H=_row_block(hidden), C=CANDIDATES, num_warps=sampling_warps(block, config),
                                **launch_options(config, logits.device))
