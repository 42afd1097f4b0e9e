"""The vocoder's fused convolutions (pipeline.codec.convolution) against the modules' PyTorch ops, in
Triton's interpreter on CPU (TRITON_INTERPRET=1, conftest.py) and on the GPU under CUDA: the same
output and the same stream state, call after call, for any cut of the stream into calls, for the
residual unit, the plain causal convolutions and the transposed ones; and a whole decoder built on
them streams what it decodes offline."""
import contextlib
import copy

import pytest
import torch

pytest.importorskip("triton")

from pipeline.codec import convolution  # noqa: E402
from pipeline.codec.convolution import residual_unit  # noqa: E402
from pipeline.codec.decoder import ResidualUnit, SpeechDecoder  # noqa: E402
from pipeline.codec.streaming import CausalConv1d, CausalConvTranspose1d, LookaheadConvTranspose1d, StreamState, derive_all_, exact_float32_convolutions  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def kernels(on: bool):
    """The layers' dispatch as where the fused kernels run (on: Triton's interpreter on CPU) or as where they do not."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(convolution, "fused_available", lambda device: on)
        yield


def with_kernels(module: torch.nn.Module) -> torch.nn.Module:
    """`module` as loaded where the fused kernels run: its dense convolutions' weights tap-major."""
    with kernels(True):
        derive_all_(module)
    return module


def random_unit(channels: int, dilation: int) -> ResidualUnit:
    torch.manual_seed(channels + dilation)
    unit = ResidualUnit(channels, dilation)
    with torch.no_grad():
        for name, p in unit.named_parameters():
            # SnakeBeta's alpha/beta away from 0; weights that keep activations near 1, where a wrong tap or channel shows
            p.normal_(0.0, 0.5 if name.endswith(("alpha", "beta")) else 1.5 / (p[0].numel() ** 0.5 if p.dim() > 1 else 1.0))
    return with_kernels(unit.to(DEVICE).eval())


def module_path(unit: ResidualUnit, x: torch.Tensor, state: StreamState) -> tuple[torch.Tensor, torch.Tensor]:
    """The unit's output and conv1's output (the input of the second SnakeBeta), in PyTorch's ops."""
    with kernels(False), exact_float32_convolutions():  # as SpeechDecoder runs it (PyTorch allows TF32 in cuDNN by default)
        hidden = unit.conv1(unit.act1(x), state)
        return x + unit.conv2(unit.act2(hidden), state), hidden


# ---- how far two float32 evaluations of the unit may be apart -----------------------------------
# The kernels and PyTorch's ops sum the same products in different orders (Triton's dots in tiles of
# 32 input channels, NumPy's BLAS in the interpreter; oneDNN or cuDNN for the module), so neither is
# the exact result and their bits differ by machine and library (AVX2 and AVX-512 builds of the same
# wheels differ). The tolerance is derived from the roundings each evaluation makes:
#
# - each rounding of a value v errs by delta * v, |delta| <= u (float32's unit roundoff), and a sum of
#   n products rounds each of its n partial sums, none larger than the sum of the terms' magnitudes m:
#   worst case (n - 1) u m (Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.5);
# - the deltas are independent with mean zero (Higham and Mary, "A new approach to probabilistic
#   rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019): the output's error, a sum of the
#   deltas times coefficients c_j, exceeds LAMBDA * u * sqrt(sum c_j^2) with probability at most
#   2 exp(-LAMBDA^2 / 2) (Hoeffding) -- 2.5e-14 an element at LAMBDA = 8, for the ~10^5 elements
#   this file checks. The worst case sums |c_j| instead: ~100 times wider here, too wide to tell a
#   wrong tap (~0.1) from rounding.
#
# Two evaluations, each within that of the exact result, are at most twice it apart.
UNIT_ROUNDOFF = 2.0**-24  # float32, round to nearest
LAMBDA = 8.0
# What one product-and-add costs, in squared units of u: one rounding of the sum on a CPU (an FMA's
# product is exact). On a GPU, the tensor cores may truncate the sum (2u), and 3xTF32 splits each
# operand into a TF32 part and a TF32 remainder that keeps all but 2^-22 of it and drops the
# remainders' product: three errors of 2^-22 = 4u each in the product, 12u at most.
TERM_VARIANCE = 2.0**2 + 12.0**2 if DEVICE == "cuda" else 1.0
# snake(v) = v + b sin^2(a v) rounds a*v (moving sin^2, whose slope is at most 1, by |a v| u), the
# sine (within 2 ulp; CUDA's approximate sine within 2^-20.9 absolute), the square, the product and
# the sum: at most 16 roundings' worth of u relative to |v| + b (1 + |a v|).
SNAKE_ROUNDINGS = 16


def snake_magnitude(snake, v: torch.Tensor) -> torch.Tensor:
    """|v| + b (1 + |a v|): what SnakeBeta's roundings are relative to."""
    return v.abs() + snake.inv_beta.abs() * (1 + (v * snake.alpha_exp).abs())


def magnitude_unit(unit: ResidualUnit) -> ResidualUnit:
    """The unit with |weights| and |biases| in float64: its first convolution sums the magnitudes of
    the products (and the bias) that the unit's sums, over the same taps and stream history."""
    magnitudes = copy.deepcopy(unit).double()
    with torch.no_grad():
        for conv in (magnitudes.conv1.conv, magnitudes.conv2.conv):
            conv.weight.abs_()
            conv.bias.abs_()
    return magnitudes


def unit_tolerance(unit: ResidualUnit, magnitudes: ResidualUnit, x: torch.Tensor, hidden: torch.Tensor,
                   state: StreamState) -> torch.Tensor:
    """Per output sample, how far two float32 evaluations of `unit` on x may be apart, given conv1's
    output `hidden` and the magnitudes' stream state (the first SnakeBeta's input magnitudes of the
    calls before, kept as the unit keeps its history). The coefficients c_j of each rounding, to first order:

    - conv1, output channel i: 7 taps x C channels + the bias, each partial sum within its
      magnitude m1_i, and the first SnakeBeta's roundings of every input (SNAKE_ROUNDINGS, bounded
      the same way), passed on through the second SnakeBeta's slope s_i <= 1 + a_i b_i and conv2's
      weight w_oi: coefficients w_oi s_i m1_i;
    - the second SnakeBeta's roundings: w_oi (|h_i| + b_i (1 + |a_i h_i|));
    - conv2's C products + the bias: its magnitude m2 = sum_i |w_oi z_i| + |b_o|; the residual add: |x| + m2."""
    x, hidden = x.double(), hidden.double()
    channels = x.shape[1]
    act2 = unit.act2
    conv1_sizes = magnitudes.conv1(snake_magnitude(unit.act1, x), state)  # m1 [B, C, T]
    slope = 1 + (act2.alpha_exp * act2.inv_beta).abs()
    weights, bias = magnitudes.conv2.conv.weight[..., 0], magnitudes.conv2.conv.bias[:, None]  # |w|, |b| of the 1x1 convolution
    conv2_sizes = weights @ magnitudes.act2(hidden).abs() + bias  # m2
    variance = ((TERM_VARIANCE * (7 * channels + 1) + SNAKE_ROUNDINGS) * (weights**2 @ (slope * conv1_sizes) ** 2)
                + SNAKE_ROUNDINGS * (weights**2 @ snake_magnitude(act2, hidden) ** 2)
                + TERM_VARIANCE * (channels + 1) * conv2_sizes**2 + (x.abs() + conv2_sizes) ** 2)
    return 2 * LAMBDA * UNIT_ROUNDOFF * variance.sqrt()


def history_tolerance(sizes: torch.Tensor) -> torch.Tensor:
    """The stored history is the first SnakeBeta's output: its roundings alone, relative to `sizes`."""
    return 2 * LAMBDA * UNIT_ROUNDOFF * SNAKE_ROUNDINGS**0.5 * sizes


def assert_within(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    apart = (got.double() - expected.double()).abs()
    assert (apart <= bound).all(), f"apart by up to {(apart / bound).nan_to_num(posinf=float('inf')).max().item():.3g} times the rounding tolerance"


# channel counts that are not multiples of the kernel's tiles (40) and that are (64), lengths below
# and above the history (6 * dilation) and the time tile
@pytest.mark.parametrize("channels,dilation,cuts", [(40, 1, [5, 1, 37, 3]), (64, 9, [3, 70, 1, 130]), (16, 3, [33, 2])])
def test_fused_unit_equals_the_modules_call_after_call(channels, dilation, cuts):
    unit = random_unit(channels, dilation)
    magnitudes = magnitude_unit(unit)
    ours, theirs, sizes = (StreamState(u, batch_size=2) for u in (unit, unit, magnitudes))
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for n in cuts:
            x = torch.randn(2, channels, n, generator=g).to(DEVICE)
            expected, hidden = module_path(unit, x, theirs)
            got = residual_unit(unit, x, ours)
            assert_within(got, expected, unit_tolerance(unit, magnitudes, x, hidden, sizes))
            assert_within(ours.flat[torch.float32], theirs.flat[torch.float32], history_tolerance(sizes.flat[torch.float64]))


def test_fused_unit_reads_a_strided_input():
    """The unit after a transposed convolution gets a slice of its output (not contiguous)."""
    unit = random_unit(24, 3)
    magnitudes = magnitude_unit(unit)
    wide = torch.randn(1, 24, 50, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    x = wide[..., 4:36]
    with torch.inference_mode():
        expected, hidden = module_path(unit, x.contiguous(), StreamState(unit))
        got = residual_unit(unit, x, StreamState(unit))
        assert_within(got, expected, unit_tolerance(unit, magnitudes, x, hidden, StreamState(magnitudes)))


def test_fused_unit_reads_a_channels_last_input():
    """The fused layers hand each other [B, C, T] views of channels-last buffers."""
    unit = random_unit(40, 1)
    magnitudes = magnitude_unit(unit)
    x = torch.randn(2, 45, 40, generator=torch.Generator().manual_seed(4)).to(DEVICE).transpose(1, 2)
    with torch.inference_mode():
        expected, hidden = module_path(unit, x.contiguous(), StreamState(unit, batch_size=2))
        got = residual_unit(unit, x, StreamState(unit, batch_size=2))
        assert_within(got, expected, unit_tolerance(unit, magnitudes, x, hidden, StreamState(magnitudes, batch_size=2)))


def random_layer(layer: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 1.0 / (p[0].numel() ** 0.5 if p.dim() > 1 else 1.0))
    return with_kernels(layer.to(DEVICE).eval())


def magnitude_layer(layer: torch.nn.Module) -> torch.nn.Module:
    """`layer` with |weight| and |bias| in float64: on |x| it sums the magnitudes of the products (and
    the bias) that the layer sums, over the same stream history."""
    magnitudes = copy.deepcopy(layer).double()
    with torch.no_grad():
        magnitudes.conv.weight.abs_()
        magnitudes.conv.bias.abs_()
    return magnitudes


def conv_tolerance(sums: int, sizes: torch.Tensor) -> torch.Tensor:
    """How far two float32 evaluations of sums of `sums` products and a bias, of magnitudes `sizes`, may be apart."""
    return 2 * LAMBDA * UNIT_ROUNDOFF * (TERM_VARIANCE * (sums + 1)) ** 0.5 * sizes


def layer_call(layer: torch.nn.Module, x: torch.Tensor, state: StreamState, fused: bool) -> torch.Tensor:
    """The layer's own forward, in the kernels or in PyTorch's ops (each path's dispatch as the decoder runs it)."""
    with kernels(fused), exact_float32_convolutions():
        return layer(x, state)


# the vocoder's kinds: its first convolution (7 taps), the last (one output channel), a 1-tap one,
# the decoder blocks' transposed convolutions (kernel 2 x stride) and the upsampling ones (kernel = stride),
# and Qwen3-Omni's look-ahead ones, whose first call is shorter
@pytest.mark.parametrize("make,taps", [
    (lambda: CausalConv1d(40, 24, 7), 7), (lambda: CausalConv1d(16, 1, 7), 7), (lambda: CausalConv1d(24, 40, 1), 1),
    (lambda: CausalConv1d(24, 40, 3, dilation=2), 3), (lambda: CausalConvTranspose1d(40, 24, 10, 5), 2),
    (lambda: CausalConvTranspose1d(24, 16, 2, 2), 1), (lambda: CausalConvTranspose1d(16, 24, 7, 3), 3),
    (lambda: LookaheadConvTranspose1d(40, 24, 10, 5), 2), (lambda: LookaheadConvTranspose1d(24, 16, 7, 4), 2),
    (lambda: LookaheadConvTranspose1d(24, 16, 2, 2), 1)])
def test_fused_convolution_equals_the_modules_call_after_call(make, taps):
    layer = random_layer(make(), taps)
    magnitudes = magnitude_layer(layer)
    ours, theirs, sizes = (StreamState(m, batch_size=2) for m in (layer, layer, magnitudes))
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for i, n in enumerate([5, 1, 70, 3]):
            x = torch.randn(2, layer.conv.in_channels, n, generator=g).to(DEVICE)
            x = x.transpose(1, 2).contiguous().transpose(1, 2) if i % 2 else x  # both layouts the layers pass on
            expected = layer_call(layer, x, theirs, False)
            got = layer_call(layer, x, ours, True)
            bound = conv_tolerance(taps * layer.conv.in_channels, layer_call(magnitudes, x.double().abs(), sizes, False))
            assert got.shape == expected.shape
            assert_within(got, expected, bound)
            for dtype, stored in theirs.flat.items():  # the stored inputs (none for a 1-tap convolution)
                torch.testing.assert_close(ours.flat[dtype], stored, rtol=0, atol=0)
            for state in (ours, theirs, sizes):
                state.started = True  # as the decoders mark it after a stream's first call


@pytest.mark.parametrize("make", [lambda: CausalConv1d(3, 2, 7), lambda: CausalConvTranspose1d(3, 2, 6, 3)])
def test_the_weights_are_held_once_tap_major_where_the_kernels_run(make):
    """Where the kernels run the checkpoint's parameter is a view of the tap-major weight (one copy,
    each kernel tap once); where they do not, it is plain and the layer has no taps; a move redoes it."""
    layer = make()
    with torch.no_grad():
        layer.conv.weight.copy_(torch.arange(1, layer.conv.weight.numel() + 1, dtype=torch.float32).view(layer.conv.weight.shape))
    expected = layer.conv.weight.detach().clone()
    with_kernels(layer)
    assert layer.taps.untyped_storage().data_ptr() == layer.conv.weight.untyped_storage().data_ptr()
    assert sorted(layer.taps.flatten().tolist()) == list(range(1, layer.conv.weight.numel() + 1))
    assert torch.equal(layer.conv.weight, expected)
    with kernels(False):
        layer.double()
    assert layer.taps is None and layer.conv.weight.is_contiguous()
    assert torch.equal(layer.conv.weight, expected.double())


def test_a_small_decoder_on_the_kernels_streams_what_it_decodes_offline(tmp_path):
    """A small variant of the tiny codec (two upsampling blocks, so that Triton's interpreter takes
    seconds), loaded by the real loader as where the kernels run: every dense convolution in the
    kernels, chunked == offline, and offline equal to PyTorch's ops."""
    from pipeline.codec import SpeechTokenizer
    from pipeline.tiny import TINY_SPEECH_TOKENIZER_CONFIG, write_tiny_speech_tokenizer

    config = copy.deepcopy(TINY_SPEECH_TOKENIZER_CONFIG)
    config["decoder_config"].update(upsample_rates=[2, 3], decoder_dim=32, num_hidden_layers=1)
    config["decode_upsample_rate"] = 2 * 2 * 2 * 3  # the upsampling ratios (2, 2) and the rates
    write_tiny_speech_tokenizer(tmp_path, seed=0, config=config)
    with kernels(True):
        decoder: SpeechDecoder = SpeechTokenizer.from_pretrained(tmp_path, device=DEVICE).decoder
    fused = [m for m in decoder.modules() if getattr(m, "taps", None) is not None]
    # the pre-conv, two upsampling transposed convs, the first conv, per block a transposed conv and 3 units of 2, the last conv
    assert len(fused) == 1 + 2 + 1 + 2 * (1 + 3 * 2) + 1
    codes = torch.randint(0, decoder.config.codebook_size, (1, 11, decoder.config.num_quantizers),
                          generator=torch.Generator().manual_seed(3)).to(DEVICE)

    def decode(chunks: list[int], on: bool) -> torch.Tensor:
        state, out, done = StreamState(decoder), [], 0
        with kernels(on), torch.inference_mode():
            for n in chunks:
                out.append(decoder(codes[:, done:done + n], state)[0, 0])
                done += n
        return torch.cat(out)

    offline = decode([11], True)
    torch.testing.assert_close(decode([1, 2, 8], True), offline, rtol=0, atol=1e-5)
    torch.testing.assert_close(decode([11], False), offline, rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a whole decoder takes minutes in the interpreter")
def test_a_decoder_on_the_fused_units_streams_what_it_decodes_offline(tiny_checkpoints, monkeypatch):
    """The tiny codec decoder, every convolution but the depthwise ones in the kernels (the GPU's
    default): chunked == offline, and offline equal to PyTorch's ops."""
    from pipeline.codec import SpeechTokenizer

    tokenizer = SpeechTokenizer.from_pretrained(tiny_checkpoints["base"] / "speech_tokenizer", device=DEVICE)
    decoder: SpeechDecoder = tokenizer.decoder
    codes = torch.randint(0, decoder.config.codebook_size, (1, 37, decoder.config.num_quantizers),
                          generator=torch.Generator().manual_seed(3)).to(DEVICE)

    def decode(chunks: list[int]) -> torch.Tensor:
        state, out, done = StreamState(decoder), [], 0
        with torch.inference_mode():
            for n in chunks:
                out.append(decoder(codes[:, done:done + n], state)[0, 0])
                done += n
        return torch.cat(out)

    offline = decode([37])
    torch.testing.assert_close(decode([1, 2, 4, 8, 16, 6]), offline, rtol=0, atol=1e-5)
    monkeypatch.setattr(convolution, "fused_available", lambda device: False)
    torch.testing.assert_close(decode([37]), offline, rtol=0, atol=1e-5)
