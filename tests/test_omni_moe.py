"""The talker's sparse MoE step against transformers' `Qwen3OmniMoeTalkerTextSparseMoeBlock` (CPU, fp32):
same output, loads the released checkpoint's per-expert tensors, and a token's output does not
depend on the other tokens of the batch."""
import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTalkerTextConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTalkerTextSparseMoeBlock

from pipeline.omni.moe import GATHER_TOKENS, SparseMoeBlock
from pipeline.tiny import randomize_

TINY = dict(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3, shared_expert_intermediate_size=24)


def _blocks(norm_topk_prob: bool):
    config = Qwen3OmniMoeTalkerTextConfig(**TINY, norm_topk_prob=norm_topk_prob)
    reference = Qwen3OmniMoeTalkerTextSparseMoeBlock(config).eval()
    with torch.no_grad():
        randomize_(reference, torch.Generator().manual_seed(0))
    ours = SparseMoeBlock(32, 16, 8, 3, 24, norm_topk_prob).eval()
    return ours, reference


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The released checkpoint's layout: one tensor per expert and projection."""
    out = {k: v for k, v in state.items() if not k.startswith("experts.")}
    gate_up, down = state["experts.gate_up_proj"], state["experts.down_proj"]
    for e in range(gate_up.shape[0]):
        out[f"experts.{e}.gate_proj.weight"], out[f"experts.{e}.up_proj.weight"] = gate_up[e].chunk(2)
        out[f"experts.{e}.down_proj.weight"] = down[e]
    return out


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("shape", [(2, 7), (1, 3 * GATHER_TOKENS + 5)], ids=["decode rows", "a prompt in pieces"])
def test_moe_matches_transformers(norm_topk_prob, shape):
    ours, reference = _blocks(norm_topk_prob)
    ours.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(*shape, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(x)
        got = ours(x)
    assert expected.abs().mean() > 0.05
    assert (got - expected).abs().max() <= 1e-6


def test_moe_loads_the_released_per_expert_layout():
    ours, reference = _blocks(False)
    ours.load_state_dict(_per_expert(reference.state_dict()), strict=True)
    assert torch.equal(ours.experts.gate_up_proj, reference.experts.gate_up_proj)
    assert torch.equal(ours.experts.down_proj, reference.experts.down_proj)
    missing = _per_expert(reference.state_dict())
    del missing["experts.5.up_proj.weight"]
    with pytest.raises(RuntimeError, match="experts"):
        SparseMoeBlock(32, 16, 8, 3, 24, False).load_state_dict(missing, strict=True)


def test_a_tokens_output_does_not_depend_on_its_neighbours():
    ours, reference = _blocks(False)
    ours.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        together = ours(x)
        others = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
        others[5] = x[5]
        assert torch.equal(ours(others)[5], together[5])
