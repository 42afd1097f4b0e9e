"""Qwen3-Omni's talker: a 20-layer transformer whose MLPs are sparse mixtures of experts, reading
the thinker's text (`text_projection`) and hidden states (`hidden_projection`) and writing codebook
0 of each 12.5 Hz frame (`codec_head`), with the 5-layer code predictor for codebooks 1..15.

Built on the Qwen3-TTS talker's layers (`pipeline/model.py`: static KV caches, graph-safe decode)
with the MoE step of `pipeline/omni/moe.py`. Parameter names are the checkpoint's `talker.*`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipeline.errors import CheckpointError
from pipeline.model import CodePredictor, CodePredictorConfig, ResizeMLP, Transformer, known_fields, read_rope_theta
from pipeline.omni.moe import SparseMoeBlock


@dataclass
class TalkerTextConfig:
    """`talker_config.text_config` (defaults: transformers' `Qwen3OmniMoeTalkerTextConfig`)."""

    vocab_size: int = 3072
    hidden_size: int = 1024
    intermediate_size: int = 2048
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    moe_intermediate_size: int = 384
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int | None = None

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.hidden_act != "silu":
            raise CheckpointError(f"talker: unsupported hidden_act {self.hidden_act!r}")
        if self.shared_expert_intermediate_size is None:
            raise CheckpointError("talker_config.text_config has no shared_expert_intermediate_size.")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TalkerTextConfig":
        values = known_fields(cls, data)
        if "num_local_experts" in data:  # transformers writes num_experts under this name
            values["num_experts"] = data["num_local_experts"]
        return cls(**{**values, "rope_theta": read_rope_theta(data, cls.rope_theta)})


@dataclass
class OmniTalkerConfig:
    """`talker_config` of Qwen3-Omni's config.json (the parts that shape the modules)."""

    text_config: TalkerTextConfig
    code_predictor_config: CodePredictorConfig = field(default_factory=CodePredictorConfig)
    thinker_hidden_size: int = 2048
    codec_eos_token_id: int = 2150  # the released checkpoint's (transformers' class default differs)

    def __post_init__(self) -> None:
        if self.code_predictor_config.hidden_size != self.text_config.hidden_size:
            # The talker hands its hidden state to the code predictor as an input position.
            raise CheckpointError("talker_config: the code predictor's hidden_size must equal the talker's.")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "OmniTalkerConfig":
        return cls(TalkerTextConfig.from_dict(data.get("text_config") or {}),
                   CodePredictorConfig.from_dict(data.get("code_predictor_config") or {}),
                   int(data.get("thinker_hidden_size", cls.thinker_hidden_size)),
                   int(data.get("codec_eos_token_id", cls.codec_eos_token_id)))

    # What the batched decode step reads (pipeline/engine/decoder.py), as the Qwen3-TTS talker has it.
    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def num_code_groups(self) -> int:
        return self.code_predictor_config.num_code_groups


class OmniTalkerModel(Transformer):
    def __init__(self, c: TalkerTextConfig):
        super().__init__(c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         c.rms_norm_eps, c.rope_theta,
                         mlp=lambda: SparseMoeBlock(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                                                    c.shared_expert_intermediate_size, c.norm_topk_prob))
        self.codec_embedding = nn.Embedding(c.vocab_size, c.hidden_size)


class OmniTalker(nn.Module):
    def __init__(self, config: OmniTalkerConfig):
        super().__init__()
        text = config.text_config
        self.config = config
        self.model = OmniTalkerModel(text)
        self.text_projection = ResizeMLP(config.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.hidden_projection = ResizeMLP(config.thinker_hidden_size, text.intermediate_size, text.hidden_size)
        self.codec_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.code_predictor = CodePredictor(config.code_predictor_config, text.hidden_size)

    def embed_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [..., 16] -> the sum of their codebook embeddings [..., hidden] (the next talker input)."""
        tables = [self.model.codec_embedding, *self.code_predictor.model.codec_embedding]
        return torch.stack([table(codes[..., i]) for i, table in enumerate(tables)], dim=-2).sum(-2)
