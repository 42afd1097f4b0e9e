"""Results of a session from its votes, with the statistics done by maintained libraries (scipy,
statsmodels): per pair of systems the win rate with its 95% Wilson interval and a two-sided sign
test against no preference; a Bradley-Terry ranking with 95% intervals; ABX correct rates with
binomial p-values; MUSHRA means with t intervals and the BS.1534 post-screening (shown, not applied);
per-listener consistency; every vote as CSV.

With few votes an estimate says nothing yet: an interval (and a bar of the results plot) is given
from MIN_VOTES votes on, None before, and never reaches outside its scale (win and correct rates
0-1, MUSHRA 0-100); Bradley-Terry strengths are given once they are finite (`bradley_terry`)."""
from __future__ import annotations

import csv
import io
import itertools
import json
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps
from statsmodels.stats.proportion import proportion_confint

from pipeline.listening.store import NO_PREFERENCE

MUSHRA_REFERENCE_MIN = 90  # BS.1534: a listener who rates the hidden reference below this ...
MUSHRA_SCREEN_SHARE = 0.15  # ... in more than this share of items is flagged
MIN_VOTES = 3  # the fewest votes behind an interval or a bar: with fewer, a 95% interval spans most of its scale
MUSHRA_SCALE = (0.0, 100.0)


@dataclass(frozen=True)
class PairResult:
    first: str
    second: str
    first_wins: int
    second_wins: int
    ties: int
    win_rate: float  # of `first` among decisive votes
    ci_low: float | None  # None: fewer than MIN_VOTES decisive votes
    ci_high: float | None
    p_value: float  # two-sided sign test, ties left out

    @property
    def votes(self) -> int:
        return self.first_wins + self.second_wins + self.ties


def pairwise(votes: list[dict], systems: list[str]) -> list[PairResult]:
    """AB preference per pair of systems."""
    tally: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for vote in votes:
        a, b = sorted(vote["clips"], key=systems.index)
        tally[(a, b)][vote["choice"]] += 1
    results = []
    for a, b in itertools.combinations(systems, 2):
        count = tally.get((a, b), Counter())
        wins_a, wins_b, ties = count[a], count[b], count[NO_PREFERENCE]
        decisive = wins_a + wins_b
        low = high = None
        if decisive >= MIN_VOTES:  # Wilson's interval lies within 0-1
            low, high = (float(v) for v in proportion_confint(wins_a, decisive, alpha=0.05, method="wilson"))
        p = float(sps.binomtest(wins_a, decisive, 0.5).pvalue) if decisive else 1.0
        results.append(PairResult(a, b, wins_a, wins_b, ties, wins_a / decisive if decisive else 0.5, low, high, p))
    return results


def win_shares(votes: list[dict], systems: list[str]) -> dict[str, float]:
    """AB: per system, the share of its decisive votes (a preference either way) that it won; systems
    with fewer than MIN_VOTES decisive votes are left out."""
    won, decided = Counter(), Counter()
    for vote in votes:
        if vote["choice"] == NO_PREFERENCE:
            continue
        for system in vote["clips"]:
            decided[system] += 1
        won[vote["choice"]] += 1
    return {s: won[s] / decided[s] for s in systems if decided[s] >= MIN_VOTES}


def bradley_terry(votes: list[dict], systems: list[str]) -> dict[str, tuple[float, float, float]] | None:
    """Strength per system (log-odds scale, the first system fixed at 0) with its 95% interval: a
    logistic model P(i beats j) = sigmoid(s_i - s_j); a tie counts half a win for each side. None
    while the strengths are not finite: fewer than MIN_VOTES votes, or systems that split into two
    groups where one group never beat the other (one system always won, say: its strength grows without bound)."""
    import statsmodels.api as sm

    if len(votes) < MIN_VOTES or not _finite_strengths(votes, systems):
        return None
    rows, weights = [], []
    for vote in votes:
        a, b = vote["clips"]
        if vote["choice"] == NO_PREFERENCE:
            rows += [_difference(systems, a, b), _difference(systems, b, a)]
            weights += [0.5, 0.5]
        else:
            loser = b if vote["choice"] == a else a
            rows.append(_difference(systems, vote["choice"], loser))
            weights.append(1.0)
    # Every row is "the first beat the second" (y = 1), with the strengths' difference as regressor.
    fit = sm.GLM(np.ones(len(rows)), np.array(rows), family=sm.families.Binomial(), freq_weights=np.array(weights)).fit()
    interval = fit.conf_int(alpha=0.05)
    scores = {systems[0]: (0.0, 0.0, 0.0)}
    for i, system in enumerate(systems[1:]):
        scores[system] = (float(fit.params[i]), float(interval[i][0]), float(interval[i][1]))
    return scores if all(np.isfinite(v).all() for v in scores.values()) else None


def _finite_strengths(votes: list[dict], systems: list[str]) -> bool:
    """Whether every system reaches every other along "beat" links (a tie links both ways): the
    condition (Zermelo's) for finite Bradley-Terry strengths."""
    beat = defaultdict(set)
    for vote in votes:
        a, b = vote["clips"]
        if vote["choice"] in (a, NO_PREFERENCE):
            beat[a].add(b)
        if vote["choice"] in (b, NO_PREFERENCE):
            beat[b].add(a)
    beaten_by = defaultdict(set)
    for winner, losers in beat.items():
        for loser in losers:
            beaten_by[loser].add(winner)
    return all(_reached(systems[0], links) >= set(systems) for links in (beat, beaten_by))


def _reached(start: str, links: dict[str, set[str]]) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for other in links[todo.pop()] - seen:
            seen.add(other)
            todo.append(other)
    return seen


def _difference(systems: list[str], winner: str, loser: str) -> np.ndarray:
    x = np.zeros(len(systems))
    x[systems.index(winner)], x[systems.index(loser)] = 1.0, -1.0
    return x[1:]  # the first system's strength is fixed at 0


def abx(votes: list[dict]) -> dict:
    """Correct rate per listener and per pair, with a one-sided binomial p-value against guessing."""

    def summary(group: list[dict]) -> dict:
        correct = sum(v["choice"] == v["x"] for v in group)
        return {"correct": correct, "trials": len(group), "rate": correct / len(group),
                "p_value": float(sps.binomtest(correct, len(group), 0.5, alternative="greater").pvalue)}

    by_listener, by_pair = defaultdict(list), defaultdict(list)
    for vote in votes:
        by_listener[vote["listener"]].append(vote)
        by_pair[tuple(sorted(vote["clips"]))].append(vote)
    return {"listeners": {k: summary(v) for k, v in sorted(by_listener.items())},
            "pairs": {f"{a} vs {b}": summary(v) for (a, b), v in sorted(by_pair.items())}}


def mushra(votes: list[dict], reference: str) -> dict:
    """Mean and 95% t interval per condition, over all listeners and over those kept by the
    BS.1534 post-screening; the screened-out listeners are named."""
    by_listener = defaultdict(list)
    for vote in votes:
        by_listener[vote["listener"]].append(vote["scores"])
    flagged = sorted(listener for listener, items in by_listener.items()
                     if sum(scores[reference] < MUSHRA_REFERENCE_MIN for scores in items) > MUSHRA_SCREEN_SHARE * len(items))

    def conditions(listeners: list[str]) -> dict:
        values = defaultdict(list)
        for listener in listeners:
            for scores in by_listener[listener]:
                for condition, score in scores.items():
                    values[condition].append(score)
        return {c: _mean_ci(v) for c, v in sorted(values.items())}

    everyone = sorted(by_listener)
    return {"all": conditions(everyone), "screened": conditions([n for n in everyone if n not in flagged]), "flagged": flagged}


def _mean_ci(values: list[float]) -> dict:
    """Mean and 95% t interval, clipped to the MUSHRA scale; no interval (None) from fewer than MIN_VOTES ratings."""
    data = np.asarray(values, dtype=float)
    mean = float(data.mean())
    if len(data) < MIN_VOTES:
        return {"mean": mean, "ci_low": None, "ci_high": None, "n": len(data)}
    if data.std() == 0:  # every rating the same: a t interval of zero width
        return {"mean": mean, "ci_low": mean, "ci_high": mean, "n": len(data)}
    low, high = np.clip(sps.t.interval(0.95, len(data) - 1, loc=mean, scale=sps.sem(data)), *MUSHRA_SCALE)
    return {"mean": mean, "ci_low": float(low), "ci_high": float(high), "n": len(data)}


def consistency(votes: list[dict]) -> dict[str, float]:
    """AB: per listener, the share of votes that agree with their own majority for the same pair
    (over pairs they judged more than once; 1.0 = always the same system)."""
    by = defaultdict(list)
    for vote in votes:
        by[(vote["listener"], tuple(sorted(vote["clips"])))].append(vote["choice"])
    agree, total = Counter(), Counter()
    for (listener, _), choices in by.items():
        if len(choices) > 1:
            agree[listener] += Counter(choices).most_common(1)[0][1]
            total[listener] += len(choices)
    return {listener: agree[listener] / total[listener] for listener in sorted(total)}


CSV_COLUMNS = ("id", "session", "listener", "trial", "item", "test", "clips", "x", "choice", "scores", "confidence", "comment", "plays",
               "shown_at", "voted_at")


def votes_csv(votes: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    for vote in votes:
        writer.writerow([vote[c] if not isinstance(vote[c], (list, dict)) else _json(vote[c]) for c in CSV_COLUMNS])
    return out.getvalue()


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)
