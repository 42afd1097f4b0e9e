"""The official Qwen3-TTS code (qwen-tts-hf, the `qwen_tts` package) as a test oracle, in a process
of its own.

The official 12 Hz speech tokenizer builds on transformers' MimiModel as it was up to 5.15 (later
releases split it into encoder and decoder halves that it cannot construct), while the app and its
tests run on the transformers that requirements.txt resolves to. So a test that needs the official
tokenizer (a whole official model included) hands `Reference.run` a job: a subprocess whose
sys.path puts REFERENCE_SITE first (transformers 5.15.1 with the tokenizers and huggingface_hub
it accepts, from requirements-reference.txt, installed there by .ci/run) runs the official code on a checkpoint the
test wrote and returns its outputs through a .safetensors file. Models stay loaded from one job to
the next. Run as a script, this module is that subprocess: one JSON job a line on stdin, one JSON
answer a line on its original stdout (everything the official code prints goes to stderr).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

REFERENCE_TRANSFORMERS = "5.15.1"  # the release whose MimiModel the official 12 Hz tokenizer builds on
REFERENCE_SITE = Path(sys.prefix) / "reference-site"  # inside the test venv, so that it goes with it
REPO = Path(__file__).resolve().parent.parent
SHIMS = Path(__file__).resolve().parent / "reference_shims"


# ---- the test side ------------------------------------------------------------------------------


class Reference:
    """The subprocess that runs the official code, started on the first job."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._files = tempfile.TemporaryDirectory(prefix="reference-")
        self._jobs = 0

    def run(self, job: str, tensors: dict[str, torch.Tensor] | None = None, **options) -> tuple[dict[str, torch.Tensor], dict]:
        """Job `job` (a function in JOBS) on `tensors` and JSON `options`: the tensors and JSON it returns."""
        self._jobs += 1
        inputs, outputs = (Path(self._files.name) / f"{self._jobs}-{side}.safetensors" for side in ("in", "out"))
        save_file({name: t.detach().cpu().clone().contiguous() for name, t in (tensors or {}).items()}, inputs)
        answer = self._ask({"job": job, "inputs": str(inputs), "outputs": str(outputs), "options": options})
        if "error" in answer:
            raise AssertionError(f"The official code failed in reference job {job!r}:\n{answer['error']}")
        with safe_open(outputs, "pt") as f:
            meta = json.loads(f.metadata()["json"])
        return load_file(outputs), meta

    def _ask(self, request: dict) -> dict:
        process = self._start()
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        return self._answer(process)

    def _start(self) -> subprocess.Popen:
        if self._process is None:
            path = [str(REFERENCE_SITE)] if REFERENCE_SITE.is_dir() else []
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
            process = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, env=env, cwd=REPO)
            ready = self._answer(process)
            if "error" in ready:  # it has ended; the next job starts a new one and reads the same sentence
                process.stdin.close()
                process.wait()
                raise AssertionError(ready["error"])
            self._process = process
        return self._process

    @staticmethod
    def _answer(process: subprocess.Popen) -> dict:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"The reference process ended (exit code {process.wait()}); its stderr is above.")
        return json.loads(line)

    def close(self) -> None:
        if self._process is not None:
            self._process.stdin.close()
            self._process.wait()
        self._files.cleanup()


# ---- the subprocess side: jobs on the official code -----------------------------------------------

_loaded: dict[tuple, object] = {}


def _cached(key: tuple, load: Callable[[], object]):
    if key not in _loaded:
        _loaded[key] = load()
    return _loaded[key]


def _tokenizer(path: str, state: dict[str, torch.Tensor]):
    """qwen_tts.Qwen3TTSTokenizer for `path`; `state`, if any, loaded into it strictly both ways."""
    import qwen_tts

    tokenizer = _cached(("tokenizer", path), lambda: qwen_tts.Qwen3TTSTokenizer.from_pretrained(path))
    if state:
        tokenizer.model.load_state_dict(state, strict=True)
    return tokenizer


def tokenizer_encode(tensors, path: str):
    """The official tokenizer's encode() of `wav` (24 kHz), after loading `state.*` if given."""
    state = {name.removeprefix("state."): t for name, t in tensors.items() if name.startswith("state.")}
    tokenizer = _tokenizer(path, state)
    if "wav" not in tensors:
        return {}, {}
    return {"codes": tokenizer.encode(tensors["wav"].numpy(), sr=24000).audio_codes[0]}, {}


def tokenizer_decode(tensors, path: str):
    """The official decode() of `codes` [frames, 16] (windows of 300 frames beyond 300)."""
    return {"wav": torch.from_numpy(_tokenizer(path, {}).decode({"audio_codes": [tensors["codes"]]})[0][0])}, {}


def tokenizer_decoder_forward(tensors, path: str):
    """The official decoder module's own forward over all of `codes` at once."""
    with torch.inference_mode():
        return {"wav": _tokenizer(path, {}).model.decoder(tensors["codes"].T[None])[0, 0]}, {}


def _tts(path: str):
    from qwen_tts import Qwen3TTSModel

    return _cached(("tts", path), lambda: Qwen3TTSModel.from_pretrained(path, dtype=torch.float32))


def tts_generate(tensors, path: str, method: str, kwargs: dict):
    """Qwen3TTSModel.`method`(**kwargs) with spies on its model: the codes it generated, the
    waveform, the talker's prefill and per-frame text (None values among `kwargs` are left out)."""
    reference = _tts(path)
    captured = {}
    generate, talker_generate = reference.model.generate, reference.model.talker.generate

    def model_generate(*args, **kw):
        out = generate(*args, **kw)
        captured["codes"] = out[0][0]
        return out

    def talker_spy(*args, **kw):
        captured["prefill"], captured["trailing"] = kw["inputs_embeds"], kw["trailing_text_hidden"]
        return talker_generate(*args, **kw)

    reference.model.generate, reference.model.talker.generate = model_generate, talker_spy
    try:
        wavs, _ = getattr(reference, method)(**{k: v for k, v in kwargs.items() if v is not None})
    finally:
        del reference.model.generate, reference.model.talker.generate
    return {"wav": torch.from_numpy(wavs[0]), **captured}, {}


def tts_decode(tensors, path: str):
    """The official model's speech tokenizer decode() of `codes`."""
    wavs, _ = _tts(path).model.speech_tokenizer.decode([{"audio_codes": tensors["codes"]}])
    return {"wav": torch.from_numpy(wavs[0])}, {}


def tts_voice_prompt(tensors, path: str, ref_audio: str, ref_text: str):
    """create_voice_clone_prompt's reference codes and speaker embedding."""
    prompt = _tts(path).create_voice_clone_prompt(ref_audio, ref_text)[0]
    return {"ref_code": prompt.ref_code, "ref_spk_embedding": prompt.ref_spk_embedding}, {}


def _official(path: str):
    from benchmarks import compare as bc

    return _cached(("official", path), lambda: bc.load_official(Path(path), "cpu"))


def official_state(tensors, path: str):
    """What benchmarks.compare.load_official loaded: the model's tensors (`model.*`) and its speech
    tokenizer's (`tokenizer.*`), and the talker's codec EOS id."""
    model = _official(path).model
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    out.update({f"tokenizer.{k}": v for k, v in model.speech_tokenizer.model.state_dict().items()})
    return out, {"eos": model.config.talker_config.codec_eos_token_id}


def official_codes(tensors, path: str, kwargs: dict):
    """The codes the official generate_custom_voice makes (its model's generate, spied on)."""
    reference = _official(path)
    captured = {}
    generate = reference.model.generate

    def spy(*args, **kw):
        out = generate(*args, **kw)
        captured["codes"] = out[0][0]
        return out

    reference.model.generate = spy
    try:
        reference.generate_custom_voice(**kwargs)
    finally:
        del reference.model.generate
    return captured, {}


def official_shapes(tensors, config: dict, codec: dict):
    """Tensor names and shapes the official classes build for `config` (config.json) and `codec`
    (speech_tokenizer/config.json), on the meta device."""
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Config,
    )
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2Model,
    )

    def shapes(module):
        return {name: list(t.shape) for name, t in module.state_dict().items()}

    with torch.device("meta"):
        return {}, {"model": shapes(Qwen3TTSForConditionalGeneration(Qwen3TTSConfig.from_dict(config))),
                    "codec": shapes(Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config.from_dict(codec)))}


def official_bench(tensors, path: str, model_type: str, frames: int, runs: int, warm_frames: int):
    """benchmarks.compare.bench_official on the CPU: per key, its runs as JSON."""
    from benchmarks import compare as bc

    results = bc.bench_official(Path(path), model_type, bc.Inputs.for_type(model_type), frames, runs, warm_frames, device="cpu")
    return {}, {key: [asdict(run) for run in measured] for key, measured in results}


JOBS: dict[str, Callable] = {f.__name__: f for f in (
    tokenizer_encode, tokenizer_decode, tokenizer_decoder_forward, tts_generate, tts_decode, tts_voice_prompt,
    official_state, official_codes, official_shapes, official_bench)}


def _untied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor in storage of its own (safetensors refuses tensors that share memory)."""
    return {name: t.detach().cpu().clone().contiguous() for name, t in tensors.items()}


def _serve(answers) -> None:
    for line in sys.stdin:
        request = json.loads(line)
        try:
            tensors, meta = JOBS[request["job"]](load_file(request["inputs"]), **request["options"])
            save_file(_untied(tensors), request["outputs"], metadata={"json": json.dumps(meta)})
            answer = {"ok": True}
        except Exception:  # noqa: BLE001 - the test that sent the job reports it
            answer = {"error": traceback.format_exc()}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def _ready() -> dict:
    """The reference's transformers, or the sentence saying how to install it."""
    import transformers

    if transformers.__version__ != REFERENCE_TRANSFORMERS:
        return {"error": f"The reference tests need transformers {REFERENCE_TRANSFORMERS} for the official code (its 12 Hz "
                         f"tokenizer builds on MimiModel as it was up to 5.15) and found {transformers.__version__}; install it "
                         f"beside the app's with: pip install --no-deps --upgrade --target {REFERENCE_SITE} -r requirements-reference.txt"}
    if importlib.util.find_spec("torchaudio") is None:  # as tests/conftest.py: the reference imports it at module load
        sys.path.append(str(SHIMS))
    return {"ok": True}


def main() -> None:
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the official code's prints must not reach the answers
    ready = _ready()
    answers.write(json.dumps(ready) + "\n")
    answers.flush()
    if "ok" in ready:
        _serve(answers)


if __name__ == "__main__":
    main()
