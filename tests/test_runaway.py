"""No runaway speech: tiny checkpoints edited to never end (the codec head's end-of-speech row zeroed:
it scores below the ~1000 codes that score above 0, never among the top 50 sampled from) and to loop (a
codec head that scores every code alike, so that greedy decoding repeats code 0), run on the real engine
on CPU. The stream ends at the text's frame budget or after the loop, with one warning sentence that the
library, the CLI and the HTTP API hand on."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.engine.scheduler import LOOP_FRAMES, frame_budget
from pipeline.request import SpeechRequest
from pipeline.tts import TTS

REPO = Path(__file__).resolve().parents[1]
TEXT = "Hello there."
EOS = 2150  # the tiny checkpoints' codec_eos_token_id
RELEASED_MAX_NEW_TOKENS = 2048  # the released checkpoints' limit (the tiny ones stop at 100 frames, inside any text budget)


def edited_checkpoint(source: Path, target: Path, edit) -> Path:
    """A copy of a tiny checkpoint with `edit(codec_head_weight)` applied and the released checkpoints' frame limit."""
    shutil.copytree(source, target)
    weights = load_file(target / "model.safetensors")
    edit(weights["talker.codec_head.weight"])
    save_file(weights, target / "model.safetensors")
    config = json.loads((target / "generation_config.json").read_text())
    (target / "generation_config.json").write_text(json.dumps({**config, "max_new_tokens": RELEASED_MAX_NEW_TOKENS}))
    return target


def never_ends(head: torch.Tensor) -> None:
    head[EOS] = 0.0


def loops(head: torch.Tensor) -> None:
    head.zero_()  # every code scores 0: greedy decoding takes the first, code 0, every frame


@pytest.fixture(scope="module")
def endless(tiny_checkpoints, tmp_path_factory) -> Path:
    return edited_checkpoint(tiny_checkpoints["custom_voice"], tmp_path_factory.mktemp("endless") / "custom_voice", never_ends)


@pytest.fixture(scope="module")
def looping(tiny_checkpoints, tmp_path_factory) -> Path:
    return edited_checkpoint(tiny_checkpoints["custom_voice"], tmp_path_factory.mktemp("looping") / "custom_voice", loops)


def text_units(tts: TTS, request: SpeechRequest) -> int:
    """What the budget counts for the request's one segment: its text tokens, or its characters where those are not given."""
    job, _ = tts.prepare(request)
    (segment,) = job.segments
    return segment.text_tokens or segment.chars


def test_speech_that_never_ends_stops_at_the_texts_frame_budget(endless):
    tts = TTS.from_pretrained(str(endless), rows=1)
    request = SpeechRequest(TEXT, speaker="ryan", seed=1)
    result = tts.synthesize(request)
    budget = frame_budget(text_units(tts, request))
    assert len(result.codes) == budget < tts.default_max_frames()
    assert EOS not in result.codes[:, 0]
    ratio = budget / (4 * text_units(tts, request))
    assert result.warnings == [f"The model did not end the utterance; stopped after {budget / 12.5:.1f} s, {ratio:.1f}x the expected length."]


def test_speech_in_a_loop_stops_after_the_loop(looping):
    tts = TTS.from_pretrained(str(looping), rows=1)
    result = tts.synthesize(SpeechRequest(TEXT, speaker="ryan", greedy=True))
    assert result.codes.shape[0] == LOOP_FRAMES and not result.codes[:, 0].any()
    assert result.warnings == [f"The speech fell into a loop (one frame repeated for {LOOP_FRAMES} frames, 6 s); stopped after 6.0 s."]


def test_streamed_text_grows_the_budget_as_it_arrives(endless):
    """Text given a position at a time has no length up front: each position that arrives adds to the budget."""
    tts = TTS.from_pretrained(str(endless), rows=1)
    job, _ = tts.prepare(SpeechRequest(TEXT, speaker="ryan", seed=2))
    segment = job.segments[0]
    pad = segment.trailing[:1]
    streamed = dataclasses.replace(job, segments=[dataclasses.replace(segment, text_end=False, chars=0, text_tokens=0)])
    handle = tts.engine.submit(streamed)
    chunks = iter(handle)
    next(chunks)  # it speaks its one text position, then waits
    handle.append_text(pad.expand(4, -1), end=True)
    list(chunks)
    assert len(handle.codes) == frame_budget(5)
    assert handle.warnings[0].startswith("The model did not end the utterance; stopped after 12.8 s")


def test_synth_prints_the_warning(endless, tmp_path):
    out = tmp_path / "out.wav"
    result = subprocess.run([sys.executable, "-m", "pipeline", "synth", "--model", str(endless), "--text", TEXT, "--speaker", "Ryan", "--seed", "1",
                             "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert "warning: The model did not end the utterance; stopped after" in result.stderr and out.exists()


def test_the_speech_api_returns_the_warning(endless):
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from pipeline.server import Access, speech_routes
    from pipeline.service import ModelService

    service = ModelService({"custom_voice": (str(endless),)})
    client = TestClient(Starlette(routes=speech_routes(service, Access())))
    response = client.post("/v1/audio/speech", json={"input": TEXT, "voice": "ryan", "response_format": "wav", "seed": 1})
    assert response.status_code == 200, response.text
    (warning,) = json.loads(response.headers["X-Warnings"])
    assert warning.startswith("The model did not end the utterance; stopped after")
