"""The prefill's routed experts (`pipeline.kernels.grouped_experts`), run by Triton's interpreter on
CPU (TRITON_INTERPRET=1, conftest.py) and by the GPU on CUDA: the same sums as transformers'
experts forward of Qwen3-Omni's thinker, with experts spanning several tiles and experts chosen by
no token; a token's output bit-identical whatever the other tokens are, how many, which experts they
choose and where it sits; inactive rows zero and without effect on the others."""
import pytest
import torch
from transformers.integrations.moe import batched_mm_experts_forward
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextExperts

from pipeline.kernels.grouped_experts import BLOCK_M, grouped_experts, tile_plan
from tests.test_thinker_kernels import DEVICE, EXPERTS, HIDDEN, TOP_K, _experts

TOKENS = BLOCK_M + 16  # every token chooses expert 0 (below): its pairs take two tiles
UNCHOSEN = EXPERTS - 1


def _routing(tokens: int, seed: int, dtype: torch.dtype, all_choose_0: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random tokens, each choosing TOP_K distinct experts (expert 0 among them where `all_choose_0`), never the last one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(DEVICE, dtype)
    if all_choose_0:
        chosen = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(UNCHOSEN - 1, generator=g)[:TOP_K - 1]])
                              for _ in range(tokens)])
    else:
        chosen = torch.stack([torch.randperm(UNCHOSEN, generator=g)[:TOP_K] for _ in range(tokens)])
    chosen = chosen.to(DEVICE)
    weights = torch.rand(tokens, TOP_K, generator=g).softmax(-1).to(DEVICE, dtype)
    return x, chosen, weights


def _dtypes() -> list[torch.dtype]:
    return [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _run(experts: Qwen3OmniMoeThinkerTextExperts, x, chosen, weights, active=None) -> torch.Tensor:
    return grouped_experts(x, chosen, weights, experts.gate_up_proj, experts.down_proj, active)


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_grouped_experts_match_transformers_experts(dtype):
    experts = _experts(dtype)
    x, chosen, weights = _routing(TOKENS, 1, dtype)
    tiles = tile_plan(chosen, None, EXPERTS).tile_end.diff(prepend=torch.zeros(1, device=DEVICE, dtype=torch.long))
    assert tiles[0] == 2 and tiles[UNCHOSEN] == 0
    expected = batched_mm_experts_forward(experts, x, chosen, weights).float()
    ours = _run(experts, x, chosen, weights).float()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(ours, expected, atol=tolerance, rtol=tolerance), (ours - expected).abs().max()
    assert ours.abs().mean() > 0.05


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_a_tokens_output_does_not_depend_on_the_other_tokens(dtype):
    """A token alone, last of many tokens (in expert 0's second tile) that share its experts, and early among
    fewer tokens with other routing: bit-identical."""
    experts = _experts(dtype)
    x, chosen, weights = _routing(TOKENS, 2, dtype)
    token = (x[:1], chosen[:1], weights[:1])
    many = [torch.cat([part[1:], one]) for part, one in zip((x, chosen, weights), token)]
    fewer = list(_routing(23, 3, dtype, all_choose_0=False))
    for part, one in zip(fewer, token):
        part[4] = one[0]
    outputs = [_run(experts, *token)[0], _run(experts, *many)[-1], _run(experts, *fewer)[4]]
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


def test_inactive_rows_are_zero_and_change_nothing():
    experts = _experts(torch.float32)
    x, chosen, weights = _routing(TOKENS, 4, torch.float32)
    active = torch.arange(TOKENS, device=DEVICE) % 3 == 0
    out = _run(experts, x, chosen, weights, active)
    every_row = _run(experts, x, chosen, weights)
    assert torch.equal(out[~active], torch.zeros_like(out[~active]))
    assert torch.equal(out[active], every_row[active]) and bool((out[active].abs().sum(-1) > 0).all())


def test_weights_that_do_not_fit_the_tokens_are_refused():
    experts = _experts(torch.float32)
    x, chosen, weights = _routing(5, 5, torch.float32)
    with pytest.raises(ValueError, match="do not fit tokens of 71"):
        _run(experts, x[:, :71], chosen, weights)
