"""Blind trials per listener, balanced: in AB and ABX every pair of systems and each of its two
left/right orders comes equally often (to within one when the count does not divide), and in ABX
X is each side equally often; items rotate evenly. The draw depends only on the session's seed and
the listener's id, so a listener who reloads (or opens a second tab) gets the same trials."""
from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass

from pipeline.listening.session import Session

ANCHOR = "anchor"  # MUSHRA's low-pass anchor (made from the reference); the hidden reference is `reference`


@dataclass(frozen=True)
class Trial:
    index: int
    item: str
    clips: tuple[str, ...]  # systems in the order played: AB (A, B); ABX (A, B) and X's system; MUSHRA every condition
    x: str | None = None  # ABX: the system X is


def listener_rng(session: Session, listener: str) -> random.Random:
    digest = hashlib.sha256(f"{session.name}\0{session.seed}\0{listener}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def trials(session: Session, listener: str) -> list[Trial]:
    rng = listener_rng(session, listener)
    if session.test == "mushra":
        return _mushra(session, rng)
    names = [s.name for s in session.systems]
    orders = [order for pair in itertools.combinations(names, 2) for order in (pair, pair[::-1])]
    blocks = [(order, x) for order in orders for x in ((0, 1) if session.test == "abx" else (None,))]
    sequence = []
    while len(sequence) < session.trials_per_listener:
        block = blocks[:]
        rng.shuffle(block)  # each full pass holds every (pair, order[, X side]) once
        sequence += block
    sequence = sequence[:session.trials_per_listener]
    items = _rotation([i.name for i in session.items], len(sequence), rng)
    return [Trial(n, item, order, None if x is None else order[x]) for n, ((order, x), item) in enumerate(zip(sequence, items))]


def _mushra(session: Session, rng: random.Random) -> list[Trial]:
    conditions = [s.name for s in session.systems] + [ANCHOR]  # the reference system is also the hidden reference
    items = [i.name for i in session.items]
    rng.shuffle(items)
    made = []
    for n, item in enumerate(items[:session.trials_per_listener]):
        order = conditions[:]
        rng.shuffle(order)
        made.append(Trial(n, item, tuple(order)))
    return made


def _rotation(items: list[str], count: int, rng: random.Random) -> list[str]:
    """`count` items, each used equally often (to within one), in shuffled passes."""
    out = []
    while len(out) < count:
        block = items[:]
        rng.shuffle(block)
        out += block
    return out[:count]
