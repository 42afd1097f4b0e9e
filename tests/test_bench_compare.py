"""benchmarks.compare on CPU, at tiny sizes: the checkpoint it writes loads in ours and in the
official package with every tensor and gives both the same greedy codes, every frame asked for; its
real-size configs build the same tensors in both; ours and the official path measure through the
same functions as on the GPU; the report (markdown, merge, PNG) renders. The official code runs in a
process of its own, on the transformers it needs (tests/reference_runner.py)."""
import copy
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from benchmarks import compare as bc
from pipeline.request import SpeechRequest
from pipeline.tiny import TINY_SPEECH_TOKENIZER_CONFIG, tiny_config, write_tiny_text_tokenizer
from pipeline.tts import TTS

FRAMES = 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    return {kind: bc.write_random_checkpoint(root / kind, kind, tiny_config, TINY_SPEECH_TOKENIZER_CONFIG) for kind in bc.TYPES}


@pytest.mark.parametrize("kind", bc.TYPES)
def test_official_loads_every_written_tensor(checkpoints, official_runner, kind):
    # from_pretrained only warns about missing or unexpected weights: compare them all here.
    state, meta = official_runner.run("official_state", path=str(checkpoints[kind]))
    for prefix, file in (("model.", checkpoints[kind] / "model.safetensors"),
                         ("tokenizer.", checkpoints[kind] / "speech_tokenizer" / "model.safetensors")):
        written = load_file(file)
        loaded = {name.removeprefix(prefix): t for name, t in state.items() if name.startswith(prefix)}
        assert set(loaded) == set(written)
        for name, tensor in written.items():
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
    head = state["model.talker.codec_head.weight"]
    assert not head[meta["eos"]].any() and head.any()


def test_same_greedy_codes_and_every_frame(checkpoints, official_runner):
    text = bc.TEXT_20_WORDS
    ours = TTS.from_pretrained(str(checkpoints["custom_voice"]))
    codes = ours.synthesize(SpeechRequest(text, speaker=bc.SPEAKER, language=bc.LANGUAGE, greedy=True, max_frames=FRAMES)).codes
    kwargs = dict(text=text, speaker=bc.SPEAKER, language=bc.LANGUAGE, do_sample=False, subtalker_dosample=False, max_new_tokens=FRAMES + 1)
    reference = official_runner.run("official_codes", path=str(checkpoints["custom_voice"]), kwargs=kwargs)[0]["codes"]
    assert codes.shape == (FRAMES, 16)  # EOS never won: every frame asked for
    np.testing.assert_array_equal(codes, reference.numpy())


@pytest.mark.parametrize("size", list(bc.SIZES))
def test_real_size_tensors_are_the_official_ones(tmp_path, size, official_runner):
    """The real-size config.json and speech_tokenizer/config.json build the same tensor names and
    shapes in ours and in the official classes (on the meta device: nothing is allocated)."""
    from pipeline.codec import SpeechTokenizer, SpeechTokenizerConfig
    from pipeline.model import Qwen3TTS, TTSConfig

    def shapes(module):
        return {name: list(t.shape) for name, t in module.state_dict().items()}

    special_ids = write_tiny_text_tokenizer(tmp_path)
    codec = bc.real_speech_tokenizer_config()
    for kind in bc.TYPES:
        config = bc.real_size_config(size, kind, special_ids)
        reference = official_runner.run("official_shapes", config=copy.deepcopy(config), codec=copy.deepcopy(codec))[1]
        with torch.device("meta"):
            ours = shapes(Qwen3TTS(TTSConfig.from_dict(config)))
        assert ours == reference["model"]
    with torch.device("meta"):
        ours = shapes(SpeechTokenizer(SpeechTokenizerConfig.from_dict(codec)))
    assert ours == reference["codec"]


@pytest.fixture(scope="module")
def measured(checkpoints, official_runner):
    """Ours (1 and 8 streams) and the official path on both checkpoints, through the GPU run's functions
    (the official one, bench_official, in the reference's process)."""
    results = []
    for kind in bc.TYPES:
        inputs = bc.Inputs.for_type(kind)
        runs = dict(bc.bench_ours(checkpoints[kind], kind, inputs, FRAMES, 1, 2, device="cpu", compiled=False))
        official = official_runner.run("official_bench", path=str(checkpoints[kind]), model_type=kind, frames=FRAMES, runs=1, warm_frames=2)[1]
        runs.update((key, [bc.Run(**run) for run in measured]) for key, measured in official.items())
        results += [bc.Result("tiny", kind, key, FRAMES, bc.OUR_STREAMS if key == "ours_8" else 1, r) for key, r in runs.items()]
    return results


def test_every_system_makes_the_frames_asked_for(measured):
    assert {(r.model_type, r.key) for r in measured} == {(kind, key) for kind in bc.TYPES for key in ("ours_1", "ours_8", "official")}
    for result in measured:
        (run,) = result.runs
        assert run.frames == FRAMES and sum(run.chunk_frames) == FRAMES, result.key
        assert 0 < run.ttfa_s <= run.wall_s
        assert result.summary()["all_frames_made"]
    ours = next(r for r in measured if r.key == "ours_1").runs[0]
    assert ours.chunk_frames == [1, 2, 3]  # streamed on the default schedule (1, 2, 4, ...), cut at 6 frames
    official = next(r for r in measured if r.key == "official").runs[0]
    assert official.chunk_frames == [FRAMES] and official.ttfa_s == official.wall_s  # nothing streams


def report_of(results, command="python -m benchmarks.compare --out x"):
    return {"gpu": "CPU", "date": "2026-01-01", "commands": [command], "versions": bc.versions(), "frames": FRAMES,
            "runs": 1, "warm_frames": 2, "rows": 8, "text": bc.TEXT_20_WORDS, "text_tokens": 30, "checkpoint_write_s": {},
            "results": [r.to_json() for r in results]}


def test_report(measured, tmp_path):
    failed = bc.Result("tiny", "base", "faster", FRAMES, error="RuntimeError: CUDA graphs require CUDA device")
    streamed = bc.Result("tiny", "base", "faster_chunk8", FRAMES, runs=[bc.Run(0.5, FRAMES, 0.1, [0.1, 0.5], [4, 2])])
    report = report_of([*measured, failed, streamed])
    table = bc.markdown(json.loads(json.dumps(report)))  # as written and read back
    assert "#### tiny custom voice" in table and "#### tiny base" in table
    assert "| faster-qwen3-tts (not streaming) | error: RuntimeError: CUDA graphs require CUDA device |" in table
    row = next(line for line in table.splitlines() if line.startswith("| faster-qwen3-tts streaming, chunk 8"))
    ours = next(r for r in measured if (r.model_type, r.key) == ("base", "ours_1")).summary()
    assert f"| {bc.ratio(ours['ms_per_frame'], 500 / FRAMES)} | {bc.ratio(ours['ttfa_ms'], 100)} |" in row  # ours / this

    # A later run of the same system on the same checkpoint replaces the earlier one.
    faster_again = bc.Result("tiny", "base", "faster", FRAMES, runs=[bc.Run(2.0, FRAMES, 2.0, [2.0], [FRAMES])])
    (tmp_path / "a.json").write_text(json.dumps(report))
    (tmp_path / "b.json").write_text(json.dumps(report_of([faster_again], "second")))
    merged = bc.merge([tmp_path / "a.json", tmp_path / "b.json"])
    assert merged["commands"] == ["python -m benchmarks.compare --out x", "second"]
    assert len(merged["results"]) == len(measured) + 2
    assert "error" not in next(line for line in bc.markdown(merged).splitlines() if line.startswith("| faster-qwen3-tts (not streaming)"))

    pytest.importorskip("matplotlib")
    bc.write_outputs(tmp_path / "out", "merged", merged)
    assert (tmp_path / "out" / "merged.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_names_the_commit_and_the_tree_of_the_files_as_they_are(tmp_path, monkeypatch):
    """A report names the commit and the tree hash of the files as run: a copy of the work tree on
    a machine whose .git is older (the GPU machine's) still names the commit that holds exactly
    those files, by its tree; a changed or new file reads as dirty."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, capture_output=True, text=True,
                              check=True).stdout.strip()

    monkeypatch.chdir(tmp_path)
    git("init", "-q")
    (tmp_path / "a.py").write_text("one\n")
    git("add", "a.py")
    git("commit", "-qm", "first")
    first = git("rev-parse", "--short", "HEAD")
    assert bc.commit() == f"{first}, tree {git('rev-parse', 'HEAD^{tree}')[:12]}"
    (tmp_path / "b.py").write_text("two\n")  # a file the old .git does not know yet
    stale = bc.commit()
    assert stale.startswith(f"{first}, tree ") and stale.endswith(" (dirty)")
    git("add", "b.py")
    git("commit", "-qm", "second")
    assert stale == f"{first}, tree {git('rev-parse', 'HEAD^{tree}')[:12]} (dirty)"  # the tree of the commit that holds the files
    assert not git("status", "--porcelain")  # the scratch index left the repository's own alone
    monkeypatch.chdir("/")
    assert bc.commit() is None
