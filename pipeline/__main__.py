"""Command line: `python -m pipeline synth ...` and `python -m pipeline make-tiny ...`."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from pipeline.errors import CheckpointError, TTSInputError

EXIT_BAD_INPUT = 2
EXIT_BAD_CHECKPOINT = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description="Qwen3-TTS synthesis with our own engine.")
    commands = parser.add_subparsers(dest="command", required=True)

    synth = commands.add_parser("synth", help="synthesize speech to a WAV file")
    synth.add_argument("--model", required=True, help="Hugging Face Hub id (e.g. Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice) or local directory")
    synth.add_argument("--text", required=True)
    synth.add_argument("--speaker", help="preset speaker (CustomVoice checkpoints)")
    synth.add_argument("--language", default="auto")
    synth.add_argument("--instruct", help="style instruction (CustomVoice 1.7B) or voice description (VoiceDesign)")
    synth.add_argument("--ref-audio", help="reference recording to clone (Base checkpoints)")
    synth.add_argument("--ref-text", help="transcript of the reference recording (ICL voice clone)")
    synth.add_argument("--x-vector-only", action="store_true", help="clone from the speaker embedding alone, no transcript")
    synth.add_argument("--greedy", action="store_true", help="no sampling, for talker and sub-talker")
    synth.add_argument("--seed", type=int)
    synth.add_argument("--temperature", type=float)
    synth.add_argument("--top-k", type=int)
    synth.add_argument("--top-p", type=float)
    synth.add_argument("--repetition-penalty", type=float)
    synth.add_argument("--subtalker-temperature", type=float)
    synth.add_argument("--subtalker-top-k", type=int)
    synth.add_argument("--subtalker-top-p", type=float)
    synth.add_argument("--max-frames", type=int, help="at most this many 80 ms frames (fewer if the model ends the utterance)")
    synth.add_argument("--device", default="cpu", help="cpu or cuda")
    synth.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    synth.add_argument("--out", required=True, type=Path, help="output WAV file")
    synth.add_argument("--codes-out", type=Path, help="save the generated codes as int64 [frames, 16] .npy")

    tiny = commands.add_parser("make-tiny", help="write a tiny random-weight checkpoint in the official layout")
    tiny.add_argument("--type", required=True, choices=["base", "custom_voice", "voice_design"])
    tiny.add_argument("outdir", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    return parser


def _check_writable(path: Path | None) -> None:
    if path is not None and not path.parent.resolve().is_dir():
        raise TTSInputError(f"Cannot write {path}: the directory {path.parent} does not exist.")


def synth(args: argparse.Namespace) -> None:
    import soundfile as sf

    from pipeline.tts import TTS

    _check_writable(args.out)
    _check_writable(args.codes_out)
    if args.max_frames is not None and args.max_frames < 1:
        raise TTSInputError(f"--max-frames must be at least 1 (got {args.max_frames}).")
    tts = TTS.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    voice_prompt = None
    if args.ref_audio is not None:
        voice_prompt = tts.create_voice_prompt(args.ref_audio, args.ref_text, args.x_vector_only)
    elif tts.model_type == "base":
        raise TTSInputError("This is a Base (voice clone) checkpoint: give --ref-audio (and --ref-text, or --x-vector-only).")
    elif args.ref_text or args.x_vector_only:
        raise TTSInputError("--ref-text and --x-vector-only need --ref-audio, which only Base checkpoints take.")
    sampling = tts.sampling(
        greedy=args.greedy,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        subtalker_temperature=args.subtalker_temperature,
        subtalker_top_k=args.subtalker_top_k,
        subtalker_top_p=args.subtalker_top_p,
    )
    start = time.perf_counter()
    result = tts.synthesize(
        args.text, args.language, args.speaker, args.instruct, voice_prompt, sampling, args.max_frames, args.seed
    )
    wall = time.perf_counter() - start
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    sf.write(args.out, result.audio, result.sample_rate, subtype="FLOAT")
    if args.codes_out is not None:
        np.save(args.codes_out, result.codes.astype(np.int64))
    seconds = len(result.audio) / result.sample_rate
    print(f"frames: {len(result.codes)}  audio: {seconds:.2f} s  wall: {wall:.2f} s  RTF: {wall / seconds:.3f}  -> {args.out}")


def make_tiny(args: argparse.Namespace) -> None:
    from pipeline.tiny import write_tiny_checkpoint

    write_tiny_checkpoint(args.outdir, args.type, args.seed)
    print(f"wrote a tiny random {args.type} checkpoint to {args.outdir}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        synth(args) if args.command == "synth" else make_tiny(args)
    except TTSInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_CHECKPOINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
