"""The `Service` protocol (pipeline/contract.py) that the UI and the listening renderer are written
against: both services implement every member of it, with parameters the protocol's calls fit, and
the module loads without torch or gradio."""
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.contract import Service
from pipeline.remote import RemoteService
from pipeline.service import ModelService

ROOT = Path(__file__).resolve().parent.parent
METHODS = [name for name, member in vars(Service).items() if inspect.isfunction(member) and not name.startswith("_")]
ATTRIBUTES = list(Service.__annotations__)


def test_the_protocol_names_what_the_tabs_call():
    assert {"info", "stream", "chat", "stop", "load_progress", "stand_in", "prepare_voice"} <= set(METHODS)
    assert set(ATTRIBUTES) == {"choices", "fallbacks"}


@pytest.mark.parametrize("service", [ModelService, RemoteService])
@pytest.mark.parametrize("name", METHODS)
def test_each_service_takes_every_call_the_protocol_allows(service, name):
    """The implementation has the method, its parameters begin with the protocol's (same names, same
    order, the same ones optional) and any it adds are optional."""
    wanted = list(inspect.signature(getattr(Service, name)).parameters.values())[1:]
    found = list(inspect.signature(getattr(service, name)).parameters.values())[1:]
    assert [(p.name, p.default is inspect.Parameter.empty) for p in found[: len(wanted)]] == \
        [(p.name, p.default is inspect.Parameter.empty) for p in wanted], (service.__name__, name)
    assert all(p.default is not inspect.Parameter.empty for p in found[len(wanted):]), (service.__name__, name)


def test_a_model_service_is_a_service(tiny_checkpoints):
    service = ModelService({"custom_voice": (str(tiny_checkpoints["custom_voice"]),)})
    assert isinstance(service, Service)
    assert service.stand_in("custom_voice") is None and service.fallbacks == {}


def test_the_contract_loads_without_torch_or_gradio():
    code = "import sys, pipeline.contract; print(sorted(m for m in ('torch', 'gradio') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "[]"
