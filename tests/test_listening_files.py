"""Hostile listening session files and share links: each gets one sentence naming the line or the
limit (SessionError in the library, exit 2 on the CLI's stderr, an escaped toast in the page), with
bounded work; paths outside the sessions folder are refused from their text alone; and whatever
the page echoes of a value shows as text, never as markup."""
import html
import os
import subprocess
import sys
from pathlib import Path

import gradio as gr
import pytest
import soundfile as sf
from conftest import voice_like
from starlette.requests import Request

from pipeline.listening import SessionError, Sessions, parse_session
from pipeline.listening.__main__ import main
from pipeline.listening.session import (
    MAX_FILE_BYTES,
    MAX_ITEMS,
    MAX_LISTENERS,
    MAX_NODES,
    MAX_SYSTEMS,
    MAX_TRIALS,
)

REPO = Path(__file__).resolve().parents[1]
SESSION = """\
name: demo
test: ab
trials_per_listener: 4
systems:
  - {name: a, checkpoint: tiny, mode: voice_design}
  - {name: b, checkpoint: tiny, mode: voice_design}
items:
  - {name: one, text: Hello there., instruct: A calm voice.}
"""
LINK = "<a href=https://example.com/>press here</a>"
IMAGE = "<img src=x onerror=alert(1)>"


def laughs(levels: int = 7, width: int = 9) -> str:
    """A 'billion laughs' name: each level lists the one before `width` times (9^7 'lol's when expanded)."""
    rows = ["  - &l0 [" + ", ".join(["lol"] * width) + "]"]
    rows += [f"  - &l{n} [" + ", ".join([f"*l{n - 1}"] * width) + "]" for n in range(1, levels)]
    return "name:\n" + "\n".join(rows) + "\n"


CASES = {  # the file's text -> the sentence, after "line N: "
    "trials": (SESSION.replace("trials_per_listener: 4", "trials_per_listener: 2000000"),
               f"line 3: trials_per_listener is at most {MAX_TRIALS:,}; split a longer test into sessions."),
    "items": (SESSION + "".join(f"  - {{name: i{n}, text: Hi., instruct: Calm.}}\n" for n in range(MAX_ITEMS)),
              f"line 7: a session has at most {MAX_ITEMS} items."),
    "systems": (SESSION.replace("items:", "".join(f"  - {{name: s{n}, checkpoint: tiny, mode: voice_design}}\n" for n in range(MAX_SYSTEMS)) + "items:"),
                f"line 4: a session has at most {MAX_SYSTEMS} systems."),
    "listeners": (SESSION + "listeners: [" + ", ".join(f"l{n}" for n in range(MAX_LISTENERS + 1)) + "]\n",
                  f"line 9: a session has at most {MAX_LISTENERS:,} listeners."),
    "aliases": (laughs() + SESSION.split("\n", 1)[1], "line 3: a session file uses no YAML aliases (*name): write the value out."),
    "list key": (SESSION + "? [a, b]\n: c\n", "line 9: a key is a name such as text:, not a list."),
    "mapping key": (SESSION + "? {a: b}\n: c\n", "line 9: a key is a name such as text:, not a mapping."),
    "number key": (SESSION + "1: one\nzebra: two\n", "line 9: the key '1' is not a name such as text:."),
    "list mode": (SESSION.replace("mode: voice_design}\n  - {name: b", "mode: [voice_design]}\n  - {name: b"),
                  "line 5: system 'a' needs a mode: one of custom_voice, voice_design, clone, clone_x_vector."),
    "list reference": (SESSION.replace("test: ab", "test: mushra\nreference: [a]"), "line 3: unknown system a list (systems: a, b)."),
    "list text": (SESSION.replace("text: Hello there.", "text: [Hello, there]"), "line 8: the text of item 'one' is text, not a list."),
    "nesting": (SESSION + "seed: " + "[" * 5000 + "]" * 5000 + "\n", "line 9: lists and mappings are nested more than 8 deep."),
    "values": (SESSION + "listeners:\n" + "".join(f"- l{n}\n" for n in range(MAX_NODES)),
               f"a session file holds at most {MAX_NODES:,} values."),
    "digits": (SESSION + "seed: " + "7" * 5000 + "\n", "line 9: the number '" + "7" * 60 + "…' has more than 30 digits."),
    "surrogate": (SESSION.replace("Hello there.", '"Hello \\udcff"'), "line 8: a value holds a lone surrogate escape (\\ud800-\\udfff), which is not text."),
    "control character": (SESSION.replace("Hello there.", "Hello\x00there."), "line 8: the character #x0000 is not allowed in a session file."),
    "long name": (SESSION.replace("name: demo", "name: " + "x" * 100_000),
                  "line 1: name '" + "x" * 60 + "…' must be 1-64 letters, digits, - or _."),
}


def write(folder: Path, text: str, name: str = "session.yaml") -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    return path


def test_the_base_session_is_valid(tmp_path):
    assert parse_session(SESSION, tmp_path).name == "demo"


@pytest.mark.parametrize("case", list(CASES))
def test_each_hostile_file_gets_its_sentence_from_the_library(case, tmp_path):
    text, sentence = CASES[case]
    with pytest.raises(SessionError) as error:
        parse_session(text, tmp_path)
    assert str(error.value).endswith(sentence) and len(str(error.value)) < 300


@pytest.mark.parametrize("case", list(CASES))
def test_each_hostile_file_gets_its_sentence_from_the_cli(case, tmp_path, capsys):
    text, sentence = CASES[case]
    assert main(["check", str(write(tmp_path, text))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: session.yaml ") and err.endswith(sentence + "\n") and err.count("\n") == 1


def test_a_list_key_is_one_sentence_from_the_real_cli(tmp_path):
    text, sentence = CASES["list key"]
    run = subprocess.run([sys.executable, "-m", "pipeline.listening", "check", str(write(tmp_path, text))], cwd=REPO, capture_output=True, check=False,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 2 and run.stderr == f"error: session.yaml {sentence}\n", run.stderr


def test_aliases_are_refused_before_anything_expands_them(tmp_path):
    """A tiny file of nested aliases: refused at its first alias, whatever the depth."""
    text = laughs(levels=30, width=2) + SESSION.split("\n", 1)[1]  # 2^30 'lol's if anything expanded it
    with pytest.raises(SessionError, match=r"^line 3: a session file uses no YAML aliases \(\*name\): write the value out\.$"):
        parse_session(text, tmp_path)
    merged = SESSION.replace("  - {name: b, checkpoint: tiny, mode: voice_design}", "  - &b {name: b, checkpoint: tiny, mode: voice_design}\n  - <<: *b")
    with pytest.raises(SessionError, match=r"^line 7: a session file uses no YAML aliases"):
        parse_session(merged, tmp_path)


def test_a_session_file_over_the_size_limit_is_refused_before_it_is_read(tmp_path, capsys):
    big = tmp_path / "session.yaml"
    with big.open("wb") as file:  # sparse: 10 MB that were never written
        file.truncate(10 * 1024 * 1024)
    assert main(["check", str(big)]) == 2
    assert capsys.readouterr().err == f"error: The session file {big} is 10,485,760 bytes long; a session file is at most {MAX_FILE_BYTES:,} bytes.\n"
    assert main(["check", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: The session file {tmp_path} is not a regular file.\n"


def test_the_page_and_a_saved_session_have_the_same_size_limit(tmp_path):
    sessions = Sessions(tmp_path, None)
    padded = SESSION + "#" * MAX_FILE_BYTES + "\n"  # a comment: valid YAML, only too long
    with pytest.raises(SessionError, match=f"^session file is over {MAX_FILE_BYTES:,} bytes long, the most a session file may be.$"):
        sessions.check(padded)
    sessions.save(SESSION)
    (tmp_path / "demo" / "session.yaml").write_text(padded, encoding="utf-8")  # grown on disk
    with pytest.raises(SessionError, match=f"is {len(padded):,} bytes long; a session file is at most {MAX_FILE_BYTES:,} bytes.$"):
        sessions.session("demo")


@pytest.mark.parametrize("case", ["trials", "aliases", "list key", "number key", "digits", "surrogate"])
def test_the_page_check_gets_the_same_sentence(case, tmp_path):
    text, sentence = CASES[case]
    with pytest.raises(SessionError) as error:
        Sessions(tmp_path, None).check(text)
    assert str(error.value) == f"session file {sentence}"


# ---- paths outside the sessions folder -------------------------------------------------------------

@pytest.fixture
def layout(tmp_path):
    """A sessions folder with recordings inside it, and recordings and a voice outside it."""
    root, outside = tmp_path / "sessions", tmp_path / "outside-secret"
    for folder in (root / "human", root / "other", outside):
        folder.mkdir(parents=True)
        sf.write(folder / "one.wav", voice_like(1.0), 24000)
    sf.write(outside / "voice.wav", voice_like(3.0), 24000)
    return root, outside


def folders(first: str, second: str = "other") -> str:
    return SESSION.replace("{name: a, checkpoint: tiny, mode: voice_design}", f"{{name: a, folder: '{first}'}}") \
                  .replace("{name: b, checkpoint: tiny, mode: voice_design}", f"{{name: b, folder: '{second}'}}")


OUTSIDE = "session file line 5: the folder of system 'a' is outside the sessions folder; recordings and reference voices go inside it."


def test_recordings_inside_the_sessions_folder_are_fine(layout):
    root, _ = layout
    assert [s.folder for s in Sessions(root, None).check(folders("human")).systems] == [root / "human", root / "other"]


def test_a_path_outside_is_refused_from_its_text_alone(layout, monkeypatch):
    """The same sentence whether the place outside exists, holds recordings or not, is reached by
    `..`, an absolute path or a symlink, and nothing outside is looked at before the refusal."""
    root, outside = layout
    (root / "link").symlink_to(outside)
    looked_at = []
    real_stat = Path.stat
    monkeypatch.setattr(Path, "stat", lambda self, **kw: (looked_at.append(self), real_stat(self, **kw))[1])
    sessions = Sessions(root, None)
    for place in ("../outside-secret", str(outside), "../missing", "/etc", "link", "human/../../outside-secret"):
        with pytest.raises(SessionError) as error:
            sessions.check(folders(place))
        assert str(error.value) == OUTSIDE, place
    assert not [p for p in looked_at if not Path(os.path.abspath(p)).is_relative_to(root)]


def test_a_symlinked_recording_or_voice_outside_is_refused(layout):
    root, outside = layout
    (root / "other" / "one.wav").unlink()
    (root / "other" / "one.wav").symlink_to(outside / "one.wav")
    sessions = Sessions(root, None)
    with pytest.raises(SessionError, match="^session file line 6: the recording of item 'one' of system 'b' is outside the sessions folder;"):
        sessions.check(folders("human"))
    clone = SESSION.replace("voice_design", "clone_x_vector").replace("instruct: A calm voice.", "reference_audio: ../outside-secret/voice.wav")
    with pytest.raises(SessionError, match="^session file line 8: the reference audio of item 'one' is outside the sessions folder;"):
        sessions.check(clone)


# ---- what the page echoes is text ----------------------------------------------------------------

def test_error_toasts_show_markup_as_text():
    from ui.errors import input_error

    assert input_error(f"not '{LINK}'").message == "not '&lt;a href=https://example.com/&gt;press here&lt;/a&gt;'"
    assert "<" not in input_error(IMAGE).message and input_error("a & b").message == "a &amp; b"


def test_warning_toasts_show_markup_as_text():
    from ui.errors import warn

    with pytest.warns(UserWarning) as caught:  # outside a request gradio hands a warning to `warnings`
        warn(f"speaker {IMAGE} is unknown")
    assert str(caught[0].message) == "speaker &lt;img src=x onerror=alert(1)&gt; is unknown"


def ui_function(sessions: Sessions, api_name: str):
    """The function behind one of the listening tab's events, as gradio calls it."""
    from ui import listening

    with gr.Blocks() as demo:
        listening.build(sessions)
    return next(f.fn for f in demo.fns.values() if f.api_name == api_name)


def test_the_check_button_echoes_a_file_value_as_text(tmp_path):
    check = ui_function(Sessions(tmp_path, None), "session_check")
    with pytest.raises(gr.Error) as error:
        check(SESSION.replace("test: ab", f'test: "{LINK}"'))
    assert error.value.message.startswith("session file line 2: test must be one of ab, abx, mushra, not '&lt;a href=")
    assert "<" not in error.value.message
    with pytest.raises(gr.Error, match="line 9: a key is a name such as text:, not a list."):  # once `unhashable type: 'list'`
        check(CASES["list key"][0])


def link(query: bytes):
    from ui.listening import from_link

    return from_link(gr.Request(Request({"type": "http", "method": "GET", "path": "/", "query_string": query, "headers": []})))


def test_a_share_link_fills_in_a_session_name_and_a_listener_id():
    assert link(b"session=demo&listener=ann") == ("demo", "ann")


def test_a_crafted_share_link_fills_in_nothing_and_echoes_nothing():
    with pytest.warns(UserWarning) as caught:
        crafted = link(b"session=%3Ca%20href%3Dhttps%3A%2F%2Fexample.com%2F%3Epress%3C%2Fa%3E&listener=ann")
    assert crafted == ("", "") and "example.com" not in str(caught[0].message)
    assert str(caught[0].message) == "This link's session is not a session name (1-64 letters, digits, - or _): ask the organizer for the link again."
    with pytest.warns(UserWarning, match="listener id is not an id"):
        assert link(b"session=demo&listener=%3Cimg%20src%3Dx%20onerror%3Dalert(1)%3E") == ("demo", "")


def test_a_name_that_is_not_a_session_name_is_not_echoed(tmp_path):
    with pytest.raises(SessionError) as error:
        Sessions(tmp_path, None).trial(LINK, "ann")
    assert str(error.value) == "There is no listening session of that name: session names are 1-64 letters, digits, - or _."


def test_a_typed_speaker_and_language_show_as_text(tiny_checkpoints):
    """The speech tabs' errors echo the speaker or language typed: as text."""
    from pipeline.service import TINY, ModelService
    from ui.app import build_demo

    service = ModelService(tiny=True, tiny_dir=Path(tiny_checkpoints["base"]).parent)
    generate = next(f.fn for f in build_demo(service).fns.values() if f.api_name == "custom_generate")
    advanced = (0.9, 50, 1.0, 1.05, 7, "1, 2, 4, 8, 16", 2)  # temperature .. seed, schedule, max length
    for field, value in (("speaker", IMAGE), ("language", LINK)):
        fields = {"name": TINY, "speaker": service.info("custom_voice").speakers[0], "instruct": "", "text": "Hello.", "language": "auto", field: value}
        with pytest.raises(gr.Error) as error:
            list(generate(*fields.values(), *advanced, "", gr.Request(), gr.Progress()))
        assert html.escape(value, quote=False) in error.value.message and "<" not in error.value.message
