"""Omni chat tab: talk with Qwen3-Omni by text or voice; the reply streams as text and as speech,
the word being spoken is highlighted as it plays, and a new message (or Stop) cuts the reply off."""
from __future__ import annotations

import html
import time

import gradio as gr

from pipeline.service import DEFAULT_SPEAKER, DEFAULT_SYSTEM_PROMPT, MAX_AUDIO_SECONDS, MAX_REPLY_TOKENS, ChatEnd, ChatRequest, TextDelta, Turn
from ui import controls
from ui.latency import LatencyPanel

NAME = "omni"
MODEL_TYPE = "omni"
EXAMPLES = [
    "Hi! What's a good way to start learning to play the piano?",
    "Tell me a very short bedtime story about a lighthouse.",
    "你好！请用两句话介绍一下你自己。",
]
LOOKAHEAD_S = 555 / 24000  # code2wav holds this much back: frame k starts k * 80 ms - LOOKAHEAD_S into the audio
LIVE_IDLE = '<div class="omni-live-text">The reply appears here while it is spoken; the word being said is highlighted.</div>'


def live_html(deltas: list[TextDelta]) -> str:
    """The reply as spans that carry the speech frames of their tokens (token k is spoken in frame k);
    ui/player.js highlights the span whose frames are playing."""
    spans = "".join(f'<span class="speech-token" data-first="{d.first_token}" data-last="{d.last_token}">{html.escape(d.text)}</span>'
                    for d in deltas)
    return f'<div class="omni-live-text" data-lead-s="{LOOKAHEAD_S:.6f}">{spans}</div>'


def user_message(text: str, audio: str | None) -> list[dict]:
    parts = [{"role": "user", "content": {"path": audio, "mime_type": "audio/wav"}}] if audio else []
    if text.strip():
        parts.append({"role": "user", "content": text})
    return parts


def turn_stats(end: ChatEnd, audio_seconds: float, wall_s: float, backend: str | None = None) -> str:
    first_text = f"{end.first_text_ms:.0f} ms" if end.first_text_ms is not None else "–"
    first_audio = f"{end.first_audio_ms:.0f} ms" if end.first_audio_ms is not None else "–"
    rtf = f"{wall_s / audio_seconds:.2f}" if audio_seconds else "–"
    state = " · stopped" if end.stopped else ""
    # A remote backend's reply carries no token ids: its times are this server's, its tokens are not counted.
    where, tokens = (" (measured here)", "") if backend else ("", f"{len(end.tokens)} tokens, ")
    return (f"Last turn: first text token **{first_text}** · first audio **{first_audio}**{where} · RTF **{rtf}** · "
            f"{tokens}{end.frames} frames ({audio_seconds:.1f} s){state}")


def build(service: controls.Service, banner: gr.Markdown) -> controls.TabParts:
    with gr.Tab("Omni chat", id=NAME) as tab:
        gr.Markdown("Talk with **Qwen3-Omni**: type or speak; the reply streams as text and as speech. "
                    "Sending a new message or pressing Stop while it speaks cuts it off.")
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="Conversation", height=380, elem_id=f"{NAME}-chatbot")
                live = gr.HTML(LIVE_IDLE, elem_id=f"{NAME}-live")
                with gr.Row(equal_height=True):
                    message = gr.Textbox(EXAMPLES[0], show_label=False, placeholder="Type a message…", lines=2, scale=3, elem_id=f"{NAME}-message")
                    audio = gr.Audio(sources=["microphone", "upload"], type="filepath", label=f"…or speak (up to {MAX_AUDIO_SECONDS:.0f} s)",
                                     scale=2, elem_id=f"{NAME}-voice-in")
                gr.Examples([[e] for e in EXAMPLES], inputs=message, label="Example messages")
                with gr.Row():
                    send = gr.Button("Send", variant="primary", elem_id=f"{NAME}-generate", elem_classes=["pcm-generate"])
                    stop = gr.Button("Stop", variant="stop", elem_id=f"{NAME}-stop")
                    clear = gr.Button("New conversation", elem_id=f"{NAME}-clear")
                stats = gr.Markdown("", elem_id=f"{NAME}-stats")
            with gr.Column(scale=2):
                checkpoint = controls.checkpoint_picker(service, MODEL_TYPE, NAME)
                model_status = controls.model_status(NAME)
                speaker = gr.Dropdown([DEFAULT_SPEAKER], value=DEFAULT_SPEAKER, label="Voice", allow_custom_value=True, elem_id=f"{NAME}-speaker")
                system = gr.Textbox(DEFAULT_SYSTEM_PROMPT, label="System prompt", lines=4, elem_id=f"{NAME}-system")
                max_tokens = gr.Slider(1, MAX_REPLY_TOKENS, value=256, step=1, label="Max reply length (tokens)", elem_id=f"{NAME}-max-tokens")
                seed = gr.Number(value=None, precision=0, label="Seed", info="Empty: a new random reply each time.", elem_id=f"{NAME}-seed")
        panel = LatencyPanel.create(NAME)
        previous_run = gr.Textbox(visible=False)  # the run a new message interrupts (barge-in)
        turns = gr.State([])  # the conversation as the model reads it: {"role", "text", "audio"} per turn

    def load(name: str, current_speaker: str | None, progress=gr.Progress(track_tqdm=True)):
        info = controls.load_checkpoint(service, MODEL_TYPE, name, progress)
        speakers = gr.update(choices=info.speakers, value=controls.keep_or_first(current_speaker, info.speakers))
        status = f"Ready: {controls.checkpoint_label(info.checkpoint)} · {len(info.speakers)} voices" + (" · random weights (noise)" if info.random_weights else "")
        return controls.banner_update(service), status, speakers

    def chat(name, speaker_name, system_prompt, tokens, seed_value, text, audio_path, history, shown, interrupted, run_id, request: gr.Request,
             progress=gr.Progress(track_tqdm=True)):
        received = time.perf_counter()
        if interrupted:
            service.stop(controls.run_key(request, NAME, interrupted))
        text = text or ""
        history = list(history or []) + [{"role": "user", "text": text, "audio": audio_path}]
        chat_request = ChatRequest([Turn(**t) for t in history], system=system_prompt or "", speaker=speaker_name or DEFAULT_SPEAKER,
                                   seed=None if seed_value is None else int(seed_value), max_new_tokens=int(tokens))
        key = controls.run_key(request, NAME, run_id)
        panel.begin(run_id)
        try:
            controls.load_checkpoint(service, MODEL_TYPE, name, progress)
            stream = service.chat(chat_request, name, key)
            start = controls.open_stream(stream)
            # The reply's bubble opens with its first text: a Stop before it (while the thinker reads the
            # conversation) leaves the message sent and no empty reply. The message joins the conversation now.
            messages = list(shown or []) + user_message(text, audio_path)
            asked = len(messages)
            deltas: list[TextDelta] = []
            yield {message: "", audio: None, chatbot: messages, live: live_html([]), stats: "", turns: history}

            def on_event(event) -> dict:
                if isinstance(event, TextDelta):
                    deltas.append(event)
                    reply = "".join(d.text for d in deltas)
                    if not reply:
                        return {}
                    messages[asked:] = [{"role": "assistant", "content": reply}]
                    return {chatbot: messages, live: live_html(deltas), turns: history + [{"role": "assistant", "text": reply, "audio": None}]}
                if isinstance(event, ChatEnd):
                    seconds = 0.0 if event.first_audio_ms is None else event.frames * 0.08
                    update = {stats: turn_stats(event, seconds, time.perf_counter() - received, start.backend)}
                    if not event.stopped:  # a stopped reply keeps what was shown; a newer message may own the state by now
                        update[turns] = history + [{"role": "assistant", "text": event.text, "audio": None}]
                    return update
                return {}

            try:
                yield from panel.stream(start, stream, run_id, received, stop=lambda: service.stop(key), on_event=on_event)
            finally:
                stream.close()
        finally:
            panel.end(run_id)

    def stop_reply(run_id: str, request: gr.Request) -> None:
        service.stop(controls.run_key(request, NAME, run_id))

    def new_conversation(run_id: str, request: gr.Request):
        stop_reply(run_id, request)
        return [], [], LIVE_IDLE, ""

    event = send.click(
        chat, inputs=[checkpoint, speaker, system, max_tokens, seed, message, audio, turns, chatbot, previous_run, panel.run_id],
        outputs=[message, audio, chatbot, live, stats, turns, *panel.outputs], js=panel.arm_js(pass_interrupted=True), concurrency_limit=None, show_progress="hidden",
        trigger_mode="multiple",  # a message sent while the reply speaks is taken at once (barge-in)
        api_name=f"{NAME}_send",
    )
    stop.click(stop_reply, inputs=panel.run_id, js=panel.stop_js(), cancels=[event], queue=False, api_name=f"{NAME}_stop")
    clear.click(new_conversation, inputs=panel.run_id, outputs=[chatbot, turns, live, stats], js=panel.stop_js(), cancels=[event], queue=False,
                api_visibility="private")
    return controls.TabParts(NAME, tab, checkpoint, load, [checkpoint, speaker], [banner, model_status, speaker])
