"""The model types, once: each one's names on every surface (the engine's id, the CLI's name and
aliases, the HTTP API's task type, how vLLM-Omni's model names end, the UI's tab), its official
checkpoints and what a request of it takes (a preset speaker, an instruction, a reference voice).
Every front door asks this registry instead of branching on a type's name."""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelType:
    id: str  # the checkpoint's tts_model_type (config.json), and the service's key
    name: str  # what users type (--models, the listening file's modes) and read (help, banner); also the UI tab's id
    tab: str  # the UI tab's label
    task_type: str  # the HTTP API's task_type (vllm-omni's values for Qwen3-TTS; "Omni" is ours)
    hub_checkpoints: tuple[str, ...]  # the official checkpoints, the tab's default first
    aliases: tuple[str, ...] = ()  # more names --models takes
    vllm_suffix: str = ""  # a regular expression for how a vLLM-Omni model's name ends for this type ("": never served as TTS)
    speech: bool = True  # a Qwen3-TTS type (POST /v1/audio/speech); False: Omni chat
    speaker: bool = False  # takes a preset speaker (and needs one)
    instruct: bool = False  # follows an instruction where its checkpoint does (1.7B CustomVoice: style; VoiceDesign: the voice)
    needs_instruct: bool = False  # the instruction is the voice itself: a request without one is refused
    reference: bool = False  # speaks in a reference recording's voice, or a saved voice
    streams_text: bool = False  # the reference's default: the text fed one token per frame (True) or all in the prompt

    def takes(self, role: str) -> bool:
        """Whether a request of this type uses the request fields of `role` (pipeline.request's roles)."""
        return {"speaker": self.speaker, "instruct": self.instruct, "reference": self.reference}.get(role, True)

    def names(self) -> tuple[str, ...]:
        return (self.name, self.id, *self.aliases)


BASE = ModelType("base", "clone", "Voice clone", "Base", ("Qwen/Qwen3-TTS-12Hz-0.6B-Base", "Qwen/Qwen3-TTS-12Hz-1.7B-Base"),
                 aliases=("voice_clone",), vllm_suffix=r"base", reference=True, streams_text=True)
CUSTOM_VOICE = ModelType("custom_voice", "custom", "Custom voice", "CustomVoice",
                         ("Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice", "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"),
                         vllm_suffix=r"custom[-_.]?voice", speaker=True, instruct=True)
VOICE_DESIGN = ModelType("voice_design", "design", "Voice design", "VoiceDesign", ("Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign",),
                         vllm_suffix=r"voice[-_.]?design", instruct=True, needs_instruct=True)
OMNI = ModelType("omni", "omni", "Omni chat", "Omni", ("Qwen/Qwen3-Omni-30B-A3B-Instruct",), speech=False)

MODEL_TYPES: dict[str, ModelType] = {t.id: t for t in (BASE, CUSTOM_VOICE, VOICE_DESIGN, OMNI)}  # the UI's tab order is clone, custom, design, omni
SPEECH_TYPES = tuple(t.id for t in MODEL_TYPES.values() if t.speech)  # the released Qwen3-TTS 12 Hz model types
_BY_NAME = {name: t for t in MODEL_TYPES.values() for name in t.names()}
_BY_TASK = {t.task_type: t for t in MODEL_TYPES.values()}


def model_type(type_id: str) -> ModelType:
    """The registry's entry of a model type id (KeyError for any other)."""
    return MODEL_TYPES[type_id]


def by_name(name: str) -> ModelType | None:
    """The model type a user's name, alias or id stands for (case-insensitive); None if none does."""
    return _BY_NAME.get(name.strip().lower())


def by_task(task_type: str) -> ModelType | None:
    """The model type of an HTTP API task_type; None if none has it."""
    return _BY_TASK.get(task_type)


def by_vllm_name(name: str) -> ModelType | None:
    """The Qwen3-TTS type a vLLM-Omni model's name ends with (as vLLM-Omni's adapter reads it); Omni by its name."""
    last = name.rstrip("/").split("/")[-1].lower()
    if "qwen3-omni" in last:
        return OMNI
    return next((t for t in MODEL_TYPES.values() if t.vllm_suffix and re.search(f"({t.vllm_suffix})$", last)), None)


def parse_models(specs: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """--models: ['clone=Qwen/...-1.7B-Base', 'custom=a,b'] -> checkpoint choices per model type (first = default)."""
    choices: dict[str, tuple[str, ...]] = {}
    for spec in specs:
        name, sep, sources = spec.partition("=")
        kind = by_name(name)
        names = tuple(s.strip() for s in sources.split(",") if s.strip())
        if not sep or kind is None or not names:
            raise ValueError(
                f"--models takes TYPE=CHECKPOINT[,CHECKPOINT...] with TYPE one of {', '.join(t.name for t in MODEL_TYPES.values())} "
                f"(or {', '.join(t.id for t in MODEL_TYPES.values() if t.id != t.name)}), not '{spec}'."
            )
        choices[kind.id] = names
    return choices
