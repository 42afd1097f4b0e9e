"""The memory plan (pipeline/memory_plan.py) against what the loaders and the engine allocate, the rows it
chooses for a given free memory, and the sentences when rows or weights do not fit: at load and at the app's
start. Free memory is given to the plan as bytes, as a GPU would report it."""
import functools
import inspect
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

import app
from pipeline import memory_plan
from pipeline.codec.tokenizer import SpeechTokenizer
from pipeline.loading import load_model
from pipeline.memory_plan import GIB, MemoryPlan, NotEnoughMemory
from pipeline.service import ModelService
from pipeline.tts import DEFAULT_MAX_SEQ, TTS


def plan_of(directory: Path, dtype: torch.dtype = torch.float32, max_rows: int = 4) -> MemoryPlan:
    """The plan of a tiny checkpoint as the CPU engine runs it (its frame's glue in PyTorch ops)."""
    return memory_plan.tts_checkpoint_plan(directory, dtype, DEFAULT_MAX_SEQ, directory.name, frame_kernels=False, max_rows=max_rows)


def held_bytes(*roots) -> int:
    """Bytes of the storages of every tensor reachable from `roots` through attributes, containers,
    partials and bound methods (each storage once: views share theirs)."""
    storages, visited, stack = {}, set(), list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in visited or obj is None:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif isinstance(obj, functools.partial):
            stack.extend([obj.func, *obj.args, *obj.keywords.values()])
        elif inspect.ismethod(obj):
            stack.append(obj.__self__)
        elif isinstance(obj, nn.Module) or type(obj).__module__.startswith("pipeline."):
            stack.extend(vars(obj).values())
    return sum(storages.values())


def engine_bytes(tts: TTS) -> int:
    """What the engine's decoder and vocoder hold on the device: the model's weights and caches, the decode
    step's buffers and the vocoder's stream states (not the engine's host-side copies of each frame)."""
    return held_bytes(tts.engine.decoder, tts.engine.vocoder, tts.model, tts.speech_tokenizer)


def test_the_plans_bytes_per_row_are_what_the_engine_allocates_per_row(tiny_checkpoints):
    directory = Path(tiny_checkpoints["custom_voice"])
    two, four = (engine_bytes(TTS.from_pretrained(str(directory), rows=rows)) for rows in (2, 4))
    assert (four - two) / 2 == plan_of(directory).per_row


def test_the_plans_weights_are_the_checkpoints_tensors_as_loaded(tiny_checkpoints):
    for kind, directory in tiny_checkpoints.items():
        directory = Path(directory)
        for dtype in (torch.float32, torch.bfloat16):
            model = load_model(directory, torch.device("cpu"), dtype)
            codec = SpeechTokenizer.from_pretrained(directory / "speech_tokenizer")  # float32, as TTS loads it
            modules = (model, codec)
            assert plan_of(directory, dtype).weights == held_bytes(*modules), (kind, dtype)
            # Their state (parameters and persistent buffers) is the checkpoints' tensors (talker in `dtype`, codec in float32);
            # the rest is derived from them.
            state = sum(t.numel() * t.element_size() for m in modules for t in m.state_dict().values())
            stored = tensor_bytes(directory / "model.safetensors", dtype.itemsize) + tensor_bytes(directory / "speech_tokenizer" / "model.safetensors", 4)
            assert state == stored, (kind, dtype)


def tensor_bytes(path: Path, size: int) -> int:
    """Bytes of a safetensors file's tensors at `size` bytes an element, from its header."""
    with safe_open(str(path), "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) * size for name in f.keys())


def test_rows_that_fit_the_free_memory_from_one_to_the_cap(tiny_checkpoints):
    plan = plan_of(Path(tiny_checkpoints["custom_voice"]), max_rows=16)
    assert plan.rows_that_fit(plan.needed(5)) == 5
    assert plan.rows_that_fit(plan.needed(6) - 1) == 5
    assert plan.rows_that_fit(plan.needed(1)) == 1
    assert plan.rows_that_fit(plan.needed(1) - 1) == 1  # at least one: choose_rows says the weights do not fit
    assert plan.rows_that_fit(plan.needed(1000)) == 16
    assert plan.choose_rows(None, plan.needed(7)) == 7 and plan.choose_rows(3, plan.needed(7)) == 3


PLAN = MemoryPlan("Qwen3-TTS-12Hz-1.7B-CustomVoice", "bfloat16", weights=int(3.4 * GIB), per_row=int(0.3 * GIB), reserve=int(1.5 * GIB),
                  max_rows=16)


def test_rows_that_do_not_fit_are_one_sentence_with_what_is_needed_and_free():
    with pytest.raises(NotEnoughMemory) as raised:
        PLAN.choose_rows(64, int(14.6 * GIB))
    assert str(raised.value) == ("--rows 64 needs about 20.7 GiB for Qwen3-TTS-12Hz-1.7B-CustomVoice's caches and working memory; "
                                 "this GPU has 11.2 GiB free after the weights; at most 32 rows fit.")
    assert raised.value.field == "rows"
    assert PLAN.choose_rows(32, int(14.6 * GIB)) == 32


def test_weights_that_do_not_fit_are_one_sentence_with_what_is_needed_and_free():
    with pytest.raises(NotEnoughMemory) as raised:
        PLAN.choose_rows(None, int(2.1 * GIB))
    assert str(raised.value) == ("Qwen3-TTS-12Hz-1.7B-CustomVoice needs about 5.2 GiB of GPU memory in bfloat16 (its weights, working memory and "
                                 "one row's caches); this GPU has 2.1 GiB free.")
    assert raised.value.field is None


def test_a_model_loaded_later_gets_the_rows_that_fit_or_its_sentence(tiny_checkpoints):
    custom = Path(tiny_checkpoints["custom_voice"])
    plan = plan_of(custom)
    choices = {"custom_voice": (str(custom),)}
    assert ModelService(choices, free_memory=plan.needed(3)).model("custom_voice").rows == 3
    assert ModelService(choices, free_memory=plan.needed(100)).model("custom_voice").rows == 4  # the CPU's default, at most
    with pytest.raises(NotEnoughMemory, match=r"^--rows 9 needs about .* at most 3 rows fit\.$"):
        ModelService(choices, rows=9, free_memory=plan.needed(3)).model("custom_voice")
    with pytest.raises(NotEnoughMemory, match=r"^custom_voice needs about .* this GPU has 0\.0 GiB free\.$"):
        ModelService(choices, free_memory=plan.weights // 2).model("custom_voice")


def test_the_app_stops_at_start_with_exit_code_2_when_the_rows_do_not_fit(tiny_checkpoints, capsys):
    dirs = {kind: str(path) for kind, path in tiny_checkpoints.items()}
    parser = app.build_parser()
    args = parser.parse_args(["--device", "cpu", "--rows", "200", "--models", f"clone={dirs['base']}", f"custom={dirs['custom_voice']}",
                              f"design={dirs['voice_design']}", "omni=tiny"])
    free = plan_of(Path(dirs["base"])).needed(3)
    with pytest.raises(SystemExit) as stopped:
        app.local_service(args, parser, free_memory=free)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().endswith(plan_of(Path(dirs["base"])).rows_sentence(200, free))
    args.rows = 3
    assert app.local_service(args, parser, free_memory=free).rows == 3  # they fit: the app starts


def test_the_three_default_checkpoints_share_the_card_with_the_rows_they_get():
    """The app's default checkpoints of the three TTS tabs, each with the rows it gets without --rows on a card
    (from an L4's 22.5 GiB up), fit that card together beside the CUDA context and what the process's first
    model pays once, and with one row more each they would not, below the cap of 64 rows."""
    from pipeline.service import HUB_CHECKPOINTS

    plans = memory_plan.shared_tts_plans(torch.bfloat16, DEFAULT_MAX_SEQ)
    assert [plan.name for plan in plans] == [memory_plan.checkpoint_name(HUB_CHECKPOINTS[kind][0]) for kind in ("base", "custom_voice", "voice_design")]
    fixed = memory_plan.CUDA_CONTEXT_BYTES + memory_plan.PROCESS_RESERVE_BYTES
    for card_gib in (22.5, 24, 40, 48, 80, 141):
        card = int(card_gib * GIB)
        rows = memory_plan.tts_row_cap(card, torch.bfloat16, DEFAULT_MAX_SEQ)
        assert fixed + sum(plan.needed(rows) for plan in plans) <= card, card_gib
        assert rows == memory_plan.TTS_MOST_ROWS or fixed + sum(plan.needed(rows + 1) for plan in plans) > card, card_gib
    assert memory_plan.tts_row_cap(int(22.5 * GIB), torch.bfloat16, DEFAULT_MAX_SEQ) > 8  # more than a fixed 8 on an L4
    assert memory_plan.tts_row_cap(80 * GIB, torch.bfloat16, DEFAULT_MAX_SEQ) == 64


def test_a_card_too_small_to_share_still_gives_each_model_up_to_8_rows():
    """Where the three default checkpoints cannot share the card with 8 rows each, the cap stays at 8: each model
    gets what its free memory holds up to that (fewer rows would not make the three fit)."""
    plans = memory_plan.shared_tts_plans(torch.bfloat16, DEFAULT_MAX_SEQ)
    card = 16 * GIB
    assert memory_plan.CUDA_CONTEXT_BYTES + memory_plan.PROCESS_RESERVE_BYTES + sum(plan.needed(8) for plan in plans) > card
    assert memory_plan.tts_row_cap(card, torch.bfloat16, DEFAULT_MAX_SEQ) == memory_plan.TTS_LEAST_CAP == 8
    assert memory_plan.tts_row_cap(int(2 * GIB), torch.bfloat16, DEFAULT_MAX_SEQ) == 8


def test_a_cuda_engine_gets_the_cap_of_its_card_or_the_rows_asked_for(tiny_checkpoints, monkeypatch):
    """Planned on CUDA (the card's size as the driver reports it): without --rows the cap of the card
    where the free memory holds more, with --rows those rows where they fit, beyond the cap too."""
    import types

    from pipeline.tts import planned_rows

    custom = Path(tiny_checkpoints["custom_voice"])
    cuda, plenty = torch.device("cuda"), plan_of(custom, torch.bfloat16).needed(200)

    def rows_on(card: int, options: dict) -> int:
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=card))
        return planned_rows(custom, custom.name, cuda, torch.bfloat16, plenty, {"fused": False, **options})

    assert rows_on(80 * GIB, {}) == 64
    assert rows_on(int(22.5 * GIB), {}) == memory_plan.tts_row_cap(int(22.5 * GIB), torch.bfloat16, DEFAULT_MAX_SEQ)
    assert rows_on(80 * GIB, {"rows": 100}) == 100
    with pytest.raises(NotEnoughMemory, match=r"^--rows 201 needs about .* at most 200 rows fit\.$"):
        rows_on(80 * GIB, {"rows": 201})
