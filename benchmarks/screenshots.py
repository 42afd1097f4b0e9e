"""Screenshots of every tab before and after a run, on a desktop window (1366x900) and a 390 px wide
phone (390x844): the app serving the tiny random checkpoints on CPU (as the browser tests serve it),
driven by headless Chromium (Debian's /usr/bin/chromium through Playwright).

Each tab is shot as a newcomer finds it and again after a run: Generate on the speech tabs, Send on
Omni chat, the sample session checked on the Listening test. A shot is the page from its top, cut at
MAX_HEIGHT, stored as a 256-colour PNG (the UI's flat colours survive; the files stay small).

    python -m benchmarks.screenshots [--out docs/screenshots] [--only phone|desktop]
"""
from __future__ import annotations

import argparse
import io
import tempfile
from collections.abc import Callable
from pathlib import Path

from PIL import Image

from benchmarks.ports import free_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
VIEWPORTS = {"desktop": {"width": 1366, "height": 900}, "phone": {"width": 390, "height": 844}}
MAX_HEIGHT = {"desktop": 2400, "phone": 4400}  # px of page kept from the top: the form, the run's panel and its WAV
WAIT_MS = 300_000  # how long any one step may take before the run is given up
MAX_SECONDS = 2  # the speech tabs' Max length: a short utterance, as a newcomer's first try
OMNI_TOKENS = 40  # the Omni chat's reply length in tokens




def start_app() -> tuple[str, Callable[[], None]]:
    """The app on a free localhost port, every tab's tiny checkpoint loaded (the tests' live app): its URL and its close."""
    from pipeline.listening import Sessions
    from pipeline.service import ModelService
    from ui.app import build_demo, launch_options

    service = ModelService(tiny=True)
    service.preload()  # the shots show the tabs ready, not their first load
    demo = build_demo(service, Sessions(tempfile.mkdtemp(prefix="screenshots-listening-"), service.model))
    demo.queue(default_concurrency_limit=None)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **launch_options(service))
    return f"http://127.0.0.1:{port}/", demo.close


def open_tab(page, label: str, status_id: str | None) -> None:
    """Click the tab and wait until its model says it is ready (a tab's load can revert settings made before)."""
    page.get_by_role("tab", name=label, exact=True).click()
    if status_id:
        page.wait_for_function(f"() => /^Ready/.test(document.querySelector('#{status_id}').innerText)")
    page.evaluate("() => window.scrollTo(0, 0)")


def shorten_speech(page, tab: str) -> None:
    """Set Max length to MAX_SECONDS in the Advanced accordion, then fold it again, as the user leaves it."""
    page.locator(f"#{tab}-advanced").click()
    slider = page.locator(f"#{tab}-max-seconds input[type=range]")
    slider.wait_for(state="visible")
    slider.fill(str(MAX_SECONDS))
    page.wait_for_function(f"(v) => document.querySelector('#{tab}-max-seconds input[type=number]').value === v", arg=str(MAX_SECONDS))
    page.locator(f"#{tab}-advanced > button, #{tab}-advanced .label-wrap").first.click()
    slider.wait_for(state="hidden")


def prepare_clone(page) -> None:
    page.get_by_text("The quick brown fox jumps").first.click()  # a shipped sample voice
    page.get_by_text("Voice ready").wait_for()


def run_speech(page, tab: str) -> None:
    """Generate, then wait until the stream has ended and the WAV is on the page."""
    page.click(f"#{tab}-generate")
    page.wait_for_function(f"() => {{ const s = window.qwenTTS.player('{tab}').stats; return s && s.done; }}")
    page.locator(f"#{tab}-audio audio[src], #{tab}-audio [data-testid=waveform-controls], #{tab}-audio .waveform-container").first.wait_for(
        state="attached")


def prepare_omni(page) -> None:
    box = page.locator("#omni-max-tokens input[type=number]")
    box.fill(str(OMNI_TOKENS))
    box.press("Enter")
    page.wait_for_function("(v) => document.querySelector('#omni-max-tokens input[type=range]').value === v", arg=str(OMNI_TOKENS))


def run_omni(page) -> None:
    """Send the example message, then wait for the reply's spoken end and the turn's figures."""
    page.click("#omni-generate")
    page.wait_for_function("() => { const s = window.qwenTTS.player('omni').stats; return s && s.done; }")
    page.wait_for_function("() => /first audio/.test(document.querySelector('#omni-stats').innerText)")


def run_listening(page) -> None:
    """Open the Organize view, load the sample session file into it and Check it."""
    page.get_by_role("tab", name="Organize", exact=True).click()
    page.click("#organize-sample")
    page.wait_for_function("() => document.querySelector('#organize-text .cm-content').innerText.trim().length > 0")
    page.click("#organize-check")
    page.wait_for_function("() => document.querySelector('#organize-status').innerText.trim().length > 0")


# Per tab: its label, the element saying its model is ready, what is done before the first shot, and the run.
TABS = {
    "clone": ("Voice clone", "clone-model-status", lambda p: (shorten_speech(p, "clone"), prepare_clone(p)), lambda p: run_speech(p, "clone")),
    "custom": ("Custom voice", "custom-model-status", lambda p: shorten_speech(p, "custom"), lambda p: run_speech(p, "custom")),
    "design": ("Voice design", "design-model-status", lambda p: shorten_speech(p, "design"), lambda p: run_speech(p, "design")),
    "omni": ("Omni chat", "omni-model-status", prepare_omni, run_omni),
    "listening": ("Listening test", None, lambda p: None, run_listening),
}


def shoot(page, size: str, path: Path) -> int:
    """The page from its top, at most MAX_HEIGHT[size] px of it, as a 256-colour PNG at `path`: its bytes."""
    height = min(page.evaluate("() => document.documentElement.scrollHeight"), MAX_HEIGHT[size])
    page.mouse.move(0, 0)  # no hover highlight on the button just clicked
    png = page.screenshot(full_page=True, clip={"x": 0, "y": 0, "width": VIEWPORTS[size]["width"], "height": height}, animations="disabled")
    Image.open(io.BytesIO(png)).convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return path.stat().st_size


def shoot_every_tab(browser, url: str, size: str, out: Path) -> list[tuple[Path, int]]:
    """Every tab before and after its run, on a fresh page of the given size."""
    page = browser.new_page(viewport=VIEWPORTS[size])
    page.set_default_timeout(WAIT_MS)
    page.goto(url)
    page.wait_for_selector("#clone-generate")
    shots = []
    try:
        for tab, (label, status, prepare, run) in TABS.items():
            open_tab(page, label, status)
            prepare(page)
            page.evaluate("() => window.scrollTo(0, 0)")
            for moment in ("before", "after"):
                if moment == "after":
                    run(page)
                path = out / f"{size}-{tab}-{moment}.png"
                shots.append((path, shoot(page, size, path)))
                print(f"{path} {shots[-1][1] / 1000:.0f} kB, page {page.evaluate('() => document.documentElement.scrollHeight')} px high", flush=True)
    finally:
        page.close()
    return shots


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots"), help="folder of the PNGs (default %(default)s)")
    parser.add_argument("--only", choices=sorted(VIEWPORTS), help="one window size (default: both)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from playwright.sync_api import sync_playwright

    url, close = start_app()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            shots = [shot for size in ([args.only] if args.only else VIEWPORTS) for shot in shoot_every_tab(browser, url, size, args.out)]
            browser.close()
    finally:
        close()
    print(f"{len(shots)} screenshots in {args.out}, {sum(size for _, size in shots) / 1e6:.2f} MB in all")


if __name__ == "__main__":
    main()
