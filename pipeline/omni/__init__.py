"""Qwen3-Omni (issue 8, in progress): code2wav, the vocoder of the talker's codes (offline and
streamed), and the talker with its sparse MoE as a graph-safe step."""
from pipeline.omni.code2wav import Code2Wav, Code2WavConfig, Code2WavStream, decode
from pipeline.omni.moe import SparseMoeBlock
from pipeline.omni.talker import OmniTalker, OmniTalkerConfig

__all__ = ["Code2Wav", "Code2WavConfig", "Code2WavStream", "OmniTalker", "OmniTalkerConfig", "SparseMoeBlock", "decode"]
