# Import-only placeholder, used by the tests alone and only when the real torchaudio is missing.
# The reference package (qwen-tts-hf) imports torchaudio at module load for its 25 Hz tokenizer,
# which the 12 Hz models under test never use; no torchaudio wheel exists for torch 2.13, so the
# tests put this folder on sys.path to let the reference import (tests/conftest.py in the tests' process,
# tests/reference_runner.py in the reference's). Calling anything here fails loudly.
