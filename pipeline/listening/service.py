"""The app's listening sessions: session files in a folder (one subfolder per session, with its
rendered clips), one SQLite vote store for all of them, and what the organizer, listener and
results views ask for. The UI calls this; it never sees a system's name during a trial."""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.listening.design import ANCHOR, trials
from pipeline.listening.render import ClipCache, ModelFor
from pipeline.listening.session import NAME, Session, SessionError, parse_session
from pipeline.listening.store import Vote, VoteError, VoteStore
from pipeline.listening import stats

SESSION_FILE = "session.yaml"


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


class Sessions:
    def __init__(self, root: str | Path, model_for: ModelFor):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.model_for = model_for
        self.store = VoteStore(self.root / "votes.db")
        self.clips = ClipCache(self.root / "clips")
        self._render_lock = threading.Lock()

    # ---- organizer ---------------------------------------------------------------------------

    def check(self, text: str, base: Path | None = None) -> Session:
        """Validate a session file's text (paths relative to `base`, default this folder; they must
        stay inside this folder: a session file from the page never opens other server paths)."""
        try:
            session = parse_session(text, base or self.root)
        except SessionError as exc:
            raise SessionError(f"session file {exc}") from None
        root = self.root.resolve()
        for path in [s.folder for s in session.systems] + [i.reference_audio for i in session.items]:
            if path is not None and not path.resolve().is_relative_to(root):
                raise SessionError(f"session file: {path} is outside the sessions folder {root}; recordings and reference voices go inside it.")
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
        if not isinstance(name, str) or not NAME.match(name) or not (self.root / name / SESSION_FILE).is_file():
            raise SessionError(f"There is no listening session '{name}'.")
        # Relative paths of a saved session are relative to the folder it was written from: this one.
        return parse_session((self.root / name / SESSION_FILE).read_text(encoding="utf-8"), self.root)

    def render(self, name: str, progress: Callable[[int, int], None] | None = None) -> int:
        """Render the session's missing clips; returns how many clips it has."""
        session = self.session(name)
        with self._render_lock:  # one render at a time: they share the engines
            return len(self.clips.render(session, self.model_for, progress))

    def missing(self, name: str) -> int:
        return len(self.clips.missing(self.session(name)))

    # ---- listener ----------------------------------------------------------------------------

    def trial(self, name: str, listener: str) -> TrialView | None:
        """The listener's next unanswered trial (None when done); where a reload resumes."""
        session = self.session(name)
        self._check_listener(session, listener)
        if self.clips.missing(session):
            raise SessionError(f"The clips of session '{name}' are not rendered yet; ask the organizer to render them.")
        trial = self.store.next_trial(session, listener)
        if trial is None:
            return None
        path = lambda system: str(self.clips.path(session, system, trial.item))  # noqa: E731
        return TrialView(session.name, session.test, listener, trial.index, len(trials(session, listener)),
                         len(self.store.answered(session, listener)), session.item(trial.item).text,
                         tuple(path(s) for s in trial.clips), path(trial.x) if trial.x else None,
                         path(session.reference) if session.test == "mushra" else None)

    def vote(self, name: str, vote: Vote) -> TrialView | None:
        """Store a vote (VoteError says why not; nothing is stored then); the next trial."""
        session = self.session(name)
        self._check_listener(session, vote.listener)
        self.store.record(session, vote)
        return self.trial(name, vote.listener)

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
            result["consistency"] = stats.consistency(votes)
        elif session.test == "abx":
            result["abx"] = stats.abx(votes)
        else:
            result["mushra"] = stats.mushra(votes, session.reference)
            result["conditions"] = systems + [ANCHOR]
        return result

    def votes_csv(self, name: str) -> str:
        return stats.votes_csv(self.store.votes(self.session(name)))
