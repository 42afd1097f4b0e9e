"""Listening test tab: Listen (blind trials, reached by a per-session link), Results (live, with
confidence intervals, CSV export) and Organize (write, check and render a session file)."""
from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import gradio as gr
import pandas as pd
from gradio.data_classes import FileData

from pipeline.errors import TTSInputError
from pipeline.listening import NO_PREFERENCE, SessionError, Sessions, TrialView, Vote, VoteError
from pipeline.listening.checkpoints import served_note
from pipeline.listening.session import NAME as ID_PATTERN  # session names and listener ids
from pipeline.listening.stats import MIN_VOTES, MUSHRA_SCALE
from pipeline.listening.store import MUSHRA_START
from ui.errors import input_error, markdown_text, warn

NAME = "listening"
MAX_CONDITIONS = 8  # MUSHRA conditions shown at once (the hidden reference and the anchor included)
SAMPLE = Path(__file__).resolve().parents[1] / "assets" / "listening" / "sizes-ab.yaml"
RESULTS_EVERY_S = 5.0
CHOICES = {"A": "A", "B": "B", "No preference": NO_PREFERENCE}
SUBMIT = "Submit vote"
SAVING = "Saving your vote…"  # the button's label from the click until the server's answer: no spinner over the page
NOT_ENOUGH = "not enough votes yet"
LISTEN_GUIDE = (
    "**Taking part?** Open the link the organizer sent you (it fills in both boxes), or type the session's name and an id of "
    "your own, then press **Start or resume**. Play every clip to the end, answer and submit: the next trial follows, and "
    "coming back later resumes where you left off.\n\n"
    "**Running a test?** Open **Organize**, press **Load the sample session**, then **Check** and **Save and render**, "
    "and share the link it gives you; the votes come in under **Results**."
)
ORGANIZE_GUIDE = (
    "1. Write or paste a session file below, or press **Load the sample session** (an AB test of the 0.6B and 1.7B "
    "CustomVoice checkpoints) and change it. Paths are relative to the sessions folder.\n"
    "2. **Check** runs every check that Save runs: the file, then each system's checkpoint (loaded now) with each item's "
    "speaker and language.\n"
    "3. **Save and render** stores it and renders every clip (unchanged clips are not rendered again), then gives the link "
    "to share.\n\n"
    "An app started with `--tiny` renders a system naming an official checkpoint with its tiny random one, as its tabs do: "
    "the steps work, and the clips are noise."
)
RESULTS_GUIDE = (f"Pick a session: its results refresh every {RESULTS_EVERY_S:.0f} s. An interval or a bar needs {MIN_VOTES} votes; "
                 f"before that the table says *{NOT_ENOUGH}*.")


@dataclasses.dataclass
class ListenParts:
    session: gr.Textbox
    listener: gr.Textbox
    start: gr.Button
    views: gr.Tabs | None = None


class ClipPlayer(gr.Audio):
    """gr.Audio for a session's clips, which the renderer wrote as float WAV (a container and codec every
    browser plays): served as they are, without the ffprobe run that gr.Audio makes on every file it returns."""

    is_template = True  # the browser's audio player: the same component as gr.Audio

    def postprocess(self, value: str | Path | None) -> FileData | None:
        if value is None:
            return None
        return FileData(path=str(value), orig_name=Path(value).name, mime_type="audio/wav")


def share_link(name: str) -> str:
    return f"Share this link with the listeners (each adds `&listener=THEIR_ID`, or types an id): `/?session={name}`"


def build(sessions: Sessions) -> ListenParts:
    with gr.Tab("Listening test", id=NAME):
        gr.Markdown("Blind AB / ABX / MUSHRA listening sessions with clips rendered by the engine, loudness-matched to −23 LUFS.")
        with gr.Tabs(selected="listen-view") as views:
            with gr.Tab("Listen", id="listen-view"):
                parts = _listen_view(sessions)
            with gr.Tab("Results", id="results-view"):
                _results_view(sessions)
            with gr.Tab("Organize", id="organize-view"):
                _organize_view(sessions)
    parts.views = views
    return parts


# ---- Listen --------------------------------------------------------------------------------------

def _listen_view(sessions: Sessions) -> ListenParts:
    guide = gr.Markdown(LISTEN_GUIDE, elem_id="listen-guide")
    with gr.Row():
        session = gr.Textbox(label="Session", elem_id="listen-session", scale=2)
        listener = gr.Textbox(label="Your listener id", elem_id="listen-listener", scale=2)
        start = gr.Button("Start or resume", variant="primary", elem_id="listen-start", scale=1)
    progress = gr.Markdown("", elem_id="listen-progress")
    text = gr.Markdown("", elem_id="listen-text")
    reference = ClipPlayer(label="Reference", type="filepath", interactive=False, visible=False, elem_id="listen-reference")
    clips, scores, columns = [], [], []
    with gr.Row(elem_id="listen-clips"):
        for i in range(MAX_CONDITIONS):  # a trial's columns alone are shown, so that they share the row's width
            with gr.Column(min_width=160, visible=False) as column:
                columns.append(column)
                clips.append(ClipPlayer(label=chr(ord("A") + i), type="filepath", interactive=False, visible=False, elem_id=f"listen-clip-{i}"))
                scores.append(gr.Slider(0, 100, value=MUSHRA_START, step=1, label="Score", visible=False, elem_id=f"listen-score-{i}"))
    x_clip = ClipPlayer(label="X", type="filepath", interactive=False, visible=False, elem_id="listen-x")
    choice = gr.Radio(list(CHOICES), label="Which do you prefer?", visible=False, elem_id="listen-choice")
    with gr.Row():
        confidence = gr.Radio(["1", "2", "3", "4", "5"], label="Confidence (optional: 1 unsure, 5 certain)", visible=False, elem_id="listen-confidence")
        comment = gr.Textbox(label="Comment (optional)", visible=False, elem_id="listen-comment")
    hint = gr.Markdown("", elem_id="listen-hint")
    submit = gr.Button(SUBMIT, variant="primary", interactive=False, visible=False, elem_id="listen-submit")
    current = gr.State(None)  # the TrialView on screen; its token names the server's record of this showing

    trial_outputs = [current, progress, text, reference, *clips, *scores, x_clip, choice, confidence, comment, hint, submit]

    def show(view: TrialView | None, note: str = "", before: TrialView | None = None) -> list:
        """The page's outputs for `view`; after `before` on the same layout, new values alone (gradio
        rebuilds a component and its config, JSON schema included, for every gr.update, gr.skip() too:
        most of a vote's server time when every player and slider is updated)."""
        if view is not None and before is not None and _same_layout(before, view):
            return next_values(view, note)
        if view is None:
            hidden = [gr.update(visible=False, value=None)] * (1 + MAX_CONDITIONS) + [gr.update(visible=False)] * MAX_CONDITIONS
            return [None, "**All trials done. Thank you!**" + (f" {note}" if note else ""), "", *hidden, gr.update(visible=False, value=None),
                    gr.update(visible=False, value=None), gr.update(visible=False, value=None), gr.update(visible=False, value=""), "",
                    gr.update(visible=False, value=SUBMIT)]
        mushra = view.test == "mushra"
        n = len(view.clips)
        clip_updates = [gr.update(visible=i < n, value=view.clips[i] if i < n else None, label=_label(view, i)) for i in range(MAX_CONDITIONS)]
        score_updates = [gr.update(visible=mushra and i < n, value=MUSHRA_START) for i in range(MAX_CONDITIONS)]
        question = "Which do you prefer?" if view.test == "ab" else "Is X the same as A or as B?"
        choices = list(CHOICES) if view.test == "ab" else ["A", "B"]
        return [view, _progress(view, note), f"> {markdown_text(view.text)}",
                gr.update(visible=mushra, value=view.reference), *clip_updates, *score_updates,
                gr.update(visible=view.x is not None, value=view.x), gr.update(visible=not mushra, value=None, choices=choices, label=question),
                gr.update(visible=True, value=None), gr.update(visible=True, value=""), _hint(view, {}),
                gr.update(visible=True, interactive=False, value=SUBMIT)]

    def next_values(view: TrialView, note: str) -> list:
        # Plain values, hidden players and sliders included (None, the start score): a gr.skip() is an update too.
        n = len(view.clips)
        return [view, _progress(view, note), f"> {markdown_text(view.text)}", view.reference,
                *[view.clips[i] if i < n else None for i in range(MAX_CONDITIONS)], *[MUSHRA_START] * MAX_CONDITIONS,
                view.x, None, None, "", _hint(view, {}), gr.update(interactive=False, value=SUBMIT)]

    def begin(name: str, who: str):
        """The trial's outputs, its columns (the same for every trial of a session) and the guide, put away."""
        try:
            view = sessions.trial(name.strip(), who.strip())
        except (SessionError, VoteError) as exc:
            raise input_error(exc) from None
        shown = len(view.clips) if view is not None else 0
        return [*show(view), *[gr.update(visible=i < shown) for i in range(MAX_CONDITIONS)], gr.update(visible=False)]

    def played(view: TrialView | None, key: str):
        if view is None:
            raise input_error("Press Start or resume first.")
        try:
            counts = sessions.played(view.token, key)
        except VoteError as exc:
            raise input_error(exc) from None
        return _hint(view, counts), gr.update(interactive=_all_played(view, counts))

    def vote(name: str, who: str, view: TrialView | None, answer, sure, note, *values):
        """The vote of the trial on this page (its server-side record, not the boxes, says which)."""
        if view is None:
            raise input_error("Press Start or resume first.")
        if view.test == "mushra":
            ballot = Vote(who.strip(), view.index, scores={str(i): values[i] for i in range(len(view.clips))}, comment=note or "",
                          confidence=int(sure) if sure else None)
        else:
            if answer is None:
                raise input_error("Choose an answer first.")
            ballot = Vote(who.strip(), view.index, CHOICES.get(answer, answer), comment=note or "", confidence=int(sure) if sure else None)
        try:
            return show(sessions.vote(view.token, name.strip(), ballot), "vote saved", before=view)
        except VoteError as exc:
            if "already answered" not in str(exc):
                raise input_error(exc) from None
            warn(str(exc))  # answered in another tab: move on to what is left
            return show(sessions.trial(view.session, view.listener))

    # No limit on any of these: every listener runs their own at once (the counts of plays are kept,
    # under a lock, by `sessions`; the votes are SQLite commits, one connection each).
    start.click(begin, inputs=[session, listener], outputs=[*trial_outputs, *columns, guide], api_name="listen_start", concurrency_limit=None)
    # Played to the end (the players' "stop" event); named so that scripted listeners (tests, API clients) can do what a browser does.
    heard = {"concurrency_limit": None, "api_visibility": "undocumented", "show_progress": "hidden"}
    for i, clip in enumerate(clips):
        clip.stop(lambda v, key=str(i): played(v, key), inputs=current, outputs=[hint, submit], api_name=f"listen_played_{i}", **heard)
    x_clip.stop(lambda v: played(v, "x"), inputs=current, outputs=[hint, submit], api_name="listen_played_x", **heard)
    # A vote is acknowledged at once in the browser (the button's label) and answered without a
    # progress overlay: the answer is the next trial, with "vote saved" in its progress line.
    submit.click(None, js=f"() => {SAVING!r}", outputs=submit, api_visibility="private")
    voted = submit.click(vote, inputs=[session, listener, current, choice, confidence, comment, *scores], outputs=trial_outputs,
                         api_name="listen_vote", concurrency_limit=None, show_progress="hidden")
    voted.failure(None, js=f"() => {SUBMIT!r}", outputs=submit, api_visibility="private")  # its toast says why
    return ListenParts(session, listener, start)


def _progress(view: TrialView, note: str) -> str:
    bar = f'<progress max="{view.total}" value="{view.answered}" style="width: 100%"></progress>'
    return f"Trial **{view.answered + 1}** of {view.total}" + (f" · {note}" if note else "") + f"\n\n{bar}"


def _same_layout(a: TrialView, b: TrialView) -> bool:
    """Whether the page shows `b` with the players, sliders and labels it shows `a` with."""
    return (a.session, a.test, len(a.clips), a.x is None, a.reference is None) == (b.session, b.test, len(b.clips), b.x is None, b.reference is None)


def _label(view: TrialView, i: int) -> str:
    return f"Condition {i + 1}" if view.test == "mushra" else chr(ord("A") + i)


def _all_played(view: TrialView, counts: dict) -> bool:
    keys = [str(i) for i in range(len(view.clips))] + (["x"] if view.x else [])
    return all(counts.get(k, 0) >= 1 for k in keys)


def _hint(view: TrialView | None, counts: dict) -> str:
    if view is None:
        return ""
    if _all_played(view, counts):
        return "Every clip was heard to the end: the vote is open."
    left = [_label(view, i) for i in range(len(view.clips)) if counts.get(str(i), 0) < 1] + (["X"] if view.x and counts.get("x", 0) < 1 else [])
    return f"Play {', '.join(left)} to the end to unlock the vote."


# ---- Results -------------------------------------------------------------------------------------

def _results_view(sessions: Sessions) -> None:
    gr.Markdown(RESULTS_GUIDE, elem_id="results-guide")
    with gr.Row():
        name = gr.Dropdown(sessions.names(), label="Session", allow_custom_value=True, elem_id="results-session")
        refresh = gr.Button("Refresh", elem_id="results-refresh")
        download = gr.DownloadButton("Download every vote (CSV)", elem_id="results-csv")
    summary = gr.Markdown("", elem_id="results-summary")
    table = gr.Dataframe(label="Per pair / per condition", interactive=False, elem_id="results-table")
    ranking = gr.Dataframe(label="Ranking / per listener", interactive=False, elem_id="results-ranking")
    plot = gr.BarPlot(pd.DataFrame({"system": [], "value": []}), x="system", y="value", label="Scores", elem_id="results-plot")
    timer = gr.Timer(RESULTS_EVERY_S)

    def show(session: str | None):
        if not session:
            return "", None, None, gr.update(), None
        try:
            result = sessions.results(session)
        except SessionError as exc:
            return str(exc), None, None, gr.update(), None
        head = f"**{result['votes']} votes** from {result['listeners']} listeners · {result['test'].upper()}"
        if result.get("consistency"):
            head += "\n\nPer-listener consistency (share of votes agreeing with their own majority, pairs heard more than once): " + \
                ", ".join(f"{k} {v:.2f}" for k, v in result["consistency"].items())
        table, second, bars, scale, meaning = _result_frames(result)
        if bars.empty:
            head += f"\n\nThe plot: {NOT_ENOUGH} (a bar needs {MIN_VOTES})."
        csv = Path(tempfile.mkdtemp()) / f"{session}-votes.csv"
        csv.write_text(sessions.votes_csv(session), encoding="utf-8")
        return head, table, second, gr.update(value=bars, y_lim=list(scale), y_title=meaning), str(csv)

    outputs = [summary, table, ranking, plot, download]
    name.change(show, inputs=name, outputs=outputs, api_visibility="private")
    refresh.click(show, inputs=name, outputs=outputs, api_name="results")
    timer.tick(show, inputs=name, outputs=outputs, api_visibility="private", show_progress="hidden")
    refresh.click(lambda: gr.update(choices=sessions.names()), outputs=name, api_visibility="private")


def _interval(low: float | None, high: float | None, digits: int) -> str:
    return NOT_ENOUGH if low is None else f"{low:.{digits}f} to {high:.{digits}f}"


def _bars(values: dict[str, float]) -> pd.DataFrame:
    return pd.DataFrame({"system": list(values), "value": list(values.values())})


def _result_frames(result: dict) -> tuple:
    """The two tables, the plot's bars, their scale and what they mean; every interval within its
    scale, or NOT_ENOUGH (pipeline.listening.stats says from how many votes)."""
    if result["test"] == "ab":
        pairs = pd.DataFrame([{"pair": f"{p.first} vs {p.second}", "votes": p.votes, "wins of first": p.first_wins, "wins of second": p.second_wins,
                               "no preference": p.ties,
                               "win rate of first": round(p.win_rate, 3) if p.first_wins + p.second_wins else NOT_ENOUGH, "95% CI": _interval(p.ci_low, p.ci_high, 3),
                               "sign test p": round(p.p_value, 4)} for p in result["pairs"]])
        if result["ranking"] is None:
            ranking = pd.DataFrame({"Bradley-Terry ranking": [f"{NOT_ENOUGH} (it needs {MIN_VOTES} votes, and every system to have won and lost)"]})
        else:
            ranking = pd.DataFrame([{"system": s, "Bradley-Terry score": round(v[0], 3), "95% CI": _interval(v[1], v[2], 3)}
                                    for s, v in sorted(result["ranking"].items(), key=lambda kv: -kv[1][0])])
        return pairs, ranking, _bars(result["shares"]), (0, 1), "share of its decisive votes won"
    if result["test"] == "abx":
        pairs = pd.DataFrame([{"pair": k, **{a: round(b, 4) if isinstance(b, float) else b for a, b in v.items()}} for k, v in result["abx"]["pairs"].items()])
        listeners = pd.DataFrame([{"listener": k, **{a: round(b, 4) if isinstance(b, float) else b for a, b in v.items()}}
                                  for k, v in result["abx"]["listeners"].items()])
        rates = {k: v["rate"] for k, v in result["abx"]["pairs"].items() if v["trials"] >= MIN_VOTES}
        return pairs, listeners, _bars(rates), (0, 1), "share of X identified"
    mushra = result["mushra"]
    screened = mushra["screened"]
    rows = [{"condition": c, "mean": round(v["mean"], 1), "95% CI": _interval(v["ci_low"], v["ci_high"], 1), "ratings": v["n"],
             "mean after screening": round(screened[c]["mean"], 1) if c in screened else NOT_ENOUGH} for c, v in mushra["all"].items()]
    flagged = pd.DataFrame({"listeners flagged by BS.1534 post-screening (not removed above)": mushra["flagged"]})
    means = {c: v["mean"] for c, v in mushra["all"].items() if v["n"] >= MIN_VOTES}
    return pd.DataFrame(rows), flagged, _bars(means), MUSHRA_SCALE, "mean score"


# ---- Organize ------------------------------------------------------------------------------------

def _organize_view(sessions: Sessions) -> None:
    gr.Markdown(ORGANIZE_GUIDE, elem_id="organize-guide")
    existing = gr.Dropdown(sessions.names(), label="Open a saved session", elem_id="organize-open")
    text = gr.Code("", language="yaml", label="Session file", elem_id="organize-text")
    with gr.Row():
        sample = gr.Button("Load the sample session", elem_id="organize-sample")
        check = gr.Button("Check", elem_id="organize-check")
        save = gr.Button("Save and render", variant="primary", elem_id="organize-save")
    status = gr.Markdown("", elem_id="organize-status")

    def checked(source: str, progress=gr.Progress()) -> str:
        progress(0, desc="Checking the file, then loading its checkpoints")
        try:
            session = sessions.check(source)
        except SessionError as exc:
            raise input_error(exc) from None
        return f"✔ `{session.name}`: {session.test.upper()}, {len(session.systems)} systems, {len(session.items)} items, " \
               f"{session.trials_per_listener} trials per listener. " + served_note(session)

    def saved(source: str, progress=gr.Progress()) -> tuple:
        progress(0, desc="Checking the file, then loading its checkpoints")
        try:
            session = sessions.save(source)
            clips = sessions.render(session.name, lambda done, total: progress(done / max(total, 1), desc=f"Rendering clip {done} of {total}"))
        except TTSInputError as exc:  # a bad file, or a checkpoint this app does not serve
            raise input_error(exc) from None
        return f"✔ `{session.name}` saved; {clips} clips ready. " + share_link(session.name) + " " + served_note(session), \
            gr.update(choices=sessions.names(), value=session.name)

    def opened(name: str) -> str:
        path = sessions.root / name / "session.yaml"
        return path.read_text(encoding="utf-8") if name and path.is_file() else gr.update()

    sample.click(lambda: (SAMPLE.read_text(encoding="utf-8"), ""), outputs=[text, status], api_visibility="private", show_progress="hidden")
    check.click(checked, inputs=text, outputs=status, api_name="session_check")
    save.click(saved, inputs=text, outputs=[status, existing], api_name="session_save")
    existing.change(opened, inputs=existing, outputs=text, api_visibility="private")


# A per-session link opens the Listening test tab in the browser. Selecting it from the server would
# make the page's Tabs an output of a page load, and the page then re-reads every component under them
# on each later update of any event (the Omni chat's streamed reply among them).
OPEN_FROM_LINK_JS = """() => {
    if (!new URLSearchParams(location.search).has("session")) return;
    const tab = [...document.querySelectorAll("#page-tabs button[role=tab]")].find((b) => b.textContent.trim() === "Listening test");
    if (tab) tab.click();
}"""


def from_link(request: gr.Request) -> tuple[str | dict, str | dict]:
    """A per-session link (`/?session=NAME[&listener=ID]`) has the Listen view's boxes filled in
    (OPEN_FROM_LINK_JS opens the view).
    Names and ids are 1-64 letters, digits, - or _; a link with anything else fills in nothing of it
    and never echoes it (a crafted link could carry markup)."""
    params = dict(request.query_params) if request is not None else {}
    if "session" not in params:
        return gr.update(), gr.update()
    session, listener = params["session"], params.get("listener", "")
    if not ID_PATTERN.match(session):
        warn("This link's session is not a session name (1-64 letters, digits, - or _): ask the organizer for the link again.")
        session, listener = "", ""
    elif listener and not ID_PATTERN.match(listener):
        warn("This link's listener id is not an id (1-64 letters, digits, - or _): type yours in the box.")
        listener = ""
    return session, listener
