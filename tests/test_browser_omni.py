"""The Omni chat tab in the browser: text and speech stream, the spoken word lights up, Stop and
barge-in cut the reply, bad input shows its sentence. On a laptop's window (1366x768) the reply is
seen to start without scrolling, Stop stays where it is while the reply grows, the reply is on the
page once, the chat re-renders once per turn (not per token), a failed turn says why where its reply
would have been, and an empty Seed is a new reply whose seed is shown and, typed, repeats it."""
import re

import pytest
from browser import HANG_GUARD_MS, report, seed_field, skip_without_browser, wait_until

skip_without_browser()

LAPTOP = {"width": 1366, "height": 768}
# The texts the chat's messages and the reply's box show while a reply streams, one sample per frame
# the page draws, in order (a frame that changes nothing adds nothing): how often each changed, as the
# user saw it.
WATCH_RENDERS = """
window.renders = {chat: [], live: []};
const seeRenders = () => {
    for (const [name, selector] of [["chat", "#omni-chatbot [data-testid=user], #omni-chatbot [data-testid=bot]"],
                                    ["live", "#omni-live .omni-live-text"]]) {
        const text = [...document.querySelectorAll(selector)].map((e) => e.innerText).join("\\n");
        const seen = window.renders[name];
        if (seen[seen.length - 1] !== text) seen.push(text);
    }
    requestAnimationFrame(seeRenders);
};
seeRenders();
"""


@pytest.fixture()
def laptop(browser, app_url):
    page = browser.new_page(viewport=LAPTOP)
    page.set_default_timeout(HANG_GUARD_MS)
    page.goto(app_url)
    page.wait_for_selector("#clone-generate")
    yield page
    page.close()


def open_omni(page, max_tokens: int, seed: str | None = "7") -> None:
    """The Omni tab with its model ready, the reply's length set and the seed typed (None: Seed left empty)."""
    page.get_by_role("tab", name="Omni chat").click()
    page.wait_for_function("() => /^Ready/.test(document.querySelector('#omni-model-status').innerText)")
    box = page.locator("#omni-max-tokens input[type=number]")
    box.fill(str(max_tokens))
    box.press("Enter")
    page.wait_for_function("(v) => document.querySelector('#omni-max-tokens input[type=range]').value === v", arg=str(max_tokens))
    if seed is not None:
        seed_field(page, "omni").fill(seed)


def send_and_wait_for_the_end(page, text: str) -> str:
    """Send `text`; the reply's text once its turn is over (its stats shown)."""
    page.locator("#omni-message textarea").fill(text)
    page.click("#omni-generate")
    page.wait_for_function("() => /Last turn/.test(document.querySelector('#omni-stats').innerText)")
    return page.locator("#omni-live").inner_text().strip()


def seed_shown(page) -> str:
    return re.search(r"Seed (\d+)", page.locator("#omni-stats").inner_text()).group(1)


def new_conversation(page) -> None:
    page.click("#omni-clear")
    page.wait_for_function("() => document.querySelector('#omni-stats').innerText.trim() === ''")


def in_viewport(page, selector: str) -> bool:
    box = page.locator(selector).bounding_box()
    return box is not None and 0 <= box["y"] and box["y"] + box["height"] <= page.viewport_size["height"]


def assistant_texts(page) -> list[str]:
    return page.locator("#omni-chatbot .message.bot, #omni-chatbot [data-testid=bot]").all_inner_texts()


def test_omni_chat_streams_text_and_speech_and_highlights_the_spoken_word(page, capsys):
    open_omni(page, max_tokens=40)
    page.locator("#omni-message textarea").fill("Hello there, how are you?")
    page.click("#omni-generate")
    # Text first, then sound, then the span of the token being spoken lights up while it plays.
    page.wait_for_function("() => document.querySelectorAll('#omni-live .speech-token').length >= 3")
    page.wait_for_function("() => { const s = window.qwenTTS.player('omni').stats; return s && s.chunks >= 2; }")
    spoken = page.wait_for_function("() => document.querySelector('#omni-live .speech-token.speaking')?.dataset.first")
    first = int(spoken.json_value())
    later = page.wait_for_function(f"() => {{ const s = document.querySelector('#omni-live .speech-token.speaking'); "
                                   f"return s && +s.dataset.first > {first} && s.dataset.first; }}")
    page.wait_for_function("() => { const s = window.qwenTTS.player('omni').stats; return s && s.done; }")
    page.wait_for_function("() => /first audio/.test(document.querySelector('#omni-stats').innerText)")
    stats = page.locator("#omni-stats").inner_text()
    assert re.search(r"first text token \d+ ms · first audio \d+ ms", stats) and "40 tokens" in stats
    reply = page.locator("#omni-live").inner_text().strip()
    assert reply and page.locator("body").inner_text().count(reply) == 1  # the reply that was spoken, shown once
    page.locator("#omni-audio audio[src]").wait_for(state="attached")  # the whole reply, downloadable
    # The next message moves the reply into the conversation, above the new one.
    page.locator("#omni-message textarea").fill("And then?")
    page.click("#omni-generate")
    page.wait_for_function("() => document.querySelector('#omni-chatbot').innerText.includes('And then?')")
    chat = page.locator("#omni-chatbot").inner_text()
    assert chat.index("Hello there, how are you?") < chat.index(reply) < chat.index("And then?")
    page.click("#omni-stop")
    report(f"[omni] highlight moved from token {first} to {later.json_value()}; {stats}", capsys)


def test_omni_stop_and_barge_in_cut_the_reply_at_once(page, live_app):
    engine = live_app[1].model("omni").engine
    open_omni(page, max_tokens=400)
    page.locator("#omni-message textarea").fill("Tell me a long story.")
    page.click("#omni-generate")
    page.wait_for_function("() => { const s = window.qwenTTS.player('omni').stats; return s && s.chunks >= 2; }")
    (speaking,) = [row.handle for row in engine.slots if row]
    page.click("#omni-stop")
    page.wait_for_function("() => window.qwenTTS.player('omni').stats === null && window.qwenTTS.player('omni').sources.size === 0")
    wait_until(lambda: not any(engine.slots), "the reply's row freed after Stop")
    assert speaking.stopped  # ended by the Stop, not by the reply's end
    # Barge-in: a new message while the reply speaks silences it and answers the new one.
    page.locator("#omni-message textarea").fill("Another question.")
    page.click("#omni-generate")
    page.wait_for_function("() => { const s = window.qwenTTS.player('omni').stats; return s && s.chunks >= 2; }")
    first_run = page.evaluate("() => window.qwenTTS.player('omni').stats.run")
    page.locator("#omni-message textarea").fill("Wait, one more thing.")
    page.click("#omni-generate")
    page.wait_for_function("(run) => { const s = window.qwenTTS.player('omni').stats; return s && s.run !== run && s.chunks >= 1; }",
                           arg=first_run)
    page.wait_for_function("() => document.querySelector('#omni-chatbot').innerText.includes('Wait, one more thing.')")
    chat = page.locator("#omni-chatbot").inner_text()
    assert chat.index("Tell me a long story.") < chat.index("Another question.") < chat.index("Wait, one more thing.")
    page.click("#omni-stop")


def test_omni_empty_message_shows_its_message(page):
    open_omni(page, max_tokens=10)
    page.locator("#omni-message textarea").fill("  ")
    page.click("#omni-generate")
    page.get_by_text("The message is empty: type something or record / upload audio.").first.wait_for()




def test_omni_reply_starts_in_view_keeps_stop_in_place_and_is_shown_once(laptop, capsys):
    page = laptop
    open_omni(page, max_tokens=80)
    assert "Press Send" in page.locator("#omni-live").inner_text()
    assert "Press Send" in page.locator("#omni-player").inner_text()
    assert "Generate" not in page.locator("#omni-live").inner_text() + page.locator("#omni-player").inner_text()
    page.evaluate(WATCH_RENDERS)
    page.locator("#omni-message textarea").fill("Tell me a very short bedtime story about a lighthouse.")
    page.click("#omni-generate")
    page.wait_for_function("() => document.querySelector('#omni-live .speech-token')")
    # The run's start is on screen where the click was: the reply's box, Stop and the player's line.
    assert all(in_viewport(page, s) for s in ("#omni-live", "#omni-stop", "#omni-player")), page.evaluate("scrollY")
    stop_at_first_token = page.locator("#omni-stop").bounding_box()
    page.wait_for_function("() => /Last turn/.test(document.querySelector('#omni-stats').innerText)")
    assert page.locator("#omni-stop").bounding_box() == stop_at_first_token
    # The end: the stats line, the WAV, and the panel's table and plot with every chunk the player heard.
    assert re.search(r"first text token \d+ ms · first audio \d+ ms .* 80 tokens", page.locator("#omni-stats").inner_text())
    page.locator("#omni-audio audio[src]").wait_for(state="attached")
    page.wait_for_function("() => { const s = window.qwenTTS.player('omni').stats; return s && s.done; }")
    chunks = page.evaluate("() => window.qwenTTS.player('omni').stats.chunks")
    assert int(page.locator("#omni-table [role=grid]").get_attribute("aria-rowcount")) - 1 == chunks
    lines = page.locator("#omni-plot polyline").count()
    assert lines >= 1 and page.locator("#omni-plot circle").count() == lines * chunks  # a point per chunk on each stage's line
    reply = page.locator("#omni-live").inner_text().strip()
    assert len(reply.split()) > 20 and page.locator("body").inner_text().count(reply) == 1
    renders = page.evaluate("() => window.renders")
    # The chat changed once (the message joined it); the reply streamed into its box in several updates.
    assert len(renders["chat"]) == 2 and "Tell me a very short bedtime story" in renders["chat"][1], renders["chat"]
    assert len(renders["live"]) >= 3 and renders["live"][-1].strip() == reply
    report(f"[omni] during the reply the chat changed {len(renders['chat']) - 1} time(s), the reply's box {len(renders['live']) - 1} times", capsys)


def test_omni_failed_turn_shows_its_sentence(page, tmp_path):
    open_omni(page, max_tokens=10)
    # A seed the field lets through but the server refuses.
    seed_field(page, "omni").fill("lucky")
    page.locator("#omni-message textarea").fill("Hello?")
    page.click("#omni-generate")
    page.locator("#omni-live").get_by_text("seed must be a whole number").wait_for()
    assert page.locator("#omni-message textarea").input_value() == "Hello?"  # not sent: the message stays to be sent again
    # An uploaded file that is no audio: the UI takes it, the server cannot read it.
    seed_field(page, "omni").fill("7")
    not_audio = tmp_path / "message.wav"
    not_audio.write_bytes(b"these bytes are no recording " * 40)
    page.locator("#omni-voice-in button[aria-label='Upload file']").click()
    page.locator("#omni-voice-in input[type=file]").set_input_files(not_audio)
    page.click("#omni-generate")
    page.locator("#omni-live").get_by_text("could not be read as audio").wait_for()
    assert "Error" not in page.locator("#omni-chatbot").inner_text()  # no bare badge over the conversation


def test_omni_empty_seed_gives_a_new_reply_whose_seed_repeats_it(page):
    open_omni(page, max_tokens=10, seed=None)
    first = send_and_wait_for_the_end(page, "Say something.")
    first_seed = seed_shown(page)
    new_conversation(page)
    send_and_wait_for_the_end(page, "Say something.")
    assert seed_shown(page) != first_seed
    new_conversation(page)
    seed_field(page, "omni").fill(first_seed)
    assert send_and_wait_for_the_end(page, "Say something.") == first
    assert seed_shown(page) == first_seed
