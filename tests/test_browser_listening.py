"""Listening sessions in the browser: a listener through an A/B and a MUSHRA session, the results,
and what a crafted link or session file carries shown as text."""
import pytest
from browser import HANG_GUARD_MS, skip_without_browser

skip_without_browser()


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


def test_the_empty_form_guides_and_the_sample_session_checks_saves_and_renders(page, live_app):
    """The Listen view opens with a guide; Organize opens empty with its own, and the sample session
    it loads passes Check and then Save and render on the app serving the tiny checkpoints."""
    _, _, sessions = live_app
    page.get_by_role("tab", name="Listening test").click()
    guide = page.locator("#listen-guide")
    guide.wait_for(state="visible")
    assert "Start or resume" in guide.inner_text() and "Load the sample session" in guide.inner_text()
    page.get_by_role("tab", name="Organize").click()
    assert "Load the sample session" in page.locator("#organize-guide").inner_text()
    editor = page.locator("#organize-text .cm-content")
    assert editor.inner_text().strip() == ""
    page.click("#organize-sample")
    page.wait_for_function("() => document.querySelector('#organize-text .cm-content').innerText.includes('name: sizes-ab')")
    status = page.locator("#organize-status")
    page.click("#organize-check")
    page.wait_for_function("() => document.querySelector('#organize-status').innerText.includes('sizes-ab: AB, 2 systems')")
    assert "Rendered by this app's 'tiny' checkpoint in place of the one the file names: small, large." in status.inner_text()
    assert sessions.names().count("sizes-ab") == 0  # Check stores nothing
    page.click("#organize-save")
    page.wait_for_function("() => document.querySelector('#organize-status').innerText.includes('clips ready')")
    assert "sizes-ab saved; 6 clips ready." in status.inner_text() and "/?session=sizes-ab" in status.inner_text()
    assert sessions.missing("sizes-ab") == 0 and page.locator("[data-testid=toast-body]").count() == 0


SHOWN_PROGRESS = "() => [...document.querySelectorAll('[data-testid=status-tracker]:not(.hide)')].map(e => e.parentElement.id || e.className)"

WATCH_THE_VOTE = """() => {
    window.votePage = {progress: [], labels: []};
    const look = () => {
        window.votePage.progress.push(...(%s)());
        window.votePage.labels.push(document.querySelector('#listen-submit').innerText);
    };
    new MutationObserver(look).observe(document.body, {subtree: true, childList: true, attributes: true, characterData: true});
}""" % SHOWN_PROGRESS


def test_a_vote_is_acknowledged_without_a_progress_overlay_and_the_next_trial_follows(page, live_app):
    """From the click on Submit until the next trial is on the page, no progress overlay or spinner
    shows anywhere on it; the button says at once that the vote is being saved. The trial's two
    players share the row's width."""
    _, _, sessions = live_app
    sessions.save("name: browser-quiet\ntest: ab\ntrials_per_listener: 2\n" + LISTENING_SYSTEMS)
    sessions.render("browser-quiet")
    listen(page, "browser-quiet", "cy")
    assert page.locator("#listen-guide").is_hidden()
    row = page.locator("#listen-clips").bounding_box()
    a, b = page.locator("#listen-clip-0").bounding_box(), page.locator("#listen-clip-1").bounding_box()
    assert a["width"] == pytest.approx(b["width"], abs=1) and a["x"] == pytest.approx(row["x"], abs=1)  # one column each, the row between them
    assert b["x"] + b["width"] == pytest.approx(row["x"] + row["width"], abs=1)
    play_to_the_end(page, "listen-clip-0", "A")
    play_to_the_end(page, "listen-clip-1", "B")
    page.wait_for_function("() => /vote is open/.test(document.querySelector('#listen-hint').innerText)")
    page.click("#listen-submit")  # no answer chosen: refused with its sentence, and the button says "Submit vote" again
    page.locator("[data-testid=toast-body]").filter(has_text="Choose an answer first.").first.wait_for()
    page.wait_for_function("() => document.querySelector('#listen-submit').innerText === 'Submit vote'")
    page.locator("#listen-choice").get_by_text("B", exact=True).click()
    page.wait_for_function(f"() => ({SHOWN_PROGRESS})().length === 0")  # the page at rest before the vote
    page.evaluate(WATCH_THE_VOTE)
    page.click("#listen-submit")
    page.wait_for_function("() => document.querySelector('#listen-progress').innerText.includes('Trial 2 of 2 · vote saved')")
    seen = page.evaluate("() => window.votePage")
    assert seen["progress"] == [] and "Saving your vote…" in seen["labels"]
    assert page.locator("#listen-submit").inner_text() == "Submit vote" and page.locator("#listen-clip-1").is_visible()
    assert [v["trial"] for v in sessions.store.votes(sessions.session("browser-quiet"))] == [0]
