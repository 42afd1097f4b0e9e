"""Blind listening sessions (issue 9, in progress): a session file (`load_session`), balanced trials
per listener (`trials`), votes in SQLite that are never lost (`VoteStore`), and the statistics of
the results (`pipeline.listening.stats`). Rendering the clips and the app's views come next."""
from pipeline.listening.design import ANCHOR, Trial, trials
from pipeline.listening.session import Item, Session, SessionError, System, load_session, parse_session
from pipeline.listening.store import NO_PREFERENCE, Vote, VoteError, VoteStore

__all__ = ["ANCHOR", "NO_PREFERENCE", "Item", "Session", "SessionError", "System", "Trial", "Vote", "VoteError", "VoteStore", "load_session",
           "parse_session", "trials"]
