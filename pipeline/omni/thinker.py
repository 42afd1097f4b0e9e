"""Qwen3-Omni's thinker (transformers' own module, with its audio encoder), driven one token at a
time so that each token can go to the chat and to the talker as soon as it exists.

A conversation holds one of a fixed number of slots: a KV cache in preallocated buffers, written
at a position kept on the device, and its own rope position (transformers keeps the offset on the
module, which would mix conversations). That makes the one-token step a CUDA graph per slot: in
eager PyTorch the 48-layer MoE step is thousands of small launches (137 ms per token measured on
an H200, slower than the speech it feeds). The prompt goes through transformers' decoder layers
as two graphs per length bucket, split at the layer the talker reads, into a staging cache and
then into the slot. Forward calls are serialized by a lock, so
conversations interleave token by token. Sampling uses the engine's counter-based draws: the
same seed gives the same reply.

Prompt and step both run transformers' decoder layers and rotary embedding directly (the model's
own forward would rebuild positions and masks from its per-module state). Those are internals
that move between releases (5.21 nests the text model one level deeper, 5.24 renames the layers'
cache argument), so the driver reaches them through `get_decoder()`, passes the cache by position,
and refuses at load a transformers release outside the range it is tested on.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from packaging.version import Version

from pipeline.engine.sampling import M32, RowSampling, exponential_noise, mix32, sample_rows
from pipeline.errors import CheckpointError
from pipeline.graphs import CUDAGraphed, GraphPool
from pipeline.model import known_fields
from pipeline.omni.conversation import ThinkerInputs

log = logging.getLogger(__name__)
PREFILL_BUCKETS = (64, 128, 256, 512, 1024, 2048)  # prompt lengths with a prefill graph (zero-padded to the next)
SLOT_POLL_S = 0.05  # how often a turn waiting for a free slot looks at its stop flag
# The transformers releases the driver is tested on (both ends included); requirements.txt allows these.
SUPPORTED_TRANSFORMERS = ("5.15.1", "5.24.0")


def check_transformers_version(installed: str) -> None:
    """Refuse a transformers release outside SUPPORTED_TRANSFORMERS, in one sentence, before any loading."""
    oldest, newest = SUPPORTED_TRANSFORMERS
    if not Version(oldest) <= Version(installed) <= Version(newest):
        raise CheckpointError(f"The Omni thinker supports transformers {oldest} to {newest}, but {installed} is installed; "
                              f"install a supported one with pip install 'transformers>={oldest},<={newest}'.")


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


class StaticKV:
    """Keys and values of every layer in fixed buffers; each `update` (called by transformers'
    attention) writes at `index`, a device tensor: a conversation's `position`, so that a graph
    replay writes where it stands without the host telling it, or a prompt's positions."""

    def __init__(self, layers: int, heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.keys = torch.zeros(layers, 1, heads, max_len, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.index = self.position  # where `update` writes: the next position, or a prompt's positions

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer_idx].index_copy_(2, self.index, key)
        self.values[layer_idx].index_copy_(2, self.index, value)
        return self.keys[layer_idx], self.values[layer_idx]

    def load(self, other: "StaticKV", length: int) -> None:
        """Take over the first `length` positions of `other` (a prompt prefilled there)."""
        self.keys[:, :, :, :length].copy_(other.keys[:, :, :, :length])
        self.values[:, :, :, :length].copy_(other.values[:, :, :, :length])
        self.position.fill_(length)


class _Slot:
    """One conversation's place in the thinker: its cache, its next token and rope position, and
    the one-token step over them (graphed on CUDA)."""

    def __init__(self, thinker: "Thinker", max_len: int):
        config = thinker.model.config.text_config
        weight = thinker.model.get_input_embeddings().weight
        self.kv = StaticKV(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, max_len, weight.dtype, weight.device)
        self.token = torch.zeros(1, 1, dtype=torch.long, device=weight.device)
        self.rope_position = torch.zeros(1, dtype=torch.long, device=weight.device)
        cuda = weight.device.type == "cuda"
        self.step = CUDAGraphed(lambda: thinker._decode(self), enabled=cuda, shared=thinker.graph_pool)
        self.picked = torch.zeros(1, dtype=torch.long, pin_memory=cuda)
        self.picked_ready = torch.cuda.Event() if cuda else None

    def to_host(self, token: torch.Tensor) -> int:
        """The picked token on the host. `int(token)` would hold the GIL while the GPU works, stalling
        the engine's threads for the whole thinker step; an event wait releases it."""
        if self.picked_ready is None:
            return int(token)
        self.picked.copy_(token, non_blocking=True)
        self.picked_ready.record()
        self.picked_ready.synchronize()
        return int(self.picked)


@dataclass
class ThinkerState:
    """One conversation in the thinker: its slot and where it stands."""

    slot: _Slot
    length: int  # positions in the cache
    seen: torch.Tensor  # [vocab] bool: ids in the prompt or the reply (repetition penalty)
    settings: RowSampling
    seed_hash: torch.Tensor  # [1]
    penalty: float
    draw_offset: torch.Tensor  # [1] where the next draw starts in the seed's counter-based stream


@dataclass
class Prefilled:
    state: ThinkerState
    logits: torch.Tensor  # [vocab] of the first reply token
    embeds: torch.Tensor  # [L, hidden] input embeddings of the prompt (audio positions hold the encoder's output)
    hidden: torch.Tensor  # [L, hidden] the prompt's states at layer `accept_hidden_layer`


class Thinker:
    """`slots` conversations can be in the thinker at once, each up to `max_len` positions (prompt
    and reply); a further one waits for a slot."""

    def __init__(self, model, accept_hidden_layer: int, slots: int = 1, max_len: int = 4096):
        model.visual = None  # messages are text and audio: the vision encoder's ~1.1 GB (bf16) is not kept
        self.model = model
        self.text = model.get_decoder()  # the text model: embeddings, rotary embedding, decoder layers, norm
        self.accept_hidden_layer = accept_hidden_layer
        self.max_len = max_len
        self.lock = threading.Lock()
        self.graph_pool = GraphPool()  # every graph of the thinker runs under its lock, so they share one pool
        weight = model.get_input_embeddings().weight
        self.device, self.vocab = weight.device, model.lm_head.weight.shape[0]
        self.key_positions = torch.arange(max_len, device=self.device)
        self.masked = torch.tensor(torch.finfo(weight.dtype).min, dtype=weight.dtype, device=self.device)
        self.slots = [_Slot(self, max_len) for _ in range(slots)]
        # Prompts go through graphs per length bucket (zero-padded; causal masking keeps the padding out
        # of every real position) into one staging cache, then into the conversation's slot.
        config = model.config.text_config
        self.buckets = [b for b in PREFILL_BUCKETS if b < max_len] or [max_len]
        self.staging = StaticKV(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, self.buckets[-1], weight.dtype, self.device)
        self.prefill_in = torch.zeros(1, self.buckets[-1], config.hidden_size, dtype=weight.dtype, device=self.device)
        self.prefill_mid = torch.zeros_like(self.prefill_in)
        graphs = self.device.type == "cuda"
        self.prefill_lower = {b: CUDAGraphed(partial(self._prefill_layers, b, 0, accept_hidden_layer), graphs, shared=self.graph_pool)
                              for b in self.buckets}
        self.prefill_upper = {b: CUDAGraphed(partial(self._prefill_layers, b, accept_hidden_layer, config.num_hidden_layers), graphs,
                                             shared=self.graph_pool) for b in self.buckets}
        self.free: queue.Queue[_Slot] = queue.Queue()
        for slot in self.slots:
            self.free.put(slot)

    @torch.inference_mode()
    def use_graphs(self, enabled: bool) -> None:
        """Run the prompt and step as CUDA graphs (on CUDA only), captured now rather than in a user's
        first reply; or eagerly."""
        for graphed in self._graphed():
            graphed.enabled = enabled and self.device.type == "cuda"
        if enabled and self.device.type == "cuda":
            self.warm_up()

    def _graphed(self) -> list[CUDAGraphed]:
        return [slot.step for slot in self.slots] + list(self.prefill_lower.values()) + list(self.prefill_upper.values())

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Capture every graph (a capture's warm-up runs write into the caches, which the next prompt overwrites),
        the largest prompt first: the pool then holds its working memory, which every later capture reuses."""
        with self.lock:
            for bucket in reversed(self.buckets):
                self.prefill_lower[bucket]()
                self.prefill_upper[bucket]()
            for slot in self.slots:
                slot.step()

    @classmethod
    def from_pretrained(cls, directory: Path, device: torch.device, dtype: torch.dtype, accept_hidden_layer: int, **options) -> "Thinker":
        """The `thinker.*` part of an official Qwen3-Omni checkpoint, through transformers' loader
        (which also stacks the per-expert tensors); the talker and code2wav tensors are ours to load."""
        import transformers

        check_transformers_version(transformers.__version__)
        from transformers import logging as hf_logging
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # it would list every talker and code2wav tensor as unexpected
        try:
            config = Qwen3OmniMoeConfig.from_pretrained(str(directory)).thinker_config
            model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(str(directory), config=config, dtype=dtype)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"The thinker in {directory} cannot be loaded: {' '.join(str(exc).split())}") from None
        finally:
            hf_logging.set_verbosity(verbosity)
        if device.type == "cuda":
            # Routed experts without a host sync, so that the step can be a graph: grouped GEMMs with
            # device-side offsets in bf16; in float32 torch's grouped GEMM copies from the host, so gathered weights.
            model.config.text_config._experts_implementation = "grouped_mm" if dtype == torch.bfloat16 else "batched_mm"
        return cls(model.to(device).eval(), accept_hidden_layer, **options)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings of token ids [n] -> [n, hidden] (what the talker's text_projection reads)."""
        return self.model.get_input_embeddings()(tokens.to(self.device))

    def acquire(self, stop: threading.Event | None = None) -> _Slot | None:
        """A free slot, waiting for one if need be; None if `stop` is set meanwhile."""
        while True:
            try:
                return self.free.get(timeout=SLOT_POLL_S)
            except queue.Empty:
                if stop is not None and stop.is_set():
                    return None

    def release(self, slot: _Slot) -> None:
        self.free.put(slot)

    @torch.inference_mode()
    def prefill(self, slot: _Slot, inputs: ThinkerInputs, sampling: ThinkerSampling, seed: int,
                on_accept_layer: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> Prefilled:
        """The prompt through the thinker, into `slot`. `on_accept_layer(embeds, hidden)` is called as
        soon as layer `accept_hidden_layer` is done, before the layers above it run (what the talker's
        prompt needs is known by then, and its prefill overlaps theirs)."""
        input_ids = inputs.input_ids.to(self.device)
        length = input_ids.shape[1]
        bucket = next((b for b in self.buckets if length <= b), None)
        if bucket is None:
            raise ValueError(f"The prompt has {length} positions; the thinker takes at most {self.buckets[-1]}.")
        embeds = self._input_embeds(input_ids, inputs.features)
        with self.lock:  # held throughout: the prompt and staging buffers are shared by all conversations
            self.prefill_in[:, :length].copy_(embeds)
            self.prefill_in[:, length:bucket].zero_()
            lower = self.prefill_lower[bucket]()
            hidden_at_accept = lower[0, :length].clone()
            if on_accept_layer is not None:
                on_accept_layer(embeds[0], hidden_at_accept)
            upper = self.prefill_upper[bucket]()
            logits = self.model.lm_head(upper[:, length - 1 : length])[0, -1]
            slot.kv.load(self.staging, length)
            # Text and audio prompts have sequential multimodal rope positions (no images or video).
            slot.rope_position.fill_(length)
        token_seen = torch.zeros(self.vocab, dtype=torch.bool, device=self.device)
        token_seen[input_ids[0]] = True
        settings = RowSampling.zeros(1, self.device)
        settings.set_row(0, sampling.do_sample, sampling.temperature, sampling.top_k, sampling.top_p)
        penalty = sampling.repetition_penalty if sampling.do_sample else 1.0
        seed_hash = mix32(torch.tensor([seed & M32], device=self.device))
        state = ThinkerState(slot, length, token_seen, settings, seed_hash, penalty, torch.zeros(1, dtype=torch.long, device=self.device))
        return Prefilled(state, logits, embeds[0], hidden_at_accept)

    def _input_embeds(self, input_ids: torch.Tensor, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """[1, L, hidden]: the token embeddings, the audio encoder's output at the audio placeholders."""
        embeds = self.model.get_input_embeddings()(input_ids)
        if "input_features" in features:
            audio = self.model.get_audio_features(features["input_features"].to(self.device, self.model.dtype),
                                                  features["feature_attention_mask"].to(self.device), return_dict=True).last_hidden_state
            placeholders = (input_ids == self.model.config.audio_token_id)[..., None].expand_as(embeds)
            embeds = embeds.masked_scatter(placeholders, audio.to(embeds.dtype))
        return embeds

    def _prefill_layers(self, bucket: int, first: int, last: int) -> torch.Tensor:
        """Layers first..last-1 over `bucket` positions of the prompt buffer (what a prefill graph
        holds), writing keys and values into the staging cache; the lower part reads the input
        embeddings and leaves its output where the upper part reads it."""
        positions = self.key_positions[:bucket]
        self.staging.index = positions
        mask = torch.where(self.key_positions[None, :self.buckets[-1]] <= positions[:, None], 0.0, self.masked).to(self.masked.dtype)
        hidden = self.prefill_in[:, :bucket] if first == 0 else self.prefill_mid[:, :bucket]
        hidden = self._layers(hidden, positions, mask, self.staging, first, last)
        if last < len(self.text.layers):
            self.prefill_mid[:, :bucket].copy_(hidden)
            return self.prefill_mid[:, :bucket]
        return self.text.norm(hidden)

    def _layers(self, hidden: torch.Tensor, rope_positions: torch.Tensor, mask: torch.Tensor, cache: StaticKV,
                first: int, last: int) -> torch.Tensor:
        """Decoder layers first..last-1 over `hidden` [1, n, hidden] at `rope_positions` [n], attending
        where `mask` [n, keys] is 0, keys and values written into `cache`."""
        # Text and audio prompts have sequential multimodal rope positions (no images or video): all three rows alike.
        rope = self.text.rotary_emb(hidden, rope_positions.view(1, 1, -1).expand(3, 1, -1))
        for layer in self.text.layers[first:last]:
            # (hidden, attention_mask, position_ids, cache): the cache by position, as its keyword is
            # `past_key_values` up to transformers 5.23 and `cache` from 5.24.
            hidden = layer(hidden, mask[None, None], None, cache, position_embeddings=rope)
        return hidden

    @torch.inference_mode()
    def step(self, state: ThinkerState, token: int) -> torch.Tensor:
        """Feed the last reply token; logits [vocab] of the next one (valid until the slot's next step)."""
        if state.length >= self.max_len:
            raise ValueError(f"The thinker's cache holds {self.max_len} positions; the reply is longer.")
        with self.lock:
            slot = state.slot
            slot.token.fill_(token)
            logits = slot.step()
            # Outside the graph: a capture's warm-up runs execute the step for real, and a step that
            # moved its own position would then move it three times.
            slot.kv.position.add_(1)
            slot.rope_position.add_(1)
        state.length += 1
        return logits

    def _decode(self, slot: _Slot) -> torch.Tensor:
        """One token of `slot` through the model: what its graph holds."""
        mask = torch.where(self.key_positions <= slot.kv.position, 0.0, self.masked).to(self.masked.dtype)
        hidden = self._layers(self.model.get_input_embeddings()(slot.token), slot.rope_position, mask[None], slot.kv, 0, len(self.text.layers))
        return self.model.lm_head(self.text.norm(hidden))[0, -1]

    @torch.inference_mode()
    def pick(self, state: ThinkerState, logits: torch.Tensor) -> int:
        """The next token from its logits, with the conversation's sampling."""
        logits = logits.float()[None]
        if state.penalty != 1.0:
            penalized = torch.where(logits < 0, logits * state.penalty, logits / state.penalty)
            logits = torch.where(state.seen, penalized, logits)
        noise = exponential_noise(state.seed_hash, state.draw_offset, self.vocab)
        state.draw_offset.add_(self.vocab)  # on the device: a host number copied in would wait for the GPU
        token = state.slot.to_host(sample_rows(logits, state.settings, noise)[:1])
        state.seen[token] = True
        return token
