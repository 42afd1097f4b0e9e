"""Qwen3-Omni's talker against transformers' `Qwen3OmniMoeTalkerForConditionalGeneration` on a tiny
random config (CPU, fp32): the official parameter names, the talker's hidden states and codebook-0
logits over a prompt, the projections of the thinker's states, and the code predictor."""
import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTalkerConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTalkerForConditionalGeneration

from pipeline.errors import CheckpointError
from pipeline.omni.talker import OmniTalker, OmniTalkerConfig
from pipeline.tiny import randomize_

TEXT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3, shared_expert_intermediate_size=24)
PREDICTOR = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, vocab_size=2048, num_code_groups=16)
TOL = 1e-5


def _hf_config() -> Qwen3OmniMoeTalkerConfig:
    config = Qwen3OmniMoeTalkerConfig(text_config=TEXT, code_predictor_config=PREDICTOR, thinker_hidden_size=40, num_code_groups=16,
                                      spatial_merge_size=2)
    for c in (config, config.text_config, config.code_predictor_config):
        c._attn_implementation = "eager"
    return config


@pytest.fixture(scope="module")
def pair():
    config = _hf_config()
    ours = OmniTalker(OmniTalkerConfig.from_dict(config.to_dict())).eval()
    with torch.no_grad():
        randomize_(ours, torch.Generator().manual_seed(0))
    reference = Qwen3OmniMoeTalkerForConditionalGeneration(config).eval()
    reference.load_state_dict(ours.state_dict(), strict=True)
    ours.model.setup_caches(1, 64)
    ours.code_predictor.model.setup_caches(1, 16)
    return ours, reference


def test_parameter_names_are_the_official_ones(pair):
    ours, reference = pair
    assert set(ours.state_dict()) == set(reference.state_dict())


def test_prompt_hidden_states_and_codebook0_logits_match(pair):
    ours, reference = pair
    x = torch.randn(1, 11, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference.model(inputs_embeds=x).last_hidden_state
        got = ours.model.prefill(x, torch.zeros(1, dtype=torch.long))
        assert expected.abs().mean() > 0.1
        assert (got - expected).abs().max() <= TOL
        assert (ours.codec_head(got) - reference.codec_head(expected)).abs().max() <= TOL


def test_thinker_projections_match(pair):
    ours, reference = pair
    states = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for name in ("text_projection", "hidden_projection"):
            assert (getattr(ours, name)(states) - getattr(reference, name)(states)).abs().max() <= TOL


def test_code_predictor_matches(pair):
    ours, reference = pair
    x = torch.randn(1, 2, 32, generator=torch.Generator().manual_seed(3))  # talker hidden state, codebook-0 embedding
    with torch.no_grad():
        expected = reference.code_predictor.model(inputs_embeds=x).last_hidden_state
        got = ours.code_predictor.model.prefill(x, torch.zeros(1, dtype=torch.long))
        assert (got - expected).abs().max() <= TOL
        assert (ours.code_predictor.logits(got[:, -1], 0) - reference.code_predictor.lm_head[0](expected[:, -1])).abs().max() <= TOL


def test_a_code_predictor_narrower_than_the_talker_is_refused():
    data = _hf_config().to_dict()
    data["code_predictor_config"]["hidden_size"] = 16
    with pytest.raises(CheckpointError, match="hidden_size must equal"):
        OmniTalkerConfig.from_dict(data)
