"""Omni chat tab: talk with Qwen3-Omni by text or voice; the reply streams as text and as speech,
the word being spoken is highlighted as it plays, and a new message (or Stop) cuts the reply off.

The reply being spoken streams into one light HTML box (`#omni-live`), refreshed with the latency
panel's batches of records (at most every UPDATE_INTERVAL_S, not per token). The chatbot, which
re-renders every message's Markdown on each update, changes once per turn: it shows the conversation
before the last reply, which joins it when the next message is sent. So each reply is on the page
once, and the page's main thread stays free while a reply streams. The box has a fixed height and
scrolls, so the message box and the buttons under it stay in place as the reply grows.
"""
from __future__ import annotations

import html
import logging
import time

import gradio as gr

from pipeline.contract.events import DEFAULT_SPEAKER, DEFAULT_SYSTEM_PROMPT, MAX_AUDIO_SECONDS, MAX_REPLY_TOKENS, ChatEnd, TextDelta
from pipeline.contract.models import OMNI
from ui import controls
from ui.errors import toast_text
from ui.latency import LatencyPanel, LiveStrip, checkpoint_label

log = logging.getLogger("ui")

TYPE = OMNI
NAME = TYPE.name
EXAMPLES = [
    "Hi! What's a good way to start learning to play the piano?",
    "Tell me a very short bedtime story about a lighthouse.",
    "你好！请用两句话介绍一下你自己。",
]
LOOKAHEAD_S = 555 / 24000  # code2wav holds this much back: frame k starts k * 80 ms - LOOKAHEAD_S into the audio
LIVE_HEIGHT = 136  # px, about five lines: a longer reply scrolls inside the box (ui/player.js keeps the spoken word in view)
LIVE_CSS = """
.omni-live-note { opacity: 0.7; }
.omni-live-error { color: var(--error-text-color, #b91c1c); font-weight: 600; }
"""
PLAYER_IDLE = "Press Send: the reply plays here while it is generated."


def live_note(text: str, kind: str = "note") -> str:
    """The box's line when no reply text is in it: `text` is HTML (a gr.Error's message is already escaped)."""
    return f'<div class="omni-live-text omni-live-{kind}">{text}</div>'


LIVE_IDLE = live_note("Press Send: the reply appears here as it is spoken, the word being said highlighted.")
READING = live_note("Reading the conversation…")
STOPPED_EARLY = live_note("Stopped before the reply began.")


def live_html(deltas: list[TextDelta]) -> str:
    """The reply as spans that carry the speech frames of their tokens (token k is spoken in frame k);
    ui/player.js highlights the span whose frames are playing."""
    spans = "".join(f'<span class="speech-token" data-first="{d.first_token}" data-last="{d.last_token}">{html.escape(d.text)}</span>'
                    for d in deltas)
    return f'<div class="omni-live-text" data-lead-s="{LOOKAHEAD_S:.6f}">{spans}</div>'


def failed_html(message: str) -> str:
    """A failed turn's sentence (HTML, as a gr.Error's message is), where its reply would have been."""
    return live_note(f"⚠️ {message}", "error")


def failure_sentence(exc: Exception) -> str:
    """The sentence for a failure that is not a user's input error (the server log has its traceback)."""
    return f"The reply failed: {exc}" if str(exc) else f"The reply failed ({type(exc).__name__}); the server log has the details."


def user_message(text: str, audio: str | None) -> list[dict]:
    parts = [{"role": "user", "content": {"path": audio, "mime_type": "audio/wav"}}] if audio else []
    if text.strip():
        parts.append({"role": "user", "content": text})
    return parts


def chat_messages(turns: list[dict]) -> list[dict]:
    """The chatbot's messages for the conversation's turns."""
    messages: list[dict] = []
    for turn in turns or []:
        if turn["role"] == "user":
            messages += user_message(turn["text"], turn["audio"])
        else:
            messages.append({"role": "assistant", "content": turn["text"]})
    return messages


def conversation(turns: list[dict], last_reply: str) -> list[dict]:
    """The conversation so far: the turns up to the last message, then the reply to it as far as it was written."""
    return list(turns or []) + ([{"role": "assistant", "text": last_reply, "audio": None}] if last_reply else [])


def seed_text(seed: int) -> str:
    return f"Seed **{seed}**: type it in Seed to hear this reply again."


def turn_stats(end: ChatEnd, audio_seconds: float, wall_s: float, seed: int, backend: str | None = None) -> str:
    first_text = f"{end.first_text_ms:.0f} ms" if end.first_text_ms is not None else "–"
    first_audio = f"{end.first_audio_ms:.0f} ms" if end.first_audio_ms is not None else "–"
    rtf = f"{wall_s / audio_seconds:.2f}" if audio_seconds else "–"
    state = " · stopped" if end.stopped else ""
    # A remote backend's reply carries no token ids: its times are this server's, its tokens are not counted.
    where, tokens = (" (measured here)", "") if backend else ("", f"{len(end.tokens)} tokens, ")
    return (f"Last turn: first text token **{first_text}** · first audio **{first_audio}**{where} · RTF **{rtf}** · "
            f"{tokens}{end.frames} frames ({audio_seconds:.1f} s){state}\n\n{seed_text(seed)}")


def build(service: controls.Service, banner: gr.Markdown) -> controls.TabParts:
    with gr.Tab(TYPE.tab, id=NAME) as tab:
        gr.Markdown("Talk with **Qwen3-Omni**: type or speak; the reply streams as text and as speech. "
                    "Sending a new message or pressing Stop while it speaks cuts it off.")
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="Conversation", height=260, elem_id=f"{NAME}-chatbot")
                live = gr.HTML(LIVE_IDLE, min_height=LIVE_HEIGHT, max_height=LIVE_HEIGHT, css_template=LIVE_CSS, padding=True,
                               elem_id=f"{NAME}-live")
                message = gr.Textbox(EXAMPLES[0], show_label=False, placeholder="Type a message…", lines=2, max_lines=2, elem_id=f"{NAME}-message")
                with gr.Row():
                    send = gr.Button("Send", variant="primary", elem_id=f"{NAME}-generate", elem_classes=["pcm-generate"])
                    stop = gr.Button("Stop", variant="stop", elem_id=f"{NAME}-stop")
                    clear = gr.Button("New conversation", elem_id=f"{NAME}-clear")
                strip = LiveStrip.create(NAME, PLAYER_IDLE)  # under the buttons: a reply is seen to start where the click is
                stats = gr.Markdown("", elem_id=f"{NAME}-stats")
                with gr.Row(equal_height=True):
                    audio = gr.Audio(sources=["microphone", "upload"], type="filepath", label=f"…or speak (up to {MAX_AUDIO_SECONDS:.0f} s), then Send",
                                     scale=2, elem_id=f"{NAME}-voice-in")
                    with gr.Column(scale=3):
                        gr.Examples([[e] for e in EXAMPLES], inputs=message, label="Example messages")
            with gr.Column(scale=2):
                checkpoint = controls.checkpoint_picker(service, TYPE.id, NAME)
                model_status = controls.model_status(NAME)
                speaker = gr.Dropdown([DEFAULT_SPEAKER], value=DEFAULT_SPEAKER, label="Voice", allow_custom_value=True, elem_id=f"{NAME}-speaker")
                system = gr.Textbox(DEFAULT_SYSTEM_PROMPT, label="System prompt", lines=4, elem_id=f"{NAME}-system")
                max_tokens = gr.Slider(1, MAX_REPLY_TOKENS, value=256, step=1, label="Max reply length (tokens)", elem_id=f"{NAME}-max-tokens")
                seed = controls.seed_box(NAME, "Empty: a new random reply each time; the seed of each reply is shown after it.")
        panel = LatencyPanel.create(NAME, strip)
        previous_run = gr.Textbox(visible=False)  # the run a new message interrupts (barge-in)
        turns = gr.State([])  # the conversation up to the last message, as the model reads it: {"role", "text", "audio"} per turn
        reply = gr.State("")  # the reply to the last message as far as it was written (shown in `live`, not yet in the chatbot)
    replying: dict[str, str] = {}  # browser session -> the run whose reply the tab shows; an interrupted one updates nothing more

    def load(name: str, current_speaker: str | None, progress=gr.Progress(track_tqdm=True)):
        info = controls.load_checkpoint(service, TYPE.id, name, progress)
        speakers = gr.update(choices=info.speakers, value=controls.keep_or_first(current_speaker, info.speakers))
        status = (f"Ready: {checkpoint_label(info.checkpoint, info.stand_in)} · {len(info.speakers)} voices"
                  + (" · random weights (noise)" if info.random_weights else ""))
        return controls.banner_update(service), status, speakers, controls.picker_update(service, TYPE.id)

    def chat(name, speaker_name, system_prompt, tokens, seed_value, text, audio_path, history, last_reply, interrupted, run_id,
             request: gr.Request, progress=gr.Progress(track_tqdm=True)):
        received = time.perf_counter()
        if interrupted:
            service.stop(controls.run_key(request, NAME, interrupted))
        session = controls.run_key(request, NAME, "")
        replying[session] = run_id
        panel.begin(run_id)
        try:
            yield from reply_turn(name, speaker_name, system_prompt, tokens, seed_value, text or "", audio_path, conversation(history, last_reply),
                                  run_id, controls.run_key(request, NAME, run_id), received, lambda: replying.get(session) == run_id, progress)
        except gr.Error as exc:  # the toast fades; the sentence stays where the reply would have been, the last reply's panel cleared
            if replying.get(session) == run_id:
                yield failed(exc.message)
            raise
        except Exception as exc:
            log.exception("Omni chat turn failed")
            sentence = toast_text(failure_sentence(exc))
            if replying.get(session) == run_id:
                yield failed(sentence)
            raise gr.Error(sentence, print_exception=False) from exc
        finally:
            panel.end(run_id)
            if replying.get(session) == run_id:
                del replying[session]

    def failed(sentence: str) -> dict:
        """A failed turn's update: its sentence where the reply would have been, the last reply's panel cleared."""
        return {live: failed_html(sentence), **panel.starting(None, "")}

    def reply_turn(name, speaker_name, system_prompt, tokens, seed_value, text, audio_path, history, run_id, key, received, current, progress):
        """The turn's updates: the message taken (and the seed) into the conversation, then the reply's
        text into `live` and the panel's, the last reply's table, plot and WAV cleared with the first of
        them rather than with the message: the page's work for one update grows with its outputs, and
        the message's was the reply's longest main-thread task. A checkpoint that is not loaded yet
        says so first."""
        taken = controls.take_seed(seed_value)
        checkpoint = name or service.default_checkpoint(TYPE.id)
        if not service.is_loaded(TYPE.id, checkpoint):
            yield {live: live_note(controls.loading_text(service, TYPE.id, checkpoint)), stats: "", **panel.starting(None, "Starting…")}
        controls.load_checkpoint(service, TYPE.id, checkpoint, progress)
        history = history + [{"role": "user", "text": text, "audio": audio_path}]
        # Here, not at the top: pipeline.omni imports torch, which a UI over a remote backend loads only once it chats.
        from pipeline.omni import ChatRequest, Turn

        chat_request = ChatRequest([Turn(**t) for t in history], system=system_prompt or "", speaker=speaker_name or DEFAULT_SPEAKER,
                                   seed=taken, max_new_tokens=int(tokens))
        stream = service.chat(chat_request, checkpoint, key)
        start = controls.open_stream(stream)
        # Accepted: the message joins the conversation (the chatbot follows `turns`) and leaves the input boxes.
        yield {message: "", audio: None, live: READING, stats: seed_text(taken), turns: history, reply: "", panel.summary: "Starting…"}
        deltas: list[TextDelta] = []
        cleared = panel.cleared()  # sent with the reply's first update (which overrides what it sets), apart from the message's

        def on_event(event) -> dict:
            if not current():  # a newer message owns the box and the reply now
                return {}
            if isinstance(event, TextDelta):
                deltas.append(event)
                written = "".join(d.text for d in deltas)
                return {live: live_html(deltas), reply: written} if written else {}
            if isinstance(event, ChatEnd):
                seconds = 0.0 if event.first_audio_ms is None else event.frames * 0.08
                update = {stats: turn_stats(event, seconds, time.perf_counter() - received, taken, start.backend)}
                if not event.stopped:  # a stopped reply keeps what was written
                    update[reply] = event.text
                return update
            return {}

        try:
            for update in panel.stream(start, stream, run_id, received, stop=lambda: service.stop(key), on_event=on_event):
                yield {**cleared, **update}
                cleared = {}
        finally:
            stream.close()

    def stop_reply(run_id: str, made: dict | None, written: str, request: gr.Request) -> dict:
        service.stop(controls.run_key(request, NAME, run_id))
        update = panel.stopped_update(made)
        if made and not written:  # stopped while the model read the conversation: the box says so instead of "Reading…"
            update[live] = STOPPED_EARLY
        if made and not int(made["chunks"]):  # before the first audio, the last reply's table and plot may still show
            update = {**panel.cleared(), **update}
        return update

    def new_conversation(run_id: str, request: gr.Request):
        service.stop(controls.run_key(request, NAME, run_id))
        return [], [], "", LIVE_IDLE, ""

    # After the click, the page shows the reply's box through the player's line under the buttons (the
    # box's top first where the window is shorter than that).
    show_reply = (f"const top = document.getElementById('{NAME}-live').getBoundingClientRect().top - 8; "
                  f"const bottom = document.getElementById('{NAME}-strip').getBoundingClientRect().bottom + 8; "
                  "if (top < 0 || bottom > innerHeight) scrollBy(0, Math.min(top, Math.max(0, bottom - innerHeight)));")
    event = send.click(
        chat, inputs=[checkpoint, speaker, system, max_tokens, seed, message, audio, turns, reply, previous_run, panel.run_id],
        outputs=[message, audio, live, stats, turns, reply, *panel.outputs],
        js=f"(...args) => {{ const armed = ({panel.arm_js(pass_interrupted=True)})(...args); {show_reply} return armed; }}",
        concurrency_limit=None, show_progress="hidden",
        trigger_mode="multiple",  # a message sent while the reply speaks is taken at once (barge-in)
        api_name=f"{NAME}_send",
    )
    # The chatbot is no output of Send: Gradio would draw its bare "Error" badge over it when a turn
    # fails, and re-render it at every status change of the reply's stream.
    turns.change(chat_messages, inputs=turns, outputs=chatbot, queue=False, show_progress="hidden", api_visibility="private")
    stop.click(stop_reply, inputs=[panel.run_id, strip.stopped, reply], outputs=[panel.summary, panel.table, panel.plot, panel.audio, live],
               js=f"(...args) => [...({panel.stop_js(report=True)})(), args[2]]",
               cancels=[event], queue=False, show_progress="hidden", api_name=f"{NAME}_stop")
    clear.click(new_conversation, inputs=panel.run_id, outputs=[chatbot, turns, reply, live, stats], js=panel.stop_js(), cancels=[event], queue=False,
                show_progress="hidden", api_visibility="private")
    return controls.TabParts(NAME, tab, checkpoint, load, [checkpoint, speaker], [banner, model_status, speaker, checkpoint])
