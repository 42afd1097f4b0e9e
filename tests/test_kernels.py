"""The fused decode-step kernels (pipeline.kernels) against the modules' own decode step, in
float32 and float16 (bfloat16 on a GPU only), run by Triton's interpreter on CPU (TRITON_INTERPRET=1,
set in conftest.py) and by the GPU on CUDA: the same hidden states, the same KV caches, a row's
result independent of its neighbours, and the same codes from the engine's whole decode step."""
import copy
import dataclasses

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pipeline.engine.decoder import BatchDecoder, DecodeConfig  # noqa: E402
from pipeline.kernels import fused_decode, fused_decode_logits, fused_supported  # noqa: E402
from pipeline.kernels.config import KernelConfig  # noqa: E402
from pipeline.kernels.sampling import _exponential_noise  # noqa: E402
from pipeline.model import Transformer  # noqa: E402
from pipeline.request import SpeechRequest  # noqa: E402
from pipeline.tts import TTS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS, MAX_SEQ = 3, 160
CONFIG = KernelConfig.for_device(torch.device(DEVICE))  # the kernels' tiles and launch options on this device


def random_stack(hidden: int, heads: int, kv_heads: int, head_dim: int) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(hidden, 2 * hidden, 2, heads, kv_heads, head_dim, 1e-6, 1e6).to(DEVICE).eval()
    for name, p in model.named_parameters():
        # norm weights away from 1, so a missing or misplaced weight shows
        p.data.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
    model.setup_caches(ROWS, MAX_SEQ)
    return model


def twins(hidden=64, heads=4, kv_heads=2, head_dim=16) -> tuple[Transformer, Transformer]:
    model = random_stack(hidden, heads, kv_heads, head_dim)
    twin = copy.deepcopy(model)
    twin.setup_caches(ROWS, MAX_SEQ)
    return model, twin


def caches(model: Transformer) -> torch.Tensor:
    return torch.stack([torch.stack((layer.self_attn.kv_cache.k, layer.self_attn.kv_cache.v)) for layer in model.layers])


# float32 to float rounding; float16 to a few of its units in the last place at values of 2 to 4
# (0.002 each: sums in another order; 0.007 seen in the interpreter), where a weight missed or read
# twice is off by the size of a value
TOLERANCE = {torch.float32: 1e-5, torch.float16: 0.02, torch.bfloat16: 0.05}


@pytest.mark.parametrize("shape, dtype", [(dict(hidden=64, heads=4, kv_heads=2, head_dim=16), torch.float32),
                                          (dict(hidden=32, heads=4, kv_heads=1, head_dim=8), torch.float32),
                                          (dict(hidden=48, heads=4, kv_heads=2, head_dim=8), torch.float32),  # widths off the tiles: masked tails
                                          (dict(hidden=32, heads=2, kv_heads=1, head_dim=16), torch.float16)])
@torch.inference_mode()
def test_fused_decode_equals_the_module_decode(shape, dtype):
    """Rows at different positions, a two-token first step (the code predictor's), then one token
    at a time; the last row's keys go past the attention's first block of 128 positions (its loop), the others' fit in
    one (its single-block path)."""
    model, fused = (m.to(dtype) for m in twins(**shape))
    generator = torch.Generator().manual_seed(1)
    starts = torch.tensor([0, 5, 125], device=DEVICE)
    positions = torch.stack((starts, starts + 1), dim=1)
    tolerance = TOLERANCE[dtype]
    for step in range(6):
        x = torch.randn(ROWS, positions.shape[1], shape["hidden"], generator=generator).to(DEVICE, dtype)
        expected, got = model.decode(x, positions), fused_decode(fused, x, positions, CONFIG)
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
        positions = positions[:, -1:] + 1
    torch.testing.assert_close(caches(fused), caches(model), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEVICE == "cpu", reason="Triton's interpreter does not round bfloat16 as the GPU does"))])
@torch.inference_mode()
def test_fused_logits_equal_the_modules_norm_and_head(dtype):
    """The final norm and an output head of 40 codes in one kernel: float32 logits of the last
    position, rounded to the activations' dtype first as `F.linear(...).float()` rounds them (in
    bfloat16 every logit is then a bfloat16 value), for the code predictor's two-token first step
    (the last position's rows read in place, apart) and a one-token step; the normed last position
    (the talker's next state) written on the side by the head's first column block. float16 runs in
    the interpreter too: NumPy has its own float16, rounded as the GPU rounds."""
    model, fused = (m.to(dtype) for m in twins())
    head = (torch.randn(40, 64, generator=torch.Generator().manual_seed(3)) * 0.2).to(DEVICE, dtype)
    generator = torch.Generator().manual_seed(4)
    positions = torch.tensor([[0, 1], [4, 5], [9, 10]], device=DEVICE)
    for _ in range(2):
        x = torch.randn(ROWS, positions.shape[1], 64, generator=generator).to(DEVICE, dtype)
        state = model.decode(x, positions)[:, -1]
        expected = torch.nn.functional.linear(state, head).float()
        normed = torch.full_like(state, float("nan"))
        got = fused_decode_logits(fused, x, positions, head, CONFIG, normed=normed)
        assert got.dtype == torch.float32 and got.shape == (ROWS, 40)
        assert torch.equal(got, got.to(dtype).float())
        tolerance = TOLERANCE[dtype]
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(normed, state, rtol=tolerance, atol=tolerance)
        positions = positions[:, -1:] + 1


@torch.inference_mode()
def test_a_rows_result_does_not_depend_on_its_neighbours():
    model, _ = twins()
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(ROWS, 1, 64, generator=generator).to(DEVICE)
    positions = torch.tensor([[3], [7], [0]], device=DEVICE)
    alone = fused_decode(model, x, positions, CONFIG)[1].clone()
    neighbours = x.clone()
    neighbours[[0, 2]] = torch.randn(2, 1, 64, generator=generator).to(DEVICE) * 5
    assert torch.equal(fused_decode(model, neighbours, positions, CONFIG)[1], alone)


def test_stacks_with_other_mlps_keep_the_unfused_step():
    """Qwen3-Omni's talker has sparse-MoE layers: the fused kernels do not apply to them."""
    model = random_stack(32, 4, 2, 8)
    assert fused_supported(model)
    model.layers[0].mlp = torch.nn.Identity()
    assert not fused_supported(model)


@pytest.fixture(scope="module")
def tts_pair(tiny_checkpoints):
    path = str(tiny_checkpoints["custom_voice"])
    return (TTS.from_pretrained(path, device=DEVICE, rows=2, use_cuda_graphs=False, fused=False),
            TTS.from_pretrained(path, device=DEVICE, rows=2, use_cuda_graphs=False, fused=True))


def test_engine_codes_with_fused_kernels_equal_the_module_step(tts_pair):
    """Sampled (seeded), so that every codebook's logits go through top-k and top-p. Two frames (the
    interpreter runs ~12 s a frame): the second's talker step attends over the cache the first wrote."""
    plain, fused = tts_pair
    assert isinstance(fused.engine.decoder, BatchDecoder) and fused.engine.decoder.fused and not plain.engine.decoder.fused
    request = SpeechRequest("Fused kernels, same codes.", speaker="ryan", seed=7, max_frames=2)
    expected = plain.submit(request)
    list(expected)
    got = fused.submit(request)
    list(got)
    assert got.codes.shape == (2, 16)
    assert torch.equal(torch.as_tensor(got.codes), torch.as_tensor(expected.codes))


HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not HOPPER, reason="overlapped launches (programmatic dependent launch) need compute capability 9.0")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_overlapped_launches_in_a_cuda_graph_give_the_same_bits(dtype):
    """Each kernel launched while the previous one runs (pulling its weights into L2, then waiting
    for the previous kernel's results) computes exactly what it computes launched after it: the
    same hidden states and caches, bit for bit, over steps replayed from one CUDA graph."""
    def replayed(overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
        config = dataclasses.replace(CONFIG, overlap=overlap)
        model = random_stack(256, 4, 2, 64).to(dtype)
        x = torch.zeros(ROWS, 1, 256, device=DEVICE, dtype=dtype)
        positions = torch.zeros(ROWS, 1, dtype=torch.long, device=DEVICE)
        fused_decode(model, x, positions, config)  # compiles the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_decode(model, x, positions, config)
        generator = torch.Generator().manual_seed(6)
        outputs = []
        for step in range(4):
            x.copy_(torch.randn(ROWS, 1, 256, generator=generator))
            positions.copy_(torch.tensor([[step], [step + 3], [step + 140]]))
            graph.replay()
            outputs.append(out.clone())
        return torch.stack(outputs), caches(model)

    assert CONFIG.overlap
    (hidden, kv), (serial_hidden, serial_kv) = replayed(True), replayed(False)
    assert torch.equal(hidden, serial_hidden) and torch.equal(kv, serial_kv)
    assert hidden.abs().sum() > 0


@pytest.mark.parametrize("rows, k, programs", [(4096, 1024, 128), (1024, 3072, 256), (6144, 1024, 96), (12288, 2048, 192), (2048, 6144, 256),
                                                (40, 64, 1)])
def test_the_next_weights_prefetch_covers_it_within_the_l2_budget(rows, k, programs):
    """What a matmul kernel asks into L2 for the next one: all of the next weight where it fits in
    the configuration's budget (the 0.6B's), its first budget's bytes where not (the 1.7B's 50 MB gate/up
    weight), in equal power-of-two shares of whole 128-byte lines over the kernel's programs (no
    more than twice what is needed); nothing off CUDA (Triton's interpreter has no prefetch)."""
    from pipeline.kernels.decode import _prefetch, prefetch_shares

    budget = KernelConfig().l2_prefetch_bytes
    size, lines, line = prefetch_shares(rows * k, 2, programs, budget)
    assert line == 64 and lines & (lines - 1) == 0
    assert size == min(rows * k, budget // 2) and (lines // 2) * programs * line < size <= lines * programs * line
    on_cpu = torch.empty(rows, k, dtype=torch.bfloat16)
    assert _prefetch(CONFIG, on_cpu, programs, on_cpu)["NEXT_LINES"] == 0 and _prefetch(CONFIG, None, programs, on_cpu)["NEXT_LINES"] == 0


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("rows", [5, 21])
@torch.inference_mode()
def test_split_k_equals_the_unsplit_kernel_and_repeats_exactly(mode, rows):
    """Split-K (programs sharing a tile's reduction, the last to finish adding the partials in split
    order; partials of the batch's rows only): the same sums as one program per tile, bit-identical
    from one launch to the next (the arrival counters reset themselves), for a part-filled row block
    and for a full one and a part-filled one."""
    from pipeline.kernels.decode import Tiles, Workspace, linear
    from pipeline.layers import RMSNorm

    generator = torch.Generator().manual_seed(3)
    n, k = 48, 64
    x = torch.randn(rows, k, generator=generator).to(DEVICE)
    weight = torch.randn(2 * n if mode == 2 else n, k, generator=generator).to(DEVICE)
    residual = torch.randn(rows, n, generator=generator).to(DEVICE)
    norm = RMSNorm(k, 1e-6).to(DEVICE) if mode == 2 else None
    workspace = Workspace()

    def run(split_k: int) -> torch.Tensor:
        out = torch.empty(rows, n, device=DEVICE)
        return linear(x, weight, out, workspace, CONFIG, norm=norm, mode=mode, residual=residual if mode == 1 else None,
                      shape=Tiles(block_k=16, split_k=split_k))

    whole, split = run(1), run(4)
    # float32 sums in another order: gate/up's product doubles the rounding (4e-5 seen on an H200);
    # a partial dropped or counted twice is off by the size of a value
    torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-4)
    assert torch.equal(run(4), split)
    assert not workspace.locks.any()


@torch.inference_mode()
def test_the_matmul_kernel_adds_a_bias_as_a_linear_does():
    """A Linear with a bias (the 1.7B's code-predictor input projection) in the matmul kernel, whole
    and split-K: the module's output; and a row's result does not depend on how many rows run."""
    from pipeline.kernels.decode import Tiles, Workspace, linear

    generator = torch.Generator().manual_seed(6)
    module = torch.nn.Linear(64, 48).to(DEVICE)
    x = torch.randn(5, 64, generator=generator).to(DEVICE)
    for split_k in (1, 4):
        out = torch.empty(5, 48, device=DEVICE)
        linear(x, module.weight, out, Workspace(), CONFIG, bias=module.bias, shape=Tiles(block_k=16, split_k=split_k))
        torch.testing.assert_close(out, module(x), rtol=1e-5, atol=1e-5)
        one = torch.empty(1, 48, device=DEVICE)
        linear(x[2:3], module.weight, one, Workspace(), CONFIG, bias=module.bias, shape=Tiles(block_k=16, split_k=split_k))
        assert torch.equal(one[0], out[2])


def test_a_workspace_keeps_every_buffer_it_handed_out():
    """A larger request replaces the workspace's buffers, but the ones handed out before stay alive
    (a CUDA graph captured with them, the decoder's graph over fewer rows, still writes there) and
    the new counters start at zero."""
    import gc
    import weakref

    from pipeline.kernels.decode import Workspace

    workspace = Workspace()
    small = [weakref.ref(t) for t in (*workspace.get(2, 4, 16, torch.device("cpu")), workspace.stats(8, torch.device("cpu")))]
    partial, locks = workspace.get(32, 4, 16, torch.device("cpu"))
    stats = workspace.stats(128, torch.device("cpu"))
    gc.collect()
    assert all(ref() is not None for ref in small)
    assert partial.numel() == 32 * 4 * 2 * 16 and locks.numel() == 32 and stats.numel() == 128
    assert not locks.any()
    assert workspace.get(3, 4, 16, torch.device("cpu"))[0] is partial  # room enough: the same buffer


@torch.inference_mode()
def test_split_k_qkv_equals_the_unsplit_kernel():
    from pipeline.kernels.decode import Tiles, Workspace, qkv_rope

    model, twin = twins()
    h = torch.randn(ROWS, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    positions = torch.tensor([0, 9, 30], device=DEVICE)
    results = []
    for stack, split_k in ((model, 1), (twin, 4)):
        q = torch.empty(ROWS, 4, 16, device=DEVICE)
        qkv_rope(stack.layers[0], h, positions, 1, stack.rope_cos, stack.rope_sin, q, Workspace(), CONFIG, Tiles(block_k=16, split_k=split_k))
        results.append((q, caches(stack)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parts, whole", [(1, 16), (2, 64), (4, 16), (4, 64)])
@torch.inference_mode()
def test_attention_split_in_chunks_equals_one_program_per_head(parts, whole):
    """Contexts of 10, 38 and 151 positions: those of `whole` positions at most attended by `parts`
    programs that each weigh a share of the value columns, the others over the cache split in chunks
    of 16 positions (3 and 10 chunks exchanging their softmax statistics): the same attention as one
    program per head, bit-identical from one launch to the next."""
    from pipeline.kernels.decode import Workspace, attention

    model, _ = twins()
    attn = model.layers[0].self_attn
    generator = torch.Generator().manual_seed(5)
    for cache in (attn.kv_cache.k, attn.kv_cache.v):
        cache.copy_(torch.randn(cache.shape, generator=generator))
    q = torch.randn(ROWS, 4, 16, generator=generator).to(DEVICE)
    positions = torch.tensor([9, 37, 150], device=DEVICE)
    workspace = Workspace()

    def run(chunk: int) -> torch.Tensor:
        out = torch.full((ROWS, 64), float("nan"), device=DEVICE)
        attention(attn, q, positions, 1, out, workspace, CONFIG, chunk=chunk, parts=parts, whole=whole)
        return out

    alone, split = run(0), run(16)
    torch.testing.assert_close(split, alone, rtol=1e-5, atol=1e-5)
    assert torch.equal(run(16), split)
    assert not workspace.locks.any() and not workspace.stats_arrivals.any()


def random_talker_attention(dtype: torch.dtype, seed: int) -> tuple[torch.nn.Module, torch.Generator]:
    """A layer's attention over 16 rows of a 2,048-position cache (the talker's) of random keys and
    values, and the generator that drew them (for the queries)."""
    torch.manual_seed(0)
    model = Transformer(256, 512, 1, 4, 2, 64, 1e-6, 1e6).to(DEVICE, dtype).eval()
    model.setup_caches(16, 2048)
    attn = model.layers[0].self_attn
    generator = torch.Generator().manual_seed(seed)
    for cache in (attn.kv_cache.k, attn.kv_cache.v):
        cache.copy_(torch.randn(cache.shape, generator=generator))
    return attn, generator


@torch.inference_mode()
def test_short_context_attention_has_the_same_bits_with_any_number_of_programs_per_head():
    """A context of 256 positions at most (the talker's first ~17 s), its value columns weighed in 4
    groups, attended by 1, 2 or 4 programs per head gives the same bits: a launch could then take
    fewer programs for many rows and a row alone and among 15 others would still give the same audio.
    16 rows at positions from 1 to 256 (and beyond: the chunks' exchange, which parts do not touch)."""
    from pipeline.kernels.decode import Workspace, attention

    config = dataclasses.replace(CONFIG, attention_parts=4)  # the column groups

    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    attn, generator = random_talker_attention(dtype, 9)
    q = torch.randn(16, 4, 64, generator=generator).to(DEVICE, dtype)
    at = torch.tensor([0, 1, 7, 15, 16, 31, 63, 64, 100, 127, 128, 200, 254, 255, 256, 700], device=DEVICE)
    outs = []
    for parts in (1, 2, 4, 1):
        out = torch.empty(16, 256, device=DEVICE, dtype=dtype)
        attention(attn, q, at, 1, out, Workspace(), config, chunk=256, num_warps=8, parts=parts, whole=256)
        outs.append(out)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.mark.skipif(DEVICE == "cpu", reason="one launch needs a GPU: Triton's interpreter runs one program after another")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_split_attention_in_one_launch_equals_its_two_passes(dtype):
    """The chunks exchanging their softmax statistics inside one launch give the bits of the two
    passes launched one after the other, over repeated launches (the counters left at zero), for
    16 rows at positions that use 1 to all 32 chunks of a 2,048-position cache (the talker's)."""
    from pipeline.kernels.decode import Workspace, attention

    attn, generator = random_talker_attention(dtype, 8)
    workspace = Workspace()
    for positions in ([0, 5, 63, 64, 100, 200, 500, 700, 1000, 1023, 1024, 1500, 2000, 2046, 2047, 300],
                      [2047, 1, 64, 65, 129, 9, 999, 1200, 40, 1800, 600, 7, 1111, 222, 333, 444]):
        q = torch.randn(16, 4, 64, generator=generator).to(DEVICE, dtype)
        at = torch.tensor(positions, device=DEVICE)
        outs = []
        for one_launch in (True, False, True):
            out = torch.empty(16, 256, device=DEVICE, dtype=dtype)
            attention(attn, q, at, 1, out, workspace, CONFIG, chunk=64, one_launch=one_launch)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[1])
        assert not workspace.locks.any() and not workspace.stats_arrivals.any()


@torch.inference_mode()
def test_fused_sampling_draws_the_tokens_of_sample_rows():
    """The one-kernel sampling chain against sample_rows, row by row, over settings that exercise
    each rule: greedy, temperature, top-k (off, 1, small, above the vocabulary), top-p, and
    suppressed (-inf) logits; the same noise gives the same token."""
    from pipeline.engine.sampling import RowSampling, exponential_noise, sample_rows
    from pipeline.kernels import fused_sample

    rows, vocab = 7, 200
    generator = torch.Generator().manual_seed(11)
    logits = (3 * torch.randn(rows, vocab, generator=generator)).to(DEVICE)
    logits[:, -40:] = float("-inf")
    settings = RowSampling.zeros(rows, torch.device(DEVICE))
    for row, values in enumerate([(True, 0.9, 50, 1.0), (True, 1.0, 0, 0.8), (False, 1.0, 0, 1.0), (True, 0.7, 5, 0.5),
                                  (True, 1.3, 500, 0.95), (True, 0.9, 1, 1.0), (True, 2.0, 0, 1.0)]):
        settings.set_row(row, *values)
    seeds = torch.arange(rows, device=DEVICE) * 7919 + 1
    for draw in range(3):
        noise = exponential_noise(seeds, torch.full((rows,), draw * vocab, device=DEVICE), vocab)
        expected = sample_rows(logits, settings, noise)
        assert torch.equal(fused_sample(logits, settings, noise, CONFIG), expected)
    assert expected[2] == logits[2].argmax() and expected[5] == logits[5].argmax()  # greedy, and top-k 1


@pytest.mark.parametrize("vocab", [2048, 3072])
@torch.inference_mode()
def test_the_top_k_search_keeps_the_top_k_at_any_scale(vocab):
    """The top-k search starts a few binades below the largest logit and stops once a threshold
    keeps exactly k: at logit scales from 0.01 to 300 (the first round's thresholds below every
    logit, or spread over them), all-negative logits, -inf among them, and ties at the k-th value,
    for k from 1 to just below the vocabulary, the drawn tokens are sample_rows' (its sorted cutoff)."""
    from pipeline.engine.sampling import RowSampling, exponential_noise, sample_rows
    from pipeline.kernels import fused_sample

    tops = [1, 2, 3, 50, 51, 333, vocab - 1]
    generator = torch.Generator().manual_seed(vocab)
    for scale in (0.01, 3.0, 300.0):
        logits = (scale * torch.randn(len(tops), vocab, generator=generator)).bfloat16().float()
        logits[1] = -logits[1].abs() - scale  # every logit negative
        logits[2, ::5] = float("-inf")
        logits[3] = torch.round(logits[3] / scale * 2)  # ties at the k-th value
        settings = RowSampling.zeros(len(tops), torch.device(DEVICE))
        for row, k in enumerate(tops):
            settings.set_row(row, True, 0.9, k, 1.0)
        logits = logits.to(DEVICE)
        for draw in range(2):
            noise = exponential_noise(torch.arange(len(tops), device=DEVICE) + 17, torch.full((len(tops),), draw * vocab, device=DEVICE), vocab)
            assert torch.equal(fused_sample(logits, settings, noise, CONFIG), sample_rows(logits, settings, noise)), (scale, draw)


@torch.inference_mode()
def test_fused_sampling_cutoffs_on_ties_signed_zeros_and_a_full_vocabulary():
    """The kernel finds its top-k and top-p cutoffs by searching the logits' bits, not by sorting:
    on the code predictor's vocabulary (2,048) with logits rounded to a coarse grid (many ties at
    the k-th value, +0.0 and -0.0 among them), top-k just below the vocabulary, and top-p so small
    that only the most likely value is left, it draws what sample_rows draws."""
    from pipeline.engine.sampling import RowSampling, exponential_noise, sample_rows
    from pipeline.kernels import fused_sample

    rows, vocab = 8, 2048
    generator = torch.Generator().manual_seed(5)
    logits = torch.round(4 * torch.randn(rows, vocab, generator=generator)) / 4
    logits[logits == 0] = torch.tensor([0.0, -0.0]).repeat(vocab)[: int((logits == 0).sum())]
    logits[0] = -5.0  # row 0's top-50 cutoff falls among 48 zeros and 60 negative zeros: all 108 kept
    logits[0, :2] = 0.1
    logits[0, 2:50] = 0.0
    logits[0, 50:110] = -0.0
    logits = logits.to(DEVICE)
    settings = RowSampling.zeros(rows, torch.device(DEVICE))
    for row, values in enumerate([(True, 0.9, 50, 1.0), (True, 1.0, vocab - 1, 1.0), (True, 1.0, 0, 1e-6), (True, 0.8, 200, 0.9),
                                  (True, 1.0, 0, 0.3), (True, 1.1, 3, 0.6), (True, 1.0, 1, 1.0), (True, 1.0, 0, 1.0)]):
        settings.set_row(row, *values)
    seeds = torch.arange(rows, device=DEVICE) * 104729 + 3
    drawn = []
    for draw in range(4):
        noise = exponential_noise(seeds, torch.full((rows,), draw * vocab, device=DEVICE), vocab)
        expected = sample_rows(logits, settings, noise)
        got = fused_sample(logits, settings, noise, CONFIG)
        assert torch.equal(got, expected), (draw, got, expected)
        drawn.append(got)
    drawn = torch.stack(drawn)
    for row in (2, 6):  # only the most likely value is left (ties of it all kept, as the reference's value cutoff)
        assert (logits[row, drawn[:, row]] == logits[row].max()).all()
    assert len(set(drawn[:, 7].tolist())) > 1  # top-k off really samples


@pytest.mark.parametrize("flags, fused", [([], False), (["--no-fused-kernels"], False)])
def test_the_app_flag_reaches_the_engine(flags, fused):
    """`--no-fused-kernels` goes from app.py through ModelService to the decode step; without it the
    default applies (fused on CUDA GPUs of compute capability >= 8.0 only: off on this CPU)."""
    pytest.importorskip("gradio")
    import app

    parser = app.build_parser()
    service = app.local_service(parser.parse_args(["--tiny", "--device", "cpu", *flags]), parser)
    assert service.fused is (False if flags else None)
    assert service.model("custom_voice").engine.decoder.fused is fused


def test_a_service_asked_for_the_fused_kernels_gets_them(tiny_checkpoints):
    from pipeline.service import ModelService

    service = ModelService(device="cpu", tiny=True, tiny_dir=tiny_checkpoints["custom_voice"].parent, fused=True)
    assert service.model("custom_voice").engine.decoder.fused


@pytest.fixture(scope="module")
def frame_decoders(tiny_checkpoints) -> tuple[list, list[BatchDecoder]]:
    """The tiny custom-voice talker and its twin, each under a decoder of ROWS rows: the modules' step
    with PyTorch's glue, and the frame in kernels. Built once for the module: the frame decoder projects
    its 33,792 code-table rows at construction, most of a minute in Triton's interpreter."""
    from pipeline.loading import load_model

    model = load_model(tiny_checkpoints["custom_voice"], torch.device(DEVICE), torch.float32)
    talkers = [model.talker, copy.deepcopy(model.talker)]
    pad = torch.randn(model.talker.config.hidden_size, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    decoders = [BatchDecoder(talker, pad, DecodeConfig.for_talker(talker, ROWS, 64, graphs=False, fused=fused, frame_kernels=fused))
                for talker, fused in zip(talkers, (False, True))]
    return talkers, decoders


@torch.inference_mode()
def test_the_frame_in_kernels_equals_the_step_in_pytorch_ops(frame_decoders):
    """The frame with its glue inside the kernels (code draws and embeddings, the talker's input and
    head, the logit processors, the commit of each row's state) against the modules' step with
    PyTorch's glue, frame by frame: the same codes, tokens and state. Row 0 samples and runs out of
    text after one frame (it waits: no frame, its state untouched); row 1 is greedy, its text
    ended (it goes on with tts_pad); row 2 is empty. The fused engine runs each frame over the
    first rows that hold every occupied one (row blocks: 2 of its 3 rows, then 1 once row 1 leaves)."""
    from pipeline.engine.sampling import SamplingConfig

    talkers, decoders = frame_decoders
    hidden = talkers[0].config.hidden_size
    generator = torch.Generator().manual_seed(9)
    prompt, text = (torch.randn(*shape, generator=generator).to(DEVICE) for shape in ((1, 5, hidden), (1, hidden)))
    assert not decoders[0].fused and decoders[1].frame_kernels and decoders[1].block_sizes == [1, 2, ROWS] and decoders[0].block_sizes == [ROWS]
    sampled = SamplingConfig(top_k=20, top_p=0.9)
    for decoder in decoders:
        decoder.start(0, prompt, text, False, sampled, seed=5, max_frames=10)
        decoder.start(1, prompt.flip(1), text, True, sampled.greedy(), seed=6, max_frames=10)
    assert decoders[1].block_size() == 2
    state = ("token", "pos", "frame", "seen", "hidden")
    for frame in range(2):
        (produced, codes, token), (got_produced, got_codes, got_token) = (d.step() for d in decoders)
        assert got_produced.tolist() == produced.tolist() == [frame < 1, True, False]
        assert torch.equal(got_codes[:2], codes[:2]) and torch.equal(got_token[:2], token[:2])
        for name in state:
            torch.testing.assert_close(getattr(decoders[1], name)[:2], getattr(decoders[0], name)[:2], rtol=1e-5, atol=1e-5, msg=name)
        # the code predictor's next first input: the talker's state and the next token's embedding
        assert torch.equal(decoders[1].code_predictor_input[:2, 1], talkers[1].model.codec_embedding(decoders[1].token[:2]))
    assert decoders[1].frame[0] == 1 and decoders[1].frame[2] == 0
    for decoder in decoders:  # row 1 leaves (it reads as not producing); row 0 gets the rest of its text and runs alone
        decoder.stop(1)
        decoder.append_text(0, text, True)
    assert decoders[1].block_size() == 1
    (produced, codes, token), (got_produced, got_codes, got_token) = (d.step() for d in decoders)
    assert got_produced.tolist() == produced.tolist() == [True, False, False]
    assert torch.equal(got_codes[0], codes[0]) and got_token[0] == token[0]
    for name in state:
        torch.testing.assert_close(getattr(decoders[1], name)[0], getattr(decoders[0], name)[0], rtol=1e-5, atol=1e-5, msg=name)


@triton.jit
def _noise_kernel(seed_ptr, start_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + row * V + offs, _exponential_noise(tl.load(seed_ptr + row), tl.load(start_ptr + row), offs), mask=offs < V)


@torch.inference_mode()
def test_the_kernels_draw_the_noise_of_exponential_noise():
    """The sampling kernels compute their Exp(1) noise themselves, in 32-bit arithmetic: the same
    values as exponential_noise's 64-bit tensor ops, also where a row's draw positions wrap past
    2^32 and for seeds near 2^32 (to float32 rounding of the logarithm)."""
    from pipeline.engine.sampling import exponential_noise, mix32

    seeds = mix32(torch.tensor([0, 1, 7, 2**32 - 1])).to(DEVICE)
    starts = torch.tensor([0, 2**32 - 100, 12345 * 32768, 2**31]).to(DEVICE)
    got = torch.empty(4, 300, device=DEVICE)
    _noise_kernel[(4,)](seeds, starts, got, 300, BLOCK=512)
    torch.testing.assert_close(got, exponential_noise(seeds, starts, 300), rtol=1e-6, atol=0)


def wide_predictor_talker(checkpoint) -> "torch.nn.Module":
    """The tiny checkpoint's talker with its code predictor as wide as the talker (the 0.6B's layout:
    no input projection), every weight random."""
    import json

    from pipeline.model import Talker, TalkerConfig

    raw = json.loads((checkpoint / "config.json").read_text())["talker_config"]
    predictor = raw["code_predictor_config"]
    predictor.update(hidden_size=raw["hidden_size"], head_dim=raw["hidden_size"] // predictor["num_attention_heads"])
    torch.manual_seed(3)
    talker = Talker(TalkerConfig.from_dict(raw)).to(DEVICE).eval()
    for name, p in talker.named_parameters():
        p.data.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
    return talker


@torch.inference_mode()
def test_the_projected_code_tables_hold_what_a_step_would_project(frame_decoders, tiny_checkpoints):
    """A code predictor narrower than the talker (the tiny checkpoint's, the 1.7B's layout) takes its
    next inputs from the code tables projected once when the engine is built: each row, bit for bit,
    what projecting that code's embedding alone in the step's matmul kernel gives, with other rows
    beside it or not, in a chunk of the table or alone (the tiny checkpoint's weights are random,
    norm weights away from 1, so a weight read from the wrong layer or step shows). As wide as the
    talker (the 0.6B's), the tables are the code tables themselves.

    On a GPU a row's bits do not depend on where it sits in the kernel's tile of BLOCK_M rows (one
    instruction sequence computes every row), so the row is projected first in a tile, as a
    one-row step puts it. In Triton's interpreter the tile's dot is NumPy's BLAS, whose AVX2
    kernels (OpenBLAS's Haswell and Zen) round a row by its place in the tile (rows 0-5 one way,
    6-15 another): there the row is projected at the place it has in the table's tile, zeros beside it."""
    from pipeline.kernels import fused_linear
    from pipeline.kernels.decode import BLOCK_M

    (_, talker), (_, decoder) = frame_decoders
    project = talker.code_predictor.small_to_mtp_projection
    tables = decoder.code_tables
    assert isinstance(project, torch.nn.Linear) and decoder.next_tables.shape == (tables.shape[0], project.out_features)
    for row in (0, 1, 255, 256, tables.shape[0] // 2, tables.shape[0] - 1):  # either side of a chunk's edge
        place = 0 if DEVICE == "cuda" else row % BLOCK_M  # the table's chunks start on a tile's first row
        alone = torch.zeros(1, place + 1, tables.shape[1], device=DEVICE)
        alone[0, place] = tables[row]
        projected = torch.empty(1, place + 1, project.out_features, device=DEVICE)
        fused_linear(talker.code_predictor.model, project, alone, projected, CONFIG)
        assert torch.equal(decoder.next_tables[row], projected[0, place]), row
    wider = wide_predictor_talker(tiny_checkpoints["custom_voice"])
    pad = torch.zeros(wider.config.hidden_size, device=DEVICE)
    wide = BatchDecoder(wider, pad, DecodeConfig.for_talker(wider, 2, 32, graphs=False, fused=True, frame_kernels=True))
    assert wide.next_tables is wide.code_tables


def test_the_step_profile_charges_each_kernel_what_it_adds_to_the_frame():
    """Overlapped kernels start before the previous one ends: each is charged with how much later
    than every kernel before it it ends (nothing if earlier), by kind, and the charges add up to the
    step's span: not the kernels' own durations, which count the overlap twice."""
    from benchmarks.kernels import charge_in_order

    kernels = [("_linear_kernel_a", 7.0, 14.0), ("_qkv_kernel", 0.0, 6.0), ("_attention_kernel", 3.0, 8.0),
               ("_code_kernel", 13.0, 28.0), ("_linear_kernel_b", 20.0, 27.0), ("_attention_split_kernel", 27.5, 31.0)]
    charged = charge_in_order(kernels)
    assert sum(v["ms"] for v in charged.values()) == pytest.approx(0.031)  # the span, 0 to 31 us
    assert charged["q/k/v + norms + RoPE + cache write"]["ms"] == pytest.approx(0.006)
    assert charged["attention"]["ms"] == pytest.approx(0.002)  # ends 2 us after the q/k/v kernel
    # 14 - 8, then 0: the second ends before the draw that started earlier
    assert charged["projections (o, gate/up, down)"] == {"kernels": 2, "ms": pytest.approx(0.006), "us_each": pytest.approx(3.0)}
    assert charged["talker attention (its cache in chunks)"]["ms"] == pytest.approx(0.003)
    assert sum(k["kernels"] for k in charged.values()) == len(kernels)


def test_the_kernel_benchmark_refuses_fewer_than_one_repeat(capsys):
    from benchmarks.kernels import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--ablation", "--repeats", "0"])
    assert exit_info.value.code == 2
    assert "--repeats must be at least 1, not 0" in capsys.readouterr().err


@pytest.mark.parametrize("kind, k, current", [("qkv", 1024, dict(block_k=128, num_warps=8, num_stages=1, split_k=4)),
                                              ("linear1", 3072, dict(block_n=32, block_k=128, num_stages=2, split_k=8)),
                                              ("linear2", 1024, dict(block_n=32))])
def test_the_step_sweep_tries_one_change_at_a_time_and_only_whole_splits(kind, k, current):
    """The in-step sweep's candidates for a weight shape: each differs from the current tiles in one
    field (or a half-width column block with twice the splits: the same programs), none repeats or
    is the current, each splits K into whole tiles (what the kernels accept), and the q/k/v kernel's
    columns stay a head's."""
    from benchmarks.kernels import step_tile_alternatives
    from pipeline.kernels.decode import Tiles, _check_split

    now = Tiles(**current)
    found = step_tile_alternatives(kind, k, now)
    assert len(found) == len(set(found)) and now not in found and len(found) >= 8
    for t in found:
        _check_split(k, t)  # raises for an uneven split
        changed = {f for f in ("block_n", "block_k", "num_warps", "num_stages", "split_k") if getattr(t, f) != getattr(now, f)}
        assert len(changed) == 1 or (changed == {"block_n", "split_k"} and t.block_n * 2 == now.block_n and t.split_k == 2 * now.split_k)
        assert kind != "qkv" or t.block_n == now.block_n
    assert any(t.split_k != now.split_k for t in found) and any(t.num_stages != now.num_stages for t in found)


def test_the_step_sweep_takes_named_weight_shapes_and_refuses_malformed_ones(capsys):
    """`--shapes` names keys of the tiles table; anything else is a usage error naming the bad value."""
    from benchmarks.kernels import main, weight_shape

    assert weight_shape("linear2,6144,2048") == ("linear2", 6144, 2048)
    assert weight_shape("qkv,4096,1024") == ("qkv", 4096, 1024)
    for bad in ("linear3,1,2", "qkv,4096", "linear1,20x,3"):
        with pytest.raises(SystemExit) as exit_info:
            main(["--step-sweep", "--shapes", bad])
        assert exit_info.value.code == 2
        assert f"{bad!r} is not KIND,N,K" in capsys.readouterr().err
