"""benchmarks.load on the CPU: its pure parts on hand-made timelines (where playback stalls, the percentiles,
the seeded Poisson arrivals of 3-20 s sentences, when a rate holds), then a short run on the tiny checkpoint
through both clients, in process and over HTTP: every request completes with every frame it asked for, the
counts add up, and the report's JSON, markdown and PNG are written."""
import json

import numpy as np
import pytest
import torch

from benchmarks import load
from pipeline.tts import SAMPLES_PER_FRAME

# ---- stalls: playback starts at the first piece -----------------------------------------------------

def test_pieces_arriving_before_the_audio_runs_out_never_stall():
    times = [0.100, 0.150, 0.300, 0.600]  # each piece before the audio received so far has played
    seconds = [0.08, 0.16, 0.32, 0.64]
    assert load.stalls(times, seconds) == []


def test_a_piece_arriving_after_the_audio_before_it_has_played_is_a_stall():
    times = [0.100, 0.250, 0.400]  # the first 80 ms play until 0.18 s; the second piece comes at 0.25 s
    seconds = [0.08, 0.16, 0.32]
    assert load.stalls(times, seconds) == pytest.approx([0.07])  # then playback resumes: 0.25 + 0.16 covers 0.40


def test_playback_resumes_with_the_late_piece_and_each_stall_counts_once():
    times = [0.0, 0.2, 0.5, 0.55]
    seconds = [0.1, 0.1, 0.1, 0.1]
    # Plays to 0.1; stall of 0.1 until 0.2, then to 0.3; stall of 0.2 until 0.5, then to 0.6; the last piece is in time.
    assert load.stalls(times, seconds) == pytest.approx([0.1, 0.2])
    points = load.stall_points(times, seconds)
    assert [at for at, _ in points] == pytest.approx([0.1, 0.2])  # after 0.1 s and 0.2 s of audio received
    assert [length for _, length in points] == pytest.approx([0.1, 0.2])


def test_a_piece_arriving_exactly_as_the_audio_runs_out_is_not_a_stall():
    assert load.stalls([0.0, 0.5, 1.0], [0.5, 0.5, 0.5]) == []


def test_a_stream_without_audio_has_no_stalls():
    assert load.stalls([], []) == []


# ---- percentiles -------------------------------------------------------------------------------------

def test_percentiles_of_hand_made_values():
    assert load.percentiles([float(v) for v in range(1, 101)]) == pytest.approx({"p50": 50.5, "p95": 95.05, "p99": 99.01, "max": 100.0})
    assert load.percentiles([7.0]) == {"p50": 7.0, "p95": 7.0, "p99": 7.0, "max": 7.0}
    assert load.percentiles([]) == {"p50": None, "p95": None, "p99": None, "max": None}


# ---- the workload -------------------------------------------------------------------------------------

def test_every_sentence_gives_3_to_20_seconds_of_speech_over_that_range():
    seconds = [load.speech_frames(text) / load.FRAMES_PER_SECOND for text in load.SENTENCES]
    assert all(3.0 <= s <= 20.0 for s in seconds)
    assert min(seconds) < 4.0 and max(seconds) > 19.0


def test_arrivals_are_seeded_poisson_at_the_rate():
    arrivals = load.workload(10.0, 200.0, seed=3)
    assert arrivals == load.workload(10.0, 200.0, seed=3)
    assert arrivals != load.workload(10.0, 200.0, seed=4)
    times = np.array([a.at for a in arrivals])
    assert np.all(np.diff(times) > 0) and 0 < times[0] and times[-1] < 200.0
    assert abs(len(arrivals) - 2000) < 4 * np.sqrt(2000)  # a Poisson count: mean and variance 2,000
    gaps = np.diff(times)
    assert abs(gaps.std() / gaps.mean() - 1.0) < 0.1  # exponential gaps: their spread is their mean
    assert [a.index for a in arrivals] == list(range(len(arrivals)))
    assert {a.text for a in arrivals} == set(load.SENTENCES)
    assert all(a.frames == load.speech_frames(a.text) and a.samples == a.frames * SAMPLES_PER_FRAME for a in arrivals)


def result(**changes) -> dict:
    base = {"requests": 10, "completed": 10, "ttfa_ms": {"p50": 20.0, "p95": 90.0, "p99": 150.0, "max": 200.0}, "stuttering_streams": 0}
    return {**base, **changes}


def test_a_rate_holds_with_every_request_completed_p95_within_100_ms_and_no_stutter():
    assert load.holds(result())
    assert load.holds(result(ttfa_ms={"p50": 20.0, "p95": 100.0, "p99": 300.0, "max": 400.0}))
    assert not load.holds(result(ttfa_ms={"p50": 20.0, "p95": 100.5, "p99": 300.0, "max": 400.0}))
    assert not load.holds(result(stuttering_streams=1))
    assert not load.holds(result(completed=9))
    assert not load.holds(result(completed=0, ttfa_ms=load.percentiles([])))


def test_the_highest_rate_held_stops_at_the_first_that_did_not():
    runs = [{"size": "0.6B", "path": "http", "rate": rate, "held": held} for rate, held in ((5, True), (10, True), (20, False), (40, True))]
    runs.append({"size": "0.6B", "path": "process", "rate": 5, "held": False})
    assert load.highest_held(runs) == {("0.6B", "http"): 10, ("0.6B", "process"): None}


def test_a_rate_run_more_than_once_holds_only_if_every_run_held():
    runs = [{"size": "1.7B", "path": "process", "rate": rate, "held": held}
            for rate, held in ((5, True), (5, True), (10, True), (10, False), (20, True), (20, True))]
    assert load.highest_held(runs) == {("1.7B", "process"): 5}


def test_repeats_are_whole_numbers_of_at_least_one(capsys):
    assert load.parse_args(["--repeats", "3"]).repeats == 3
    assert load.parse_args([]).repeats == 1
    for bad in ("0", "two", "1.5"):
        with pytest.raises(SystemExit):
            load.parse_args(["--repeats", bad])
        assert "takes a whole number of at least 1" in capsys.readouterr().err


def test_rates_are_numbers_separated_by_commas(capsys):
    assert load.parse_args(["--rates", "5,10,20.5"]).rates == [5.0, 10.0, 20.5]
    for bad in ("5,ten", "0,5"):
        with pytest.raises(SystemExit):
            load.parse_args(["--rates", bad])
        assert "--rates takes" in capsys.readouterr().err


def kernel(stream: int, name: str, start_us: float, dur_us: float) -> dict:
    return {"cat": "kernel", "name": name, "ts": start_us, "dur": dur_us, "args": {"stream": stream}}


def test_a_profiled_window_sums_each_streams_kernels_and_counts_overlaps_once():
    events = [kernel(7, "_linear_kernel", 0, 300), kernel(7, "_qkv_kernel", 400, 100), kernel(13, "_conv_kernel", 200, 400),
              kernel(13, "_conv_kernel", 1_500, 500), kernel(13, "elementwise", 1_700, 100)]
    summary = load.kernel_summary(events)
    assert [(s["stream"], s["kernel_ms"], s["kernels"], s["top"]) for s in summary["streams"]] == [
        (13, 1.0, 3, "_conv_kernel"), (7, 0.4, 2, "_linear_kernel")]
    assert summary["window_s"] == pytest.approx(0.002)  # the first kernel's start to the last one's end
    assert summary["busy_share"] == pytest.approx((600 + 500) / 2000)  # [0, 600) and [1500, 2000) busy


def test_profile_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert load.main(["--tiny", "--profile", "--rates", "1", "--duration", "1"]) == 2
    assert "--profile measures GPU kernels and needs a CUDA GPU" in capsys.readouterr().err


# ---- a run on the tiny checkpoint -----------------------------------------------------------------

RATE, DURATION, REPEATS = 1.0, 2.0, 2


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("load")
    assert load.main(["--tiny", "--rates", str(RATE), "--duration", str(DURATION), "--drain", "600", "--repeats", str(REPEATS), "--out", str(out)]) == 0
    (report_file,) = out.glob("*-CPU-load-tiny.json")
    return json.loads(report_file.read_text()), out


def test_the_tiny_run_completes_every_request_through_both_clients(tiny_run):
    report, _ = tiny_run
    arrivals = load.workload(RATE, DURATION, seed=0)
    assert len(arrivals) >= 2
    assert [(r["size"], r["path"], r["rate"], r["repeat"]) for r in report["results"]] == [
        ("tiny", path, RATE, repeat) for repeat in range(REPEATS) for path in load.PATHS]
    for r in report["results"]:
        assert r["requests"] == r["ended"] == r["completed"] == len(r["streams"]) == len(arrivals), r["path"]
        assert r["errors"] == r["no_audio"] == 0 and not r["cut"]
        assert [s["frames"] for s in r["streams"]] == [a.frames for a in arrivals]
        assert all(s["complete"] and s["error"] is None for s in r["streams"])
        # Every frame asked for, as audio: nothing lost or doubled on the way.
        assert r["audio_s"] == pytest.approx(sum(a.samples for a in arrivals) / load.SAMPLE_RATE)


def test_the_tiny_runs_figures_add_up_from_its_streams(tiny_run):
    report, _ = tiny_run
    for r in report["results"]:
        streams = r["streams"]
        ttfa = [s["ttfa_ms"] for s in streams]
        assert r["ttfa_ms"] == pytest.approx(load.percentiles(ttfa))
        assert r["ttfa_ms"]["p50"] <= r["ttfa_ms"]["p95"] <= r["ttfa_ms"]["p99"] <= r["ttfa_ms"]["max"]
        stuttering = sum(bool(s["stalls_ms"]) for s in streams)
        assert r["stuttering_streams"] == stuttering and r["stutter_share"] == pytest.approx(stuttering / len(streams))
        assert 0 <= r["first_chunks_waited"] <= len(streams)  # at most one first chunk a stream
        # The engine hands each stream its first chunk before its client has it: every order statistic is earlier.
        sent = r["first_chunk_path"]["sent by the engine"]
        assert all(0 <= sent[q] <= r["ttfa_ms"][q] for q in ("p50", "p95", "p99", "max")), (sent, r["ttfa_ms"])
        assert all(stage["p50"] >= 0 for stage in r["first_chunk_path"].values())
        assert r["stall_ms_max"] == pytest.approx(max((max(s["stalls_ms"]) for s in streams if s["stalls_ms"]), default=0.0))
        assert r["audio_s_per_s"] == pytest.approx(r["audio_s"] / r["wall_s"])
        assert 1 <= r["max_rows_busy"] <= report["rows"]["tiny"] and r["max_waiting"] >= 0
        assert r["gpu_peak_allocated_gib"] is None  # the CPU
        assert r["held"] == load.holds(r)


def test_the_tiny_run_writes_its_table_and_plot(tiny_run):
    report, out = tiny_run
    (table,) = out.glob("*-CPU-load-tiny.md")
    text = table.read_text()
    assert report["command"].startswith("python -m benchmarks.load --tiny")
    assert text.count("| tiny | 4 |") == len(report["results"])
    assert "Highest rate holding p95 TTFA" in text
    for repeat in range(REPEATS):  # each run's row in where the first audio's time goes, per path
        assert all(f"| tiny | {path} | 1 (run {repeat + 1}) |" in text for path in load.PATHS)
    (png,) = out.glob("*-CPU-load-tiny.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def served_tiny(tmp_path_factory):
    target = load.tiny_target(None, tmp_path_factory.mktemp("cut"))
    load.serve(target)
    yield target
    target.close()


@pytest.mark.parametrize("path", load.PATHS)
def test_streams_still_running_when_the_drain_ends_are_cut_and_counted(served_tiny, path):
    """No time to drain: the streams still running or waiting for a row end, each client returns, and the
    run counts them as not completed (so the rate does not hold)."""
    r = load.run_rate(served_tiny, path, rate=4.0, duration=1.0, seed=0, drain=0.0)
    assert r["cut"] and r["requests"] == r["ended"] == len(load.workload(4.0, 1.0, seed=0))
    assert r["completed"] < r["requests"] and not r["held"]
    assert r["completed"] == sum(s["complete"] for s in r["streams"])


def test_a_run_cut_at_its_horizon_ends_every_stream_on_both_paths(tmp_path):
    """Streams still running (or waiting for a row) when the drain ends are cut, in process and from the
    HTTP client process alike: every request ends, none with an error, and the run says whether it cut."""
    assert load.main(["--tiny", "--rates", "4", "--duration", "2", "--drain", "1", "--keep-going", "--out", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("*-CPU-load-tiny.json")).read_text())
    assert [r["path"] for r in report["results"]] == ["process", "http"]
    for r in report["results"]:
        assert r["ended"] == r["requests"] == len(load.workload(4.0, 2.0, seed=0)) and r["errors"] == 0, r["path"]
        assert r["cut"] == (r["completed"] < r["requests"]), r["path"]
