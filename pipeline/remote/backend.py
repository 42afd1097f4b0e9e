"""The HTTP side of a remote backend: one httpx client that carries the key, what the server serves
(`GET /v1/models`), and the server's answers turned into the sentences the UI shows.

Two kinds of server speak the protocol: another instance of this app (its `/v1/models` entries carry
`task_type`, and it describes a checkpoint at `GET /v1/models/{id}`) and vLLM-Omni (`vllm serve ...
--omni`: one model per server, plain vLLM model entries, preset speakers at `GET /v1/audio/voices`).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from pipeline.contract.models import by_task, by_vllm_name
from pipeline.errors import BackendUnavailable, TTSInputError

CONNECT_TIMEOUT_S = 10.0
# A backend that sends nothing for this long is taken as gone. Generous: a request may wait in the
# backend's queue, or for its model to load, before its first audio. Once audio has started, a
# `StallRule` decides, in seconds.
READ_TIMEOUT_S = 300.0
LOAD_TIMEOUT_S = 1800.0  # a first use that downloads and loads a checkpoint on the backend
KEY_HINT = "give the backend's key with --backend-key (or QWEN_TTS_BACKEND_KEY)"


@dataclass(frozen=True)
class StallRule:
    """When a stream whose audio has started counts as stalled: no audio chunk for `gaps` times the
    longest interval between two of its chunks so far, and for at least `floor_s` seconds (a chunk's
    interval grows with the chunk schedule, and a new request joining the backend's batch delays one)."""

    floor_s: float = 5.0
    gaps: float = 4.0

    def limit(self, longest_interval_s: float) -> float:
        return max(self.floor_s, self.gaps * longest_interval_s)

    def __str__(self) -> str:
        return f"{self.gaps:g} times its slowest chunk so far, at least {self.floor_s:g} s"


@dataclass(frozen=True)
class RemoteModel:
    id: str
    model_type: str  # the tab it serves: base, custom_voice, voice_design or omni
    entry: dict  # as GET /v1/models listed it


class Backend:
    def __init__(self, url: str, key: str | None = None):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))

    def models(self) -> tuple[bool, list[RemoteModel]]:
        """(whether the server is this app, the models it serves that a tab can use)."""
        entries = self.get_json("/v1/models").get("data") or []
        ours = bool(entries) and all("task_type" in e for e in entries)
        models = [RemoteModel(str(e["id"]), kind, e) for e in entries if (kind := model_type_of(e))]
        return ours, models

    def get_json(self, path: str, params: dict | None = None, timeout: float = READ_TIMEOUT_S) -> dict:
        try:
            response = self.client.get(path, params=params, timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S))
        except httpx.TransportError as exc:
            raise self.unreachable(exc) from None
        if response.status_code >= 400:
            raise self.refusal(response)
        try:
            return response.json()
        except ValueError:
            raise BackendUnavailable(f"The backend at {self.url} answered {path} with something that is not JSON: is it the right URL?") from None

    @contextmanager
    def post_stream(self, path: str, body: dict) -> Iterator[httpx.Response]:
        """The response of a streamed POST, its headers read; a refusal raises with the server's message."""
        try:
            with self.client.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise self.refusal(response)
                yield response
        except httpx.TransportError as exc:  # reading errors are the caller's: it knows how far the stream got
            raise self.unreachable(exc) from None

    def refusal(self, response: httpx.Response) -> TTSInputError:
        """A 4xx as the server's own sentence (a bad request reads as it would locally); 401 says which
        flag gives the key; 5xx says the backend failed."""
        message = server_message(response)
        if response.status_code == 401:
            return TTSInputError(f"The backend at {self.url} refused the key (401: {message}): {KEY_HINT}.")
        if response.status_code >= 500:
            return BackendUnavailable(f"The backend at {self.url} failed ({response.status_code}): {message}")
        return TTSInputError(message)

    def unreachable(self, exc: Exception) -> BackendUnavailable:
        return BackendUnavailable(f"The backend at {self.url} is not answering ({describe(exc)}): start it, or check the URL given to --backend.")

    def stopped_answering(self, exc: Exception, audio_seconds: float) -> BackendUnavailable:
        return BackendUnavailable(f"The backend at {self.url} stopped answering after {audio_seconds:.1f} s of audio ({describe(exc)}); "
                                  "check that it still runs, then try again.")

    def stalled(self, silence_s: float, audio_seconds: float, rule: StallRule) -> BackendUnavailable:
        return BackendUnavailable(f"The backend at {self.url} stalled: it sent no audio for {silence_s:.1f} s after {audio_seconds:.1f} s of it "
                                  f"(the limit once audio has started: {rule}); check that it still runs, then try again.")


def model_type_of(entry: dict) -> str | None:
    """The tab a /v1/models entry serves: this app says it (`task_type`); vLLM-Omni's entries are named
    like the checkpoint they serve (`id`, else `root`, the path it was loaded from); None if neither."""
    if "task_type" in entry:
        kind = by_task(entry["task_type"]) if isinstance(entry["task_type"], str) else None
        return kind.id if kind else None
    kind = next(filter(None, (by_vllm_name(str(name or "")) for name in (entry.get("id"), entry.get("root")))), None)
    return kind.id if kind else None


def server_message(response: httpx.Response) -> str:
    """The error sentence of a response in OpenAI's shape (`{"error": {"message"}}`), vLLM's older flat
    one (`{"message"}`) or FastAPI's (`{"detail"}`); else the start of its text."""
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:300] or f"HTTP {response.status_code}"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if data.get("message"):
            return str(data["message"])
        if data.get("detail"):
            detail = data["detail"]
            return "; ".join(str(d.get("msg", d)) if isinstance(d, dict) else str(d) for d in detail) if isinstance(detail, list) else str(detail)
    return str(data)[:300]


def describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
