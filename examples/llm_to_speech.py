"""Speak a language model's reply while it is being written.

Streams the reply of any OpenAI-compatible chat server (POST /v1/chat/completions with "stream": true)
into this project's WebSocket /v1/audio/speech/stream, piece by piece as the model writes it, and plays
the audio as it arrives (with the `sounddevice` package; else, or with --out, writes a WAV file).

    python examples/llm_to_speech.py "Tell me a short story." --llm http://localhost:8000 --tts http://localhost:7860

Needs `httpx` and `websockets` (both in requirements.txt).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import wave

SAMPLE_RATE = 24000


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", help="what to ask the language model")
    parser.add_argument("--llm", default="http://localhost:8000", help="base URL of the OpenAI-compatible chat server (default: %(default)s)")
    parser.add_argument("--llm-model", default="default", help="the chat server's model name (default: %(default)s)")
    parser.add_argument("--llm-key", help="the chat server's API key, if it needs one")
    parser.add_argument("--tts", default="http://localhost:7860", help="base URL of this project's app (default: %(default)s)")
    parser.add_argument("--api-key", help="the app's --api-key, if it was started with one")
    parser.add_argument("--task-type", default="CustomVoice", help="CustomVoice, VoiceDesign or Base (default: %(default)s)")
    parser.add_argument("--voice", help="a CustomVoice speaker (GET /v1/models/ID names them)")
    parser.add_argument("--instructions", help="how to speak (VoiceDesign: the voice description)")
    parser.add_argument("--language", default="auto")
    parser.add_argument("--seed", type=int, help="a seed, for the same speech every run")
    parser.add_argument("--max-new-tokens", type=int, help="frames of speech at most (12.5 per second)")
    parser.add_argument("--out", help="write the audio to this WAV file instead of playing it")
    return parser


def session_config(args: argparse.Namespace) -> dict:
    settings = {"task_type": args.task_type, "voice": args.voice, "instructions": args.instructions, "language": args.language,
                "seed": args.seed, "max_new_tokens": args.max_new_tokens}
    return {"type": "session.config", "response_format": "pcm", **{k: v for k, v in settings.items() if v is not None}}


async def reply_pieces(args: argparse.Namespace):
    """The chat server's reply as it is written: the text of each streamed delta."""
    import httpx

    headers = {"Authorization": f"Bearer {args.llm_key}"} if args.llm_key else {}
    body = {"model": args.llm_model, "messages": [{"role": "user", "content": args.prompt}], "stream": True}
    async with httpx.AsyncClient(timeout=None) as client:
        async with client.stream("POST", f"{args.llm.rstrip('/')}/v1/chat/completions", json=body, headers=headers) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                data = line.removeprefix("data:").strip()
                if not line.startswith("data:") or not data:
                    continue
                if data == "[DONE]":
                    return
                choices = json.loads(data).get("choices") or [{}]
                piece = (choices[0].get("delta") or {}).get("content")
                if piece:
                    yield piece


class Sink:
    """Where the audio goes: the sound card as it arrives (sounddevice), or a WAV file."""

    def __init__(self, out: str | None):
        self.player = None if out else _player()
        self.wav = None
        if self.player is None:
            self.wav = wave.open(out or "reply.wav", "wb")
            self.wav.setnchannels(1)
            self.wav.setsampwidth(2)
            self.wav.setframerate(SAMPLE_RATE)
            print(f"writing the audio to {out or 'reply.wav'}", file=sys.stderr)

    def write(self, pcm: bytes) -> None:
        if self.player is not None:
            self.player.write(pcm)
        else:
            self.wav.writeframes(pcm)

    def close(self) -> None:
        if self.player is not None:
            self.player.stop()
            self.player.close()
        if self.wav is not None:
            self.wav.close()


def _player():
    try:
        import sounddevice
    except (ImportError, OSError):  # not installed, or no PortAudio library
        return None
    stream = sounddevice.RawOutputStream(samplerate=SAMPLE_RATE, channels=1, dtype="int16")
    stream.start()
    return stream


async def speak(args: argparse.Namespace) -> int:
    import websockets

    url = args.tts.rstrip("/").replace("http://", "ws://").replace("https://", "wss://") + "/v1/audio/speech/stream"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    sink = Sink(args.out)
    try:
        async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
            await ws.send(json.dumps(session_config(args)))
            listener = asyncio.create_task(listen(ws, sink))
            async for piece in reply_pieces(args):
                print(piece, end="", flush=True)
                await ws.send(json.dumps({"type": "input.text", "text": piece}))
            print()
            await ws.send(json.dumps({"type": "input.done"}))
            return await listener
    finally:
        sink.close()


async def listen(ws, sink: Sink) -> int:
    """Play each audio message as it comes; report the end (0) or the server's error (1)."""
    async for message in ws:
        if isinstance(message, bytes):
            sink.write(message)
            continue
        event = json.loads(message)
        if event["type"] == "error":
            print(f"error: {event['message']}", file=sys.stderr)
            return 1
        if event["type"] == "session.done":
            print(f"{event['audio_seconds']:.1f} s of speech; first audio {event['first_audio_ms']:.0f} ms after the first text", file=sys.stderr)
            for warning in event["warnings"]:
                print(f"warning: {warning}", file=sys.stderr)
            return 0
    print("error: the server closed the connection before the end of the speech", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(speak(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
