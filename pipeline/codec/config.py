"""The keys of the official speech_tokenizer/config.json that the codec uses."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from pipeline.config_types import ROPE, config_problem, dataclass_schema
from pipeline.errors import CheckpointError


def _pick(cls, raw: dict):
    """The dataclass built from the keys of `raw` it knows; the rest of `raw` is ignored."""
    return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})


@dataclass
class EncoderConfig:
    """The MimiConfig keys the encoder uses (`encoder_config` in config.json)."""

    sampling_rate: int = 24000
    audio_channels: int = 1
    hidden_size: int = 512
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: list[int] = field(default_factory=lambda: [8, 6, 5, 4])
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    compress: int = 2
    pad_mode: str = "constant"
    use_causal_conv: bool = True
    use_conv_shortcut: bool = False
    codebook_size: int = 2048
    codebook_dim: int | None = 256
    vector_quantization_hidden_dimension: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1
    num_hidden_layers: int = 8
    intermediate_size: int = 2048
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int | None = None
    hidden_act: str = "gelu"
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    attention_bias: bool = False
    frame_rate: float = 12.5

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.codebook_dim is None:
            self.codebook_dim = self.hidden_size  # as MimiConfig
        # The checkpoint's layout only; anything else is a different architecture.
        if not self.use_causal_conv or self.use_conv_shortcut or self.audio_channels != 1 or self.pad_mode != "constant":
            raise CheckpointError("speech tokenizer encoder: only causal, mono, zero-padded, shortcut-free Mimi is supported")
        if self.hidden_act != "gelu":
            raise CheckpointError(f"speech tokenizer encoder: unsupported hidden_act {self.hidden_act!r}")
        # The codebooks quantize the latents projected to vector_quantization_hidden_dimension (or
        # left at hidden_size when the two are equal, without a projection): Mimi builds any other
        # codebook_dim, then fails on the first encode.
        if self.codebook_dim != self.vector_quantization_hidden_dimension:
            raise CheckpointError(f"speech tokenizer encoder: codebook_dim {self.codebook_dim} differs from "
                                  f"vector_quantization_hidden_dimension {self.vector_quantization_hidden_dimension}, "
                                  "the size of the vectors the codebooks quantize")

    @classmethod
    def from_dict(cls, raw: dict) -> "EncoderConfig":
        raw = dict(raw)
        # transformers 5 writes RoPE as rope_parameters, 4.x (the released checkpoints) as rope_theta.
        if "rope_theta" not in raw and isinstance(raw.get("rope_parameters"), dict):
            raw["rope_theta"] = raw["rope_parameters"].get("rope_theta", cls.rope_theta)
        return _pick(cls, raw)

    @property
    def latent_stride(self) -> int:
        # SEANet runs at ceil(sr / prod(ratios)) Hz (25 Hz); the downsample conv brings it to frame_rate.
        seanet_rate = math.ceil(self.sampling_rate / math.prod(self.upsampling_ratios))
        return int(seanet_rate / self.frame_rate)

    @property
    def projects_latents(self) -> bool:
        """Whether the quantizers have input/output projections (Mimi builds them only then)."""
        return self.vector_quantization_hidden_dimension != self.hidden_size


@dataclass
class DecoderConfig:
    """`decoder_config` in config.json."""

    codebook_size: int = 2048
    codebook_dim: int = 512
    hidden_size: int = 512
    latent_dim: int = 1024
    max_position_embeddings: int = 8000
    rope_theta: float = 10000.0
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    attention_bias: bool = False
    sliding_window: int = 72
    intermediate_size: int = 1024
    hidden_act: str = "silu"
    layer_scale_initial_scale: float = 0.01
    rms_norm_eps: float = 1e-5
    num_hidden_layers: int = 8
    num_quantizers: int = 16
    upsample_rates: list[int] = field(default_factory=lambda: [8, 5, 4, 3])
    upsampling_ratios: list[int] = field(default_factory=lambda: [2, 2])
    decoder_dim: int = 1536

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.hidden_act != "silu":
            raise CheckpointError(f"codec decoder: unsupported hidden_act {self.hidden_act!r}")

    @classmethod
    def from_dict(cls, raw: dict) -> "DecoderConfig":
        return _pick(cls, raw)

    @property
    def upsample(self) -> int:
        """Output samples per code frame."""
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)


@dataclass
class SpeechTokenizerConfig:
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    encoder_valid_num_quantizers: int = 16
    input_sample_rate: int = 24000
    output_sample_rate: int = 24000
    decode_upsample_rate: int = 1920
    encode_downsample_rate: int = 1920

    @classmethod
    def from_dict(cls, raw: dict) -> "SpeechTokenizerConfig":
        problem = config_problem(raw, SPEECH_TOKENIZER_CONFIG)
        if problem is not None:
            raise CheckpointError(problem)
        top = {k: raw[k] for k in ("encoder_valid_num_quantizers", "input_sample_rate", "output_sample_rate",
                                   "decode_upsample_rate", "encode_downsample_rate") if k in raw}
        config = cls(EncoderConfig.from_dict(raw.get("encoder_config") or {}),
                     DecoderConfig.from_dict(raw.get("decoder_config") or {}), **top)
        if config.decoder.upsample != config.decode_upsample_rate:
            raise CheckpointError(f"speech tokenizer: decoder upsamples x{config.decoder.upsample}, "
                                  f"config says decode_upsample_rate {config.decode_upsample_rate}")
        if config.decoder.num_quantizers != config.encoder_valid_num_quantizers:
            raise CheckpointError("speech tokenizer: encoder and decoder disagree on the number of codebooks")
        return config


# The keys of speech_tokenizer/config.json that SpeechTokenizerConfig.from_dict reads, by their JSON types.
SPEECH_TOKENIZER_CONFIG = {
    "encoder_config": dataclass_schema(EncoderConfig, {EncoderConfig: {"rope_parameters": ROPE}}),
    "decoder_config": dataclass_schema(DecoderConfig),
    **{name: int for name in ("encoder_valid_num_quantizers", "input_sample_rate", "output_sample_rate", "decode_upsample_rate", "encode_downsample_rate")},
}
