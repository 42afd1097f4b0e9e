"""Qwen3-Omni's thinker (transformers' module, with its audio encoder), driven one token at a
time for every conversation at once, so that each token goes to the chat and to the talker as
soon as it exists.

`rows` conversations share one decode step. Each holds a row of every per-row buffer: its KV cache
(preallocated, written at the row's position, a device tensor), its next token, its sampling
settings, its seed's counter-based draws and the ids it has seen (repetition penalty). One thread
(the scheduler, `_run`) alternates between one pack of prompts and one decode step over all rows.
A pack is `pack_tokens` prompt positions: the waiting prompts' next positions in arrival order, a
prompt cut where the pack ends and continued in the next, each position writing its key and value
straight into its conversation's row. So prompts that arrive together go through the model
together (one read of the experts' weights for all of them), and a joining conversation delays the
running ones by one pack at a time, never by its whole prompt or reply. A pack waits while a running
reply has yet to write its lead tokens (those of its speech's first two chunks, whose audio a pack
would outrun), a step each.

Batch invariance: a conversation's reply is the same alone and beside others, whatever packs its
prompt shared and wherever they cut it. Every pack and every step runs at one fixed shape (a
pack's unused positions and the rows that hold no conversation compute and are ignored, writing
their keys to a sink position past the end of the cache), so the same dense kernels run whatever
the occupancy and a position's numbers depend only on its own inputs; shapes that followed the
load would let cuBLAS pick kernels by row count. Two operations need more than fixed shapes. The
routed experts: a grouped GEMM picks its tiles by the tokens each expert gets, so on CUDA the pack
runs `pipeline.kernels.grouped_experts` (fixed tiles) and the step `pipeline.kernels.experts`
(each row's own products, skipping rows that hold no conversation); on the CPU both run
`batched_mm`, a product per (token, expert) pair. Attention: every query attends over its own
row's cached keys, through `pipeline.kernels.row_attention` on CUDA (PyTorch's SDPA over a long
masked key range is not reproducible from run to run there; a pack's queries on tensor cores) and
SDPA over the gathered rows on the CPU. These are registered with transformers' experts and attention
interfaces (pipeline/omni/row_invariant.py, with the row caches) and chosen for the pack and the
step alone. On CUDA the step and the pack's two halves (split at the layer the talker reads) are
graphs: in eager PyTorch the 48-layer MoE model is thousands of small launches.

Streams and threads: the scheduler runs its work on a CUDA stream of its own, so what the callers'
threads put on theirs (a new prompt's embeddings and audio encoder, the talker's text projections
of each token) runs beside the thinker's graphs rather than queued behind them. A prompt's
`on_accept_layer` runs on a hand-off thread (and stream) once the pack's lower layers are done:
the talker's prompt is built there while the upper layers run, and whatever it waits for (its
host copies wait for their stream) never holds up the scheduler.

Memory: a row is its KV cache, 2 x layers x KV heads x (`max_len` + 1) x head_dim elements (0.28 GiB
in bf16 at the released size and 3054 positions), and a flag per vocabulary id; the step's working
memory lives in the graph pool that the pack's graphs already hold. pipeline.memory_plan
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
from packaging.version import Version

from pipeline.engine.sampling import M32, RowSampling, exponential_noise, mix32, sample_rows
from pipeline.errors import CheckpointError
from pipeline.graphs import CUDAGraphed, GraphPool
from pipeline.model import known_fields
from pipeline.omni.conversation import ThinkerInputs
from pipeline.omni.row_invariant import (
    PACK_ATTENTION,
    PACK_EXPERTS,
    PACK_SDPA,
    ROW_ATTENTION,
    ROW_EXPERTS,
    PackKV,
    RowKV,
    register_row_kernels,
)

log = logging.getLogger(__name__)
# Prompt positions a pack takes. On CUDA the experts' weights are read once for all of them: 1024 hold
# eight short messages (~70 positions each with the system prompt) and cost one alone about what 512
# do (docs/BENCHMARKS.md). On the CPU the attention gathers each position's row.
PACK_TOKENS = {"cuda": 1024, "cpu": 64}
# The transformers releases the driver is tested on (both ends included); requirements.txt allows these.
SUPPORTED_TRANSFORMERS = ("5.15.1", "5.24.0")
_END = object()  # a reply's last item: the thinker wrote its last token

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


@dataclass(eq=False)  # a live conversation: compared and hashed by identity
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
    ready: "torch.cuda.Event | None" = None  # recorded after `embeds` on the caller's stream (None on the CPU)
    tokens: queue.Queue = field(default_factory=queue.Queue)
    written: int = 0  # tokens written so far (the scheduler's count)
    # Tokens it writes before a pack runs beside it: its speech's first chunks, whose audio a pack
    # (~40 ms at the real size) would outrun (0: packs never wait for it).
    lead_tokens: int = 0
    row: int = -1  # the row it holds, from its prompt's first pack
    prefilled: int = 0  # prompt positions through the model so far
    accept_hidden: torch.Tensor | None = None  # [L, hidden] layer `accept_hidden_layer`'s output, pack by pack (for on_accept_layer)

    @property
    def length(self) -> int:
        return self.embeds.shape[1]

    def __iter__(self) -> Iterator[int]:
        while True:
            item = self.tokens.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class PromptShare(NamedTuple):
    """A prompt's positions in one pack: `count` of them from its position `first`."""

    reply: ThinkerReply
    first: int
    count: int

    @property
    def ends(self) -> bool:
        """The prompt's last position is in this pack."""
        return self.first + self.count == self.reply.length


class Thinker:
    """Up to `rows` conversations at once, each up to `max_len` positions (prompt and reply); a
    further one waits for a row. `start` hands a conversation to the scheduler thread."""

    def __init__(self, model, accept_hidden_layer: int, rows: int = 1, max_len: int = 4096, pack_tokens: int | None = None):
        model.visual = None  # messages are text and audio: the vision encoder's ~1.1 GB (bf16) is not kept
        self.model = model
        self.text = model.get_decoder()  # the text model: embeddings, rotary embedding, decoder layers, norm
        self.accept_hidden_layer = accept_hidden_layer
        self.rows, self.max_len = rows, max_len
        weight = model.get_input_embeddings().weight
        self.device, self.vocab = weight.device, model.lm_head.weight.shape[0]
        self.pack_tokens = pack_tokens or PACK_TOKENS.get(self.device.type, PACK_TOKENS["cpu"])
        config = model.config.text_config
        self.experts = [layer.mlp.experts for layer in self.text.layers if hasattr(layer.mlp, "experts")]
        register_row_kernels()
        if self.device.type == "cuda":
            self._check_expert_layout()
            self.step_kernels, self.pack_kernels = (ROW_EXPERTS, ROW_ATTENTION), (PACK_EXPERTS, PACK_ATTENTION)
        else:
            # Each (token, expert) pair its own product: the CPU's grouped kernel runs one GEMM per expert over
            # however many tokens chose it, and a GEMM's blocking may follow that count, so a row's rounding could
            # follow its neighbours' routing.
            config._experts_implementation = "batched_mm"
            self.step_kernels, self.pack_kernels = ("batched_mm", config._attn_implementation), ("batched_mm", PACK_SDPA)
        self.key_positions = torch.arange(max_len + 1, device=self.device)
        self.masked = torch.tensor(torch.finfo(weight.dtype).min, dtype=weight.dtype, device=self.device)
        self._rows_state(config, weight.dtype)
        self._pack_state(config.hidden_size, weight.dtype)
        self.graph_pool = GraphPool()  # every graph of the thinker runs on its scheduler thread, so they share one pool
        graphs = self.device.type == "cuda"
        self.step_graph = CUDAGraphed(self._decode, graphs, shared=self.graph_pool)
        self.pack_lower = CUDAGraphed(partial(self._pack_layers, 0, accept_hidden_layer), graphs, shared=self.graph_pool)
        self.pack_upper = CUDAGraphed(partial(self._pack_layers, accept_hidden_layer, config.num_hidden_layers), graphs,
                                      shared=self.graph_pool)
        self.lock = threading.Lock()  # the model's buffers: the scheduler's work, or a capture
        self.stream = torch.cuda.Stream(self.device) if graphs else None  # the scheduler's work
        self.handoff = ThreadPoolExecutor(1, thread_name_prefix="thinker-handoff")  # on_accept_layer, in order
        self.handoff_stream = torch.cuda.Stream(self.device) if graphs else None
        self.changed = threading.Condition()
        self.waiting: list[ThinkerReply] = []  # in arrival order, no row yet
        self.prefilling: list[ThinkerReply] = []  # in arrival order, each in its row, its prompt part way through
        self.running: dict[int, ThinkerReply] = {}  # row -> its conversation, writing its reply
        self.scheduler: threading.Thread | None = None

    def _rows_state(self, config, dtype: torch.dtype) -> None:
        """The per-row buffers the decode step reads (a row holding no conversation: token 0 at position 0, inactive)."""
        rows, device = self.rows, self.device
        self.kv = RowKV(config.num_hidden_layers, rows, config.num_key_value_heads, config.head_dim, self.max_len, dtype, device)
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.active = torch.zeros(rows, dtype=torch.bool, device=device)
        self.seen = torch.zeros(rows, self.vocab, dtype=torch.bool, device=device)  # ids in the prompt or the reply
        self.penalty = torch.ones(rows, device=device)
        self.settings = RowSampling.zeros(rows, device)
        self.seed_hash = torch.zeros(rows, dtype=torch.long, device=device)
        self.draw_offset = torch.zeros(rows, dtype=torch.long, device=device)  # where each row's next draw starts in its seed's stream
        cuda = device.type == "cuda"
        self.picked = torch.zeros(rows, dtype=torch.long, pin_memory=cuda)
        self.picked_ready = torch.cuda.Event() if cuda else None

    def _pack_state(self, hidden: int, dtype: torch.dtype) -> None:
        """The buffers a pack reads: its positions' input embeddings, positions (rope and key counts) and rows; and
        each row's last prompt position in the pack (where its first reply token comes from) if its prompt ends there."""
        tokens, device = self.pack_tokens, self.device
        self.pack_in = torch.zeros(1, tokens, hidden, dtype=dtype, device=device)
        self.pack_mid = torch.zeros_like(self.pack_in)
        self.pack_kv = PackKV(self.kv, tokens)
        self.pack_positions = torch.zeros(tokens, dtype=torch.long, device=device)
        self.pack_used = torch.zeros(tokens, dtype=torch.bool, device=device)
        self.pack_last = torch.zeros(self.rows, dtype=torch.long, device=device)
        for experts in self.experts:
            experts.active_rows = self.active  # what the step's row-invariant experts skip
            experts.active_tokens = self.pack_used  # what the pack's skip

    def _check_expert_layout(self) -> None:
        """The row-invariant kernels read transformers' default experts layout: [gate; up] stacked, not transposed, no bias."""
        for experts in self.experts:
            if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True) or getattr(experts, "has_bias", False):
                raise CheckpointError("The thinker's experts are not in transformers' stacked [gate; up] layout that the decode step reads.")

    @contextlib.contextmanager
    def _kernels(self, kernels: tuple[str, str]) -> Iterator[None]:
        """The step's or the pack's experts and attention: transformers dispatch on the config's `_experts_implementation`
        and `_attn_implementation` at each call (traced into the graphs on CUDA)."""
        config = self.model.config.text_config
        before = config._experts_implementation, config._attn_implementation
        config._experts_implementation, config._attn_implementation = kernels
        try:
            yield
        finally:
            config._experts_implementation, config._attn_implementation = before

    @torch.inference_mode()
    def use_graphs(self, enabled: bool) -> None:
        """Run the pack and the step as CUDA graphs (on CUDA only), captured now rather than in a user's
        first reply; or eagerly."""
        for graphed in (self.step_graph, self.pack_lower, self.pack_upper):
            graphed.enabled = enabled and self.device.type == "cuda"
        if enabled and self.device.type == "cuda":
            self.warm_up()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Capture every graph, the pack first: the pool then holds its working memory, which the step's capture
        reuses. A capture's warm-up runs write at the sink of the cache, as every unused position and idle row does."""
        with self.lock:
            if self.running or self.prefilling:
                raise RuntimeError("The thinker's graphs are captured while no conversation runs.")
            self._fill_pack([])
            self.pack_lower()
            self.pack_upper()
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
        return cls(model.to(device).eval(), accept_hidden_layer, **options)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Input embeddings of token ids [n] -> [n, hidden] (what the talker's text_projection reads)."""
        return self.model.get_input_embeddings()(tokens.to(self.device))

    # ---- conversations ---------------------------------------------------------------------------

    @torch.inference_mode()
    def start(self, inputs: ThinkerInputs, sampling: ThinkerSampling, seed: int, max_new_tokens: int, stop_token: int,
              stop: threading.Event, on_accept_layer: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
              lead_tokens: int = 0) -> ThinkerReply:
        """Queue a conversation for a row; its reply comes as the scheduler writes it. `on_accept_layer(embeds,
        hidden)` is called (on the thinker's hand-off thread, its tensors ready on that thread's current stream)
        as soon as the prompt's layer `accept_hidden_layer` is done, while the layers above it run over its last
        pack (what the talker's prompt needs is known by then, and its prefill overlaps theirs); it handles its
        own errors. The audio encoder runs here, on the caller's thread and stream, not in the others' way.
        `lead_tokens`: the tokens it writes before another prompt's pack runs (ThinkerReply.lead_tokens)."""
        length = inputs.input_ids.shape[1]
        if length + max_new_tokens - 1 > self.max_len:
            raise ValueError(f"The thinker's cache holds {self.max_len} positions; a prompt of {length} and a reply of {max_new_tokens} do not fit.")
        reply = ThinkerReply(inputs, self._input_embeds(inputs.input_ids.to(self.device), inputs.features), sampling, seed, max_new_tokens,
                             stop_token, stop, on_accept_layer, ready=self._recorded(), lead_tokens=lead_tokens)
        with self.changed:
            self.waiting.append(reply)
            if self.scheduler is None:
                self.scheduler = threading.Thread(target=self._run, name="thinker-scheduler", daemon=True)
                self.scheduler.start()
            self.changed.notify()
        return reply

    def _recorded(self) -> "torch.cuda.Event | None":
        """An event on the current stream (None on the CPU): another stream waits for it before reading what was made before it."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _on_stream(self, stream: "torch.cuda.Stream | None"):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _run(self) -> None:
        """The scheduler: one pack of the waiting prompts, then one step of the running replies; sleep when there is nothing to do."""
        if self.stream is not None:
            torch.cuda.set_device(self.device)
            self.stream.wait_stream(torch.cuda.default_stream(self.device))  # the graphs' capture and warm-up
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.waiting or self.prefilling or self.running)
            with self.lock, torch.inference_mode(), self._on_stream(self.stream):
                self._admit()
                self._drop_stopped()
                if self.running:
                    self._step_all()

    def _admit(self) -> None:
        """Free rows to waiting conversations, then one pack of the prompts in their rows (a stopped one leaves with no token)."""
        with self.changed:
            for reply in [r for r in self.waiting if r.stop.is_set()]:
                self.waiting.remove(reply)
                reply.tokens.put(_END)
            taken = set(self.running) | {reply.row for reply in self.prefilling}
            free = [row for row in range(self.rows) if row not in taken]
            admitted = [(self.waiting.pop(0), row) for row in free[:len(self.waiting)]]
        for reply, row in admitted:
            self._take_row(reply, row)
        for reply in [r for r in self.prefilling if r.stop.is_set()]:
            self._drop(reply, _END)
        if self.prefilling and not self._leads_pending():
            self._pack()

    def _leads_pending(self) -> bool:
        """Whether a running reply has yet to write its lead tokens: the next pack waits for them (a step
        each), so that a conversation that started alone does not run dry at its second chunk while the
        prompts that came after it go through."""
        return any(reply.written < min(reply.lead_tokens, reply.max_new_tokens) for reply in self.running.values())

    def _take_row(self, reply: ThinkerReply, row: int) -> None:
        """`row` ready for `reply`: its sampling settings, its seed's draws from the start, its prompt's ids seen."""
        reply.row = row
        if reply.ready is not None:  # its embeddings were made on the caller's stream
            torch.cuda.current_stream().wait_event(reply.ready)
            reply.embeds.record_stream(torch.cuda.current_stream())
            reply.embeds.record_stream(self.handoff_stream)
        sampling = reply.sampling
        self.settings.set_row(row, sampling.do_sample, sampling.temperature, sampling.top_k, sampling.top_p)
        self.penalty[row] = sampling.repetition_penalty if sampling.do_sample else 1.0
        self.seed_hash[row:row + 1] = mix32(torch.tensor([reply.seed & M32], device=self.device))
        self.draw_offset[row] = 0
        self.seen[row] = False
        self.seen[row, reply.inputs.input_ids[0].to(self.device)] = True
        if reply.on_accept_layer is not None:
            reply.accept_hidden = torch.empty(reply.length, self.pack_in.shape[2], dtype=self.pack_in.dtype, device=self.device)
        self.prefilling.append(reply)

    def _pack(self) -> None:
        """The next pack of the prompts in their rows; a prompt that ends in it gets its first reply token and starts running."""
        packed = self._fill_pack(self.prefilling)
        try:
            picked = self._pack_through(packed)
        except Exception as exc:  # noqa: BLE001 - each conversation's reader raises it
            log.exception("omni thinker prefill failed")
            for reply, _, _ in packed:
                self._drop(reply, exc)
            return
        for share in packed:
            reply, first, count = share
            reply.prefilled = first + count
            if share.ends:
                self.prefilling.remove(reply)
                self.running[reply.row] = reply
                self._deliver(reply.row, reply, picked[reply.row])

    def _drop(self, reply: ThinkerReply, last: object) -> None:
        """A conversation still taking its prompt ends with `last` (an error its reader raises, or the end of
        the reply); its row is free again."""
        self.prefilling.remove(reply)
        reply.tokens.put(last)
        self._leave(reply.row)

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

    def _fill_pack(self, prompts: list[ThinkerReply]) -> list[PromptShare]:
        """The pack's buffers from the prompts' next positions, in order, until it is full: each prompt's share
        of it. Unused positions read zeros at rope position
        0 of row 0, attend to one key and write at the sink."""
        tokens = self.pack_tokens
        rows = torch.zeros(tokens, dtype=torch.long)
        positions = torch.zeros(tokens, dtype=torch.long)
        last = torch.zeros(self.rows, dtype=torch.long)
        packed, used = [], 0
        for reply in prompts:
            if used == tokens:
                break
            first = reply.prefilled
            count = min(reply.length - first, tokens - used)
            self.pack_in[0, used:used + count].copy_(reply.embeds[0, first:first + count])
            rows[used:used + count] = reply.row
            positions[used:used + count] = torch.arange(first, first + count)
            share = PromptShare(reply, first, count)
            if share.ends:
                last[reply.row] = used + count - 1
            packed.append(share)
            used += count
        self.pack_in[0, used:].zero_()
        self.pack_kv.rows.copy_(rows)
        self.pack_positions.copy_(positions)
        self.pack_used.copy_(torch.arange(tokens) < used)
        self.pack_last.copy_(last)
        return packed

    def _pack_through(self, packed: list[PromptShare]) -> list[int]:
        """The filled pack through the model: the lower layers, each prompt's share of their output kept and
        handed on once its prompt is complete, the upper layers; every row's pick from its prompt's last position
        (used for the rows whose prompt ended in the pack: they start running here)."""
        lower = self.pack_lower()
        offset = 0
        for share in packed:
            reply, first, count = share
            if reply.accept_hidden is not None:
                reply.accept_hidden[first:first + count].copy_(lower[0, offset:offset + count])
                if share.ends:
                    self.handoff.submit(self._hand_off, reply, self._recorded())
            offset += count
        picked = self.pack_upper()
        ending = torch.zeros(self.rows, dtype=torch.bool)
        for share in packed:
            if share.ends:
                ending[share.reply.row] = True
                self.kv.positions[share.reply.row] = share.reply.length
        ending = ending.to(self.device)
        self.tokens[:, 0] = torch.where(ending, picked, self.tokens[:, 0])
        self.active |= ending
        self._commit(picked, ending)
        return self._to_host(picked)

    def _hand_off(self, reply: ThinkerReply, lower_done: "torch.cuda.Event | None") -> None:
        """`reply.on_accept_layer` on the hand-off thread and stream, once the pack's lower layers are done
        (its errors are its own: the talker's side reports them to its conversation)."""
        try:
            with torch.inference_mode(), self._on_stream(self.handoff_stream):
                if lower_done is not None:
                    torch.cuda.current_stream().wait_event(lower_done)
                    reply.accept_hidden.record_stream(torch.cuda.current_stream())
                reply.on_accept_layer(reply.embeds[0], reply.accept_hidden)
        except Exception:  # noqa: BLE001 - a failure here must not stop the thinker's scheduler
            log.exception("omni thinker hand-off failed")

    def _pack_layers(self, first: int, last: int) -> torch.Tensor:
        """Layers first..last-1 over the whole pack (what a pack graph holds), keys and values written into the
        rows; the lower part reads the input embeddings and leaves its output where the upper part reads it, the
        upper part picks every row's next token from the row's `pack_last` position."""
        hidden = self.pack_in if first == 0 else self.pack_mid
        if first == 0:  # an unused position writes at the sink, as an idle row does in the step
            self.pack_kv.write_at.copy_(torch.where(self.pack_used, self.pack_positions, self.kv.sink))
        with self._kernels(self.pack_kernels):
            hidden = self._layers(hidden, self.pack_positions[None], None, self.pack_kv, first, last,
                                  token_rows=self.pack_kv.rows, token_lengths=self.pack_positions + 1)
        if last < len(self.text.layers):
            self.pack_mid.copy_(hidden)
            return self.pack_mid
        logits = self.model.lm_head(self.text.norm(hidden[0, self.pack_last, None]))[:, -1].float()  # [rows, 1, hidden] as in the step
        return self._pick(logits, slice(None), self.settings)

    def _input_embeds(self, input_ids: torch.Tensor, features: dict[str, torch.Tensor]) -> torch.Tensor:
        """[1, L, hidden]: the token embeddings, the audio encoder's output at the audio placeholders."""
        embeds = self.model.get_input_embeddings()(input_ids)
        if "input_features" in features:
            audio = self.model.get_audio_features(features["input_features"].to(self.device, self.model.dtype),
                                                  features["feature_attention_mask"].to(self.device), return_dict=True).last_hidden_state
            placeholders = (input_ids == self.model.config.audio_token_id)[..., None].expand_as(embeds)
            embeds = embeds.masked_scatter(placeholders, audio.to(embeds.dtype))
        return embeds

    def _layers(self, hidden: torch.Tensor, rope_positions: torch.Tensor, mask: torch.Tensor | None, cache: RowKV | PackKV,
                first: int, last: int, **attention: torch.Tensor) -> torch.Tensor:
        """Decoder layers first..last-1 over `hidden` [B, n, hidden] at `rope_positions` [B, n], attending
        where `mask` [B, 1, n, keys] is 0 (or as the `attention` arguments say), keys and values written into `cache`."""
        # Text and audio prompts have sequential multimodal rope positions (no images or video): all three rows alike.
        rope = self.text.rotary_emb(hidden, rope_positions[None].expand(3, -1, -1))
        for layer in self.text.layers[first:last]:
            # (hidden, attention_mask, position_ids, cache): the cache by position, as its keyword is
            # `past_key_values` up to transformers 5.23 and `cache` from 5.24.
            hidden = layer(hidden, mask, None, cache, position_embeddings=rope, **attention)
        return hidden

    def _step(self) -> list[int]:
        """One token of every row: feed each row's last token, pick its next (idle rows compute and are ignored)."""
        picked = self.step_graph()
        # Outside the graph: a capture's warm-up runs execute the step for real, and a step that
        # moved its own state would then move it three times.
        self.tokens[:, 0] = torch.where(self.active, picked, 0)
        self._commit(picked, self.active)
        self.kv.positions.add_(self.active)
        return self._to_host(picked)

    def _commit(self, picked: torch.Tensor, rows: torch.Tensor) -> None:
        """Count the picked tokens as seen and move the rows' draws on, for the rows flagged in `rows` only; on the
        device: a host number copied in would wait for the GPU."""
        self.seen[self.kv.row_ids, picked] |= rows
        self.draw_offset += rows * self.vocab

    def _decode(self) -> torch.Tensor:
        """Every row's next token [rows] from its last one: what the step's graph holds. A row holding no
        conversation writes at the sink (its row may be taking a prompt, pack by pack)."""
        self.kv.write_at.copy_(torch.where(self.active, self.kv.positions, self.kv.sink))
        mask = torch.where(self.key_positions[None] <= self.kv.positions[:, None], 0.0, self.masked).to(self.masked.dtype)
        with self._kernels(self.step_kernels):
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
