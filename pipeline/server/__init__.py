"""The HTTP API on the app's server (issue 10, in progress): `speech_routes(service)` serves
`POST /v1/audio/speech` and `GET /v1/models` through the app's model service."""
from pipeline.server.speech import Access, speech_routes

__all__ = ["Access", "speech_routes"]
