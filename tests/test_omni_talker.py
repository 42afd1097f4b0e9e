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
EOS = 2150


def _hf_config() -> Qwen3OmniMoeTalkerConfig:
    config = Qwen3OmniMoeTalkerConfig(text_config=TEXT, code_predictor_config=PREDICTOR, thinker_hidden_size=40, num_code_groups=16,
                                      spatial_merge_size=2, codec_eos_token_id=EOS)
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
        assert (ours.code_predictor.lm_head[0](got[:, -1]) - reference.code_predictor.lm_head[0](expected[:, -1])).abs().max() <= TOL


def test_a_code_predictor_narrower_than_the_talker_is_refused():
    data = _hf_config().to_dict()
    data["code_predictor_config"]["hidden_size"] = 16
    with pytest.raises(CheckpointError, match="hidden_size must equal"):
        OmniTalkerConfig.from_dict(data)


def _hf_codes(reference, prompt: torch.Tensor, trailing: torch.Tensor, pad: torch.Tensor, frames: int) -> torch.Tensor:
    """transformers' talker loop, greedy (as Qwen3OmniMoeForConditionalGeneration.generate calls it) -> codes [frames, 16]."""
    vocab = reference.config.text_config.vocab_size
    out = reference.generate(
        inputs_embeds=prompt[None], trailing_text_hidden=trailing[None], tts_pad_embed=pad[None, None],
        talker_input_ids=torch.full((1, prompt.shape[0]), 151671), attention_mask=torch.ones(1, prompt.shape[0], dtype=torch.long),
        # N new tokens make N - 1 frames: the last token's residuals are never drawn.
        max_new_tokens=frames + 1, do_sample=False, repetition_penalty=1.05, eos_token_id=EOS,
        suppress_tokens=[i for i in range(vocab - 1024, vocab) if i != EOS], output_hidden_states=True, return_dict_in_generate=True)
    return torch.stack([h[-1] for h in out.hidden_states if h[-1] is not None], dim=1)[0]


def _our_codes(ours, prompt: torch.Tensor, trailing: torch.Tensor, pad: torch.Tensor, frames: int, text_at_once: bool) -> torch.Tensor:
    """Our batched decode step in row 1 of 2, the row's text given at once or one entry per frame (with a wait)."""
    from pipeline.engine.decoder import BatchDecoder, DecodeConfig
    from pipeline.engine.sampling import SamplingConfig

    decoder = BatchDecoder(ours, pad, DecodeConfig.for_talker(ours, rows=2, max_seq=64, graphs=False, min_new_tokens=0))
    fed = len(trailing) if text_at_once else 1
    decoder.start(1, prompt[None], trailing[:fed], text_at_once, SamplingConfig(repetition_penalty=1.05).greedy(), 0, frames)
    codes = []
    while len(codes) < frames:
        produced, step_codes, token = decoder.step()
        if produced[1]:
            codes.append(step_codes[1].clone())
        elif fed < len(trailing):  # the row waited for text: give it the next entry
            decoder.append_text(1, trailing[fed:fed + 1], fed + 1 == len(trailing))
            fed += 1
        if token[1] == EOS:
            break
    return torch.stack(codes)


@pytest.mark.parametrize("text_at_once", [True, False])
def test_greedy_codes_equal_transformers_talker_generate(pair, text_at_once):
    """The talker's loop: prompt, then one text entry per frame (the last one tts_eos), then tts_pad."""
    ours, reference = pair
    g = torch.Generator().manual_seed(5)
    prompt, trailing, pad = torch.randn(12, 32, generator=g), torch.randn(6, 32, generator=g), torch.randn(32, generator=g)
    with torch.no_grad():
        expected = _hf_codes(reference, prompt, trailing, pad, 24)
        got = _our_codes(ours, prompt, trailing, pad, 24, text_at_once)
    assert len(set(expected[:, 0].tolist())) > 3  # a varied codebook 0, not one token repeated
    assert torch.equal(got, expected)
