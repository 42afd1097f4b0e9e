# The demo on a CUDA machine:
#   docker build -t qwen3-tts-demo .
#   docker run --gpus all -p 7860:7860 -v qwen3-tts-models:/home/user/.cache/huggingface -v qwen3-tts-listening:/home/user/listening qwen3-tts-demo
# The named volumes keep the downloaded checkpoints and the listening sessions (files, clips, votes) across containers. Without a GPU the app runs on
# the CPU (slowly); add `--tiny` to the command to try the interface without any download.
#
# Base: plain Ubuntu, no nvidia/cuda image. torch==2.13.0 from PyPI (Linux x86_64) is a CUDA 13 build whose wheel requires
# cuda-toolkit==13.0.3 and nvidia-*-cu13 wheels (cuDNN, NCCL, ...): pip installs the CUDA runtime libraries into the venv, so a
# CUDA base image would only add a second, unused copy (and its CUDA major would have to follow torch's; tests/test_deployment.py
# checks both). The host needs only an NVIDIA driver that runs CUDA 13 (>= 580) and the NVIDIA Container Toolkit (`--gpus all`).
# Ubuntu 24.04's python3 is 3.12, for which torch 2.13.0 has wheels.
FROM ubuntu:24.04

# What the nvidia/cuda images set for the container toolkit: expose the GPUs and the driver's compute libraries, and refuse
# to start on a driver older than torch's CUDA needs.
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility NVIDIA_REQUIRE_CUDA="cuda>=13.0"
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
# gcc and python3-dev: Triton (torch.compile on CUDA, on by default) builds a small C launcher at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ffmpeg libsndfile1 ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# Hugging Face Spaces (and most hosts) run containers as uid 1000; the base image's "ubuntu" user has it.
RUN userdel -r ubuntu && useradd -m -u 1000 user
USER user
# The compiled kernels live on the model cache's volume, so a restart starts warm (0.6B on an H100:
# ready in 23 s with them, 72 s without; python -m benchmarks.cold_start).
ENV HOME=/home/user VIRTUAL_ENV=/home/user/venv PATH=/home/user/venv/bin:$PATH \
    HF_HOME=/home/user/.cache/huggingface \
    TRITON_CACHE_DIR=/home/user/.cache/huggingface/compiled/triton \
    TORCHINDUCTOR_CACHE_DIR=/home/user/.cache/huggingface/compiled/inductor \
    GRADIO_SERVER_NAME=0.0.0.0 GRADIO_SERVER_PORT=7860
WORKDIR /home/user/app

# torch from PyPI's default index: the CUDA 13 build on Linux x86_64, with its CUDA libraries (the host brings the driver).
RUN python3 -m venv $VIRTUAL_ENV
COPY --chown=user requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt

COPY --chown=user . .
RUN mkdir -p $HF_HOME /home/user/listening
VOLUME ["/home/user/.cache/huggingface", "/home/user/listening"]
EXPOSE 7860
CMD ["python", "app.py", "--sessions", "/home/user/listening"]
