"""Qwen3-TTS inference: model code, loading, generation and streaming. Never imports gradio."""
