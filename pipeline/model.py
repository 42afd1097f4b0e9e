"""Qwen3-TTS talker and code predictor: config dataclasses and lean modules with static KV caches.

Parameter names are the official checkpoint's (`talker.model.layers.0.self_attn.q_proj.weight`, ...),
so `model.safetensors` loads with `load_state_dict(strict=True)`.

Numerics follow the reference: RMSNorm variance in float32, RoPE cos/sin computed in float32 and
cast to the activation dtype (shared/reference: vllm-omni PR 2277). The talker's M-RoPE uses three
position axes, but text-to-speech feeds the same position on all three, and M-RoPE with equal axes
is exactly 1-D RoPE, so 1-D RoPE is what runs here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from pipeline.contract.models import SPEECH_TYPES
from pipeline.layers import DETERMINISTIC_ATTENTION, RMSNorm, apply_rope, attention, rope_tables
from pipeline.speaker_encoder import SpeakerEncoder, SpeakerEncoderConfig


def known_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
    """The entries of `data` that are fields of the dataclass `cls` (config files carry many more)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def read_rope_theta(data: dict[str, Any], default: float) -> float:
    if "rope_theta" in data:
        return float(data["rope_theta"])
    return float((data.get("rope_parameters") or {}).get("rope_theta", default))


@dataclass
class CodePredictorConfig:
    vocab_size: int = 2048
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 5
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    num_code_groups: int = 16

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CodePredictorConfig":
        return cls(**{**known_fields(cls, data), "rope_theta": read_rope_theta(data, cls.rope_theta)})


@dataclass
class TalkerConfig:
    code_predictor_config: CodePredictorConfig = field(default_factory=CodePredictorConfig)
    vocab_size: int = 3072
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    num_code_groups: int = 16
    text_hidden_size: int = 2048
    text_vocab_size: int = 151936
    codec_eos_token_id: int = 2150
    codec_think_id: int = 2154
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    codec_pad_id: int = 2148
    codec_bos_id: int = 2149
    spk_id: dict[str, int] = field(default_factory=dict)
    spk_is_dialect: dict[str, str | bool] = field(default_factory=dict)
    codec_language_id: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TalkerConfig":
        values = known_fields(cls, data)
        values["code_predictor_config"] = CodePredictorConfig.from_dict(data.get("code_predictor_config") or {})
        values["rope_theta"] = read_rope_theta(data, cls.rope_theta)
        values["spk_id"] = dict(data.get("spk_id") or {})
        values["spk_is_dialect"] = dict(data.get("spk_is_dialect") or {})
        values["codec_language_id"] = dict(data.get("codec_language_id") or {})
        return cls(**values)


MODEL_TYPES = SPEECH_TYPES  # the released Qwen3-TTS 12 Hz model types (pipeline.contract.models' registry)


@dataclass
class TTSConfig:
    talker_config: TalkerConfig
    speaker_encoder_config: SpeakerEncoderConfig
    tts_model_type: str
    tts_model_size: str = ""
    tokenizer_type: str = "qwen3_tts_tokenizer_12hz"
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TTSConfig":
        values = known_fields(cls, data)
        values["talker_config"] = TalkerConfig.from_dict(data.get("talker_config") or {})
        values["speaker_encoder_config"] = SpeakerEncoderConfig.from_dict(data.get("speaker_encoder_config") or {})
        return cls(**values)


class KVCache(nn.Module):
    """Keys and values of `rows` independent sequences; each row is one utterance of the batch."""

    def __init__(self, rows: int, kv_heads: int, max_seq: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        shape = (rows, kv_heads, max_seq, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """rows [B], positions [B, L]; k, v [B, H_kv, L, D]. Index assignment: graph-safe, and
        torch.compile turns it into one in-place scatter (as gpt-fast)."""
        index = (rows[:, None], slice(None), positions)
        self.k[index] = k.transpose(1, 2)
        self.v[index] = v.transpose(1, 2)


def fuse_projections(module: nn.Module, fused: str, parts: dict[str, int]) -> None:
    """Store several bias-free projections of one input as one Linear `fused` (one matmul, not several).

    Checkpoints keep each part under its own name (`q_proj.weight`, ...): a load pre-hook
    concatenates them into `{fused}.weight` and a state_dict hook splits them again, so official
    files load and save unchanged.
    """

    def merge(mod, state_dict, prefix, *args) -> None:
        keys = [f"{prefix}{name}.weight" for name in parts]
        if all(k in state_dict for k in keys):
            state_dict[f"{prefix}{fused}.weight"] = torch.cat([state_dict.pop(k) for k in keys])

    def split(mod, state_dict, prefix, local_metadata) -> None:
        weight = state_dict.pop(f"{prefix}{fused}.weight")
        for name, part in zip(parts, weight.split(list(parts.values()))):
            state_dict[f"{prefix}{name}.weight"] = part

    module.register_load_state_dict_pre_hook(merge)
    module.register_state_dict_post_hook(split)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        self.qkv_proj = nn.Linear(hidden, sum(self.sizes), bias=False)
        fuse_projections(self, "qkv_proj", dict(zip(("q_proj", "k_proj", "v_proj"), self.sizes)))
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        self.kv_cache: KVCache | None = None

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, length, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = self.q_norm(q.view(b, length, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(b, length, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _out(self, out: torch.Tensor) -> torch.Tensor:
        b, _, length, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Every cache row: x [B, L, hidden] at `positions` [B, L]; attends over the whole cache."""
        q, k, v = self._qkv(x, cos, sin)
        self.kv_cache.write(rows, positions, k, v)
        return self._out(attention(q, self.kv_cache.k, self.kv_cache.v, mask, self.head_dim**-0.5))

    def extend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One cache row: x [1, L, hidden] at `positions` [1, L], after what the row holds; attends over that row's cache."""
        q, k, v = self._qkv(x, cos, sin)
        self.kv_cache.write(row, positions, k, v)
        return self._out(attention(q, self.kv_cache.k[row], self.kv_cache.v[row], mask, self.head_dim**-0.5))

    def prefill(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One sequence from position 0: x [1, L, hidden] stored in cache row `row` [1]; causal over itself."""
        q, k, v = self._qkv(x, cos, sin)
        self.kv_cache.write(row, positions[None], k, v)
        # Never cuDNN's attention: on an H200 (torch 2.11) it is the default pick and it is not
        # deterministic; the same prompt must give the same cache every time.
        with sdpa_kernel(DETERMINISTIC_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self._out(out)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        fuse_projections(self, "gate_up_proj", {"gate_proj": intermediate, "up_proj": intermediate})
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, eps)
        self.mlp = mlp if mlp is not None else MLP(hidden, intermediate)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        x = x + attend(self.self_attn, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """A Qwen3 decoder stack over a static KV cache of `rows` sequences; positions are device tensors.
    `mlp` makes each layer's MLP where it is not the dense one (Qwen3-Omni's talker: a sparse MoE)."""

    def __init__(self, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int, eps: float, rope_theta: float,
                 mlp: Callable[[], nn.Module] | None = None):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(hidden, intermediate, heads, kv_heads, head_dim, eps, mlp() if mlp else None) for _ in range(layers))
        self.norm = RMSNorm(hidden, eps)
        self.kv_heads, self.head_dim, self.rope_theta = kv_heads, head_dim, rope_theta
        self.max_seq = 0

    def setup_caches(self, rows: int, max_seq: int) -> None:
        weight = self.norm.weight
        self.max_seq = max_seq
        for layer in self.layers:
            layer.self_attn.kv_cache = KVCache(rows, self.kv_heads, max_seq, self.head_dim, weight.dtype, weight.device)
        cos, sin = rope_tables(self.head_dim, self.rope_theta, max_seq, weight.device)
        self.register_buffer("rope_cos", cos.to(weight.dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(weight.dtype), persistent=False)
        self.register_buffer("key_pos", torch.arange(max_seq, device=weight.device), persistent=False)
        self.register_buffer("all_rows", torch.arange(rows, device=weight.device), persistent=False)

    def _run(self, x: torch.Tensor, attend) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, attend)
        return self.norm(x)

    def decode(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [rows, L, hidden] for every cache row, at `positions` [rows, L] (each row its own)."""
        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]
        # One additive float32 mask for all layers; it also hides cache slots not yet written.
        mask = torch.where(self.key_pos <= positions[..., None], 0.0, float("-inf"))
        rows = self.all_rows
        return self._run(x, lambda attn, h: attn.decode(h, cos, sin, mask, rows, positions))

    def extend(self, x: torch.Tensor, row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [1, L, hidden] at `positions` [1, L]: more of the sequence in cache row `row` [1] (a prompt given in parts)."""
        cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]
        mask = torch.where(self.key_pos <= positions[..., None], 0.0, float("-inf"))
        return self._run(x, lambda attn, h: attn.extend(h, cos, sin, mask, row, positions))

    def prefill(self, x: torch.Tensor, row: torch.Tensor, layer_step: Callable | None = None) -> torch.Tensor:
        """x [1, L, hidden]: one sequence from position 0, written into cache row `row` [1].
        `layer_step`: what runs each layer (`prefill_layer`, or a torch.compile'd copy of it)."""
        positions = self.key_pos[: x.shape[1]]
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        step = layer_step or prefill_layer
        for layer in self.layers:
            x = step(layer, x, cos, sin, row, positions)
        return self.norm(x)


def prefill_layer(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One layer of `Transformer.prefill`. A function of the layer rather than a method: torch.compile'd
    once, it serves every layer of the stack (their parameters are its inputs, their shapes agree) and
    every prompt length, so compiling the prefill traces one layer, not all of them."""
    return layer(x, lambda attn, h: attn.prefill(h, cos, sin, row, positions))


def embedding(count: int, dim: int) -> nn.Embedding:
    """nn.Embedding(count, dim), its weights drawn as nn.Embedding draws them except on the meta device, where the
    loaders build models: a draw on meta tensors imports torch._dynamo, seconds of a start."""
    weight = torch.empty(count, dim)
    if weight.device.type != "meta":
        nn.init.normal_(weight)
    return nn.Embedding(count, dim, _weight=weight)


class ResizeMLP(nn.Module):
    def __init__(self, inp: int, intermediate: int, out: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(inp, intermediate, bias=True)
        self.linear_fc2 = nn.Linear(intermediate, out, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class CodePredictorModel(Transformer):
    def __init__(self, config: CodePredictorConfig, embedding_dim: int):
        c = config
        super().__init__(c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.rope_theta)
        self.codec_embedding = nn.ModuleList(embedding(c.vocab_size, embedding_dim) for _ in range(c.num_code_groups - 1))


class CodePredictor(nn.Module):
    """Predicts codebooks 1..15 of a frame from the talker's hidden state and codebook 0."""

    def __init__(self, config: CodePredictorConfig, talker_hidden: int):
        super().__init__()
        self.config = config
        self.model = CodePredictorModel(config, talker_hidden)
        self.lm_head = nn.ModuleList(nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_code_groups - 1))
        if config.hidden_size != talker_hidden:
            self.small_to_mtp_projection = nn.Linear(talker_hidden, config.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()


class TalkerModel(Transformer):
    def __init__(self, config: TalkerConfig):
        c = config
        super().__init__(c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.rope_theta)
        self.codec_embedding = embedding(c.vocab_size, c.hidden_size)
        self.text_embedding = embedding(c.text_vocab_size, c.text_hidden_size)


class Talker(nn.Module):
    def __init__(self, config: TalkerConfig):
        super().__init__()
        self.config = config
        self.model = TalkerModel(config)
        self.text_projection = ResizeMLP(config.text_hidden_size, config.text_hidden_size, config.hidden_size)
        self.codec_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.code_predictor = CodePredictor(config.code_predictor_config, config.hidden_size)

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """Text token ids [B, L] -> talker-space embeddings [B, L, hidden]."""
        return self.text_projection(self.model.text_embedding(ids))

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [..., 16] -> the sum of their 16 codebook embeddings [..., hidden]."""
        tables = [self.model.codec_embedding, *self.code_predictor.model.codec_embedding]
        # One stacked sum, not 15 running adds: the same float rounding as the reference.
        return torch.stack([table(codes[..., i]) for i, table in enumerate(tables)], dim=-2).sum(-2)


class Qwen3TTS(nn.Module):
    """The top-level module of a checkpoint's `model.safetensors`: talker and, for Base models, the speaker encoder."""

    def __init__(self, config: TTSConfig):
        super().__init__()
        self.config = config
        self.talker = Talker(config.talker_config)
        self.speaker_encoder = SpeakerEncoder(config.speaker_encoder_config) if config.tts_model_type == "base" else None
