"""The HTTP API on the app's server: `speech_routes(service, access)` serves
`POST /v1/audio/speech` and `GET /v1/models`, `chat_routes(service, access)` Qwen3-Omni's
`POST /v1/chat/completions`, both through the app's model service.

The routes are imported on first use: they import the model service (torch), which a process serving
the UI alone (`app.py --backend URL`) never loads, though it uses `Access`."""
from pipeline.server.common import Access

__all__ = ["Access", "chat_routes", "speech_routes", "stream_routes"]


def __getattr__(name: str):
    if name == "speech_routes":
        from pipeline.server.speech import speech_routes

        return speech_routes
    if name == "chat_routes":
        from pipeline.server.chat import chat_routes

        return chat_routes
    if name == "stream_routes":
        from pipeline.server.stream import stream_routes

        return stream_routes
    raise AttributeError(f"module 'pipeline.server' has no attribute {name!r}")
