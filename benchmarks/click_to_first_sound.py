"""Click to first sound in a browser: `python app.py --tiny` on this machine, driven by headless
Chromium (Debian's /usr/bin/chromium through Playwright). The Custom voice tab's Generate is clicked
N times, a pause between clicks as a user makes; for each click the page's PCM player reports when
it scheduled the first sample and when that sample reaches the speaker (after the browser's output
latency), and the latency panel shows the server's TTFA and when it sent the first chunk. Reported:
each run and the medians, and the time outside the model (first sample scheduled - TTFA).

    python -m benchmarks.click_to_first_sound [--clicks 7] [--pause 1.0] [--json out.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.ports import free_port

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
WAIT_MS = 300_000  # how long any one step may take before the run is given up




def start_app(port: int) -> subprocess.Popen:
    app = subprocess.Popen([sys.executable, "app.py", "--tiny", "--port", str(port)], cwd=REPO, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + WAIT_MS / 1000
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=5).raise_for_status()
            return app
        except httpx.HTTPError:
            if app.poll() is not None or time.monotonic() > deadline:
                app.kill()
                raise SystemExit("The app did not start.") from None
            time.sleep(1)


def open_custom_voice(page) -> None:
    page.get_by_role("tab", name="Custom voice").click()
    page.wait_for_function("() => /^Ready/.test(document.querySelector('#custom-model-status').innerText)")
    page.locator("#custom-advanced").click()
    slider = page.locator("#custom-max-seconds input[type=range]")
    slider.wait_for(state="visible")
    slider.fill("2")
    page.wait_for_function("() => document.querySelector('#custom-max-seconds input[type=number]').value === '2'")
    page.locator("#custom-seed input").fill("7")


def click_once(page) -> dict:
    """One Generate click, to the end of its stream: the player's figures and the server's."""
    previous = page.evaluate("() => (window.qwenTTS.player('custom').stats || {}).run")
    page.click("#custom-generate")
    page.wait_for_function("(p) => { const s = window.qwenTTS.player('custom').stats; return s && s.run !== p && s.done; }", arg=previous)
    stats = page.evaluate("() => window.qwenTTS.player('custom').stats")
    page.wait_for_function("(n) => new RegExp(`final RTF.* in ${n} chunks`).test(document.querySelector('#custom-summary').innerText)",
                           arg=stats["chunks"])
    summary = page.locator("#custom-summary").inner_text()
    return {"scheduled_ms": stats["scheduledMs"], "sound_ms": stats["soundMs"], "chunks": stats["chunks"], "gaps": stats["gaps"],
            "ttfa_ms": float(re.search(r"TTFA ([\d.]+) ms", summary).group(1)),
            "sent_ms": float(re.search(r"first chunk sent ([\d.]+) ms", summary).group(1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clicks", type=int, default=7)
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between clicks (back to back, the last run's WAV still renders)")
    parser.add_argument("--json", type=Path, help="also write the runs and medians here")
    args = parser.parse_args()
    if args.clicks < 1:
        parser.error("--clicks must be at least 1.")
    from playwright.sync_api import sync_playwright

    port = free_port()
    app = start_app(port)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1500})
            page.set_default_timeout(WAIT_MS)
            page.goto(f"http://127.0.0.1:{port}/")
            open_custom_voice(page)
            runs = []
            for _ in range(args.clicks):
                time.sleep(args.pause)
                runs.append(click_once(page))
                print(json.dumps(runs[-1]), flush=True)
            browser.close()
    finally:
        app.kill()
        app.wait()
    median = {key: statistics.median(r[key] for r in runs) for key in ("scheduled_ms", "sound_ms", "ttfa_ms", "sent_ms")}
    median["outside_model_ms"] = statistics.median(r["scheduled_ms"] - r["ttfa_ms"] for r in runs)
    print(f"click to first sound over {args.clicks} clicks (custom voice, tiny model, CPU): first sample scheduled "
          f"{median['scheduled_ms']:.0f} ms after the click, heard at {median['sound_ms']:.0f} ms; server TTFA {median['ttfa_ms']:.0f} ms, "
          f"first chunk sent {median['sent_ms']:.0f} ms after the request arrived; outside the model {median['outside_model_ms']:.0f} ms")
    if args.json:
        args.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "machine": platform.platform(),
                                         "cpus": os.cpu_count(), "runs": runs, "median": median}, indent=2))


if __name__ == "__main__":
    main()
