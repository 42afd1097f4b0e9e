"""Command line: `python -m pipeline synth ...`, `synth-batch ...`, `chat ...` (Qwen3-Omni) and `make-tiny ...`.

Exit codes: 0 done, 2 bad input (one sentence on stderr, before any work), 3 a checkpoint that
cannot be found or loaded."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import MISSING, dataclass
from pathlib import Path

import numpy as np

from pipeline.contract.events import MAX_REPLY_TOKENS
from pipeline.contract.models import OMNI, SPEECH_TYPES
from pipeline.errors import CheckpointError, TTSInputError
from pipeline.loading import DTYPES, device_dtype
from pipeline.outputs import check_output_dir, check_output_path
from pipeline.request import REQUEST_FIELDS, SpeechRequest, default, load_json

EXIT_BAD_INPUT = 2
EXIT_BAD_CHECKPOINT = 3
REQUEST_OPTIONS = tuple(name for name, spec in REQUEST_FIELDS.items() if spec.cli)  # synth's flags of the request, one per field
FLAG_TYPES = {"number": float, "integer": int}  # what the other kinds' flags take: a string
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
DTYPE_HELP = "weights and activations; bfloat16 needs a GPU of compute capability 8.0 or newer (default %(default)s)"


def _model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face Hub id (e.g. Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice) or local directory (required)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES), help=DTYPE_HELP)


def _request_options(parser: argparse.ArgumentParser) -> None:
    """A flag per request field the CLI takes, its type, help and default from the request's schema."""
    for name in REQUEST_OPTIONS:
        spec, flag = REQUEST_FIELDS[name], f"--{name.replace('_', '-')}"
        if spec.kind == "flag":
            action = "store_true" if default(name) is False else argparse.BooleanOptionalAction  # None: on, off, or the model type's
            parser.add_argument(flag, action=action, help=spec.help)
        else:
            parser.add_argument(flag, type=FLAG_TYPES.get(spec.kind, str), required=default(name) is MISSING, help=spec.help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline", description="Qwen3-TTS synthesis with our own engine.")
    commands = parser.add_subparsers(dest="command", required=True)

    synth = commands.add_parser("synth", help="synthesize speech to a WAV file")
    _model_options(synth)
    _request_options(synth)
    synth.add_argument("--save-voice-prompt", type=Path, help="also save the voice computed from --ref-audio as a .safetensors voice file (default: none)")
    synth.add_argument("--out", required=True, type=Path, help="output audio file (.wav, .flac or .ogg) (required)")
    synth.add_argument("--codes-out", type=Path, help="save the generated codes as int64 [frames, 16] .npy (default: none)")
    synth.add_argument("--timings-out", type=Path, help="save each word's start and end in seconds of the audio, [{word, start, end}] as .json, "
                       "where the text is fed one token per frame (--no-non-streaming-mode, or Base's default) (default: none)")

    batch = commands.add_parser("synth-batch", help="synthesize every request of a JSONL file together, in one engine")
    _model_options(batch)
    batch.add_argument("--requests", required=True, type=Path,
                       help="JSONL: one object per line with a 'name' and synth's options (dashes as underscores) (required)")
    batch.add_argument("--out-dir", required=True, type=Path, help="receives NAME.wav and NAME.codes.npy per request (required)")

    chat = commands.add_parser("chat", help="answer one message with Qwen3-Omni, in text and speech")
    chat.add_argument("--model", required=True, help="Hugging Face Hub id (Qwen/Qwen3-Omni-30B-A3B-Instruct) or local directory (required)")
    chat.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default %(default)s)")
    chat.add_argument("--dtype", default="float32", choices=list(DTYPES), help=DTYPE_HELP)
    chat.add_argument("--text", default="", help="the message (after the audio, if both are given; default: none)")
    chat.add_argument("--audio", type=Path, help="a spoken message (WAV, FLAC, OGG or MP3; default: none)")
    chat.add_argument("--speaker", default="Ethan", help="the voice of the reply (Chelsie, Ethan, Aiden; default %(default)s)")
    chat.add_argument("--system", help="a system prompt (default: none)")
    chat.add_argument("--greedy", action="store_true", help="no sampling: thinker, talker and code predictor greedy (default: off)")
    chat.add_argument("--seed", type=int, help="0..2^32-1; the same seed gives the same reply (default: a new one each time)")
    chat.add_argument("--max-new-tokens", type=int, default=MAX_REPLY_TOKENS, help=f"at most this many reply tokens (default and most: {MAX_REPLY_TOKENS})")
    chat.add_argument("--max-frames", type=int, help="at most this many 80 ms speech frames (default: as many as the reply needs)")
    chat.add_argument("--out", required=True, type=Path, help="the spoken reply (.wav, .flac or .ogg) (required)")
    chat.add_argument("--text-out", type=Path, help="the reply as the tokenizer decodes it, special tokens skipped (.txt; default: none)")
    chat.add_argument("--codes-out", type=Path, help="the talker's codes as int64 [frames, 16] .npy (default: none)")

    tiny = commands.add_parser("make-tiny", help="write a tiny random-weight checkpoint in the official layout")
    tiny.add_argument("--type", required=True, choices=[*SPEECH_TYPES, OMNI.id], help="the checkpoint's model type (required)")
    tiny.add_argument("outdir", type=Path, help="the directory to write (required)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default %(default)s)")
    return parser


def _request(options: dict) -> SpeechRequest:
    return SpeechRequest.from_dict({k: v for k, v in options.items() if v is not None}).validate()


def synth(args: argparse.Namespace) -> None:
    from pipeline.tts import TTS

    request = _request({name: getattr(args, name) for name in REQUEST_OPTIONS} | {"word_timestamps": args.timings_out is not None})
    check_output_path(args.out, "audio")
    if args.codes_out is not None:
        check_output_path(args.codes_out, "codes")
    if args.timings_out is not None:
        check_timings_path(args.timings_out)
    if args.save_voice_prompt is not None:
        if request.ref_audio is None:
            raise TTSInputError("--save-voice-prompt saves the voice computed from --ref-audio: give --ref-audio (with --ref-text or --x-vector-only).")
        check_output_path(args.save_voice_prompt, "voice")
    device_dtype(args.device, args.dtype)
    tts = TTS.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    start = time.perf_counter()
    # Computed here only to be saved; the synthesis uses it as it would have computed it.
    voice = tts.create_voice_prompt(request.ref_audio, request.ref_text, request.x_vector_only) if args.save_voice_prompt else None
    result = tts.synthesize(request, voice)
    wall = time.perf_counter() - start
    write_audio(args.out, result.audio, result.sample_rate, result.warnings)
    if args.codes_out is not None:
        save_codes(args.codes_out, result.codes)
    if args.timings_out is not None:
        args.timings_out.write_text(json.dumps([word.as_dict() for word in result.words], ensure_ascii=False, indent=1), encoding="utf-8")
    if voice is not None:
        tts.save_voice_prompt(voice, args.save_voice_prompt)
    seconds = len(result.audio) / result.sample_rate
    print(f"frames: {len(result.codes)}  audio: {seconds:.2f} s  wall: {wall:.2f} s  RTF: {wall / seconds:.3f}  -> {args.out}")


def write_audio(path: Path, audio: np.ndarray, sample_rate: int, warnings: list[str]) -> None:
    """The result's warnings on stderr, its audio to `path` (float WAV, or the format of the extension)."""
    import soundfile as sf

    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    sf.write(path, audio, sample_rate, subtype="FLOAT" if path.suffix.lower() == ".wav" else None)


def check_timings_path(path: Path) -> None:
    """Raise TTSInputError unless word timings (.json) can be written at `path`."""
    if path.is_dir() or path.suffix.lower() != ".json":
        raise TTSInputError(f"Cannot write word timings to {path}: give a file name ending in .json.")
    check_output_dir(path.parent)
    if path.exists() and not os.access(path, os.W_OK):
        raise TTSInputError(f"Cannot write word timings to {path}: the file exists and is read-only.")


def save_codes(path: Path, codes: np.ndarray) -> None:
    with open(path, "wb") as f:  # through a file object, np.save keeps the name as given
        np.save(f, codes.astype(np.int64))


@dataclass
class BatchLine:
    number: int
    name: str
    request: SpeechRequest | None = None
    error: str | None = None


def read_batch(path: Path) -> list[BatchLine]:
    """Every non-empty line of a JSONL request file, parsed and validated (problems kept per line)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TTSInputError(f"Cannot read the request file {path}: {exc}.") from None
    parsed, names = [], set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        item = BatchLine(number, "?")
        parsed.append(item)
        try:
            data = load_json(line)
        except json.JSONDecodeError as exc:
            item.error = f"not valid JSON ({exc.msg})"
            continue
        except TTSInputError as exc:
            item.error = str(exc)
            continue
        try:
            item.name = _batch_name(data, names)
            options = {k: v for k, v in data.items() if k != "name"}
            for key in (name for name, spec in REQUEST_FIELDS.items() if spec.kind == "file"):
                if isinstance(options.get(key), str) and not Path(options[key]).is_absolute():
                    options[key] = str(path.parent / options[key])  # relative to the request file
            item.request = SpeechRequest.from_dict(options).validate()
            names.add(item.name)
        except TTSInputError as exc:
            item.error = str(exc)
    if not parsed:
        raise TTSInputError(f"The request file {path} has no requests.")
    return parsed


def _batch_name(data, taken: set[str]) -> str:
    name = data.get("name") if isinstance(data, dict) else None
    if not isinstance(name, str) or not SAFE_NAME.match(name):
        raise TTSInputError("every request needs a 'name' made of letters, digits, '.', '_' or '-' (it names the output files)")
    if name in taken:
        raise TTSInputError(f"the name '{name}' is used by an earlier line")
    return name


def synth_batch(args: argparse.Namespace) -> int:
    import soundfile as sf

    from pipeline.tts import TTS

    lines = read_batch(args.requests)
    check_output_dir(args.out_dir)
    device_dtype(args.device, args.dtype)
    tts = TTS.from_pretrained(args.model, device=args.device, dtype=args.dtype, max_queue=len(lines))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    submitted = []
    for line in lines:
        if line.request is None:
            continue
        try:
            handle = tts.submit(line.request)
        except TTSInputError as exc:
            line.error = str(exc)
            continue
        submitted.append((line, handle))
    for line, handle in submitted:
        start = time.perf_counter()
        try:
            chunks = list(handle)
        except Exception as exc:  # one failed request must not lose the others' results
            line.error = f"failed: {exc}"
            continue
        audio = np.concatenate([c.audio for c in chunks])
        sf.write(args.out_dir / f"{line.name}.wav", audio, tts.sample_rate, subtype="FLOAT")
        save_codes(args.out_dir / f"{line.name}.codes.npy", handle.codes.numpy())
        for warning in dict.fromkeys(handle.warnings):
            print(f"warning: line {line.number} ({line.name}): {warning}", file=sys.stderr)
        wall = (time.perf_counter() - handle.submitted) if chunks else time.perf_counter() - start
        print(f"{line.name}: frames {len(handle.codes)}  audio {len(audio) / tts.sample_rate:.2f} s  "
              f"TTFA {chunks[0].elapsed_ms:.0f} ms  wall {wall:.2f} s")
    bad = [line for line in lines if line.error]
    for line in bad:
        print(f"error: line {line.number} ({line.name}): {line.error}", file=sys.stderr)
    return EXIT_BAD_INPUT if bad else 0


def chat(args: argparse.Namespace) -> None:
    from pipeline.audio import load_message_audio
    from pipeline.loading import load_text_tokenizer, resolve_checkpoint
    from pipeline.omni import MAX_AUDIO_SECONDS, ChatRequest, OmniChat, PromptIds, Turn
    from pipeline.omni.chat import REQUIRED_FILES as OMNI_FILES
    from pipeline.omni.chat import read_config as read_omni_config
    from pipeline.omni.conversation import AUDIO_SAMPLE_RATE, check_control_tokens

    for path, kind in ((args.out, "audio"), (args.text_out, "text"), (args.codes_out, "codes")):
        if path is not None:
            check_output_path(path, kind)
    audio = load_message_audio(args.audio, AUDIO_SAMPLE_RATE, MAX_AUDIO_SECONDS) if args.audio is not None else None
    request = ChatRequest([Turn("user", args.text, audio)], system=args.system or "", speaker=args.speaker, greedy=args.greedy, seed=args.seed,
                          max_new_tokens=args.max_new_tokens, max_frames=args.max_frames).validate()
    device_dtype(args.device, args.dtype)
    directory = resolve_checkpoint(args.model, OMNI_FILES)
    # Before the weights load: the speaker from config.json, control tokens in the text from the tokenizer.
    PromptIds.from_config(read_omni_config(directory)).speaker(args.speaker)
    check_control_tokens(load_text_tokenizer(directory), request.turns, request.system)
    model = OmniChat.from_pretrained(str(directory), device=args.device, dtype=args.dtype)
    start = time.perf_counter()
    reply = model.reply(request)
    wall = time.perf_counter() - start
    write_audio(args.out, reply.audio, model.sample_rate, reply.warnings)
    if args.text_out is not None:
        with open(args.text_out, "w", encoding="utf-8", newline="") as f:
            f.write(reply.text)
    if args.codes_out is not None:
        save_codes(args.codes_out, reply.codes)
    print(f"reply: {reply.text!r}\ntokens: {len(reply.tokens)}  frames: {len(reply.codes)}  audio: {len(reply.audio) / model.sample_rate:.2f} s  "
          f"wall: {wall:.2f} s  -> {args.out}")


def make_tiny(args: argparse.Namespace) -> None:
    from pipeline.tiny import write_tiny_checkpoint, write_tiny_omni_checkpoint

    check_output_dir(args.outdir)
    if args.type == OMNI.id:
        write_tiny_omni_checkpoint(args.outdir, args.seed)
    else:
        write_tiny_checkpoint(args.outdir, args.type, args.seed)
    print(f"wrote a tiny random {args.type} checkpoint to {args.outdir}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "synth":
            synth(args)
        elif args.command == "synth-batch":
            return synth_batch(args)
        elif args.command == "chat":
            chat(args)
        else:
            make_tiny(args)
    except TTSInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_CHECKPOINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
