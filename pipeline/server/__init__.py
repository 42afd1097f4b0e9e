"""The HTTP API on the app's server: `speech_routes(service, access)` serves
`POST /v1/audio/speech` and `GET /v1/models`, `chat_routes(service, access)` Qwen3-Omni's
`POST /v1/chat/completions`, both through the app's model service."""
from pipeline.server.chat import chat_routes
from pipeline.server.common import Access
from pipeline.server.speech import speech_routes

__all__ = ["Access", "chat_routes", "speech_routes"]
