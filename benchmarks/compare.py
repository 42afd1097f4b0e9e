"""Side by side on one GPU: the official `qwen-tts` generate path, faster-qwen3-tts 0.5.4 and ours.

    python -m benchmarks.compare --out DIR [--sizes 0.6B 1.7B] [--types custom_voice base]
                                     [--frames 250] [--runs 5] [--systems ours faster official]
    python -m benchmarks.compare --merge A.json B.json ... --out DIR   # one table of several runs

For each size and model type, one random-weight checkpoint at the real size is written in the
official file layout (config.json, generation_config.json, model.safetensors in bf16, the text
tokenizer files, speech_tokenizer/), and every system loads that same directory:

- official: `qwen_tts.Qwen3TTSModel.from_pretrained(dir, device_map="cuda", dtype=bfloat16,
  attn_implementation="sdpa")`, then `generate_custom_voice` / `generate_voice_clone` (not streaming:
  the official package has no streaming output), timed per call;
- faster-qwen3-tts: `FasterQwen3TTS.from_pretrained(dir)` (bf16, CUDA graphs), `generate_*` (not
  streaming) and `generate_*_streaming` with chunk_size 8 and 1;
- ours: `TTS.from_pretrained(dir, dtype="bfloat16", rows=8, compiled=True)` (CUDA graphs), one stream
  alone, and 8 streams submitted together, each consumed on its own thread.

The same text, language (english), voice (custom voice: speaker ryan; base: ICL voice clone of one
synthetic 5 s clip and its transcript, the voice prompt made once per system outside the timing)
and the same frame count for all, with each system's default sampling (top-k 50, temperature 0.9,
repetition penalty 1.05, sampled sub-talker). A warm-up call of --warm-frames (faster-qwen3-tts
captures its CUDA graphs then), then the median of --runs calls. The EOS row of the codec head is
zeroed in the checkpoint, so that EOS never reaches the top-k and every call makes the frames asked
for (the official code is asked for frames + 1 tokens: its max_new_tokens=N gives N - 1 frames);
the frames made are counted from each call's audio (1920 samples a frame) or chunks, and reported.

Reported per system: ms per frame (wall time of the call / frames made; for 8 streams, of the
batch, per stream), x real time (audio made / wall time, all streams), time to first audio (the
whole call where nothing streams), the ratios ours / peer, peak GPU memory allocated by torch, and
a PNG of per-chunk latency over time for the three streaming runs (faster chunk 8, faster chunk 1,
ours). Each system is guarded: its error is recorded in the JSON and the others still run; the JSON
is rewritten after every system, so a run cut short keeps what it finished. Between systems the
models are deleted and the CUDA cache emptied. Weight values do not change speed; the text
tokenizer is the tiny test BPE (no download), which cuts the text into more tokens than Qwen's
would: the same prompt for every system, a little longer than with the released tokenizer.

Offline GPU machine (python 3.12, torch 2.11+cu130, transformers 5.17, no gradio/librosa/soundfile):
the wheels in .whl/ are installed with --no-deps into /tmp/site, which comes first on PYTHONPATH.
- qwen-tts-hf 0.1.1.post1 is the official Qwen3-TTS `qwen_tts` package with the transformers-5 patch
  (QwenLM/Qwen3-TTS PR 360), the reference of tests/test_parity.py; PyPI's `qwen-tts` 0.1.1 is the
  same package before that patch and pins transformers==4.57.3, and faster-qwen3-tts 0.5.4 requires
  qwen-tts-hf, so qwen-tts itself is not carried (both install the same `qwen_tts` folder).
- transformers 5.15.1 and tokenizers 0.22.2 replace the machine's 5.17 / 0.23.2: the official 12 Hz
  tokenizer cannot be built on transformers 5.17 (MimiConfig has no rope_theta there; see
  requirements-test.txt), and transformers 5.15.1 refuses tokenizers above 0.23.0 at import.
- librosa (the official code imports it at module load and uses its mel filters for the speaker
  encoder) with audioread, decorator, pooch, platformdirs and soxr; soundfile/cffi/pycparser were
  already there; sox (imported at module load by the official 25 Hz tokenizer; only its import runs).
Left out: gradio (only qwen_tts.cli.demo imports it); accelerate==1.12.0 (qwen-tts-hf's pin: the
machine's accelerate 1.15 serves transformers' device_map, which asks for >= 1.1); torchaudio (the
official 25 Hz tokenizer's import; the machine's 2.11 matches its torch), onnxruntime and einops (on
the machine); qwentts-cpp-python (faster-qwen3-tts's GGML backend, imported only when asked for);
fastapi, uvicorn, python-multipart (its demo extra); qwen-tts (see above).

Device command (`carry: [".whl"]`, the wheels being git-ignored; 18.5 MiB):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    && export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
    && python3 -m benchmarks.compare --out $OUT --sizes 0.6B --types custom_voice
Time for one size and type at the defaults, estimated: checkpoint ~15 s; ours
~2 min (compile and capture ~1 min, then 12 calls of ~2 s); faster-qwen3-tts ~2 min (18 calls, chunk 1
the slowest); the official path 2.5-5 min (eager HF generate, 0.1-0.2 s a frame by faster-qwen3-tts's
published H100 baseline, 6 calls of 250 frames). So one size and type per call of the device tool
(limit 10 min), four calls in all, then --merge the four JSON files; the log prints the elapsed time
after every system, and if the first call runs long, give the official path its own call
(--systems official) or lower --frames for every system.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import gc
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from benchmarks.speed import TEXT_20_WORDS, save_figure
from pipeline.released import SIZES, real_size_config
from pipeline.tiny import GENERATION_CONFIG, TINY_SPEECH_TOKENIZER_CONFIG, randomize_, write_tiny_speech_tokenizer, write_tiny_text_tokenizer

TYPES = ("custom_voice", "base")
SYSTEMS = ("ours", "faster", "official")
SIZE_NAMES = {"0.6B": "0b6", "1.7B": "1b7"}  # tts_model_size in the released config.json files
SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920
FRAME_S = SAMPLES_PER_FRAME / SAMPLE_RATE  # 12.5 frames a second
LANGUAGE = "english"
SPEAKER = "ryan"
REF_TEXT = "Speak slowly and warmly, like a calm narrator reading a bedtime story."
REF_SECONDS = 5.0
OUR_STREAMS = 8
FASTER_CHUNKS = (8, 1)
STREAMING_KEYS = ("faster_chunk8", "faster_chunk1", "ours_1")  # the runs the PNG shows
LABELS = {
    "official": "official qwen-tts (generate, not streaming)",
    "faster": "faster-qwen3-tts (not streaming)",
    "faster_chunk8": "faster-qwen3-tts streaming, chunk 8",
    "faster_chunk1": "faster-qwen3-tts streaming, chunk 1",
    "ours_1": "ours, 1 stream",
    "ours_8": f"ours, {OUR_STREAMS} streams together",
}
SYSTEM_KEYS = {
    "ours": ["ours_1", "ours_8"],
    "faster": ["faster", *(f"faster_chunk{c}" for c in FASTER_CHUNKS)],
    "official": ["official"],
}


# ----------------------------------------------------------------------------------------------
# The checkpoint


def real_speech_tokenizer_config() -> dict:
    """speech_tokenizer/config.json at the released Qwen3-TTS-Tokenizer-12Hz sizes (the tiny config's
    keys, which both implementations read; the sizes are those of the released file)."""
    config = copy.deepcopy(TINY_SPEECH_TOKENIZER_CONFIG)
    config["encoder_config"].update(
        hidden_size=512, num_filters=64, num_hidden_layers=8, intermediate_size=2048, num_attention_heads=8,
        num_key_value_heads=8, head_dim=64, codebook_dim=256, vector_quantization_hidden_dimension=256,
        upsample_groups=512, max_position_embeddings=8000, sliding_window=250,
    )
    config["decoder_config"].update(
        codebook_dim=512, hidden_size=512, latent_dim=1024, decoder_dim=1536, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=16, head_dim=64, intermediate_size=1024,
    )
    return config


@torch.no_grad()
def write_random_checkpoint(directory: Path, model_type: str, make_config: Callable[[str, dict[str, int]], dict],
                            speech_config: dict, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """A random-weight checkpoint in the official layout whose codec head never picks EOS.

    `make_config(model_type, special_ids)` gives config.json (tiny_config, or a real size); weights are
    drawn on `device` (a CUDA generator fills a real-size model in seconds) and saved in `dtype`.
    The speech tokenizer is random and uncalibrated: its audio is noise, its cost that of the real one.
    """
    from safetensors.torch import save_file

    from pipeline.model import Qwen3TTS, TTSConfig

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = make_config(model_type, write_tiny_text_tokenizer(directory))
    (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generation = dict(GENERATION_CONFIG, max_new_tokens=2048)  # as released; every call here names its length
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    with torch.device(device):
        model = Qwen3TTS(TTSConfig.from_dict(config))
    randomize_(model, torch.Generator(device).manual_seed(seed))
    # A zero logit sits far below the top 50 of 2048 random ones: EOS is never sampled, so every
    # system makes exactly the frames it is asked for.
    model.talker.codec_head.weight[config["talker_config"]["codec_eos_token_id"]].zero_()
    state = {name: (t.to(dtype) if t.is_floating_point() else t).contiguous().cpu() for name, t in model.state_dict().items()}
    del model
    save_file(state, directory / "model.safetensors")
    write_tiny_speech_tokenizer(directory, seed, speech_config, calibrate=False)
    return directory


def write_real_size_checkpoint(directory: Path, size: str, model_type: str, device: str = "cuda") -> Path:
    """The real 0.6B / 1.7B talker (bf16, as released) and the real-size codec, random weights."""

    def make_config(kind: str, special_ids: dict[str, int]) -> dict:
        config = real_size_config(size, kind, special_ids)
        config["tts_model_size"] = SIZE_NAMES[size]
        return config

    return write_random_checkpoint(directory, model_type, make_config, real_speech_tokenizer_config(), device, torch.bfloat16)


def reference_clip(seconds: float = REF_SECONDS, seed: int = 0) -> np.ndarray:
    """A deterministic voice-like signal at 24 kHz (gliding harmonics, syllable-rate envelope, noise).
    Not speech: only the input of the voice-clone timing."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    phase = 2 * np.pi * np.cumsum(140 + 30 * np.sin(2 * np.pi * 0.7 * t)) / SAMPLE_RATE
    wave = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    return (0.2 * envelope * wave + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


@dataclass
class Inputs:
    """What every system is asked to say, and in which voice."""

    text: str
    speaker: str | None = None  # custom voice
    ref_audio: np.ndarray | None = None  # base: ICL voice clone of this clip...
    ref_text: str | None = None  # ...and its transcript

    @classmethod
    def for_type(cls, model_type: str) -> Inputs:
        if model_type == "base":
            return cls(TEXT_20_WORDS, ref_audio=reference_clip(), ref_text=REF_TEXT)
        return cls(TEXT_20_WORDS, speaker=SPEAKER)


# ----------------------------------------------------------------------------------------------
# Records


@dataclass
class Run:
    """One timed call (for several streams: one round of them, submitted together)."""

    wall_s: float
    frames: int  # frames made (of each stream: the fewest)
    ttfa_s: float  # first audio (several streams: their median); the whole call when nothing streams
    arrivals_s: list[float] = field(default_factory=list)  # each chunk's arrival since the call (first stream)
    chunk_frames: list[int] = field(default_factory=list)


@dataclass
class Result:
    """One system on one checkpoint: its runs, or the error that stopped it."""

    size: str
    model_type: str
    key: str  # a key of LABELS
    frames_asked: int
    streams: int = 1
    runs: list[Run] = field(default_factory=list)
    error: str | None = None
    peak_gib: float | None = None  # peak GPU memory allocated by torch over the system's load and runs

    @property
    def median_run(self) -> Run:
        """The run of median wall time (the upper one of an even count): its chunks go in the plot."""
        return sorted(self.runs, key=lambda r: r.wall_s)[len(self.runs) // 2]

    def summary(self) -> dict:
        if not self.runs:
            return {}
        wall = statistics.median(r.wall_s for r in self.runs)
        frames = min(r.frames for r in self.runs)
        per_frame = wall * 1000.0 / frames if frames else None  # of one stream
        return {
            "wall_s": wall,
            "frames_made": frames,
            "all_frames_made": all(r.frames == self.frames_asked for r in self.runs),
            "ms_per_frame": per_frame,
            "aggregate_ms_per_frame": per_frame / self.streams if per_frame else None,
            "x_real_time": self.streams * frames * FRAME_S / wall,
            "ttfa_ms": statistics.median(r.ttfa_s for r in self.runs) * 1000.0,
        }

    def to_json(self) -> dict:
        return {**asdict(self), "label": LABELS[self.key], "summary": self.summary()}

    @classmethod
    def from_json(cls, data: dict) -> Result:
        fields_ = {k: v for k, v in data.items() if k not in ("label", "summary", "runs")}
        return cls(**fields_, runs=[Run(**r) for r in data["runs"]])


# ----------------------------------------------------------------------------------------------
# Timing


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def call_once(generate: Callable[[], np.ndarray]) -> Run:
    """A call that returns the whole utterance's audio: frames counted from its length."""
    sync()
    start = time.perf_counter()
    audio = generate()
    wall = time.perf_counter() - start
    frames = round(len(audio) / SAMPLES_PER_FRAME)
    return Run(wall, frames, wall, [wall], [frames])


def consume(open_stream: Callable[[], Iterable[int]], synchronize: bool = True) -> Run:
    """Iterate a stream of chunks (given as their frame counts), noting when each arrives. The stream
    is opened inside the timing: preparing the prompt is part of the time to first audio.
    `synchronize=False` for streams that start together: waiting for the GPU would wait for the others."""
    if synchronize:
        sync()
    start = time.perf_counter()
    arrivals, frames = [], []
    for n in open_stream():
        arrivals.append(time.perf_counter() - start)
        frames.append(int(n))
    wall = time.perf_counter() - start
    return Run(wall, sum(frames), arrivals[0] if arrivals else wall, arrivals, frames)


def together(streams: list[Callable[[], Run]]) -> Run:
    """Several streams started at once, each consumed on its own thread (as the app's visitors are)."""
    runs: list[Run | BaseException | None] = [None] * len(streams)

    def listen(i: int) -> None:
        try:
            runs[i] = streams[i]()
        except BaseException as exc:  # re-raised below, on the caller's thread
            runs[i] = exc

    threads = [threading.Thread(target=listen, args=(i,)) for i in range(len(streams))]
    sync()
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    for r in runs:
        if isinstance(r, BaseException):
            raise r
    first = runs[0]
    return Run(wall, min(r.frames for r in runs), statistics.median(r.ttfa_s for r in runs), first.arrivals_s, first.chunk_frames)


def measure(call: Callable[[int, int], Run], frames: int, runs: int, warm_frames: int) -> list[Run]:
    """A warm-up call, then `runs` timed calls; `call(frames, seed)`."""
    call(warm_frames, 10_000)
    return [call(frames, seed) for seed in range(runs)]


# ----------------------------------------------------------------------------------------------
# The three systems. Each yields its Results one by one (so a later failure keeps the earlier ones).


def bench_ours(directory: Path, model_type: str, inputs: Inputs, frames: int, runs: int, warm_frames: int,
               rows: int = OUR_STREAMS, device: str = "cuda", compiled: bool = True) -> Iterator[tuple[str, list[Run]]]:
    from pipeline.request import SpeechRequest
    from pipeline.tts import TTS

    tts = TTS.from_pretrained(str(directory), device=device, dtype="bfloat16" if device == "cuda" else "float32", rows=rows, compiled=compiled)
    try:
        tts.warm_up()
        voice = tts.create_voice_prompt((inputs.ref_audio, SAMPLE_RATE), inputs.ref_text) if model_type == "base" else None

        def one(n: int, seed: int, synchronize: bool = True) -> Run:
            request = SpeechRequest(inputs.text, language=LANGUAGE, speaker=inputs.speaker, seed=seed, max_frames=n)
            return consume(lambda: (chunk.frames for chunk in tts.submit(request, voice)), synchronize)

        def batch(n: int, seed: int) -> Run:
            return together([lambda i=i: one(n, seed * OUR_STREAMS + i, False) for i in range(OUR_STREAMS)])

        yield "ours_1", measure(one, frames, runs, warm_frames)
        yield "ours_8", measure(batch, frames, runs, warm_frames)
    finally:
        tts.engine.shutdown()


def load_official(directory: Path, device: str = "cuda"):
    """qwen_tts.Qwen3TTSModel as its README loads it, with sdpa attention instead of flash-attn (not on
    the machine; faster-qwen3-tts loads it so too). device_map needs accelerate: only on the GPU."""
    from qwen_tts import Qwen3TTSModel

    options = dict(device_map=device, dtype=torch.bfloat16) if device == "cuda" else dict(dtype=torch.float32)
    return Qwen3TTSModel.from_pretrained(str(directory), attn_implementation="sdpa", **options)


def official_calls(model, model_type: str, inputs: Inputs) -> dict[str, Callable[[int, int], Run]]:
    """The official generate call, `call(frames, seed)`; the voice prompt (base) is made once here."""
    if model_type == "base":
        prompt = model.create_voice_clone_prompt(ref_audio=(inputs.ref_audio, SAMPLE_RATE), ref_text=inputs.ref_text)
        generate = partial(model.generate_voice_clone, text=inputs.text, language=LANGUAGE, voice_clone_prompt=prompt)
    else:
        generate = partial(model.generate_custom_voice, text=inputs.text, speaker=inputs.speaker, language=LANGUAGE)

    def call(n: int, seed: int) -> Run:
        torch.manual_seed(seed)
        return call_once(lambda: generate(max_new_tokens=n + 1)[0][0])  # max_new_tokens=N gives N - 1 frames

    return {"official": call}


def bench_official(directory: Path, model_type: str, inputs: Inputs, frames: int, runs: int, warm_frames: int,
                   device: str = "cuda") -> Iterator[tuple[str, list[Run]]]:
    model = load_official(directory, device)
    for key, call in official_calls(model, model_type, inputs).items():
        yield key, measure(call, frames, runs, warm_frames)


def faster_calls(model, model_type: str, inputs: Inputs) -> dict[str, Callable[[int, int], Run]]:
    """faster-qwen3-tts's calls, `call(frames, seed)`: not streaming, and streaming with each chunk size.
    The voice prompt (base) is made once here, by the official code it wraps."""
    if model_type == "base":
        prompt = model.model.create_voice_clone_prompt(ref_audio=(inputs.ref_audio, SAMPLE_RATE), ref_text=inputs.ref_text)
        kwargs = dict(text=inputs.text, language=LANGUAGE, voice_clone_prompt=prompt)
        generate, stream = model.generate_voice_clone, model.generate_voice_clone_streaming
    else:
        kwargs = dict(text=inputs.text, speaker=inputs.speaker, language=LANGUAGE)
        generate, stream = model.generate_custom_voice, model.generate_custom_voice_streaming

    def whole(n: int, seed: int) -> Run:
        torch.manual_seed(seed)
        return call_once(lambda: generate(**kwargs, max_new_tokens=n)[0][0])  # max_new_tokens=N gives N frames

    def streamed(chunk: int) -> Callable[[int, int], Run]:
        def call(n: int, seed: int) -> Run:
            torch.manual_seed(seed)
            # Each item: (audio, sample_rate, timing); timing["chunk_steps"] is the chunk's frames.
            return consume(lambda: (timing["chunk_steps"] for _, _, timing in stream(**kwargs, max_new_tokens=n, chunk_size=chunk)))
        return call

    return {"faster": whole, **{f"faster_chunk{chunk}": streamed(chunk) for chunk in FASTER_CHUNKS}}


def bench_faster(directory: Path, model_type: str, inputs: Inputs, frames: int, runs: int, warm_frames: int) -> Iterator[tuple[str, list[Run]]]:
    from faster_qwen3_tts import FasterQwen3TTS

    # Its defaults: bf16, sdpa, CUDA graphs captured on the first call (the warm-up), max_seq_len 2048.
    model = FasterQwen3TTS.from_pretrained(str(directory), device="cuda", dtype=torch.bfloat16, attn_implementation="sdpa")
    for key, call in faster_calls(model, model_type, inputs).items():
        yield key, measure(call, frames, runs, warm_frames)


def run_system(system: str, directory: Path, size: str, model_type: str, args: argparse.Namespace,
               on_result: Callable[[Result], None]) -> None:
    """One system on one checkpoint, guarded: an error becomes the Result of every key not measured yet."""
    bench = {"ours": bench_ours, "faster": bench_faster, "official": bench_official}[system]
    inputs = Inputs.for_type(model_type)
    done: list[str] = []
    torch.cuda.reset_peak_memory_stats()
    extra = {"rows": args.rows} if system == "ours" else {}
    try:
        for key, runs in bench(directory, model_type, inputs, args.frames, args.runs, args.warm_frames, **extra):
            streams = OUR_STREAMS if key == "ours_8" else 1
            on_result(Result(size, model_type, key, args.frames, streams, runs, peak_gib=torch.cuda.max_memory_allocated() / 2**30))
            done.append(key)
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"
        print(f"{system} failed on {size} {model_type}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        for key in SYSTEM_KEYS[system]:
            if key not in done:
                on_result(Result(size, model_type, key, args.frames, OUR_STREAMS if key == "ours_8" else 1, error=message))
    finally:
        gc.collect()  # the models are unreachable once the generator has ended
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# Report


def commit() -> str | None:
    """The repository's commit, the hash of the tree of the files as they are (what `git log
    --format='%h %T'` matches to the commit holding exactly them, also where this .git is older than
    the files, as on a machine that receives a copy of the work tree), and "dirty" where that tree
    is not the commit's; None where git or .git is missing."""
    def git(*args: str, **options) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, **options).stdout.strip()

    try:
        head, head_tree = git("rev-parse", "--short", "HEAD"), git("rev-parse", "HEAD^{tree}")
        with tempfile.TemporaryDirectory() as index:  # a scratch index: the repository's own stays as it is
            env = {**os.environ, "GIT_INDEX_FILE": str(Path(index) / "index")}
            git("add", "--all", env=env)
            tree = git("write-tree", env=env)
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}, tree {tree[:12]}" + ("" if tree == head_tree else " (dirty)")


def versions() -> dict[str, str]:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {"python": sys.version.split()[0], "torch": torch.__version__,
            **{name: version(name) for name in ("transformers", "qwen-tts-hf", "faster-qwen3-tts", "tokenizers")}}


def ratio(ours: float | None, peer: float | None) -> str:
    return f"{ours / peer:.3g}" if ours and peer else ""  # significant digits: ours can be 1/1000 of a peer


def number(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def markdown(report: dict) -> str:
    results = [Result.from_json(r) for r in report["results"]]
    v = report["versions"]
    lines = [
        f"### Side by side: official qwen-tts, faster-qwen3-tts, ours — {report['gpu']}, {report['date']}", "",
        f"torch {v['torch']}, transformers {v['transformers']}, qwen-tts-hf {v['qwen-tts-hf']} (the official `qwen_tts` "
        f"code, transformers-5 build), faster-qwen3-tts {v['faster-qwen3-tts']}. One random-weight checkpoint at the real "
        f"size in the official layout per model, loaded by all three (the peers: bf16 talker and codec, sdpa attention; ours: "
        f"bf16 talker, float32 codec, compiled decode step, CUDA graphs, an engine of {report['rows']} rows). The same text "
        f"({report['text_tokens']} tokens of the test tokenizer), sampling and voice (custom voice: speaker {SPEAKER}; base: "
        f"ICL clone of a synthetic {REF_SECONDS:.0f} s clip, its prompt made once outside the timing), {report['frames']} "
        f"frames ({report['frames'] * FRAME_S:.0f} s of audio) per utterance; a warm-up call of {report['warm_frames']} "
        f"frames, then the median of {report['runs']} calls.",
        "", *(f"Command: `{c}`" for c in report["commands"]), *([f"Commit: {report['commit']}."] if report.get("commit") else []), "",
        "ms per frame: wall time of the call / frames made (8 streams: of the batch, per stream). x real time: audio made "
        "by all streams / wall time. TTFA: call to first audio (the whole call when it does not stream). "
        "ours / this: below 1, ours takes less time.", "",
    ]
    combos = dict.fromkeys((r.size, r.model_type) for r in results)
    for size, model_type in combos:
        rows = {r.key: r for r in results if (r.size, r.model_type) == (size, model_type)}
        ours_1 = rows.get("ours_1").summary() if "ours_1" in rows else {}
        ours_8 = rows.get("ours_8").summary() if "ours_8" in rows else {}
        lines += [f"#### {size} {model_type.replace('_', ' ')}", "",
                  "| system | frames made | ms per frame | x real time | TTFA ms | peak GiB "
                  "| ours 1 stream / this, ms per frame | ours 1 stream / this, TTFA | ours 8 streams aggregate / this, ms per frame |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for key in LABELS:
            if key not in rows:
                continue
            r, s = rows[key], rows[key].summary()
            if r.error:
                lines.append(f"| {LABELS[key]} | error: {r.error.splitlines()[0][:200]} | | | | | | | |")
                continue
            made = f"{s['frames_made']}" + ("" if s["all_frames_made"] else f" (asked {r.frames_asked})")
            per_frame = number(s["ms_per_frame"], 2) + (f" ({number(s['aggregate_ms_per_frame'], 2)} aggregate)" if r.streams > 1 else "")
            mine = key.startswith("ours")
            lines.append(
                f"| {LABELS[key]} | {made} | {per_frame} | {number(s['x_real_time'])} | {number(s['ttfa_ms'], 0)} | {number(r.peak_gib)} "
                f"| {'' if mine else ratio(ours_1.get('ms_per_frame'), s['ms_per_frame'])} "
                f"| {'' if mine else ratio(ours_1.get('ttfa_ms'), s['ttfa_ms'])} "
                f"| {'' if mine else ratio(ours_8.get('aggregate_ms_per_frame'), s['ms_per_frame'])} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> bool:
    """Per-chunk latency over time of the streaming runs (their median run), one row per checkpoint.
    False (and no file) where matplotlib is missing or nothing streamed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [Result.from_json(r) for r in report["results"]]
    streaming = sorted((r for r in results if r.key in STREAMING_KEYS and r.runs), key=lambda r: STREAMING_KEYS.index(r.key))
    combos = list(dict.fromkeys((r.size, r.model_type) for r in streaming))
    if not combos:
        return False
    colors = dict(zip(STREAMING_KEYS, ("tab:orange", "tab:red", "tab:blue"), strict=True))  # the same in every row
    fig, axes = plt.subplots(len(combos), 2, figsize=(13, 4.2 * len(combos)), squeeze=False)
    for (size, model_type), (latency, audio) in zip(combos, axes, strict=True):
        name = f"{size} {model_type.replace('_', ' ')}"
        end = 0.0
        for r in (r for r in streaming if (r.size, r.model_type) == (size, model_type)):
            run = r.median_run
            t = np.array(run.arrivals_s)
            gaps_ms = np.diff(t, prepend=0.0) * 1000.0  # the first chunk's is its time to first audio
            latency.plot(t, gaps_ms, marker=".", markersize=3, linewidth=0.8, color=colors[r.key], label=LABELS[r.key])
            audio.step(t, np.cumsum(run.chunk_frames) * FRAME_S, where="post", color=colors[r.key], label=LABELS[r.key])
            end = max(end, t[-1])
        audio.plot([0, end], [0, end], color="grey", linestyle="--", linewidth=0.8, label="real time")
        latency.set(xlabel="wall time since the call (s)", ylabel="ms since the previous chunk (first: TTFA)",
                    title=f"{name}: per-chunk latency", ylim=(0, None))
        audio.set(xlabel="wall time since the call (s)", ylabel="audio received (s)", title=f"{name}: audio received")
    return save_figure(fig, axes.flat, f"{report['gpu']}, {report['frames']} frames, median run of {report['runs']}", path)


def write_outputs(out: Path, stem: str, report: dict, with_plot: bool = True) -> None:
    """STEM.json, STEM.md and STEM.png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    (out / f"{stem}.md").write_text(markdown(report))
    if with_plot and not plot(report, out / f"{stem}.png"):
        print("no PNG: matplotlib is missing or nothing streamed", file=sys.stderr)


def merge(files: list[Path]) -> dict:
    """One report of several runs' JSON files: the first one's header, every command, every result
    (of a size, model type and system measured twice, the later file's)."""
    reports = [json.loads(Path(f).read_text()) for f in files]
    merged = dict(reports[0])
    merged["commands"] = [c for r in reports for c in r["commands"]]
    results = {(res["size"], res["model_type"], res["key"]): res for r in reports for res in r["results"]}
    merged["results"] = list(results.values())
    return merged


# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON, markdown and PNG")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    parser.add_argument("--frames", type=int, default=250, help="frames per utterance, every system (250 = 20 s)")
    parser.add_argument("--runs", type=int, default=5, help="timed calls per system after the warm-up (median)")
    parser.add_argument("--warm-frames", type=int, default=32, help="frames of the warm-up call")
    parser.add_argument("--rows", type=int, default=OUR_STREAMS, help="rows (batch) of our engine; at least 8")
    parser.add_argument("--merge", type=Path, nargs="+", help="JSON files of earlier runs: write one report of them all (no GPU)")
    args = parser.parse_args(argv)
    if args.rows < OUR_STREAMS or args.frames < 1 or args.runs < 1 or args.warm_frames < 1:
        parser.error(f"--rows is at least {OUR_STREAMS}; --frames, --runs and --warm-frames at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        write_outputs(args.out, "compare-merged", merge(args.merge))
        return 0
    if not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    report = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "commands": ["python -m benchmarks.compare " + " ".join(sys.argv[1:] if argv is None else argv)],
        "versions": versions(),
        "commit": commit(),
        "frames": args.frames, "runs": args.runs, "warm_frames": args.warm_frames, "rows": args.rows,
        "text": TEXT_20_WORDS, "text_tokens": None, "checkpoint_write_s": {}, "results": [],
    }
    stem = f"{report['date']}-{report['gpu'].replace(' ', '_')}-compare-{'-'.join(args.sizes)}-{'-'.join(args.types)}"
    start = time.perf_counter()

    def on_result(result: Result) -> None:
        report["results"].append(result.to_json())
        # Kept current: a call cut short keeps what it finished (the PNG changes with the streaming runs only).
        write_outputs(args.out, stem, report, with_plot=result.key in STREAMING_KEYS and not result.error)
        s = result.summary()
        status = result.error or f"{number(s['ms_per_frame'], 2)} ms/frame, TTFA {s['ttfa_ms']:.0f} ms, {s['frames_made']} frames"
        print(f"[{time.perf_counter() - start:6.0f} s] {result.size} {result.model_type} {LABELS[result.key]}: {status}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            for model_type in args.types:
                t0 = time.perf_counter()
                directory = write_real_size_checkpoint(Path(tmp) / f"{size}-{model_type}", size, model_type)
                report["checkpoint_write_s"][f"{size} {model_type}"] = time.perf_counter() - t0
                torch.cuda.empty_cache()  # the float32 model the weights were drawn in
                if report["text_tokens"] is None:
                    from pipeline.loading import load_text_tokenizer

                    report["text_tokens"] = len(load_text_tokenizer(directory)(TEXT_20_WORDS)["input_ids"])
                print(f"[{time.perf_counter() - start:6.0f} s] wrote {size} {model_type}", flush=True)
                for system in args.systems:
                    run_system(system, directory, size, model_type, args, on_result)
                shutil.rmtree(directory)
    write_outputs(args.out, stem, report)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
