"""Qwen3-TTS and Qwen3-Omni streaming demo: `python app.py` (also the Hugging Face Spaces entry point)."""
from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING

from pipeline.contract.models import MODEL_TYPES, parse_models
from pipeline.errors import TTSInputError
from pipeline.listening import Sessions
from pipeline.remote import RemoteService
from pipeline.server import Access
from ui.app import build_demo, launch_options

if TYPE_CHECKING:  # the local models' service imports torch: `--backend URL` runs without it
    from pipeline.service import ModelService

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
LOCAL_MODEL_FLAGS = ("device", "dtype", "models", "tiny", "rows", "no_compile", "no_fused_kernels")  # what --backend replaces


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


ZERO_GPU_REFUSED = (
    "ZeroGPU Spaces are not supported: the engine keeps its CUDA graphs, caches and scheduler threads from one request to "
    "the next, which ZeroGPU's GPU, lent to one function call at a time in a worker process, does not allow; choose a "
    "dedicated GPU (an L4 or larger) in the Space's settings, or serve the UI only with --backend URL."
)


def on_zero_gpu() -> bool:
    # Hugging Face sets this on ZeroGPU Spaces.
    return os.environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Streaming Qwen3-TTS and Qwen3-Omni demo: voice clone, custom voice, voice design and Omni chat.")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"), help="interface to listen on (env GRADIO_SERVER_NAME; default %(default)s)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")), help="port (env GRADIO_SERVER_PORT; default %(default)s)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", default=None,
                        help="weights and activations: float32, bfloat16 or float16 (default: bfloat16 on GPUs of compute capability 8.0 or newer, "
                        "float16 on older ones such as a T4, float32 on cpu)")
    parser.add_argument(
        "--models",
        nargs="+",
        default=[],
        metavar="TYPE=CHECKPOINT[,CHECKPOINT]",
        help=f"checkpoints per tab, the first the default: Hub ids, local directories or 'tiny'; TYPE is {', '.join(t.name for t in MODEL_TYPES.values())} "
        "(e.g. --models clone=Qwen/Qwen3-TTS-12Hz-1.7B-Base custom=Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice,Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice; "
        "default: the official checkpoints of every tab)",
    )
    parser.add_argument("--tiny", action="store_true", help="serve the built-in tiny random checkpoints (noise; for trying the UI offline; default: off)")
    parser.add_argument(
        "--rows", type=int, default=None,
        help="utterances each model decodes together (its batch; default on CUDA: as many as the GPU's free memory holds, at most 16 for "
        "Qwen3-TTS (8 on a card under 40 GiB) and 8 for Qwen3-Omni; 4 and 2 on CPU); more wait in a FIFO queue",
    )
    parser.add_argument("--sessions", default="listening", help="folder of the listening sessions: their files, clips and votes (SQLite) (default %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get("QWEN_TTS_API_KEY"),
                        help="key of the HTTP API (/v1/...: speech and Omni chat), sent as 'Authorization: Bearer KEY' (env QWEN_TTS_API_KEY); "
                        "without one the API answers only when the server listens on localhost (default: none)")
    parser.add_argument("--backend", default=None, metavar="URL",
                        help="generate on the server at URL instead of in this process: another instance of this app, or vLLM-Omni "
                        "(vllm serve ... --omni); the tabs are those of the models it serves (default: none, the models run here)")
    parser.add_argument("--backend-key", default=os.environ.get("QWEN_TTS_BACKEND_KEY"),
                        help="API key of the --backend server, sent as 'Authorization: Bearer KEY' (env QWEN_TTS_BACKEND_KEY; default: none)")
    parser.add_argument("--share", action="store_true", help="also serve on a public gradio.live link (default: off)")
    parser.add_argument(
        "--no-compile", action="store_true",
        help="on CUDA, skip torch.compile of Omni's talker step and prefill, and, with --no-fused-kernels, of the TTS prefill and the "
        "decode step's sampling and code embeddings (with the fused kernels a TTS model compiles none of them; faster start, slower "
        "prefill; default: compiled)"
    )
    parser.add_argument(
        "--no-fused-kernels", action="store_true", help="on CUDA, run the decode step's transformer layers as PyTorch modules (compiled unless "
        "--no-compile) instead of the fused Triton kernels (default: fused, on GPUs of compute capability 8.0 or newer)"
    )
    return parser


def local_service(args: argparse.Namespace, parser: argparse.ArgumentParser, free_memory: int | None = None) -> ModelService:
    """The models of this process. `free_memory`: the bytes their rows are planned against (None: the
    GPU's free memory; see ModelService); --rows that do not fit stop the app with exit code 2 and the reason."""
    from pipeline.loading import device_dtype
    from pipeline.service import ModelService

    try:
        choices = parse_models(args.models)
    except ValueError as exc:
        parser.error(str(exc))
    if args.rows is not None and not 1 <= args.rows <= 256:
        parser.error(f"--rows takes a number from 1 to 256, not {args.rows}.")
    if on_zero_gpu():  # checked before torch touches CUDA, which ZeroGPU forbids in the main process
        parser.exit(2, f"{parser.prog}: {ZERO_GPU_REFUSED}\n")
    device = args.device or default_device()
    try:
        dtype = device_dtype(device, args.dtype)
    except TTSInputError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")
    logging.getLogger("app").info(dtype.sentence)
    compiled = device.startswith("cuda") and not args.no_compile
    service = ModelService(choices, device=device, dtype=dtype.name, tiny=args.tiny, compiled=compiled, rows=args.rows,
                           fused=False if args.no_fused_kernels else None, free_memory=free_memory)
    service.probe()
    try:
        service.check_rows()
    except TTSInputError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")
    return service


def remote_service(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RemoteService:
    """The backend's service; a backend that cannot be reached, refuses the key or serves nothing usable
    stops the app with exit code 2 and the reason: its tabs are made from what the backend serves."""
    local = [f"--{name.replace('_', '-')}" for name in LOCAL_MODEL_FLAGS if getattr(args, name) != parser.get_default(name)]
    if local:
        parser.error(f"{', '.join(local)} configure models in this process; with --backend the backend's models serve.")
    try:
        return RemoteService(args.backend, args.backend_key)
    except TTSInputError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    service = remote_service(args, parser) if args.backend else local_service(args, parser)
    demo = build_demo(service, Sessions(args.sessions, service))
    demo.queue(default_concurrency_limit=None)
    access = Access(key=args.api_key, public=args.share or args.host not in LOCAL_HOSTS)
    # Over a backend the speech API is the backend's: this server serves the UI only.
    api = None if isinstance(service, RemoteService) else service
    demo.launch(server_name=args.host, server_port=args.port, share=args.share, **launch_options(api, access))


if __name__ == "__main__":
    main()
