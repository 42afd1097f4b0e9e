"""The speech tabs in the browser: each tab's Generate fills the latency table and starts the PCM
player; the run is seen to start without scrolling on a laptop's screen; Stop silences it and says so;
an empty Seed is a new take whose seed is shown, and typing it repeats the take; each wait says what
it is doing; the table fits a phone. The click-to-first-sound is printed next to the server's TTFA
(`python -m benchmarks.click_to_first_sound` measures it)."""
import re
import statistics
from contextlib import contextmanager
from pathlib import Path

import pytest
from browser import (
    CLICKS,
    HANG_GUARD_MS,
    SCREENSHOTS,
    TABS,
    assert_gapless_or_gaps_counted,
    assert_in_order,
    click_generate,
    generate,
    open_tab,
    player_stats,
    report,
    seed_field,
    set_max_seconds,
    skip_without_browser,
)

skip_without_browser()


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
    page.wait_for_function("() => /^Stopped after [\\d.]+ s, with [\\d.]+ s of audio in \\d+ chunks/.test(document.querySelector('#design-summary').innerText)")
    set_max_seconds(page, "design", 2)
    page.locator("#design-schedule textarea, #design-schedule input").first.fill("1, 2, 4, 8, 16")
    assert generate(page, "design")["chunks"] >= 3


def test_bad_input_shows_its_message(page):
    open_tab(page, "design")
    page.locator("#design-text textarea").fill("   ")
    page.click("#design-generate")
    page.get_by_text("The text is empty: type what the voice should say.").first.wait_for()




def wav_link(page, tab: str):
    """The download link of the tab's whole-utterance WAV (there while the player holds one)."""
    return page.locator(f"#{tab}-audio a[data-testid=download-link]")


def run_wav_digest(page, tab: str) -> str:
    """SHA-256 of the WAV the tab's player offers for download (the run's whole utterance)."""
    src = page.wait_for_function("(tab) => document.querySelector(`#${tab}-audio a[data-testid=download-link]`)?.href", arg=tab).json_value()
    return page.evaluate("""async (src) => {
        const digest = await crypto.subtle.digest("SHA-256", await (await fetch(src)).arrayBuffer());
        return Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join("");
    }""", src)


def seed_shown(page, tab: str) -> str:
    return re.search(r"Seed (\d+): type it in Seed", page.locator(f"#{tab}-take").inner_text()).group(1)


@pytest.mark.parametrize("size", [(1366, 768), (1400, 900)])
def test_a_run_is_seen_to_start_without_scrolling_and_stop_marks_it(browser, app_url, size):
    """On a laptop's window the live strip (player line, summary, seed) is on screen while the run
    streams; Stop says when it stopped, and the last run's WAV is gone rather than left beside it."""
    page = browser.new_page(viewport={"width": size[0], "height": size[1]})
    page.set_default_timeout(HANG_GUARD_MS)
    try:
        page.goto(app_url)
        open_tab(page, "design")
        generate(page, "design")
        wav_link(page, "design").wait_for(state="attached")  # a finished run's WAV
        set_max_seconds(page, "design", 160)
        page.locator("#design-schedule textarea, #design-schedule input").first.fill("1")
        previous = page.evaluate("() => window.qwenTTS.player('design').stats.run")
        click_generate(page, "design", previous)
        # Where the strip is while the run streams, and Stop pressed in the same moment (the tiny model's
        # utterance is short: a Stop from here after the condition could come after its end).
        box = page.wait_for_function("""() => {
            const s = window.qwenTTS.player('design').stats;
            if (!s || s.chunks < 2 || s.done) return null;
            const box = document.querySelector('#design-strip').getBoundingClientRect();
            document.querySelector('#design-stop').click();
            return { top: box.top, bottom: box.bottom, height: window.innerHeight };
        }""").json_value()
        assert 0 <= box["top"] and box["bottom"] <= box["height"], box
        assert "First sound" in page.locator("#design-legend").inner_text() and "TTFA" in page.locator("#design-legend").inner_text()
        page.wait_for_function("() => /^Stopped after [\\d.]+ s/.test(document.querySelector('#design-summary').innerText)")
        assert "final RTF" not in page.locator("#design-summary").inner_text()
        assert wav_link(page, "design").count() == 0
    finally:
        page.close()


def test_an_empty_seed_is_a_new_take_shown_after_the_run_and_typing_it_repeats_the_take(page):
    open_tab(page, "custom", seed=None)
    assert seed_field(page, "custom").input_value() == ""  # empty by default, not 0
    generate(page, "custom")
    first_seed, first_wav = seed_shown(page, "custom"), run_wav_digest(page, "custom")
    generate(page, "custom")
    second_seed, second_wav = seed_shown(page, "custom"), run_wav_digest(page, "custom")
    assert first_seed != second_seed and first_wav != second_wav
    seed_field(page, "custom").fill(first_seed)
    generate(page, "custom")
    assert seed_shown(page, "custom") == first_seed and run_wav_digest(page, "custom") == first_wav


# Every text the page shows in a status line or a component's loading overlay, and the most of those
# overlays on screen at once, sampled on every frame from the page's first script on.
SAMPLER = """(() => {
    window.seen = { texts: new Set(), most: 0 };
    const tick = () => {
        const shown = [...document.querySelectorAll("[data-testid=status-tracker]")]  // a component's, not the app's own boot screen
            .filter((e) => !e.classList.contains("hide") && e.offsetParent && e.innerText.trim() && e.parentElement.closest("[id]"));
        window.seen.most = Math.max(window.seen.most, shown.length);
        for (const e of [...shown, ...document.querySelectorAll("[id$=-voice-status], [id$=-model-status]")]) window.seen.texts.add(e.innerText);
        requestAnimationFrame(tick);
    };
    requestAnimationFrame(tick);
})();"""


def seen_texts(page) -> list[str]:
    return page.evaluate("() => [...window.seen.texts]")


@contextmanager
def sampled_page(browser, url: str, width: int, height: int):
    """A new page of the app at `url` that records every text its status lines show (SAMPLER); closed after."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(HANG_GUARD_MS)
    try:
        page.add_init_script(SAMPLER)
        page.goto(url)
        yield page
    finally:
        page.close()


def test_preparing_a_sample_voice_says_what_it_is_doing(browser, app_url):
    with sampled_page(browser, app_url, 1400, 1500) as page:
        page.wait_for_function("() => /^Ready/.test(document.querySelector('#clone-model-status')?.innerText)")
        page.get_by_text("Good morning. Today the weather").first.click()  # a sample voice no other test here prepares
        page.wait_for_function("() => document.querySelector('#clone-ref-text textarea').value.startsWith('Good morning')")
        page.wait_for_function("() => /^Voice ready/.test(document.querySelector('#clone-voice-status').innerText)")
        assert any(t.startswith("Preparing this voice: computing its speaker embedding") for t in seen_texts(page)), seen_texts(page)


@pytest.fixture(scope="module")
def cold_app(tiny_checkpoints, tmp_path_factory):
    """The app with nothing loaded yet: the tiny checkpoints, and for the Custom voice tab a checkpoint
    that cannot be had (the tiny one serves in its place)."""
    from conftest import free_port

    from pipeline.service import TINY, ModelService
    from ui.app import build_demo, launch_options

    missing = str(tmp_path_factory.mktemp("cold") / "no-such-checkpoint")
    choices = {"base": (TINY,), "custom_voice": (missing,), "voice_design": (TINY,), "omni": (TINY,)}
    service = ModelService(choices, tiny_dir=Path(tiny_checkpoints["base"]).parent)
    demo = build_demo(service)
    demo.queue(default_concurrency_limit=None)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **launch_options(service))
    yield f"http://127.0.0.1:{port}/", missing
    demo.close()


def test_a_first_load_shows_one_message_and_the_name_of_what_serves(browser, cold_app):
    """What the load says is asserted in tests/test_app_service.py: a quick load may end before a frame shows it."""
    url, missing = cold_app
    with sampled_page(browser, url, 1366, 768) as page:
        page.wait_for_function("() => /^Ready/.test(document.querySelector('#clone-model-status [data-testid=markdown]')?.innerText)")
        assert page.locator("#clone-model-status [data-testid=markdown]").inner_text().startswith("Ready: built-in tiny random checkpoint ·")
        page.get_by_role("tab", name="Custom voice").click()
        page.wait_for_function("() => /^Ready/.test(document.querySelector('#custom-model-status [data-testid=markdown]')?.innerText)")
        stand_in = f"built-in tiny random checkpoint (in place of {missing})"
        assert page.locator("#custom-model-status [data-testid=markdown]").inner_text().startswith(f"Ready: {stand_in} ·")
        assert page.locator("#custom-checkpoint input").input_value() == stand_in
        assert page.evaluate("() => window.seen.most") == 1  # each load's message shows once, on its tab's status line


def test_the_table_and_the_strip_fit_a_phone_screen(browser, app_url):
    page = browser.new_page(viewport={"width": 390, "height": 844})
    page.set_default_timeout(HANG_GUARD_MS)
    try:
        page.goto(app_url)
        open_tab(page, "custom")
        generate(page, "custom")
        width = page.evaluate("() => window.innerWidth")
        page.locator("#custom-table").scroll_into_view_if_needed()
        shown = page.evaluate("""() => [...document.querySelectorAll('#custom-table thead th')].filter((th) => th.offsetParent)
            .map((th) => [th.innerText.trim(), th.getBoundingClientRect().right])""")
        assert [name for name, _ in shown] == ["chunk", "ms since request", "RTF"] and all(right <= width for _, right in shown), (shown, width)
        wrap = page.locator("#custom-table .table-wrap")
        assert wrap.evaluate("(e) => e.scrollWidth <= e.clientWidth")  # nothing to scroll sideways to
        for part in ("strip", "summary", "take"):
            box = page.locator(f"#custom-{part}").bounding_box()
            assert box["x"] >= 0 and box["x"] + box["width"] <= width, (part, box, width)
    finally:
        page.close()


def test_the_word_being_spoken_is_highlighted_where_the_text_is_fed_token_by_token(page):
    """Custom voice puts the whole text in the prompt by default, which times no words: the box says how
    to get them. With the text fed one token per frame, the word being spoken lights up and moves on
    while the audio plays."""
    open_tab(page, "custom", max_seconds=4)
    assert "Text layout" in page.locator("#custom-live").inner_text()
    page.locator("#custom-non-streaming-mode").get_by_label("One token per frame").check()
    text = page.locator("#custom-text textarea").input_value()
    click_generate(page, "custom", (player_stats(page, "custom") or {}).get("run"))
    spoken = page.wait_for_function("() => { const s = document.querySelector('#custom-live .speech-token.speaking'); "
                                    "return s && [s.textContent, +s.dataset.first]; }").json_value()
    later = page.wait_for_function("(first) => { const s = document.querySelector('#custom-live .speech-token.speaking'); "
                                   "return s && +s.dataset.first > first && [s.textContent, +s.dataset.first]; }", arg=spoken[1]).json_value()
    assert spoken[0] in text.split() and later[0] in text.split()
