"""Voice clone tab: a reference recording (uploaded, recorded or a sample voice) speaks new text; the
voice computed from it can be exported as a file and imported again instead of the recording."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import gradio as gr

from pipeline.contract.events import VoiceInfo
from pipeline.contract.models import BASE
from pipeline.errors import TTSInputError
from ui import controls
from ui.errors import input_error
from ui.latency import LatencyPanel, LiveStrip

TYPE = BASE
NAME = TYPE.name
VOICES = Path(__file__).resolve().parent.parent / "assets" / "voices"
EXAMPLES = [
    "Hello! This is my voice, cloned from a few seconds of audio, and it plays while it is being generated.",
    "The first sound arrives before the sentence is finished, so a conversation with a machine can feel natural.",
    "今天天气很好，我们去公园散步吧。",
]


def sample_voices() -> list[list[str]]:
    """[audio path, transcript] for each shipped reference voice (see assets/README.md)."""
    voices = json.loads((VOICES / "voices.json").read_text(encoding="utf-8"))
    return [[str(VOICES / v["file"]), v["transcript"]] for v in voices]


def build(service: controls.Service, banner: gr.Markdown) -> controls.TabParts:
    with gr.Tab(TYPE.tab, id=NAME) as tab:
        gr.Markdown("Upload or record 3-20 s of a voice, give its transcript (or use x-vector only), and type what it should say.")
        with gr.Row():
            with gr.Column():
                checkpoint = controls.checkpoint_picker(service, TYPE.id, NAME)
                model_status = controls.model_status(NAME)
                ref_audio = gr.Audio(
                    sources=["upload", "microphone"],
                    type="filepath",
                    format=None,  # decoded by the pipeline, which names the problem with a bad file
                    label="Reference voice (3-20 s)",
                    elem_id=f"{NAME}-ref-audio",
                )
                ref_text = gr.Textbox(label="Transcript of the reference", lines=2, elem_id=f"{NAME}-ref-text")
                x_vector_only = gr.Checkbox(
                    label="x-vector only: clone from the speaker embedding alone (no transcript needed; less similar)",
                )
                voice_status = gr.Markdown("", elem_id=f"{NAME}-voice-status")
                gr.Examples(sample_voices(), inputs=[ref_audio, ref_text], label="Sample voices (synthetic, free to ship)")
                export = gr.DownloadButton("Export voice", value=None, interactive=False, size="sm", elem_id=f"{NAME}-export")
                saved = gr.File(
                    label="Import voice (a file from Export voice; used instead of the reference above until cleared)",
                    file_types=[".safetensors"],
                    type="filepath",
                    elem_id=f"{NAME}-voice-file",
                )
            with gr.Column():
                text = controls.text_input(NAME, EXAMPLES)
                language = controls.language_picker(NAME)
                advanced = controls.Advanced.create(NAME)
                generate, stop = controls.buttons(NAME)
                strip = LiveStrip.create(NAME, words=True)  # under the buttons: a run is seen to start where the click is
        panel = LatencyPanel.create(NAME, strip)

    load = controls.model_loader(service, TYPE.id)
    speak = controls.speech_handler(service, panel, TYPE, ["checkpoint", "ref_audio", "ref_text", "x_vector_only", "voice_prompt", "text", "language"],
                                    advanced, voice_fields)

    def voice_state(name, ref, transcript, xvec, voice_file) -> Iterator[tuple[str, dict]]:
        """The status line and the Export button for the voice Generate will use: an imported voice
        file if there is one (a bad one is a gr.Error), else the reference. Each wait (the checkpoint's
        first load, the voice prompt) says what it is doing while it lasts."""
        no_export = gr.update(value=None, interactive=False)
        if voice_file or ref is not None:
            yield from loading(name, no_export)
        if not voice_file:
            yield from prepare(name, ref, transcript, xvec, no_export)
            return
        yield f"Reading the voice file `{Path(voice_file).name}`…", no_export
        try:
            info = service.load_voice_file(name, voice_file)
        except TTSInputError as exc:
            raise input_error(exc) from None
        yield saved_voice_status(Path(voice_file).name, info), no_export

    def loading(name, no_export) -> Iterator[tuple[str, dict]]:
        if not service.is_loaded(TYPE.id, name):
            yield f"{controls.loading_text(service, TYPE.id, name)} The voice is prepared next.", no_export

    def prepare(name, ref, transcript, xvec, no_export) -> Iterator[tuple[str, dict]]:
        if ref is None:
            yield "", no_export
            return
        if not (xvec or (transcript or "").strip()):
            yield "Add the transcript of the reference (or tick x-vector only) to prepare this voice.", no_export
            return
        yield preparing_text(bool(xvec)), no_export
        start = time.perf_counter()
        try:
            service.prepare_voice(name, ref, transcript, bool(xvec))
        except TTSInputError as exc:
            yield f"**Cannot use this reference:** {exc}", no_export
            return
        status = f"Voice ready ({(time.perf_counter() - start) * 1000:.0f} ms): computed once, reused by every generation."
        exported = service.export_voice(name, ref, transcript, bool(xvec))  # None over a backend, which makes voices itself
        yield status, gr.update(value=str(exported), interactive=True) if exported else no_export

    # The voice prompt is computed (or the voice file loaded) as soon as the voice is complete, not at
    # the first Generate; another checkpoint means another voice, and may refuse the imported one.
    voice_inputs = [checkpoint, ref_audio, ref_text, x_vector_only, saved]
    for trigger in (ref_audio.change, ref_text.blur, x_vector_only.change, saved.change, checkpoint.change):
        trigger(voice_state, voice_inputs, [voice_status, export], concurrency_id=TYPE.id, concurrency_limit=1, trigger_mode="always_last",
                show_progress="minimal", api_name=f"{NAME}_voice", api_visibility="private")

    inputs = [checkpoint, ref_audio, ref_text, x_vector_only, saved, text, language, *advanced.inputs]
    controls.wire_buttons(service, panel, generate, stop, speak, inputs, advanced)
    return controls.TabParts(NAME, tab, checkpoint, load, [checkpoint, language], [banner, model_status, language, checkpoint])


def voice_fields(fields: dict) -> dict:
    """An imported voice file replaces the reference recording, its transcript and its mode."""
    if fields["voice_prompt"]:
        return {**fields, "ref_audio": None, "ref_text": None, "x_vector_only": False}
    return {**fields, "voice_prompt": None, "x_vector_only": bool(fields["x_vector_only"])}


def preparing_text(x_vector_only: bool) -> str:
    made_of = "its speaker embedding" if x_vector_only else "its speaker embedding and the codes of the recording"
    return f"Preparing this voice: computing {made_of} (once per recording; every Generate then reuses it)…"


def saved_voice_status(name: str, info: VoiceInfo) -> str:
    mode = "x-vector only" if info.x_vector_only else f"ICL with {info.ref_seconds:.1f} s of reference and its transcript"
    return f"**Using the imported voice** `{name}` ({mode}); the reference audio above is not used. Clear the file to use it again."
