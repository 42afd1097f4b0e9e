"""Qwen3-Omni end to end on a tiny random model (CPU, fp32, greedy): transformers' thinker writes
the reply; our talker prompt, our batched decode step and our code2wav speak it. Same reply, same
codec codes and the same waveform as `Qwen3OmniMoeForConditionalGeneration.generate`."""
import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

from pipeline.engine.decoder import BatchDecoder
from pipeline.engine.sampling import SamplingConfig
from pipeline.omni import Code2Wav, Code2WavConfig, OmniTalker, OmniTalkerConfig, PromptIds, assistant_part, decode, text_specials, user_part
from pipeline.tiny import randomize_, randomize_code2wav_

IM_START, IM_END, USER, ASSISTANT, SYSTEM, NL = 151644, 151645, 872, 77091, 8948, 198
AUDIO, AUDIO_START, AUDIO_END = 151646, 151669, 151670
MEL_FRAMES, AUDIO_TOKENS = 100, 13  # one second of 128-bin log-mel at 100 Hz -> 13 audio positions
REPLY_TOKENS, TALKER_TOKENS = 12, 30
THINKER = dict(
    text_config=dict(vocab_size=151936, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 1, 1], "interleaved": True}),
    audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=48, output_dim=32, downsample_hidden_size=16),
    vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=32, deepstack_visual_indexes=[0]),
    audio_start_token_id=151669, vision_start_token_id=151652,
)
TALKER = dict(
    text_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3, shared_expert_intermediate_size=24),
    code_predictor_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=8, vocab_size=2048, num_code_groups=16),
    thinker_hidden_size=32, num_code_groups=16, accept_hidden_layer=2, spatial_merge_size=2,
    # The released checkpoint's ids (transformers' class defaults differ).
    codec_eos_token_id=2150, codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157, codec_pad_id=2148,
    codec_bos_id=2149, speaker_id={"chelsie": 2301, "ethan": 2302, "aiden": 2303},
)
CODE2WAV = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, intermediate_size=48, decoder_dim=32,
                sliding_window=16)


@pytest.fixture(scope="module")
def reference() -> Qwen3OmniMoeForConditionalGeneration:
    config = Qwen3OmniMoeConfig(thinker_config=THINKER, talker_config=TALKER, code2wav_config=CODE2WAV, enable_audio_output=True)
    config.code2wav_config._attn_implementation = "eager"
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        randomize_(model, g, buffers=False)  # the rotary tables are buffers; the fused experts start uninitialised
        randomize_code2wav_(model.code2wav, g)  # a vocoder whose activations stay O(1), as in the code2wav tests
    return model


def _conversation(*user_texts: list[int], system: list[int] | None = None, answers: list[list[int]] = ()) -> torch.Tensor:
    ids = [IM_START, SYSTEM, NL, *system, IM_END, NL] if system else []
    for i, text in enumerate(user_texts):
        ids += [IM_START, USER, NL, *text, IM_END, NL]
        if i < len(answers):
            ids += [IM_START, ASSISTANT, NL, *answers[i], IM_END, NL]
    return torch.tensor([ids + [IM_START, ASSISTANT, NL]])


def _audio(seconds_seed: int) -> dict[str, torch.Tensor]:
    features = torch.randn(1, 128, MEL_FRAMES, generator=torch.Generator().manual_seed(seconds_seed))
    return {"input_features": features, "feature_attention_mask": torch.ones(1, MEL_FRAMES, dtype=torch.long)}


def _transformers(model, input_ids: torch.Tensor, speaker: str, media: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    captured = {}
    chunked = model.code2wav.chunked_decode

    def capture(codes, **kwargs):
        captured["codes"] = codes
        return chunked(codes, **kwargs)

    model.code2wav.chunked_decode = capture
    try:
        sequences, wav = model.generate(input_ids, speaker=speaker, thinker_max_new_tokens=REPLY_TOKENS, thinker_do_sample=False,
                                        talker_do_sample=False, talker_max_new_tokens=TALKER_TOKENS, **media)
    finally:
        model.code2wav.chunked_decode = chunked
    return sequences[0, input_ids.shape[1]:], captured["codes"][0].T, wav.reshape(-1)


def _ours(model, input_ids: torch.Tensor, speaker: str, media: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    config = model.config
    talker = OmniTalker(OmniTalkerConfig.from_dict(config.talker_config.to_dict())).eval()
    talker.load_state_dict(model.talker.state_dict(), strict=True)
    code2wav = Code2Wav(Code2WavConfig.from_dict(config.code2wav_config.to_dict())).eval()
    code2wav.load_state_dict(model.code2wav.state_dict(), strict=True)
    ids = PromptIds.from_config(config.to_dict())

    # The thinker (transformers' own): the reply, with its input embeddings and layer-`accept` states.
    result = model.thinker.generate(input_ids, max_new_tokens=REPLY_TOKENS, do_sample=False, eos_token_id=IM_END,
                                    output_hidden_states=True, return_dict_in_generate=True, **media)
    length = input_ids.shape[1]
    reply = result.sequences[0, length:]
    embeds = torch.cat([h[0] for h in result.hidden_states], dim=1)[0]
    hidden = torch.cat([h[config.talker_config.accept_hidden_layer] for h in result.hidden_states], dim=1)[0]

    specials = text_specials(talker, model.thinker.get_input_embeddings(), ids)
    prompt = torch.cat([user_part(talker, input_ids[0], embeds[:length], hidden[:length], ids),
                        assistant_part(talker, embeds[length - 3:length + 1], specials, ids.speaker(speaker), ids)])
    # One text token per frame after the first (in the prompt); the last token made, <|im_end|>, is never fed.
    trailing = torch.cat([talker.text_projection(embeds[length + 1:]), specials[2:3]])
    decoder = BatchDecoder(talker, specials[0], rows=2, max_seq=128, use_cuda_graphs=False, min_new_tokens=0)
    decoder.start(0, prompt[None], trailing, True, SamplingConfig(repetition_penalty=1.05).greedy(), 0, TALKER_TOKENS - 1)
    codes = []
    while True:
        produced, step_codes, token = decoder.step()
        if not produced[0]:
            break
        codes.append(step_codes[0].clone())
    codes = torch.stack(codes)
    return reply, codes, decode(code2wav, codes)


AUDIO_MESSAGE = [AUDIO_START, *[AUDIO] * AUDIO_TOKENS, AUDIO_END, 601, 602]  # the audio first, then the text


@pytest.mark.parametrize("name, input_ids, speaker, media", [
    ("short message", _conversation([101, 102, 103]), "Ethan", {}),
    ("with a system prompt", _conversation([201, 202], system=[301, 302, 303]), "Chelsie", {}),
    ("second turn", _conversation([101, 102, 103], [401, 402], answers=[[501, 502, 503, 504]]), "Aiden", {}),
    ("audio message", _conversation(AUDIO_MESSAGE), "Ethan", _audio(3)),
])
def test_reply_codes_and_waveform_equal_transformers(reference, name, input_ids, speaker, media):
    with torch.no_grad():
        reply, codes, wav = _transformers(reference, input_ids, speaker, media)
        our_reply, our_codes, our_wav = _ours(reference, input_ids, speaker, media)
    assert torch.equal(our_reply, reply) and len(reply) > 3
    assert len(codes) > 5 and len(set(codes[:, 0].tolist())) > 3
    assert torch.equal(our_codes, codes)
    assert our_wav.shape == wav.shape and (our_wav - wav).abs().max() <= 1e-5
