"""The dtype each device runs in (pipeline.loading.choose_dtype): bfloat16 on GPUs of compute
capability 8.0 or newer, float16 below, float32 on the CPU, a requested one checked against the GPU,
and a GPU older than the PyTorch build refused, each in one sentence before anything loads. The
GPUs are described by hand (name, compute capability, the build's oldest), so every case runs here."""
import logging

import numpy as np
import pytest
import soundfile as sf
import torch

from pipeline.__main__ import EXIT_BAD_INPUT, main
from pipeline.errors import TTSInputError
from pipeline.loading import CudaGPU, choose_dtype, oldest_capability

CUDA_13_BUILD = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_110", "sm_120", "compute_120"]  # torch.cuda.get_arch_list() of a cu130 wheel
H100 = CudaGPU("NVIDIA H100 80GB HBM3", (9, 0), (7, 5))
T4 = CudaGPU("Tesla T4", (7, 5), (7, 5))
V100 = CudaGPU("Tesla V100-SXM2-16GB", (7, 0), (7, 5))


def test_the_oldest_capability_is_the_builds_oldest_machine_code():
    assert oldest_capability(CUDA_13_BUILD) == (7, 5)
    assert oldest_capability(["sm_90a", "sm_100", "compute_70"]) == (9, 0)  # PTX runs on newer GPUs only
    assert oldest_capability(["gfx90a", "gfx942"]) == (0, 0)  # a ROCm build names no sm_


def test_each_device_gets_the_dtype_it_runs_best_and_says_which():
    assert choose_dtype(None, H100) == ("bfloat16", "This GPU (NVIDIA H100 80GB HBM3, compute capability 9.0) runs in bfloat16.")
    assert choose_dtype(None, T4) == ("float16", "This GPU (Tesla T4, compute capability 7.5) has no bfloat16; running in float16.")
    assert choose_dtype(None, None) == ("float32", "Running in float32 on the CPU.")


@pytest.mark.parametrize("requested, gpu", [("float16", H100), ("float32", H100), ("float16", T4), ("float32", T4), ("float16", None),
                                            ("bfloat16", None)])
def test_a_requested_dtype_the_device_runs_is_kept(requested, gpu):
    choice = choose_dtype(requested, gpu)
    assert choice.name == requested and requested in choice.sentence


def test_bfloat16_on_a_gpu_without_it_is_refused_in_one_sentence():
    with pytest.raises(TTSInputError) as refused:
        choose_dtype("bfloat16", T4)
    assert str(refused.value) == ("This GPU (Tesla T4, compute capability 7.5) has no bfloat16, which needs compute capability 8.0 "
                                  "or newer: use --dtype float16 or float32.")


@pytest.mark.parametrize("requested", [None, "float32"])
def test_a_gpu_older_than_the_pytorch_build_is_refused_in_one_sentence(requested):
    with pytest.raises(TTSInputError) as refused:
        choose_dtype(requested, V100)
    assert str(refused.value) == (f"This GPU (Tesla V100-SXM2-16GB, compute capability 7.0) is too old for this PyTorch build "
                                  f"(torch {torch.__version__}), which runs on compute capability 7.5 or newer: use --device cpu.")


def test_an_unknown_dtype_is_refused_naming_the_ones_there_are():
    with pytest.raises(TTSInputError, match=r"^Unsupported dtype 'float64': use one of float32, bfloat16, float16\.$"):
        choose_dtype("float64", H100)


def test_the_app_serves_the_dtype_asked_for_and_logs_the_sentence(caplog):
    pytest.importorskip("gradio")
    import app

    parser = app.build_parser()
    with caplog.at_level(logging.INFO, logger="app"):
        service = app.local_service(parser.parse_args(["--tiny", "--device", "cpu", "--dtype", "float16"]), parser)
    assert service.dtype == "float16" and "Running in float16 on the CPU." in caplog.messages


def test_the_app_refuses_a_device_it_cannot_run_on_at_start(capsys):
    pytest.importorskip("gradio")
    import app

    parser = app.build_parser()
    with pytest.raises(SystemExit) as stopped:
        app.local_service(parser.parse_args(["--tiny", "--device", "tpu"]), parser)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == f"{parser.prog}: Unsupported device 'tpu': use cpu, cuda or cuda:N (N the index of a CUDA GPU, from 0)."


def test_the_cli_synthesizes_in_float16(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "half.wav"
    code = main(["synth", "--model", str(tiny_checkpoints["custom_voice"]), "--text", "Half precision.", "--speaker", "ryan", "--seed", "3",
                 "--max-frames", "3", "--dtype", "float16", "--out", str(out), "--codes-out", str(tmp_path / "half.npy")])
    assert code == 0, capsys.readouterr().err
    audio, rate = sf.read(out, dtype="float32")
    assert rate == 24000 and len(audio) > 0 and np.abs(audio).max() > 0
    assert np.load(tmp_path / "half.npy").shape == (3, 16)


def test_the_cli_refuses_a_dtype_it_does_not_know(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["synth", "--model", "m", "--text", "Hi.", "--out", "o.wav", "--dtype", "float64"])
    assert stopped.value.code == EXIT_BAD_INPUT and "invalid choice: 'float64'" in capsys.readouterr().err
