"""The one request type: every bad field gets one specific sentence before any work starts, in the
library, the CLI (exit 2, before the checkpoint loads) and the app (gr.Error)."""
import math

import pytest

from pipeline.__main__ import EXIT_BAD_INPUT, main
from pipeline.errors import TTSInputError
from pipeline.request import MAX_INSTRUCT_CHARS, MAX_REF_TEXT_CHARS, MAX_SEED, SpeechRequest

BAD_FIELDS = [
    (dict(temperature=0.0), r"temperature must be a number above 0 and at most 100 \(got 0.0\)"),
    (dict(temperature=101), r"temperature must be a number above 0 and at most 100 \(got 101\)"),
    (dict(temperature=10**400), r"temperature must be a number above 0 and at most 100 \(got a number of about 401 digits\)"),
    (dict(seed=10**5000), r"seed must be a whole number from 0 to 4294967295 \(got a number of about 5001 digits\)"),
    (dict(top_k=2**31), r"top_k must be a whole number from 0 to 2147483647"),
    (dict(text="hi \udcff"), r"text holds the lone surrogate \\udcff"),
    (dict(speaker="\ud800"), r"speaker holds the lone surrogate \\ud800"),
    (dict(model_type="voice_design", instruct=" "), "Voice design needs a voice description"),
    (dict(temperature=-1.0), "temperature must be a number above 0"),
    (dict(temperature=math.nan), r"temperature must be a number above 0 and at most 100 \(got nan\)"),
    (dict(temperature=math.inf), r"temperature must be a number above 0 and at most 100 \(got inf\)"),
    (dict(subtalker_temperature=0.0), "subtalker_temperature must be a number above 0"),
    (dict(top_p=0.0), r"top_p must be a number in \(0, 1\] \(got 0.0\)"),
    (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
    (dict(subtalker_top_p=-0.1), r"subtalker_top_p must be a number in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be a whole number from 0 to 2147483647 .got -1."),
    (dict(top_k=2.5), "top_k must be a whole number from 0 to 2147483647 .got 2.5."),
    (dict(subtalker_top_k=-3), "subtalker_top_k must be a whole number from 0"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a number above 0"),
    (dict(repetition_penalty=math.nan), "repetition_penalty must be a number above 0"),
    (dict(seed=-1), f"seed must be a whole number from 0 to {MAX_SEED}"),
    (dict(seed=MAX_SEED + 1), f"seed must be a whole number from 0 to {MAX_SEED}"),
    (dict(max_frames=0), "max_frames must be a whole number of at least 1"),
    (dict(schedule="1, two"), "A chunk schedule is a comma-separated list of frame counts"),
    (dict(instruct="x" * (MAX_INSTRUCT_CHARS + 1)), f"The instruction is {MAX_INSTRUCT_CHARS + 1} characters long; the limit is {MAX_INSTRUCT_CHARS}"),
    (dict(ref_text="x" * (MAX_REF_TEXT_CHARS + 1)), f"The reference transcript is {MAX_REF_TEXT_CHARS + 1} characters long"),
    (dict(text="   "), "The text is empty"),
    (dict(text=5), "The text must be a string, not int"),
    (dict(speaker=3), "speaker must be text, not int"),
    (dict(word_timestamps="yes"), "word_timestamps is true or false, not 'yes'"),
    (dict(model_type="custom_voice", word_timestamps=True), r"Word timestamps need the text fed one token per frame.*\(CustomVoice puts it there by default\)"),
    (dict(model_type="base", word_timestamps=True, non_streaming_mode=True), r"\(non_streaming_mode is true\): set non_streaming_mode to false"),
]


@pytest.mark.parametrize("fields, message", BAD_FIELDS)
def test_each_bad_field_has_its_sentence(fields, message):
    with pytest.raises(TTSInputError, match=message):
        SpeechRequest(**{"text": "Hello.", **fields}).validate()


def test_good_values_pass_and_are_normalised():
    request = SpeechRequest("Hello.", seed=7.0, top_k=0, top_p=1.0, temperature=1e-3, schedule="2, 4").validate()
    assert request.seed == 7 and isinstance(request.seed, int) and request.schedule == (2, 4)


def test_word_timestamps_go_with_the_streaming_text_layout():
    assert SpeechRequest("Hi.", model_type="base", word_timestamps=True).validate().streams_text("base")  # Base's default layout
    assert SpeechRequest("Hi.", model_type="voice_design", instruct="Calm.", word_timestamps=True, non_streaming_mode=False).validate()
    unnamed = SpeechRequest("Hi.", instruct="Calm.", word_timestamps=True).validate()  # checked against the checkpoint's type instead
    with pytest.raises(TTSInputError, match="VoiceDesign puts it there by default"):
        unnamed.check_for_checkpoint("voice_design", 100)


def test_json_requests_name_unknown_fields():
    with pytest.raises(TTSInputError, match="Unknown request field.s.: tempreature"):
        SpeechRequest.from_dict({"text": "Hi.", "tempreature": 0.5})
    with pytest.raises(TTSInputError, match="no 'text'"):
        SpeechRequest.from_dict({"speaker": "ryan"})


CLI_FLAGS = [
    (["--temperature", "0"], "temperature must be a number above 0"),
    (["--temperature", "nan"], "temperature must be a number above 0"),
    (["--top-p", "1.5"], "top_p must be a number in"),
    (["--top-k", "-1"], "top_k must be a whole number"),
    (["--repetition-penalty", "0"], "repetition_penalty must be a number above 0"),
    (["--instruct", "x" * (MAX_INSTRUCT_CHARS + 1)], "The instruction is"),
    (["--ref-text", "x" * (MAX_REF_TEXT_CHARS + 1)], "The reference transcript is"),
    (["--out", "out.mp4"], "out.mp4"),
]


@pytest.mark.parametrize("flags, message", CLI_FLAGS)
def test_cli_refuses_bad_values_before_loading_anything(flags, message, tmp_path, capsys, monkeypatch):
    import pipeline.tts

    def never(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the request was checked")

    monkeypatch.setattr(pipeline.tts.TTS, "from_pretrained", never)
    monkeypatch.chdir(tmp_path)
    args = ["synth", "--model", "unused", "--text", "Hi.", "--out", "out.wav", *flags]
    assert main(args) == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err
