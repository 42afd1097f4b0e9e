"""The text tokenizer built with the `tokenizers` library gives transformers' ids, offsets, pre-tokens
and decoded text for the same checkpoint files (the tiny checkpoint's small BPE, and a BPE trained
here to a full-size-like vocabulary over many scripts), names the file of a damaged added-token
table, and loading a TTS checkpoint leaves transformers unimported."""
from __future__ import annotations

import builtins
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import CheckpointError
from pipeline.loading import load_text_tokenizer
from pipeline.text_tokenizer import PRE_TOKEN

REPO = Path(__file__).resolve().parents[1]

TEXTS = [
    "",
    "Hello, world! This is a test of the text tokenizer.",
    "I'M SURE it's fine; we'LL see, they'd say, you've done it, I'd agree.",
    "你好，世界！今天天气很好，我们去公园散步吧。",
    "こんにちは、世界。カタカナとひらがなと漢字が混ざった文です。",
    "안녕하세요. 만나서 반갑습니다!",
    "Mixed 中文 and English, 日本語 too, и русский, و العربية, हिन्दी।",
    "Digits 0123456789, 3.14159, 1,000,000, 42%, ½ ² ① ٣ ४",
    "Emoji \U0001F600\U0001F680\U0001F44D\U0001F3FD family \U0001F468\u200d\U0001F469\u200d\U0001F467 flag \U0001F1EF\U0001F1F5",
    "   leading spaces, inner   runs\t\ttabs\u00a0nbsp\u3000ideographic   ",
    "line one\nline two\n\n\nafter blanks\r\nwindows\rold mac\n  \n",
    "<|im_start|>assistant\nHello there.<|im_end|>\n<|im_start|>user\n",
    "text<|im_end|>glued<tts_pad>to<|tts_text_bos|>words and <|im_st half a token, <|unknown|> and <think>",
    "a <think> b</think>c  <tool_call>  x word<think>word \u00a0</think>\u00a0 <|fim_prefix|>",
    "Cafe\u0301 na\u0308ive \u1100\u1161\u11a8 e\u0301\u0301 \ufb01 \uff21\uff22\uff23 \u2126",  # NFC composes some, leaves others
    "Punctuation!!! ??? ... --- ((nested)) [brackets] {braces} \"quotes\" 'single' «guillemets» “curly”",
    "Code: def f(x): return x**2  # comment\n\tif a != b: print('hi')\n",
    "\x00\x01\x1f control \x7f characters \u200b zero \ufeff width",
    "A" * 300 + " " + "\u4e2d" * 200,
]
# Characters the random texts are drawn from: every kind the regex, NFC and the byte-level mapping treat apart.
POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789½²①٣४",
    " \t\n\r\u00a0\u3000\u2028\u200b",
    ".,;:!?'\"()[]{}-_/\\@#$%^&*+=<>|~`",
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就",
    "あいうえおかきくけこアイウエオカキクケコ、。「」",
    "가나다라마바사아자차카타파하\u1100\u1161\u11a8",
    "абвгдежзийклмнопрстуфхцчшщыэюяАБВГД",
    "e\u0301\u0308\u0327\u20ac\u00e9\u00f1\ufb01\uff21\u2126",
    "\U0001F600\U0001F680\U0001F44D\U0001F3FD\u200d\u2764\ufe0f\U0001F1EF\U0001F1F5",
]
PIECES = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tts_pad>", "<think>", "</think>", "<tool_call>", "<|fim_prefix|>", "<|im_", "|>", "<",
          "'s", "'LL", "'Re", "\n\n", "   "]
SCRIPTS = {  # the alphabets of the training text's made-up words, and what separates the words
    "latin": ("abcdefghijklmnopqrstuvwxyzéèüöñç", " "),
    "cyrillic": ("абвгдежзийклмнопрстуфхцчшщыэюя", " "),
    "han": ("的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后"
            "小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长", ""),
    "kana": ("あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをんアイウエオカキクケコサシスセソタチツテト", ""),
    "hangul": ("가나다라마바사아자차카타파하고노도로모보소오조초코토포호", " "),
}
# Added tokens as in Qwen3-TTS's tokenizer_config.json: special ones, plain ones, and tokens without bars.
QWEN3_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_pad|>", "<tool_call>", "</tool_call>",
               "<|fim_prefix|>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
               "<tts_text_bos_single>", "<|audio_pad|>"]
PLAIN_ADDED = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<think>", "</think>"}


def random_texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 30)):
            pool = rng.choice(POOLS + [PIECES])
            parts.extend(rng.choices(pool, k=rng.randint(1, 6)) if isinstance(pool, str) else [rng.choice(pool)])
        texts.append("".join(parts))
    return texts


def training_text(seed: int = 0) -> list[str]:
    """Sentences of made-up words in five scripts (drawn Zipf-like, so that long merges form), with
    punctuation, digits, line breaks and emoji, and the English docstrings of Python's builtins."""
    rng = random.Random(seed)
    lexicon = {name: ["".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(3000)] for name, (alphabet, _) in SCRIPTS.items()}
    weights = [1 / (rank + 1) for rank in range(3000)]
    lines = []
    for _ in range(12000):
        name = rng.choice(list(SCRIPTS))
        words = rng.choices(lexicon[name], weights, k=rng.randint(3, 25))
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 10 ** rng.randint(1, 6))))
        end = rng.choice([".", "!", "?", "。", "！", "，", "...", " \U0001F600", ":\n"])
        lines.append(SCRIPTS[name][1].join(words) + end + rng.choice([" ", "\n", "\n\n", "  "]))
    docs = [getattr(builtins, name).__doc__ or "" for name in dir(builtins)]
    return ["".join(lines[i:i + 50]) for i in range(0, len(lines), 50)] + docs * 4


def write_tokenizer_files(directory: Path, vocab: dict[str, int], merges: list[str], added: list[str], flags: dict | None = None) -> None:
    """vocab.json, merges.txt and a tokenizer_config.json of Qwen2Tokenizer whose added tokens follow the vocabulary."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    entries = {str(len(vocab) + i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                                     "special": token not in PLAIN_ADDED, **(flags or {}).get(token, {})} for i, token in enumerate(added)}
    config = {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": entries, "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace", "model_max_length": 32768,
              "additional_special_tokens": [t for t in added[1:] if t not in PLAIN_ADDED], "add_prefix_space": False,
              "clean_up_tokenization_spaces": False, "split_special_tokens": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


@pytest.fixture(scope="module")
def trained_bpe(tmp_path_factory) -> tuple[dict[str, int], list[str]]:
    """A byte-level BPE with a vocabulary of about 26,000 tokens, trained here on Qwen2's pre-tokens."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRE_TOKEN), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=32000, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(training_text(), trainer)
    model = json.loads(bpe.to_str())["model"]
    return model["vocab"], [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]


@pytest.fixture(scope="module")
def tokenizer_dirs(tiny_checkpoints, trained_bpe, tmp_path_factory) -> dict[str, Path]:
    """The tiny checkpoint's tokenizer; the trained BPE with Qwen3-TTS's kinds of added tokens; the
    same with added tokens that strip spaces around them, match single words or normalized text."""
    root = tmp_path_factory.mktemp("text-tokenizers")
    vocab, merges = trained_bpe
    write_tokenizer_files(root / "trained", vocab, merges, QWEN3_ADDED)
    # On tokens that tokenizer_config.json does not also name as special tokens (bos_token, ...,
    # additional_special_tokens): transformers adds those again with its own flags.
    flags = {"<think>": {"single_word": True}, "</think>": {"lstrip": True, "rstrip": True}, "<tool_call>": {"rstrip": True},
             "<|fim_prefix|>": {"normalized": True}}
    write_tokenizer_files(root / "flags", vocab, merges, QWEN3_ADDED, flags)
    return {"tiny": Path(tiny_checkpoints["custom_voice"]), "trained": root / "trained", "flags": root / "flags"}


def transformers_tokenizer(directory: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the tiny checkpoint's config.json has a model_type transformers does not know
    return AutoTokenizer.from_pretrained(str(directory))


def test_the_trained_vocabulary_is_full_size_like(trained_bpe):
    vocab, merges = trained_bpe
    assert len(vocab) > 20000 and len(merges) > 20000
    assert max(len(token) for token in vocab) >= 12  # long merges formed


@pytest.mark.parametrize("kind", ["tiny", "trained", "flags"])
def test_ids_offsets_pre_tokens_and_decoding_equal_transformers(tokenizer_dirs, kind):
    ours, theirs = load_text_tokenizer(tokenizer_dirs[kind]), transformers_tokenizer(tokenizer_dirs[kind])
    for text in TEXTS + random_texts(400):
        got, expected = ours(text), theirs(text, return_offsets_mapping=True)
        assert got["input_ids"] == expected["input_ids"], text
        assert got["offset_mapping"] == [tuple(span) for span in expected["offset_mapping"]], text
        assert got["word_ids"] == expected.word_ids(), text
        assert ours.decode(got["input_ids"]) == theirs.decode(expected["input_ids"]), text


@pytest.mark.parametrize("kind", ["tiny", "trained"])
def test_added_and_special_tokens_equal_transformers(tokenizer_dirs, kind):
    ours, theirs = load_text_tokenizer(tokenizer_dirs[kind]), transformers_tokenizer(tokenizer_dirs[kind])
    assert ours.added_tokens == theirs.added_tokens_encoder
    assert sorted(ours.all_special_tokens) == sorted(theirs.all_special_tokens)


def test_control_tokens_in_text_are_single_tokens_and_nothing_is_added_around_the_text(tokenizer_dirs):
    tokenizer = load_text_tokenizer(tokenizer_dirs["trained"])
    ids = tokenizer("<|im_start|>assistant\nHi<tts_pad><|im_end|>")["input_ids"]
    added = tokenizer.added_tokens
    assert ids[0] == added["<|im_start|>"] and ids[-2:] == [added["<tts_pad>"], added["<|im_end|>"]]
    assert tokenizer("")["input_ids"] == []


def test_the_omni_tokenizers_special_tokens_equal_transformers(tmp_path):
    from pipeline.tiny import write_tiny_omni_tokenizer

    write_tiny_omni_tokenizer(tmp_path)
    assert sorted(load_text_tokenizer(tmp_path).all_special_tokens) == sorted(transformers_tokenizer(tmp_path).all_special_tokens)


def edited_config(change):
    """A damage: `change` applied to the object in tokenizer_config.json."""
    def damage(directory: Path) -> None:
        path = directory / "tokenizer_config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        change(config)
        path.write_text(json.dumps(config), encoding="utf-8")
    return damage


def move_first_added_token(config: dict) -> None:
    table = config["added_tokens_decoder"]
    first = min(table, key=int)
    table[str(int(first) + 100)] = table.pop(first)


@pytest.mark.parametrize("damage, problem", [
    pytest.param(edited_config(move_first_added_token), "the id", id="id-past-the-vocabulary"),
    pytest.param(edited_config(lambda c: c.update(added_tokens_decoder=["<|im_start|>"])), "should map each added token's id", id="table-is-a-list"),
    pytest.param(edited_config(lambda c: c.update(added_tokens_decoder={"5000": {"special": True}})), "holding the token's content",
                 id="entry-without-content"),
    pytest.param(edited_config(lambda c: c.update(added_tokens_decoder={"first": {"content": "<|x|>"}})), "holding the token's content",
                 id="key-not-an-id"),
])
def test_a_damaged_added_token_table_names_tokenizer_config(tokenizer_dirs, tmp_path, damage, problem):
    directory = Path(shutil.copytree(tokenizer_dirs["tiny"], tmp_path / "checkpoint"))
    damage(directory)
    with pytest.raises(CheckpointError, match=problem) as error:
        load_text_tokenizer(directory)
    assert str(directory) in str(error.value) and "tokenizer_config.json" in str(error.value)


def test_loading_a_tts_checkpoint_leaves_transformers_unimported(tiny_checkpoints):
    code = ("import sys\nfrom pipeline.tts import TTS\n"
            f"tts = TTS.from_pretrained({str(tiny_checkpoints['custom_voice'])!r}, device='cpu', rows=1)\n"
            "assert tts.text_tokenizer('Hello.')['input_ids']\n"
            "print(sorted(name for name in sys.modules if name.split('.')[0] == 'transformers'))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
