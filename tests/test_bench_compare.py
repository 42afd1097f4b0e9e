"""pipeline.bench_compare on CPU, at tiny sizes: the checkpoint it writes loads in ours and in the
official package with every tensor and gives both the same greedy codes, every frame asked for; its
real-size configs build the same tensors in both; ours and the official path measure through the
same functions as on the GPU; the report (markdown, merge, PNG) renders."""
import copy
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline import bench_compare as bc
from pipeline.request import SpeechRequest
from pipeline.tiny import TINY_SPEECH_TOKENIZER_CONFIG, tiny_config, write_tiny_text_tokenizer
from pipeline.tts import TTS

FRAMES = 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    return {kind: bc.write_random_checkpoint(root / kind, kind, tiny_config, TINY_SPEECH_TOKENIZER_CONFIG) for kind in bc.TYPES}


@pytest.fixture(scope="module")
def official(checkpoints):
    return {kind: bc.load_official(path, "cpu") for kind, path in checkpoints.items()}


@pytest.mark.parametrize("kind", bc.TYPES)
def test_official_loads_every_written_tensor(checkpoints, official, kind):
    # from_pretrained only warns about missing or unexpected weights: compare them all here.
    model = official[kind].model
    for module, file in ((model, checkpoints[kind] / "model.safetensors"),
                         (model.speech_tokenizer.model, checkpoints[kind] / "speech_tokenizer" / "model.safetensors")):
        written, loaded = load_file(file), module.state_dict()
        assert set(loaded) == set(written)
        for name, tensor in written.items():
            torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)
    eos = model.config.talker_config.codec_eos_token_id
    assert not model.talker.codec_head.weight[eos].any() and model.talker.codec_head.weight.any()


def official_codes(reference, **kwargs) -> torch.Tensor:
    """The codes the official generate_custom_voice makes (its model's generate, spied on)."""
    captured = {}
    generate = reference.model.generate

    def spy(*args, **kw):
        out = generate(*args, **kw)
        captured["codes"] = out[0][0]
        return out

    reference.model.generate = spy
    try:
        reference.generate_custom_voice(**kwargs)
    finally:
        del reference.model.generate
    return captured["codes"]


def test_same_greedy_codes_and_every_frame(checkpoints, official):
    text = bc.TEXT_20_WORDS
    ours = TTS.from_pretrained(str(checkpoints["custom_voice"]))
    codes = ours.synthesize(SpeechRequest(text, speaker=bc.SPEAKER, language=bc.LANGUAGE, greedy=True, max_frames=FRAMES)).codes
    reference = official_codes(official["custom_voice"], text=text, speaker=bc.SPEAKER, language=bc.LANGUAGE,
                               do_sample=False, subtalker_dosample=False, max_new_tokens=FRAMES + 1)
    assert codes.shape == (FRAMES, 16)  # EOS never won: every frame asked for
    np.testing.assert_array_equal(codes, reference.numpy())


@pytest.mark.parametrize("size", list(bc.SIZES))
def test_real_size_tensors_are_the_official_ones(tmp_path, size):
    """The real-size config.json and speech_tokenizer/config.json build the same tensor names and
    shapes in ours and in the official classes (on the meta device: nothing is allocated)."""
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

    from pipeline.codec import SpeechTokenizer, SpeechTokenizerConfig
    from pipeline.model import Qwen3TTS, TTSConfig

    def shapes(module):
        return {name: tuple(t.shape) for name, t in module.state_dict().items()}

    special_ids = write_tiny_text_tokenizer(tmp_path)
    for kind in bc.TYPES:
        config = bc.real_size_config(size, kind, special_ids)
        with torch.device("meta"):
            ours = shapes(Qwen3TTS(TTSConfig.from_dict(config)))
            reference = shapes(Qwen3TTSForConditionalGeneration(Qwen3TTSConfig.from_dict(copy.deepcopy(config))))
        assert ours == reference
    codec = bc.real_speech_tokenizer_config()
    with torch.device("meta"):
        ours = shapes(SpeechTokenizer(SpeechTokenizerConfig.from_dict(codec)))
        reference = shapes(Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config.from_dict(copy.deepcopy(codec))))
    assert ours == reference


@pytest.fixture(scope="module")
def measured(checkpoints, official):
    """Ours (1 and 8 streams) and the official path on both checkpoints, through the GPU run's functions."""
    results = []
    for kind in bc.TYPES:
        inputs = bc.Inputs.for_type(kind)
        runs = dict(bc.bench_ours(checkpoints[kind], kind, inputs, FRAMES, 1, 2, device="cpu", compiled=False))
        runs.update((key, bc.measure(call, FRAMES, 1, 2)) for key, call in bc.official_calls(official[kind], kind, inputs).items())
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


def report_of(results, command="python -m pipeline.bench_compare --out x"):
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
    assert merged["commands"] == ["python -m pipeline.bench_compare --out x", "second"]
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
