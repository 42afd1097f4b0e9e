"""Listening sessions without the app: session files and their error messages (with line numbers),
the balanced trial design, votes in SQLite (checked, never duplicated, never lost: concurrent
voters and a killed server), and the statistics against hand-computed values."""
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import voice_like

from pipeline.listening import ANCHOR, SessionError, Vote, VoteError, VoteStore, load_session, parse_session, stats, trials

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "session.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


@pytest.fixture
def recordings(tmp_path):
    """Two folder systems with one WAV per item, and a reference voice."""
    for folder in ("human", "other"):
        (tmp_path / folder).mkdir()
        for i, item in enumerate(("one", "two")):
            sf.write(tmp_path / folder / f"{item}.wav", voice_like(1.0, 24000, seed=i), 24000)
    sf.write(tmp_path / "voice.wav", voice_like(3.0), 24000)
    return tmp_path


AB = """\
name: demo
test: ab
trials_per_listener: 6
systems:
  - name: human
    folder: human
  - name: other
    folder: other
  - name: engine
    checkpoint: tiny
    mode: custom_voice
    seed: 3
    settings: {temperature: 0.8, schedule: [1, 2]}
items:
  - name: one
    text: Hello there.
    speaker: ryan
  - name: two
    text: Good evening.
    speaker: vivian
"""


def test_the_sample_session_in_assets_is_valid():
    session = load_session(REPO / "assets/listening/sizes-ab.yaml")
    assert session.test == "ab" and [s.name for s in session.systems] == ["small", "large"] and len(session.items) == 3


def test_a_valid_session(recordings):
    session = load_session(write(recordings, AB))
    assert [s.name for s in session.systems] == ["human", "other", "engine"]
    request = session.system("engine").request(session.item("two"))
    assert (request.speaker, request.seed, request.temperature, request.schedule, request.model_type) == ("vivian", 3, 0.8, (1, 2), "custom_voice")


@pytest.mark.parametrize("change, message", [
    (("test: ab", "test: abc"), "line 2: test must be one of ab, abx, mushra, not 'abc'."),
    (("  - name: other\n", "  - name: human\n"), "line 7: duplicate name 'human' in systems (first on line 5)."),
    (("    folder: other", "    folder: missing"), "line 8: the folder"),
    (("    mode: custom_voice", "    mode: cloning"), "line 11: system 'engine' needs a mode: one of custom_voice, voice_design, clone, clone_x_vector."),
    (("    speaker: vivian\n", ""), "line 18: item 'two' has no speaker, which system 'engine' (custom_voice) needs."),
    (("seed: 3", "seed: -3"), "line 12: the seed of system 'engine' is a whole number from 0 to 2^32-1."),
    (("{temperature: 0.8, schedule: [1, 2]}", "{temprature: 0.8}"), "line 13: unknown setting 'temprature' of system 'engine'"),
    (("{temperature: 0.8, schedule: [1, 2]}", "{top_p: 2.0}"), "line 15: item 'one' with system 'engine': top_p"),
    (("trials_per_listener: 6", "trials_per_listener: 0"), "line 3: trials_per_listener must be a positive whole number."),
    (("items:", "itemz:"), "line 1: 'items' is missing."),
    (("  - name: one", "  - name: one\n    txt: typo"), "line 16: unknown key 'txt' in item 'one'."),
    (("name: demo", "name: demo\nname: again"), "line 2: 'name' is given twice."),
    (("systems:", "systems: [\n"), "not valid YAML"),
])
def test_each_bad_session_file_gets_its_message(recordings, change, message):
    path = write(recordings, AB.replace(*change))
    with pytest.raises(SessionError) as error:
        load_session(path)
    assert str(error.value).startswith("session.yaml ") and message in str(error.value)


def test_missing_and_unreadable_recordings_and_references(recordings):
    (recordings / "other" / "two.wav").unlink()
    with pytest.raises(SessionError, match=r"line 7: system 'other' has no recording of item 'two' \(.*other/two.wav is missing\)"):
        load_session(write(recordings, AB))
    (recordings / "other" / "two.wav").write_bytes(b"RIFF garbage")
    with pytest.raises(SessionError, match=r"line 7: .*other/two.wav of system 'other' is not a readable WAV file."):
        load_session(write(recordings, AB))
    clone = AB.replace("mode: custom_voice", "mode: clone").replace("speaker: ryan", "reference_audio: nowhere.wav\n    reference_text: Hi.")
    with pytest.raises(SessionError, match=r"line 17: the reference audio .*nowhere.wav of item 'one' does not exist."):
        load_session(write(recordings, clone))


def test_mushra_needs_a_known_reference(recordings):
    mushra = AB.replace("test: ab", "test: mushra").replace("trials_per_listener: 6\n", "")
    with pytest.raises(SessionError, match="line 1: a MUSHRA test needs a `reference:` system"):
        load_session(write(recordings, mushra))
    with pytest.raises(SessionError, match=r"line 3: unknown system 'humans' \(systems: human, other, engine\)."):
        load_session(write(recordings, mushra.replace("test: mushra", "test: mushra\nreference: humans")))
    session = load_session(write(recordings, mushra.replace("test: mushra", "test: mushra\nreference: human")))
    assert session.trials_per_listener == 2


# ---- the design ----------------------------------------------------------------------------------

def session_of(test: str, systems: int, trials_per_listener: int, items: int = 3):
    names = "\n".join(f"  - name: s{i}\n    checkpoint: tiny\n    mode: voice_design" for i in range(systems))
    things = "\n".join(f"  - name: i{i}\n    text: Item {i}.\n    instruct: A calm voice." for i in range(items))
    extra = "reference: s0\n" if test == "mushra" else f"trials_per_listener: {trials_per_listener}\n"
    return parse_session(f"name: d\ntest: {test}\n{extra}systems:\n{names}\nitems:\n{things}\n", Path("."))


@pytest.mark.parametrize("test, systems, per_listener", [("ab", 3, 12), ("ab", 4, 24), ("abx", 3, 24), ("ab", 3, 10)])
def test_every_pair_and_order_equally_often_per_listener(test, systems, per_listener):
    session = session_of(test, systems, per_listener)
    blocks = len(list(itertools.permutations(range(systems), 2))) * (2 if test == "abx" else 1)
    for listener in (f"listener-{n}" for n in range(200)):
        drawn = trials(session, listener)
        assert len(drawn) == per_listener and [t.index for t in drawn] == list(range(per_listener))
        orders = Counter(t.clips for t in drawn)
        assert len(orders) == min(blocks, len(orders)) and max(orders.values()) - min(orders.values()) <= 1
        if per_listener % blocks == 0:
            assert len(orders) == systems * (systems - 1) and set(orders.values()) == {per_listener // (systems * (systems - 1))}
        assert max(Counter(t.item for t in drawn).values()) - min(Counter(t.item for t in drawn).values()) <= 1
        if test == "abx":
            assert Counter(t.x == t.clips[0] for t in drawn) == {True: per_listener // 2, False: per_listener // 2}
    assert trials(session, "listener-7") == trials(session, "listener-7")  # a reload gets the same trials
    assert trials(session, "listener-7") != trials(session, "listener-8")


def test_left_right_positions_are_balanced_over_many_trials():
    """A statistical check: over 500 listeners, each system is on the left half of the time (chi-square)."""
    from scipy.stats import chisquare

    session = session_of("ab", 4, 13)  # 13 does not divide by the 12 orders: balance within one
    left = Counter(t.clips[0] for n in range(500) for t in trials(session, f"l{n}"))
    assert chisquare(list(left.values())).pvalue > 0.01 and sum(left.values()) == 500 * 13


def test_mushra_trial_holds_every_condition_once():
    session = session_of("mushra", 3, 0)
    drawn = trials(session, "ann")
    assert len(drawn) == 3 and all(sorted(t.clips) == sorted(["s0", "s1", "s2", ANCHOR]) for t in drawn)
    assert sorted(t.item for t in drawn) == ["i0", "i1", "i2"]


# ---- votes ---------------------------------------------------------------------------------------

def both_played(n: int = 2) -> dict:
    return {str(i): 1 for i in range(n)} | {"x": 1}


def test_votes_are_checked_and_stored_once(tmp_path):
    session = session_of("ab", 3, 6)
    store = VoteStore(tmp_path / "votes.db")
    first = trials(session, "ann")[0]
    with pytest.raises(VoteError, match="Play B to the end before voting."):
        store.record(session, Vote("ann", 0, "A", plays={"0": 1}))
    with pytest.raises(VoteError, match="There is no trial 6 for listener 'ann' \\(they have 6\\)."):
        store.record(session, Vote("ann", 6, "A", plays=both_played()))
    with pytest.raises(VoteError, match="Answer A, B, none, not 'C'."):
        store.record(session, Vote("ann", 0, "C", plays=both_played()))
    store.record(session, Vote("ann", 0, "B", confidence=4, comment="clearer", plays=both_played()))
    with pytest.raises(VoteError, match="Trial 1 is already answered"):
        store.record(session, Vote("ann", 0, "A", plays=both_played()))
    votes = store.votes(session)
    assert len(votes) == 1 and votes[0]["choice"] == first.clips[1] and votes[0]["clips"] == list(first.clips)
    assert store.next_trial(session, "ann").index == 1 and store.next_trial(session, "ben").index == 0
    closed = parse_session("name: c\ntest: ab\ntrials_per_listener: 2\nlisteners: [ann]\nsystems:\n  - {name: a, checkpoint: t, mode: voice_design}\n"
                           "  - {name: b, checkpoint: t, mode: voice_design}\nitems:\n  - {name: i, text: Hi., instruct: Calm.}\n", Path("."))
    with pytest.raises(VoteError, match="'eve' is not a listener of session 'c'."):
        store.record(closed, Vote("eve", 0, "A", plays=both_played()))


def test_a_mushra_ballot_with_no_slider_moved_is_refused(tmp_path):
    session = session_of("mushra", 3, 0)
    store = VoteStore(tmp_path / "votes.db")
    untouched = {str(i): 50 for i in range(4)}
    with pytest.raises(VoteError, match="^Move the sliders to rate the conditions: every one still has the starting score of 50.$"):
        store.record(session, Vote("ann", 0, scores=untouched, plays=both_played(4)))
    assert store.votes(session) == []
    store.record(session, Vote("ann", 0, scores={**untouched, "3": 20}, plays=both_played(4)))  # one slider moved: a rating
    assert sorted(store.votes(session)[0]["scores"].values()) == [20.0, 50.0, 50.0, 50.0]


def test_concurrent_voters_lose_no_vote(tmp_path):
    session = session_of("ab", 3, 6)
    store = VoteStore(tmp_path / "votes.db")
    errors = []

    def listener(n: int) -> None:
        try:
            for trial in range(6):
                store.record(session, Vote(f"l{n}", trial, "A", plays=both_played()))
        except Exception as exc:  # collected: a thread's assert would not fail the test
            errors.append(exc)

    threads = [threading.Thread(target=listener, args=(n,)) for n in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(store.votes(session)) == 120


KILLED_VOTER = """
import sys, time
from pathlib import Path
from pipeline.listening import Vote, VoteStore, parse_session
session = parse_session(sys.argv[2], Path("."))
store = VoteStore(sys.argv[1])
for n in range(10**6):
    store.record(session, Vote(f"l{n // 6}", n % 6, "B", plays={"0": 1, "1": 1}))
    print(n, flush=True)  # acknowledged: committed before this line
"""


def test_a_killed_server_keeps_every_acknowledged_vote(tmp_path):
    session_text = "name: d\ntest: ab\ntrials_per_listener: 6\nsystems:\n" + "".join(
        f"  - {{name: s{i}, checkpoint: t, mode: voice_design}}\n" for i in range(3)) + "items:\n  - {name: i, text: Hi., instruct: Calm.}\n"
    db = tmp_path / "votes.db"
    voter = subprocess.Popen([sys.executable, "-c", KILLED_VOTER, str(db), session_text], cwd=REPO, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    acknowledged = -1
    for line in voter.stdout:
        acknowledged = int(line)
        if acknowledged >= 150:
            break
    os.kill(voter.pid, signal.SIGKILL)
    voter.wait()
    stored = VoteStore(db).votes(parse_session(session_text, Path(".")))
    assert len(stored) >= acknowledged + 1 and len({(v["listener"], v["trial"]) for v in stored}) == len(stored)


# ---- statistics ----------------------------------------------------------------------------------

def ab_votes(table: dict[tuple[str, str, str], int]) -> list[dict]:
    """(left, right, choice) -> count, as stored votes."""
    return [{"listener": f"l{n % 3}", "clips": [a, b], "choice": c} for (a, b, c), count in table.items() for n in range(count)]


def test_pairwise_statistics_match_hand_computed_values():
    votes = ab_votes({("x", "y", "x"): 5, ("y", "x", "x"): 3, ("x", "y", "y"): 2, ("y", "x", "none"): 4})
    (pair,) = stats.pairwise(votes, ["x", "y"])
    assert (pair.first_wins, pair.second_wins, pair.ties, pair.votes) == (8, 2, 4, 14)
    # Wilson 95% for 8 of 10: (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), z = 1.959964
    assert pair.win_rate == 0.8 and pair.ci_low == pytest.approx(0.49016, abs=1e-4) and pair.ci_high == pytest.approx(0.94332, abs=1e-4)
    assert pair.p_value == pytest.approx(0.109375)  # 2 * P(X >= 8), X ~ Bin(10, 1/2) = 2 * 56/1024


def test_bradley_terry_strengths():
    votes = ab_votes({("a", "b", "a"): 3, ("b", "a", "b"): 1})
    scores = stats.bradley_terry(votes, ["a", "b"])
    assert scores["a"][0] == 0.0 and scores["b"][0] == pytest.approx(np.log(1 / 3), abs=1e-6)  # log-odds of b over a
    assert scores["b"][1] < scores["b"][0] < scores["b"][2]
    three = stats.bradley_terry(ab_votes({("a", "b", "b"): 6, ("b", "a", "a"): 2, ("b", "c", "b"): 6, ("c", "b", "c"): 2,
                                          ("a", "c", "a"): 4, ("c", "a", "c"): 4}), ["a", "b", "c"])
    assert three["b"][0] > three["a"][0] == 0.0 and three["b"][0] > three["c"][0]


def test_abx_and_mushra_and_consistency():
    votes = [{"listener": "ann", "clips": ["p", "q"], "x": "p", "choice": "p"}] * 9 + [{"listener": "ann", "clips": ["q", "p"], "x": "q", "choice": "p"}]
    result = stats.abx(votes)
    assert result["listeners"]["ann"]["rate"] == 0.9 and result["listeners"]["ann"]["p_value"] == pytest.approx(11 / 1024)
    ratings = [{"listener": "ann", "scores": {"ref": 100, "sys": 70}}, {"listener": "ben", "scores": {"ref": 80, "sys": 60}},
               {"listener": "cat", "scores": {"ref": 90, "sys": 50}}]
    result = stats.mushra(ratings, "ref")
    assert result["flagged"] == ["ben"]  # rated the hidden reference below 90 in 1 of 1 items (> 15%)
    sys_all = result["all"]["sys"]
    assert sys_all["mean"] == 60.0 and sys_all["ci_high"] - 60.0 == pytest.approx(4.302653 * 10 / np.sqrt(3), abs=1e-4)
    assert result["screened"]["sys"]["mean"] == 60.0 and result["screened"]["sys"]["n"] == 2
    same = ab_votes({("a", "b", "a"): 3}) + [{"listener": "l0", "clips": ["a", "b"], "choice": "b"}] * 2
    assert stats.consistency(same) == {"l0": 2 / 3}  # l1 and l2 judged the pair once: nothing to be consistent with


def test_csv_export_holds_every_vote(tmp_path):
    session = session_of("ab", 3, 6)
    store = VoteStore(tmp_path / "votes.db")
    for trial in range(3):
        store.record(session, Vote("ann", trial, "none", comment='says "both, fine"', plays=both_played()))
    text = stats.votes_csv(store.votes(session))
    import csv
    import io

    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == 3 and rows[0]["comment"] == 'says "both, fine"' and json.loads(rows[0]["clips"]) == list(trials(session, "ann")[0].clips)


def test_few_votes_give_no_interval_and_no_interval_outside_its_scale():
    """Below MIN_VOTES votes there is no interval; Bradley-Terry strengths only once they are finite;
    a MUSHRA interval is clipped to 0-100."""
    assert stats.MIN_VOTES == 3
    (pair,) = stats.pairwise(ab_votes({("a", "b", "a"): 2}), ["a", "b"])
    assert (pair.first_wins, pair.ci_low, pair.ci_high) == (2, None, None)
    (pair,) = stats.pairwise(ab_votes({("a", "b", "a"): 3}), ["a", "b"])
    assert 0.0 <= pair.ci_low < pair.ci_high <= 1.0
    assert stats.bradley_terry([], ["a", "b"]) is None
    assert stats.bradley_terry(ab_votes({("a", "b", "a"): 8}), ["a", "b"]) is None  # a always won: its strength has no bound
    assert stats.bradley_terry(ab_votes({("a", "b", "a"): 3, ("b", "a", "b"): 3}), ["a", "b", "c"]) is None  # c never compared
    assert stats.bradley_terry(ab_votes({("a", "b", "a"): 2, ("b", "a", "none"): 1}), ["a", "b"]) is not None  # a tie: b "won" half
    assert stats.win_shares(ab_votes({("a", "b", "a"): 2, ("b", "a", "b"): 1}), ["a", "b"]) == {"a": 2 / 3, "b": 1 / 3}
    assert stats.win_shares(ab_votes({("a", "b", "a"): 2}), ["a", "b"]) == {}
    one = stats.mushra([{"listener": "ann", "scores": {"ref": 100, "sys": 70}}], "ref")
    assert one["all"]["sys"] == {"mean": 70.0, "ci_low": None, "ci_high": None, "n": 1}
    spread = stats.mushra([{"listener": n, "scores": {"ref": 100, "sys": s}} for n, s in (("ann", 0), ("ben", 0), ("cat", 100))], "ref")
    assert (spread["all"]["sys"]["ci_low"], spread["all"]["sys"]["ci_high"]) == (0.0, 100.0)  # the t interval alone: -110 to 177


def results_shown(sessions, name: str) -> tuple:
    """What the Results view shows of a session: its summary, both tables and the plot's bars."""
    import gradio as gr

    from ui import listening

    with gr.Blocks() as demo:
        listening.build(sessions)
    head, table, second, plot, _ = next(f.fn for f in demo.fns.values() if f.api_name == "results")(name)
    return head, table, second, plot


def test_the_results_view_says_not_enough_votes_yet_instead_of_nan(recordings):
    from pipeline.listening import Sessions

    sessions = Sessions(recordings, None)
    sessions.save(FOLDERS_AB.format(name="few"))
    session = sessions.session("few")
    mushra = FOLDERS_AB.format(name="rated").replace("test: ab\ntrials_per_listener: 2", "test: mushra\nreference: human")
    sessions.save(mushra)
    for name, votes in (("few", []), ("few", [Vote("ann", 0, "A", plays=both_played())]), ("rated", [Vote("ann", 0, scores={"0": 100, "1": 5, "2": 0},
                                                                                                         plays=both_played(3))])):
        for vote in votes:
            sessions.store.record(sessions.session(name), vote)
        head, table, second, plot = results_shown(sessions, name)
        shown = " ".join([head, table.to_string(), second.to_string(), plot["value"].to_string()])
        assert "nan" not in shown.lower() and "not enough votes yet" in shown
        assert plot["value"].empty and "The plot: not enough votes yet (a bar needs 3)." in head
    assert len(sessions.store.votes(session)) == 1


# ---- rendering -----------------------------------------------------------------------------------

def test_render_normalises_caches_and_rerenders_the_same_audio(tiny_checkpoints, recordings):
    import pyloudnorm

    from pipeline.listening.render import TARGET_LUFS, ClipCache
    from pipeline.service import ModelService

    text = AB.replace("checkpoint: tiny", f"checkpoint: {tiny_checkpoints['custom_voice']}").replace(
        "settings: {temperature: 0.8, schedule: [1, 2]}", "settings: {max_frames: 15}").replace("test: ab", "test: mushra\nreference: human")
    session = load_session(write(recordings, text.replace("trials_per_listener: 6\n", "")))
    service = ModelService({"custom_voice": (str(tiny_checkpoints["custom_voice"]),)})

    class NothingToRender:
        def stream(self, request, key=""):
            pytest.fail("a cached clip was rendered again")

    cache = ClipCache(recordings / "clips")
    steps = []
    clips = cache.render(session, service, progress=lambda done, total: steps.append((done, total)))
    assert len(clips) == 4 * 2 and steps[-1] == (8, 8) and cache.missing(session) == []
    meter = pyloudnorm.Meter(24000)
    for clip in clips:
        audio, rate = sf.read(clip.path, dtype="float32")
        assert rate == 24000 and abs(meter.integrated_loudness(audio.astype(np.float64)) - TARGET_LUFS) < 0.1
    engine_clip = next(c for c in clips if c.system == "engine")
    first, _ = sf.read(engine_clip.path, dtype="float32")
    assert len(first) == 15 * 1920
    assert cache.render(session, NothingToRender()) == clips
    engine_clip.path.unlink()
    cache.render(session, service)
    again, _ = sf.read(engine_clip.path, dtype="float32")
    assert np.abs(again - first).max() <= 1e-6  # the engine's determinism: the same clip again
    anchor, _ = sf.read(next(c for c in clips if c.system == ANCHOR and c.item == "one").path, dtype="float32")
    spectrum = np.abs(np.fft.rfft(anchor))
    assert spectrum[np.fft.rfftfreq(len(anchor), 1 / 24000) > 5000].max() < 1e-3 * spectrum.max()  # low-passed at 3.5 kHz


def test_check_command(recordings, capsys):
    from pipeline.listening.__main__ import main

    assert main(["check", str(REPO / "assets/listening/sizes-ab.yaml")]) == 0
    assert "sizes-ab: AB, 2 systems (small, large), 3 items, 12 trials per listener" in capsys.readouterr().out
    assert main(["check", str(write(recordings, AB.replace("test: ab", "test: abc")))]) == 2
    assert "error: session.yaml line 2: test must be one of ab, abx, mushra, not 'abc'." in capsys.readouterr().err


def test_sessions_service_messages(tmp_path, recordings):
    from pipeline.listening import Sessions

    never = Sessions(tmp_path / "s", None)  # no renderer: the file's own checks alone
    text = "name: svc\ntest: ab\ntrials_per_listener: 2\nsystems:\n  - {name: a, checkpoint: t, mode: voice_design}\n" \
           "  - {name: b, checkpoint: t, mode: voice_design}\nitems:\n  - {name: i, text: Hi., instruct: Calm.}\n"
    never.save(text)
    with pytest.raises(SessionError, match="The clips of session 'svc' are not rendered yet; ask the organizer to render them."):
        never.trial("svc", "ann")
    with pytest.raises(SessionError, match="There is no listening session 'nope'."):
        never.trial("nope", "ann")
    with pytest.raises(VoteError, match="Enter a listener id"):
        never.trial("svc", "  ")
    outside = AB.replace("folder: human", f"folder: {recordings / 'human'}").replace("folder: other", f"folder: {recordings / 'other'}")
    with pytest.raises(SessionError, match="is outside the sessions folder"):
        never.check(outside)
    # A session with votes keeps its file: a changed one must get a new name.
    never.store.record(never.session("svc"), Vote("ann", 0, "A", plays=both_played()))
    never.save(text)  # the same file again is fine
    with pytest.raises(SessionError, match="Session 'svc' already has votes: save the changed file under a new name."):
        never.save(text.replace("Hi.", "Hello."))


# ---- Check and Save: one validation -----------------------------------------------------------------

@pytest.fixture
def tiny_app_sessions(tiny_checkpoints, tmp_path):
    """Sessions rendered by the service of an app started with --tiny."""
    from pipeline.listening import Sessions
    from pipeline.service import ModelService

    service = ModelService(tiny=True, tiny_dir=Path(tiny_checkpoints["base"]).parent)
    return Sessions(tmp_path / "sessions", service)


def test_the_sample_session_passes_check_and_save_and_renders_under_the_tiny_app(tiny_app_sessions):
    from pipeline.listening.render import clip_key

    sessions, text = tiny_app_sessions, (REPO / "assets/listening/sizes-ab.yaml").read_text(encoding="utf-8")
    checked = sessions.check(text)
    assert [(s.checkpoint, s.served_by) for s in checked.systems] == [("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", "tiny"),
                                                                       ("Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", "tiny")]
    assert sessions.save(text) == checked
    assert sessions.render("sizes-ab") == 6 and sessions.missing("sizes-ab") == 0
    view = sessions.trial("sizes-ab", "ann")
    assert len(view.clips) == 2 and all(Path(clip).is_file() for clip in view.clips)
    # A clip the tiny checkpoint rendered is never taken for the named checkpoint's, in an app that serves it.
    named = load_session(REPO / "assets/listening/sizes-ab.yaml")
    assert clip_key(named, "small", "news") != clip_key(sessions.session("sizes-ab"), "small", "news")


def test_a_checkpoint_the_app_does_not_serve_fails_check_with_the_sentence_save_gives(tiny_app_sessions):
    sessions = tiny_app_sessions
    text = (REPO / "assets/listening/sizes-ab.yaml").read_text(encoding="utf-8").replace("Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", "Qwen/Qwen3-TTS-9B")
    sentence = "session file line 13: system 'large': 'Qwen/Qwen3-TTS-9B' is not one of this app's custom_voice checkpoints: tiny."
    for step in (sessions.check, sessions.save):
        with pytest.raises(SessionError) as error:
            step(text)
        assert str(error.value) == sentence
    speaker = (REPO / "assets/listening/sizes-ab.yaml").read_text(encoding="utf-8").replace("speaker: vivian", "speaker: nobody")
    for step in (sessions.check, sessions.save):  # a check that needs the checkpoint: the same sentence too
        with pytest.raises(SessionError, match=r"^session file line 22: item 'story' with system 'small': Unknown speaker 'nobody': choose one of"):
            step(speaker)
    assert sessions.names() == []  # nothing saved


def test_official_checkpoints_are_rendered_by_the_tiny_one_only_where_the_app_serves_nothing_else():
    from pipeline.listening.checkpoints import served_checkpoint

    small, large = "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"
    assert served_checkpoint({"custom_voice": ("tiny",)}, "custom_voice", large) == "tiny"
    assert served_checkpoint({"custom_voice": (small, large)}, "custom_voice", large) == large
    assert served_checkpoint({"custom_voice": ("tiny", small)}, "custom_voice", large) is None  # a real one is served: no stand-in
    assert served_checkpoint({"custom_voice": ("tiny",)}, "custom_voice", "/models/mine") is None  # a folder is not an official one
    assert served_checkpoint({"custom_voice": ("tiny",)}, "voice_design", large) is None


# ---- the Listen view: what a vote may name, and when --------------------------------------------

FOLDERS_AB = """\
name: {name}
test: ab
trials_per_listener: 2
systems:
  - {{name: human, folder: human}}
  - {{name: other, folder: other}}
items:
  - {{name: one, text: Hello there.}}
  - {{name: two, text: Good evening.}}
"""
START = 1_800_000_000.0  # the test clock's first reading, seconds since the epoch


class Clock:
    """A clock the test moves by hand: the server's idea of now, without sleeping."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def listen_app(recordings):
    """The listening tab alone on a localhost port, its sessions (two AB sessions of 1 s folder clips,
    `demo` and `elsewhere`) on the test's clock: (url, sessions, clock)."""
    import gradio as gr
    from conftest import free_port

    from pipeline.listening import Sessions
    from ui import listening

    clock = Clock()
    sessions = Sessions(recordings, None, clock=clock)
    for name in ("demo", "elsewhere"):
        sessions.save(FOLDERS_AB.format(name=name))
        sessions.render(name)
    with gr.Blocks() as demo:
        listening.build(sessions)
    demo.queue(default_concurrency_limit=None)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}/", sessions, clock
    demo.close()


def vote_args(session: str, listener: str, answer: str = "A") -> tuple:
    return session, listener, answer, None, "", *[50] * 8


def stored(sessions, name: str) -> list[dict]:
    return sessions.store.votes(sessions.session(name))


def test_a_vote_is_stored_only_for_the_trial_this_page_was_shown(listen_app):
    """The listener and session boxes are the page's to edit: a vote sent with another listener's id
    or another session's name is refused, and nothing is stored anywhere; the honest vote is stored."""
    import re

    from gradio_client import Client
    from gradio_client.exceptions import AppError

    url, sessions, clock = listen_app
    mallory = Client(url, verbose=False)
    assert "Trial **1** of 2" in mallory.predict("demo", "mallory", api_name="/listen_start")[0]
    mallory.predict(api_name="/listen_played_0")
    mallory.predict(api_name="/listen_played_1")
    clock.now += 2.0  # both clips heard, one after the other
    as_victim = "This page shows a trial of listener 'mallory' in session 'demo': press Start or resume to vote as 'victim' in 'demo'."
    with pytest.raises(AppError, match=f"^{re.escape(as_victim)}$"):
        mallory.predict(*vote_args("demo", "victim"), api_name="/listen_vote")
    in_elsewhere = "This page shows a trial of listener 'mallory' in session 'demo': press Start or resume to vote as 'mallory' in 'elsewhere'."
    with pytest.raises(AppError, match=f"^{re.escape(in_elsewhere)}$"):
        mallory.predict(*vote_args("elsewhere", "mallory"), api_name="/listen_vote")
    assert stored(sessions, "demo") == [] and stored(sessions, "elsewhere") == []
    assert "Trial **2** of 2" in mallory.predict(*vote_args("demo", "mallory"), api_name="/listen_vote")[0]
    (vote,) = stored(sessions, "demo")
    assert (vote["listener"], vote["trial"], vote["choice"]) == ("mallory", 0, vote["clips"][0])
    assert stored(sessions, "elsewhere") == []


def test_a_vote_sooner_than_the_clips_last_is_refused_and_times_are_kept(listen_app):
    """Both `played` events sent at once do not open the vote: the server refuses it until the two
    1 s clips could have been heard one after the other (2 s after it sent them, less 0.25 s), and the
    stored vote carries when the trial was shown and when the vote came, in the CSV too."""
    import csv
    import io

    from gradio_client import Client
    from gradio_client.exceptions import AppError

    url, sessions, clock = listen_app
    client = Client(url, verbose=False)
    client.predict("demo", "ann", api_name="/listen_start")
    with pytest.raises(AppError, match="^This trial has no clip 'x'.$"):  # AB has no X to count as heard
        client.predict(api_name="/listen_played_x")
    for job in [client.submit(api_name="/listen_played_0"), client.submit(api_name="/listen_played_1")]:  # at once: both count
        job.result()
    clock.now += 1.7
    with pytest.raises(AppError, match=r"^Too soon: the clips last 2.0 s together and this trial was shown 1.7 s ago; "
                                       r"hear each one to the end at normal speed, then vote.$"):
        client.predict(*vote_args("demo", "ann"), api_name="/listen_vote")
    assert stored(sessions, "demo") == []
    clock.now += 0.1  # 1.8 s: within the tolerance of the 2.0 s the clips last
    client.predict(*vote_args("demo", "ann", "B"), api_name="/listen_vote")
    (vote,) = stored(sessions, "demo")
    assert vote["shown_at"] == START and vote["voted_at"] == START + 1.8 and vote["plays"] == {"0": 1, "1": 1}
    (row,) = csv.DictReader(io.StringIO(sessions.votes_csv("demo")))
    assert (float(row["shown_at"]), float(row["voted_at"])) == (START, START + 1.8)


def test_a_showing_takes_one_vote_and_only_its_own_plays(recordings):
    from pipeline.listening import Sessions

    clock = Clock()
    sessions = Sessions(recordings, None, clock=clock)
    sessions.save(FOLDERS_AB.format(name="demo"))
    sessions.render("demo")
    first, second = sessions.trial("demo", "ann"), sessions.trial("demo", "ann")  # two tabs: two showings of trial 1
    assert first.token != second.token and len(first.token) >= 24 and first.listen_s == pytest.approx(2.0)
    sessions.played(first.token, "0")
    sessions.played(first.token, "1")
    sessions.played(second.token, "0")
    clock.now += 2.0
    with pytest.raises(VoteError, match="^Play B to the end before voting.$"):  # the other tab's plays do not count here
        sessions.vote(second.token, "demo", Vote("ann", 0, "A"))
    assert sessions.vote(first.token, "demo", Vote("ann", 0, "A")).index == 1
    for token in (first.token, "made-up"):
        with pytest.raises(VoteError, match=r"^This page has no trial open \(it was answered, or the server restarted\): press Start or resume.$"):
            sessions.vote(token, "demo", Vote("ann", 0, "A"))
    assert len(stored(sessions, "demo")) == 1


def test_the_clips_of_a_trial_are_served_without_probing_them(listen_app, monkeypatch):
    """gr.Audio runs ffprobe on every file it returns (where ffmpeg is installed); the Listen view's
    players serve the renderer's WAVs as they are, and the listener gets the very bytes."""
    from gradio import processing_utils
    from gradio_client import Client

    probed = []
    monkeypatch.setattr(processing_utils, "ffmpeg_installed", lambda: True)
    monkeypatch.setattr(processing_utils, "audio_is_playable", lambda path: probed.append(path) or True)
    url, sessions, _ = listen_app
    outputs = Client(url, verbose=False).predict("demo", "ann", api_name="/listen_start")
    assert probed == []
    view = sessions.trial("demo", "ann")
    assert Path(outputs[3]["value"]).read_bytes() == Path(view.clips[0]).read_bytes()
