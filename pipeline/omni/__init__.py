"""Qwen3-Omni: code2wav, the vocoder of the talker's codes (offline and streamed)."""
from pipeline.omni.code2wav import Code2Wav, Code2WavConfig, Code2WavStream, decode

__all__ = ["Code2Wav", "Code2WavConfig", "Code2WavStream", "decode"]
