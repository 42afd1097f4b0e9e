"""Blind listening sessions: `Sessions` is the entry point of the app's views. Underneath:
a session file (`load_session`), balanced trials per listener (`trials`), clips rendered by the
engine and loudness-normalised (`render.ClipCache`), votes in SQLite that are never lost
(`VoteStore`), and the statistics of the results (`stats`)."""
from pipeline.listening.design import ANCHOR, Trial, trials
from pipeline.listening.service import Sessions, TrialView
from pipeline.listening.session import Item, Session, SessionError, System, load_session, parse_session
from pipeline.listening.store import NO_PREFERENCE, Vote, VoteError, VoteStore

__all__ = ["ANCHOR", "NO_PREFERENCE", "Item", "Session", "SessionError", "Sessions", "TrialView", "System", "Trial", "Vote", "VoteError", "VoteStore", "load_session",
           "parse_session", "trials"]
