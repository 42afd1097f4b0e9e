"""A chat as the thinker reads it: turns laid out in Qwen3-Omni's chat format, audio messages as
log-mel features with their placeholder tokens, the oldest turns dropped when the context is full.

The layout is the official chat template's for text and audio: `<|im_start|>{role}\\n`, a user
turn's audio first (`<|audio_start|><|audio_pad|><|audio_end|>`), then its text, `<|im_end|>\\n`;
the prompt ends with `<|im_start|>assistant\\n`. As transformers' processor does, each
`<|audio_pad|>` becomes as many as the audio encoder makes positions. (The processor itself is not
used: it imports torchvision for its video part, which this app has no use for.)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pipeline.contract.events import MAX_AUDIO_SECONDS as MAX_AUDIO_SECONDS  # per audio message; pipeline.omni imports it from here
from pipeline.errors import TTSInputError

AUDIO_SAMPLE_RATE = 16000  # the audio encoder's feature extractor
AUDIO_START, AUDIO_PAD, AUDIO_END = "<|audio_start|>", "<|audio_pad|>", "<|audio_end|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
N_WINDOW = 50  # the audio encoder's window (mel frames per half chunk), as the processor's default


@dataclass
class Turn:
    """One message: a user turn (text, audio or both) or an earlier reply of the assistant."""

    role: str  # "user" or "assistant"
    text: str = ""
    audio: np.ndarray | str | Path | None = None  # float32 mono at 16 kHz, or an audio file (user turns)

    def __post_init__(self) -> None:
        if self.role not in ("user", "assistant"):
            raise TTSInputError(f"A turn is from 'user' or 'assistant', not {self.role!r}.")


@dataclass
class ThinkerInputs:
    input_ids: torch.Tensor  # [1, L]
    features: dict[str, torch.Tensor] = field(default_factory=dict)  # input_features, feature_attention_mask
    dropped_turns: int = 0  # oldest turns left out to fit the context


def audio_positions(mel_frames: int) -> int:
    """Positions the audio encoder makes of `mel_frames` log-mel frames (transformers' formula)."""
    chunk = N_WINDOW * 2
    rest = mel_frames % chunk
    lengths = (rest - 1) // 2 + 1
    return ((lengths - 1) // 2 + 1 - 1) // 2 + 1 + (mel_frames // chunk) * 13


def check_turns(turns: list[Turn]) -> None:
    """The conversation must end with a user message that says something."""
    if not turns or turns[-1].role != "user":
        raise TTSInputError("The conversation must end with a user message.")
    last = turns[-1]
    if not last.text.strip() and last.audio is None:
        raise TTSInputError("The message is empty: type something or record / upload audio.")


def layout(turns: list[Turn], system: str) -> str:
    """The chat-format text of a conversation, with one `<|audio_pad|>` per audio message."""
    return _frame(system) + "".join(_turn_text(turn) for turn in turns) + f"{IM_START}assistant\n"


def _frame(system: str) -> str:
    return f"{IM_START}system\n{system}{IM_END}\n" if system.strip() else ""


def _turn_text(turn: Turn) -> str:
    audio = f"{AUDIO_START}{AUDIO_PAD}{AUDIO_END}" if turn.audio is not None else ""
    return f"{IM_START}{turn.role}\n{audio}{turn.text}{IM_END}\n"


def build_inputs(tokenizer, feature_extractor, turns: list[Turn], system: str, max_prompt: int) -> ThinkerInputs:
    """Token ids and audio features of the conversation; drops the oldest turns (a user turn with the
    replies after it) while the prompt is longer than `max_prompt` positions."""
    check_turns(turns)
    check_control_tokens(tokenizer, turns, system)
    first = _first_kept(tokenizer, feature_extractor, turns, system, max_prompt)
    inputs = _encode(tokenizer, feature_extractor, turns[first:], system)
    inputs.dropped_turns = first
    return inputs


def _first_kept(tokenizer, feature_extractor, turns: list[Turn], system: str, max_prompt: int) -> int:
    """The first turn of the longest tail of the conversation that fits `max_prompt` and starts the
    conversation or at a user turn. Turns are measured newest first, each once, until one does not
    fit: a long history costs what is kept, not (turns x dropped) tokenizations. Every turn starts
    and ends with a special token, which the tokenizer never merges across, so the lengths add up."""
    length = _length(tokenizer, _frame(system) + f"{IM_START}assistant\n")
    first = len(turns)
    for index in range(len(turns) - 1, -1, -1):
        length += _turn_length(tokenizer, feature_extractor, turns[index])
        if length > max_prompt:
            break
        if index == 0 or turns[index].role == "user":
            first = index
    if first == len(turns):  # the message (the last turn, a user's) is too long on its own
        raise TTSInputError(f"The message is {length} tokens long with the system prompt; the model takes at most {max_prompt}. Send a shorter message.")
    return first


def _length(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _turn_length(tokenizer, feature_extractor, turn: Turn) -> int:
    """Positions of one turn in the prompt: its tokens, its one `<|audio_pad|>` counted as the encoder's positions."""
    if turn.audio is None:
        return _length(tokenizer, _turn_text(turn))
    mask = feature_extractor([turn.audio], sampling_rate=AUDIO_SAMPLE_RATE, padding=True, truncation=False, return_attention_mask=True,
                             return_tensors="pt")["attention_mask"]
    return _length(tokenizer, _turn_text(turn)) - 1 + audio_positions(int(mask.sum()))


def check_control_tokens(tokenizer, turns: list[Turn], system: str) -> None:
    # Typed control tokens would be read as structure: a turn ending early, an audio placeholder.
    specials = [t for t in tokenizer.all_special_tokens if t.startswith("<|")]
    for text in [system] + [turn.text for turn in turns]:
        found = next((t for t in specials if t in text), None)
        if found:
            raise TTSInputError(f"Messages and the system prompt may not contain the control token {found}.")


def _encode(tokenizer, feature_extractor, turns: list[Turn], system: str) -> ThinkerInputs:
    text = layout(turns, system)
    audios = [turn.audio for turn in turns if turn.audio is not None]
    features: dict[str, torch.Tensor] = {}
    if audios:
        extracted = feature_extractor(audios, sampling_rate=AUDIO_SAMPLE_RATE, padding=True, truncation=False,
                                      return_attention_mask=True, return_tensors="pt")
        mask = extracted["attention_mask"]
        features = {"input_features": extracted["input_features"], "feature_attention_mask": mask}
        pieces = text.split(AUDIO_PAD)
        text = pieces[0] + "".join(AUDIO_PAD * audio_positions(int(n)) + piece for n, piece in zip(mask.sum(-1), pieces[1:]))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ThinkerInputs(torch.tensor([ids]), features)
