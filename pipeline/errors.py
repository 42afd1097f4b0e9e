class TTSInputError(ValueError):
    """A request the model cannot serve, described in one sentence a user can act on; `field` names the
    request field at fault where there is one (the API reports it as the error's `param`)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be found or loaded; the message names the missing piece."""


class EngineBusy(TTSInputError):
    """The engine's queue is full; the message says how many requests are ahead. A TTSInputError so that
    every front end shows its sentence as it shows a bad input's; the HTTP API answers it with 429."""


class BackendUnavailable(TTSInputError):
    """A remote backend that cannot be reached or stopped answering; a TTSInputError so that every front
    end shows its sentence the way it shows a bad input's."""
