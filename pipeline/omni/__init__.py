"""Qwen3-Omni chat: `OmniChat` answers a conversation in streamed text and speech.

chat.py: the entry point and the conversation loop. conversation.py: the chat layout and audio
messages. thinker.py: transformers' thinker, every conversation a row of one batched step;
row_invariant.py: its experts and attention functions and row caches. prompt.py: the talker's
prompt. talker.py / moe.py: the talker with its sparse MoE as a graph-safe step. code2wav.py: the
vocoder.
"""
from pipeline.omni.chat import DEFAULT_SPEAKER, DEFAULT_SYSTEM_PROMPT, HUB_ID, MAX_REPLY_TOKENS, ChatEnd, ChatReply, ChatRequest, ChatStream, OmniChat, TextDelta
from pipeline.omni.code2wav import Code2Wav, Code2WavConfig, Code2WavStream, decode
from pipeline.omni.conversation import MAX_AUDIO_SECONDS, Turn
from pipeline.omni.moe import SparseMoeBlock
from pipeline.omni.prompt import PromptIds, assistant_part, text_specials, user_part
from pipeline.omni.talker import OmniTalker, OmniTalkerConfig

__all__ = ["DEFAULT_SPEAKER", "DEFAULT_SYSTEM_PROMPT", "HUB_ID", "MAX_AUDIO_SECONDS", "MAX_REPLY_TOKENS", "ChatEnd", "ChatReply", "ChatRequest", "ChatStream", "Code2Wav",
           "Code2WavConfig", "Code2WavStream", "OmniChat", "OmniTalker", "OmniTalkerConfig", "PromptIds", "SparseMoeBlock", "TextDelta",
           "Turn", "assistant_part", "decode", "text_specials", "user_part"]
