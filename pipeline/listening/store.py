"""Votes in SQLite (WAL mode, synchronous FULL): one row per vote, acknowledged only once committed,
so a vote that was acknowledged survives the server being killed; many listeners may vote at once.

A vote is checked against the listener's own trials (the design), refused before both (all) clips
were played to the end and, for MUSHRA, while every slider still sits at its starting score, and
stored once: the same trial voted again (a second tab, a double click) is refused with a message,
and nothing stored changes. When the trial was shown and when the vote came are stored with it
(the app's `Sessions` fills both in from its own clock and refuses a vote too soon for the clips).
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import TTSInputError
from pipeline.listening.design import Trial, trials
from pipeline.listening.session import Session

SCHEMA = """
CREATE TABLE IF NOT EXISTS votes (
    id INTEGER PRIMARY KEY,
    session TEXT NOT NULL,
    listener TEXT NOT NULL,
    trial INTEGER NOT NULL,
    item TEXT NOT NULL,
    test TEXT NOT NULL,
    clips TEXT NOT NULL,        -- JSON: the systems in the order played (ABX: A, B)
    x TEXT,                     -- ABX: the system X was
    choice TEXT,                -- AB: a system or 'none'; ABX: the system the listener says X is
    scores TEXT,                -- MUSHRA: JSON {condition: 0-100}
    confidence INTEGER,
    comment TEXT,
    plays TEXT NOT NULL,        -- JSON: times each clip was played to the end
    shown_at REAL,
    voted_at REAL NOT NULL,
    UNIQUE (session, listener, trial)
);
"""
NO_PREFERENCE = "none"
MUSHRA_START = 50  # where every MUSHRA slider starts: a ballot with all of them still there rates nothing


class VoteError(TTSInputError):
    """A vote that cannot be stored, in one sentence; nothing was written."""


@dataclass(frozen=True)
class Vote:
    listener: str
    trial: int
    choice: str | None = None  # AB: a system name or "none"; ABX: a system name
    scores: dict | None = None  # MUSHRA
    confidence: int | None = None
    comment: str = ""
    plays: dict | None = None  # clip -> times played to the end
    shown_at: float | None = None  # seconds since the epoch: when the trial's clips were sent to the listener
    voted_at: float | None = None  # when the vote came (None: now)


class VoteStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        # A connection per call: sqlite3 connections are not shared between threads, and opening one is cheap.
        db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA busy_timeout=30000")
        return db

    def record(self, session: Session, vote: Vote) -> int:
        """Check and store one vote; returns its row id once committed. VoteError says what is wrong."""
        trial = self._trial(session, vote)
        clips = list(trial.clips)
        check_played(trial, vote.plays or {})
        choice, scores = _check_answer(session, trial, vote)
        if vote.confidence is not None and not 1 <= vote.confidence <= 5:
            raise VoteError("Confidence is 1 (unsure) to 5 (certain).")
        row = (session.name, vote.listener, trial.index, trial.item, session.test, json.dumps(clips), trial.x, choice,
               json.dumps(scores) if scores is not None else None, vote.confidence, (vote.comment or "")[:2000], json.dumps(vote.plays or {}),
               vote.shown_at, time.time() if vote.voted_at is None else vote.voted_at)
        db = self._connect()
        try:
            cursor = db.execute("INSERT INTO votes (session, listener, trial, item, test, clips, x, choice, scores, confidence, comment, plays, "
                                "shown_at, voted_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            return int(cursor.lastrowid)  # autocommit: the row is on disk when execute returns
        except sqlite3.IntegrityError:
            raise VoteError(f"Trial {trial.index + 1} is already answered (perhaps in another tab); the next one is waiting.") from None
        finally:
            db.close()

    def answered(self, session: Session, listener: str) -> set[int]:
        with self._closing() as db:
            return {row[0] for row in db.execute("SELECT trial FROM votes WHERE session = ? AND listener = ?", (session.name, listener))}

    def next_trial(self, session: Session, listener: str) -> Trial | None:
        """The listener's first unanswered trial (where a reload resumes), None when all are done."""
        done = self.answered(session, listener)
        return next((t for t in trials(session, listener) if t.index not in done), None)

    def votes(self, session: Session) -> list[dict]:
        with self._closing() as db:
            db.row_factory = sqlite3.Row
            rows = db.execute("SELECT * FROM votes WHERE session = ? ORDER BY id", (session.name,)).fetchall()
        return [{**dict(row), "clips": json.loads(row["clips"]), "scores": json.loads(row["scores"]) if row["scores"] else None,
                 "plays": json.loads(row["plays"])} for row in rows]

    def _closing(self):
        from contextlib import closing

        return closing(self._connect())

    @staticmethod
    def _trial(session: Session, vote: Vote) -> Trial:
        if session.listeners and vote.listener not in session.listeners:
            raise VoteError(f"'{vote.listener}' is not a listener of session '{session.name}'.")
        own = trials(session, vote.listener)
        if not isinstance(vote.trial, int) or not 0 <= vote.trial < len(own):
            raise VoteError(f"There is no trial {vote.trial} for listener '{vote.listener}' (they have {len(own)}).")
        return own[vote.trial]


def check_played(trial: Trial, plays: dict) -> None:
    unplayed = [chr(ord("A") + i) for i, _ in enumerate(trial.clips) if int(plays.get(str(i), 0)) < 1]
    if trial.x is not None and int(plays.get("x", 0)) < 1:
        unplayed.append("X")
    if unplayed:
        raise VoteError(f"Play {' and '.join(unplayed)} to the end before voting.")


def _check_answer(session: Session, trial: Trial, vote: Vote) -> tuple[str | None, dict | None]:
    if session.test == "mushra":
        scores = vote.scores or {}
        wanted = {str(i) for i in range(len(trial.clips))}
        if set(scores) != wanted or not all(isinstance(v, (int, float)) and 0 <= v <= 100 for v in scores.values()):
            raise VoteError(f"Rate every one of the {len(trial.clips)} conditions from 0 to 100.")
        if all(v == MUSHRA_START for v in scores.values()):
            raise VoteError(f"Move the sliders to rate the conditions: every one still has the starting score of {MUSHRA_START}.")
        return None, {trial.clips[int(k)]: float(v) for k, v in scores.items()}  # by system, never shown to the listener
    allowed = {"A": trial.clips[0], "B": trial.clips[1]}
    if session.test == "ab":
        allowed[NO_PREFERENCE] = NO_PREFERENCE
    if vote.choice not in allowed:
        raise VoteError(f"Answer {', '.join(allowed)}, not {vote.choice!r}.")
    return allowed[vote.choice], None
