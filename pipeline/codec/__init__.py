"""The Qwen3-TTS 12 Hz speech tokenizer (codec): 24 kHz audio <-> 16 codes per 80 ms frame.

config.py: the checkpoint's config. streaming.py: the per-row streaming state and causal convs.
decoder.py: the decoder and its streaming front ends. encoder.py: the Mimi encoder. tokenizer.py:
loading, encode and decode.
"""
from pipeline.codec.config import SpeechTokenizerConfig
from pipeline.codec.decoder import MultiStreamDecoder, StreamingDecoder
from pipeline.codec.streaming import StreamState
from pipeline.codec.tokenizer import SpeechTokenizer

__all__ = ["MultiStreamDecoder", "SpeechTokenizer", "SpeechTokenizerConfig", "StreamState", "StreamingDecoder"]
