"""GPU benchmark on random weights at the real 0.6B and 1.7B sizes: `python -m pipeline.bench`.

Weight values do not change speed, so no download is needed. Random weights would end utterances
at random frames; the EOS row of the codec head is zeroed so that EOS never reaches the top-k and
every run produces exactly the frames asked for.

Writes a JSON file and a markdown table (GPU, torch version, date, command next to the numbers).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.generate import SamplingConfig
from pipeline.model import Qwen3TTS, TTSConfig
from pipeline.speech_tokenizer import SpeechTokenizer, SpeechTokenizerConfig, randomize_speech_tokenizer_
from pipeline.tiny import GENERATION_CONFIG, tiny_config, write_tiny_text_tokenizer
from pipeline.tts import TTS, VoicePrompt

SIZES = {
    "0.6B": dict(hidden_size=1024, intermediate_size=3072, text_hidden_size=2048),
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, text_hidden_size=2048),
}
TEXT_20_WORDS = "The quick brown fox jumps over the lazy dog while the patient narrator reads every word of this sentence aloud."
RUNS = 5


def real_size_config(size: str, model_type: str, special_ids: dict[str, int]) -> dict:
    config = tiny_config(model_type, special_ids)
    talker = config["talker_config"]
    talker.update(SIZES[size], num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, text_vocab_size=151936)
    talker["rope_scaling"]["mrope_section"] = [24, 20, 20]
    talker["code_predictor_config"].update(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=8, head_dim=128
    )
    config["speaker_encoder_config"] = {"enc_dim": talker["hidden_size"], "sample_rate": 24000}
    return config


@torch.no_grad()
def random_tts(size: str, model_type: str, device: str, dtype: torch.dtype, workdir: Path) -> TTS:
    from transformers import AutoTokenizer

    special_ids = write_tiny_text_tokenizer(workdir)
    config = TTSConfig.from_dict(real_size_config(size, model_type, special_ids))
    with torch.device(device):
        model = Qwen3TTS(config).to(dtype).eval()
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
        model.talker.codec_head.weight[config.talker_config.codec_eos_token_id].zero_()
    codec = SpeechTokenizer(SpeechTokenizerConfig())
    randomize_speech_tokenizer_(codec, torch.Generator().manual_seed(0))
    codec = codec.to(device=device).eval()  # float32, as TTS.from_pretrained loads it
    generation = dict(GENERATION_CONFIG, max_new_tokens=4096)
    return TTS(model, AutoTokenizer.from_pretrained(str(workdir)), codec, generation, f"random {size} {model_type}")


def cuda_ms(fn, repeat: int = 1) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000.0 / repeat


def frame_ms(tts: TTS, request, sampling: SamplingConfig, graphs: bool, frames: int = 100) -> float:
    decoder = tts.frame_decoder(request, sampling, seed=0)
    previous, decoder.use_cuda_graphs = decoder.use_cuda_graphs, graphs
    decoder.prefill(request.prompt.prefill)
    decoder.step()  # capture (graphs) / warm-up (eager), outside the timing
    runs = []
    for _ in range(RUNS):
        decoder.reset(request.prompt.trailing_text, request.prompt.tts_pad, sampling, 0)
        decoder.prefill(request.prompt.prefill)
        runs.append(cuda_ms(decoder.step, frames))
    decoder.use_cuda_graphs = previous
    return statistics.median(runs)


def kernels_per_frame(tts: TTS, request, sampling: SamplingConfig, graphs: bool) -> int:
    from torch.profiler import ProfilerActivity, profile

    decoder = tts.frame_decoder(request, sampling, seed=0)
    previous, decoder.use_cuda_graphs = decoder.use_cuda_graphs, graphs
    decoder.prefill(request.prompt.prefill)
    decoder.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decoder.step()
        torch.cuda.synchronize()
    decoder.use_cuda_graphs = previous
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" not in e.name and "Memset" not in e.name)


def stream_times(tts: TTS, frames: int, **request) -> dict:
    ttfa, totals = [], []
    for _ in range(RUNS):
        start = time.perf_counter()
        chunks = list(tts.stream(TEXT_20_WORDS, max_frames=frames, seed=0, **request))
        totals.append(time.perf_counter() - start)
        ttfa.append(chunks[0].elapsed_ms)
        assert sum(c.frames for c in chunks) == frames
    return {"ttfa_ms": statistics.median(ttfa), "total_s": statistics.median(totals)}


def vocoder_ms(tts: TTS, sizes=(1, 2, 4, 8, 16)) -> dict:
    """Per chunk size, the engine's vocoder (CUDA graph per size) and the same decoder run eagerly."""
    out = {}
    for graphs in (True, False):
        vocoder = tts.vocoder if graphs else tts.speech_tokenizer.stream_decoder()
        for n in sizes:
            codes = torch.randint(0, 2048, (n, 16), device=tts.device)
            vocoder.decode_chunk(codes)
            out[f"{n}-frame chunk, {'CUDA graph' if graphs else 'eager'}"] = statistics.median(cuda_ms(lambda: vocoder.decode_chunk(codes)) for _ in range(RUNS))
    tts.vocoder.reset()
    return out


@torch.inference_mode()
def ttfa_breakdown(tts: TTS, **request) -> dict:
    """Where the time to first audio goes, stage by stage (each synchronised), first chunk of one frame."""
    stages, start = {}, time.perf_counter()

    def mark(name: str) -> None:
        nonlocal start
        torch.cuda.synchronize()
        stages[name] = (time.perf_counter() - start) * 1000.0
        start = time.perf_counter()

    prepared = tts.prepare(TEXT_20_WORDS, **request)
    mark("prepare (tokenize, prompt embeddings)")
    decoder = tts.frame_decoder(prepared, tts.sampling(), seed=0)
    decoder.prefill(prepared.prompt.prefill)
    mark("prefill")
    codes, _ = decoder.step()
    mark("first frame")
    tts.vocoder.reset()
    audio = tts.vocoder.decode_chunk(codes[None])
    mark("vocoder, 1 frame")
    audio.cpu()
    mark("copy to host")
    tts.vocoder.reset()
    return stages


def stream_equals_offline(tts: TTS, frames: int = 120) -> float:
    codes = torch.randint(0, 2048, (frames, 16), device=tts.device)
    offline = tts.speech_tokenizer.decode(codes)
    stream = tts.speech_tokenizer.stream_decoder()
    pieces, start = [], 0
    for n in (1, 2, 4, 8, 16, 16, 16, 16, 16, 16, 9):
        pieces.append(stream.decode_chunk(codes[start : start + n]))
        start += n
    return float((torch.cat(pieces) - offline).abs().max())


def graph_equals_eager(size: str, device: str, workdir: Path, frames: int = 40) -> dict:
    """fp32: the CUDA graph (plain and compiled) must give the same codes as eager execution."""
    tts = random_tts(size, "custom_voice", device, torch.float32, workdir)
    request = tts.prepare(TEXT_20_WORDS, speaker="ryan", language="english")
    result = {}
    for name, sampling in (("greedy", tts.sampling(greedy=True)), ("sampled", tts.sampling())):
        codes = {}
        for variant, graphs, compiled in (("eager", False, False), ("graph", True, False), ("compiled graph", True, True)):
            tts.use_cuda_graphs, tts.compiled, tts.decoder = graphs, compiled, None
            codes[variant] = torch.stack(list(tts.generate_codes(request, sampling, max_frames=frames, seed=7)))
        for variant in ("graph", "compiled graph"):
            result[f"{variant}, {name}"] = bool(torch.equal(codes["eager"], codes[variant]))
    return result


def bench_size(size: str, device: str, workdir: Path, frames_20s: int = 250) -> dict:
    sampling = SamplingConfig()
    custom = random_tts(size, "custom_voice", device, torch.bfloat16, workdir)
    request = custom.prepare(TEXT_20_WORDS, speaker="ryan", language="english")
    result = {
        "prompt_positions": request.prompt.prefill.shape[1],
        "frame_ms_eager": frame_ms(custom, request, sampling, graphs=False, frames=20),
        "frame_ms_graph": frame_ms(custom, request, sampling, graphs=True),
        "kernels_per_frame_eager": kernels_per_frame(custom, request, sampling, graphs=False),
        "kernels_per_frame_graph": kernels_per_frame(custom, request, sampling, graphs=True),
    }
    custom.decoder, custom.compiled = None, True
    start = time.perf_counter()
    custom.warm_up()
    result["warm_up_s_compiled"] = time.perf_counter() - start
    result["frame_ms_graph_compiled"] = frame_ms(custom, request, sampling, graphs=True)
    result["kernels_per_frame_graph_compiled"] = kernels_per_frame(custom, request, sampling, graphs=True)
    custom_voice = stream_times(custom, frames_20s, speaker="ryan", language="english")
    result["ttfa_ms_custom_voice"] = custom_voice["ttfa_ms"]
    result["ttfa_breakdown_ms_custom_voice"] = ttfa_breakdown(custom, speaker="ryan", language="english")
    result["rtf_20s"] = custom_voice["total_s"] / (frames_20s * 0.08)
    result["vocoder_ms_per_chunk"] = vocoder_ms(custom)
    result["stream_vs_offline_max_abs"] = stream_equals_offline(custom)
    del custom
    torch.cuda.empty_cache()

    base = random_tts(size, "base", device, torch.bfloat16, workdir)
    base.compiled = True
    from pipeline.audio import SAMPLE_RATE

    rng = np.random.default_rng(0)
    reference = (0.1 * rng.standard_normal(5 * SAMPLE_RATE)).astype(np.float32)
    start = time.perf_counter()
    voice = base.create_voice_prompt((reference, SAMPLE_RATE), "A five second reference recording of a voice.")
    torch.cuda.synchronize()
    result["voice_prompt_ms"] = (time.perf_counter() - start) * 1000.0
    assert isinstance(voice, VoicePrompt) and voice.ref_codes.shape[0] == 63
    base.warm_up()
    result["ttfa_ms_icl_clone_5s_ref"] = stream_times(base, 20, voice_prompt=voice, language="english")["ttfa_ms"]
    return result


def markdown(report: dict) -> str:
    rows = [
        ("ms per frame, eager", "frame_ms_eager", "{:.2f}"),
        ("ms per frame, CUDA graph", "frame_ms_graph", "{:.2f}"),
        ("ms per frame, compiled + CUDA graph", "frame_ms_graph_compiled", "{:.2f}"),
        ("kernels per frame, eager", "kernels_per_frame_eager", "{}"),
        ("kernels per frame, CUDA graph", "kernels_per_frame_graph", "{}"),
        ("kernels per frame, compiled + CUDA graph", "kernels_per_frame_graph_compiled", "{}"),
        ("warm-up incl. compile (s, once per process)", "warm_up_s_compiled", "{:.1f}"),
        ("TTFA custom voice (ms)", "ttfa_ms_custom_voice", "{:.1f}"),
        ("TTFA ICL clone, 5 s reference (ms)", "ttfa_ms_icl_clone_5s_ref", "{:.1f}"),
        ("voice prompt from 5 s reference (ms, once per voice)", "voice_prompt_ms", "{:.1f}"),
        ("RTF, 20 s utterance (wall / audio)", "rtf_20s", "{:.3f}"),
        ("streamed vs offline vocoder, max abs (codec in float32)", "stream_vs_offline_max_abs", "{:.2e}"),
    ]
    sizes = list(report["sizes"])
    lines = [f"| | {' | '.join(sizes)} |", "|---|" + "---|" * len(sizes)]
    for label, key, fmt in rows:
        lines.append(f"| {label} | " + " | ".join(fmt.format(report["sizes"][s][key]) for s in sizes) + " |")
    for stage in report["sizes"][sizes[0]]["ttfa_breakdown_ms_custom_voice"]:
        lines.append(f"| TTFA stage: {stage} (ms) | " + " | ".join(f"{report['sizes'][s]['ttfa_breakdown_ms_custom_voice'][stage]:.2f}" for s in sizes) + " |")
    for n in report["sizes"][sizes[0]]["vocoder_ms_per_chunk"]:
        lines.append(f"| vocoder ms, {n} | " + " | ".join(f"{report['sizes'][s]['vocoder_ms_per_chunk'][n]:.2f}" for s in sizes) + " |")
    checks = ", ".join(f"{k}: {'identical' if v else 'DIFFERENT'}" for k, v in report["graph_equals_eager_fp32"].items())
    return "\n".join(
        [
            f"### {report['gpu']} — {report['date']}",
            "",
            f"torch {report['torch']}, talker bf16, codec float32, batch 1, random weights at real size, median of {RUNS}. Command: `{report['command']}`",
            "",
            *lines,
            "",
            f"Codes vs eager execution (fp32, 0.6B, 40 frames): {checks}. TTFA, RTF and vocoder rows use the compiled engine.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.bench")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    device = "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        report = {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "command": "python -m pipeline.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "graph_equals_eager_fp32": graph_equals_eager("0.6B", device, workdir),
            "sizes": {},
        }
        print("codes vs eager:", report["graph_equals_eager_fp32"], flush=True)
        for size in args.sizes:
            report["sizes"][size] = bench_size(size, device, workdir)
            print(size, json.dumps(report["sizes"][size]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{report['date']}-{report['gpu'].replace(' ', '_')}"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
