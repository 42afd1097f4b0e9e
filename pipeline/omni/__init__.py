"""Qwen3-Omni (issue 8, in progress): code2wav, the vocoder of the talker's codes (offline and
streamed); the talker with its sparse MoE as a graph-safe step; the talker's prompt."""
from pipeline.omni.code2wav import Code2Wav, Code2WavConfig, Code2WavStream, decode
from pipeline.omni.moe import SparseMoeBlock
from pipeline.omni.prompt import PromptIds, assistant_part, text_specials, user_part
from pipeline.omni.talker import OmniTalker, OmniTalkerConfig

__all__ = ["Code2Wav", "Code2WavConfig", "Code2WavStream", "OmniTalker", "OmniTalkerConfig", "PromptIds", "SparseMoeBlock",
           "assistant_part", "decode", "text_specials", "user_part"]
