"""The reusable latency panel: a live PCM player, a per-chunk latency table and plot, a summary
line, and the full utterance as a WAV at the end.

Each chunk's audio goes out as raw 16-bit PCM on the run's HTTP stream (`ui/pcm_stream.py`) the
moment it is ready, and `ui/player.js` schedules it gaplessly on a WebAudio context; the table,
plot and summary follow through Gradio's queue. Gradio's own streaming audio re-encodes chunks
(AAC/HLS through ffmpeg) and adds a second or more before the first sound.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import numpy as np
import pandas as pd

from pipeline.service import Chunk, Queued, StreamEnd, StreamStart, TTSInputError
from ui.pcm_stream import CHANNELS, ROUTE, RUN_ID
from ui.errors import input_error, toast_text, warn

PLAYER_JS = Path(__file__).with_name("player.js")
TABLE_HEADERS = ["chunk", "frames", "generate ms", "vocode ms", "ms since request", "RTF"]
# The table and plot re-render at most this often: rendering on every chunk costs the browser the
# CPU time that the next chunks need (on a small CPU machine it caused gaps).
UPDATE_INTERVAL_S = 0.25
PUMP_JOIN_S = 5.0  # a stopped stream ends within a frame; the bound only guards against a stuck worker
IDLE_TEXT = "Press Generate: the audio plays here while it is generated."


def player_head() -> str:
    """The <head> script that creates the shared AudioContext at page load (see player.js for why)."""
    return f"<script>{PLAYER_JS.read_text(encoding='utf-8')}</script>"


def pcm16(audio: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] -> int16: the player's wire format (half the bytes of float32) and the WAV's."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype(np.int16)


def summary_text(start: StreamStart, chunks: list[Chunk], first_sent_ms: float | None, done: bool, warnings: list[str] = ()) -> str:
    """The line under the player; `warnings` (what the stream's end said, e.g. text left unspoken) stay on it after the toasts fade."""
    if not chunks:
        return f"Generating with `{start.checkpoint}`{f' on {start.backend}' if start.backend else ''}…"
    last = chunks[-1]
    speed = f"{1 / last.rtf:.1f}× real time" if last.rtf > 0 else "instant"
    rtf = f"{'final' if done else 'running'} RTF **{last.rtf:.3f}** ({speed})"
    # Over a remote backend the times are this server's: from sending the request to receiving the bytes.
    where = f"measured here: first audio bytes from `{start.backend}`; generate and vocode ms not reported" if start.backend else "model"
    return (
        f"TTFA **{chunks[0].elapsed_ms:.0f} ms** ({where}) · first chunk sent {first_sent_ms:.0f} ms after the request arrived · "
        f"{rtf} · {last.audio_seconds:.2f} s of audio in {len(chunks)} chunks · `{start.checkpoint}`"
    ) + "".join(f"\n\n**Warning:** {toast_text(warning)}" for warning in warnings)


def ms_cell(ms: float | None) -> float | str:
    return "–" if ms is None else round(ms, 1)


def queued_text(queued: Queued) -> str:
    ahead = "next in line" if queued.ahead == 0 else f"{queued.ahead} request{'s' if queued.ahead > 1 else ''} ahead"
    return f"Every slot of the model is busy: waiting ({ahead})…"


def table_frame(rows: list[list]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=TABLE_HEADERS)


def plot_frame(chunks: list[Chunk]) -> pd.DataFrame:
    rows = [(c.index, c.generate_ms, "generate") for c in chunks if c.generate_ms is not None]
    rows += [(c.index, c.vocode_ms, "vocode") for c in chunks if c.vocode_ms is not None]
    if chunks and not rows:  # a remote backend reports neither: plot what is measured here, the time between arrivals
        arrivals = [0.0] + [c.elapsed_ms for c in chunks]
        rows = [(c.index, arrivals[i + 1] - arrivals[i], "arrival gap (here)") for i, c in enumerate(chunks)]
    return pd.DataFrame(rows, columns=["chunk", "ms", "stage"])


@dataclass
class LatencyPanel:
    """The components of one panel; `create` builds them inside the current Blocks context."""

    name: str
    run_id: gr.Textbox  # input: the run id the Generate click's JS made
    player: gr.HTML
    summary: gr.Markdown
    table: gr.Dataframe
    plot: gr.LinePlot
    audio: gr.Audio

    @classmethod
    def create(cls, name: str) -> "LatencyPanel":
        run_id = gr.Textbox(visible=False)
        player = gr.HTML(f'<div class="pcm-player"><span class="pcm-status">{IDLE_TEXT}</span></div>', elem_id=f"{name}-player")
        summary = gr.Markdown("", elem_id=f"{name}-summary")
        with gr.Row(equal_height=True):
            table = gr.Dataframe(
                headers=TABLE_HEADERS, label="Chunks as they arrive", interactive=False, elem_id=f"{name}-table", scale=3
            )
            plot = gr.LinePlot(
                plot_frame([]), x="chunk", y="ms", color="stage", label="Per-chunk latency (ms)", elem_id=f"{name}-plot", scale=2
            )
        audio = gr.Audio(label="Full utterance (WAV, downloadable)", type="numpy", format="wav", interactive=False, elem_id=f"{name}-audio")
        return cls(name, run_id, player, summary, table, plot, audio)

    @property
    def outputs(self) -> list[gr.components.Component]:
        return [self.summary, self.table, self.plot, self.audio]

    def arm_js(self, pass_interrupted: bool = False) -> str:
        """JS of the Generate click: unlock the audio, open the run's PCM stream, and pass the run id
        as the last input (the stream's request leaves before Gradio's queue join does); with
        `pass_interrupted`, the id of the run it silences ("" if none) as the input before it."""
        url = ROUTE.lstrip("/").replace("{run_id}", "")
        player = f"window.qwenTTS.player('{self.name}')"
        interrupted = f"args[args.length - 2] = {player}.stats ? {player}.stats.run : ''; " if pass_interrupted else ""
        return f"(...args) => {{ {interrupted}args[args.length - 1] = {player}.arm('{url}'); return args; }}"

    def stop_js(self) -> str:
        """JS of the Stop click: silence the player and pass the stopped run's id to the server."""
        return f"() => [window.qwenTTS.player('{self.name}').stop()]"

    def begin(self, run_id: str) -> None:
        """The run `run_id` has started: the page's PCM stream of it may attach (first thing in a handler)."""
        CHANNELS.open(run_id)

    def end(self, run_id: str) -> None:
        """End the page's PCM stream of `run_id`, however the run ended (done, error, Stop)."""
        CHANNELS.finish(run_id)

    def stream(
        self, start: StreamStart, chunks: Iterator, run_id: str, received: float, stop: Callable[[], object],
        on_event: Callable[[object], dict] | None = None,
    ) -> Iterator[dict]:
        """Panel updates for a stream. A pump thread sends each chunk's audio to the player the moment
        it is ready, so audio never waits for the table and plot to be rendered; this generator
        yields one table update per batch of chunks that arrived meanwhile, then the WAV.
        `received`: perf_counter when the request reached the handler; `stop` ends `chunks` early;
        `on_event`: the updates of other components for the stream's other records (a chat's text),
        yielded with the panel's."""
        arrived: queue.Queue = queue.Queue()
        live = bool(RUN_ID.match(run_id or ""))  # API clients have no player: they get the table and WAV
        pump = threading.Thread(target=self._pump, args=(chunks, run_id, live, received, arrived), name=f"{self.name}-pcm", daemon=True)
        pump.start()
        try:
            yield from self._updates(start, arrived, on_event)
        finally:  # Stop, a closed page or an error: end generation within a frame, then the pump
            stop()
            pump.join(PUMP_JOIN_S)

    def _updates(self, start: StreamStart, arrived: queue.Queue, on_event: Callable[[object], dict] | None) -> Iterator[dict]:
        done: list[Chunk] = []
        rows: list[list] = []
        first_sent_ms = None
        ended = False
        end = StreamEnd(stopped=False)
        next_update = time.perf_counter()  # the first row (the TTFA) shows at once; later ones are batched
        while not ended:
            extra: dict = {}
            for item in self._batch(arrived, next_update):
                if item is None:
                    ended = True
                    break
                if isinstance(item, TTSInputError):  # found after the start (e.g. the engine's queue is full)
                    raise input_error(item)
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, StreamEnd):
                    end = item
                    continue
                if isinstance(item, Queued):
                    yield {self.summary: queued_text(item)}
                    continue
                if not isinstance(item, tuple):
                    extra.update(on_event(item) if on_event else {})
                    continue
                chunk, since_ms = item
                first_sent_ms = since_ms if first_sent_ms is None else first_sent_ms
                done.append(chunk)
                rows.append([chunk.index, chunk.frames, ms_cell(chunk.generate_ms), ms_cell(chunk.vocode_ms), round(since_ms, 1), round(chunk.rtf, 3)])
            if done:
                summary = summary_text(start, done, first_sent_ms, ended, end.warnings)
                extra.update({self.table: table_frame(rows), self.plot: plot_frame(done), self.summary: summary})
            if extra:
                yield extra
            next_update = time.perf_counter() + UPDATE_INTERVAL_S
        for warning in end.warnings:
            warn(warning)
        if not done:
            if end.stopped:
                yield {self.summary: "Stopped before the first audio."}
                return
            raise gr.Error("The model ended the utterance before producing any audio; try another seed or text.")
        yield {self.audio: (done[0].sample_rate, pcm16(np.concatenate([c.audio for c in done])))}

    @staticmethod
    def _batch(arrived: queue.Queue, until: float) -> list:
        """At least one item, then whatever else arrives before `until` (or the end)."""
        batch = [arrived.get()]
        while batch[-1] is not None and not isinstance(batch[-1], BaseException):
            try:
                batch.append(arrived.get(timeout=max(0.0, until - time.perf_counter())))
            except queue.Empty:
                break
        return batch

    def _pump(self, chunks: Iterator[Chunk], run_id: str, live: bool, received: float, arrived: queue.Queue) -> None:
        try:
            for item in chunks:
                if not isinstance(item, Chunk):
                    arrived.put(item)
                    continue
                if live:
                    CHANNELS.send(run_id, pcm16(item.audio).astype("<i2").tobytes())
                arrived.put((item, (time.perf_counter() - received) * 1000.0))
        except BaseException as exc:  # raised to the user by `stream`
            arrived.put(exc)
        finally:
            self.end(run_id)  # the player hears the end now, not after the WAV is encoded
            arrived.put(None)
