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


def test_every_front_door_takes_the_request_fields_of_the_schema():
    """The CLI's flags, the API's body fields, the listening settings and the engine's sampling come from
    pipeline.request's one description of the request."""
    import argparse
    import dataclasses

    from pipeline.__main__ import build_parser
    from pipeline.engine.sampling import SamplingConfig
    from pipeline.listening.session import SETTING_KEYS
    from pipeline.request import REQUEST_FIELDS, api_fields, fields_of, shipped
    from pipeline.server.speech import FIELDS

    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    flags = {flag for action in commands.choices["synth"]._actions for flag in action.option_strings}
    assert {f"--{name.replace('_', '-')}" for name, spec in REQUEST_FIELDS.items() if spec.cli} <= flags
    assert {body for _, body in api_fields()} <= FIELDS and {"input", "voice", "instructions", "max_new_tokens", "non_streaming_mode"} <= FIELDS
    sampling = fields_of("sampling")
    assert set(sampling) <= set(SETTING_KEYS) and {"schedule", "max_frames", "non_streaming_mode", "language"} <= set(SETTING_KEYS)
    defaults = SamplingConfig()
    assert set(sampling) <= {f.name for f in dataclasses.fields(SamplingConfig)}
    assert all(getattr(defaults, name) == shipped(name) for name in sampling)


def test_each_model_type_is_named_once_for_every_surface():
    from pipeline.contract.models import BASE, CUSTOM_VOICE, MODEL_TYPES, OMNI, VOICE_DESIGN, by_name, by_task, by_vllm_name

    for kind in MODEL_TYPES.values():
        assert by_name(kind.name) is by_name(kind.id.upper()) is by_task(kind.task_type) is kind
        assert all(by_vllm_name(checkpoint) is kind for checkpoint in kind.hub_checkpoints)
    assert by_name("voice_clone") is BASE and by_name("speech") is None and by_task("Talking") is None
    assert by_vllm_name("/models/qwen3-tts-custom_voice/") is CUSTOM_VOICE and by_vllm_name("my-voice.design") is VOICE_DESIGN
    assert by_vllm_name("Qwen3-Omni-30B-A3B-Instruct") is OMNI and by_vllm_name("Qwen/Qwen3-TTS-Tokenizer-12Hz") is None
