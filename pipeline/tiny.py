"""Tiny random-weight checkpoints in the official layout, for tests and the app's offline mode."""
import itertools
import json
import math
from pathlib import Path

import torch
from torch import nn

from pipeline.codec import SpeechTokenizer, SpeechTokenizerConfig
from pipeline.codec.decoder import DecoderCodebook, ResidualUnit
from pipeline.codec.encoder import MimiCodebook
from pipeline.codec.streaming import derive_all_

NORM_WEIGHT_KEYS = ("norm", "layer_scale", "scale")


@torch.no_grad()
def randomize_(module: nn.Module, generator: torch.Generator, buffers: bool = True) -> None:
    """Give every tensor of `module` (its parameters only, without `buffers`) a seeded, non-trivial value
    (drawn on the generator's device: a CUDA generator fills a real-size model in seconds).

    Default initialisation hides bugs: norm gains of exactly 1 make a missing norm invisible and
    zero biases make a dropped bias invisible. Weights get ~1/sqrt(fan_in) scale so activations
    stay O(1) through deep stacks; 1-D parameters get values around their typical magnitude.
    """
    for name, tensor in list(module.named_parameters()) + (list(module.named_buffers()) if buffers else []):
        if not tensor.is_floating_point():
            continue
        leaf = name.rsplit(".", 1)[-1]
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32, device=generator.device)
        if "running_var" in leaf:
            value = 0.5 + noise.abs()
        elif "running_mean" in leaf:
            value = 0.1 * noise
        elif tensor.dim() == 1 and leaf == "weight" or any(k in name for k in NORM_WEIGHT_KEYS) and tensor.dim() == 1:
            value = 1.0 + 0.2 * noise
        elif tensor.dim() == 1:
            value = 0.05 * noise
        else:
            fan_in = tensor[0].numel() if tensor.dim() > 1 else tensor.numel()
            value = noise / math.sqrt(max(fan_in, 1))
        tensor.copy_(value.to(tensor.dtype))


# Text the tiny BPE is trained on: the chat-format words must become single tokens, as in Qwen's
# tokenizer, because the prompt is cut by token positions ("<|im_start|>", "assistant", "\n").
TOKENIZER_CORPUS = (
    "assistant user system assistant user assistant\n"
    "Hello, this is a tiny random test voice. The quick brown fox jumps over the lazy dog.\n"
    "Speak slowly and warmly, like a calm narrator reading a bedtime story.\n"
    "A deep, gravelly male voice with a slight British accent.\n"
    "Numbers 0 1 2 3 4 5 6 7 8 9, punctuation ! ? ; : ' \" ( ) - and spaces.\n"
    "你好，世界。今天天气很好。こんにちは。안녕하세요.\n"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|tts_pad|>", "<|tts_text_bos|>", "<|tts_text_eod|>")


def write_tiny_text_tokenizer(directory: Path, merges: int = 300) -> dict[str, int]:
    """A byte-level BPE in Qwen2Tokenizer's file layout (vocab.json, merges.txt, tokenizer_config.json), built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + merges, initial_alphabet=alphabet, show_progress=False)
    bpe.train_from_iterator([TOKENIZER_CORPUS] * 20, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    special_ids = {token: len(vocab) + i for i, token in enumerate(SPECIAL_TOKENS)}
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merge_lines = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merge_lines) + "\n", encoding="utf-8")
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True} for t, i in special_ids.items()}
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return special_ids


# Control ids, languages and speakers as in the released checkpoints' config.json.
CODEC_CONTROL_IDS = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_think_id": 2154,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
LANGUAGE_IDS = {
    "chinese": 2055, "english": 2050, "german": 2053, "spanish": 2054, "japanese": 2058, "french": 2061,
    "korean": 2064, "russian": 2069, "italian": 2070, "portuguese": 2071, "beijing_dialect": 2074, "sichuan_dialect": 2062,
}
SPEAKER_IDS = {
    "vivian": 3065, "serena": 3066, "uncle_fu": 3010, "dylan": 2878, "eric": 2875,
    "ryan": 3061, "aiden": 2861, "ono_anna": 2873, "sohee": 2864,
}
SPEAKER_DIALECTS = {"dylan": "beijing_dialect", "eric": "sichuan_dialect"}
TINY_TALKER_HIDDEN = 64
TINY_SIZES = {"base": "0b6", "custom_voice": "1b7", "voice_design": "1b7"}
GENERATION_CONFIG = {
    "do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05,
    "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
    "max_new_tokens": 101,  # 100 frames (8 s) by default: their audio is noise (the released checkpoints: 2048)
}


def tiny_config(model_type: str, special_ids: dict[str, int]) -> dict:
    from pipeline.speaker_encoder import tiny_speaker_encoder_config

    speakers = SPEAKER_IDS if model_type == "custom_voice" else {}
    talker = {
        "vocab_size": 3072, "hidden_size": TINY_TALKER_HIDDEN, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
        "rope_scaling": {"interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default", "type": "default"},
        "num_code_groups": 16, "text_hidden_size": 48, "text_vocab_size": max(special_ids.values()) + 1,
        "spk_id": speakers, "spk_is_dialect": {name: SPEAKER_DIALECTS.get(name, False) for name in speakers},
        "codec_language_id": LANGUAGE_IDS, **CODEC_CONTROL_IDS,
        "code_predictor_config": {
            "vocab_size": 2048, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
            "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "num_code_groups": 16,
        },
    }
    return {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_type": model_type,
        "tts_model_size": TINY_SIZES[model_type],
        "im_start_token_id": special_ids["<|im_start|>"],
        "im_end_token_id": special_ids["<|im_end|>"],
        "tts_pad_token_id": special_ids["<|tts_pad|>"],
        "tts_bos_token_id": special_ids["<|tts_text_bos|>"],
        "tts_eos_token_id": special_ids["<|tts_text_eod|>"],
        "talker_config": talker,
        "speaker_encoder_config": tiny_speaker_encoder_config(enc_dim=TINY_TALKER_HIDDEN),
    }


def write_tiny_checkpoint(directory: Path, model_type: str, seed: int = 0) -> Path:
    """A small random-weight checkpoint in the official layout, loadable by `TTS.from_pretrained`."""
    from safetensors.torch import save_file

    from pipeline.model import Qwen3TTS, TTSConfig

    if model_type not in TINY_SIZES:
        raise ValueError(f"Unknown model type '{model_type}': use one of {', '.join(TINY_SIZES)}.")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    special_ids = write_tiny_text_tokenizer(directory)
    config = tiny_config(model_type, special_ids)
    (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2), encoding="utf-8")
    model = Qwen3TTS(TTSConfig.from_dict(config))
    randomize_(model, torch.Generator().manual_seed(seed))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "model.safetensors")
    write_tiny_speech_tokenizer(directory, seed)
    return directory


# ----------------------------------------------------------------------------------------------
# Speech tokenizer (codec)

# Small everywhere except what the rest of the engine depends on: 16 x 2048 codes, 12.5 Hz,
# 1920 samples per frame, 24 kHz, a 72-frame window. Head dims differ from hidden/heads and the
# decoder uses grouped KV heads, as a check that neither is assumed. The encoder's
# sliding_window (16 steps = 0.64 s) is far shorter than the test audio, so a Mimi that honours
# it gives different codes than the full causal attention the checkpoints expect.
TINY_SPEECH_TOKENIZER_CONFIG = {
    "architectures": ["Qwen3TTSTokenizerV2Model"],
    "model_type": "qwen3_tts_tokenizer_12hz",
    "encoder_valid_num_quantizers": 16,
    "input_sample_rate": 24000,
    "output_sample_rate": 24000,
    "decode_upsample_rate": 1920,
    "encode_downsample_rate": 1920,
    "encoder_config": {
        "sampling_rate": 24000, "audio_channels": 1, "hidden_size": 32, "num_filters": 4,
        "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4], "kernel_size": 7, "last_kernel_size": 3,
        "residual_kernel_size": 3, "dilation_growth_rate": 2, "compress": 2, "pad_mode": "constant",
        "use_causal_conv": True, "use_conv_shortcut": False, "trim_right_ratio": 1.0,
        "codebook_size": 2048, "codebook_dim": 16, "vector_quantization_hidden_dimension": 16,
        "num_quantizers": 32, "num_semantic_quantizers": 1, "upsample_groups": 32, "frame_rate": 12.5,
        "num_hidden_layers": 2, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
        "head_dim": 16, "hidden_act": "gelu", "max_position_embeddings": 8000, "norm_eps": 1e-5,
        "rope_theta": 10000.0, "sliding_window": 16, "layer_scale_initial_scale": 0.01, "use_cache": False,
    },
    "decoder_config": {
        "codebook_size": 2048, "codebook_dim": 16, "hidden_size": 32, "latent_dim": 32, "decoder_dim": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 64, "hidden_act": "silu", "attention_bias": False, "sliding_window": 72,
        "max_position_embeddings": 8000, "rope_theta": 10000, "rms_norm_eps": 1e-5,
        "layer_scale_initial_scale": 0.01, "num_quantizers": 16, "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2], "attention_dropout": 0.0,
    },
}

# What the reference's AutoFeatureExtractor reads (Mimi's feature extractor is Encodec's).
TINY_SPEECH_TOKENIZER_PREPROCESSOR_CONFIG = {
    "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1, "sampling_rate": 24000,
    "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
    "chunk_length_s": None, "overlap": None,
}


@torch.no_grad()
def randomize_speech_tokenizer_(model: SpeechTokenizer, g: torch.Generator) -> None:
    """Seeded random weights that behave like a codec's: used by the tiny checkpoints and the GPU benchmark."""
    randomize_(model, g)

    def usage(n: int) -> torch.Tensor:
        # Varied positive counts: the codeword is sum / count, so a dropped division shows.
        return 0.5 + 1.5 * torch.rand(n, generator=g)

    for m in model.modules():
        if isinstance(m, ResidualUnit):
            # Unit-variance residual branches make the vocoder's activations grow ~x15 over its 12
            # units; the SnakeBeta sin() of large activations then turns float rounding into
            # O(1e-5) output noise. Smaller branches keep activations O(1), as in a trained model.
            m.conv2.conv.weight.mul_(0.3)
            m.conv2.conv.bias.mul_(0.3)
        elif isinstance(m, DecoderCodebook):
            m.cluster_usage.copy_(usage(len(m.cluster_usage)))
        elif isinstance(m, MimiCodebook):
            m.initialized.fill_(1.0)
            m.cluster_usage.copy_(usage(len(m.cluster_usage)))
    derive_all_(model)


@torch.no_grad()
def _spread_encoder_codebooks_(model: SpeechTokenizer, g: torch.Generator) -> None:
    """Encoder codebooks spread over what each of them quantizes (mean and spread per dimension, one
    stage after the other), so that random audio gives varied codes in every codebook."""
    latents = model.encoder.latents(0.5 * torch.randn(1, 4 * 24000, generator=g))
    for rvq in (model.encoder.quantizer.semantic_residual_vector_quantizer,
                model.encoder.quantizer.acoustic_residual_vector_quantizer):
        residual = rvq.project(latents).flatten(0, 1)
        for vq in rvq.layers:
            cb = vq.codebook
            unit = (cb.embed - cb.embed.mean(0)) / cb.embed.std(0)
            cb.embed_sum.copy_((residual.mean(0) + unit * residual.std(0)) * cb.cluster_usage[:, None])
            cb._derive_()
            residual = residual - cb.embed[cb.encode(residual)]


@torch.no_grad()
def _scale_decoder_output_(model: SpeechTokenizer, g: torch.Generator) -> None:
    """Scale the last conv (output is linear in its weight and bias together) so that random codes
    give a waveform well inside [-1, 1]: the reference's clamp would otherwise hide differences."""
    last = model.decoder.decoder[-1].conv
    config = model.config.decoder
    codes = torch.randint(0, config.codebook_size, (64, config.num_quantizers), generator=g)
    for _ in range(4):
        peak = model.decode(codes).abs().max()
        factor = 0.3 / peak if peak < 0.9 else 1e-2
        last.weight.mul_(factor)
        last.bias.mul_(factor)


@torch.no_grad()
def write_tiny_speech_tokenizer(directory: Path, seed: int, config: dict | None = None, calibrate: bool = True) -> None:
    """Write `directory/speech_tokenizer/{config.json, preprocessor_config.json, model.safetensors}`:
    a tiny random codec in the official layout, loadable by ours and by the reference.

    `config`: the config.json to write instead of TINY_SPEECH_TOKENIZER_CONFIG (e.g. a variant of it).
    `calibrate=False` skips spreading the codebooks and scaling the output (which run the codec on
    the CPU: half a minute at the real size), for checkpoints that only time the codec."""
    from safetensors.torch import save_file

    config = TINY_SPEECH_TOKENIZER_CONFIG if config is None else config
    model = SpeechTokenizer(SpeechTokenizerConfig.from_dict(config))
    g = torch.Generator().manual_seed(seed)
    randomize_speech_tokenizer_(model, g)
    if calibrate:
        _spread_encoder_codebooks_(model, g)
        _scale_decoder_output_(model, g)

    out = Path(directory) / "speech_tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps(TINY_SPEECH_TOKENIZER_PREPROCESSOR_CONFIG, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))


@torch.no_grad()
def randomize_code2wav_(model: nn.Module, g: torch.Generator) -> None:
    """Seeded random weights for Qwen3-Omni's code2wav (ours or transformers', same names; buffers
    are left alone: transformers' rotary tables are buffers)."""
    randomize_(model, g, buffers=False)
    for name, p in model.named_parameters():
        if name.endswith(("conv2.conv.weight", "conv2.conv.bias")):
            p.mul_(0.3)  # small residual branches keep the vocoder's activations O(1), as for the codec
    derive_all_(model)


# ----------------------------------------------------------------------------------------------
# Qwen3-Omni

# Qwen3-Omni's special tokens in id order from 151643, as its tokenizer has them (the tokenizers
# library numbers added tokens consecutively after the vocabulary, so every one is listed).
OMNI_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)
OMNI_FIRST_SPECIAL_ID = 151643
OMNI_VOCAB_SIZE = 151936
OMNI_SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
OMNI_GENERATION_CONFIG = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
OMNI_FEATURE_EXTRACTOR = {
    "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128, "sampling_rate": 16000, "hop_length": 160,
    "chunk_length": 300, "n_fft": 400, "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True, "dither": 0.0,
}


def _pseudo_words(count: int, taken: set[str]) -> list[str]:
    """`count` distinct pronounceable byte-level tokens (" bako", " tulimesa", ...) that fill the
    vocabulary up to the real special-token ids; the tiny BPE never produces them, a random
    thinker writes them as its words."""
    syllables = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]
    words = []
    for n in (2, 3, 4):
        for parts in itertools.product(syllables, repeat=n):
            word = "\u0120" + "".join(parts)  # Ġ: byte-level BPE's leading space
            if word not in taken:
                words.append(word)
                if len(words) == count:
                    return words
    raise ValueError("not enough pseudo-words")


def write_tiny_omni_tokenizer(directory: Path, merges: int = 300, words: str = "") -> dict[str, int]:
    """Qwen2Tokenizer files whose special tokens sit at Qwen3-Omni's real ids (151643...). The words of
    `words` become one token each (with `merges` enough), as a released tokenizer's vocabulary holds
    common words whole."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + merges, initial_alphabet=alphabet, show_progress=False)
    # The chat roles as single tokens, also where more merges would make them only " user" and " assistant".
    roles = "".join(f"\n{role}\n" for role in ("user", "assistant") * 8) if words else ""
    bpe.train_from_iterator([TOKENIZER_CORPUS + "system " * 8 + words + roles] * 20, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    for word in _pseudo_words(OMNI_FIRST_SPECIAL_ID - len(vocab), set(vocab)):
        vocab[word] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merge_lines = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merge_lines) + "\n", encoding="utf-8")
    special_ids = {token: OMNI_FIRST_SPECIAL_ID + i for i, token in enumerate(OMNI_SPECIAL_TOKENS)}
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
             for t, i in special_ids.items()}
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added, "additional_special_tokens": list(OMNI_SPECIAL_TOKENS[1:]),
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace",
        "model_max_length": 65536, "clean_up_tokenization_spaces": False, "split_special_tokens": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return {**special_ids, **{word: vocab[word] for word in ("system", "user", "assistant")}}


def tiny_omni_config(ids: dict[str, int]) -> dict:
    """A Qwen3-Omni config.json with every part small, the released checkpoint's ids and structure
    (sparse MoE thinker and talker with a shared expert, audio and vision encoders, code2wav)."""
    thinker = {
        "text_config": {
            "vocab_size": OMNI_VOCAB_SIZE, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
            "norm_topk_prob": True, "max_position_embeddings": 65536,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 1, 1], "interleaved": True},
        },
        "audio_config": {"d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 48, "output_dim": 32,
                         "downsample_hidden_size": 16, "num_mel_bins": 128},
        "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 32,
                          "deepstack_visual_indexes": [0]},
        "audio_token_id": ids["<|audio_pad|>"], "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"], "vision_start_token_id": ids["<|vision_start|>"],
        "position_id_per_seconds": 13, "user_token_id": ids["user"],
    }
    talker = {
        "text_config": {"vocab_size": 3072, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 8, "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 3,
                        "shared_expert_intermediate_size": 24, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
        "code_predictor_config": {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 2048, "num_code_groups": 16},
        "thinker_hidden_size": 32, "num_code_groups": 16, "accept_hidden_layer": 2, "spatial_merge_size": 2,
        "audio_token_id": ids["<|audio_pad|>"], "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"], "vision_start_token_id": ids["<|vision_start|>"], "position_id_per_seconds": 13,
        "codec_eos_token_id": 2150, "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "codec_pad_id": 2148, "codec_bos_id": 2149, "speaker_id": OMNI_SPEAKERS,
    }
    code2wav = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "intermediate_size": 48,
                "decoder_dim": 32, "sliding_window": 16}
    return {
        "thinker_config": thinker, "talker_config": talker, "code2wav_config": code2wav, "enable_audio_output": True,
        "im_start_token_id": ids["<|im_start|>"], "im_end_token_id": ids["<|im_end|>"], "system_token_id": ids["system"],
        "user_token_id": ids["user"], "assistant_token_id": ids["assistant"],
        "tts_pad_token_id": ids["<tts_pad>"], "tts_bos_token_id": ids["<tts_text_bos>"], "tts_eos_token_id": ids["<tts_text_eod>"],
    }


@torch.no_grad()
def write_tiny_omni_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A small random Qwen3-Omni in the official layout (transformers writes config.json and the
    per-expert safetensors), loadable by `OmniChat.from_pretrained`."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ids = write_tiny_omni_tokenizer(directory)
    config = Qwen3OmniMoeConfig(**tiny_omni_config(ids))
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(seed)
    randomize_(model, g, buffers=False)  # the rotary tables are buffers; transformers leaves the fused experts uninitialised
    randomize_code2wav_(model.code2wav, g)
    model.save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps(OMNI_GENERATION_CONFIG, indent=2), encoding="utf-8")
    (directory / "preprocessor_config.json").write_text(json.dumps(OMNI_FEATURE_EXTRACTOR, indent=2), encoding="utf-8")
    return directory
