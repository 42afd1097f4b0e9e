"""Parity of our speaker encoder and mel with the official qwen_tts implementation (tiny, CPU)."""
import numpy as np
import pytest
import torch

from pipeline.speaker_encoder import (
    SpeakerEncoder,
    SpeakerEncoderConfig,
    mel_spectrogram,
    tiny_speaker_encoder_config,
)
from pipeline.tiny import randomize_

SR = 24000


def _signal(seconds: float = 2.0, seed: int = 0, f0: float = 140.0) -> np.ndarray:
    """Voice-like test clip: harmonic tone with vibrato, amplitude envelope, noise and a silent gap."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    phase = 2 * np.pi * np.cumsum(f0 * (1 + 0.03 * np.sin(2 * np.pi * 5 * t))) / SR
    wav = sum(np.sin(k * phase) / k for k in range(1, 12))
    wav = wav * (0.5 + 0.5 * np.sin(2 * np.pi * 1.5 * t) ** 2) + 0.02 * rng.standard_normal(t.size)
    wav[int(0.8 * SR) : int(0.9 * SR)] = 0.0  # exact zeros exercise the log floor and the +1e-9
    return (0.3 * wav / np.abs(wav).max()).astype(np.float32)


def _ours(config: dict) -> SpeakerEncoder:
    model = SpeakerEncoder(SpeakerEncoderConfig.from_dict(config)).eval()
    randomize_(model, torch.Generator().manual_seed(0))
    return model


def _reference(config: dict) -> torch.nn.Module:
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSSpeakerEncoder

    return Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**config)).eval()


def _reference_mel(wav: np.ndarray) -> torch.Tensor:
    from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram as ref_mel

    # The arguments the reference's extract_speaker_embedding passes.
    return ref_mel(torch.from_numpy(wav)[None], n_fft=1024, num_mels=128, sampling_rate=24000,
                   hop_size=256, win_size=1024, fmin=0, fmax=12000)


def test_default_config_matches_reference_defaults():
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig

    ref = Qwen3TTSSpeakerEncoderConfig()
    ours = SpeakerEncoderConfig.from_dict({"model_type": "ignored"})
    for key, value in ours.to_dict().items():
        assert getattr(ref, key) == value, key
    assert SpeakerEncoderConfig.from_dict({"enc_dim": 2048}).enc_dim == 2048


def test_real_size_state_dict_keys_match_reference():
    config = {"enc_dim": 1024, "sample_rate": 24000}  # what the released 0.6B config.json sets
    with torch.device("meta"):
        ours = SpeakerEncoder(SpeakerEncoderConfig.from_dict(config)).state_dict()
        ref = _reference(config).state_dict()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in ref.items()}
    assert len(ours) == 76


def test_invalid_config_is_rejected():
    with pytest.raises(ValueError, match="sum"):
        SpeakerEncoderConfig(enc_channels=[32, 32, 32, 32, 64])
    with pytest.raises(ValueError, match="divisible"):
        SpeakerEncoderConfig(enc_channels=[36, 36, 36, 36, 108], enc_res2net_scale=8)


def test_mel_matches_reference():
    wav = _signal()
    ours = mel_spectrogram(torch.from_numpy(wav)[None])
    ref = _reference_mel(wav)
    assert ours.shape == ref.shape == (1, 128, wav.size // 256)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


def test_embedding_matches_reference_fp32():
    config = tiny_speaker_encoder_config()
    ours = _ours(config)
    ref = _reference(config)
    # The way the top-level model will load it: checkpoint keys minus the "speaker_encoder." prefix.
    checkpoint = {f"speaker_encoder.{k}": v for k, v in ours.state_dict().items()}
    ref.load_state_dict({k[len("speaker_encoder."):]: v for k, v in checkpoint.items()}, strict=True)
    wav = _signal()
    emb = ours.embed(torch.from_numpy(wav))
    with torch.no_grad():
        ref_emb = ref(_reference_mel(wav).transpose(1, 2))[0]
    assert emb.shape == (config["enc_dim"],) and emb.dtype == torch.float32
    torch.testing.assert_close(emb, ref_emb, rtol=0, atol=1e-5)


def test_embedding_is_not_degenerate():
    ours = _ours(tiny_speaker_encoder_config())
    a = ours.embed(torch.from_numpy(_signal(seed=0, f0=140.0)))
    b = ours.embed(torch.from_numpy(_signal(seed=1, f0=220.0)))
    assert torch.isfinite(a).all() and a.std() > 0.1
    assert (a - b).norm() > 0.05 * a.norm()


def test_embedding_bf16_matches_reference_bf16():
    # 12 s = 1125 frames: not exact in bf16, which the pooling's 1/T must reproduce like the reference.
    config = tiny_speaker_encoder_config()
    ours = _ours(config)
    ref = _reference(config)
    ref.load_state_dict(ours.state_dict(), strict=True)
    ours, ref = ours.to(torch.bfloat16), ref.to(torch.bfloat16)
    wav = _signal(seconds=12.0)
    emb = ours.embed(torch.from_numpy(wav))
    with torch.no_grad():
        ref_emb = ref(_reference_mel(wav).transpose(1, 2).to(torch.bfloat16))[0]
    assert emb.dtype == torch.bfloat16
    torch.testing.assert_close(emb, ref_emb, rtol=0, atol=0)


def test_embed_rejects_bad_input():
    ours = _ours(tiny_speaker_encoder_config())
    with pytest.raises(ValueError, match="mono"):
        ours.embed(torch.zeros(2, 24000))
    with pytest.raises(ValueError, match="at least"):
        ours.embed(torch.zeros(500))


def test_mel_filter_bank_equals_librosa():
    """Ours is computed without librosa (the GPU image lacks it); it must be librosa's default Slaney bank."""
    import librosa

    from pipeline.speaker_encoder import _mel_basis

    for sr, n_fft, n_mels, fmax in ((24000, 1024, 128, 12000.0), (16000, 512, 80, 7600.0)):
        expected = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=0.0, fmax=fmax)
        assert np.abs(_mel_basis(sr, n_fft, n_mels, 0.0, fmax).numpy() - expected).max() <= 1e-7
