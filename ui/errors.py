"""A user's input error: shown in the page, logged as one line (gradio would print the whole traceback)."""
from __future__ import annotations

import logging

import gradio as gr

log = logging.getLogger("ui")


def input_error(exc: BaseException | str) -> gr.Error:
    """The gr.Error to raise for a bad input: one INFO line in the log, no traceback on the console."""
    log.info("input error: %s", exc)
    return gr.Error(str(exc), print_exception=False)
