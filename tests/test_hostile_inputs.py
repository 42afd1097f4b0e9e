"""Hostile and malformed input on every surface gets one sentence before any work: a JSON 4xx from the
API (never a 500 in plain text), a per-line error in synth-batch (the good lines still produce their
output), exit 2 from the CLI before the weights load, gr.Error in the UI; the same request field
gets the same sentence on every surface; a checkpoint's config file of the wrong JSON type anywhere
is one sentence (exit 3), never a traceback."""
import copy
import html
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import gradio as gr
import httpx
import numpy as np
import pytest

from pipeline.__main__ import EXIT_BAD_CHECKPOINT, EXIT_BAD_INPUT, main
from pipeline.errors import CheckpointError, TTSInputError
from pipeline.request import MAX_SEED, SpeechRequest
from pipeline.service import TINY, ChatRequest, Turn
from ui import controls

REPO = Path(__file__).resolve().parents[1]
SPEECH, CHAT = "/v1/audio/speech", "/v1/chat/completions"
TINY_FRAME_LIMIT = 100  # the tiny checkpoints' generation_config: max_new_tokens 101


@pytest.fixture(scope="module")
def api(live_app):
    url, service, _ = live_app
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client, service


def post_raw(client: httpx.Client, path: str, body: bytes, content_type: str | None = "application/json") -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": content_type} if content_type else {})


def speech_body(extra: bytes = b"") -> bytes:
    return b'{"input": "Hello.", "voice": "ryan", "max_new_tokens": 3' + extra + b"}"


def chat_body(extra: bytes = b"", content: bytes = b'"Hello."') -> bytes:
    return b'{"messages": [{"role": "user", "content": ' + content + b'}], "max_tokens": 2' + extra + b"}"


HOSTILE_BODIES = [  # (path, raw JSON body, the field the error names)
    (SPEECH, b'{"input": "hi \\udcff", "voice": "ryan"}', "input"),
    (SPEECH, speech_body(b', "language": "\\udcff"'), "language"),
    (SPEECH, b'{"input": "Hello.", "voice": "ryan \\ud800"}', "voice"),
    (SPEECH, speech_body(b', "temperature": 1' + b"0" * 400), "temperature"),
    (SPEECH, speech_body(b', "seed": 1' + b"0" * 4400), "seed"),
    (CHAT, chat_body(content=b'"hi \\udcff"'), "messages[0].content"),
    (CHAT, chat_body(content=b'[{"type": "text", "text": "\\udcff"}]'), "messages[0].content[0].text"),
    (CHAT, chat_body(b', "temperature": 1' + b"0" * 400), "temperature"),
    (CHAT, chat_body(b', "seed": 1' + b"0" * 4400), "seed"),
]


@pytest.mark.parametrize("path, body, field", HOSTILE_BODIES)
def test_hostile_json_is_a_json_400_naming_the_field(api, path, body, field):
    client, _ = api
    response = post_raw(client, path, body)
    assert response.status_code == 400 and response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["param"] == field and error["message"].startswith(field) and "\n" not in error["message"]


@pytest.mark.parametrize("path", [SPEECH, CHAT])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_declared_json_is_415(api, path, content_type):
    """What a page on another site can send without the browser asking first never starts generation."""
    client, _ = api
    response = post_raw(client, path, speech_body() if path == SPEECH else chat_body(), content_type)
    assert response.status_code == 415 and "Content-Type: application/json" in response.json()["error"]["message"]


def raw_request(url: str, head: bytes, body_pieces) -> bytes:
    """Send a request by hand (headers, then body pieces, stopping if the server answers) and read the answer."""
    address = urlparse(url)
    with socket.create_connection((address.hostname, address.port), timeout=120) as sock:
        sock.sendall(head)
        try:
            for piece in body_pieces:
                sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):  # the server answered and closed: the answer is still to read
            pass
        answer = b""
        while b"\r\n\r\n" not in answer and (data := sock.recv(65536)):
            answer += data
    return answer


def test_a_declared_oversized_body_is_413_before_it_is_sent(live_app):
    url, _, _ = live_app
    head = (f"POST {SPEECH} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {400 * 2**20}\r\n\r\n").encode()
    answer = raw_request(url, head, [b'{"input": "'])  # 400 MB promised, 11 bytes sent: the answer cannot wait for the rest
    assert answer.startswith(b"HTTP/1.1 413")


def test_a_chunked_body_is_refused_once_it_passes_the_limit(live_app):
    url, _, _ = live_app
    head = f"POST {SPEECH} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    mb = b"x" * 2**20
    pieces = [b"%x\r\n%s\r\n" % (len(mb), mb) for _ in range(51)]  # 51 MB and never the final chunk: only a limit met mid-stream answers
    assert raw_request(url, head, pieces).startswith(b"HTTP/1.1 413")


def test_max_new_tokens_over_the_checkpoints_limit_is_refused(api):
    client, service = api
    response = client.post(SPEECH, json={"input": "Hello.", "voice": "ryan", "max_new_tokens": 10_000_000})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_new_tokens"
    assert error["message"] == f"max_frames (max_new_tokens in the API) must be at most {TINY_FRAME_LIMIT} for this checkpoint (8.0 s), not 10000000."
    ok = client.post(SPEECH, json={"input": "Hello.", "voice": "ryan", "max_new_tokens": TINY_FRAME_LIMIT, "response_format": "pcm", "seed": 1})
    assert ok.status_code == 200


def ui_error(service, request: SpeechRequest) -> str:
    """The message the UI's generation handler shows for `request` (as the page displays it)."""
    with pytest.raises(gr.Error) as raised:
        controls.open_stream(service.stream(request))
    return html.unescape(raised.value.message)


def test_the_ui_refuses_a_max_length_over_the_checkpoints_limit(api):
    _, service = api
    fields = controls.sampling_fields(0.9, 50, 1.0, 1.05, None, "1, 2", 9)  # 9 s: 112 frames
    message = ui_error(service, SpeechRequest("Hello.", model_type="custom_voice", checkpoint=TINY, speaker="ryan", **fields))
    assert message == f"max_frames (max_new_tokens in the API) must be at most {TINY_FRAME_LIMIT} for this checkpoint (8.0 s), not 112."


# ---- the same field, the same sentence, on every surface ----------------------------------------------

def seed_sentence(value) -> str:
    return f"seed must be a whole number from 0 to {MAX_SEED} (got {value})."


@pytest.mark.parametrize("seed", [-1, MAX_SEED + 1, 2**64])
def test_a_bad_seed_gets_the_same_sentence_everywhere(api, capsys, monkeypatch, tmp_path, seed):
    client, service = api
    expected = seed_sentence(seed)
    assert client.post(SPEECH, json={"input": "Hi.", "voice": "ryan", "seed": seed}).json()["error"]["message"] == expected
    assert client.post(CHAT, json={"messages": [{"role": "user", "content": "Hi."}], "seed": seed}).json()["error"]["message"] == expected
    for typed in (str(seed), str(float(seed))):  # the Seed box sends the text typed
        fields = controls.sampling_fields(0.9, 50, 1.0, 1.05, typed, "1, 2", controls.MAX_SECONDS)
        assert ui_error(service, SpeechRequest("Hi.", model_type="custom_voice", checkpoint=TINY, speaker="ryan", **fields)) == expected
    with pytest.raises(TTSInputError, match=f"^{expected.replace('(', '.').replace(')', '.')}$"):
        ChatRequest([Turn("user", "Hi.")], seed=int(float(seed))).validate()  # the Omni tab's request
    never_loaded(monkeypatch)
    for command in (["synth", "--model", "unused"], ["chat", "--model", "unused"]):
        assert main([*command, "--text", "Hi.", "--seed", str(seed), "--out", str(tmp_path / "o.wav")]) == EXIT_BAD_INPUT
        assert capsys.readouterr().err == f"error: {expected}\n"


@pytest.mark.parametrize("top_p", [0.0, 1.5])
def test_a_bad_top_p_gets_the_same_sentence_everywhere(api, capsys, monkeypatch, tmp_path, top_p):
    client, service = api
    expected = f"top_p must be a number in (0, 1] (got {top_p})."
    assert client.post(SPEECH, json={"input": "Hi.", "voice": "ryan", "top_p": top_p}).json()["error"]["message"] == expected
    assert client.post(CHAT, json={"messages": [{"role": "user", "content": "Hi."}], "top_p": top_p}).json()["error"]["message"] == expected
    fields = controls.sampling_fields(0.9, 50, top_p, 1.05, None, "1, 2", controls.MAX_SECONDS)
    assert ui_error(service, SpeechRequest("Hi.", model_type="custom_voice", checkpoint=TINY, speaker="ryan", **fields)) == expected
    never_loaded(monkeypatch)
    assert main(["synth", "--model", "unused", "--text", "Hi.", "--top-p", str(top_p), "--out", str(tmp_path / "o.wav")]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == f"error: {expected}\n"


def test_voice_design_without_a_description_is_refused_everywhere(api, tiny_checkpoints, capsys, tmp_path):
    client, service = api
    expected = "Voice design needs a voice description (the instruction): describe the voice to speak in."
    response = client.post(SPEECH, json={"input": "Hi.", "task_type": "VoiceDesign", "instructions": " "})
    assert response.status_code == 400 and response.json()["error"] == {**response.json()["error"], "message": expected, "param": "instructions"}
    fields = controls.sampling_fields(0.9, 50, 1.0, 1.05, None, "1, 2", controls.MAX_SECONDS)
    assert ui_error(service, SpeechRequest("Hi.", model_type="voice_design", checkpoint=TINY, instruct="", **fields)) == expected
    out = tmp_path / "o.wav"
    assert main(["synth", "--model", str(tiny_checkpoints["voice_design"]), "--text", "Hi.", "--out", str(out)]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == f"error: {expected}\n" and not out.exists()


# ---- the command line -----------------------------------------------------------------------------------

def never_loaded(monkeypatch) -> None:
    import pipeline.omni
    import pipeline.tts

    def never(*args, **kwargs):
        raise AssertionError("the weights were loaded before the request was checked")

    monkeypatch.setattr(pipeline.tts.TTS, "from_pretrained", never)
    monkeypatch.setattr(pipeline.omni.OmniChat, "from_pretrained", never)


def test_invalid_utf8_in_the_text_is_exit_2_before_loading(tmp_path):
    """On Linux an argument's undecodable byte reaches Python as a lone surrogate."""
    result = subprocess.run([sys.executable, "-m", "pipeline", "synth", "--model", str(tmp_path / "none"), "--text".encode(), b"hi \xff there",
                             "--out", str(tmp_path / "o.wav")], cwd=REPO, capture_output=True, timeout=300)
    err = result.stderr.decode()
    assert result.returncode == EXIT_BAD_INPUT and "Traceback" not in err
    assert err == "error: text holds the lone surrogate \\udcff (an invalid UTF-8 byte, or half of a \\u escape pair), which is not text.\n"


def test_chat_refuses_control_tokens_before_the_weights_load(tiny_omni, monkeypatch, capsys, tmp_path):
    never_loaded(monkeypatch)
    code = main(["chat", "--model", str(tiny_omni), "--text", "Hi <|im_end|> there", "--out", str(tmp_path / "r.wav")])
    assert code == EXIT_BAD_INPUT and "control token <|im_end|>" in capsys.readouterr().err


def test_synth_batch_reports_hostile_lines_and_still_speaks_the_good_ones(tiny_checkpoints, tmp_path, capsys):
    lines = [
        '{"name": "good", "text": "Hello.", "speaker": "ryan", "max_frames": 3, "seed": 1}',
        '{"name": "surrogate", "text": "hi \\udcff", "speaker": "ryan"}',
        '{"name": "huge", "text": "Hi.", "speaker": "ryan", "temperature": 1' + "0" * 400 + "}",
        '{"name": "digits", "text": "Hi.", "speaker": "ryan", "seed": 1' + "0" * 4400 + "}",
        '{"name": "long", "text": "Hi.", "speaker": "ryan", "max_frames": 10000000}',
    ]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(lines) + "\n", encoding="utf-8")
    code = main(["synth-batch", "--model", str(tiny_checkpoints["custom_voice"]), "--requests", str(requests), "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and "Traceback" not in err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["good.codes.npy", "good.wav"]
    assert np.load(tmp_path / "out" / "good.codes.npy").shape == (3, 16)
    assert "error: line 2 (?): text holds the lone surrogate \\udcff" in err
    assert "error: line 3 (?): temperature is a number of 401 digits; no field takes a number of over 308 digits." in err
    assert "error: line 4 (?): seed is a number of 4401 digits" in err
    assert f"error: line 5 (long): max_frames (max_new_tokens in the API) must be at most {TINY_FRAME_LIMIT} for this checkpoint" in err


def test_make_tiny_into_a_file_or_an_unwritable_place_is_one_sentence(tmp_path, capsys):
    existing = tmp_path / "a-file"
    existing.write_text("keep me")
    assert main(["make-tiny", "--type", "base", str(existing)]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == f"error: Cannot write into {existing}: it is a file, not a directory.\n"
    assert existing.read_text() == "keep me"
    assert main(["make-tiny", "--type", "base", "/proc/tiny-checkpoint"]) == EXIT_BAD_INPUT  # procfs takes no new files, not even root's
    err = capsys.readouterr().err
    assert err.startswith("error: Cannot write into /proc/tiny-checkpoint") and err.count("\n") == 1


# ---- config files of the wrong JSON type ----------------------------------------------------------------

def test_a_talker_config_that_is_a_string_is_exit_3(tiny_checkpoints, tmp_path, capsys):
    checkpoint = shutil.copytree(tiny_checkpoints["custom_voice"], tmp_path / "cv")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "talker_config": "oops"}))
    code = main(["synth", "--model", str(checkpoint), "--text", "Hi.", "--speaker", "ryan", "--out", str(tmp_path / "o.wav")])
    assert code == EXIT_BAD_CHECKPOINT
    assert capsys.readouterr().err == f"error: {checkpoint / 'config.json'}: talker_config is a string; it should be an object ({{\"key\": value, ...}}).\n"


def nodes(value, path=()):
    """Every value of a JSON tree with its path (the root's is ())."""
    yield path, value
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from nodes(child, (*path, key))


def of_another_type(value):
    """A value of another JSON type: a string for an object, an object for a number or an array, ... (None for null)."""
    if isinstance(value, dict):
        return "not an object"
    if isinstance(value, bool):
        return "yes"
    if isinstance(value, (int, float, list)):
        return {"not": "this"}
    if isinstance(value, str):
        return 7
    return None


def replaced(tree, path, value):
    if not path:
        return value
    tree = copy.deepcopy(tree)
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return tree


def tts_config_phase(directory: Path) -> None:
    from pipeline.config_types import check_config
    from pipeline.loading import TTS_CONFIG, read_json
    from pipeline.model import TTSConfig

    raw = read_json(directory, "config.json")
    check_config(directory / "config.json", raw, TTS_CONFIG)
    TTSConfig.from_dict(raw)


def speech_tokenizer_config_phase(directory: Path) -> None:
    from pipeline.codec.tokenizer import _read_config

    _read_config(directory / "speech_tokenizer")


def omni_config_phase(directory: Path) -> None:
    from pipeline.omni.chat import read_config
    from pipeline.omni.code2wav import Code2WavConfig
    from pipeline.omni.prompt import PromptIds
    from pipeline.omni.talker import OmniTalkerConfig

    config = read_config(directory)
    PromptIds.from_config(config)
    OmniTalkerConfig.from_dict(config.get("talker_config") or {})
    Code2WavConfig.from_dict(config.get("code2wav_config") or {})


def full_load(kind: str, directory: Path) -> None:
    if kind == "omni":
        from pipeline.omni import OmniChat

        OmniChat.from_pretrained(str(directory))
    else:
        from pipeline.tts import TTS

        TTS.from_pretrained(str(directory))


CONFIG_FILES = [("tts", "config.json", tts_config_phase), ("tts", "speech_tokenizer/config.json", speech_tokenizer_config_phase),
                ("omni", "config.json", omni_config_phase)]


@pytest.mark.parametrize("kind, name, config_phase", CONFIG_FILES, ids=["tts-config", "speech-tokenizer-config", "omni-config"])
def test_every_config_value_of_the_wrong_type_is_one_sentence(kind, name, config_phase, tiny_checkpoints, tiny_omni, tmp_path):
    """Each value of the file, one at a time, replaced by one of another JSON type: the config's reading
    refuses it with one CheckpointError naming the file and the key, or takes it (a key no loader reads).
    The values it takes are then all replaced at once, and the whole checkpoint must load (one load,
    not one per value: this test takes seconds)."""
    source = tiny_omni if kind == "omni" else tiny_checkpoints["custom_voice"]
    checkpoint = shutil.copytree(source, tmp_path / kind)
    original = json.loads((checkpoint / name).read_text())
    taken, refused = [], 0
    for path, value in nodes(original):
        wrong = of_another_type(value)
        if wrong is None:
            continue
        (checkpoint / name).write_text(json.dumps(replaced(original, path, wrong)))
        try:
            config_phase(checkpoint)
        except CheckpointError as exc:
            assert str(exc).startswith(str(checkpoint / name)) and "\n" not in str(exc), (path, str(exc))
            refused += 1
        else:
            taken.append((path, wrong))
    assert refused > len(taken)  # most values are read
    combined, paths = original, {path for path, _ in taken}
    for path, wrong in taken:
        if not any(path[:n] in paths for n in range(len(path))):  # a value inside another taken one goes with it
            combined = replaced(combined, path, wrong)
    (checkpoint / name).write_text(json.dumps(combined))
    full_load(kind, checkpoint)
