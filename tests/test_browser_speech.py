"""The speech tabs in the browser: each tab's Generate fills the latency table and starts the PCM
player; Stop silences it; the click-to-first-sound is printed next to the server's TTFA
(`python -m benchmarks.click_to_first_sound` measures it)."""
import statistics
from pathlib import Path

import pytest
from browser import CLICKS, SCREENSHOTS, TABS, assert_gapless_or_gaps_counted, assert_in_order, click_generate, generate, open_tab, report, \
    set_max_seconds, skip_without_browser

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
    set_max_seconds(page, "design", 2)
    page.locator("#design-schedule textarea, #design-schedule input").first.fill("1, 2, 4, 8, 16")
    assert generate(page, "design")["chunks"] >= 3


def test_bad_input_shows_its_message(page):
    open_tab(page, "design")
    page.locator("#design-text textarea").fill("   ")
    page.click("#design-generate")
    page.get_by_text("The text is empty: type what the voice should say.").first.wait_for()


