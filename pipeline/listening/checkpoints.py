"""Which of the app's checkpoints renders each system of a session, and the checks of a session that
need those checkpoints: with the file's own checks (`parse_session`), the one validation that the
organizer's Check runs and Save runs before it stores and renders (`Sessions.check`).

An app run with --tiny serves only the tiny random checkpoint of each type; there a system naming an
official Hub checkpoint of that type is rendered by the tiny one (as every tab of such an app
renders), so the sample session and any session written for the real models run there, as noise."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from pipeline.audio import load_reference_audio
from pipeline.contract import Service
from pipeline.contract.events import TINY
from pipeline.contract.models import MODEL_TYPES
from pipeline.errors import TTSInputError
from pipeline.listening.session import MODES, Session, SessionError, System, excerpt

Choices = Mapping[str, Sequence[str]]  # the checkpoints the app serves per model type (a service's `choices`)


def served_choices(service: Service | None) -> Choices | None:
    """The checkpoints the rendering service serves; None without one."""
    return None if service is None else service.choices


def served_checkpoint(choices: Choices, model_type: str, checkpoint: str) -> str | None:
    """The app's checkpoint that renders `checkpoint`: itself where the app serves it; the tiny one
    for an official Hub checkpoint of a type the app serves only the tiny one of; None otherwise."""
    served = tuple(choices.get(model_type, ()))
    if checkpoint in served:
        return checkpoint
    if served == (TINY,) and checkpoint in MODEL_TYPES[model_type].hub_checkpoints:
        return TINY
    return None


def as_served(session: Session, choices: Choices | None) -> Session:
    """The session with `served_by` set on each system that another of the app's checkpoints renders."""
    if choices is None:
        return session
    return replace(session, systems=tuple(_served(system, choices) for system in session.systems))


def _served(system: System, choices: Choices) -> System:
    if not system.rendered:
        return system
    served = served_checkpoint(choices, MODES[system.mode].model_type, system.checkpoint)
    return system if served in (None, system.checkpoint) else replace(system, served_by=served)


def check_renderable(session: Session, service: Service | None) -> None:
    """The checks that rendering the session's clips makes, before any is rendered: each system's
    checkpoint is one the app serves (loaded now, as Save would load it), each clip's request passes
    that checkpoint's checks (speaker, language, frame limit) and each reference voice is a clip of
    1-30 s. SessionError names the line. The checkpoints' checks need them loaded here: a remote
    backend's service refuses (`RemoteService.model`), with its sentence."""
    if service is None:  # sessions of recordings alone: nothing is rendered
        return
    for system in session.systems:
        if not system.rendered:
            continue
        try:
            model = service.model(MODES[system.mode].model_type, system.served_by or system.checkpoint)
        except TTSInputError as exc:  # not served here: the service's own sentence
            raise SessionError(f"line {system.line}: system '{system.name}': {excerpt(str(exc))}") from None
        for item in session.items:
            try:
                request = system.request(item)
                model.check(request)
                if request.ref_audio is not None:
                    load_reference_audio(request.ref_audio)
            except TTSInputError as exc:
                raise SessionError(f"line {item.line}: item '{item.name}' with system '{system.name}': {excerpt(str(exc))}") from None


def served_note(session: Session) -> str:
    """A sentence naming the systems that another of the app's checkpoints renders ('' when none)."""
    by: dict[str, list[str]] = {}
    for system in session.systems:
        if system.served_by is not None:
            by.setdefault(system.served_by, []).append(system.name)
    return " ".join(f"Rendered by this app's '{served}' checkpoint in place of the one the file names: {', '.join(names)}."
                    for served, names in by.items())
