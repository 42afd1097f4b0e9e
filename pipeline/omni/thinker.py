"""Qwen3-Omni's thinker (transformers' own module, with its audio encoder), driven one token at a
time so that each token can go to the chat and to the talker as soon as it exists.

A conversation's state is its own KV cache and rope offset (transformers keeps the offset on the
module, which would mix conversations); forward calls are serialized by a lock, so conversations
interleave token by token. Sampling uses the engine's counter-based draws: the same seed gives
the same reply.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.engine.sampling import M32, RowSampling, exponential_noise, mix32, sample_rows
from pipeline.errors import CheckpointError
from pipeline.model import known_fields
from pipeline.omni.conversation import ThinkerInputs


@dataclass(frozen=True)
class ThinkerSampling:
    """The thinker's sampling (generation_config.json's values; greedy: argmax, no penalty)."""

    do_sample: bool = True
    temperature: float = 0.7
    top_k: int = 20
    top_p: float = 0.8
    repetition_penalty: float = 1.0

    @classmethod
    def from_generation_config(cls, data: dict[str, Any]) -> "ThinkerSampling":
        section = data.get("thinker") if isinstance(data.get("thinker"), dict) else data
        return cls(**known_fields(cls, section))


@dataclass
class ThinkerState:
    """One conversation in the thinker: its cache and where it stands."""

    cache: Any  # transformers' DynamicCache
    length: int  # positions in the cache
    rope_delta: int  # multimodal rope position minus sequence position, after the prompt
    seen: torch.Tensor  # [vocab] bool: ids in the prompt or the reply (repetition penalty)
    settings: RowSampling
    seed_hash: torch.Tensor  # [1]
    penalty: float
    draws: int = 0


@dataclass
class Prefilled:
    state: ThinkerState
    logits: torch.Tensor  # [vocab] of the first reply token
    embeds: torch.Tensor  # [L, hidden] input embeddings of the prompt (audio positions hold the encoder's output)
    hidden: torch.Tensor  # [L, hidden] the prompt's states at layer `accept_hidden_layer`


class Thinker:
    def __init__(self, model, accept_hidden_layer: int):
        self.model = model
        self.accept_hidden_layer = accept_hidden_layer
        self.lock = threading.Lock()
        weight = model.get_input_embeddings().weight
        self.device, self.vocab = weight.device, model.lm_head.weight.shape[0]

    @classmethod
    def from_pretrained(cls, directory: Path, device: torch.device, dtype: torch.dtype, accept_hidden_layer: int) -> "Thinker":
        """The `thinker.*` part of an official Qwen3-Omni checkpoint, through transformers' loader
        (which also stacks the per-expert tensors); the talker and code2wav tensors are ours to load."""
        from transformers import logging as hf_logging
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # it would list every talker and code2wav tensor as unexpected
        try:
            config = Qwen3OmniMoeConfig.from_pretrained(str(directory)).thinker_config
            model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(str(directory), config=config, dtype=dtype)
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"The thinker in {directory} cannot be loaded: {' '.join(str(exc).split())}") from None
        finally:
            hf_logging.set_verbosity(verbosity)
        return cls(model.to(device).eval(), accept_hidden_layer)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings of token ids [n] -> [n, hidden] (what the talker's text_projection reads)."""
        return self.model.get_input_embeddings()(tokens.to(self.device))

    @torch.inference_mode()
    def prefill(self, inputs: ThinkerInputs, sampling: ThinkerSampling, seed: int,
                on_accept_layer: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> Prefilled:
        """The prompt through the thinker. `on_accept_layer(embeds, hidden)` is called as soon as layer
        `accept_hidden_layer` is done, while the layers above it still run (what the talker's prompt
        needs is known by then)."""
        input_ids = inputs.input_ids.to(self.device)
        features = {k: v.to(self.device) for k, v in inputs.features.items()}
        if "input_features" in features:
            features["input_features"] = features["input_features"].to(self.model.dtype)
        layers = self.model.model.layers
        seen: dict[str, torch.Tensor] = {}

        def keep_embeds(module, args, kwargs):
            seen["embeds"] = (args[0] if args else kwargs["hidden_states"])[0]

        def at_accept_layer(module, args, output):
            seen["hidden"] = (output[0] if isinstance(output, tuple) else output)[0]
            if on_accept_layer is not None:
                on_accept_layer(seen["embeds"], seen["hidden"])

        # hidden_states[k] of transformers' output is what layer k reads: the input embeddings, then each layer's output.
        hooks = [layers[0].register_forward_pre_hook(keep_embeds, with_kwargs=True),
                 layers[self.accept_hidden_layer - 1].register_forward_hook(at_accept_layer)]
        try:
            with self.lock:
                out = self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=True, **features)
        finally:
            for hook in hooks:
                hook.remove()
        token_seen = torch.zeros(self.vocab, dtype=torch.bool, device=self.device)
        token_seen[input_ids[0]] = True
        settings = RowSampling.zeros(1, self.device)
        settings.set_row(0, sampling.do_sample, sampling.temperature, sampling.top_k, sampling.top_p)
        penalty = sampling.repetition_penalty if sampling.do_sample else 1.0
        seed_hash = mix32(torch.tensor([seed & M32], device=self.device))
        state = ThinkerState(out.past_key_values, input_ids.shape[1], int(out.rope_deltas.reshape(-1)[0]), token_seen, settings, seed_hash, penalty)
        return Prefilled(state, out.logits[0, -1], seen["embeds"], seen["hidden"])

    @torch.inference_mode()
    def step(self, state: ThinkerState, token: int) -> torch.Tensor:
        """Feed the last reply token; logits [vocab] of the next one."""
        position = torch.full((3, 1, 1), state.length + state.rope_delta, device=self.device)
        with self.lock:
            out = self.model(input_ids=torch.tensor([[token]], device=self.device), position_ids=position, past_key_values=state.cache,
                             use_cache=True)
        state.length += 1
        return out.logits[0, -1]

    @torch.inference_mode()
    def pick(self, state: ThinkerState, logits: torch.Tensor) -> int:
        """The next token from its logits, with the conversation's sampling."""
        logits = logits.float()[None]
        if state.penalty != 1.0:
            penalized = torch.where(logits < 0, logits * state.penalty, logits / state.penalty)
            logits = torch.where(state.seen, penalized, logits)
        noise = exponential_noise(state.seed_hash, torch.tensor([state.draws * self.vocab], device=self.device), self.vocab)
        state.draws += 1
        token = int(sample_rows(logits, state.settings, noise)[0])
        state.seen[token] = True
        return token
