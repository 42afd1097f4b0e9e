"""Benchmark scripts, each run as `python -m benchmarks.NAME`: the engine, its kernels, Omni chat and the
HTTP path on random weights at the real sizes (speed, kernels, omni, api), ours beside the official
package (compare), and the app as its users meet it (cold_start, click_to_first_sound, ...)."""
