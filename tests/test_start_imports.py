"""What a Qwen3-TTS load imports: a fresh process that loads the tiny checkpoints on the CPU holds none of the
heavy modules that loading does not need: the UI and the web server, Qwen3-Omni, the Hub client (a local
directory downloads nothing), the listening test's statistics."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_NEEDED = ("gradio", "fastapi", "uvicorn", "pipeline.omni", "pipeline.server", "pipeline.service", "pipeline.listening", "pipeline.remote",
              "huggingface_hub", "scipy", "sklearn", "statsmodels", "pandas")
HANG_GUARD_S = 600  # a load that never returns fails here instead of stalling the suite
LOAD = """
import json, sys
from pipeline.tts import TTS
for directory in sys.argv[1:]:
    TTS.from_pretrained(directory, device="cpu").engine.shutdown()
print(json.dumps(sorted(sys.modules)))
"""


def modules_after_loading(*directories: Path) -> set[str]:
    done = subprocess.run([sys.executable, "-c", LOAD, *map(str, directories)], cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_loading_a_tts_checkpoint_imports_no_module_it_does_not_need(tiny_checkpoints):
    loaded = modules_after_loading(*tiny_checkpoints.values())
    assert "pipeline.tts" in loaded and "pipeline.codec" in loaded  # the load ran in that process
    assert sorted(name for name in loaded if any(name == heavy or name.startswith(heavy + ".") for heavy in NOT_NEEDED)) == []
