"""The vocoder's fused residual unit (pipeline.codec.residual) against the module's PyTorch ops, in
Triton's interpreter on CPU (TRITON_INTERPRET=1, conftest.py) and on the GPU under CUDA: the same
output and the same stream state, call after call, for any cut of the stream into calls; and a
whole decoder built on it streams what it decodes offline."""
import pytest
import torch

pytest.importorskip("triton")

from pipeline.codec.decoder import ResidualUnit, SpeechDecoder  # noqa: E402
from pipeline.codec.residual import residual_unit  # noqa: E402
from pipeline.codec.streaming import StreamState, derive_all_, exact_float32_convolutions  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_unit(channels: int, dilation: int) -> ResidualUnit:
    torch.manual_seed(channels + dilation)
    unit = ResidualUnit(channels, dilation)
    with torch.no_grad():
        for name, p in unit.named_parameters():
            # SnakeBeta's alpha/beta away from 0; weights that keep activations near 1, where a wrong tap or channel shows
            p.normal_(0.0, 0.5 if name.endswith(("alpha", "beta")) else 1.5 / (p[0].numel() ** 0.5 if p.dim() > 1 else 1.0))
    derive_all_(unit)
    return unit.to(DEVICE).eval()


def module_path(unit: ResidualUnit, x: torch.Tensor, state: StreamState) -> torch.Tensor:
    with exact_float32_convolutions():  # as SpeechDecoder runs it (PyTorch allows TF32 in cuDNN by default)
        return x + unit.conv2(unit.act2(unit.conv1(unit.act1(x), state)), state)


# channel counts that are not multiples of the kernel's tiles (40) and that are (64), lengths below
# and above the history (6 * dilation) and the time tile
@pytest.mark.parametrize("channels,dilation,cuts", [(40, 1, [5, 1, 37, 3]), (64, 9, [3, 70, 1, 130]), (16, 3, [33, 2])])
def test_fused_unit_equals_the_modules_call_after_call(channels, dilation, cuts):
    unit = random_unit(channels, dilation)
    ours, theirs = StreamState(unit, batch_size=2), StreamState(unit, batch_size=2)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for n in cuts:
            x = torch.randn(2, channels, n, generator=g).to(DEVICE)
            expected = module_path(unit, x, theirs)
            got = residual_unit(unit, x, ours)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ours.flat[torch.float32], theirs.flat[torch.float32], rtol=1e-5, atol=1e-5)


def test_fused_unit_reads_a_strided_input():
    """The unit after a transposed convolution gets a slice of its output (not contiguous)."""
    unit = random_unit(24, 3)
    wide = torch.randn(1, 24, 50, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    x = wide[..., 4:36]
    with torch.inference_mode():
        expected = module_path(unit, x.contiguous(), StreamState(unit))
        got = residual_unit(unit, x, StreamState(unit))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a whole decoder takes minutes in the interpreter")
def test_a_decoder_on_the_fused_units_streams_what_it_decodes_offline(tiny_checkpoints, monkeypatch):
    """The tiny codec decoder, every residual unit in the kernels (the GPU's default): chunked ==
    offline, and offline equal to PyTorch's ops."""
    from pipeline.codec import SpeechTokenizer, decoder as decoder_module

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
    monkeypatch.setattr(decoder_module, "fused_residual_available", lambda x: False)
    torch.testing.assert_close(decode([37]), offline, rtol=0, atol=1e-5)
