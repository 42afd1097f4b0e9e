"""The remote backend: `RemoteService(url, key)` serves the UI from a server that speaks our
HTTP protocol (another instance of this app, or vLLM-Omni) instead of models in this process.

backend.py: the HTTP client, what the server serves, its errors as sentences. speech.py: a Qwen3-TTS
request's body and its streamed PCM as Chunks. chat.py: a Qwen3-Omni conversation's body and its
streamed events as the chat's items. service.py: the entry point.
"""
from pipeline.remote.backend import StallRule
from pipeline.remote.service import RemoteService

__all__ = ["RemoteService", "StallRule"]
