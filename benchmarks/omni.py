"""GPU benchmark of Omni chat at the real Qwen3-Omni-30B-A3B size, random weights:
`python -m benchmarks.omni`.

Weight values do not change speed, so the model is built in GPU memory from the released
config.json's structure (no 70 GB checkpoint to write). A random thinker rarely writes
<|im_end|> and a random talker rarely ends its speech, so every reply runs to the token and frame
limits given.

Measures, after Send: time to the first text token and to the first audio, for a short text
message and a 5 s audio message; talker + code predictor ms per frame (GPU time of the engine's
decode step); thinker ms per token; the gaps between audio chunks against the audio already
buffered (a stall is playback running dry); then `--together` conversations at once (released
together, each a row of the thinker's batched step), each reported: first text token, first audio,
thinker ms per token, stalls; with the p95 of first audio over them. Writes JSON and markdown (GPU,
torch, transformers, date and command next to the numbers).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.speed import report_header, write_report
from pipeline.contract.events import DEFAULT_SYSTEM_PROMPT
from pipeline.engine import Chunk
from pipeline.omni import ChatEnd, ChatRequest, Code2Wav, Code2WavConfig, OmniChat, OmniTalker, OmniTalkerConfig, PromptIds, TextDelta, Turn
from pipeline.omni.chat import DEFAULT_ROWS, THINKER_MAX_SEQ
from pipeline.omni.thinker import Thinker
from pipeline.released import RELEASED_CONFIG
from pipeline.tiny import OMNI_FEATURE_EXTRACTOR, randomize_, randomize_code2wav_, write_tiny_omni_tokenizer

SHORT_MESSAGE = "Hi! Could you tell me, in one or two sentences, what the weather is usually like in Lisbon in spring?"
SPEECH_S = 0.08
# Merges enough for the benchmark's prompts to be one token per word (and punctuation mark), as the released
# tokenizer encodes such common English: the short message with the default system prompt is then about as
# many positions as with the released files (not available here). `--spelt-prompts` leaves them spelt out.
WORD_MERGES = 4000


@torch.no_grad()
def random_omni(workdir: Path, dtype: torch.dtype, rows: int, compiled: bool, pack_tokens: int | None = None,
                seed: int = 0, words: str = "") -> tuple[OmniChat, dict[str, float]]:
    """The real-size Qwen3-Omni with seeded random weights, in GPU memory; and the GiB allocated for the
    weights and, after, for the caches and graphs the chat builds (the GPU's memory plan). The words of
    `words` are one token each; others are spelt out in pieces."""
    from transformers import AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration

    device = torch.device("cuda")
    g = torch.Generator(device).manual_seed(seed)
    write_tiny_omni_tokenizer(workdir, merges=WORD_MERGES if words else 300, words=words)  # Qwen3-Omni's special-token ids
    ids = {**RELEASED_CONFIG}
    ids["system_token_id"], ids["user_token_id"], ids["assistant_token_id"] = (
        AutoTokenizer.from_pretrained(str(workdir)).convert_tokens_to_ids(["system", "user", "assistant"]))
    ids["thinker_config"] = {**ids["thinker_config"], "user_token_id": ids["user_token_id"]}
    thinker_config = Qwen3OmniMoeThinkerConfig(**ids["thinker_config"])
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            thinker_model = Qwen3OmniMoeThinkerForConditionalGeneration(thinker_config)
            talker = OmniTalker(OmniTalkerConfig.from_dict(ids["talker_config"]))
    finally:
        torch.set_default_dtype(default_dtype)
    randomize_(thinker_model, g, buffers=False)
    randomize_(talker, g, buffers=False)
    with device:
        code2wav = Code2Wav(Code2WavConfig.from_dict(ids["code2wav_config"]))
    randomize_code2wav_(code2wav, g)
    # A random talker would end its speech at a random frame: keep EOS out of reach.
    talker.codec_head.weight[ids["talker_config"]["codec_eos_token_id"]].zero_()
    thinker = Thinker(thinker_model.eval(), ids["talker_config"]["accept_hidden_layer"], rows=rows, max_len=THINKER_MAX_SEQ, pack_tokens=pack_tokens)
    weights = gib(torch.cuda.memory_allocated())  # the thinker's row caches are small beside them; the vision encoder is dropped
    tokenizer = AutoTokenizer.from_pretrained(str(workdir))
    features = WhisperFeatureExtractor(**{k: v for k, v in OMNI_FEATURE_EXTRACTOR.items() if k != "feature_extractor_type"})
    chat = OmniChat(thinker, tokenizer, features, talker.eval(), code2wav.eval(), PromptIds.from_config(ids), {}, "random Qwen3-Omni-30B-A3B",
                    rows=rows, vocoder_lanes=3, compiled=compiled)
    ready = gib(torch.cuda.memory_allocated())
    return chat, {"weights_and_thinker_caches_gib": weights, "engine_and_graphs_gib": ready - weights, "ready_gib": ready,
                  "ready_reserved_gib": gib(torch.cuda.memory_reserved()), "card_gib": gib(torch.cuda.get_device_properties(0).total_memory)}


def gib(size: int) -> float:
    return round(size / 2**30, 2)


def spoken_message(seconds: float, seed: int = 0) -> np.ndarray:
    """A voice-like 16 kHz signal (a gliding harmonic series with a syllable-rate envelope)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    phase = 2 * np.pi * np.cumsum(140 + 30 * np.sin(2 * np.pi * 0.7 * t)) / 16000
    wave = sum(np.sin(k * phase) / k for k in range(1, 8)) * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2)
    return (0.2 * wave + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


def converse(chat: OmniChat, request: ChatRequest) -> dict:
    """One reply through `OmniChat.stream`, timed on the host as a listener sees it."""
    arrivals, audio_s, generate_ms, frames = [], [], [], []
    first_text = end = None
    for event in chat.stream(request):
        if isinstance(event, TextDelta) and first_text is None:
            first_text = event.elapsed_ms
        elif isinstance(event, Chunk):
            arrivals.append(event.elapsed_ms)
            audio_s.append(len(event.audio) / 24000)
            generate_ms.append(event.generate_ms)
            frames.append(event.frames)
        elif isinstance(event, ChatEnd):
            end = event
    steady = [(ms, n) for i, (ms, n) in enumerate(zip(generate_ms, frames)) if i > 0]
    # Playback starts with the first chunk; a stall is a chunk arriving after the audio before it has played out.
    buffered = np.cumsum(audio_s)
    underrun = [arrivals[i] - arrivals[0] - buffered[i - 1] * 1000 for i in range(1, len(arrivals))]
    gaps = np.diff(arrivals) if len(arrivals) > 1 else np.zeros(1)
    return {
        "first_text_ms": first_text,
        "first_audio_ms": arrivals[0] if arrivals else None,
        "talker_frame_ms": sum(ms for ms, _ in steady) / max(1, sum(n for _, n in steady)),
        "thinker_ms_per_token": end.thinker_ms_per_token,
        "tokens": len(end.tokens),
        "frames": int(sum(frames)),
        "gap_p95_ms": float(np.percentile(gaps, 95)),
        "worst_underrun_ms": float(max(underrun)) if underrun else 0.0,
        "stalls": int(sum(u > 0 for u in underrun)),
        # Where each stall came: the audio received before the late chunk (one frame before the second chunk).
        "stalls_after_audio_s": [round(float(buffered[i - 1]), 2) for i, u in enumerate(underrun, 1) if u > 0],
    }


def median_run(chat: OmniChat, make_request, repeats: int) -> dict:
    runs = [converse(chat, make_request(seed)) for seed in range(repeats)]
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {"stalls_total": sum(r["stalls"] for r in runs), "runs": repeats}


def together(chat: OmniChat, make_request, conversations: int) -> dict:
    """`conversations` replies released at once; each one's figures, and the p95 of first audio over them."""
    results: list[dict] = [None] * conversations

    def one(i: int) -> None:
        results[i] = converse(chat, make_request(100 + i))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first_audio = [r["first_audio_ms"] for r in results]
    return {"conversations": conversations, "first_audio_p95_ms": float(np.percentile(first_audio, 95)),
            "talker_frame_ms": statistics.median(r["talker_frame_ms"] for r in results),
            "thinker_ms_per_token": statistics.median(r["thinker_ms_per_token"] for r in results),
            "gap_p95_ms": max(r["gap_p95_ms"] for r in results), "stalls": sum(r["stalls"] for r in results),
            "worst_underrun_ms": max(r["worst_underrun_ms"] for r in results), "each": results}


def write_trace(chat: OmniChat, request: ChatRequest, path: Path) -> None:
    """Where one reply's time goes, thread by thread (open in Perfetto or chrome://tracing)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        converse(chat, request)
    trace.export_chrome_trace(str(path))
    print(trace.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)


def markdown(report: dict) -> str:
    lines = [f"### Omni chat, random Qwen3-Omni-30B-A3B weights ({report['gpu']}, torch {report['torch']}, transformers {report['transformers']}, "
             f"{report['date']})", "", f"Command: `{report['command']}`; {report['rows']} talker rows, bf16 thinker and talker, fp32 code2wav, "
             f"talker step {'compiled' if report['compiled'] else 'a plain CUDA graph'}, thinker step and packs of {report['pack_tokens']} "
             f"prompt positions CUDA graphs; "
             f"median of {report['repeats']} replies of {report['tokens']} tokens / {report['frames']} frames; "
             f"the short text message with the system prompt is {report['short_text_positions']} prompt positions.", "",
             "| message | first text token (ms) | first audio (ms) | talker frame (ms) | thinker token (ms) | p95 chunk gap (ms) | stalls |",
             "|---|---|---|---|---|---|---|"]
    for name, r in report["single"].items():
        lines.append(f"| {name} | {r['first_text_ms']:.0f} | {r['first_audio_ms']:.0f} | {r['talker_frame_ms']:.2f} | {r['thinker_ms_per_token']:.1f} | "
                     f"{r['gap_p95_ms']:.0f} | {r['stalls_total']} |")
    for t in report["together"]:
        lines += ["", f"{t['conversations']} conversations at once (short text): p95 first audio {t['first_audio_p95_ms']:.0f} ms; "
                  f"talker frame {t['talker_frame_ms']:.2f} ms; thinker token {t['thinker_ms_per_token']:.1f} ms (median); p95 chunk gap {t['gap_p95_ms']:.0f} ms; "
                  f"{t['stalls']} stalls (worst underrun {t['worst_underrun_ms']:.0f} ms).", "",
                  "| conversation | first text token (ms) | first audio (ms) | thinker token (ms) | stalls |", "|---|---|---|---|---|"]
        for i, r in enumerate(t["each"], 1):
            lines.append(f"| {i} | {r['first_text_ms']:.0f} | {r['first_audio_ms']:.0f} | {r['thinker_ms_per_token']:.1f} | {r['stalls']} |")
    lines.append("")
    m = report["memory"]
    lines += [f"GPU memory (GiB, card {m['card_gib']}): weights and thinker row caches {m['weights_and_thinker_caches_gib']}, "
              f"engine caches and graphs {m['engine_and_graphs_gib']}, ready {m['ready_gib']} allocated / {m['ready_reserved_gib']} reserved; "
              f"peak {m['peak_allocated_gib']} allocated / {m['peak_reserved_gib']} reserved.", "", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import transformers

    parser = argparse.ArgumentParser(prog="python -m benchmarks.omni")
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS["cuda"], help="talker rows and thinker rows (conversations at once; the app's default)")
    parser.add_argument("--tokens", type=int, default=40, help="reply tokens")
    parser.add_argument("--frames", type=int, default=60, help="speech frames per reply (60 = 4.8 s)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--together", type=int, nargs="+", default=[4], help="conversations released at once (one run per count)")
    parser.add_argument("--pack-tokens", type=int, default=None, help="prompt positions per thinker pack (default the thinker's)")
    parser.add_argument("--spelt-prompts", action="store_true",
                        help="prompts spelt out in pieces of a few letters (about 3x the positions of whole words)")
    parser.add_argument("--no-compile", action="store_true", help="the talker's decode step as a plain CUDA graph, not torch.compile'd (as the app's --no-compile)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--trace", type=Path, default=None, help="also write a torch.profiler trace (.json.gz) of one reply here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        words = "" if args.spelt_prompts else f"{DEFAULT_SYSTEM_PROMPT} {SHORT_MESSAGE}"
        chat, memory = random_omni(Path(tmp), torch.bfloat16, args.rows, compiled=not args.no_compile, pack_tokens=args.pack_tokens, words=words)
        print(f"built in {time.perf_counter() - t0:.0f} s, memory {json.dumps(memory)}", flush=True)
        audio = spoken_message(5.0)
        requests = {
            "short text": lambda seed: ChatRequest([Turn("user", SHORT_MESSAGE)], max_new_tokens=args.tokens, max_frames=args.frames, seed=seed),
            "5 s audio": lambda seed: ChatRequest([Turn("user", "", audio)], max_new_tokens=args.tokens, max_frames=args.frames, seed=seed),
        }
        for warm_up in requests.values():  # allocator, cuBLAS handles, first-call paths (the audio encoder's too)
            converse(chat, warm_up(99))
        report = {
            **report_header("benchmarks.omni", argv), "transformers": transformers.__version__,
            "rows": args.rows, "compiled": not args.no_compile, "tokens": args.tokens, "frames": args.frames, "repeats": args.repeats, "pack_tokens": chat.thinker.pack_tokens,
            "short_text_positions": chat.prepare(requests["short text"](0)).inputs.input_ids.shape[1],
            "memory": memory,
            "single": {name: median_run(chat, make, args.repeats) for name, make in requests.items()},
        }
        print(json.dumps(report["single"]), flush=True)
        report["together"] = [together(chat, requests["short text"], count) for count in args.together]
        print(json.dumps(report["together"]), flush=True)
        if args.trace is not None:
            write_trace(chat, requests["short text"](7), args.trace)
        report["memory"] |= {"peak_allocated_gib": gib(torch.cuda.max_memory_allocated()), "peak_reserved_gib": gib(torch.cuda.max_memory_reserved())}
    write_report(args.out, "omni", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
