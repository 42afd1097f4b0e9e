"""The 12 Hz speech tokenizer: 24 kHz audio <-> 16 codes per 80 ms frame, loaded from the official
`speech_tokenizer/{config.json, model.safetensors}`."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pipeline.codec.config import SpeechTokenizerConfig
from pipeline.codec.decoder import MultiStreamDecoder, SpeechDecoder, StreamingDecoder
from pipeline.codec.encoder import SpeechEncoder
from pipeline.errors import CheckpointError
from pipeline.loading import load_weights, read_json


def _speech_tokenizer_files(directory: Path) -> Path:
    """The folder holding the tokenizer's files: `directory/speech_tokenizer` in a model directory,
    or `directory` itself (the standalone tokenizer repository); each file checked present."""
    root = directory / "speech_tokenizer" if (directory / "speech_tokenizer").is_dir() else directory
    for path in (root / "config.json", root / "model.safetensors"):
        if not path.is_file():
            raise CheckpointError(f"speech tokenizer file missing: {path}")
    return root


def _read_config(root: Path) -> SpeechTokenizerConfig:
    raw = read_json(root, "config.json")  # names the file when it is unreadable or not a JSON object
    try:
        return SpeechTokenizerConfig.from_dict(raw)
    except CheckpointError as e:
        raise CheckpointError(f"{root / 'config.json'}: {e}") from None


class SpeechTokenizer(nn.Module):
    """The 12 Hz speech tokenizer; parameter names are the official checkpoint's."""

    # Offline decode runs through the streaming state in blocks of this many frames: exact (the
    # decoder is causal) and it bounds memory and the attention mask for long audio.
    decode_block_frames = 300

    def __init__(self, config: SpeechTokenizerConfig):
        super().__init__()
        self.config = config
        self.encoder = SpeechEncoder(config.encoder, config.encoder_valid_num_quantizers)
        self.decoder = SpeechDecoder(config.decoder)

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32) -> "SpeechTokenizer":
        """Load `directory/speech_tokenizer/{config.json, model.safetensors}` (a model directory),
        or the same files directly in `directory` (the standalone tokenizer repository).

        A missing, damaged or mismatched file is a CheckpointError naming it."""
        root = _speech_tokenizer_files(Path(directory))
        with torch.device("meta"):
            model = cls(_read_config(root))
        weights = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device)
                   for k, v in load_weights(root).items()}
        try:
            # assign=True: the meta parameters become the loaded tensors; the post-hooks then
            # derive the fused buffers from them in the final dtype.
            model.load_state_dict(weights, strict=True, assign=True)
        except RuntimeError as e:
            raise CheckpointError(f"speech tokenizer weights {root / 'model.safetensors'} do not match the config: {e}") from e
        return model.eval()

    @property
    def device(self) -> torch.device:
        return self.decoder.device

    @torch.no_grad()
    def encode(self, wav: torch.Tensor) -> torch.Tensor:
        """wav: float [samples] at 24 kHz -> codes LongTensor [ceil(samples / 1920), 16] (on the model's device)."""
        dtype = self.encoder.downsample.conv.weight.dtype
        return self.encoder(wav.to(self.device, dtype)[None])[0]

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes: LongTensor [frames, 16] with values in [0, 2048) -> float32 [frames * 1920] in [-1, 1].

        Full causal decode (no windows, unlike the reference beyond 300 frames)."""
        stream = self.stream_decoder()
        chunks = [stream.decode_chunk(c) for c in codes.split(self.decode_block_frames)]
        return torch.cat(chunks) if chunks else torch.zeros(0, device=self.device)

    def stream_decoder(self) -> StreamingDecoder:
        return StreamingDecoder(self.decoder)

    def multi_stream_decoder(self, streams: int, use_cuda_graphs: bool = False, lanes: int = 1, batch_lanes: int = 0,
                             slots: int = 1) -> MultiStreamDecoder:
        return MultiStreamDecoder(self.decoder, streams, use_cuda_graphs, lanes, batch_lanes, slots)
