"""The whole page: banner, title, the three tabs; and what `launch` needs to serve it."""
from __future__ import annotations

import tempfile

import gradio as gr

from pipeline.contract import Service
from pipeline.contract.running import MAX_UPLOAD_BYTES
from pipeline.listening import Sessions
from pipeline.server import Access
from ui import controls, custom_voice, listening, omni_chat, voice_clone, voice_design
from ui.latency import player_head
from ui.pcm_stream import CHANNELS

TITLE = "Qwen3-TTS and Qwen3-Omni, streamed"
INTRO = (
    "# Qwen3-TTS and Qwen3-Omni, streamed\n"
    "The audio starts playing with the first 80 ms frame, while the rest is still being generated; "
    "the panel under each tab shows where every millisecond went."
)
CSS = """
.pcm-player { padding: 0.5em 0.75em; border-radius: 8px; background: var(--block-background-fill);
              border: 1px solid var(--border-color-primary); font-variant-numeric: tabular-nums; }
.omni-live-text { padding: 0.5em 0.75em; line-height: 1.6; min-height: 2.5em; }
.speech-token.speaking { background: #ffe08a; color: #1a1300; border-radius: 3px; }
#banner { border-left: 6px solid #e8a400; padding-left: 1em; background: #fff8e1; color: #3d2e00; }
"""
# Phones: Gradio's side margins (32 px each) take a sixth of a 390 px screen; a third of that leaves
# the forms, the live strip and the chunk table their width. Served in <head>: Gradio rewrites the
# `css` of `launch` to apply inside the page's content only, where the margins are not.
PHONE_CSS = """
@media (max-width: 600px) {
  .gradio-container .main.app { padding-left: var(--size-3); padding-right: var(--size-3); }
}
"""


def build_demo(service: controls.Service, sessions: Sessions | None = None) -> gr.Blocks:
    """The page; `sessions`: the listening sessions' folder and votes (a temporary one if None). A tab
    whose model type the service does not serve (a remote backend serves what it serves) is left out."""
    sessions = sessions or Sessions(tempfile.mkdtemp(prefix="listening-"), service)
    modules = [m for m in (voice_clone, custom_voice, voice_design, omni_chat) if service.choices.get(m.TYPE.id)]
    with gr.Blocks(title=TITLE, delete_cache=(3600, 3600)) as demo:
        banner = gr.Markdown(controls.banner_markdown(service), visible=bool(controls.banner_markdown(service)), elem_id="banner")
        gr.Markdown(INTRO)
        # "wrap": on a narrow screen the tab bar takes more rows; Gradio's default hides the tabs that do
        # not fit behind a "⋯" menu, where a newcomer on a phone does not find them.
        with gr.Tabs(overflow_behavior="wrap", elem_id="page-tabs"):
            tabs = [module.build(service, banner) for module in modules]
            listen = listening.build(sessions)
        for parts in tabs:
            controls.wire_loading(parts)
        first = tabs[0]  # the tab on screen at page load is "first used" as the page opens
        # The load's progress shows on the tab's status line alone, never over the banner and the intro.
        demo.load(first.load, inputs=first.load_inputs, outputs=first.load_outputs, show_progress_on=first.status, api_visibility="private")
        demo.load(None, js=listening.OPEN_FROM_LINK_JS)
        demo.load(listening.from_link, outputs=[listen.session, listen.listener], show_progress="hidden", api_visibility="private")
    return demo


def launch_options(service: Service | None = None, access: Access | None = None) -> dict:
    """What `Blocks.launch` needs besides host and port: the player script, styling, upload limit,
    and the routes beside Gradio's (the PCM stream; the speech and chat API when `service`, local models, is given)."""
    access = access or Access()  # one for both: a client's requests in flight are counted over all routes
    api = []
    if service is not None:  # the API's routes import the local models' service (torch): only where there is one
        from pipeline.server import chat_routes, speech_routes, stream_routes

        api = [*speech_routes(service, access), *chat_routes(service, access), *stream_routes(service, access)]
    return {
        "head": f"{player_head()}<style>{PHONE_CSS}</style>",
        "css": CSS,
        "theme": gr.themes.Soft(),
        "max_file_size": MAX_UPLOAD_BYTES,
        "show_error": True,
        "app_kwargs": {"routes": [CHANNELS.route(), *api]},
    }
