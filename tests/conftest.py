import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("torchaudio") is None:
    sys.path.append(str(Path(__file__).parent / "reference_shims"))
