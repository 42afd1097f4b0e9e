"""The Omni thinker decode step's kernels, run by Triton's interpreter on CPU (TRITON_INTERPRET=1,
conftest.py) and by the GPU on CUDA. Routed experts (`pipeline.kernels.experts`): the same sums as
transformers' experts forward of Qwen3-Omni's thinker, a row's output bit-identical whatever the
other rows hold and choose, inactive rows skipped. Attention of one query per row
(`pipeline.kernels.row_attention`): transformers' eager attention with the step's prefix mask, a
row's output bit-identical whatever the other rows' keys and lengths, and the same on every run.
Attention of a prompt pack (`pack_attention`, tensor cores): each query over its own row's keys up
to its length, as `token_attention` to rounding, a query's output bit-identical whichever queries
share its block of the pack."""
import pytest
import torch
from transformers.integrations.moe import batched_mm_experts_forward
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextExperts, eager_attention_forward

from pipeline.kernels.experts import routed_experts
from pipeline.kernels.row_attention import PACK_BLOCK_QUERIES, decode_attention, pack_attention, token_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Sizes that do not fill the kernels' tiles, so the masked edges are exercised.
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, ROWS = 72, 40, 9, 3, 5


def _experts(dtype: torch.dtype) -> Qwen3OmniMoeThinkerTextExperts:
    config = Qwen3OmniMoeThinkerConfig(text_config=dict(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=EXPERTS,
                                                        num_experts_per_tok=TOP_K)).text_config
    experts = Qwen3OmniMoeThinkerTextExperts(config).to(DEVICE, dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.2)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.2)
    return experts


def _routing(rows: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HIDDEN, generator=g).to(DEVICE, dtype)
    chosen = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(rows)]).to(DEVICE)
    weights = torch.rand(rows, TOP_K, generator=g).softmax(-1).to(DEVICE, dtype)
    return x, chosen, weights


def _dtypes() -> list[torch.dtype]:
    return [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_routed_experts_match_transformers_experts(dtype):
    experts = _experts(dtype)
    x, chosen, weights = _routing(ROWS, 1, dtype)
    expected = batched_mm_experts_forward(experts, x, chosen, weights).float()
    ours = routed_experts(x, chosen, weights, experts.gate_up_proj, experts.down_proj).float()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(ours, expected, atol=tolerance, rtol=tolerance), (ours - expected).abs().max()
    assert ours.abs().mean() > 0.05


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_a_rows_output_does_not_depend_on_the_other_rows(dtype):
    """Row 2 alone among idle rows, and beside rows with other inputs and experts (some sharing its own): bit-identical."""
    experts = _experts(dtype)
    x, chosen, weights = _routing(ROWS, 2, dtype)
    others_x, others_chosen, others_weights = _routing(ROWS, 3, dtype)
    others_chosen[0] = chosen[2]  # a neighbour with the same experts
    others_x[2], others_chosen[2], others_weights[2] = x[2], chosen[2], weights[2]
    alone = torch.zeros(ROWS, dtype=torch.bool, device=DEVICE)
    alone[2] = True
    outputs = [routed_experts(*batch, experts.gate_up_proj, experts.down_proj, active) for batch, active in
               [((x, chosen, weights), None), ((others_x, others_chosen, others_weights), None), ((x, chosen, weights), alone)]]
    assert torch.equal(outputs[0][2], outputs[1][2]) and torch.equal(outputs[0][2], outputs[2][2])
    assert not torch.equal(outputs[0][0], outputs[1][0])


def test_inactive_rows_are_zero():
    experts = _experts(torch.float32)
    x, chosen, weights = _routing(ROWS, 4, torch.float32)
    active = torch.tensor([True, False, True, False, False], device=DEVICE)
    out = routed_experts(x, chosen, weights, experts.gate_up_proj, experts.down_proj, active)
    assert torch.equal(out[~active], torch.zeros_like(out[~active])) and bool((out[active].abs().sum(-1) > 0).all())


def test_weights_that_do_not_fit_the_tokens_are_refused():
    experts = _experts(torch.float32)
    x, chosen, weights = _routing(ROWS, 5, torch.float32)
    with pytest.raises(ValueError, match="do not fit tokens of 71"):
        routed_experts(x[:, :71], chosen, weights, experts.gate_up_proj, experts.down_proj)


HEADS, KV_HEADS, HEAD_DIM, MAX_KEYS = 6, 2, 24, 150  # head_dim not a power of two, keys not a multiple of the kernel's block


class _Grouped(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS


def _attention_inputs(lengths: list[int], seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    query = torch.randn(rows, HEADS, 1, HEAD_DIM, generator=g).to(DEVICE, dtype)
    key = torch.randn(rows, KV_HEADS, MAX_KEYS, HEAD_DIM, generator=g).to(DEVICE, dtype)
    value = torch.randn(rows, KV_HEADS, MAX_KEYS, HEAD_DIM, generator=g).to(DEVICE, dtype)
    return query, key, value, torch.tensor(lengths, device=DEVICE)


def _prefix_mask(lengths: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The thinker step's additive mask: 0 on each row's first lengths[b] keys, the dtype's minimum after."""
    keys = torch.arange(MAX_KEYS, device=DEVICE)
    return torch.where(keys[None] < lengths[:, None], 0.0, torch.finfo(dtype).min).to(dtype)[:, None, None]


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_decode_attention_matches_eager_attention(dtype):
    query, key, value, lengths = _attention_inputs([1, 63, 64, 65, 150], 6, dtype)
    expected, _ = eager_attention_forward(_Grouped(), query, key, value, _prefix_mask(lengths, dtype), scaling=HEAD_DIM ** -0.5)
    ours = decode_attention(query, key, value, lengths, HEAD_DIM ** -0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert ours.shape == expected.shape == (5, 1, HEADS, HEAD_DIM)
    assert torch.allclose(ours.float(), expected.float(), atol=tolerance, rtol=tolerance), (ours.float() - expected.float()).abs().max()


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_decode_attention_row_does_not_depend_on_other_rows_or_keys_past_its_length(dtype):
    query, key, value, lengths = _attention_inputs([100, 7, 150], 7, dtype)
    other_query, other_key, other_value, _ = _attention_inputs([100, 7, 150], 8, dtype)
    other_query[0], other_key[0, :, :100], other_value[0, :, :100] = query[0], key[0, :, :100], value[0, :, :100]  # row 0's own keys kept
    first = decode_attention(query, key, value, lengths, 0.2)
    beside = decode_attention(other_query, other_key, other_value, torch.tensor([100, 150, 1], device=DEVICE), 0.2)
    again = decode_attention(query, key, value, lengths, 0.2)
    assert torch.equal(first[0], beside[0]) and torch.equal(first, again)
    assert not torch.equal(first[1], beside[1])


def test_decode_attention_refuses_more_than_one_query_position():
    query, key, value, lengths = _attention_inputs([3, 3], 9, torch.float32)
    with pytest.raises(ValueError, match="one query position per row"):
        decode_attention(query.expand(-1, -1, 2, -1), key, value, lengths, 0.2)


def _pack_inputs(rows_of: list[int], lengths: list[int], seed: int, dtype: torch.dtype, cache_rows: int = 3):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(len(rows_of), HEADS, HEAD_DIM, generator=g).to(DEVICE, dtype)
    key = torch.randn(cache_rows, KV_HEADS, MAX_KEYS, HEAD_DIM, generator=g).to(DEVICE, dtype)
    value = torch.randn(cache_rows, KV_HEADS, MAX_KEYS, HEAD_DIM, generator=g).to(DEVICE, dtype)
    return query, key, value, torch.tensor(rows_of, device=DEVICE), torch.tensor(lengths, device=DEVICE)


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_pack_attention_matches_eager_attention_over_each_querys_row(dtype):
    """Queries of three rows in one block and across blocks (a prompt's positions, then another's), lengths
    over one, two and three blocks of keys."""
    rows_of = [2] * 5 + [0] * 40 + [1] * 3
    lengths = list(range(96, 101)) + list(range(1, 41)) + [150, 64, 65]
    query, key, value, rows, lengths = _pack_inputs(rows_of, lengths, 10, dtype)
    expected, _ = eager_attention_forward(_Grouped(), query[:, :, None], key[rows], value[rows], _prefix_mask(lengths, dtype),
                                          scaling=HEAD_DIM ** -0.5)
    ours = pack_attention(query, key, value, rows, lengths, HEAD_DIM ** -0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert ours.shape == (len(rows_of), HEADS, HEAD_DIM) and expected.shape == (len(rows_of), 1, HEADS, HEAD_DIM)
    assert torch.allclose(ours.float(), expected[:, 0].float(), atol=tolerance, rtol=tolerance), (ours.float() - expected[:, 0].float()).abs().max()
    assert torch.allclose(ours.float(), token_attention(query, key, value, rows, lengths, HEAD_DIM ** -0.5).float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
def test_a_pack_querys_output_does_not_depend_on_the_queries_beside_it(dtype):
    """Query 0 (row 1, 70 keys) alone, first of a block of other rows' queries with longer lengths, and
    last of a block: bit-identical, and the same on every run."""
    query, key, value, rows, lengths = _pack_inputs([1], [70], 11, dtype)
    others, _, _, other_rows, other_lengths = _pack_inputs([0, 2, 1, 0] * 10, [150, 3, 120, 99] * 10, 12, dtype)
    alone = pack_attention(query, key, value, rows, lengths, 0.2)
    first = pack_attention(torch.cat([query, others]), key, value, torch.cat([rows, other_rows]), torch.cat([lengths, other_lengths]), 0.2)
    place = PACK_BLOCK_QUERIES - 1
    last = pack_attention(torch.cat([others[:place], query, others[place:]]), key, value, torch.cat([other_rows[:place], rows, other_rows[place:]]),
                          torch.cat([other_lengths[:place], lengths, other_lengths[place:]]), 0.2)
    assert torch.equal(alone[0], first[0]) and torch.equal(alone[0], last[place])
    assert torch.equal(first, pack_attention(torch.cat([query, others]), key, value, torch.cat([rows, other_rows]),
                                             torch.cat([lengths, other_lengths]), 0.2))
