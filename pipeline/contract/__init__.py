"""The contract at the pipeline's edges, importing neither torch nor gradio: what the front doors (the
UI's tabs, the HTTP server, the listening renderer) ask of the models behind them, the `Service`
protocol, which `pipeline.service.ModelService` (models in this process) and
`pipeline.remote.RemoteService` (another server's, over HTTP) both implement.

events.py: the records a stream yields and the audio constants. models.py: the model-type registry.
running.py: what both services do alike without a model. The request schema is `pipeline.request`."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from pipeline.contract.events import ChatEnd, Chunk, Fallback, ModelInfo, Queued, StreamEnd, StreamStart, TextDelta, VoiceInfo, Waiting

if TYPE_CHECKING:
    from pipeline.omni import ChatRequest
    from pipeline.request import SpeechRequest


@runtime_checkable
class Service(Protocol):
    """Checkpoints per model type, their loading, speech and chat streams, Stop, and cloned voices."""

    choices: Mapping[str, tuple[str, ...]]  # model type -> its checkpoints, the default first
    fallbacks: Mapping[str, Fallback]  # checkpoints that could not be had -> why, and what serves instead

    def default_checkpoint(self, model_type: str) -> str: ...

    def random_weights(self, model_type: str, checkpoint: str | None = None) -> bool:
        """Whether the checkpoint's weights are random (its audio is noise)."""

    def stand_in(self, model_type: str, checkpoint: str | None = None) -> str | None:
        """What serves in the checkpoint's place (None: the checkpoint itself)."""

    def is_loaded(self, model_type: str, checkpoint: str | None = None) -> bool:
        """Whether its first use will be quick."""

    def load_progress(self, model_type: str, checkpoint: str | None = None) -> tuple[int, int] | None:
        """While it loads: (CUDA graphs captured, graphs in all); None where that is not known."""

    def info(self, model_type: str, checkpoint: str | None = None) -> ModelInfo:
        """Load it if needed and describe it (speakers, languages, instructions)."""

    def stream(self, request: SpeechRequest, key: str = "") -> Iterator[StreamStart | Queued | Chunk | StreamEnd | Waiting]:
        """Speech for `request`, chunk by chunk; `key` names the run for `stop`."""

    def chat(self, request: ChatRequest, checkpoint: str | None = None, key: str = "") -> Iterator[StreamStart | TextDelta | Queued | Chunk | ChatEnd | StreamEnd | Waiting]:
        """An Omni chat turn: the reply's text deltas and its speech."""

    def stop(self, key: str = "") -> bool:
        """Stop the run of `key`; whether one was running."""

    def prepare_voice(self, checkpoint: str | None, ref_audio: str | Path | None, ref_text: str | None, x_vector_only: bool) -> bool:
        """Make the voice prompt of a reference recording ready; whether it had to be made."""

    def export_voice(self, checkpoint: str | None, ref_audio: str | Path, ref_text: str | None, x_vector_only: bool) -> Path | None:
        """The cloned voice as a file (None where the service cannot write one)."""

    def load_voice_file(self, checkpoint: str | None, path: str | Path) -> VoiceInfo:
        """Check a saved voice file against the checkpoint and load it; what it holds."""
