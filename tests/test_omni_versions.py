"""The transformers releases the Omni thinker driver supports: it calls the thinker's decoder layers and
rotary embedding directly, internals that move between releases, so a release outside the tested
range is refused when the thinker loads, in one sentence, rather than failing in a user's first turn."""
import sys

import pytest
from packaging.version import Version

from pipeline.errors import CheckpointError
from pipeline.omni import thinker
from pipeline.omni.thinker import SUPPORTED_TRANSFORMERS, check_transformers_version

UNSUPPORTED = "5.25.0"


def installed_transformers():
    """The transformers module the thinker imports (transformers' lazy loading can put a new one in sys.modules)."""
    import transformers  # noqa: F401 - imported for sys.modules

    return sys.modules["transformers"]


def refusal(installed: str) -> str:
    return (f"The Omni thinker supports transformers 5.15.1 to 5.24.0, but {installed} is installed; "
            "install a supported one with pip install 'transformers>=5.15.1,<=5.24.0'.")


def test_the_thinker_supports_transformers_5_15_1_to_5_24_0():
    assert SUPPORTED_TRANSFORMERS == ("5.15.1", "5.24.0")
    for version in ("5.15.1", "5.17.0", "5.21.1", "5.24.0"):
        check_transformers_version(version)
    for version in ("4.57.3", "5.15.0", "5.24.1", UNSUPPORTED, "6.0.0"):
        with pytest.raises(CheckpointError) as info:
            check_transformers_version(version)
        assert str(info.value) == refusal(version)


def test_the_installed_transformers_is_supported():
    oldest, newest = map(Version, SUPPORTED_TRANSFORMERS)
    installed = installed_transformers().__version__
    assert oldest <= Version(installed) <= newest
    check_transformers_version(installed)


def test_an_unsupported_transformers_fails_when_the_thinker_loads(tiny_omni, monkeypatch):
    import torch

    monkeypatch.setattr(installed_transformers(), "__version__", UNSUPPORTED)
    with pytest.raises(CheckpointError) as info:
        thinker.Thinker.from_pretrained(tiny_omni, torch.device("cpu"), torch.float32, accept_hidden_layer=2)
    assert str(info.value) == refusal(UNSUPPORTED)


def test_the_chat_command_says_so_with_the_checkpoint_exit_code(tiny_omni, tmp_path, monkeypatch, capsys):
    from pipeline import __main__ as cli

    monkeypatch.setattr(installed_transformers(), "__version__", UNSUPPORTED)
    assert cli.main(["chat", "--model", str(tiny_omni), "--text", "Hello", "--out", str(tmp_path / "reply.wav")]) == cli.EXIT_BAD_CHECKPOINT
    assert capsys.readouterr().err.strip() == f"error: {refusal(UNSUPPORTED)}"
