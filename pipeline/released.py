"""The released checkpoints' structure at their real sizes, without their weights: Qwen3-TTS 0.6B and
1.7B (`real_size_config`) and Qwen3-Omni-30B-A3B (`RELEASED_CONFIG`). The memory table counts their
bytes from these configs; the benchmarks build random-weight models of these shapes."""
from __future__ import annotations

from pipeline.tiny import tiny_config

# The talker's widths that differ between the two Qwen3-TTS sizes.
SIZES = {
    "0.6B": dict(hidden_size=1024, intermediate_size=3072, text_hidden_size=2048),
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, text_hidden_size=2048),
}


def real_size_config(size: str, model_type: str, special_ids: dict[str, int]) -> dict:
    """The structure of the released Qwen3-TTS checkpoint's config.json of `size` and `model_type`: the
    tiny checkpoint's config widened to the real layers, heads, widths and text vocabulary (what
    shapes the modules), with the given special-token ids."""
    config = tiny_config(model_type, special_ids)
    talker = config["talker_config"]
    talker.update(SIZES[size], num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, text_vocab_size=151936)
    talker["rope_scaling"]["mrope_section"] = [24, 20, 20]
    talker["code_predictor_config"].update(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=8, head_dim=128
    )
    config["speaker_encoder_config"] = {"enc_dim": talker["hidden_size"], "sample_rate": 24000}
    return config


# The structure of Qwen/Qwen3-Omni-30B-A3B-Instruct's config.json (what shapes the modules and the prompt).
RELEASED_CONFIG = {
    "thinker_config": {
        "text_config": {"vocab_size": 152064, "hidden_size": 2048, "intermediate_size": 768, "moe_intermediate_size": 768,
                        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                        "num_experts_per_tok": 8, "norm_topk_prob": True, "shared_expert_intermediate_size": 0, "max_position_embeddings": 65536,
                        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000, "mrope_section": [24, 20, 20],
                                                                  "interleaved": True, "mrope_interleaved": True}},
        "audio_config": {"d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120, "output_dim": 2048,
                         "downsample_hidden_size": 480, "num_mel_bins": 128, "n_window": 50, "n_window_infer": 800, "conv_chunksize": 500},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 2048,
                          "deepstack_visual_indexes": [8, 16, 24], "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh"},
        "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656, "audio_start_token_id": 151669,
        "vision_start_token_id": 151652, "position_id_per_seconds": 13, "user_token_id": 872,
    },
    "talker_config": {
        "text_config": {"vocab_size": 3072, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 20, "num_attention_heads": 16,
                        "num_key_value_heads": 2, "head_dim": 128, "moe_intermediate_size": 384, "num_experts": 128, "num_experts_per_tok": 6,
                        "norm_topk_prob": True, "shared_expert_intermediate_size": 768, "rms_norm_eps": 1e-6,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000, "mrope_section": [24, 20, 20], "interleaved": True}},
        "code_predictor_config": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5, "num_attention_heads": 16,
                                  "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 2048, "num_code_groups": 16, "rms_norm_eps": 1e-6,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1000000}},
        "thinker_hidden_size": 2048, "num_code_groups": 16, "accept_hidden_layer": 24, "spatial_merge_size": 2,
        "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656, "audio_start_token_id": 151669,
        "vision_start_token_id": 151652, "position_id_per_seconds": 13,
        "codec_eos_token_id": 2150, "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "codec_pad_id": 2148, "codec_bos_id": 2149, "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
    },
    "code2wav_config": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8, "num_attention_heads": 16,
                        "num_key_value_heads": 16, "decoder_dim": 1536, "sliding_window": 72, "codebook_size": 2048, "num_quantizers": 16,
                        "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "rms_norm_eps": 1e-5, "layer_scale_initial_scale": 0.01,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000}},
    "im_start_token_id": 151644, "im_end_token_id": 151645, "system_token_id": 8948, "user_token_id": 872, "assistant_token_id": 77091,
    "tts_pad_token_id": 151671, "tts_bos_token_id": 151672, "tts_eos_token_id": 151673,
}
