"""Qwen3-Omni's thinker (transformers' module, with its audio encoder), driven one token at a
time for every conversation at once, so that each token goes to the chat and to the talker as
soon as it exists.

`rows` conversations share one decode step. Each holds a row of every per-row buffer: its KV cache
(preallocated, written at the row's position, a device tensor), its next token, its sampling
settings, its seed's counter-based draws and the ids it has seen (repetition penalty). One thread
(the scheduler, `_run`) alternates between admitting at most one waiting conversation (its prompt
through the model into a free row, and its first token) and one decode step over all rows, so a new
conversation's prefill delays the others by one prompt, never by its whole reply.

Batch invariance: the step always runs over all `rows` rows and the whole cache (a row that holds
no conversation feeds token 0 at position 0), so the same kernels run whatever the occupancy and
a row's numbers depend only on its own inputs; graphs per batch size would let cuBLAS pick kernels
by row count, and a reply would change with its neighbours. Two operations need more than fixed
shapes. The routed experts: a grouped GEMM picks its tiles by the tokens each expert gets, so the
step's experts run each row's own products (on CUDA `pipeline.kernels.experts`; on the CPU
`batched_mm`, a product per (token, expert) pair), and the CUDA kernel skips the rows that hold no
conversation, so one conversation does not pay for the idle rows' experts. Attention: PyTorch's
SDPA over a long masked key range (one query a row) is not reproducible from run to run on CUDA,
so the step attends through `pipeline.kernels.row_attention` (each row over its own keys only).
Both are registered with transformers' experts and attention interfaces and chosen for the step
alone. On CUDA the step is one graph: in eager PyTorch the 48-layer MoE step is
thousands of small launches. The prompt goes through transformers' decoder layers (grouped GEMM
experts on CUDA: a prompt is one conversation's alone) as two graphs per length bucket, split at the
layer the talker reads, into a staging cache and then into the conversation's row.

Memory: a row is its KV cache, 2 x layers x KV heads x `max_len` x head_dim elements (0.28 GiB in
bf16 at the released size and 3054 positions), and a flag per vocabulary id; the step's working
memory lives in the graph pool that the largest prompt's graphs already hold. pipeline.memory_plan
counts one row per conversation (`thinker_slot_bytes`), and OmniChat builds as many as the free
memory holds after the weights and the fixed reserve, up to its default.

Prompt and step both run transformers' decoder layers and rotary embedding directly (the model's
own forward would rebuild positions and masks from its per-module state). Those are internals
that move between releases (5.21 nests the text model one level deeper, 5.24 renames the layers'
cache argument), so the driver reaches them through `get_decoder()`, passes the cache by position,
and refuses at load a transformers release outside the range it is tested on.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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
# The transformers releases the driver is tested on (both ends included); requirements.txt allows these.
SUPPORTED_TRANSFORMERS = ("5.15.1", "5.24.0")
_END = object()  # a reply's last item: the thinker wrote its last token
# The decode step's experts and attention on CUDA, under these names in transformers' interfaces.
ROW_EXPERTS = "row_invariant"
ROW_ATTENTION = "row_invariant_decode"


def _row_experts_forward(experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward (stacked `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) through the
    row-invariant kernels, skipping the rows its thinker marks inactive (`experts.active_rows`)."""
    from pipeline.kernels.experts import routed_experts

    return routed_experts(hidden_states, top_k_index, top_k_weights, experts.gate_up_proj, experts.down_proj, experts.active_rows)


def _row_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                           scaling: float, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention function for the decode step: each row attends to the prefix of keys its
    mask leaves open (the step's mask is causal, so that prefix is every key it attends to)."""
    from pipeline.kernels.row_attention import decode_attention

    lengths = (attention_mask[:, 0, -1] == 0).sum(-1)
    return decode_attention(query, key, value, lengths, scaling), None


def _register_row_kernels() -> None:
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(ROW_EXPERTS, _row_experts_forward)
    AttentionInterface.register(ROW_ATTENTION, _row_attention_forward)


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
    """Keys and values of every layer for one prompt in fixed buffers; each `update` (called by
    transformers' attention) writes at `index`, the prompt's positions (a device tensor)."""

    def __init__(self, layers: int, heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.keys = torch.zeros(layers, 1, heads, max_len, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.index = torch.arange(max_len, device=device)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer_idx].index_copy_(2, self.index, key)
        self.values[layer_idx].index_copy_(2, self.index, value)
        return self.keys[layer_idx], self.values[layer_idx]


class RowKV:
    """Keys and values of every layer for every row, [layers, rows, heads, max_len, head_dim]; each
    `update` (called by transformers' attention in the decode step) writes row r's one new key at
    `positions[r]`, a device tensor, so a graph replay writes where each row stands."""

    def __init__(self, layers: int, rows: int, heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.keys = torch.zeros(layers, rows, heads, max_len, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.row_ids = torch.arange(rows, device=device)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        # key, value: [rows, heads, 1, head_dim]
        self.keys[layer_idx][self.row_ids, :, self.positions] = key[:, :, 0]
        self.values[layer_idx][self.row_ids, :, self.positions] = value[:, :, 0]
        return self.keys[layer_idx], self.values[layer_idx]

    def load(self, row: int, prompt: StaticKV, length: int) -> None:
        """Take over the first `length` positions of `prompt` (prefilled there) into `row`."""
        self.keys[:, row, :, :length].copy_(prompt.keys[:, 0, :, :length])
        self.values[:, row, :, :length].copy_(prompt.values[:, 0, :, :length])
        self.positions[row] = length


@dataclass
class ThinkerReply:
    """One conversation's reply as the thinker writes it: iterate for its token ids (the first as
    soon as the prompt is through). The iteration ends after `max_new_tokens` tokens, after the
    stop token, or soon after `stop` is set (then possibly with no token at all); an error in the
    thinker's work for it is raised here."""

    inputs: ThinkerInputs
    embeds: torch.Tensor  # [1, L, hidden] the prompt's input embeddings
    sampling: ThinkerSampling
    seed: int
    max_new_tokens: int
    stop_token: int
    stop: threading.Event
    on_accept_layer: Callable[[torch.Tensor, torch.Tensor], None] | None
    tokens: queue.Queue = field(default_factory=queue.Queue)
    written: int = 0  # tokens written so far (the scheduler's count)

    def __iter__(self) -> Iterator[int]:
        while True:
            item = self.tokens.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class Thinker:
    """Up to `rows` conversations at once, each up to `max_len` positions (prompt and reply); a
    further one waits for a row. `start` hands a conversation to the scheduler thread."""

    def __init__(self, model, accept_hidden_layer: int, rows: int = 1, max_len: int = 4096):
        model.visual = None  # messages are text and audio: the vision encoder's ~1.1 GB (bf16) is not kept
        self.model = model
        self.text = model.get_decoder()  # the text model: embeddings, rotary embedding, decoder layers, norm
        self.accept_hidden_layer = accept_hidden_layer
        self.rows, self.max_len = rows, max_len
        weight = model.get_input_embeddings().weight
        self.device, self.vocab = weight.device, model.lm_head.weight.shape[0]
        config = model.config.text_config
        self.experts = [layer.mlp.experts for layer in self.text.layers if hasattr(layer.mlp, "experts")]
        if self.device.type == "cuda":
            self._check_expert_layout()
            _register_row_kernels()
            self.step_kernels = (ROW_EXPERTS, ROW_ATTENTION)
        else:
            # Each (token, expert) pair its own product: the CPU's grouped kernel runs one GEMM per expert over
            # however many tokens chose it, and a GEMM's blocking may follow that count, so a row's rounding could
            # follow its neighbours' routing.
            config._experts_implementation = "batched_mm"
            self.step_kernels = (config._experts_implementation, config._attn_implementation)
        self.key_positions = torch.arange(max_len, device=self.device)
        self.masked = torch.tensor(torch.finfo(weight.dtype).min, dtype=weight.dtype, device=self.device)
        self._rows_state(config, weight.dtype)
        self.graph_pool = GraphPool()  # every graph of the thinker runs on its scheduler thread, so they share one pool
        graphs = self.device.type == "cuda"
        self.step_graph = CUDAGraphed(self._decode, graphs, shared=self.graph_pool)
        # Prompts go through graphs per length bucket (zero-padded; causal masking keeps the padding out
        # of every real position) into one staging cache, then into the conversation's row.
        self.buckets = [b for b in PREFILL_BUCKETS if b < max_len] or [max_len]
        self.staging = StaticKV(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, self.buckets[-1], weight.dtype, self.device)
        self.prefill_in = torch.zeros(1, self.buckets[-1], config.hidden_size, dtype=weight.dtype, device=self.device)
        self.prefill_mid = torch.zeros_like(self.prefill_in)
        self.prefill_lower = {b: CUDAGraphed(partial(self._prefill_layers, b, 0, accept_hidden_layer), graphs, shared=self.graph_pool)
                              for b in self.buckets}
        self.prefill_upper = {b: CUDAGraphed(partial(self._prefill_layers, b, accept_hidden_layer, config.num_hidden_layers), graphs,
                                             shared=self.graph_pool) for b in self.buckets}
        self.lock = threading.Lock()  # the model's buffers: the scheduler's work, or a capture
        self.changed = threading.Condition()
        self.waiting: list[ThinkerReply] = []  # in arrival order
        self.running: dict[int, ThinkerReply] = {}  # row -> its conversation
        self.scheduler: threading.Thread | None = None

    def _rows_state(self, config, dtype: torch.dtype) -> None:
        """The per-row buffers the decode step reads (a row holding no conversation: token 0 at position 0, inactive)."""
        rows, device = self.rows, self.device
        self.kv = RowKV(config.num_hidden_layers, rows, config.num_key_value_heads, config.head_dim, self.max_len, dtype, device)
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.active = torch.zeros(rows, dtype=torch.bool, device=device)
        for experts in self.experts:
            experts.active_rows = self.active  # what the step's row-invariant experts skip
        self.seen = torch.zeros(rows, self.vocab, dtype=torch.bool, device=device)  # ids in the prompt or the reply
        self.penalty = torch.ones(rows, device=device)
        self.settings = RowSampling.zeros(rows, device)
        self.seed_hash = torch.zeros(rows, dtype=torch.long, device=device)
        self.draw_offset = torch.zeros(rows, dtype=torch.long, device=device)  # where each row's next draw starts in its seed's stream
        cuda = device.type == "cuda"
        self.picked = torch.zeros(rows, dtype=torch.long, pin_memory=cuda)
        self.picked_ready = torch.cuda.Event() if cuda else None

    def _check_expert_layout(self) -> None:
        """The row-invariant kernels read transformers' default experts layout: [gate; up] stacked, not transposed, no bias."""
        for experts in self.experts:
            if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True) or getattr(experts, "has_bias", False):
                raise CheckpointError("The thinker's experts are not in transformers' stacked [gate; up] layout that the decode step reads.")

    @contextlib.contextmanager
    def _step_kernels(self) -> Iterator[None]:
        """The decode step's experts and attention: transformers dispatch on the config's `_experts_implementation`
        and `_attn_implementation` at each call, and the step's (traced into its graph on CUDA) differ from the prompt's."""
        config = self.model.config.text_config
        before = config._experts_implementation, config._attn_implementation
        config._experts_implementation, config._attn_implementation = self.step_kernels
        try:
            yield
        finally:
            config._experts_implementation, config._attn_implementation = before

    @torch.inference_mode()
    def use_graphs(self, enabled: bool) -> None:
        """Run the prompt and step as CUDA graphs (on CUDA only), captured now rather than in a user's
        first reply; or eagerly."""
        for graphed in self._graphed():
            graphed.enabled = enabled and self.device.type == "cuda"
        if enabled and self.device.type == "cuda":
            self.warm_up()

    def _graphed(self) -> list[CUDAGraphed]:
        return [self.step_graph] + list(self.prefill_lower.values()) + list(self.prefill_upper.values())

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Capture every graph, the largest prompt first: the pool then holds its working memory, which every
        later capture reuses. A capture's warm-up runs write into the staging cache, which the next prompt
        overwrites, and at position 0 of rows that hold no conversation (as every step does)."""
        with self.lock:
            if self.running:
                raise RuntimeError("The thinker's graphs are captured while no conversation runs.")
            for bucket in reversed(self.buckets):
                self.prefill_lower[bucket]()
                self.prefill_upper[bucket]()
            self.step_graph()

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

    # ---- conversations ---------------------------------------------------------------------------

    @torch.inference_mode()
    def start(self, inputs: ThinkerInputs, sampling: ThinkerSampling, seed: int, max_new_tokens: int, stop_token: int,
              stop: threading.Event, on_accept_layer: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> ThinkerReply:
        """Queue a conversation for a row; its reply comes as the scheduler writes it. `on_accept_layer(embeds,
        hidden)` is called (on the scheduler's thread) as soon as the prompt's layer `accept_hidden_layer` is
        done, before the layers above it run (what the talker's prompt needs is known by then, and its prefill
        overlaps theirs). The audio encoder runs here, on the caller's thread, not in the others' way."""
        length = inputs.input_ids.shape[1]
        if length > self.buckets[-1]:
            raise ValueError(f"The prompt has {length} positions; the thinker takes at most {self.buckets[-1]}.")
        if length + max_new_tokens - 1 > self.max_len:
            raise ValueError(f"The thinker's cache holds {self.max_len} positions; a prompt of {length} and a reply of {max_new_tokens} do not fit.")
        reply = ThinkerReply(inputs, self._input_embeds(inputs.input_ids.to(self.device), inputs.features), sampling, seed, max_new_tokens,
                             stop_token, stop, on_accept_layer)
        with self.changed:
            self.waiting.append(reply)
            if self.scheduler is None:
                self.scheduler = threading.Thread(target=self._run, name="thinker-scheduler", daemon=True)
                self.scheduler.start()
            self.changed.notify()
        return reply

    def _run(self) -> None:
        """The scheduler: admit at most one waiting conversation, then one step of all of them; sleep when there is nothing to do."""
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.waiting or self.running)
            with self.lock, torch.inference_mode():
                self._admit_one()
                self._drop_stopped()
                if self.running:
                    self._step_all()

    def _admit_one(self) -> None:
        """The first waiting conversation into a free row (a stopped one leaves the queue with no token)."""
        with self.changed:
            for reply in [r for r in self.waiting if r.stop.is_set()]:
                self.waiting.remove(reply)
                reply.tokens.put(_END)
            free = [row for row in range(self.rows) if row not in self.running]
            if not self.waiting or not free:
                return
            reply, row = self.waiting.pop(0), free[0]
        try:
            token = self._prefill(row, reply)
        except Exception as exc:  # noqa: BLE001 - the conversation's reader raises it
            log.exception("omni thinker prefill failed")
            reply.tokens.put(exc)
            self._leave(row)
            return
        self.running[row] = reply
        self._deliver(row, reply, token)

    def _deliver(self, row: int, reply: ThinkerReply, token: int) -> None:
        reply.written += 1
        reply.tokens.put(token)
        if token == reply.stop_token or reply.written == reply.max_new_tokens or reply.stop.is_set():
            self._finish(row)

    def _finish(self, row: int) -> None:
        self.running.pop(row).tokens.put(_END)
        self._leave(row)

    def _drop_stopped(self) -> None:
        for row in [row for row, reply in self.running.items() if reply.stop.is_set()]:
            self._finish(row)

    def _step_all(self) -> None:
        try:
            picked = self._step()
        except Exception as exc:  # noqa: BLE001
            log.exception("omni thinker step failed")
            for row in list(self.running):
                self.running.pop(row).tokens.put(exc)
                self._leave(row)
            return
        for row, reply in list(self.running.items()):
            self._deliver(row, reply, picked[row])

    def _leave(self, row: int) -> None:
        """The row back to its idle state: token 0 at position 0, inactive (every idle row computes the same)."""
        self.active[row] = False
        self.tokens[row] = 0
        self.kv.positions[row] = 0

    # ---- the model -------------------------------------------------------------------------------

    def _prefill(self, row: int, reply: ThinkerReply) -> int:
        """The prompt through the thinker into `row`; its first reply token."""
        input_ids = reply.inputs.input_ids.to(self.device)
        length = input_ids.shape[1]
        bucket = next(b for b in self.buckets if length <= b)
        self.prefill_in[:, :length].copy_(reply.embeds)
        self.prefill_in[:, length:bucket].zero_()
        lower = self.prefill_lower[bucket]()
        if reply.on_accept_layer is not None:
            reply.on_accept_layer(reply.embeds[0], lower[0, :length].clone())
        upper = self.prefill_upper[bucket]()
        logits = self.model.lm_head(upper[:, length - 1 : length])[0, -1]
        self.kv.load(row, self.staging, length)
        sampling = reply.sampling
        self.settings.set_row(row, sampling.do_sample, sampling.temperature, sampling.top_k, sampling.top_p)
        self.penalty[row] = sampling.repetition_penalty if sampling.do_sample else 1.0
        self.seed_hash[row:row + 1] = mix32(torch.tensor([reply.seed & M32], device=self.device))
        self.draw_offset[row] = 0
        self.seen[row] = False
        self.seen[row, input_ids[0]] = True
        rows = slice(row, row + 1)
        picked = self._pick(logits.float()[None], rows, self.settings.select(rows))
        self.tokens[row] = picked[0]
        self.active[row] = True
        self._commit(picked, rows)
        return self._to_host(picked)[0]

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
        hidden = self._layers(hidden, positions[None], mask[None, None], self.staging, first, last)
        if last < len(self.text.layers):
            self.prefill_mid[:, :bucket].copy_(hidden)
            return self.prefill_mid[:, :bucket]
        return self.text.norm(hidden)

    def _layers(self, hidden: torch.Tensor, rope_positions: torch.Tensor, mask: torch.Tensor, cache: StaticKV | RowKV,
                first: int, last: int) -> torch.Tensor:
        """Decoder layers first..last-1 over `hidden` [B, n, hidden] at `rope_positions` [B, n], attending
        where `mask` [B, 1, n, keys] is 0, keys and values written into `cache`."""
        # Text and audio prompts have sequential multimodal rope positions (no images or video): all three rows alike.
        rope = self.text.rotary_emb(hidden, rope_positions[None].expand(3, -1, -1))
        for layer in self.text.layers[first:last]:
            # (hidden, attention_mask, position_ids, cache): the cache by position, as its keyword is
            # `past_key_values` up to transformers 5.23 and `cache` from 5.24.
            hidden = layer(hidden, mask, None, cache, position_embeddings=rope)
        return hidden

    def _step(self) -> list[int]:
        """One token of every row: feed each row's last token, pick its next (idle rows compute and are ignored)."""
        picked = self.step_graph()
        # Outside the graph: a capture's warm-up runs execute the step for real, and a step that
        # moved its own state would then move it three times.
        everything = slice(None)
        self.tokens[:, 0] = torch.where(self.active, picked, 0)
        self._commit(picked, everything)
        self.kv.positions.add_(self.active)
        return self._to_host(picked)

    def _commit(self, picked: torch.Tensor, rows: slice) -> None:
        """Count the picked tokens as seen and move the rows' draws on, for active rows only; on the device:
        a host number copied in would wait for the GPU."""
        active = self.active[rows]
        row_ids = self.kv.row_ids[rows]
        self.seen[row_ids, picked] |= active
        self.draw_offset[rows] += active * self.vocab

    def _decode(self) -> torch.Tensor:
        """Every row's next token [rows] from its last one: what the step's graph holds."""
        mask = torch.where(self.key_positions[None] <= self.kv.positions[:, None], 0.0, self.masked).to(self.masked.dtype)
        with self._step_kernels():
            hidden = self._layers(self.model.get_input_embeddings()(self.tokens), self.kv.positions[:, None], mask[:, None, None], self.kv,
                                  0, len(self.text.layers))
        logits = self.model.lm_head(self.text.norm(hidden))[:, -1].float()
        return self._pick(logits, slice(None), self.settings)

    def _pick(self, logits: torch.Tensor, rows: slice, settings: RowSampling) -> torch.Tensor:
        """Tokens [n] of rows `rows` from their logits [n, vocab] (float32), with each row's penalty, settings and draws."""
        penalty = self.penalty[rows, None]
        penalized = torch.where(logits < 0, logits * penalty, logits / penalty)  # a penalty of 1 leaves every logit as it is
        logits = torch.where(self.seen[rows], penalized, logits)
        noise = exponential_noise(self.seed_hash[rows], self.draw_offset[rows], self.vocab)
        return sample_rows(logits, settings, noise)

    def _to_host(self, tokens: torch.Tensor) -> list[int]:
        """Picked tokens on the host. `.tolist()` would hold the GIL while the GPU works, stalling the
        engine's threads for the whole thinker step; an event wait releases it."""
        if self.picked_ready is None:
            return tokens.tolist()
        picked = self.picked[:len(tokens)]
        picked.copy_(tokens, non_blocking=True)
        self.picked_ready.record()
        self.picked_ready.synchronize()
        return picked.tolist()
