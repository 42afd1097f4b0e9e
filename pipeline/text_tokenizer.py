"""Qwen2's byte-level BPE text tokenizer, built with the `tokenizers` library from a checkpoint's
vocab.json, merges.txt and tokenizer_config.json: the ids, offsets and text that transformers'
Qwen2Tokenizer gives for the same files, without importing transformers (seconds at start).

The pipeline, as Qwen2Tokenizer builds it: NFC normalization; a regex split into pre-tokens (a word
with one leading non-letter, a single digit, a punctuation run, a whitespace run); byte-level
mapping; BPE within each pre-token. The added tokens of tokenizer_config.json (`<|im_start|>`,
`<tts_pad>`, ...) are matched as whole tokens in the text before any of that. Nothing is added
around the text (no BOS or EOS).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

# Qwen2's pre-token split (transformers' Qwen2Tokenizer, PRETOKENIZE_REGEX): English contractions,
# letters with at most one leading non-letter, one digit at a time, punctuation runs (with the line
# breaks after them), line breaks with the spaces before them, then other whitespace runs.
PRE_TOKEN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


class TextTokenizer:
    """Text to token ids (with each token's characters and pre-token), and ids back to text."""

    def __init__(self, tokenizer: Tokenizer, special_tokens: list[str]):
        self._tokenizer = tokenizer
        # The added tokens marked special, read by pipeline.omni.conversation.check_control_tokens.
        self.all_special_tokens = special_tokens
        # Every added token by its text: each is one token wherever it appears in the text.
        self.added_tokens = {token.content: token_id for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())}

    @classmethod
    def from_files(cls, vocab: Path, merges: Path, config: dict[str, Any]) -> TextTokenizer:
        """The tokenizer of vocab.json, merges.txt and the parsed tokenizer_config.json. ValueError
        where an added token is malformed or does not get the id the config gives it; the tokenizers
        library raises Exception where the BPE cannot be built."""
        tokenizer = Tokenizer(BPE.from_file(str(vocab), str(merges), dropout=None, unk_token=None, continuing_subword_prefix="",
                                            end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_TOKEN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space")), use_regex=False),
        ])
        tokenizer.decoder = decoders.ByteLevel()
        added = read_added_tokens(config)
        tokenizer.add_tokens(list(added.values()))
        _check_added_ids(tokenizer, added)
        return cls(tokenizer, [token.content for token in added.values() if token.special])

    def __call__(self, text: str) -> dict[str, list]:
        """`input_ids`; `offset_mapping`: each token's (start, end) characters in `text`; `word_ids`:
        each token's pre-token index (None for an added token)."""
        encoding = self._tokenizer.encode(text)
        return {"input_ids": encoding.ids, "offset_mapping": encoding.offsets, "word_ids": encoding.word_ids}

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def read_added_tokens(config: dict[str, Any]) -> dict[int, AddedToken]:
    """tokenizer_config.json's `added_tokens_decoder` ({"151643": {"content": ..., "special": ...}, ...}), by id.

    Each token keeps the flags the file gives it. transformers adds the tokens that the file also names
    as special (bos_token, eos_token, pad_token, additional_special_tokens) once more, as special, not
    normalized and stripping nothing: the flags those tokens have in Qwen's checkpoints."""
    entries = config.get("added_tokens_decoder") or {}
    if not isinstance(entries, dict):
        raise ValueError("tokenizer_config.json's added_tokens_decoder should map each added token's id to the token")
    tokens = {}
    for key, entry in entries.items():
        if not key.isdigit() or not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or not entry["content"]:
            raise ValueError(f"tokenizer_config.json's added_tokens_decoder entry {key!r} should be an id with an object holding the token's content")
        tokens[int(key)] = AddedToken(entry["content"], **{flag: bool(entry[flag]) for flag in ADDED_TOKEN_FLAGS if flag in entry})
    return dict(sorted(tokens.items()))


def _check_added_ids(tokenizer: Tokenizer, added: dict[int, AddedToken]) -> None:
    # The library gives an added token the id its text has in vocab.json, else the next free one; the
    # model's embedding rows are those of the config's ids, so a gap or clash would shift every id.
    for token_id, token in added.items():
        given = tokenizer.token_to_id(token.content)
        if given != token_id:
            raise ValueError(f"tokenizer_config.json gives the added token {token.content} the id {token_id}, but it gets {given} "
                             f"after the {tokenizer.get_vocab_size(with_added_tokens=False)} tokens of vocab.json")
