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


def test_attention_in_float64_stays_in_float64():
    """The benchmark's float64 decoder is a reference only where its attention scores are float64 too."""
    import torch

    from pipeline.layers import attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 3, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # two key/value heads for four query heads
    mask = torch.zeros(1, 3, 3, dtype=torch.float64)
    out = attention(q, k, v, mask, 8**-0.5)
    expected = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 8**-0.5, -1) @ v.repeat_interleave(2, 1)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
