"""Deployment as written: the Dockerfile, requirements.txt, the Spaces front matter, the README's install commands,
the CLI's help, and the UI's handling of input errors and of the tiny checkpoints' length."""
from __future__ import annotations

import argparse
import json
import logging
import re
from pathlib import Path

import gradio as gr
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import app
from pipeline import __main__ as cli
from pipeline.contract.models import MODEL_TYPES, parse_models
from pipeline.tiny import write_tiny_checkpoint
from ui import controls
from ui.errors import input_error

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# torch release -> (CUDA major of its PyPI Linux x86_64 wheel, Python minors with wheels). Source: the wheel's METADATA on PyPI
# (torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl: Requires-Dist cuda-toolkit[...]==13.0.3, nvidia-cudnn-cu13, nvidia-nccl-cu13;
# Requires-Python >=3.10; files cp310 to cp314 at https://pypi.org/simple/torch/). Bumping torch means adding its row here.
TORCH_WHEELS = {"2.13.0": (13, ("3.10", "3.11", "3.12", "3.13", "3.14"))}
UBUNTU_PYTHON = {"ubuntu:22.04": "3.10", "ubuntu:24.04": "3.12"}  # the distribution's python3

# https://huggingface.co/docs/hub/spaces-config-reference
SPACE_COLORS = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}
SPACE_HARDWARE = {"cpu-basic", "cpu-upgrade", "t4-small", "t4-medium", "l4x1", "l4x4", "a10g-small", "a10g-large", "a10g-largex2",
                  "a10g-largex4", "a100-large", "v5e-1x1", "v5e-2x2", "v5e-2x4"}


def requirement(name: str) -> Requirement:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and Requirement(line).name == name:
            return Requirement(line)
    raise AssertionError(f"{name} is not in requirements.txt")


def pinned_torch() -> str:
    spec = requirement("torch").specifier
    (pin,) = [s.version for s in spec if s.operator == "=="]
    assert pin in TORCH_WHEELS, f"torch {pin}: add its CUDA major and Python versions (from PyPI) to TORCH_WHEELS"
    return pin


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def front_matter() -> dict:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_the_image_has_no_cuda_of_its_own_and_requires_the_pinned_torchs_cuda():
    text = dockerfile()
    (base,) = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
    assert "cuda" not in base.lower() and base in UBUNTU_PYTHON, "torch's wheels bring CUDA: a CUDA base would be a second copy"
    cuda_major, pythons = TORCH_WHEELS[pinned_torch()]
    assert re.search(rf'NVIDIA_REQUIRE_CUDA="cuda>={cuda_major}\.\d+"', text), f"the image must require the driver of CUDA {cuda_major}"
    assert UBUNTU_PYTHON[base] in pythons
    # torch from PyPI's default index (the CUDA build): no other index, and requirements.txt installed as is.
    assert "--index-url" not in text and "--extra-index-url" not in text and "download.pytorch.org" not in text
    assert re.search(r"^RUN pip install --no-cache-dir -r requirements.txt$", text, re.MULTILINE)
    assert "useradd -m -u 1000 user" in text and 'CMD ["python", "app.py"' in text


def test_the_space_front_matter_keeps_the_documented_limits():
    meta = front_matter()
    assert meta["sdk"] == "gradio" and (ROOT / meta["app_file"]).is_file()
    assert len(meta["short_description"]) <= 60
    assert len(meta["emoji"]) <= 2 and not any(c.isalnum() for c in meta["emoji"])  # one emoji (with its variation selector)
    assert {meta["colorFrom"], meta["colorTo"]} <= SPACE_COLORS
    assert meta["suggested_hardware"] in SPACE_HARDWARE
    assert requirement("gradio").specifier.contains(Version(meta["sdk_version"]))
    assert str(meta["python_version"]) in TORCH_WHEELS[pinned_torch()][1]
    hub_id = re.compile(r"^[\w.-]+/[\w.-]+(\s+[^\s]+)?$")  # "repo" or "repo file,file"
    assert isinstance(meta["preload_from_hub"], list) and all(hub_id.match(item) for item in meta["preload_from_hub"])


def test_a_zero_gpu_space_is_refused_at_start_with_one_sentence(monkeypatch, capsys):
    """Local models on ZeroGPU stop the app before torch touches CUDA: exit code 2 and one sentence naming what to choose instead."""
    monkeypatch.setenv("SPACES_ZERO_GPU", "true")
    parser = app.build_parser()
    with pytest.raises(SystemExit) as stopped:
        app.local_service(parser.parse_args(["--tiny"]), parser)
    assert stopped.value.code == 2
    message = capsys.readouterr().err.strip()
    assert message == f"{parser.prog}: {app.ZERO_GPU_REFUSED}" and "\n" not in message
    assert "ZeroGPU Spaces are not supported" in message and "dedicated GPU" in message and "--backend" in message
    assert "ZeroGPU is refused at start" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_requirements_allow_the_transformers_the_omni_thinker_supports_and_the_tests_take_them():
    from pipeline.omni.thinker import SUPPORTED_TRANSFORMERS

    oldest, newest = SUPPORTED_TRANSFORMERS
    assert requirement("transformers").specifier == SpecifierSet(f">={oldest},<={newest}")
    # The tests see the releases a user's install resolves to: requirements-test.txt takes requirements.txt's.
    test_lines = [line.split("#")[0].strip() for line in (ROOT / "requirements-test.txt").read_text().splitlines()]
    assert "-r requirements.txt" in test_lines
    named = {Requirement(line).name.lower().replace("_", "-") for line in test_lines if line and not line.startswith("-")}
    assert not named & {"transformers", "tokenizers", "huggingface-hub"}


def test_the_readme_installs_torch_from_the_cpu_index_before_the_requirements():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    cpu = f"pip install torch=={pinned_torch()} --index-url {CPU_INDEX}"
    assert cpu in text and text.index(cpu) < text.index("pip install -r requirements.txt", text.index(cpu))


def parsers() -> dict[str, argparse.ArgumentParser]:
    found = {"app.py": app.build_parser()}
    top = cli.build_parser()
    found["python -m pipeline"] = top
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update({f"python -m pipeline {name}": sub for name, sub in action.choices.items()})
    return found


def test_every_cli_option_says_what_it_does_and_its_default():
    names = parsers()
    assert {"python -m pipeline synth", "python -m pipeline synth-batch", "python -m pipeline chat", "python -m pipeline make-tiny"} <= set(names)
    for name, parser in names.items():
        parser.format_help()  # every %(default)s expands
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            flag = action.option_strings[0] if action.option_strings else action.dest
            assert action.help, f"{name} {flag} has no help"
            assert "default" in action.help or "required" in action.help, f"{name} {flag}: the help does not say its default"


def test_the_models_types_are_named_alike_in_the_help_the_readme_and_the_parser():
    short = [t.name for t in MODEL_TYPES.values()]
    assert short == ["clone", "custom", "design", "omni"]
    (models,) = [a for a in app.build_parser()._actions if a.dest == "models"]
    assert f"TYPE is {', '.join(short)} " in models.help
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (row,) = [line for line in readme.splitlines() if line.startswith("| `--models")]
    assert re.findall(r"`(\w+)`", row.split("TYPE is")[1].split(";")[0]) == short
    assert parse_models(["clone=a", "custom=b", "design=c", "omni=d"]) == parse_models(["base=a", "custom_voice=b", "voice_design=c", "omni=d"])
    with pytest.raises(ValueError, match="TYPE one of clone, custom, design, omni"):
        parse_models(["voice=a"])


def test_an_input_error_is_one_log_line_and_no_traceback(caplog):
    caplog.set_level(logging.INFO, logger="ui")
    error = input_error(ValueError("The text is empty."))
    assert isinstance(error, gr.Error) and error.message == "The text is empty." and not error.print_exception
    assert [r.getMessage() for r in caplog.records] == ["input error: The text is empty."]


def test_a_bad_request_in_the_ui_raises_the_quiet_error():
    from pipeline.errors import TTSInputError

    def stream():
        raise TTSInputError("Say something: the text is empty.")
        yield

    with pytest.raises(gr.Error) as caught:
        controls.open_stream(stream())
    assert not caught.value.print_exception


def test_the_ui_max_length_defaults_to_the_checkpoints_own(tmp_path):
    fields = controls.sampling_fields(0.9, 50, 1.0, 1.05, None, "", controls.MAX_SECONDS)
    assert fields["max_frames"] is None  # the slider's default: generation_config.json decides
    assert controls.sampling_fields(0.9, 50, 1.0, 1.05, None, "", 8)["max_frames"] == 100
    write_tiny_checkpoint(tmp_path, "custom_voice", seed=0)
    tiny = json.loads((tmp_path / "generation_config.json").read_text())["max_new_tokens"]
    assert tiny - 1 == 100  # 8 s of noise at most; the released checkpoints ship 2048 (164 s)
