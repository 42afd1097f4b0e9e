"""The memory plan (pipeline/memory_plan.py) against what the loaders and the engine allocate, the rows it
chooses for a given free memory, and the sentences when rows or weights do not fit: at load and at the app's
start. Free memory is given to the plan as bytes, as a GPU would report it. The plan counts bytes from the
configs' numbers; here each count is checked against the modules themselves, built on the meta device, for
the tiny, the released and other valid configs."""
import collections
import copy
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
from pipeline.codec.config import SpeechTokenizerConfig
from pipeline.codec.decoder import SpeechDecoder
from pipeline.codec.streaming import derive_all_
from pipeline.codec.tokenizer import SpeechTokenizer
from pipeline.loading import load_model
from pipeline.memory_plan import GIB, VOCODER_BATCH_BYTES, VOCODER_BATCH_ROWS, MemoryPlan, NotEnoughMemory, most_rows, tts_row_cap
from pipeline.model import Qwen3TTS, TTSConfig
from pipeline.released import RELEASED_CONFIG, real_size_config
from pipeline.service import ModelService
from pipeline.speaker_encoder import tiny_speaker_encoder_config
from pipeline.tiny import SPECIAL_TOKENS, TINY_SPEECH_TOKENIZER_CONFIG, tiny_config, tiny_omni_config
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


BATCHED = MemoryPlan("Qwen3-TTS-12Hz-0.6B-CustomVoice", "bfloat16", weights=int(2.5 * GIB), per_row=int(0.25 * GIB), reserve=GIB,
                     max_rows=64, batch_reserve=VOCODER_BATCH_BYTES)


def test_engines_of_many_rows_also_need_their_batched_vocoders_memory():
    below = VOCODER_BATCH_ROWS - 1
    assert BATCHED.needed(below) == BATCHED.weights + BATCHED.reserve + below * BATCHED.per_row
    assert BATCHED.needed(VOCODER_BATCH_ROWS) == BATCHED.weights + BATCHED.reserve + VOCODER_BATCH_ROWS * BATCHED.per_row + VOCODER_BATCH_BYTES
    # Room for 48 rows but not for their batched vocoder: 47, which need none.
    assert BATCHED.rows_that_fit(BATCHED.needed(below) + 2 * BATCHED.per_row) == below
    assert BATCHED.rows_that_fit(BATCHED.needed(VOCODER_BATCH_ROWS)) == VOCODER_BATCH_ROWS
    assert BATCHED.rows_that_fit(BATCHED.needed(60) + BATCHED.per_row - 1) == 60
    with pytest.raises(NotEnoughMemory, match=r"at most 47 rows fit\.$"):
        BATCHED.choose_rows(VOCODER_BATCH_ROWS, BATCHED.needed(VOCODER_BATCH_ROWS) - 1)


def test_the_shared_row_cap_keeps_the_batched_vocoder_where_it_gives_48_rows_or_more():
    assert most_rows(10_000, 100, 500) == 95  # 100 rows without the reserve, 95 with it: batched
    assert most_rows(4_900, 100, 500) == 47  # 49 rows without it, 44 with it: 47, without batched calls
    assert most_rows(5_300, 100, 500) == 48
    assert most_rows(4_700, 100, 500) == 47
    assert [tts_row_cap(int(g * GIB), torch.bfloat16, DEFAULT_MAX_SEQ) for g in (24, 40, 48, 53, 53.5, 64.3, 80)] == [13, 37, 47, 47, 48, 64, 64]


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


# ---- the arithmetic against the modules --------------------------------------------------------

def meta_bytes(build, dtype: torch.dtype | None = None) -> int:
    """Bytes of the parameters and buffers of the module `build()` makes on the meta device (nothing is
    allocated), its floating-point tensors counted in `dtype` where given, as the loaders cast them;
    each storage once (a derived tensor that is a view of a parameter takes no memory of its own)."""
    with torch.device("meta"):
        module = build()
        derive_all_(module)  # the derived tensors the load's post-hooks add (not built on meta)
    storages = {}
    for t in (*module.parameters(), *module.buffers()):
        storage = t.untyped_storage()
        size = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
        storages[storage._cdata] = storage.nbytes() // t.element_size() * size
    return sum(storages.values())


def meta_stream_state_bytes(build) -> int:
    """Bytes of one stream's state of the vocoder `build()` makes: what `StreamState` allocates per row,
    from each stateful layer's `init_state` (float32, as the codecs run)."""
    with torch.device("meta"):
        vocoder = build()
        derive_all_(vocoder)
    total = 0
    for layer in vocoder.modules():
        state = layer.init_state(1, torch.device("meta"), torch.float32) if hasattr(layer, "init_state") else None
        for t in (state if isinstance(state, tuple) else (state,) if state is not None else ()):
            total += t.numel() * t.element_size()
    return total


SPECIAL_IDS = {token: 151643 + i for i, token in enumerate(SPECIAL_TOKENS)}


def tts_config(size: str | None, model_type: str, talker: dict | None = None, predictor: dict | None = None,
               speaker_encoder: dict | None = None) -> TTSConfig:
    """The tiny (`size` None) or a released size's config of `model_type`, with the talker's, the code predictor's
    and the speaker encoder's keys changed as given."""
    raw = tiny_config(model_type, SPECIAL_IDS) if size is None else real_size_config(size, model_type, SPECIAL_IDS)
    raw["talker_config"].update(talker or {})
    raw["talker_config"]["code_predictor_config"].update(predictor or {})
    raw["speaker_encoder_config"].update(speaker_encoder or {})
    return TTSConfig.from_dict(raw)


TTS_CONFIGS = {
    **{f"tiny {kind}": tts_config(None, kind) for kind in ("base", "custom_voice", "voice_design")},
    **{f"{size} {kind}": tts_config(size, kind) for size, kind in memory_plan.TTS_NAMES},
    "more layers, fewer heads": tts_config(None, "custom_voice", dict(num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=1)),
    "as many kv heads as heads": tts_config(None, "voice_design", dict(num_attention_heads=4, num_key_value_heads=4)),
    "head_dim from hidden / heads": tts_config(None, "custom_voice", dict(head_dim=None, num_attention_heads=8)),
    "wider head_dim": tts_config(None, "base", dict(head_dim=40)),
    "wider talker, no projection": tts_config(None, "custom_voice", dict(hidden_size=32, intermediate_size=96),
                                              dict(hidden_size=32, intermediate_size=40)),
    "projected predictor": tts_config(None, "base", dict(hidden_size=96), dict(hidden_size=48, num_hidden_layers=3, head_dim=12),
                                      dict(enc_dim=96)),
    "other vocabularies": tts_config(None, "custom_voice", dict(vocab_size=3100, text_vocab_size=5000, text_hidden_size=40),
                                     dict(vocab_size=1024, num_code_groups=8)),
    "other speaker encoder": tts_config(None, "base", speaker_encoder={
        **tiny_speaker_encoder_config(64), "enc_channels": [24, 24, 24, 48], "enc_kernel_sizes": [3, 5, 3, 1],
        "enc_dilations": [1, 2, 3, 1], "enc_res2net_scale": 4, "enc_se_channels": 8, "enc_attention_channels": 12, "mel_dim": 80}),
}


@pytest.mark.parametrize("name", TTS_CONFIGS)
def test_the_talkers_bytes_from_its_config_are_its_modules_bytes(name):
    config = TTS_CONFIGS[name]
    for dtype in (torch.bfloat16, torch.float32):
        assert memory_plan.tts_model_bytes(config, dtype) == meta_bytes(lambda: Qwen3TTS(config), dtype), (name, dtype)


def codec_config(encoder: dict | None = None, decoder: dict | None = None, tiny: bool = True) -> SpeechTokenizerConfig:
    """The tiny or the released (`tiny` False: the defaults) speech tokenizer's config, its encoder's and decoder's keys changed as given."""
    raw = copy.deepcopy(TINY_SPEECH_TOKENIZER_CONFIG) if tiny else {"encoder_config": {}, "decoder_config": {}}
    raw["encoder_config"].update(encoder or {})
    raw["decoder_config"].update(decoder or {})
    return SpeechTokenizerConfig.from_dict(raw)


CODEC_CONFIGS = {
    "tiny": codec_config(),
    "released": codec_config(tiny=False),
    "attention biases": codec_config(dict(attention_bias=True), dict(attention_bias=True)),
    "latents not projected": codec_config(dict(hidden_size=16, intermediate_size=32)),
    "more layers and residual layers": codec_config(dict(num_residual_layers=2, num_hidden_layers=3, compress=4, kernel_size=5),
                                                    dict(num_hidden_layers=3, num_key_value_heads=4, head_dim=8)),
    "other rates and widths": codec_config(dict(upsampling_ratios=[4, 8, 5, 4], num_filters=8),
                                           dict(upsample_rates=[6, 5, 4, 4], upsampling_ratios=[4], decoder_dim=48, latent_dim=24,
                                                codebook_dim=32, sliding_window=20)),
    "a one-channel last block": codec_config(decoder=dict(decoder_dim=16)),  # 16, 8, 4, 2, 1 channels
    "codebooks": codec_config(dict(num_quantizers=20, codebook_size=512, num_semantic_quantizers=2), dict(codebook_size=512)),
}


@pytest.mark.parametrize("name", CODEC_CONFIGS)
def test_the_codecs_bytes_and_stream_state_from_its_config_are_its_modules(name):
    config = CODEC_CONFIGS[name]
    assert memory_plan.codec_bytes(config) == meta_bytes(lambda: SpeechTokenizer(config), torch.float32)
    assert memory_plan.codec_stream_bytes(config.decoder) == meta_stream_state_bytes(lambda: SpeechDecoder(config.decoder))


def omni_config(tiny: bool = True, thinker: dict | None = None, text: dict | None = None, code2wav: dict | None = None) -> dict:
    """Qwen3-Omni's tiny (ids only name tokens) or released config, its thinker's, its thinker's text model's and
    its code2wav's keys changed as given."""
    config = tiny_omni_config(collections.defaultdict(int)) if tiny else copy.deepcopy(RELEASED_CONFIG)
    config["thinker_config"].update(thinker or {})
    config["thinker_config"]["text_config"].update(text or {})
    config["code2wav_config"].update(code2wav or {})
    return config


OMNI_CONFIGS = {
    "tiny": omni_config(),
    "released": omni_config(tiny=False),
    "tied embeddings": omni_config(thinker=dict(tie_word_embeddings=True)),
    "dense layers among sparse": omni_config(text=dict(mlp_only_layers=[0], decoder_sparse_step=2, attention_bias=True)),
    "longer audio positions": omni_config(thinker=dict(audio_config={**omni_config()["thinker_config"]["audio_config"], "max_source_positions": 2000,
                                                                     "num_mel_bins": 80})),
    "other code2wav": omni_config(code2wav=dict(decoder_dim=48, upsample_rates=[6, 5, 4, 4], upsampling_ratios=[4], num_hidden_layers=2)),
}


def omni_modules_bytes(config: dict, dtype: torch.dtype) -> int:
    """Bytes of the thinker (transformers' module, without its vision encoder) and the talker in `dtype`, and code2wav in float32."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration

    from pipeline.omni.code2wav import Code2Wav, Code2WavConfig
    from pipeline.omni.talker import OmniTalker, OmniTalkerConfig

    def thinker() -> nn.Module:
        model = Qwen3OmniMoeThinkerForConditionalGeneration(Qwen3OmniMoeThinkerConfig(**config["thinker_config"]))
        model.model.visual = None  # as pipeline.omni.thinker keeps it: messages are text and audio
        return model

    return (meta_bytes(thinker, dtype) + meta_bytes(lambda: OmniTalker(OmniTalkerConfig.from_dict(config["talker_config"])), dtype)
            + meta_bytes(lambda: Code2Wav(Code2WavConfig.from_dict(config["code2wav_config"])), torch.float32))


@pytest.mark.parametrize("name", OMNI_CONFIGS)
def test_qwen3_omnis_bytes_and_stream_state_from_its_config_are_its_modules(name):
    from pipeline.omni.code2wav import Code2Wav, Code2WavConfig

    config = OMNI_CONFIGS[name]
    assert memory_plan.released_omni_weight_bytes(config, torch.bfloat16) == omni_modules_bytes(config, torch.bfloat16)
    code2wav = Code2WavConfig.from_dict(config["code2wav_config"])
    assert memory_plan.stream_state_bytes(code2wav, code2wav.hidden_size) == meta_stream_state_bytes(lambda: Code2Wav(code2wav))


def test_the_plan_builds_no_module(tiny_checkpoints, monkeypatch):
    """The plans count from the configs alone: no module is built, on the meta device or any other."""
    def refuse(*args, **kwargs):
        raise AssertionError("the memory plan built a module")

    memory_plan.shared_tts_plans.cache_clear()
    monkeypatch.setattr(nn.Module, "__init__", refuse)
    plan_of(Path(tiny_checkpoints["base"]))
    memory_plan.tts_row_cap(24 * GIB, torch.bfloat16, DEFAULT_MAX_SEQ)
    memory_plan.table_plans()
