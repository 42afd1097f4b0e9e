"""Voice design tab: a voice described in words speaks the text."""
from __future__ import annotations

import gradio as gr

from pipeline.contract.models import VOICE_DESIGN
from ui import controls
from ui.latency import LatencyPanel, LiveStrip

TYPE = VOICE_DESIGN
NAME = TYPE.name
EXAMPLES = [
    ["A deep, gravelly male voice with a slight British accent, speaking slowly and calmly.",
     "The old lighthouse keeper climbed the stairs one last time, and looked out over the grey sea."],
    ["A bright, energetic young woman, fast and cheerful, like a morning radio host.",
     "Good morning everyone! The sun is out, the coffee is hot, and we have a great show for you today."],
    ["体现撒娇稚嫩的萝莉女声，音调偏高且起伏明显。", "哥哥，你回来啦，人家等了你好久好久了，要抱抱！"],
]


def build(service: controls.Service, banner: gr.Markdown) -> controls.TabParts:
    with gr.Tab(TYPE.tab, id=NAME) as tab:
        gr.Markdown("Describe a voice in words (timbre, age, accent, emotion, pace) and hear it speak.")
        with gr.Row():
            with gr.Column():
                checkpoint = controls.checkpoint_picker(service, TYPE.id, NAME)
                model_status = controls.model_status(NAME)
                description = gr.Textbox(EXAMPLES[0][0], label="Voice description", lines=3, elem_id=f"{NAME}-description")
                text = gr.Textbox(EXAMPLES[0][1], label="Text to speak", lines=3, max_lines=controls.MAX_TEXT_LINES, elem_id=f"{NAME}-text")
                gr.Examples(EXAMPLES, inputs=[description, text], label="Examples")
            with gr.Column():
                language = controls.language_picker(NAME)
                advanced = controls.Advanced.create(NAME)
                generate, stop = controls.buttons(NAME)
                strip = LiveStrip.create(NAME, words=True)  # under the buttons: a run is seen to start where the click is
        panel = LatencyPanel.create(NAME, strip)

    load = controls.model_loader(service, TYPE.id)
    speak = controls.speech_handler(service, panel, TYPE, ["checkpoint", "instruct", "text", "language"], advanced)
    inputs = [checkpoint, description, text, language, *advanced.inputs]
    controls.wire_buttons(service, panel, generate, stop, speak, inputs, advanced)
    return controls.TabParts(NAME, tab, checkpoint, load, [checkpoint, language], [banner, model_status, language, checkpoint])
