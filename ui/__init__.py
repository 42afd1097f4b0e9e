"""The Gradio app: one module per tab, the reusable latency panel and the PCM player."""
