"""The app's listening sessions: session files in a folder (one subfolder per session, with its
rendered clips), one SQLite vote store for all of them, and what the organizer, listener and
results views ask for. The UI calls this; it never sees a system's name during a trial.

A vote counts only for a trial this server showed: each showing is a server-side record, keyed by
an unguessable token that the listener's page holds, with the session, the listener, the trial,
the clips' plays and the time it was shown; a vote names the token and is refused unless its
session and listener are the record's, every clip was played to the end, and at least the clips'
lengths added up have passed since the trial was shown (less SOON_TOLERANCE_S): each clip must be
heard on its own, so a listener needs their sum, not the longest one.
"""
from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import soundfile as sf

from pipeline.contract import Service
from pipeline.listening import stats
from pipeline.listening.checkpoints import as_served, check_renderable, served_choices
from pipeline.listening.design import ANCHOR, trials
from pipeline.listening.render import ClipCache
from pipeline.listening.session import NAME, Session, SessionError, load_session, parse_session
from pipeline.listening.store import Vote, VoteError, VoteStore, check_played

SESSION_FILE = "session.yaml"
SOON_TOLERANCE_S = 0.25  # the server's clock against the listener's players: rounding and clock slew, far below a clip's length
MAX_OPEN_TRIALS = 20_000  # showings kept for their votes; past this the least recently used is dropped (its page is asked to press Start again)


@dataclass(frozen=True)
class TrialView:
    """What a listener sees of a trial: clip files (named by hash), never the systems."""

    session: str
    test: str
    listener: str
    index: int
    total: int
    answered: int
    text: str  # what is said
    clips: tuple[str, ...]  # AB: A, B; ABX: A, B; MUSHRA: the conditions in this listener's order
    x: str | None = None  # ABX: the X clip
    reference: str | None = None  # MUSHRA: the open reference
    token: str = ""  # this showing, as the server records it: what the page plays and votes with
    listen_s: float = 0.0  # the clips to hear, their lengths added: the soonest a vote is taken after showing


@dataclass
class Shown:
    """A trial as the server sent it to one page; votes are checked against this, never the page's word."""

    session: str
    listener: str
    trial: int
    keys: tuple[str, ...]  # the clips to hear to the end: "0", "1", ... and "x"
    listen_s: float
    shown_at: float
    plays: dict[str, int] = field(default_factory=dict)


class Sessions:
    def __init__(self, root: str | Path, service: Service | None, clock: Callable[[], float] = time.time):
        """`service`: what renders clips (its `choices` say which checkpoints it serves), or None for
        sessions of recordings alone."""
        self.root = Path(root)
        self.clock = clock  # seconds since the epoch: when trials are shown and votes come
        self.root.mkdir(parents=True, exist_ok=True)
        self.service = service
        self.store = VoteStore(self.root / "votes.db")
        self.clips = ClipCache(self.root / "clips")
        self._render_lock = threading.Lock()
        self._shown: OrderedDict[str, Shown] = OrderedDict()
        self._shown_lock = threading.Lock()

    # ---- organizer ---------------------------------------------------------------------------

    def check(self, text: str, base: Path | None = None) -> Session:
        """Validate a session file's text: the organizer's Check, and Save before it stores the file.
        The file's own checks (paths relative to `base`, default this folder; they must stay inside
        this folder: a session file from the page never opens other server paths), then every check
        that rendering its clips makes (`check_renderable`: the checkpoints, loaded now)."""
        try:
            session = as_served(parse_session(text, base or self.root, root=self.root), served_choices(self.service))
            check_renderable(session, self.service)
        except SessionError as exc:
            raise SessionError(f"session file {exc}") from None
        return session

    def save(self, text: str) -> Session:
        """Validate and store a session file as `ROOT/NAME/session.yaml` (replacing one of that name
        only while it has no votes: votes always refer to the file they were given under)."""
        session = self.check(text)
        path = self.root / session.name / SESSION_FILE
        if path.is_file() and path.read_text(encoding="utf-8") != text and self.store.votes(session):
            raise SessionError(f"Session '{session.name}' already has votes: save the changed file under a new name.")
        folder = self.root / session.name
        folder.mkdir(exist_ok=True)
        (folder / SESSION_FILE).write_text(text, encoding="utf-8")
        return session

    def names(self) -> list[str]:
        return sorted(p.parent.name for p in self.root.glob(f"*/{SESSION_FILE}"))

    def session(self, name: str) -> Session:
        if not isinstance(name, str) or not NAME.match(name):
            raise SessionError("There is no listening session of that name: session names are 1-64 letters, digits, - or _.")
        if not (self.root / name / SESSION_FILE).is_file():
            raise SessionError(f"There is no listening session '{name}'.")
        # Relative paths of a saved session are relative to the folder it was written from: this one.
        return as_served(load_session(self.root / name / SESSION_FILE, base=self.root, root=self.root), served_choices(self.service))

    def render(self, name: str, progress: Callable[[int, int], None] | None = None) -> int:
        """Render the session's missing clips; returns how many clips it has."""
        session = self.session(name)
        with self._render_lock:  # one render at a time: they share the engines
            return len(self.clips.render(session, self.service, progress))

    def missing(self, name: str) -> int:
        return len(self.clips.missing(self.session(name)))

    # ---- listener ----------------------------------------------------------------------------

    def trial(self, name: str, listener: str) -> TrialView | None:
        """The listener's next unanswered trial (None when done), recorded as shown now; where a reload resumes."""
        session = self.session(name)
        self._check_listener(session, listener)
        if self.clips.missing(session):
            raise SessionError(f"The clips of session '{name}' are not rendered yet; ask the organizer to render them.")
        trial = self.store.next_trial(session, listener)
        if trial is None:
            return None
        path = lambda system: str(self.clips.path(session, system, trial.item))  # noqa: E731
        clips = tuple(path(s) for s in trial.clips)
        x = path(trial.x) if trial.x else None
        heard = {str(i): clip for i, clip in enumerate(clips)} | ({"x": x} if x else {})
        listen_s = sum(sf.info(clip).duration for clip in heard.values())
        token = self._show(Shown(session.name, listener, trial.index, tuple(heard), listen_s, self.clock()))
        return TrialView(session.name, session.test, listener, trial.index, len(trials(session, listener)),
                         len(self.store.answered(session, listener)), session.item(trial.item).text, clips, x,
                         path(session.reference) if session.test == "mushra" else None, token, listen_s)

    def played(self, token: str, clip: str) -> dict[str, int]:
        """Count a clip of a shown trial as played to the end; every clip's count so far."""
        with self._shown_lock:
            shown = self._open(token)
            if clip not in shown.keys:
                raise VoteError(f"This trial has no clip '{clip}'.")
            shown.plays[clip] = shown.plays.get(clip, 0) + 1
            return dict(shown.plays)

    def vote(self, token: str, name: str, vote: Vote) -> TrialView | None:
        """Store a vote on the showing `token` (VoteError says why not; nothing is stored then); the
        next trial. `name` and `vote.listener` are what the page says; they must be the showing's."""
        now = self.clock()
        with self._shown_lock:
            shown = self._open(token)
            plays = dict(shown.plays)
        if (name, vote.listener) != (shown.session, shown.listener):
            raise VoteError(f"This page shows a trial of listener '{shown.listener}' in session '{shown.session}': "
                            f"press Start or resume to vote as '{vote.listener}' in '{name}'.")
        if vote.trial != shown.trial:
            raise VoteError(f"This page shows trial {shown.trial + 1}, not trial {vote.trial + 1}.")
        session = self.session(name)
        check_played(trials(session, shown.listener)[shown.trial], plays)
        _check_heard(shown, now)
        try:
            self.store.record(session, replace(vote, plays=plays, shown_at=shown.shown_at, voted_at=now))
        except VoteError as exc:
            if "already answered" in str(exc):
                self._close(token)
            raise
        self._close(token)
        return self.trial(name, vote.listener)

    def _show(self, shown: Shown) -> str:
        token = secrets.token_urlsafe(18)
        with self._shown_lock:
            self._shown[token] = shown
            while len(self._shown) > MAX_OPEN_TRIALS:
                self._shown.popitem(last=False)
        return token

    def _open(self, token: str) -> Shown:
        """The showing of `token` (the caller holds the lock)."""
        shown = self._shown.get(token) if isinstance(token, str) else None
        if shown is None:
            raise VoteError("This page has no trial open (it was answered, or the server restarted): press Start or resume.")
        self._shown.move_to_end(token)
        return shown

    def _close(self, token: str) -> None:
        with self._shown_lock:
            self._shown.pop(token, None)

    @staticmethod
    def _check_listener(session: Session, listener: str) -> None:
        if not isinstance(listener, str) or not NAME.match(listener):
            raise VoteError("Enter a listener id: 1-64 letters, digits, - or _.")
        if session.listeners and listener not in session.listeners:
            raise VoteError(f"'{listener}' is not a listener of session '{session.name}'.")

    # ---- results -----------------------------------------------------------------------------

    def results(self, name: str) -> dict:
        session = self.session(name)
        votes = self.store.votes(session)
        systems = [s.name for s in session.systems]
        result = {"session": session.name, "test": session.test, "votes": len(votes), "listeners": len({v["listener"] for v in votes})}
        if session.test == "ab":
            result["pairs"] = stats.pairwise(votes, systems)
            result["ranking"] = stats.bradley_terry(votes, systems)
            result["shares"] = stats.win_shares(votes, systems)
            result["consistency"] = stats.consistency(votes)
        elif session.test == "abx":
            result["abx"] = stats.abx(votes)
        else:
            result["mushra"] = stats.mushra(votes, session.reference)
            result["conditions"] = systems + [ANCHOR]
        return result

    def votes_csv(self, name: str) -> str:
        return stats.votes_csv(self.store.votes(self.session(name)))


def _check_heard(shown: Shown, now: float) -> None:
    """Refuse a vote sooner after the trial was shown than its clips, heard one after another, last."""
    waited = now - shown.shown_at
    if waited < shown.listen_s - SOON_TOLERANCE_S:
        raise VoteError(f"Too soon: the clips last {shown.listen_s:.1f} s together and this trial was shown {max(waited, 0.0):.1f} s ago; "
                        "hear each one to the end at normal speed, then vote.")
