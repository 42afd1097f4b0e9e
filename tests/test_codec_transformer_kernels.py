"""The codec's sliding-window transformer in Triton kernels (pipeline.codec.transformer_kernels), in
Triton's interpreter on CPU (TRITON_INTERPRET=1, conftest.py) and on the GPU under CUDA, against the
module's PyTorch ops: over a stream cut into calls of 1 to 16 frames, two streams at once that
started at different times, and one offline call longer than a pass, its output is as close to the
float64 evaluation as PyTorch's float32 ops are, its stored history is the PyTorch path's, and a
stream's output does not depend on the streams decoded beside it."""
import copy

import pytest
import torch

pytest.importorskip("triton")

from pipeline.codec import transformer_kernels  # noqa: E402
from pipeline.codec.config import DecoderConfig  # noqa: E402
from pipeline.codec.decoder import DecoderTransformer  # noqa: E402
from pipeline.codec.streaming import StreamState  # noqa: E402
from pipeline.tiny import TINY_SPEECH_TOKENIZER_CONFIG  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UNIT_ROUNDOFF = 2.0**-24
# A stream's calls: every pass size, more frames than the 72-frame window, so the window slides.
CALLS = [16, 1, 2, 4, 8, 16, 16, 3, 16, 1]

CONFIGS = {
    # the tiny checkpoints' decoder: grouped KV heads, head_dim (16) apart from hidden / heads
    "tiny": TINY_SPEECH_TOKENIZER_CONFIG["decoder_config"],
    # the released decoder's head shape (64, as many KV heads as query heads), fewer and narrower layers
    "released heads": {**TINY_SPEECH_TOKENIZER_CONFIG["decoder_config"], "hidden_size": 128, "num_attention_heads": 2,
                       "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 96, "latent_dim": 48, "num_hidden_layers": 2},
}


@pytest.fixture(autouse=True)
def kernels_here():
    """The transformer's dispatch as where its kernels run (on CPU: Triton's interpreter)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformer_kernels, "fused_available", lambda device: True)
        yield


def random_transformer(name: str, projected: bool = True) -> DecoderTransformer:
    """A decoder transformer with weights that make every branch count: layer scales near 1 (the
    checkpoints' 0.01 would hide a wrong attention), norms away from 1."""
    torch.manual_seed(len(name) + projected)
    module = DecoderTransformer(DecoderConfig.from_dict(CONFIGS[name]), projected=projected)
    with torch.no_grad():
        for key, p in module.named_parameters():
            if key.endswith("scale"):
                p.uniform_(0.5, 1.5)
            elif "norm" in key:
                p.uniform_(0.5, 1.5)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            else:
                p.normal_(0.0, 0.1)
        module._derive_()
        for layer in module.layers:
            layer.self_attn._derive_()
            layer.mlp._derive_()
    return module.to(DEVICE).eval()


def run(module: DecoderTransformer, inputs: list[torch.Tensor], fused: bool, restart_second_after: int | None = None) -> tuple[list, StreamState]:
    """The module's outputs over calls of `inputs` [B, T, latent] (the second stream's state zeroed
    after call `restart_second_after`: it starts later than the first) and the final state."""
    state = StreamState(module, batch_size=inputs[0].shape[0])
    outputs = []
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode():
        if not fused:
            patch.setattr(transformer_kernels, "fused_available", lambda device: False)
        for i, x in enumerate(inputs):
            outputs.append(module(x.to(next(module.parameters()).dtype), state))
            if i == restart_second_after:
                for flat in state.flat.values():
                    flat[1].zero_()
    return outputs, state


def stream_inputs(module: DecoderTransformer, streams: int, calls: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = module.config.latent_dim if isinstance(module.input_proj, torch.nn.Linear) else module.config.hidden_size
    return [torch.randn(streams, n, width, generator=g).to(DEVICE) for n in calls]


def assert_as_close_as_pytorch(module: DecoderTransformer, inputs: list[torch.Tensor], **kwargs) -> tuple[StreamState, StreamState]:
    """The kernels' outputs within 8x the error of PyTorch's float32 ops (or 8 units of roundoff of
    the output's size) from the float64 evaluation, call by call; returns both float32 paths' states."""
    fused, fused_state = run(module, inputs, fused=True, **kwargs)
    eager, eager_state = run(module, inputs, fused=False, **kwargs)
    exact, _ = run(copy.deepcopy(module).double(), inputs, fused=False, **kwargs)
    for call, (a, b, ref) in enumerate(zip(fused, eager, exact)):
        assert a.shape == ref.shape and a.dtype == torch.float32
        size = ref.abs().max().item()
        eager_error = (b.double() - ref).abs().max().item()
        fused_error = (a.double() - ref).abs().max().item()
        assert fused_error <= 8 * max(eager_error, UNIT_ROUNDOFF * size), (call, fused_error, eager_error, size)
    return fused_state, eager_state


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_stream_cut_into_calls_decodes_as_pytorchs_ops_do_and_stores_the_same_history(name):
    module = random_transformer(name)
    fused_state, eager_state = assert_as_close_as_pytorch(module, stream_inputs(module, 1, CALLS))
    for layer in module.layers:
        for a, b in zip(fused_state[layer.self_attn], eager_state[layer.self_attn]):
            assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_state[module], eager_state[module]) and fused_state[module].item() == sum(CALLS)


def test_two_streams_that_started_at_different_times_each_see_only_their_own_history():
    """The second stream starts over after the third call: its window must not reach the first stream's
    frames or its own old ones (the mask over the history slots it has filled)."""
    module = random_transformer("tiny")
    fused_state, eager_state = assert_as_close_as_pytorch(module, stream_inputs(module, 2, CALLS), restart_second_after=2)
    assert fused_state[module].tolist() == eager_state[module].tolist() == [sum(CALLS), sum(CALLS[3:])]


def test_an_offline_call_longer_than_a_pass_and_the_unprojected_transformer_of_code2wav():
    """40 frames in one call run as passes of 16, 16 and 8; Qwen3-Omni's code2wav has no projections."""
    for projected in (True, False):
        module = random_transformer("tiny", projected=projected)
        assert_as_close_as_pytorch(module, stream_inputs(module, 1, [40, 1]))


def test_a_streams_output_does_not_depend_on_the_streams_beside_it():
    """The batched vocoder lanes decode several streams in one call: stream 0's output and history are
    bit-identical whatever the other two hold."""
    module = random_transformer("released heads")
    first = stream_inputs(module, 3, [16, 16, 4], seed=1)
    second = [torch.cat([x[:1], torch.randn_like(x[1:]) * 3], dim=0) for x in first]
    (a, a_state), (b, b_state) = run(module, first, fused=True), run(module, second, fused=True)
    for x, y in zip(a, b):
        assert torch.equal(x[0], y[0]) and not torch.equal(x[1], y[1])
    for layer in module.layers:
        for s, t in zip(a_state[layer.self_attn], b_state[layer.self_attn]):
            assert torch.equal(s[0], t[0])
