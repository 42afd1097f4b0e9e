"""The reusable latency panel: a live strip (the PCM player's line, the summary, the seed of the
take), a per-chunk latency table and plot, and the full utterance as a WAV at the end. The strip
can stand apart from the rest (under the Generate button, where the click is) so that a run is
seen to start without scrolling.

Each chunk's audio goes out as raw 16-bit PCM on the run's HTTP stream (`ui/pcm_stream.py`) the
moment it is ready, and `ui/player.js` schedules it gaplessly on a WebAudio context; the table,
plot and summary follow through Gradio's queue. Gradio's own streaming audio re-encodes chunks
(AAC/HLS through ffmpeg) and adds a second or more before the first sound.
"""
from __future__ import annotations

import html
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import numpy as np
import pandas as pd

from pipeline.contract.events import FRAME_SECONDS, TINY, Chunk, Queued, StreamEnd, StreamStart
from pipeline.errors import TTSInputError
from ui.errors import input_error, toast_text, warn
from ui.pcm_stream import CHANNELS, ROUTE, RUN_ID

PLAYER_JS = Path(__file__).with_name("player.js")
ARRIVAL_GAP = "arrival gap (here)"
STAGE_COLORS = {"generate": "#4c78a8", "vocode": "#f58518", ARRIVAL_GAP: "#54a24b"}
PLOT_VIEW = (360, 260)  # the plot's SVG coordinates, about its column's width in pixels: it scales to that width
TABLE_HEADERS = ["chunk", "frames", "generate ms", "vocode ms", "ms since request", "RTF"]
# The table and plot re-render at most this often: rendering on every chunk costs the browser the
# CPU time that the next chunks need (on a small CPU machine it caused gaps).
UPDATE_INTERVAL_S = 0.25
PUMP_JOIN_S = 5.0  # a stopped stream ends within a frame; the bound only guards against a stuck worker
IDLE_TEXT = "Press Generate: the audio plays here while it is generated."
# The two first-audio figures side by side: where each is measured and what it includes.
LEGEND = ("<b>First sound</b>: from your click until the first audio reaches the speakers, measured in this browser. "
          "<b>TTFA</b> (time to first audio): from the request's arrival until the model has made the first audio chunk, measured on the server.")
CSS = """
/* A tab's status line, where a checkpoint's first load says what it is doing: room for Gradio's
   progress text and bar (or its spinner) while they show, one line otherwise. */
.model-status { min-height: 2.5em; }
.model-status:has(> [data-testid=status-tracker]:not(.hide)) { min-height: 84px; }
/* The strip keeps the height its figures take from the click on, so that scrolling it into view at
   the click leaves it in view when they arrive. */
.pcm-summary { min-height: 3.4em; }
.pcm-take { min-height: 1.6em; }
.pcm-plot svg { display: block; width: 100%; height: auto; font-size: 11px; }
.pcm-plot text { fill: currentColor; opacity: 0.75; }
.pcm-plot .pcm-grid { stroke: currentColor; opacity: 0.15; }
.pcm-plot-legend { display: flex; flex-wrap: wrap; gap: 0.25em 1em; font-size: 0.8em; opacity: 0.85; }
.pcm-plot-legend i { display: inline-block; width: 0.8em; height: 0.8em; border-radius: 50%; margin-right: 0.35em; vertical-align: -0.05em; }
.pcm-legend { font-size: 0.8em; opacity: 0.75; margin-top: 0.25em; line-height: 1.35; }
.pcm-words-note { font-size: 0.8em; opacity: 0.75; }
/* Narrow screens (phones): the table keeps the columns a reader needs (chunk, ms since the request,
   RTF) and drops the per-stage times, which the plot under it shows; the strip's figures wrap. */
@media (max-width: 600px) {
  .pcm-table th:nth-child(2), .pcm-table td:nth-child(2),
  .pcm-table th:nth-child(3), .pcm-table td:nth-child(3),
  .pcm-table th:nth-child(4), .pcm-table td:nth-child(4) { display: none; }
}
"""


def player_head() -> str:
    """The <head> script that creates the shared AudioContext at page load (see player.js for why),
    and the panel's styles."""
    return f"<script>{PLAYER_JS.read_text(encoding='utf-8')}</script><style>{CSS}</style>"


def player_html(name: str, idle: str = IDLE_TEXT) -> str:
    """The player's line (ui/player.js writes its status; `idle` until the first run) and the legend of its figures."""
    return (f'<div class="pcm-player"><span class="pcm-status">{idle}</span>'
            f'<div class="pcm-legend" id="{name}-legend">{LEGEND}</div></div>')


WORDS_IDLE = ('<div class="pcm-words-note">The word being spoken is highlighted here where the text is fed one token per frame '
              "(Advanced → Text layout).</div>")


def words_html(words: list[dict] | None) -> str:
    """The spoken words as spans carrying their frames (80 ms each, from the word's start to before its
    end), which ui/player.js highlights as they play; the note where the run has no word timings.
    A frame's audio is the frame's own samples (no look-ahead): the lead is 0."""
    if words is None:
        return WORDS_IDLE
    spans = []
    for word in words:
        first = round(word["start"] / FRAME_SECONDS)
        last = max(first, round(word["end"] / FRAME_SECONDS) - 1)
        spans.append(f'<span class="speech-token" data-first="{first}" data-last="{last}">{html.escape(word["word"])}</span>')
    return f'<div class="pcm-words" data-lead-s="0">{" ".join(spans)}</div>'


def pcm16(audio: np.ndarray) -> np.ndarray:
    """float32 [-1, 1] -> int16: the player's wire format (half the bytes of float32) and the WAV's."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype(np.int16)


def checkpoint_label(name: str, stand_in: str | None = None) -> str:
    """A checkpoint as the page names it: the built-in tiny random one by that name, also where it
    stands in for a checkpoint that could not be had."""
    if name == TINY:
        return "built-in tiny random checkpoint"
    return f"built-in tiny random checkpoint (in place of {name})" if stand_in == TINY else name


def summary_text(start: StreamStart, chunks: list[Chunk], first_sent_ms: float | None, done: bool, warnings: list[str] = ()) -> str:
    """The line under the player; `warnings` (what the stream's end said, e.g. text left unspoken) stay on it after the toasts fade."""
    if not chunks:
        return f"Generating with {checkpoint_label(start.checkpoint, start.stand_in)}{f' on {start.backend}' if start.backend else ''}…"
    last = chunks[-1]
    speed = f"{1 / last.rtf:.1f}× real time" if last.rtf > 0 else "instant"
    rtf = f"{'final' if done else 'running'} RTF **{last.rtf:.3f}** ({speed})"
    # Over a remote backend the times are this server's: from sending the request to receiving the bytes.
    where = f"measured here: first audio bytes from `{start.backend}`; generate and vocode ms not reported" if start.backend else "model"
    return (
        f"TTFA **{chunks[0].elapsed_ms:.0f} ms** ({where}) · first chunk sent {first_sent_ms:.0f} ms after the request arrived · "
        f"{rtf} · {last.audio_seconds:.2f} s of audio in {len(chunks)} chunks · {checkpoint_label(start.checkpoint, start.stand_in)}"
    ) + "".join(f"\n\n**Warning:** {toast_text(warning)}" for warning in warnings)


def stopped_text(after_s: float, audio_s: float, chunks: int) -> str:
    """The summary of a run that Stop ended: when, and how much audio it had made (a stopped run has no WAV)."""
    if not chunks:
        return f"**Stopped after {after_s:.1f} s**, before the first audio."
    return f"**Stopped after {after_s:.1f} s**, with {audio_s:.2f} s of audio in {chunks} chunk{'s' if chunks > 1 else ''}; a stopped run leaves no WAV."


def take_text(seed: int) -> str:
    return f"Seed **{seed}**: type it in Seed (under Advanced) to hear this take again."


def ms_cell(ms: float | None) -> float | str:
    return "–" if ms is None else round(ms, 1)


def queued_text(queued: Queued) -> str:
    ahead = "next in line" if queued.ahead == 0 else f"{queued.ahead} request{'s' if queued.ahead > 1 else ''} ahead"
    return f"Every slot of the model is busy: waiting ({ahead})…"


def table_frame(rows: list[list]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=TABLE_HEADERS)


def plot_series(chunks: list[Chunk]) -> dict[str, list[tuple[int, float]]]:
    """The plot's lines: (chunk, ms) per stage, for the stages the chunks report."""
    series = {"generate": [(c.index, c.generate_ms) for c in chunks if c.generate_ms is not None],
              "vocode": [(c.index, c.vocode_ms) for c in chunks if c.vocode_ms is not None]}
    if chunks and not any(series.values()):  # a remote backend reports neither: plot what is measured here, the time between arrivals
        arrivals = [0.0] + [c.elapsed_ms for c in chunks]
        series = {ARRIVAL_GAP: [(c.index, arrivals[i + 1] - arrivals[i]) for i, c in enumerate(chunks)]}
    return {stage: points for stage, points in series.items() if points}


def axis_top(ms: float) -> float:
    """The y axis' top: the smallest 1, 2 or 5 times a power of ten at or above `ms`."""
    if ms <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(ms))
    return next(step * power for step in (1, 2, 5, 10) if step * power >= ms)


def plot_html(chunks: list[Chunk]) -> str:
    """The per-chunk latency plot as inline SVG markup: chunks along x, ms up y, a line per stage
    (each point's figures in its tooltip). The browser draws it as it draws any HTML, where a charting
    library's plot (gr.LinePlot) compiles its chart on every update: 100-200 ms of the page's main
    thread each time, while the reply streams."""
    series = plot_series(chunks)
    width, height = PLOT_VIEW
    left, right, top, bottom = 44, 12, 30, 34  # the top leaves room for the label floating over the plot
    xs = [x for points in series.values() for x, _ in points] or [0]
    first, last = min(xs), max(xs)
    top_ms = axis_top(max((ms for points in series.values() for _, ms in points), default=0.0))

    def x_at(chunk: float) -> float:
        return left + (width - left - right) * ((chunk - first) / (last - first) if last > first else 0.5)

    def y_at(ms: float) -> float:
        return top + (height - top - bottom) * (1 - ms / top_ms)

    marks = []
    for fraction in (0, 0.25, 0.5, 0.75, 1):
        y = y_at(top_ms * fraction)
        marks.append(f'<line class="pcm-grid" x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}"/>'
                     f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{top_ms * fraction:g}</text>')
    if series:
        marks += [f'<text x="{x_at(c):.1f}" y="{height - bottom + 15}" text-anchor="middle">{c}</text>' for c in sorted({first, last})]
    marks.append(f'<text x="{(left + width - right) / 2}" y="{height - 3}" text-anchor="middle">chunk</text>')
    for stage, points in series.items():
        color = STAGE_COLORS[stage]
        line = " ".join(f"{x_at(c):.1f},{y_at(ms):.1f}" for c, ms in points)
        marks.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>')
        marks += [f'<circle cx="{x_at(c):.1f}" cy="{y_at(ms):.1f}" r="3" fill="{color}"><title>chunk {c} · {html.escape(stage)} {ms:.1f} ms</title></circle>'
                  for c, ms in points]
    legend = "".join(f'<span><i style="background:{STAGE_COLORS[stage]}"></i>{html.escape(stage)}</span>' for stage in series) or "no chunks yet"
    return (f'<svg viewBox="0 0 {width} {height}" role="img" aria-label="per-chunk latency in ms">{"".join(marks)}</svg>'
            f'<div class="pcm-plot-legend">{legend}</div>')


@dataclass
class LiveStrip:
    """What shows a run start and stream: the player's line, the summary and the seed of the take.
    Placed under the Generate button, it is on screen when the click is."""

    run_id: gr.Textbox  # input: the run id the Generate click's JS made
    stopped: gr.JSON  # input of a Stop: what the player had when it was pressed (None: no run was streaming)
    player: gr.HTML
    summary: gr.Markdown
    take: gr.Markdown
    words: gr.HTML | None = None  # the run's words, the one being spoken highlighted (`words_html`)

    @classmethod
    def create(cls, name: str, idle: str = IDLE_TEXT, words: bool = False) -> "LiveStrip":
        """With `words`, a box of the run's words too (`#NAME-live`, where ui/player.js highlights)."""
        with gr.Column(elem_id=f"{name}-strip"):
            run_id = gr.Textbox(visible=False)
            stopped = gr.JSON(visible=False)
            player = gr.HTML(player_html(name, idle), elem_id=f"{name}-player")
            summary = gr.Markdown("", elem_id=f"{name}-summary", elem_classes=["pcm-summary"])
            take = gr.Markdown("", elem_id=f"{name}-take", elem_classes=["pcm-take"])
            box = gr.HTML(WORDS_IDLE, elem_id=f"{name}-live", padding=True) if words else None
        return cls(run_id, stopped, player, summary, take, box)


@dataclass
class LatencyPanel:
    """The components of one panel; `create` builds them inside the current Blocks context."""

    name: str
    strip: LiveStrip
    table: gr.Dataframe
    plot: gr.HTML
    audio: gr.Audio

    @classmethod
    def create(cls, name: str, strip: LiveStrip | None = None) -> "LatencyPanel":
        """The panel, its live strip made here unless one was made elsewhere (under the buttons)."""
        strip = strip or LiveStrip.create(name)
        with gr.Row(equal_height=True):
            table = gr.Dataframe(
                headers=TABLE_HEADERS, label="Chunks as they arrive", interactive=False, elem_id=f"{name}-table", elem_classes=["pcm-table"],
                scale=3, min_width=300,
            )
            with gr.Column(scale=2, min_width=300):  # a column keeps the width where the row wraps (gr.HTML has no min width of its own)
                plot = gr.HTML(plot_html([]), label="Per-chunk latency (ms)", show_label=True, container=True, padding=True, js_on_load=None,
                               elem_id=f"{name}-plot", elem_classes=["pcm-plot"])
        # The browser's own player: Gradio's waveform player draws the whole utterance's waveform on the
        # page's main thread when the WAV arrives (60-100 ms for 15 s of audio), as the next click may come.
        audio = gr.Audio(label="Full utterance (WAV, downloadable)", type="numpy", format="wav", interactive=False, elem_id=f"{name}-audio",
                         waveform_options=gr.WaveformOptions(show_recording_waveform=False))
        return cls(name, strip, table, plot, audio)

    @property
    def run_id(self) -> gr.Textbox:
        return self.strip.run_id

    @property
    def player(self) -> gr.HTML:
        return self.strip.player

    @property
    def summary(self) -> gr.Markdown:
        return self.strip.summary

    @property
    def take(self) -> gr.Markdown:
        return self.strip.take

    @property
    def outputs(self) -> list[gr.components.Component]:
        # The take after the WAV, the words last: API clients find the WAV where it was.
        return [self.summary, self.table, self.plot, self.audio, self.take, *([self.strip.words] if self.strip.words else [])]

    def arm_js(self, pass_interrupted: bool = False, after: int = 0) -> str:
        """JS of the Generate click: unlock the audio, open the run's PCM stream, and pass the run id
        as the input `after` inputs from the end (the stream's request leaves before Gradio's queue
        join does); with `pass_interrupted`, the id of the run it silences ("" if none) as the input before it."""
        url = ROUTE.lstrip("/").replace("{run_id}", "")
        player = f"window.qwenTTS.player('{self.name}')"
        run = f"args.length - {1 + after}"
        interrupted = f"args[{run} - 1] = {player}.stats ? {player}.stats.run : ''; " if pass_interrupted else ""
        return f"(...args) => {{ {interrupted}args[{run}] = {player}.arm('{url}'); return args; }}"

    def stop_js(self, report: bool = False) -> str:
        """JS of the Stop click: silence the player and pass the stopped run's id to the server; with
        `report`, also what the run had made (the input after it, for `stopped_update`)."""
        player = f"window.qwenTTS.player('{self.name}')"
        if report:
            return f"() => {{ const made = {player}.progress(); return [{player}.stop(), made]; }}"
        return f"() => [{player}.stop()]"

    def starting(self, seed: int | None, text: str) -> dict:
        """The panel as a run starts: the last run's table, plot and WAV cleared, what happens now, and the seed."""
        return {self.summary: text, self.take: "" if seed is None else take_text(seed), **self.cleared()}

    def cleared(self) -> dict:
        """The last run's table, plot, WAV (and words) cleared."""
        return {self.table: table_frame([]), self.plot: plot_html([]), self.audio: None, **self._words(None)}

    def _words(self, words: list[dict] | None) -> dict:
        return {self.strip.words: words_html(words)} if self.strip.words else {}

    def stopped_update(self, made: dict | None) -> dict:
        """For a Stop that cancels its run's event (whose own last update then never comes): the summary
        from what the player had (`made`), and the WAV cleared; nothing changes when no run was streaming."""
        if not made:
            return {self.summary: gr.skip(), self.audio: gr.skip()}
        return {self.summary: stopped_text(float(made["after_s"]), float(made["audio_s"]), int(made["chunks"])), self.audio: None}

    def stopped(self, received: float) -> dict:
        """The panel of a run that Stop ended before its stream started (while its checkpoint loaded)."""
        return {self.summary: stopped_text(time.perf_counter() - received, 0.0, 0), self.audio: None}

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
            yield from self._updates(start, arrived, received, on_event)
        finally:  # Stop, a closed page or an error: end generation within a frame, then the pump
            stop()
            pump.join(PUMP_JOIN_S)

    def _updates(self, start: StreamStart, arrived: queue.Queue, received: float, on_event: Callable[[object], dict] | None) -> Iterator[dict]:
        done: list[Chunk] = []
        rows: list[list] = []
        first_sent_ms = None
        ended = False
        end = StreamEnd(stopped=False)
        next_update = time.perf_counter()  # the first row (the TTFA) shows at once; later ones are batched
        while not ended:
            extra: dict = {}
            added = False
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
                    extra.update(self._words(end.words))  # while the audio still plays in the page
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
                added = True
                rows.append([chunk.index, chunk.frames, ms_cell(chunk.generate_ms), ms_cell(chunk.vocode_ms), round(since_ms, 1), round(chunk.rtf, 3)])
            # The table and plot re-render the page's heaviest components: sent when they change, not with
            # every batch of an Omni reply's text.
            if done and (added or ended):
                summary = summary_text(start, done, first_sent_ms, ended, end.warnings)
                extra.update({self.table: table_frame(rows), self.plot: plot_html(done), self.summary: summary})
            if extra:
                yield extra
            next_update = time.perf_counter() + UPDATE_INTERVAL_S
        for warning in end.warnings:
            warn(warning)
        if end.stopped:
            audio_s = sum(len(c.audio) for c in done) / done[0].sample_rate if done else 0.0
            yield {self.summary: stopped_text(time.perf_counter() - received, audio_s, len(done)), self.audio: None}
            return
        if not done:
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
