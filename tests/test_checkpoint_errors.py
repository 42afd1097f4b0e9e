"""A damaged checkpoint exits 3, a bad --device or output path exits 2: one sentence naming the problem, never a traceback."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.errors import CheckpointError, TTSInputError
from pipeline.loading import WEIGHTS, WEIGHTS_INDEX, load_model, load_text_tokenizer, read_json, torch_device
from pipeline.outputs import check_output_dir, check_output_path

REPO = Path(__file__).resolve().parents[1]
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
# The CLI's exit codes, written out: they are the contract these tests hold pipeline.__main__ to.
EXIT_BAD_INPUT, EXIT_BAD_CHECKPOINT = 2, 3


# Ways a file gets damaged: a download cut short, an error page saved in its place, bytes that are not text.
def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def html_page(path: Path) -> None:
    path.write_text("<html><body>502 Bad Gateway</body></html>\n")


def binary_noise(path: Path) -> None:
    path.write_bytes(bytes(range(128, 256)) * 4)


def writer(text: str):
    return lambda path: path.write_text(text, encoding="utf-8")


def reshape_one_matrix(path: Path) -> None:
    """One weight matrix with a row too many: tensors saved for a different config."""
    state = load_file(path)
    key = next(key for key in sorted(state) if state[key].dim() == 2)
    state[key] = torch.zeros(state[key].shape[0] + 1, state[key].shape[1])
    save_file(state, path)


def shard_weights(directory: Path) -> None:
    """Split model.safetensors into two shards and an index, the layout of the larger released checkpoints."""
    state = load_file(directory / WEIGHTS)
    keys = sorted(state)
    parts = dict(zip(SHARDS, (keys[: len(keys) // 2], keys[len(keys) // 2 :])))
    for shard, part in parts.items():
        save_file({key: state[key] for key in part}, directory / shard)
    index = {"metadata": {}, "weight_map": {key: shard for shard, part in parts.items() for key in part}}
    (directory / WEIGHTS_INDEX).write_text(json.dumps(index))
    (directory / WEIGHTS).unlink()


@pytest.fixture
def checkpoint(tiny_checkpoints, tmp_path) -> Path:
    """A private copy of the tiny VoiceDesign checkpoint, free to damage."""
    return Path(shutil.copytree(tiny_checkpoints["voice_design"], tmp_path / "checkpoint"))


@pytest.fixture
def sharded_checkpoint(checkpoint) -> Path:
    shard_weights(checkpoint)
    return checkpoint


def synth(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return ["synth", "--model", str(checkpoint), "--text", "Hi.", "--out", str(out), "--max-frames", "3", *extra]


def cli_error(capsys, argv: list[str]) -> tuple[int, str]:
    # Imported when called, so the checks of single functions below run even while the CLI cannot be imported.
    from pipeline.__main__ import main

    code = main(argv)
    return code, capsys.readouterr().err


# --- A damaged checkpoint: exit 3, the message names the file -------------------------------------------------

DAMAGED_FILES = [
    pytest.param("model.safetensors", truncate, "damaged or is not a safetensors file", id="weights-truncated"),
    pytest.param("model.safetensors", html_page, "damaged or is not a safetensors file", id="weights-html"),
    pytest.param("model.safetensors", writer(""), "damaged or is not a safetensors file", id="weights-empty"),
    pytest.param("model.safetensors", reshape_one_matrix, "shaped for another model", id="weights-wrong-shape"),
    pytest.param("config.json", truncate, "is not valid JSON", id="config-truncated"),
    pytest.param("config.json", binary_noise, "is not UTF-8 text", id="config-binary"),
    pytest.param("config.json", writer("[]"), "does not hold a JSON object", id="config-list"),
    pytest.param("generation_config.json", truncate, "is not valid JSON", id="generation-config-truncated"),
    # The text tokenizer's files: exit 3 through the CLI because TTS.from_pretrained calls loading.load_text_tokenizer.
    pytest.param("tokenizer_config.json", truncate, "is not valid JSON", id="tokenizer-config-truncated"),
    pytest.param("tokenizer_config.json", binary_noise, "is not UTF-8 text", id="tokenizer-config-binary"),
    pytest.param("vocab.json", truncate, "is not valid JSON", id="vocab-truncated"),
    pytest.param("vocab.json", writer('["a", "b"]'), "does not hold a JSON object", id="vocab-list"),
    pytest.param("vocab.json", writer('{"a": "one"}'), "integer id", id="vocab-string-ids"),
    pytest.param("merges.txt", writer("#version: 0.2\nnot a pair of tokens\n"), "Merges text file invalid", id="merges-not-pairs"),
    pytest.param("merges.txt", writer("#version: 0.2\nqqqq wwww\n"), "out of vocabulary", id="merges-unknown-token"),
    pytest.param("merges.txt", binary_noise, "is not UTF-8 text", id="merges-binary"),
]
DAMAGED_SHARDS = [
    pytest.param(SHARDS[1], truncate, "damaged or is not a safetensors file", id="shard-truncated"),
    pytest.param(SHARDS[0], html_page, "damaged or is not a safetensors file", id="shard-html"),
    pytest.param(WEIGHTS_INDEX, writer('{"metadata": {}}'), "has no weight_map", id="index-without-weight-map"),
    pytest.param(WEIGHTS_INDEX, writer('{"weight_map": ["a.safetensors"]}'), "has no weight_map", id="index-weight-map-list"),
    pytest.param(WEIGHTS_INDEX, truncate, "is not valid JSON", id="index-truncated"),
]
TOKENIZER_FILES = ("tokenizer_config.json", "vocab.json", "merges.txt")


@pytest.mark.parametrize("name, damage, problem", DAMAGED_FILES)
def test_damaged_file_is_a_checkpoint_error(capsys, checkpoint, tmp_path, name, damage, problem):
    damage(checkpoint / name)
    code, err = cli_error(capsys, synth(checkpoint, tmp_path / "o.wav"))
    assert code == EXIT_BAD_CHECKPOINT and problem in err
    assert name in err and str(checkpoint) in err


@pytest.mark.parametrize("name, damage, problem", DAMAGED_SHARDS)
def test_damaged_shard_or_index_is_a_checkpoint_error(capsys, sharded_checkpoint, tmp_path, name, damage, problem):
    damage(sharded_checkpoint / name)
    code, err = cli_error(capsys, synth(sharded_checkpoint, tmp_path / "o.wav"))
    assert code == EXIT_BAD_CHECKPOINT and problem in err and str(sharded_checkpoint / name) in err


def test_intact_shards_load(sharded_checkpoint):
    """The control for the shard cases: it is the damage that fails them, not the sharding."""
    model = load_model(sharded_checkpoint, torch.device("cpu"), torch.float32)
    assert model.config.tts_model_type == "voice_design"


def test_damaged_weights_end_without_a_traceback(checkpoint, tmp_path):
    truncate(checkpoint / WEIGHTS)
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", *synth(checkpoint, tmp_path / "o.wav")], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == EXIT_BAD_CHECKPOINT and "Traceback" not in result.stderr
    assert str(checkpoint / WEIGHTS) in result.stderr


@pytest.mark.parametrize("name, damage, problem", [p for p in DAMAGED_FILES if p.values[0] in TOKENIZER_FILES])
def test_load_text_tokenizer_names_the_damaged_file(checkpoint, name, damage, problem):
    damage(checkpoint / name)
    with pytest.raises(CheckpointError, match=problem) as error:
        load_text_tokenizer(checkpoint)
    assert str(checkpoint) in str(error.value) and name in str(error.value)


def test_load_text_tokenizer_loads_an_intact_tokenizer(checkpoint):
    tokenizer = load_text_tokenizer(checkpoint)
    assert tokenizer("Hello there.")["input_ids"]


def test_read_json_names_a_missing_file(checkpoint):
    with pytest.raises(CheckpointError, match=re.escape(f"{checkpoint} is missing nothing.json")):
        read_json(checkpoint, "nothing.json")


# --- --device: cpu, cuda or cuda:N of a GPU that exists; exit 2 otherwise, before anything loads ----------------


@pytest.fixture
def one_gpu(monkeypatch):
    """This machine as one with a single CUDA GPU, whatever it has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


@pytest.mark.parametrize("name", ["mps", "gpu", "cuda:x", "cuda:-1", "CPU", "cuda 0", ""])
def test_unsupported_device_name(name):
    with pytest.raises(TTSInputError, match="use cpu, cuda or cuda:N"):
        torch_device(name)


def test_cuda_gpu_that_is_not_there(one_gpu):
    with pytest.raises(TTSInputError, match=r"There is no CUDA GPU cuda:7 on this machine: it has 1 \(cuda:0\)"):
        torch_device("cuda:7")
    assert torch_device("cuda:0") == torch.device("cuda:0") and torch_device("cuda") == torch.device("cuda")


def test_cpu_device():
    assert torch_device("cpu") == torch.device("cpu")


@pytest.fixture
def loading_forbidden(monkeypatch):
    """Any attempt to load a checkpoint fails the test: the error under test must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the command line was checked")

    monkeypatch.setattr("pipeline.tts.resolve_checkpoint", refuse)


# CLI test: the device is checked (by __main__ and again by TTS.from_pretrained) before the checkpoint is looked at.
@pytest.mark.parametrize("device, message", [("mps", "Unsupported device 'mps'"), ("cuda:x", "Unsupported device 'cuda:x'"), ("cuda:7", "no CUDA GPU cuda:7")])
def test_cli_bad_device_exits_2_before_loading(capsys, checkpoint, tmp_path, one_gpu, loading_forbidden, device, message):
    code, err = cli_error(capsys, synth(checkpoint, tmp_path / "o.wav", "--device", device))
    assert code == EXIT_BAD_INPUT and message in err


# --- Output paths: checked before any work -----------------------------------------------------------------------


def can_create_file(directory: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


@pytest.fixture
def unwritable_dir(tmp_path):
    """A directory this process cannot create files in: a read-only one, or for root (whom modes do not stop) sysfs."""
    directory = tmp_path / "read-only"
    directory.mkdir(mode=0o555)
    if can_create_file(directory):
        directory = Path("/sys")
        if not directory.is_dir() or can_create_file(directory):
            pytest.skip("no directory here refuses new files to this user")
    yield directory
    (tmp_path / "read-only").chmod(0o755)


@pytest.mark.parametrize("name", ["out.wav", "out.flac", "out.ogg", "OUT.WAV"])
def test_audio_paths_that_can_be_written(tmp_path, name):
    check_output_path(tmp_path / name, "audio")
    assert list(tmp_path.iterdir()) == [], "the check leaves nothing behind"


BAD_OUTPUT_PATHS = [
    pytest.param(lambda tmp: tmp / "no" / "such" / "out.wav", "audio", "does not exist", id="missing-directory"),
    pytest.param(lambda tmp: tmp, "audio", "it is a directory", id="existing-directory"),
    pytest.param(lambda tmp: tmp / "out.mp3", "audio", "must end in .wav, .flac or .ogg", id="mp3"),
    pytest.param(lambda tmp: tmp / "out", "audio", "must end in .wav, .flac or .ogg", id="no-extension"),
    pytest.param(lambda tmp: tmp / "codes.wav", "codes", "must end in .npy", id="codes-as-wav"),
]


@pytest.mark.parametrize("make_path, kind, message", BAD_OUTPUT_PATHS)
def test_bad_output_path(tmp_path, make_path, kind, message):
    with pytest.raises(TTSInputError, match=message):
        check_output_path(make_path(tmp_path), kind)


def test_output_path_under_a_file(tmp_path):
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(TTSInputError, match="notes.txt is a file, not a directory"):
        check_output_path(tmp_path / "notes.txt" / "out.wav", "audio")


def test_output_path_in_an_unwritable_directory(unwritable_dir):
    with pytest.raises(TTSInputError, match="is not writable"):
        check_output_path(unwritable_dir / "out.wav", "audio")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write read-only files")
def test_existing_read_only_output_file(tmp_path):
    path = tmp_path / "out.wav"
    path.write_bytes(b"")
    path.chmod(0o444)
    with pytest.raises(TTSInputError, match="exists and is read-only"):
        check_output_path(path, "audio")


def test_output_dir_that_exists_or_can_be_created(tmp_path):
    check_output_dir(tmp_path)
    check_output_dir(tmp_path / "new" / "nested")
    assert list(tmp_path.iterdir()) == [], "checking creates nothing"


def test_output_dir_that_cannot_be_used(tmp_path, unwritable_dir):
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(TTSInputError, match="it is a file, not a directory"):
        check_output_dir(tmp_path / "notes.txt")
    with pytest.raises(TTSInputError, match="is a file, not a directory"):
        check_output_dir(tmp_path / "notes.txt" / "sub")
    with pytest.raises(TTSInputError, match="is not writable"):
        check_output_dir(unwritable_dir / "new")


# CLI tests: __main__.synth must call check_output_path on --out ("audio") and --codes-out ("codes") before
# TTS.from_pretrained; `loading_forbidden` fails them if a checkpoint is loaded first.
@pytest.mark.parametrize(
    "flag, make_path, message",
    [
        ("--out", lambda tmp: tmp / "no" / "such" / "out.wav", "does not exist"),
        ("--out", lambda tmp: tmp, "it is a directory"),
        ("--out", lambda tmp: tmp / "out.mp3", "must end in .wav, .flac or .ogg"),
        ("--codes-out", lambda tmp: tmp / "codes.txt", "must end in .npy"),
    ],
    ids=["missing-directory", "directory", "mp3", "codes-txt"],
)
def test_cli_bad_output_path_exits_2_before_loading(capsys, checkpoint, tmp_path, loading_forbidden, flag, make_path, message):
    argv = synth(checkpoint, tmp_path / "o.wav") + [flag, str(make_path(tmp_path))]
    code, err = cli_error(capsys, argv)
    assert code == EXIT_BAD_INPUT and message in err


def test_cli_unwritable_output_directory_exits_2_before_loading(capsys, checkpoint, unwritable_dir, loading_forbidden):
    code, err = cli_error(capsys, synth(checkpoint, unwritable_dir / "o.wav"))
    assert code == EXIT_BAD_INPUT and "is not writable" in err
