"""The README's CPU install (PyTorch's CPU wheel, then requirements.txt) has no Triton: the app must
import, load and speak without it. The test suite's own environment has Triton (the kernel tests
run in its interpreter), so the check runs in a child process in which `import triton` fails."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in the child: Triton made unimportable, then the app's own start-up path (`app.local_service`,
# as `python app.py --tiny --device cpu` builds it) and one utterance streamed through the service.
WITHOUT_TRITON = r"""
import json
import sys


class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoTriton())

import numpy as np

import app
from pipeline.engine.core import Chunk
from pipeline.request import SpeechRequest

parser = app.build_parser()
service = app.local_service(parser.parse_args(["--tiny", "--device", "cpu"]), parser)
speaker = service.info("custom_voice").speakers[0]
request = SpeechRequest("Hello from a machine without a GPU.", model_type="custom_voice", speaker=speaker, seed=1, max_frames=24)
audio = np.concatenate([event.audio for event in service.stream(request) if isinstance(event, Chunk)])
print(json.dumps({"samples": int(audio.size), "peak": float(np.abs(audio).max())}))
"""


def test_the_app_speaks_on_a_cpu_install_without_triton():
    child = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], check=False, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, f"the app failed without Triton:\n{child.stderr[-3000:]}"
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["samples"] > 0 and result["peak"] > 0  # audio came out, and it is not silence
