"""Streaming synthesis: a generator of `Chunk`s, with generation and vocoding overlapped on two threads.

Threads and buffers (the policy a slow consumer meets):
  generation thread  -> code chunks (tiny: 16 ints a frame), unbounded queue: generation never waits;
  vocoder thread     -> audio chunks, bounded queue of AUDIO_AHEAD chunks: the vocoder may run ahead
                        of the consumer by that much, then waits; generation goes on regardless;
  the caller         <- yields Chunk records as the vocoder finishes them.
Closing the generator (Stop pressed, browser gone) sets a stop flag that the generation loop checks
every frame, so work ends within one frame, and the threads are joined before the close returns.
"""
from __future__ import annotations

import contextlib
import queue
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.generate import SamplingConfig

DEFAULT_SCHEDULE = (1, 2, 4, 8, 16)  # frames per chunk; the last size repeats
AUDIO_AHEAD = 4
SEGMENT_CHARS = 300  # longer texts are split at sentence ends and streamed segment after segment
# After . ! ? ; … only when whitespace follows (so 3.5 stays whole); CJK stops need no space.
_SENTENCE_END = re.compile(r"(?<=[.!?;…])\s+|(?<=[。！？；])\s*")


@dataclass
class Chunk:
    """One piece of streamed audio and where its time went."""

    index: int
    audio: np.ndarray  # float32 [samples] at 24 kHz
    frames: int
    generate_ms: float  # generating this chunk's frames (the first chunk includes the prefill)
    vocode_ms: float
    elapsed_ms: float  # since the request started, when this chunk was ready; chunk 0's is the TTFA
    audio_seconds: float  # audio streamed so far, this chunk included
    sample_rate: int = 24000

    @property
    def rtf(self) -> float:
        """Running real-time factor: wall time so far over audio so far (below 1 is faster than real time)."""
        return self.elapsed_ms / 1000.0 / self.audio_seconds if self.audio_seconds else float("inf")


def chunk_sizes(schedule: Sequence[int]) -> Iterator[int]:
    if not schedule or any(int(n) < 1 for n in schedule):
        raise ValueError(f"A chunk schedule is a list of positive frame counts, got {list(schedule)}.")
    yield from schedule
    while True:
        yield schedule[-1]


def parse_schedule(text: str) -> tuple[int, ...]:
    """'1, 2, 4, 8, 16' -> (1, 2, 4, 8, 16)."""
    try:
        schedule = tuple(int(part) for part in re.split(r"[,\s]+", text.strip()) if part)
    except ValueError:
        raise ValueError(f"A chunk schedule is a comma-separated list of frame counts like '1, 2, 4, 8, 16', not '{text}'.") from None
    list(zip(range(1), chunk_sizes(schedule)))  # validates
    return schedule


def _pieces(sentence: str, limit: int) -> list[str]:
    """A sentence longer than `limit` cut at its last clause break (or space) before the limit, so no
    segment outgrows the talker's static cache; a single unbroken run of characters is cut hard."""
    pieces = []
    while len(sentence) > limit:
        cut = max(sentence.rfind(mark, 0, limit) for mark in (", ", "，", "、", "; ", " "))
        cut = cut + 1 if cut > 0 else limit
        pieces.append(sentence[:cut].strip())
        sentence = sentence[cut:].strip()
    return pieces + [sentence] if sentence else pieces


def split_text(text: str, limit: int = SEGMENT_CHARS) -> list[str]:
    """Sentences packed into segments of at most `limit` characters (longer sentences cut at clause breaks)."""
    segments: list[str] = []
    for sentence in (s.strip() for s in _SENTENCE_END.split(text.strip())):
        for piece in _pieces(sentence, limit):
            if segments and len(segments[-1]) + 1 + len(piece) <= limit:
                segments[-1] = f"{segments[-1]} {piece}"
            else:
                segments.append(piece)
    return segments


class _Stop(Exception):
    pass


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Copy to CPU, waiting on a CUDA event: the wait releases the GIL, which `.cpu()` would hold,
    starving the other worker thread for the whole time the GPU is busy."""
    if t.device.type != "cuda":
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host


def _on(stream: "torch.cuda.Stream | None"):
    """Queue this worker's GPU work on its own CUDA stream (None on CPU), after the work already queued."""
    if stream is None:
        return contextlib.nullcontext()
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    return torch.cuda.stream(stream)


class StreamRun:
    """One request's threads and queues; iterate to get Chunks, close() to cancel."""

    def __init__(self, tts, requests: Sequence, sampling: SamplingConfig, max_frames: int, seed: int | None, schedule: Sequence[int]):
        self.tts, self.requests, self.sampling = tts, list(requests), sampling
        self.max_frames, self.seed, self.schedule = max_frames, seed, tuple(schedule)
        self.stop = threading.Event()
        self.codes: queue.Queue = queue.Queue()
        self.audio: queue.Queue = queue.Queue(maxsize=AUDIO_AHEAD)
        self.frames_generated = 0
        self.code_blocks: list[torch.Tensor] = []  # every generated frame, kept for the caller
        self.start = time.perf_counter()
        # The model (decoder caches, vocoder state) is ours from the moment the generation thread
        # takes tts.lock until both threads have finished; the last one out releases it.
        self.holding = threading.Event()
        self.active = 2
        self.active_lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._guard, args=(self._generate, self.codes), name="tts-generate", daemon=True),
            threading.Thread(target=self._guard, args=(self._vocode, self.audio), name="tts-vocode", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _guard(self, work, out: queue.Queue) -> None:
        try:
            work()
        except _Stop:
            pass
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(out, exc)
        finally:
            self._put(out, None)
            self._leave()

    def _leave(self) -> None:
        with self.active_lock:
            self.active -= 1
            last = self.active == 0
        if last and self.holding.is_set():
            self.tts.lock.release()

    def _wait(self, ready) -> None:
        """Wait until `ready()` (polling), or raise _Stop as soon as the request is cancelled."""
        while not ready():
            if self.stop.is_set():
                raise _Stop

    def _put(self, out: queue.Queue, item) -> None:
        while True:
            try:
                out.put(item, timeout=0.05)
                return
            except queue.Full:
                if self.stop.is_set():
                    return

    def _generate(self) -> None:
        self._wait(lambda: self.tts.lock.acquire(timeout=0.05))  # another request may hold the model
        self.holding.set()
        with torch.inference_mode(), _on(self.tts.generation_stream):
            self._generate_segments()

    def _generate_segments(self) -> None:
        sizes = chunk_sizes(self.schedule)
        for segment, request in enumerate(self.requests):
            remaining = self.max_frames - self.frames_generated
            if remaining <= 0:
                return
            t0 = time.perf_counter()
            seed = None if self.seed is None else self.seed + segment
            decoder = self.tts.frame_decoder(request, self.sampling, seed)
            remaining = min(remaining, decoder.max_frames(request.prompt.prefill.shape[1]))
            token = decoder.prefill(request.prompt.prefill)
            produced = 0
            while produced < remaining:
                n = min(next(sizes), remaining - produced)
                frames = []
                for _ in range(n):
                    if self.stop.is_set():
                        raise _Stop
                    codes, token = decoder.step()
                    frames.append(codes.clone())
                # One host sync per chunk, not per frame; the next codebook-0 token rides along as a last row.
                rows = to_host(torch.stack([*frames, token.expand(len(frames[0]))]))
                block, next_token = rows[:-1], int(rows[-1, 0])
                ended = (block[:, 0] == decoder.eos_id).nonzero()
                if len(ended):
                    block = block[: int(ended[0])]
                produced += len(block)
                if len(block):
                    self.code_blocks.append(block)
                    self.codes.put((block, (time.perf_counter() - t0) * 1000.0))
                t0 = time.perf_counter()
                if len(ended) or next_token == decoder.eos_id:
                    break
            self.frames_generated += produced

    def _vocode(self) -> None:
        index, samples = 0, 0
        first = self.requests[0]
        self._wait(lambda: self.holding.wait(timeout=0.05))
        with torch.inference_mode(), _on(self.tts.vocoder_stream):
            vocoder = self.tts.vocoder
            vocoder.reset()
            if first.vocoder_state is not None:
                vocoder.state.restore(first.vocoder_state)
            elif first.ref_codes is not None:
                vocoder.prime(first.ref_codes)
            while True:
                item = self.codes.get()
                if item is None or self.stop.is_set():
                    return
                if isinstance(item, BaseException):
                    raise item
                block, generate_ms = item
                t0 = time.perf_counter()
                audio = to_host(vocoder.decode_chunk(block.to(self.tts.device)).float()).numpy()
                now = time.perf_counter()
                samples += audio.size
                chunk = Chunk(index, audio, len(block), generate_ms, (now - t0) * 1000.0, (now - self.start) * 1000.0, samples / 24000)
                self._put(self.audio, chunk)
                index += 1

    @property
    def codes_out(self) -> torch.Tensor:
        """int64 [frames, 16]: the frames generated so far (all of them once iteration has ended)."""
        return torch.cat(self.code_blocks) if self.code_blocks else torch.zeros(0, 16, dtype=torch.long)

    def __iter__(self) -> Iterator[Chunk]:
        try:
            while True:
                try:
                    item = self.audio.get(timeout=0.05)
                except queue.Empty:
                    if self.stop.is_set():  # closed from another thread: the end marker may never come
                        return
                    continue
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.close()

    def close(self) -> None:
        self.stop.set()
        self.codes.put(None)
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join()
