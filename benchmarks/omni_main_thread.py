"""The Omni chat tab's main thread while a reply streams: `python app.py --tiny` on this machine, driven
by headless Chromium (Debian's /usr/bin/chromium through Playwright) in a 1366x768 window. One message
is sent with a reply of N tokens (80 by default); the page's Long Tasks API (a buffered
PerformanceObserver of 'longtask' entries, installed before the page loads) records every task that
held the main thread 50 ms or more. Reported: the longest such task between the Send click and the
end of the reply (its stats line and its WAV shown), how many there were, and their blocking time
(the part of each beyond 50 ms, during which a click waits). The Long Tasks API measures wall time,
which a busy machine stretches (a task waits for a CPU core); a performance trace of the same reply
gives each of the page's main-thread tasks between the same two points its CPU time too, the work
the page itself asked for. The load average before and after is printed: other jobs on the machine
stretch the wall times.

    python -m benchmarks.omni_main_thread [--tokens 80] [--json out.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

from benchmarks.click_to_first_sound import CHROMIUM, CHROMIUM_ARGS, WAIT_MS, start_app
from benchmarks.ports import free_port

VIEWPORT = {"width": 1366, "height": 768}
MESSAGE = "Tell me a very short bedtime story about a lighthouse."
SENT, ENDED = "omni-send", "omni-reply-end"  # the page's performance marks around a reply
# Every long task of the page, from its load on; the reply's are picked out by their start times.
RECORD_LONG_TASKS = """
window.longTasks = [];
new PerformanceObserver((list) => {
    for (const entry of list.getEntries()) window.longTasks.push({ start: entry.startTime, duration: entry.duration });
}).observe({ type: "longtask", buffered: true });
"""


def open_omni(page, tokens: int) -> None:
    page.get_by_role("tab", name="Omni chat").click()
    page.wait_for_function("() => /^Ready/.test(document.querySelector('#omni-model-status').innerText)")
    box = page.locator("#omni-max-tokens input[type=number]")
    box.fill(str(tokens))
    box.press("Enter")
    page.wait_for_function("(v) => document.querySelector('#omni-max-tokens input[type=range]').value === v", arg=str(tokens))
    page.locator("#omni-seed input").fill("7")
    page.locator("#omni-message textarea").fill(MESSAGE)


def main_thread_tasks(trace: dict) -> list[dict]:
    """The renderer main thread's tasks in a Chromium trace that started between the page's SENT and
    ENDED marks (the tracing's own start and stop run tasks outside them): when each started (ms
    after SENT), its wall and CPU milliseconds. A task appears as nested RunTask events: the outermost counts."""
    events = trace["traceEvents"]
    threads = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
               and e["args"].get("name") == "CrRendererMain"}
    marks = {e["name"]: e["ts"] for e in events if e.get("name") in (SENT, ENDED)}
    runs = sorted((e for e in events if e.get("ph") == "X" and e.get("name") in ("RunTask", "ThreadControllerImpl::RunTask")
                   and (e["pid"], e["tid"]) in threads and marks[SENT] <= e["ts"] <= marks[ENDED]), key=lambda e: (e["ts"], -e["dur"]))
    tasks, busy_until = [], 0
    for e in runs:
        if e["ts"] >= busy_until:
            tasks.append({"at_ms": (e["ts"] - marks[SENT]) / 1000, "wall_ms": e["dur"] / 1000, "cpu_ms": e.get("tdur", e["dur"]) / 1000})
            busy_until = e["ts"] + e["dur"]
    return tasks


def send_and_wait(page) -> tuple[float, float]:
    """Send the message and wait for the reply's end (its stats line and its WAV shown): the page's
    SENT and ENDED marks (performance.now() at both; a trace records them too)."""
    sent_at = page.evaluate("(name) => performance.mark(name).startTime", SENT)
    page.click("#omni-generate")
    page.wait_for_function("() => /Last turn/.test(document.querySelector('#omni-stats').innerText)")
    page.locator("#omni-audio audio[src]").wait_for(state="attached")
    return sent_at, page.evaluate("(name) => performance.mark(name).startTime", ENDED)


def one_reply(page) -> dict:
    """One reply: the long tasks (wall time) that started between the Send click and its end."""
    sent_at, ended_at = send_and_wait(page)
    tasks = page.evaluate("([from, to]) => window.longTasks.filter((t) => t.start >= from && t.start <= to)", [sent_at, ended_at])
    durations = [t["duration"] for t in tasks]
    return {
        "reply_s": round((ended_at - sent_at) / 1000, 1),
        "longest_task_ms": round(max(durations, default=0.0)),
        "long_tasks": len(durations),
        "blocking_ms": round(sum(d - 50 for d in durations)),
        "stats": page.locator("#omni-stats").inner_text().strip(),
    }


def traced_reply(browser, page) -> dict:
    """The same reply again (a new conversation, the same message and seed) under a performance trace:
    the main thread's tasks by CPU time (tracing slows the page, so the first reply is measured without it)."""
    page.click("#omni-clear")
    page.wait_for_function("() => !/Last turn/.test(document.querySelector('#omni-stats').innerText)")
    page.locator("#omni-message textarea").fill(MESSAGE)
    browser.start_tracing(page=page, categories=["toplevel", "disabled-by-default-devtools.timeline", "blink.user_timing"])
    send_and_wait(page)
    tasks = main_thread_tasks(json.loads(browser.stop_tracing()))
    longest = max(tasks, key=lambda t: t["cpu_ms"])
    return {"longest_task_cpu_ms": round(longest["cpu_ms"]), "longest_task_cpu_at_ms": round(longest["at_ms"]),
            "long_tasks_by_cpu": sum(t["cpu_ms"] >= 50 for t in tasks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=80, help="reply length in tokens (the Max reply length slider)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    load_before = [round(x, 2) for x in os.getloadavg()]
    port = free_port()
    app = start_app(port)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(WAIT_MS)
            page.add_init_script(RECORD_LONG_TASKS)
            page.goto(f"http://127.0.0.1:{port}/")
            open_omni(page, args.tokens)
            result = one_reply(page)
            result.update(traced_reply(browser, page))
            browser.close()
    finally:
        app.kill()
        app.wait()
    result.update(load_average_before=load_before, load_average=[round(x, 2) for x in os.getloadavg()], date=datetime.date.today().isoformat(),
                  machine=platform.platform(), cpus=os.cpu_count(), processor=platform.processor())
    print(f"Omni chat, {args.tokens}-token reply (tiny model, CPU), headless Chromium {VIEWPORT['width']}x{VIEWPORT['height']}: "
          f"longest main-thread task {result['longest_task_ms']} ms; {result['long_tasks']} long tasks (>= 50 ms), "
          f"{result['blocking_ms']} ms blocking in all, over a {result['reply_s']} s reply")
    print(f"the same reply traced, by CPU time: longest main-thread task {result['longest_task_cpu_ms']} ms "
          f"({result['longest_task_cpu_at_ms']} ms after Send); {result['long_tasks_by_cpu']} tasks of 50 ms or more")
    print(f"load average (1, 5, 15 min): {result['load_average_before']} before, {result['load_average']} after")
    print(f"machine: {result['machine']}, {result['cpus']} CPUs; date: {result['date']}")
    print(result["stats"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
