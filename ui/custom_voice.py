"""Custom voice tab: a preset speaker of the checkpoint, with a style instruction where it takes one."""
from __future__ import annotations

import gradio as gr

from pipeline.contract.events import ModelInfo
from pipeline.contract.models import CUSTOM_VOICE
from ui import controls
from ui.latency import LatencyPanel, LiveStrip

TYPE = CUSTOM_VOICE
NAME = TYPE.name
EXAMPLES = [
    "Good evening, and welcome to the late news. Here are tonight's top stories.",
    "I can't believe it actually worked! We streamed the whole sentence before it was even finished.",
    "其实我真的有发现，我是一个特别善于观察别人情绪的人。",
]
INSTRUCT_EXAMPLES = ["", "Speak slowly and warmly, like a calm narrator reading a bedtime story.", "用特别愤怒的语气说"]


def instruct_update(info: ModelInfo) -> dict:
    if info.supports_instruct:
        return gr.update(info="How to say it: emotion, pace, style.")
    return gr.update(info="This checkpoint ignores instructions (the 0.6B CustomVoice takes none; pick the 1.7B to use them).")


def build(service: controls.Service, banner: gr.Markdown) -> controls.TabParts:
    with gr.Tab(TYPE.tab, id=NAME) as tab:
        gr.Markdown("Pick one of the checkpoint's preset speakers; the 1.7B checkpoint also follows a style instruction.")
        with gr.Row():
            with gr.Column():
                checkpoint = controls.checkpoint_picker(service, TYPE.id, NAME)
                model_status = controls.model_status(NAME)
                # Filled from the checkpoint when it loads; custom values reach the pipeline, which names the valid ones.
                speaker = gr.Dropdown([], label="Speaker", allow_custom_value=True, elem_id=f"{NAME}-speaker")
                instruct = gr.Textbox(label="Instruction (optional)", lines=2, elem_id=f"{NAME}-instruct")
                gr.Examples([[e] for e in INSTRUCT_EXAMPLES if e], inputs=instruct, label="Example instructions")
            with gr.Column():
                text = controls.text_input(NAME, EXAMPLES)
                language = controls.language_picker(NAME)
                advanced = controls.Advanced.create(NAME)
                generate, stop = controls.buttons(NAME)
                strip = LiveStrip.create(NAME, words=True)  # under the buttons: a run is seen to start where the click is
        panel = LatencyPanel.create(NAME, strip)

    def load(name: str, current_language: str, current_speaker: str | None, progress=gr.Progress(track_tqdm=True)):
        info = controls.load_checkpoint(service, TYPE.id, name, progress)
        speakers = gr.update(choices=info.speakers, value=controls.keep_or_first(current_speaker, info.speakers))
        return (controls.banner_update(service), controls.status_text(info), controls.language_update(info, current_language), speakers,
                instruct_update(info), controls.picker_update(service, TYPE.id))

    speak = controls.speech_handler(service, panel, TYPE, ["checkpoint", "speaker", "instruct", "text", "language"], advanced)
    inputs = [checkpoint, speaker, instruct, text, language, *advanced.inputs]
    controls.wire_buttons(service, panel, generate, stop, speak, inputs, advanced)
    return controls.TabParts(NAME, tab, checkpoint, load, [checkpoint, language, speaker], [banner, model_status, language, speaker, instruct, checkpoint])
