"""Text that arrives in pieces: its token ids (equal to those of the whole text), the frame at which
each token enters the talker, and the words' times in the output audio.

Tokens: a BPE tokenizer splits text into pre-tokens (a word with its leading space, a digit, a run of
punctuation, a run of whitespace) and merges bytes within each one only, so every pre-token but the
last is final once more text follows it. `IncrementalTokenizer` hands out the tokens of those final
pre-tokens and keeps the rest (the last pre-token, trailing whitespace, a possible start of a special
token such as "<|im_" ) until more text or the end comes. For Chinese or Japanese, where a run of
characters between punctuation is one pre-token, that is a clause at a time.

Timings: in the streaming-text layout the talker reads one text token per generated frame, and a
row waits (making no frame) while its next token has not arrived, so token j always enters at the
same frame whatever the client's pace: `TextLayout.entry_frame`. A word is timed from its tokens:
it starts at the frame its first token enters and ends at the frame after its last token entered.
The model speaks a token at the earliest in its entry frame (the frame's codes are the first that
the token can change), usually some frames later: these times are lower bounds of when it is heard.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.contract.events import FRAME_SECONDS
from pipeline.text_tokenizer import TextTokenizer

# One word per character in scripts written without spaces (CJK ideographs, kana); else a run of non-space characters.
_WORD = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]|[^\s\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]+")


@dataclass(frozen=True)
class Token:
    id: int
    start: int  # characters of the text it comes from
    end: int


@dataclass(frozen=True)
class WordTime:
    word: str
    start: float  # seconds of the output audio
    end: float

    def as_dict(self) -> dict[str, Any]:
        return {"word": self.word, "start": round(self.start, 3), "end": round(self.end, 3)}


@dataclass(frozen=True)
class TextLayout:
    """Where the text's tokens sit in a streaming-text prompt: `lead` tokens of it are laid in the
    prompt beyond the first (a voice-clone prompt lays text against the reference frames)."""

    lead: int = 0

    def entry_frame(self, index: int) -> int:
        """The first generated frame whose codes token `index` of the text can change."""
        return max(0, index - self.lead)


class IncrementalTokenizer:
    """The token ids of a text given in pieces, equal to those of the whole text (leading and
    trailing whitespace stripped). `feed` returns the tokens that are final, `finish` the rest."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self.tokens: list[Token] = []
        self.done = False
        self._specials = list(tokenizer.added_tokens)

    def feed(self, piece: str) -> list[Token]:
        if self.done:
            raise ValueError("The text has ended.")
        self.text = (self.text + piece) if self.text else piece.lstrip()
        if not self.text:
            return []
        ids, spans, words = self._encode(self.text)
        hold = words[self._first_held_token(spans)]
        final = next((i for i, word in enumerate(words) if word >= hold), len(ids))
        return self._commit(ids, spans, final)

    def finish(self) -> list[Token]:
        """The tokens still held; the text ends here."""
        self.done = True
        self.text = self.text.rstrip()
        if not self.text:
            return []
        ids, spans, _ = self._encode(self.text)
        return self._commit(ids, spans, len(ids))

    def _encode(self, text: str) -> tuple[list[int], list[tuple[int, int]], list[int]]:
        encoding = self.tokenizer(text)
        # Added (special) tokens have no pre-token: each counts as one of its own.
        words = [w if w is not None else -1 for w in encoding["word_ids"]]
        for i in range(1, len(words)):
            words[i] = max(words[i], words[i - 1]) if words[i] >= 0 else words[i - 1] + 1
        return encoding["input_ids"], encoding["offset_mapping"], words

    def _first_held_token(self, spans: list[tuple[int, int]]) -> int:
        """The first token whose pre-token may still change: the one holding the trailing whitespace
        (dropped at the end, or joined to a punctuation run before it) or a start of a special token,
        else the last."""
        held_char = len(self.text.rstrip())
        if held_char == len(self.text):
            held_char -= 1
        held_char = min(held_char, self._special_prefix_start())
        return next((i for i, (_, end) in enumerate(spans) if end > held_char), len(spans) - 1)

    def _special_prefix_start(self) -> int:
        """Where a tail of the text begins that more text could turn into a special token; past the end if none."""
        start = len(self.text)
        for special in self._specials:
            for size in range(min(len(special) - 1, len(self.text)), 0, -1):
                if special.startswith(self.text[-size:]):
                    start = min(start, len(self.text) - size)
                    break
        return start

    def _commit(self, ids: list[int], spans: list[tuple[int, int]], final: int) -> list[Token]:
        known = len(self.tokens)
        if [t.id for t in self.tokens] != ids[:known]:
            raise RuntimeError("The text's tokens changed before the point where they were final.")
        new = [Token(ids[i], *spans[i]) for i in range(known, max(known, final))]
        self.tokens.extend(new)
        return new


def word_spans(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in _WORD.finditer(text)]


def word_times(text: str, tokens: Sequence[Token], layout: TextLayout, final: bool = True) -> list[WordTime]:
    """The words of `text` with their times, from the tokens given so far: all of them if `final`,
    else those that a later token shows complete."""
    times, first = [], 0
    reached = tokens[-1].start if tokens else 0
    for start, end in word_spans(text):
        if not final and end > reached:
            break
        while first < len(tokens) and tokens[first].end <= start:
            first += 1
        last = first
        while last + 1 < len(tokens) and tokens[last + 1].start < end:
            last += 1
        if first >= len(tokens) or tokens[first].start >= end:
            continue  # no token of its own (a character the tokenizer dropped)
        begin, finish = layout.entry_frame(first), layout.entry_frame(last) + 1
        times.append(WordTime(text[start:end], begin * FRAME_SECONDS, finish * FRAME_SECONDS))
    return times


def spoken_words(segments: Sequence[tuple[str, Sequence[Token]]], layout: TextLayout, segment_frames: Sequence[int], frames: int) -> list[WordTime]:
    """The words of a text spoken segment after segment, each segment (its text and tokens) from a
    prompt of its own: a segment's words are timed from the frames it made (`segment_frames`, then
    what is left of `frames`, all frames spoken), those starting after its last frame left out (not
    spoken) and their ends cut at it."""
    times, before = [], 0
    for index, (text, tokens) in enumerate(segments):
        made = segment_frames[index] if index < len(segment_frames) else frames - before
        if made <= 0:
            break
        offset, end = before * FRAME_SECONDS, made * FRAME_SECONDS
        times += [WordTime(w.word, offset + w.start, offset + min(w.end, end)) for w in word_times(text, tokens, layout) if w.start < end]
        before += made
    return times
