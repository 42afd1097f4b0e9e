class TTSInputError(ValueError):
    """A request the model cannot serve, described in one sentence a user can act on."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be found or loaded; the message names the missing piece."""
