"""Tiny random-weight checkpoints in the official layout, for tests and the app's offline mode."""
import json
import math
from pathlib import Path

import torch
from torch import nn

NORM_WEIGHT_KEYS = ("norm", "layer_scale", "scale")


@torch.no_grad()
def randomize_(module: nn.Module, generator: torch.Generator) -> None:
    """Give every tensor of `module` a seeded, non-trivial value.

    Default initialisation hides bugs: norm gains of exactly 1 make a missing norm invisible and
    zero biases make a dropped bias invisible. Weights get ~1/sqrt(fan_in) scale so activations
    stay O(1) through deep stacks; 1-D parameters get values around their typical magnitude.
    """
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if not tensor.is_floating_point():
            continue
        leaf = name.rsplit(".", 1)[-1]
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
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
    "max_new_tokens": 301,
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
    from pipeline.speech_tokenizer import write_tiny_speech_tokenizer

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
