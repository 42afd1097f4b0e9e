"""What the page says in a toast: a user's input error (shown in the page, logged as one line; gradio
would print the whole traceback) and warnings. Gradio renders a toast's message as HTML (it strips
scripts and event handlers but keeps links and images), and the messages echo what users typed, a
share link's query or a session file's values: every message is escaped here, so that it shows as
the text it is."""
from __future__ import annotations

import html
import logging
import re

import gradio as gr

log = logging.getLogger("ui")


def input_error(exc: BaseException | str) -> gr.Error:
    """The gr.Error to raise for a bad input: one INFO line in the log, no traceback on the console."""
    log.info("input error: %s", exc)
    return gr.Error(toast_text(str(exc)), print_exception=False)


def warn(message: str) -> None:
    """A warning toast that shows `message` as plain text."""
    gr.Warning(toast_text(message))


def toast_text(message: str) -> str:
    """`message` as HTML that displays it literally: `<`, `>` and `&` escaped, which is all that text
    between tags needs (quotes stay as they are for gradio_client, which gets the same string);
    toasts render no Markdown."""
    return html.escape(message, quote=False)


MARKDOWN_SYNTAX = re.compile(r"([\\`*_{}\[\]()#+\-.!|>~])")


def markdown_text(text: str) -> str:
    """`text` as Markdown that displays it literally: HTML escaped as in a toast and every character
    that Markdown reads as syntax (links, emphasis, headings, lists) backslash-escaped, for text that
    a session file's author wrote and every listener sees."""
    return MARKDOWN_SYNTAX.sub(r"\\\1", toast_text(text))
