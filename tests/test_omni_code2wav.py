"""Qwen3-Omni's code2wav: parity with transformers' `Qwen3OmniMoeCode2Wav` on a tiny random
checkpoint in the official layout, streamed decoding equal to offline decoding for any chunking
(the look-ahead held back, never guessed), and loading only the code2wav tensors."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

from pipeline.errors import CheckpointError
from pipeline.omni import Code2Wav, Code2WavConfig, Code2WavStream, decode
from pipeline.tiny import randomize_code2wav_

HOP = 1920
TOL = 1e-5
# Real rates (1920 samples per frame, 555 of look-ahead), small widths, a short window so that
# 40 frames already slide it, grouped KV heads.
TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=96,
            decoder_dim=64, sliding_window=16)


def _codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(seed))


def _hf_config() -> Qwen3OmniMoeCode2WavConfig:
    config = Qwen3OmniMoeCode2WavConfig(**TINY)
    config._attn_implementation = "eager"
    return config


def _write_checkpoint(directory: Path, model: Code2Wav, sharded: bool) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen3_omni_moe", "code2wav_config": _hf_config().to_dict()}
    (directory / "config.json").write_text(json.dumps(config))
    code2wav = {f"code2wav.{k}": v.contiguous() for k, v in model.state_dict().items()}
    thinker = {"thinker.model.norm.weight": torch.ones(8)}
    if not sharded:
        save_file({**thinker, **code2wav}, directory / "model.safetensors")
        return directory
    # The thinker's shard is garbage: reading the code2wav must not touch it.
    (directory / "model-00001-of-00002.safetensors").write_bytes(b"not a safetensors file")
    save_file(code2wav, directory / "model-00002-of-00002.safetensors")
    weight_map = {**{k: "model-00001-of-00002.safetensors" for k in thinker}, **{k: "model-00002-of-00002.safetensors" for k in code2wav}}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Code2Wav:
    model = Code2Wav(Code2WavConfig.from_dict(_hf_config().to_dict()))
    randomize_code2wav_(model, torch.Generator().manual_seed(0))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, written) -> Path:
    return _write_checkpoint(tmp_path_factory.mktemp("omni"), written, sharded=False)


@pytest.fixture(scope="module")
def ours(checkpoint) -> Code2Wav:
    return Code2Wav.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def reference(written) -> Qwen3OmniMoeCode2Wav:
    model = Qwen3OmniMoeCode2Wav(_hf_config()).eval()
    model.load_state_dict(written.state_dict(), strict=True)
    return model


def test_parameter_names_are_the_official_ones(ours, reference):
    assert set(ours.state_dict()) == set(reference.state_dict())


def test_lookahead_of_the_released_config_is_555_samples():
    config = Code2WavConfig()
    assert (config.upsample, config.lookahead) == (1920, 555)


@pytest.mark.parametrize("frames", [1, 5, 40])
def test_offline_decode_matches_transformers(ours, reference, frames):
    codes = _codes(frames, seed=frames)
    with torch.no_grad():
        expected = reference(codes.T[None])[0, 0]
    got = decode(ours, codes)
    assert got.shape == (frames * HOP - 555,) == expected.shape
    assert expected.std() > 0.05 and (expected.abs() < 1).float().mean() > 0.9  # not silence, not clipped
    assert (got - expected).abs().max() <= TOL


@pytest.mark.parametrize("chunks", [[1] * 12, [3, 1, 7, 2, 5, 1, 11, 4, 6], [40], [2, 38]])
def test_streamed_decode_equals_offline_for_any_chunking(ours, chunks):
    codes = _codes(sum(chunks), seed=7)
    offline = decode(ours, codes)
    stream = Code2WavStream(ours)
    parts = [stream.decode_chunk(c) for c in codes.split(chunks)]
    # Every call hands out what no later frame can change: the first holds back the look-ahead.
    assert [len(p) for p in parts] == [chunks[0] * HOP - 555] + [n * HOP for n in chunks[1:]]
    assert (torch.cat(parts) - offline).abs().max() <= TOL


def test_reset_starts_a_new_stream(ours):
    codes = _codes(9, seed=3)
    stream = Code2WavStream(ours)
    stream.decode_chunk(_codes(5, seed=4))
    stream.reset()
    again = torch.cat([stream.decode_chunk(c) for c in codes.split(4)])
    assert (again - decode(ours, codes)).abs().max() <= TOL


def test_sharded_checkpoint_reads_only_the_code2wav_shards(tmp_path, written, ours):
    loaded = Code2Wav.from_pretrained(_write_checkpoint(tmp_path / "sharded", written, sharded=True))
    codes = _codes(6, seed=5)
    assert torch.equal(decode(loaded, codes), decode(ours, codes))


def test_missing_tensor_or_config_is_a_checkpoint_error(tmp_path, written):
    directory = _write_checkpoint(tmp_path / "ckpt", written, sharded=False)
    state = {f"code2wav.{k}": v.contiguous() for k, v in written.state_dict().items() if not k.startswith("decoder.0.")}
    save_file(state, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match="do not match its code2wav_config"):
        Code2Wav.from_pretrained(directory)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe"}))
    with pytest.raises(CheckpointError, match="no code2wav_config"):
        Code2Wav.from_pretrained(directory)
