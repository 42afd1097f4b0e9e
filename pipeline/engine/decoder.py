"""The batched decode step: static per-row state for up to `rows` utterances, one frame per call.

A row is one utterance in flight (moshi's LMGen keeps such per-stream state; here it is a row of
every buffer). `step()` advances every row that can run - occupied, not ended, under its frame
limit, and with its next text available - and leaves every other row's state untouched, so rows
join (`start`), wait for text (`append_text`) and leave (`stop`) between frames. The step reads
only static buffers (no `.item()`, no branch on tensor values), so on CUDA one graph captures a
whole frame for the whole batch: the 15 code-predictor steps with their sampling, the next talker
input, the talker step and the sampling of the next codebook-0 token. With the fused kernels on
CUDA (`_frame_in_kernels`) the glue between them (code embeddings, the talker's input, logit
processors, noise, the commit of each row's state) runs inside the sampling kernels: 79 kernels a
frame fewer than in PyTorch ops (547 a frame for the 0.6B, 548 for the 1.7B).

Batch invariance: every shape in the step is fixed (all `rows` rows, the whole cache), so the same
kernels run whatever the occupancy, and a row's numbers depend only on its own inputs. Kernels
chosen per batch size (cuBLAS picks GEMM algorithms by M, reductions pick their thread layout by
the number of rows) would make a row's codes depend on how many neighbours it has.

Row blocks (`KernelConfig.row_blocks`, with the frame in kernels): the frame runs over the first 1, 2, 4, ...
rows, the smallest block that holds every occupied row (the engine fills the lowest free row
first), one graph per block, so a lone listener's frame costs what an engine of one row's does.
The fused kernels' arithmetic does not depend on the number of rows (`pipeline.kernels.decode`);
the frame runs no cuBLAS matmul (whose algorithm follows the row count).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial

import torch
import torch.nn.functional as F

from pipeline.engine.sampling import M32, RowSampling, SamplingConfig, exponential_noise, mix32, sample_rows
from pipeline.graphs import CUDAGraphed

# pipeline.kernels imports Triton only when a kernel runs; its submodule sampling imports it at its own
# import, so it is imported where the frame runs in kernels: a CPU-only install has no Triton.
from pipeline.kernels import FrameText, RowState, fused_available, fused_decode, fused_decode_logits, fused_linear, fused_prefill, fused_sample, fused_supported
from pipeline.kernels.config import KernelConfig
from pipeline.model import Talker, Transformer, prefill_layer

MIN_NEW_TOKENS = 2  # Qwen3-TTS's reference masks EOS for the first two codebook-0 tokens (Qwen3-Omni's: none)
PREFILL_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048)  # prompts are zero-padded to one of these lengths
# The decode step is a chain of ~600 small kernels; the vocoder's convolutions fill the GPU. With
# the step's kernels first in line for free SMs, the two overlap instead of taking turns.
GENERATION_PRIORITY = -1


@dataclass(frozen=True)
class RowBlock(RowState):
    """The first `count` rows of a BatchDecoder's per-row buffers (views): what a frame over those
    rows reads and writes (its `RowState` part is what `next_token` advances)."""

    count: int
    codes: torch.Tensor
    trailing: torch.Tensor
    code_predictor_input: torch.Tensor
    predictor_next: torch.Tensor
    projected_input: torch.Tensor
    projected_next: torch.Tensor
    talker_input: torch.Tensor
    next_hidden: torch.Tensor
    talker_sampling: RowSampling
    sub_sampling: RowSampling
    cp_positions: list[torch.Tensor]


ROW_BUFFERS = tuple(f.name for f in fields(RowBlock) if f.type == "torch.Tensor")  # the decoder's buffers of the same names, sliced


def block_sizes(rows: int) -> list[int]:
    """Row counts a frame may run over: 1, 2, 4, ... below `rows`, then `rows`."""
    return [1 << i for i in range(rows.bit_length()) if 1 << i < rows] + [rows]


@dataclass(frozen=True)
class DecodeConfig:
    """How a BatchDecoder runs its model, resolved once from the flags and the device (`for_talker`)
    and handed down whole: nothing in the decoder reads a setting from elsewhere.

    `rows` utterances at once over caches of `max_seq` positions; `graphs`: the step, prefill and
    extension as CUDA graphs (CUDA only); `compiled`: the PyTorch path's step and, where the fused
    kernels do not prefill, the prefill layer torch.compile'd; `fused`: the transformer layers of the step in pipeline.kernels' Triton kernels,
    and on CUDA its sampling too; `frame_kernels`: with `fused` and dense layers in both transformers,
    the whole frame in kernels (`_frame_in_kernels`: sampling, code embeddings, the talker's input and
    head, the logit processors and the commit of the row state inside them), else that glue in
    PyTorch's ops; `kernels`: the fused kernels' tiles and launch options, whose `row_blocks` runs each
    frame in kernels over the smallest block of first rows holding every occupied row;
    `min_new_tokens`: codebook-0 draws before EOS may be drawn."""

    rows: int
    max_seq: int
    graphs: bool
    compiled: bool
    fused: bool
    frame_kernels: bool
    kernels: KernelConfig
    min_new_tokens: int = MIN_NEW_TOKENS

    @classmethod
    def for_talker(cls, talker: Talker, rows: int, max_seq: int, graphs: bool = True, compiled: bool = False, fused: bool | None = None,
                   frame_kernels: bool | None = None, kernels: KernelConfig | None = None, min_new_tokens: int = MIN_NEW_TOKENS) -> "DecodeConfig":
        """The configuration for `talker` on its device. Defaults: fused where `fused_available` says the
        GPU runs the kernels; the frame in kernels on CUDA where both transformers are dense; the
        kernel configuration of the GPU's architecture (`KernelConfig.for_device`; another
        architecture's runs where the GPU has what it needs)."""
        device = talker.codec_head.weight.device
        fused = fused_available(device) if fused is None else fused
        kernels = KernelConfig.for_device(device) if kernels is None else kernels
        if device.type == "cuda" and fused and not kernels.runs_on(torch.cuda.get_device_capability(device)):
            raise ValueError(f"The kernels' configuration for compute capability {kernels.capability} does not run on this GPU "
                             f"(compute capability {torch.cuda.get_device_capability(device)}).")
        frame_kernels = (fused and fused_supported(talker.model) and fused_supported(talker.code_predictor.model)
                         and (device.type == "cuda" if frame_kernels is None else frame_kernels))
        return cls(rows, max_seq, graphs and device.type == "cuda", compiled, fused, frame_kernels, kernels, min_new_tokens)


class BatchDecoder:
    def __init__(self, talker: Talker, tts_pad: torch.Tensor, settings: DecodeConfig):
        """`settings`: see DecodeConfig (`DecodeConfig.for_talker` builds it for `talker`)."""
        rows, max_seq, compiled = settings.rows, settings.max_seq, settings.compiled
        config = talker.config
        weight = talker.codec_head.weight
        device, dtype = weight.device, weight.dtype
        self.talker, self.rows, self.max_seq = talker, rows, max_seq
        talker.model.setup_caches(rows, max_seq)
        talker.code_predictor.model.setup_caches(rows, config.num_code_groups)
        self.vocab = config.vocab_size
        self.sub_vocab = config.code_predictor_config.vocab_size
        self.sub_steps = config.num_code_groups - 1
        self.draws_per_frame = self.vocab + self.sub_steps * self.sub_vocab
        self.eos_id = config.codec_eos_token_id
        self.min_new_tokens = settings.min_new_tokens
        self.suppressed = torch.zeros(self.vocab, dtype=torch.bool, device=device)
        self.suppressed[self.vocab - 1024 :] = True
        self.suppressed[self.eos_id] = False
        self.tts_pad = tts_pad.to(device=device, dtype=dtype)
        self.all_rows = torch.arange(rows, device=device)
        # Positions of each code-predictor step, [rows, 2] then [rows, 1]s, contiguous (the fused step reads them flat).
        cp_pos = torch.arange(config.num_code_groups, device=device).expand(rows, -1)
        self.cp_positions = [cp_pos[:, : 2].contiguous()] + [cp_pos[:, h + 1 : h + 2].contiguous() for h in range(1, self.sub_steps)]

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        # Per-row state.
        self.active = zeros(rows, dtype=torch.bool)  # occupied and not cancelled
        # The code predictor's first input: the talker's output of the last position, and the embedding of codebook 0 of the frame.
        self.code_predictor_input = zeros(rows, 2, config.hidden_size, dtype=dtype)
        self.hidden = self.code_predictor_input[:, 0]
        self.token = zeros(rows)  # codebook 0 of the next frame
        self.pos = zeros(rows)  # next talker position
        self.frame = zeros(rows)  # frames produced so far
        self.max_frame = zeros(rows)
        self.seen = zeros(rows, self.vocab, dtype=torch.bool)  # codebook-0 ids so far (repetition penalty)
        self.seed_hash = zeros(rows)
        self.trailing = zeros(rows, max_seq, config.hidden_size, dtype=dtype)  # text fed with frame k
        self.text_len = zeros(rows)
        self.text_len_host = [0] * rows  # the same, known without a device sync
        self.text_end_host = [False] * rows  # text_end, known without a device sync
        self.prompt_in = [False] * rows  # the row's whole prompt is prefilled: it runs once it has text
        self.text_end = zeros(rows, dtype=torch.bool)  # no more text will come: pad after text_len
        self.penalty = torch.ones(rows, device=device)
        self.talker_sampling = RowSampling.zeros(rows, device)
        self.sub_sampling = RowSampling.zeros(rows, device)
        # Step outputs.
        self.codes = zeros(rows, config.num_code_groups)
        self.produced = zeros(rows, dtype=torch.bool)

        self.fused, self.frame_kernels, self.kernels = settings.fused, settings.frame_kernels, settings.kernels
        self.talker_decode = self._decode_step(talker.model, compiled)
        self.predictor_logits = self._logits_step(talker.code_predictor.model, compiled)
        self.talker_extend = talker.model.extend
        self.sample, self.noise = sample_rows, exponential_noise
        self.embed_codes = talker.embed_codes
        if compiled and not self.frame_kernels:
            # Every model in the process adds entries to dynamo's cache; the default limit of 8 would stop the third.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            options = dict(fullgraph=True, dynamic=False)
            self.sample, self.noise = torch.compile(sample_rows, **options), torch.compile(exponential_noise, **options)
            self.embed_codes = torch.compile(talker.embed_codes, **options)  # 16 lookups and their sum: one kernel
        if self.fused and device.type == "cuda":
            # One kernel instead of a sort, two softmaxes, a scan and an argmax, 16 times a frame
            # (not on CPU: Triton's interpreter takes a third of a second per row).
            self.sample = partial(fused_sample, config=self.kernels)
        self.talker_prefill = self._prefill_function(talker.model, compiled)
        project = talker.code_predictor.small_to_mtp_projection
        projects = isinstance(project, torch.nn.Linear)  # the 1.7B's: the talker is wider than its code predictor
        if self.frame_kernels:
            self.code_tables, self.table_starts = stack_code_tables(talker)
            self.predictor_next = zeros(rows, 1, config.hidden_size, dtype=dtype)
            # The code predictor's inputs in its width (the 1.7B's input projection writes them; the 0.6B's are its inputs).
            self.projected_input, self.projected_next = (
                (zeros(rows, 2, project.out_features, dtype=dtype), zeros(rows, 1, project.out_features, dtype=dtype))
                if projects else (self.code_predictor_input, self.predictor_next))
            self.talker_input = zeros(rows, 1, config.hidden_size, dtype=dtype)
            self.next_hidden = zeros(rows, config.hidden_size, dtype=dtype)
            # The code predictor's next inputs come from its tables already in its width (the 1.7B's
            # projected once here): one input projection a frame instead of 15.
            self.next_tables = (project_code_tables(talker.code_predictor.model, project, self.code_tables, self.kernels) if projects
                                else self.code_tables)
        self.use_cuda_graphs = settings.graphs
        row_blocks = self.frame_kernels and self.kernels.row_blocks
        self.block_sizes = block_sizes(rows) if row_blocks else [rows]
        self.occupied = [False] * rows  # rows between start() and stop(), known without a device sync
        # `_step`'s PyTorch ops embed the codes its sampling kernels draw: not run with those kernels skipped (CUDAGraphed's `ahead`).
        self.step_graphs = {n: CUDAGraphed(partial(self._frame_in_kernels, self._row_block(n)) if self.frame_kernels else self._step,
                                           self.use_cuda_graphs, priority=GENERATION_PRIORITY, ahead=self.frame_kernels) for n in self.block_sizes}
        self.buckets = sorted({min(b, max_seq) for b in PREFILL_BUCKETS})
        self.prefill_row = zeros(1)
        self.prefill_in = {b: zeros(1, b, config.hidden_size, dtype=dtype) for b in self.buckets}
        self.prefill_graphs = {b: CUDAGraphed(partial(self._prefill_bucket, b), self.use_cuda_graphs, priority=GENERATION_PRIORITY) for b in self.buckets}
        self.prompt_len_host = [0] * rows
        self.extend_in = zeros(1, 1, config.hidden_size, dtype=dtype)
        self.extend_pos = zeros(1, 1)
        self.extend_graph = CUDAGraphed(self._extend_one, self.use_cuda_graphs, priority=GENERATION_PRIORITY)

    def _prefill_function(self, model: Transformer, compiled: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """(x [1, L, hidden], row [1]) -> `model.prefill(x, row)`: pipeline.kernels' prefill where the fused kernels run on a
        GPU and apply (dense layers), else the module's, its layer torch.compile'd where `compiled`. Eager, a prefill is ~50
        kernels a layer: on an H100 the 0.6B's graph of 32 positions takes 4.34 ms against 1.36 with the layer compiled, a
        stall for the running rows; the kernels' prefill needs no compile by torch.compile at start."""
        if self.fused and model.norm.weight.is_cuda and fused_supported(model):
            return partial(fused_prefill, model)
        if compiled:
            # One compile of one layer serves every layer and every bucket length.
            return partial(model.prefill, layer_step=torch.compile(prefill_layer, fullgraph=True, dynamic=True))
        return model.prefill

    def _decode_step(self, model: Transformer, compiled: bool):
        """`model`'s decode step: the fused kernels where asked for and they apply (dense layers), else the module's own."""
        if self.fused and fused_supported(model):
            return partial(fused_decode, model, config=self.kernels)
        return torch.compile(model.decode, fullgraph=True, dynamic=False) if compiled else model.decode

    def _logits_step(self, model: Transformer, compiled: bool):
        """(x, positions, head weight) -> float32 logits of the last position: `model`'s decode step and
        the head, with the final norm and the head in one kernel where the fused kernels apply."""
        if self.fused and fused_supported(model):
            return partial(fused_decode_logits, model, config=self.kernels)
        decode = self._decode_step(model, compiled)
        return lambda x, positions, head: F.linear(decode(x, positions)[:, -1], head).float()

    # ---- rows joining, waiting and leaving ---------------------------------------------------

    def max_frames(self, prompt_length: int) -> int:
        """Frames a row can hold after a prompt of this length (its cache is `max_seq` positions)."""
        return self.max_seq - prompt_length - 1

    @torch.inference_mode()
    def start(self, row: int, prompt: torch.Tensor, trailing: torch.Tensor, text_end: bool, sampling: SamplingConfig, seed: int, max_frames: int,
              awaits: int = 0) -> None:
        """Prefill `prompt` [1, L, hidden] into `row` and sample its first codebook-0 token.

        `trailing` [T, hidden]: the text fed alongside frames 0..T-1; after it, tts_pad once
        `text_end`, or the row waits for `append_text`. `awaits`: the prompt's last positions are
        not known yet (`finish_prompt` brings them); the row waits for them, its prefix prefilled."""
        length = prompt.shape[1]
        if not 1 <= max_frames <= self.max_frames(length + awaits):
            raise ValueError(f"A prompt of {length + awaits} positions leaves room for 1..{self.max_frames(length + awaits)} frames, not {max_frames}.")
        self._set_sampling(row, sampling)
        # Per-row values are written with fill_ (the value travels as a kernel argument): `t[row] = v`
        # copies a host scalar tensor in and waits for the stream to drain, so an admission would
        # wait for the frame in flight, 17 times over.
        self.occupied[row] = True
        self.prompt_in[row] = False
        self.seed_hash[row].fill_(int(mix32(torch.tensor(seed & M32))))
        self.seen[row].fill_(False)
        self.frame[row].fill_(0)
        self.pos[row].fill_(length)
        self.max_frame[row].fill_(max_frames)
        self.text_len_host[row] = 0
        self.append_text(row, trailing, text_end)
        hidden = self._prefill(row, prompt)
        self.prompt_len_host[row] = length
        if not awaits:
            self._begin(row, hidden)

    @torch.inference_mode()
    def finish_prompt(self, row: int, rest: torch.Tensor) -> None:
        """The last positions [1, n, hidden] of `row`'s prompt: prefilled after its prefix; the row then runs."""
        start, n = self.prompt_len_host[row], rest.shape[1]
        if n == 1 and self.use_cuda_graphs:
            self.extend_in.copy_(rest)
            self.extend_pos.fill_(start)
            self.prefill_row.fill_(row)
            hidden = self.extend_graph()[0, -1]
        else:
            positions = torch.arange(start, start + n, device=self.pos.device)[None]
            hidden = self.talker_extend(rest, self.all_rows[row:row + 1], positions)[0, -1]
        self.prompt_len_host[row] = start + n
        self.pos[row].fill_(start + n)
        self._begin(row, hidden)

    def _begin(self, row: int, hidden: torch.Tensor) -> None:
        """The row's prompt is in: sample its first codebook-0 token from the last position's state and let it run."""
        self.hidden[row] = hidden
        rows = slice(row, row + 1)
        token = self._next_token(self.talker.codec_head(hidden[None]), rows, self.frame[rows])
        self.token[row] = token[0]
        self.code_predictor_input[row, 1] = self.talker.model.codec_embedding(token[0])
        self.active[row].fill_(True)
        self.prompt_in[row] = True

    def append_text(self, row: int, embeds: torch.Tensor, end: bool) -> None:
        """More text for `row` (embeds [n, hidden]); `end`: nothing follows, pad after it."""
        start = self.text_len_host[row]
        if start + len(embeds) > self.max_seq:
            raise ValueError(f"A row holds at most {self.max_seq} text positions.")
        self.trailing[row, start : start + len(embeds)] = embeds
        self.text_len_host[row] = start + len(embeds)
        self.text_end_host[row] = end
        self.text_len[row].fill_(start + len(embeds))
        self.text_end[row].fill_(end)

    def may_run(self, row: int, frames: int) -> bool:
        """Whether `row`, having made `frames` frames of its segment, can make one in a step: its whole
        prompt is in, and its text reaches that frame or has ended (a step's own test, on the host)."""
        return self.prompt_in[row] and (self.text_end_host[row] or frames < self.text_len_host[row])

    def stop(self, row: int) -> None:
        """The row leaves: it runs no more, and reads as not having produced (a frame over fewer rows leaves it as it is)."""
        self.occupied[row] = False
        self.prompt_in[row] = False
        self.active[row].fill_(False)
        self.produced[row].fill_(False)

    def _set_sampling(self, row: int, s: SamplingConfig) -> None:
        self.penalty[row].fill_(s.repetition_penalty)
        self.talker_sampling.set_row(row, s.do_sample, s.temperature, s.top_k, s.top_p)
        self.sub_sampling.set_row(row, s.subtalker_dosample, s.subtalker_temperature, s.subtalker_top_k, s.subtalker_top_p)

    # ---- prefill ---------------------------------------------------------------------------

    def _prefill(self, row: int, prompt: torch.Tensor) -> torch.Tensor:
        """The talker over the prompt, written into cache row `row`; returns the last position's hidden state.

        Zero-padded to a bucket length on every device (so eager and graphed prefill run the same
        kernels): causal attention keeps the padding out of the real positions, and the cache slots
        it fills are rewritten by the decode steps before any query can see them."""
        length = prompt.shape[1]
        bucket = next(b for b in self.buckets if length <= b)
        inputs = self.prefill_in[bucket]
        inputs.zero_()
        inputs[:, :length] = prompt
        self.prefill_row.fill_(row)
        return self.prefill_graphs[bucket]()[0, length - 1]

    def _prefill_bucket(self, bucket: int) -> torch.Tensor:
        return self.talker_prefill(self.prefill_in[bucket], self.prefill_row)

    def _extend_one(self) -> torch.Tensor:
        return self.talker_extend(self.extend_in, self.prefill_row, self.extend_pos)

    def captures(self) -> list[Callable[[], None]]:
        """The decode step of every row block, every prefill bucket and the one-position extension, each
        to capture at load (every row idle), not in a user's time to first audio; none without graphs."""
        if not self.use_cuda_graphs:
            return []
        graphs = [*self.step_graphs.values(), *self.prefill_graphs.values(), self.extend_graph]
        return [torch.inference_mode()(graph.capture) for graph in graphs]

    # ---- the decode step ---------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One frame for every row that can run. Returns static buffers (copy to keep):
        produced [rows] (which rows made a frame), codes [rows, 16], and the next codebook-0 token [rows]."""
        self.step_graphs[self.block_size()]()
        return self.produced, self.codes, self.token

    def block_size(self) -> int:
        """The rows the next frame runs over: the smallest block size holding every occupied row."""
        last = max((row for row, occupied in enumerate(self.occupied) if occupied), default=-1)
        return next(n for n in self.block_sizes if n > last)

    def _row_block(self, count: int) -> RowBlock:
        """Views of the first `count` rows of the per-row buffers (built once per block size, at load)."""
        rows = slice(0, count)
        return RowBlock(count=count, **{name: getattr(self, name)[rows] for name in ROW_BUFFERS}, talker_sampling=self.talker_sampling.select(rows),
                        sub_sampling=self.sub_sampling.select(rows),
                        cp_positions=[p[rows] for p in self.cp_positions])

    def _next_token(self, logits: torch.Tensor, rows: slice, frame: torch.Tensor) -> torch.Tensor:
        """Codebook-0 logits [n, V] of the rows `rows` at frame `frame` [n] -> tokens [n], with the reference's logit processors."""
        logits = logits.float()
        penalty = self.penalty[rows][:, None]
        seen = self.seen[rows]
        logits = torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
        logits = logits.masked_fill(self.suppressed, float("-inf"))
        logits[:, self.eos_id] = torch.where(frame < self.min_new_tokens, float("-inf"), logits[:, self.eos_id])
        noise = self.noise(self.seed_hash[rows], frame * self.draws_per_frame, self.vocab)
        token = self.sample(logits, self.talker_sampling.select(rows), noise)
        seen.scatter_(1, token[:, None], True)  # a view of self.seen: only these rows change
        return token

    def _predict_codebooks(self) -> torch.Tensor:
        """Codebooks 1..15 of every row's current frame; returns all 16 codes [rows, 16]."""
        predictor = self.talker.code_predictor
        project = predictor.small_to_mtp_projection
        noise = self.noise(self.seed_hash, self.frame * self.draws_per_frame + self.vocab, self.sub_steps * self.sub_vocab)
        noise = noise.view(self.rows, self.sub_steps, self.sub_vocab)
        embeds = torch.stack((self.hidden, self.talker.model.codec_embedding(self.token)), dim=1)
        codes = [self.token]
        for head in range(self.sub_steps):
            if head:
                embeds = predictor.model.codec_embedding[head - 1](codes[-1])[:, None]
            logits = self.predictor_logits(project(embeds), self.cp_positions[head], predictor.lm_head[head].weight)
            codes.append(self.sample(logits, self.sub_sampling, noise[:, head]))
        return torch.stack(codes, dim=1)

    def _step(self) -> None:
        run = self.active & (self.token != self.eos_id) & (self.frame < self.max_frame) & ((self.frame < self.text_len) | self.text_end)
        codes = self._predict_codebooks()
        has_text = self.frame < self.text_len
        text = self.trailing[self.all_rows, self.frame.clamp(max=self.max_seq - 1)]
        embeds = self.embed_codes(codes) + torch.where(has_text[:, None], text, self.tts_pad)
        hidden = self.talker_decode(embeds[:, None], self.pos[:, None])[:, -1]
        before = self.seen.clone()
        token = self._next_token(self.talker.codec_head(hidden), slice(None), self.frame + 1)
        # Commit only the rows that ran; the others keep their state exactly (their cache slot at
        # `pos` was written, but it is rewritten before any of their queries can read it).
        self.seen.copy_(torch.where(run[:, None], self.seen, before))
        self.hidden.copy_(torch.where(run[:, None], hidden, self.hidden))
        self.token.copy_(torch.where(run, token, self.token))
        self.pos.add_(run.long())
        self.frame.add_(run.long())
        self.codes.copy_(codes)
        self.produced.copy_(run)

    def _frame_in_kernels(self, rows: RowBlock) -> None:
        """`_step` with its glue inside the kernels, over the first `rows.count` rows: per
        code-predictor step, the layers, the head and one kernel that draws the codebook and writes
        the next step's input (after the last, the talker's input: code embeddings and text); then
        the talker's layers, its head (final norm, logits and the normed state at once) and one
        kernel for the next codebook-0 token and the commit of every row's state. Same arithmetic as
        `_step`'s ops, in the kernels' order of sums."""
        from pipeline.kernels.sampling import next_token

        text = FrameText(rows.trailing, rows.text_len, self.tts_pad)
        self._predict_in_kernels(rows, text)
        logits = fused_decode_logits(self.talker.model, rows.talker_input, rows.pos[:, None], self.talker.codec_head.weight, self.kernels,
                                     normed=rows.next_hidden)
        next_token(logits, rows.talker_sampling, rows, self.draws_per_frame, self.suppressed, self.eos_id, self.min_new_tokens, rows.next_hidden,
                   rows.code_predictor_input, self.talker.model.codec_embedding.weight, self.kernels)

    def _predict_in_kernels(self, rows: RowBlock, text: FrameText) -> None:
        """The code predictor a kernel per stage over the block's rows: the first step's input
        projection (the 1.7B's: the talker's state and codebook 0), then per step its layers, its head
        and `code_step`, which writes the next step's input from `next_tables` (already projected)."""
        from pipeline.kernels.sampling import code_step

        predictor = self.talker.code_predictor
        project = predictor.small_to_mtp_projection
        if isinstance(project, torch.nn.Linear):
            fused_linear(predictor.model, project, rows.code_predictor_input, rows.projected_input, self.kernels)
        for head in range(self.sub_steps):
            projected = rows.projected_input if head == 0 else rows.projected_next
            logits = self.predictor_logits(projected, rows.cp_positions[head], predictor.lm_head[head].weight)
            last = head == self.sub_steps - 1
            code_step(logits, rows.sub_sampling, rows.seed_hash, rows.frame, self.draws_per_frame, self.vocab + head * self.sub_vocab, rows.codes,
                      head + 1, self.code_tables if last else self.next_tables, self.table_starts,
                      rows.talker_input if last else rows.projected_next, self.kernels, text=text if last else None, token=rows.token)


@torch.inference_mode()
def project_code_tables(model: Transformer, project: torch.nn.Linear, tables: torch.Tensor, config: KernelConfig,
                        chunk: int = 256) -> torch.Tensor:
    """Every row of the stacked code tables through the code predictor's input projection, in the
    decode step's matmul kernel (`fused_linear`, whose arithmetic for a row does not depend on the
    rows beside it): row r is bit for bit what projecting code r's embedding in a step gives.
    In chunks of rows: the model's split-K workspace, which keeps its size, grows only to a few MB."""
    out = torch.empty(tables.shape[0], project.out_features, dtype=tables.dtype, device=tables.device)
    for start in range(0, tables.shape[0], chunk):
        rows = slice(start, start + chunk)
        fused_linear(model, project, tables[None, rows], out[None, rows], config)
    return out


def stack_code_tables(talker: Talker) -> tuple[torch.Tensor, torch.Tensor]:
    """The 16 codebooks' embedding tables (the talker's codebook 0, the code predictor's 1..15) as
    row blocks of one tensor, the modules' weights made views of it (no copy kept): a kernel reaches
    any codebook's table from one pointer. Returns it and each codebook's first row [16]."""
    modules = [talker.model.codec_embedding, *talker.code_predictor.model.codec_embedding]
    stacked = torch.cat([m.weight.detach() for m in modules])
    starts, start = [], 0
    for module in modules:
        rows = module.weight.shape[0]
        module.weight.data = stacked[start : start + rows]
        starts.append(start)
        start += rows
    return stacked, torch.tensor(starts, device=stacked.device)
