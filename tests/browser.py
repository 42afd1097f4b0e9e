"""What the browser tests share: headless Chromium (Debian's /usr/bin/chromium driven by Playwright)
on the app serving the tiny checkpoints on CPU, and the steps a user takes on the speech tabs.

Nothing here asserts a duration: every wait is on a condition of the page or the server, and its
timeout (HANG_GUARD_MS) only ends a wait that would never end, so a slow or busy machine makes the
tests slower, never red."""
import importlib.util
import os
import re
import shutil
import time

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]
TABS = {"clone": "Voice clone", "custom": "Custom voice", "design": "Voice design"}
CLICKS = 3
HANG_GUARD_MS = 300_000  # ends a wait for something that never comes; no wait decides pass or fail by its duration
SCREENSHOTS = os.environ.get("SCREENSHOT_DIR")  # set to keep the tests' screenshots (the README's: python -m benchmarks.screenshots)


def browser_missing() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed"
    if not shutil.which(CHROMIUM):
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    return None



def skip_without_browser() -> None:
    """Skip the calling test module where no browser is installed, except on CI, where the tests fail instead."""
    if browser_missing() and not os.environ.get("CI"):
        pytest.skip(browser_missing(), allow_module_level=True)


def open_tab(page, tab: str, max_seconds: int = 2, seed: str | None = "7") -> None:
    """Open a speech tab ready to generate: its model ready, the clone tab's sample voice prepared, the
    Advanced accordion open with the max length and the seed set (`seed=None` leaves Seed empty)."""
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
    if seed is not None:
        seed_field(page, tab).fill(seed)


def seed_field(page, tab: str):
    return page.locator(f"#{tab}-seed input, #{tab}-seed textarea").first


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


def assert_in_order(run: dict) -> None:
    """The server's interval lies inside the browser's: the click comes before the request arrives,
    the first chunk is made (TTFA) before it is sent, and sent before the browser schedules it, which
    is before it sounds. The summary shows whole milliseconds (0.5 ms of rounding)."""
    assert 0 < run["ttfa"] <= run["sent"] <= run["scheduledMs"] + 0.5 and run["scheduledMs"] <= run["soundMs"], run


def wait_until(condition, what: str) -> None:
    """Poll a condition of the server's state until it holds (HANG_GUARD_MS ends a wait that never would)."""
    deadline = time.monotonic() + HANG_GUARD_MS / 1000
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


