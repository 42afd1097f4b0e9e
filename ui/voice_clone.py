"""Voice clone tab: a reference recording (uploaded, recorded or a sample voice) speaks new text."""
from __future__ import annotations

import json
import time
from pathlib import Path

import gradio as gr

from pipeline.errors import TTSInputError
from pipeline.service import SpeechRequest
from ui import controls
from ui.latency import LatencyPanel

NAME = "clone"
MODEL_TYPE = "base"
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
    with gr.Tab("Voice clone", id=NAME) as tab:
        gr.Markdown("Upload or record 3-20 s of a voice, give its transcript (or use x-vector only), and type what it should say.")
        with gr.Row():
            with gr.Column():
                checkpoint = controls.checkpoint_picker(service, MODEL_TYPE, NAME)
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
            with gr.Column():
                text = controls.text_input(NAME, EXAMPLES)
                language = controls.language_picker(NAME)
                advanced = controls.Advanced.create(NAME)
                generate, stop = controls.buttons(NAME)
        panel = LatencyPanel.create(NAME)

    load = controls.model_loader(service, MODEL_TYPE)

    def speak(name, ref, transcript, xvec, text, language, temperature, top_k, top_p, penalty, seed, schedule, max_seconds, run_id,
              request: gr.Request, progress=gr.Progress(track_tqdm=True)):
        speech = SpeechRequest(
            text, model_type=MODEL_TYPE, checkpoint=name, language=language, ref_audio=ref, ref_text=transcript, x_vector_only=bool(xvec),
            **controls.sampling_fields(temperature, top_k, top_p, penalty, seed, schedule, max_seconds),
        )
        yield from controls.generation(service, panel, speech, run_id, request, progress)

    def prepare(name, ref, transcript, xvec) -> str:
        if ref is None:
            return ""
        start = time.perf_counter()
        try:
            ready = service.prepare_voice(name, ref, transcript, bool(xvec))
        except TTSInputError as exc:
            return f"**Cannot use this reference:** {exc}"
        if not ready:
            return "Add the transcript of the reference (or tick x-vector only) to prepare this voice."
        return f"Voice ready ({(time.perf_counter() - start) * 1000:.0f} ms): prepared once, reused by every generation."

    # The voice prompt is computed as soon as the reference is complete, not at the first Generate.
    voice_inputs = [checkpoint, ref_audio, ref_text, x_vector_only]
    for trigger in (ref_audio.change, ref_text.blur, x_vector_only.change):
        trigger(prepare, voice_inputs, voice_status, concurrency_id=MODEL_TYPE, concurrency_limit=1, trigger_mode="always_last",
                show_progress="minimal", api_visibility="private")

    inputs = [checkpoint, ref_audio, ref_text, x_vector_only, text, language, *advanced.inputs]
    controls.wire_buttons(service, panel, generate, stop, speak, inputs)
    return controls.TabParts(NAME, tab, checkpoint, load, [checkpoint, language], [banner, model_status, language])
