"""Text given in pieces tokenizes to the whole text's ids (wherever the pieces are cut), words are timed
from the frames at which their tokens enter the talker, and on a tiny checkpoint a token changes no
audio before its entry frame and changes the audio from that frame's first sample."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.loading import load_text_tokenizer
from pipeline.request import SpeechRequest
from pipeline.tts import TTS
from pipeline.word_timings import IncrementalTokenizer, TextLayout, Token, WordTime, spoken_words, word_times

TEXTS = [
    "Hello there, world! It's 12345 o'clock; don't worry.",
    "Numbers: 3.14159, 1,000,000 and 42%... really?!  Yes.\n\nNew paragraph\ttab.",
    "Cafe\u0301 na\u00efve re\u0301sume\u0301 \u00e9l\u00e8ve",  # combining accents, composed by NFC
    "你好，世界！今天天气很好。我们去公园吧",
    "Emoji \U0001F600\U0001F680 and <|im_end|> and <|tts_pad|>x <|im_",
    "  leading and trailing whitespace, newline at the end.\n \n",
    "I'LL SAY IT'S FINE, WE'VE DONE IT, THEY'D AGREE.",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoints):
    return load_text_tokenizer(Path(tiny_checkpoints["custom_voice"]))


def whole_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text.strip())["input_ids"]


def fed(tokenizer, pieces: list[str]) -> IncrementalTokenizer:
    tokens = IncrementalTokenizer(tokenizer)
    for piece in pieces:
        tokens.feed(piece)
    tokens.finish()
    return tokens


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_cut_anywhere_give_the_whole_texts_ids(tokenizer, text):
    rng = random.Random(0)
    expected = whole_ids(tokenizer, text)
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert [t.id for t in fed(tokenizer, pieces).tokens] == expected, pieces
    assert [t.id for t in fed(tokenizer, list(text)).tokens] == expected  # one character at a time


def test_a_word_is_held_until_the_text_after_it_shows_it_complete(tokenizer):
    tokens = IncrementalTokenizer(tokenizer)
    assert tokens.feed("Hel") == []
    assert tokens.feed("lo") == []
    first = tokens.feed(" wor")
    assert tokenizer.decode([t.id for t in first]) == "Hello"
    assert tokens.finish() and tokenizer.decode([t.id for t in tokens.tokens]) == "Hello wor"


def test_spans_point_into_the_text(tokenizer):
    tokens = fed(tokenizer, ["Hello, ", "world"])
    assert [tokens.text[t.start:t.end] for t in tokens.tokens][:2] == ["Hello", ","]


def test_words_start_at_their_first_token_and_end_after_their_last():
    text = "Hi there you"
    tokens = [Token(1, 0, 2), Token(2, 2, 5), Token(3, 5, 8), Token(4, 8, 12)]  # "Hi", " th", "ere", " you"
    assert word_times(text, tokens, TextLayout()) == [WordTime("Hi", 0.0, 0.08), WordTime("there", 0.08, 0.24), WordTime("you", 0.24, 0.32)]
    # Before the end, a word is timed once a token after it has come.
    assert [w.word for w in word_times(text, tokens[:3], TextLayout(), final=False)] == ["Hi"]
    # Text laid in the prompt (a voice clone's): its first tokens all enter with the first frame.
    assert [(w.start, w.end) for w in word_times(text, tokens, TextLayout(lead=2))] == [(0.0, 0.08), (0.0, 0.08), (0.08, 0.16)]


def test_characters_without_spaces_are_words_of_their_own():
    text = "你好"
    tokens = [Token(1, 0, 2)]  # one token for both
    assert word_times(text, tokens, TextLayout()) == [WordTime("你", 0.0, 0.08), WordTime("好", 0.0, 0.08)]


def test_a_token_is_heard_from_its_entry_frame_on_and_never_before(tiny_checkpoints):
    """Greedy speech of a text and of the same text with one word replaced: frames before the word's
    first token enters are equal, and the audio differs from the first sample of that frame on."""
    tts = TTS.from_pretrained(str(tiny_checkpoints["custom_voice"]))
    words = "one two three four five six seven".split()

    def speak(text: str):
        stream = tts.open_text_stream(SpeechRequest(".", speaker=tts.speakers[0], greedy=True, seed=0, max_frames=30))
        stream.append(text)
        stream.finish()
        audio = np.concatenate([chunk.audio for chunk in stream.handle])
        return stream, stream.handle.codes, audio

    base, codes, audio = speak(" ".join(words))
    for k in (1, 4):
        stream, changed_codes, changed_audio = speak(" ".join("zzq" if i == k else w for i, w in enumerate(words)))
        token = next(i for i, (a, b) in enumerate(zip(base.tokens, stream.tokens)) if a.id != b.id)
        frame = stream.layout.timing.entry_frame(token)
        first_frame = next(i for i in range(len(codes)) if not torch.equal(codes[i], changed_codes[i]))
        first_sample = next(i for i in range(len(audio)) if audio[i] != changed_audio[i])
        assert first_frame == frame and first_sample == frame * 1920
        assert stream.words(final=True)[k].start >= frame * 0.08  # the word's first letter enters with or after the first changed token


def test_segments_are_timed_after_the_frames_before_them_and_unspoken_words_left_out():
    first = ("Hi there", [Token(1, 0, 2), Token(2, 2, 8)])
    second = ("you all", [Token(3, 0, 3), Token(4, 3, 7)])
    # The first segment made 5 frames; the second 1 (the speech ended there): "all" enters after it.
    words = spoken_words([first, second], TextLayout(), [5], 6)
    assert [(w.word, round(w.start, 3), round(w.end, 3)) for w in words] == [("Hi", 0.0, 0.08), ("there", 0.08, 0.16), ("you", 0.4, 0.48)]
    # A segment cut inside a word: the word ends where its segment's audio does.
    assert [(w.word, round(w.end, 3)) for w in spoken_words([first], TextLayout(), [], 1)] == [("Hi", 0.08)]


def test_a_long_text_is_timed_segment_after_segment(tiny_checkpoints):
    """Two segments in the streaming-text layout: the second one's first word starts at the first frame
    after the first segment's, and no word outlasts the audio."""
    tts = TTS.from_pretrained(str(tiny_checkpoints["custom_voice"]))
    sentence = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen. "
    text = sentence * 4  # over 300 characters: two segments
    request = SpeechRequest(text, speaker=tts.speakers[0], greedy=True, seed=0, non_streaming_mode=False, word_timestamps=True)
    segments = tts.segments(text)
    assert len(segments) == 2
    handle = tts.submit(request)
    for _ in handle:
        pass
    words = tts.spoken_words(request, None, handle)
    boundary = handle.segment_frames[0] * 0.08
    first_count = len([w for w in word_times(segments[0], tts.segment_tokens(segments[0]), TextLayout()) if w.start < boundary])
    assert [w.word for w in words[:first_count]] == segments[0].split()[:first_count]
    assert len(handle.segment_frames) == 2 and len(words) > first_count  # greedy: both segments speak
    assert words[first_count].word == "One" and abs(words[first_count].start - boundary) < 1e-9
    assert all(w.end <= len(handle.codes) * 0.08 + 1e-9 for w in words)
