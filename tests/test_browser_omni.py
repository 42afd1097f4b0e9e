"""The Omni chat tab in the browser: text and speech stream, the spoken word lights up, Stop and
barge-in cut the reply, bad input shows its sentence."""
import re

from browser import report, skip_without_browser, wait_until

skip_without_browser()


def open_omni(page, max_tokens: int) -> None:
    page.get_by_role("tab", name="Omni chat").click()
    page.wait_for_function("() => /^Ready/.test(document.querySelector('#omni-model-status').innerText)")
    box = page.locator("#omni-max-tokens input[type=number]")
    box.fill(str(max_tokens))
    box.press("Enter")
    page.wait_for_function("(v) => document.querySelector('#omni-max-tokens input[type=range]').value === v", arg=str(max_tokens))
    page.locator("#omni-seed input").fill("7")


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
    assert reply and reply in page.locator("#omni-chatbot").inner_text()  # the chat holds the reply that was spoken
    page.locator("#omni-audio audio[src]").wait_for(state="attached")  # the whole reply, downloadable
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


