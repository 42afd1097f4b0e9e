"""Controls every tab shares: checkpoint picker, text with examples, language, the Advanced
accordion, Generate / Stop, and the one generation handler they all feed."""
from __future__ import annotations

import contextvars
import dataclasses
import inspect
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import gradio as gr

from pipeline.contract import Service
from pipeline.contract.events import DEFAULT_SCHEDULE, FRAMES_PER_SECOND, TINY, ModelInfo, StreamStart
from pipeline.contract.models import MODEL_TYPES, ModelType
from pipeline.errors import TTSInputError
from pipeline.remote import RemoteService
from pipeline.request import MAX_SEED, REQUEST_FIELDS, SpeechRequest
from ui.errors import input_error, warn
from ui.latency import LatencyPanel, checkpoint_label

MAX_TEXT_LINES = 8
LOAD_POLL_S = 0.5  # how often a loading tab's status line asks how far the load is
SLIDERS = tuple(name for name, spec in REQUEST_FIELDS.items() if spec.slider is not None)  # the request fields the Advanced accordion sets
CHOICES = tuple(name for name, spec in REQUEST_FIELDS.items() if spec.choice is not None)  # ... with a choice of options each
MAX_SECONDS = 160  # the slider's right end, its default: the checkpoint's own limit (2047 frames, 164 s, for the released ones;
# 100 frames, 8 s, for the tiny random ones, whose noise nobody wants for minutes)


@dataclass
class Advanced:
    """The Advanced accordion: a slider per request field whose spec has one (pipeline.request), starting
    at the value the official checkpoints ship, and a choice per field whose spec has one; the seed,
    the chunk schedule and the length. The choices are the Generate event's last inputs, after the run
    id, so that an API client that leaves them out gets their defaults."""

    sliders: dict[str, gr.Slider]  # request field -> its slider
    choices: dict[str, gr.Radio]  # request field -> its options
    seed: gr.Textbox
    schedule: gr.Textbox
    max_seconds: gr.Slider

    @classmethod
    def create(cls, name: str) -> "Advanced":
        with gr.Accordion("Advanced", open=False, elem_id=f"{name}-advanced"):
            with gr.Row():
                sliders = {field: slider(field) for field in SLIDERS}
            with gr.Row():
                choices = {field: choice(name, field) for field in CHOICES}
            with gr.Row():
                seed = seed_box(name, "Empty: a new random take each time; the seed of each take is shown after Generate.")
                schedule = gr.Textbox(
                    ", ".join(map(str, DEFAULT_SCHEDULE)),
                    label="Chunk schedule (frames per chunk, 80 ms each; the last repeats)",
                    info="Small first chunks give early sound; larger later chunks cost less overhead.",
                    elem_id=f"{name}-schedule",
                )
                max_seconds = gr.Slider(1, MAX_SECONDS, value=MAX_SECONDS, step=1, label="Max length (s)", elem_id=f"{name}-max-seconds",
                                        info=f"At {MAX_SECONDS}: the checkpoint's own limit (164 s; 8 s for the tiny random checkpoints).")
        return cls(sliders, choices, seed, schedule, max_seconds)

    @property
    def inputs(self) -> list[gr.components.Component]:
        """The inputs before the run id (`choices` follow it)."""
        return [*self.sliders.values(), self.seed, self.schedule, self.max_seconds]

    @property
    def names(self) -> list[str]:
        """What each of `inputs` is: its request field, or seed, schedule and max_seconds."""
        return [*self.sliders, "seed", "schedule", "max_seconds"]


def slider(name: str) -> gr.Slider:
    spec = REQUEST_FIELDS[name]
    return gr.Slider(spec.slider.low, spec.slider.high, value=spec.shipped, step=spec.slider.step, label=spec.slider.label)


@dataclass
class TabParts:
    """What the app needs of a tab: its checkpoint picker and the loader that fills the tab from it."""

    name: str
    tab: gr.Tab
    checkpoint: gr.Dropdown
    load: Callable  # (*load_inputs, progress) -> updates of `load_outputs`
    load_inputs: list[gr.components.Component]
    load_outputs: list[gr.components.Component]

    @property
    def status(self) -> gr.components.Component:
        """The tab's status line under the picker (`model_status`), where the load shows what it is doing."""
        return next(c for c in self.load_outputs if c.elem_id == f"{self.name}-model-status")


def seed_box(name: str, info: str) -> gr.Textbox:
    """The Seed field, empty by default. A text box, not gr.Number: Gradio 6.31's Number sets an empty
    value to 0 as it mounts (`value ??= 0` in its frontend), so it shows 0 and sends 0, and every
    default run would repeat one take."""
    return gr.Textbox("", label="Seed", placeholder="random", max_lines=1, info=info, elem_id=f"{name}-seed")


def choice(tab: str, name: str) -> gr.Radio:
    """A field's options by label; the handler gets the index of the one chosen (`sampling_fields`)."""
    spec = REQUEST_FIELDS[name].choice
    return gr.Radio([label for label, _ in spec.options], value=spec.options[0][0], type="index", label=spec.label, info=spec.info,
                    elem_id=f"{tab}-{name.replace('_', '-')}")


def sampling_fields(*values) -> dict:
    """The Advanced accordion's values (in the order of `Advanced.inputs`) as request fields. The max
    length's default (its right end) is the checkpoint's own; an empty seed is a new random one (`take_seed`)."""
    *sampling, seed, schedule, max_seconds = values
    return {
        **dict(zip(SLIDERS, sampling)),
        "max_frames": None if float(max_seconds) >= MAX_SECONDS else max(1, round(float(max_seconds) * FRAMES_PER_SECOND)),
        "seed": take_seed(seed),
        "schedule": schedule or "",
    }


def chosen_fields(indices: Sequence[int | None]) -> dict:
    """The Advanced accordion's choices (option indices, in the order of CHOICES) as request fields."""
    return {name: REQUEST_FIELDS[name].choice.options[index or 0][1] for name, index in zip(CHOICES, indices)}


def take_seed(value: str | float | None) -> int | float:
    """The seed a run uses: the one typed, or a new random one when the field is empty, so that every
    default run is a new take and the seed shown after it repeats that take. A typed number goes to the
    request as it is (its range is checked there, with the sentence every surface gives); text that is
    no number is refused here with that same sentence."""
    text = "" if value is None else str(value).strip()
    if not text:
        return secrets.randbelow(MAX_SEED + 1)
    try:
        number = float(text)
    except ValueError:
        raise input_error(f"seed must be a whole number from 0 to {MAX_SEED} (got {text!r}).") from None
    return int(number) if number.is_integer() else number


def keep_or_first(value: str | None, choices: list[str]) -> str | None:
    return value if value in choices else (choices[0] if choices else None)


def language_update(info: ModelInfo, current: str | None = "auto") -> dict:
    return gr.update(choices=info.languages, value=keep_or_first(current, info.languages))


def stand_in(service: Service, model_type: str, checkpoint: str) -> str | None:
    """What serves in `checkpoint`'s place in this process (the tiny random checkpoint, once it could not
    be had); a backend's checkpoints serve themselves."""
    return service.stand_in(model_type, checkpoint)


def picker_choices(service: Service, model_type: str) -> list[tuple[str, str]]:
    """The picker's (label, checkpoint) pairs: a checkpoint that could not be had is labelled by the one serving instead."""
    return [(checkpoint_label(c, stand_in(service, model_type, c)), c) for c in service.choices[model_type]]


def picker_update(service: Service, model_type: str) -> dict:
    """The picker relabelled after a load, which may have found that its checkpoint could not be had."""
    return gr.update(choices=picker_choices(service, model_type))


def checkpoint_picker(service: Service, model_type: str, name: str) -> gr.Dropdown:
    choices = service.choices[model_type]
    return gr.Dropdown(
        picker_choices(service, model_type),
        value=choices[0],
        label="Checkpoint",
        info="Loaded on first use, then shared by every visitor.",
        interactive=len(choices) > 1,
        elem_id=f"{name}-checkpoint",
    )


def model_status(name: str) -> gr.Markdown:
    return gr.Markdown("", elem_id=f"{name}-model-status", elem_classes=["model-status"])


def status_text(info: ModelInfo) -> str:
    """One line on the loaded checkpoint, shown under the picker once the tab's model is ready."""
    parts = [f"Ready: {checkpoint_label(info.checkpoint, info.stand_in)}"]
    if len(info.languages) > 1:  # besides "auto"; a vLLM-Omni backend does not list them
        parts.append(f"{len(info.languages) - 1} languages")
    if info.speakers:
        parts.append(f"{len(info.speakers)} speakers")
    if info.random_weights:
        parts.append("random weights (noise)")
    return " · ".join(parts)


def text_input(name: str, examples: list[str]) -> gr.Textbox:
    text = gr.Textbox(examples[0], label="Text to speak", lines=3, max_lines=MAX_TEXT_LINES, elem_id=f"{name}-text")
    gr.Examples([[e] for e in examples], inputs=text, label="Example texts")
    return text


def language_picker(name: str) -> gr.Dropdown:
    # Filled from the checkpoint once it is loaded ("auto" lets the model tell from the text); custom
    # values reach the pipeline, whose error names the languages the checkpoint knows.
    return gr.Dropdown(["auto"], value="auto", label="Language", allow_custom_value=True, elem_id=f"{name}-language")


def buttons(name: str) -> tuple[gr.Button, gr.Button]:
    with gr.Row():
        generate = gr.Button("Generate", variant="primary", elem_id=f"{name}-generate", elem_classes=["pcm-generate"])
        stop = gr.Button("Stop", variant="stop", elem_id=f"{name}-stop")
    return generate, stop


def times_words(service: Service) -> bool:
    """Whether the service can time the words it speaks: this app's engine can, vLLM-Omni has no such
    field (asking would only warn that it was not applied)."""
    return not isinstance(service, RemoteService) or service.ours


def banner_markdown(service: Service) -> str:
    """The persistent notice shown while any tab serves random weights, or a remote backend; empty otherwise."""
    if isinstance(service, RemoteService):
        return remote_banner(service)
    if service.fallbacks:
        reasons = "\n".join(f"- `{f.source}`: {f.reason}" for f in service.fallbacks.values())
        return (
            "### ⚠️ Random weights: the audio is noise\n"
            "These checkpoints could not be had, so their tabs run the built-in tiny random checkpoints:\n"
            f"{reasons}\n\n"
            "To hear real voices, start the app once with network access (the weights download to the "
            "Hugging Face cache, `~/.cache/huggingface` or `$HF_HOME`), or point `--models` at local "
            "checkpoint directories, e.g. `--models clone=/models/Qwen3-TTS-12Hz-0.6B-Base`; then restart."
        )
    tiny_types = [model_type for model_type, choices in service.choices.items() if choices[0] == TINY]
    if tiny_types:
        which = "every tab" if len(tiny_types) == len(service.choices) else "the " + ", ".join(MODEL_TYPES[t].name for t in tiny_types) + " tab(s)"
        return (
            "### ⚠️ Random weights: the audio is noise\n"
            f"The app serves the built-in tiny random checkpoints in {which} (`--tiny`, or `tiny` in `--models`), "
            "for trying the interface and measuring its latency. Start it without them to use the real Qwen3-TTS and Qwen3-Omni checkpoints."
        )
    return ""


def remote_banner(service: RemoteService) -> str:
    """Where the audio comes from, which figures of the latency panel are measured here, and what the backend does not take."""
    text = (
        f"### Remote backend: `{service.url}` ({service.kind})\n"
        "The audio is generated there and streamed through this server. The latency panel measures here: TTFA is the time from "
        "sending the request to the first audio bytes received, each chunk's time its arrival; the backend does not report its "
        "generate and vocode times, so they show as –."
    )
    if not service.ours:
        text += ("\n\nvLLM-Omni does not list its languages (type one; a wrong one is answered with the list) and takes temperature, "
                 "top-k, top-p, repetition penalty and the chunk schedule from its deploy config, not per request.")
    if any(service.random_weights(kind, c) for kind, choices in service.choices.items() for c in choices):
        text += "\n\n⚠️ The backend serves tiny random checkpoints in some tabs: their audio is noise."
    return text


def banner_update(service: Service) -> dict:
    text = banner_markdown(service)
    return gr.update(value=text, visible=bool(text))


def loading_text(service: Service, model_type: str, checkpoint: str) -> str:
    return f"Loading {checkpoint_label(checkpoint, stand_in(service, model_type, checkpoint))} (first use of this checkpoint)…"


def load_checkpoint(service: Service, model_type: str, checkpoint: str, progress: gr.Progress) -> ModelInfo:
    """Load (first use) and describe a checkpoint: what it does shows on the tab's status line, a
    download's progress through tqdm tracking, then the engine's graphs captured (their first runs
    compile the kernels) as they go. (Gradio shows the text only beside a bar, hence the 0.)"""
    if service.is_loaded(model_type, checkpoint):
        return checked_info(service, model_type, checkpoint)
    text = loading_text(service, model_type, checkpoint)
    progress(0, desc=text)
    with ThreadPoolExecutor(1) as pool:
        # In this event's context: gradio finds a download's tqdm bars through it.
        loading = pool.submit(contextvars.copy_context().run, checked_info, service, model_type, checkpoint)
        while not wait([loading], timeout=LOAD_POLL_S).done:
            captured = service.load_progress(model_type, checkpoint)
            if captured is not None:
                done, total = captured
                progress(done / total, desc=f"{text} Compiling kernels and capturing CUDA graphs: {done} / {total}")
        return loading.result()


def checked_info(service: Service, model_type: str, checkpoint: str) -> ModelInfo:
    try:
        return service.info(model_type, checkpoint)
    except TTSInputError as exc:
        raise input_error(exc) from None


def model_loader(service: Service, model_type: str):
    """The tab-load handler of tabs whose checkpoint sets only the language choices: banner, status, language."""

    def load(name: str, current_language: str, progress=gr.Progress(track_tqdm=True)):
        info = load_checkpoint(service, model_type, name, progress)
        return banner_update(service), status_text(info), language_update(info, current_language), picker_update(service, model_type)

    return load


def speech_handler(service: Service, panel: LatencyPanel, kind: ModelType, fields: Sequence[str], advanced: Advanced,
                   tidy: Callable[[dict], dict] | None = None) -> Callable[..., Iterator[dict]]:
    """The Generate handler of a speech tab of `kind`. Its inputs are the tab's components, which hold
    the request fields `fields` in that order, then the Advanced values, then the run id, then the
    Advanced choices; `tidy` may adjust the tab's fields (an imported voice file replaces the reference).
    Gradio finds the request and progress arguments in a handler's signature, so the signature is
    written out from the names."""
    values_end = len(fields) + len(advanced.names)

    def speak(*args) -> Iterator[dict]:
        own, values, run_id = args[:len(fields)], args[len(fields):values_end], args[values_end]
        chosen, (request, progress) = args[values_end + 1:-2], args[-2:]
        tab_fields = dict(zip(fields, own))
        speech = SpeechRequest(**(tidy(tab_fields) if tidy else tab_fields), **sampling_fields(*values), **chosen_fields(chosen), model_type=kind.id)
        # Where the text is fed one token per frame, the words are timed and the one being spoken is highlighted.
        speech = dataclasses.replace(speech, word_timestamps=times_words(service) and speech.streams_text(kind.id))
        yield from generation(service, panel, speech, run_id, request, progress)

    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    speak.__signature__ = inspect.Signature([*(inspect.Parameter(name, positional) for name in [*fields, *advanced.names, "run_id", *advanced.choices]),
                                             inspect.Parameter("request", positional, annotation=gr.Request),
                                             inspect.Parameter("progress", positional, default=gr.Progress(track_tqdm=True))])
    speak.__annotations__ = {"request": gr.Request}
    return speak


def generation(
    service: Service,
    panel: LatencyPanel,
    speech: SpeechRequest,
    run_id: str,
    request: gr.Request | None,
    progress: gr.Progress,
) -> Iterator[dict]:
    """The generation handler's body, one per tab: clear the last run from the panel and say what
    happens (and the seed of this take), validate, warn, then stream into the panel."""
    received = time.perf_counter()
    panel.begin(run_id)
    key = run_key(request, panel.name, run_id)
    checkpoint = speech.checkpoint or service.default_checkpoint(speech.model_type)
    try:
        STOPS.begin(key)
        loaded = service.is_loaded(speech.model_type, checkpoint)
        yield panel.starting(speech.seed, "Starting…" if loaded else loading_text(service, speech.model_type, checkpoint))
        load_checkpoint(service, speech.model_type, checkpoint, progress)
        if STOPS.stopped(key):
            yield panel.stopped(received)
            return
        stream = service.stream(speech, key)
        start = open_stream(stream)
        if STOPS.stopped(key):  # pressed while the stream started: it has a handle to stop now
            service.stop(key)
        try:
            yield from panel.stream(start, stream, run_id, received, stop=lambda: service.stop(key))
        finally:
            stream.close()
    except gr.Error as exc:  # the toast says it too; the strip must not go on saying "Starting…"
        yield {panel.summary: f"**Not generated:** {exc.message}"}
        raise
    finally:
        STOPS.end(key)
        panel.end(run_id)


def open_stream(stream: Iterator) -> StreamStart:
    """The stream's first item: its request validated (a bad one is a gr.Error, before any work), its warnings shown."""
    try:
        start = next(stream)
    except TTSInputError as exc:
        raise input_error(exc) from None
    for warning in start.warnings:
        warn(warning)
    return start


class StopRequests:
    """The runs of this process between their click and their end, and those of them that Stop reached:
    a Stop that comes before a run's stream exists (while its checkpoint loads, or its voice is
    prepared) has no stream to end, so the run looks here before it starts streaming."""

    def __init__(self) -> None:
        self._running: set[str] = set()
        self._stopped: set[str] = set()
        self._lock = threading.Lock()

    def begin(self, key: str) -> None:
        with self._lock:
            self._running.add(key)

    def stop(self, key: str) -> None:
        with self._lock:
            if key in self._running:
                self._stopped.add(key)

    def stopped(self, key: str) -> bool:
        with self._lock:
            return key in self._stopped

    def end(self, key: str) -> None:
        with self._lock:
            self._running.discard(key)
            self._stopped.discard(key)


STOPS = StopRequests()


def run_key(request: gr.Request | None, tab: str, run_id: str) -> str:
    # A run is known by browser session, tab and run id: Stop must reach this run and no other.
    return f"{getattr(request, 'session_hash', None) or ''}:{tab}:{run_id or ''}"


def wire_loading(parts: TabParts) -> None:
    """A tab's checkpoint loads when the tab is first opened or another checkpoint is picked. What the
    load is doing shows once, on the tab's status line: by default Gradio draws it over every output
    (the banner, the status, the language and speaker pickers), four copies at once."""
    parts.tab.select(parts.load, inputs=parts.load_inputs, outputs=parts.load_outputs, show_progress_on=parts.status, api_visibility="private")
    parts.checkpoint.change(parts.load, inputs=parts.load_inputs, outputs=parts.load_outputs, show_progress_on=parts.status,
                            api_name=f"{parts.name}_load")


def wire_buttons(
    service: Service,
    panel: LatencyPanel,
    generate: gr.Button,
    stop: gr.Button,
    handler: Callable[..., Iterator[dict]],
    inputs: list[gr.components.Component],
    advanced: Advanced,
) -> None:
    """Generate runs `handler` at once for every visitor: the model's engine batches the utterances and
    queues what does not fit (the panel shows the position); Stop silences the player, stops the
    stream and frees the engine's row within a frame. `inputs` end with the Advanced values (`advanced.inputs`)."""
    choices = list(advanced.choices.values())
    generate.click(
        handler,
        inputs=inputs + [panel.run_id] + choices,
        outputs=panel.outputs,
        js=panel.arm_js(after=len(choices)),
        concurrency_limit=None,
        show_progress="hidden",  # the player and the summary show progress; spinners only cost the click time
        api_name=f"{panel.name}_generate",
    )

    def stop_stream(run_id: str, request: gr.Request) -> None:
        key = run_key(request, panel.name, run_id)
        STOPS.stop(key)
        service.stop(key)

    # Not a cancel of the run's event: the stopped stream ends within a frame, and the run's own last
    # update ("Stopped after X s", the WAV cleared) comes after every update before it.
    stop.click(stop_stream, inputs=panel.run_id, js=panel.stop_js(), queue=False, api_name=f"{panel.name}_stop")
