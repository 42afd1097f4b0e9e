"""`python -m benchmarks.vocoder --tiny`: the tiny codec on the CPU, as the script's own trial run."""
import json

from benchmarks.vocoder import main


def test_the_tiny_run_times_every_call_and_keeps_the_vocoder_within_float32_of_float64(tmp_path):
    assert main(["--tiny", "--slots", "2", "--calls", "1", "--out", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("*-vocoder-tiny.json")).read_text())
    assert list(report["calls_ms"]) == [f"1 stream, {n} frame{'s' if n > 1 else ''}" for n in (16, 8, 4, 2, 1)] + ["2 streams x 16 frames"]
    assert all(ms > 0 for ms in report["calls_ms"].values())
    # A causal decoder decodes a stream in chunks as it does in one call; float32 against float64 at rounding level.
    assert report["numerics"]["streamed_vs_offline"] <= 1e-5
    assert report["numerics"]["offline_vs_float64"] <= 1e-5
    assert "| 2 streams x 16 frames |" in next(tmp_path.glob("*-vocoder-tiny.md")).read_text()
