"""The prefill kernels (pipeline.kernels.prefill) against the module's own prefill, run by Triton's
interpreter on CPU (TRITON_INTERPRET=1, set in conftest.py) and by the GPU on CUDA: the same final
states, the same keys and values in the prompt's cache row, and every other row untouched."""
import copy

import pytest
import torch

pytest.importorskip("triton")

from pipeline.kernels import fused_prefill  # noqa: E402
from pipeline.model import Transformer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS, MAX_SEQ = 3, 96
# (absolute, relative): float32 to float rounding; float16 and bfloat16 to a unit or two in the last
# place (sums in another order flip a rounding), where a weight missed or read twice, a position off by
# one or a head swapped is off by the size of a value
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (0.02, 2**-9), torch.bfloat16: (0.05, 2**-6)}


def worst_excess(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> float:
    """How far the largest difference goes past the tolerance at its value (<= 0: within it everywhere)."""
    absolute, relative = TOLERANCE[dtype]
    return ((got.float() - expected.float()).abs() - absolute - relative * expected.float().abs()).max().item()


def random_stack(hidden: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(hidden, 3 * hidden, 2, heads, kv_heads, head_dim, 1e-6, 1e6).to(DEVICE, dtype).eval()
    for name, p in model.named_parameters():
        # Norm weights away from 1 (a missing one shows); matrices scaled by their width, as trained
        # weights are, so activations stay near 1 whatever the width.
        p.data.normal_(1.0, 0.2) if name.endswith("norm.weight") else p.data.normal_(0.0, p.shape[-1] ** -0.5)
    model.setup_caches(ROWS, MAX_SEQ)
    for layer in model.layers:  # something in every row, so a write to the wrong row shows
        layer.self_attn.kv_cache.k.normal_()
        layer.self_attn.kv_cache.v.normal_()
    return model


def caches(model: Transformer) -> torch.Tensor:
    return torch.stack([torch.stack((layer.self_attn.kv_cache.k, layer.self_attn.kv_cache.v)) for layer in model.layers])


@pytest.mark.parametrize("shape, dtype, length", [
    (dict(hidden=64, heads=4, kv_heads=2, head_dim=16), torch.float32, 32),
    (dict(hidden=48, heads=4, kv_heads=1, head_dim=8), torch.float32, 21),  # widths and a length off the tiles: masked tails
    (dict(hidden=32, heads=2, kv_heads=1, head_dim=16), torch.float16, 32),
    pytest.param(dict(hidden=1024, heads=16, kv_heads=8, head_dim=128), torch.bfloat16, 80,  # the 0.6B talker's layer
                 marks=pytest.mark.skipif(DEVICE != "cuda", reason="bfloat16 and the real width: on a GPU")),
])
@torch.inference_mode()
def test_prefill_kernels_equal_the_module_prefill(shape, dtype, length):
    model = random_stack(**shape, dtype=dtype)
    twin = copy.deepcopy(model)
    x = torch.randn(1, length, shape["hidden"], device=DEVICE, dtype=dtype)
    row = torch.tensor([1], device=DEVICE)

    expected = model.prefill(x, row)
    got = fused_prefill(twin, x, row)

    assert got.shape == expected.shape
    states_excess, caches_excess = worst_excess(got, expected, dtype), worst_excess(caches(twin), caches(model), dtype)
    assert states_excess <= 0, f"final states off by {states_excess} past the tolerance"
    assert caches_excess <= 0, f"keys or values off by {caches_excess} past the tolerance"
    # the rows the prompt does not own hold exactly what they held
    others = [0, 2]
    assert torch.equal(caches(twin)[:, :, others], caches(model)[:, :, others])
    assert torch.equal(caches(twin)[:, :, 1, :, length:], caches(model)[:, :, 1, :, length:])
