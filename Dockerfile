# The demo on a CUDA machine:
#   docker build -t qwen3-tts-demo .
#   docker run --gpus all -p 7860:7860 -v qwen3-tts-models:/home/user/.cache/huggingface -v qwen3-tts-listening:/home/user/listening qwen3-tts-demo
# The named volumes keep the downloaded checkpoints and the listening sessions (files, clips, votes) across containers. Without a GPU the app runs on
# the CPU (slowly); add `--tiny` to the command to try the interface without any download.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ffmpeg libsndfile1 \
    && rm -rf /var/lib/apt/lists/*

# Hugging Face Spaces (and most hosts) run containers as uid 1000; the base image's "ubuntu" user has it.
RUN userdel -r ubuntu && useradd -m -u 1000 user
USER user
ENV HOME=/home/user VIRTUAL_ENV=/home/user/venv PATH=/home/user/venv/bin:$PATH \
    HF_HOME=/home/user/.cache/huggingface \
    GRADIO_SERVER_NAME=0.0.0.0 GRADIO_SERVER_PORT=7860
WORKDIR /home/user/app

# torch from PyPI is the CUDA build on Linux x86_64 (it brings its CUDA libraries; the host brings the driver).
RUN python3 -m venv $VIRTUAL_ENV
COPY --chown=user requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt

COPY --chown=user . .
RUN mkdir -p $HF_HOME /home/user/listening
VOLUME ["/home/user/.cache/huggingface", "/home/user/listening"]
EXPOSE 7860
CMD ["python", "app.py", "--sessions", "/home/user/listening"]
