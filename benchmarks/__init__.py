"""Benchmark scripts that measure the app as its users meet it (run each with `python -m benchmarks.NAME`)."""
