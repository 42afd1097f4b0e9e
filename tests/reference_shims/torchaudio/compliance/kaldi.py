# Import-only placeholder (see ../__init__.py): the 25 Hz tokenizer's kaldi fbank is never called by the 12 Hz models.
def __getattr__(name):
    raise RuntimeError(f"torchaudio.compliance.kaldi.{name} is an import-only test placeholder")
