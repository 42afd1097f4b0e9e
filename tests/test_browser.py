"""The app in headless Chromium (Debian's /usr/bin/chromium driven by Playwright), tiny checkpoints on
CPU: each tab's Generate fills the latency table and starts the PCM player; Stop silences it; the
click-to-first-sound is printed next to the server's TTFA (`python -m benchmarks.click_to_first_sound`
measures it).

Nothing here asserts a duration: every wait is on a condition of the page or the server, and its
timeout (HANG_GUARD_MS) only ends a wait that would never end, so a slow or busy machine makes the
tests slower, never red."""
import importlib.util
import os
import re
import shutil
import statistics
import time
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
TABS = {"clone": "Voice clone", "custom": "Custom voice", "design": "Voice design"}
CLICKS = 3
HANG_GUARD_MS = 300_000  # ends a wait for something that never comes; no wait decides pass or fail by its duration
SCREENSHOTS = os.environ.get("SCREENSHOT_DIR")  # set to keep the screenshots (docs/screenshot*.png)


def browser_missing() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed"
    if not shutil.which(CHROMIUM):
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    return None


if browser_missing() and not os.environ.get("CI"):
    pytest.skip(browser_missing(), allow_module_level=True)  # on CI a missing browser fails below instead


@pytest.fixture(scope="module")
def app_url(live_app):
    return live_app[0]


@pytest.fixture(scope="module")
def browser():
    assert browser_missing() is None, browser_missing()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture()
def page(browser, app_url):
    page = browser.new_page(viewport={"width": 1400, "height": 1500})
    page.set_default_timeout(HANG_GUARD_MS)
    page.set_default_navigation_timeout(HANG_GUARD_MS)
    page.goto(app_url)
    page.wait_for_selector("#clone-generate")
    yield page
    page.close()


def open_tab(page, tab: str, max_seconds: int = 2) -> None:
    page.get_by_role("tab", name=TABS[tab]).click()
    # Settings changed while the tab's load (or an example) is still being answered can be reverted
    # by Gradio's page state when the answer lands, so settle those first.
    page.wait_for_function(f"() => /^Ready/.test(document.querySelector('#{tab}-model-status').innerText)")
    if tab == "clone":
        page.get_by_text("The quick brown fox jumps").first.click()  # a shipped sample voice
        page.wait_for_function("() => document.querySelector('#clone-ref-text textarea').value.startsWith('The quick')")
        page.get_by_text("Voice ready").wait_for()  # the voice prompt, computed before Generate
    page.locator(f"#{tab}-advanced").click()
    set_max_seconds(page, tab, max_seconds)
    page.locator(f"#{tab}-seed input").fill("7")


def set_max_seconds(page, tab: str, seconds: int) -> None:
    """Move the Max length slider until its number box shows the value: an answer of the tab's still
    on its way (an example, the model's status) can put the page's earlier state back, so a move that
    did not take is made again."""
    from playwright.sync_api import TimeoutError as NotYet

    slider = page.locator(f"#{tab}-max-seconds input[type=range]")
    slider.wait_for(state="visible")
    taken = f"(v) => document.querySelector('#{tab}-max-seconds input[type=number]').value === v"
    for _ in range(HANG_GUARD_MS // 5_000):
        slider.fill(str(seconds))
        try:
            page.wait_for_function(taken, arg=str(seconds), timeout=5_000)
            return
        except NotYet:
            pass
    raise AssertionError(f"the {tab} tab's Max length never took {seconds} s")


def player_stats(page, tab: str) -> dict | None:
    return page.evaluate(f"() => window.qwenTTS.player('{tab}').stats")


# How the player placed the run's chunks on the audio clock: for each chunk after the first, whether it
# starts exactly where the one before ends (gapless), after it (a gap: the chunk came late), or before it.
JOINS = """(tab) => {
    const t = window.qwenTTS.player(tab).timeline;
    return t.slice(1).map((piece, i) => {
        const end = t[i].at + t[i].duration;
        return piece.at === end ? "gapless" : piece.at > end ? "gap" : "overlap";
    });
}"""


def assert_gapless_or_gaps_counted(page, tab: str, stats: dict) -> None:
    """Every chunk is scheduled back to back with the one before (gapless playback), except one that
    came after the audio before it had ended, and the player counts and shows exactly those gaps.
    Whether a chunk comes late depends on the machine's speed; how the player joins them does not."""
    joins = page.evaluate(JOINS, tab)
    assert len(joins) == stats["chunks"] - 1 and "overlap" not in joins, joins
    assert joins.count("gap") == stats["gaps"], (joins, stats["gaps"])
    shown = page.locator(f"#{tab}-player").inner_text()
    assert ("gapless" in shown) == (stats["gaps"] == 0) and (f"{stats['gaps']} gap" in shown) == (stats["gaps"] > 0), shown


def click_generate(page, tab: str, previous: str | None) -> None:
    """Click Generate until the player starts a new run. Gradio takes no click on a button whose last
    event is still pending (its WAV still being written, or a Stop's cancel still on its way to the
    server), and drops it whole; a click repeated while an earlier one is being taken is dropped the
    same way, so a repeat never starts a second run."""
    from playwright.sync_api import TimeoutError as NotYet

    started = f"(previous) => {{ const s = window.qwenTTS.player('{tab}').stats; return s && s.run !== previous; }}"
    for _ in range(HANG_GUARD_MS // 5_000):
        page.click(f"#{tab}-generate")
        try:
            page.wait_for_function(started, arg=previous, timeout=5_000)
            return
        except NotYet:  # dropped: the event before has not ended yet
            pass
    raise AssertionError(f"the {tab} tab never took a Generate click")


def generate(page, tab: str) -> dict:
    """Click Generate, wait for the stream to end; the player's numbers and the table's rows."""
    previous = (player_stats(page, tab) or {}).get("run")
    click_generate(page, tab, previous)
    page.wait_for_function(
        f"(previous) => {{ const s = window.qwenTTS.player('{tab}').stats; return s && s.run !== previous && s.done; }}", arg=previous
    )
    stats = player_stats(page, tab)
    page.wait_for_function(
        f"(n) => new RegExp(`final RTF.* in ${{n}} chunks`).test(document.querySelector('#{tab}-summary').innerText)", arg=stats["chunks"]
    )
    rows = int(page.locator(f"#{tab}-table [role=grid]").get_attribute("aria-rowcount")) - 1  # less the header
    summary = page.locator(f"#{tab}-summary").inner_text()
    ttfa = float(re.search(r"TTFA ([\d.]+) ms", summary).group(1))
    sent = float(re.search(r"first chunk sent ([\d.]+) ms", summary).group(1))
    return {**stats, "rows": rows, "ttfa": ttfa, "sent": sent}


def report(line: str, capsys) -> None:
    with capsys.disabled():
        print(f"\n{line}")


@pytest.mark.parametrize("tab", list(TABS))
def test_generate_fills_the_table_and_starts_the_player(page, tab, tmp_path, capsys):
    open_tab(page, tab)
    result = generate(page, tab)
    assert result["chunks"] >= 3 and result["rows"] == result["chunks"]  # every chunk heard and listed
    assert_in_order(result)
    assert_gapless_or_gaps_counted(page, tab, result)
    page.locator(f"#{tab}-audio audio[src]").wait_for(state="attached")  # the whole utterance, downloadable
    shot = Path(SCREENSHOTS or tmp_path) / f"screenshot-{tab}.png"
    page.screenshot(path=str(shot), full_page=True)
    report(
        f"[{tab}] click -> first sample scheduled {result['scheduledMs']:.0f} ms, first sound {result['soundMs']:.0f} ms; "
        f"server TTFA {result['ttfa']:.0f} ms, first chunk sent {result['sent']:.0f} ms after the request; "
        f"{result['chunks']} chunks, {result['gaps']} gaps; screenshot {shot}",
        capsys,
    )


def assert_in_order(run: dict) -> None:
    """The server's interval lies inside the browser's: the click comes before the request arrives,
    the first chunk is made (TTFA) before it is sent, and sent before the browser schedules it, which
    is before it sounds. The summary shows whole milliseconds (0.5 ms of rounding)."""
    assert 0 < run["ttfa"] <= run["sent"] <= run["scheduledMs"] + 0.5 and run["scheduledMs"] <= run["soundMs"], run


def test_click_to_first_sound(page, capsys):
    """Click after click, each run's first sound comes after the server sent its first chunk. How long
    that takes is the machine's business: the test asserts the order of the events each figure is made
    of and prints the figures; benchmarks/click_to_first_sound.py measures them."""
    open_tab(page, "custom")
    runs = []
    for _ in range(CLICKS):
        runs.append(generate(page, "custom"))
        assert_in_order(runs[-1])
    median = {key: statistics.median(r[key] for r in runs) for key in ("scheduledMs", "soundMs", "ttfa", "sent")}
    outside = statistics.median(r["scheduledMs"] - r["ttfa"] for r in runs)
    report(
        f"click-to-first-sound over {CLICKS} runs (custom voice, tiny model, CPU): median first sample scheduled "
        f"{median['scheduledMs']:.0f} ms after the click, heard at {median['soundMs']:.0f} ms (incl. the browser's output latency); "
        f"server TTFA {median['ttfa']:.0f} ms; outside the model {outside:.0f} ms",
        capsys,
    )


def test_stop_silences_the_player_and_the_next_run_plays(page):
    open_tab(page, "design", max_seconds=160)
    page.locator("#design-schedule textarea, #design-schedule input").first.fill("1")
    click_generate(page, "design", None)
    page.wait_for_function("() => { const s = window.qwenTTS.player('design').stats; return s && s.chunks >= 2; }")
    page.click("#design-stop")
    page.wait_for_function("() => /stopped/.test(document.querySelector('#design-player').innerText)")
    assert page.evaluate("() => window.qwenTTS.player('design').sources.size") == 0  # stop() clears them before it shows "stopped"
    set_max_seconds(page, "design", 2)
    page.locator("#design-schedule textarea, #design-schedule input").first.fill("1, 2, 4, 8, 16")
    assert generate(page, "design")["chunks"] >= 3


def test_bad_input_shows_its_message(page):
    open_tab(page, "design")
    page.locator("#design-text textarea").fill("   ")
    page.click("#design-generate")
    page.get_by_text("The text is empty: type what the voice should say.").first.wait_for()


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


def wait_until(condition, what: str) -> None:
    """Poll a condition of the server's state until it holds (HANG_GUARD_MS ends a wait that never would)."""
    deadline = time.monotonic() + HANG_GUARD_MS / 1000
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


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


# ---- listening sessions --------------------------------------------------------------------------

LISTENING_SYSTEMS = """\
systems:
  - {name: zorblax, checkpoint: tiny, mode: voice_design, seed: 1, settings: {max_frames: 8}}
  - {name: quintor, checkpoint: tiny, mode: voice_design, seed: 2, settings: {max_frames: 8}}
items:
  - {name: one, text: Hello there., instruct: A calm voice.}
  - {name: two, text: Good evening., instruct: A deep voice.}
"""


def listen(page, session: str, listener: str) -> None:
    page.goto(f"{page.url.split('?')[0]}?session={session}&listener={listener}")
    page.wait_for_function(f"() => document.querySelector('#listen-session textarea, #listen-session input')?.value === '{session}'")
    page.click("#listen-start")
    page.wait_for_function("() => /Trial/.test(document.querySelector('#listen-progress').innerText)")


HEARD = """(label) => {
    const hint = document.querySelector('#listen-hint').innerText;
    const waiting = (hint.match(/Play (.*) to the end/) || [null, ''])[1].split(', ');
    return !waiting.includes(label);
}"""


def play_to_the_end(page, clip: str, label: str) -> None:
    """Play a clip and wait until the server has counted it as heard. A click that lands while the
    player is still loading plays nothing, so the click is repeated every minute; a repeated click on a
    clip that did play (and is only slow to be counted) plays it again, which counts as heard too."""
    from playwright.sync_api import TimeoutError as NotYet

    for _ in range(HANG_GUARD_MS // 60_000):
        page.locator(f"#{clip} button[aria-label='Play']").click()
        try:
            page.wait_for_function(HEARD, arg=label, timeout=60_000)
            return
        except NotYet:  # not counted within the minute: click again
            pass
    raise AssertionError(f"{clip} was never counted as played to the end")


def test_one_listener_through_an_ab_session_and_the_results(page, live_app):
    _, _, sessions = live_app
    sessions.save("name: browser-ab\ntest: ab\ntrials_per_listener: 2\n" + LISTENING_SYSTEMS)
    sessions.render("browser-ab")
    listen(page, "browser-ab", "ann")
    assert "zorblax" not in page.content() and "quintor" not in page.content()  # blind: no system name anywhere on the page
    for trial in (1, 2):
        assert page.locator("#listen-submit").is_disabled()  # locked until both clips were heard to the end
        play_to_the_end(page, "listen-clip-0", "A")
        play_to_the_end(page, "listen-clip-1", "B")
        page.wait_for_function("() => /vote is open/.test(document.querySelector('#listen-hint').innerText)")
        page.locator("#listen-choice").get_by_text("A", exact=True).click()
        page.click("#listen-submit")
        expected = "Trial 2 of 2" if trial == 1 else "All trials done"
        page.wait_for_function(f"() => document.querySelector('#listen-progress').innerText.includes('{expected}')")
    votes = sessions.store.votes(sessions.session("browser-ab"))
    assert [v["trial"] for v in votes] == [0, 1] and all(v["plays"]["0"] >= 1 and v["plays"]["1"] >= 1 for v in votes)
    page.get_by_role("tab", name="Results").click()
    page.locator("#results-session input").fill("browser-ab")
    page.locator("#results-session input").press("Enter")
    page.click("#results-refresh")
    page.wait_for_function("() => /2 votes/.test(document.querySelector('#results-summary').innerText)")
    assert "zorblax vs quintor" in page.locator("#results-table").inner_text()


def test_one_listener_rates_a_mushra_item(page, live_app):
    _, _, sessions = live_app
    sessions.save("name: browser-mushra\ntest: mushra\nreference: zorblax\ntrials_per_listener: 1\n" + LISTENING_SYSTEMS)
    sessions.render("browser-mushra")
    listen(page, "browser-mushra", "ben")
    page.locator("#listen-reference").wait_for(state="visible")  # the trial's players appear as the page renders them
    assert page.locator("#listen-clip-3").is_hidden()
    for i in range(3):  # zorblax (the hidden reference), quintor, the anchor
        play_to_the_end(page, f"listen-clip-{i}", f"Condition {i + 1}")
    page.wait_for_function("() => /vote is open/.test(document.querySelector('#listen-hint').innerText)")
    for i, score in enumerate((95, 40, 10)):
        box = page.locator(f"#listen-score-{i} input[type=number]")
        box.fill(str(score))
        box.press("Enter")
        # the slider took the value: the submit sends what the sliders hold
        page.wait_for_function(f"(v) => document.querySelector('#listen-score-{i} input[type=range]').value === v", arg=str(score))
    page.click("#listen-submit")
    page.wait_for_function("() => document.querySelector('#listen-progress').innerText.includes('All trials done')")
    (vote,) = sessions.store.votes(sessions.session("browser-mushra"))
    assert sorted(vote["scores"].values()) == [10.0, 40.0, 95.0] and set(vote["scores"]) == {"zorblax", "quintor", "anchor"}


HOSTILE = "<a href=//e.com>a</a>[b](//e.com)<img src=x>"  # a link, a Markdown link, an image


def test_a_crafted_share_link_and_a_file_value_show_as_text(page, app_url):
    """What a link or a pasted session file carries shows in the toasts as the text it is: no
    link and no image appear in a toast."""
    from urllib.parse import quote

    toasts = page.locator("[data-testid=toast-body]")
    page.goto(f"{app_url}?session={quote(HOSTILE)}&listener=ann")
    toasts.filter(has_text="is not a session name").first.wait_for(timeout=30_000)
    assert page.locator("#listen-session textarea, #listen-session input").first.input_value() == ""  # nothing filled in
    page.get_by_role("tab", name="Organize").click()
    page.locator("#organize-text .cm-content").click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(f"{{name: x, test: '{HOSTILE}', systems: [], items: []}}")
    page.click("#organize-check")
    toasts.filter(has_text=f"not '{HOSTILE}'").first.wait_for(timeout=30_000)  # the value, shown literally
    assert toasts.locator("a, img").count() == 0
