# syntax=docker/dockerfile:1
# kvstitch images. Targets:
#   cpu   — python:3.11-slim with the CPU build of torch (tests, small models, the ingest worker without a GPU)
#   cuda  — NVIDIA's CUDA runtime with the CUDA build of torch (the gateway and workers on GPUs); the default
# Both run the README's commands: `kvstitch serve` (gateway) and `kvstitch worker` (ingestion); settings come
# from KVSTITCH_* variables (docker-compose.yml, deploy/k8s/).
#   docker build --target cuda -t kvstitch:cuda .      docker build --target cpu -t kvstitch:cpu .

ARG TORCH_VERSION=2.13.0

# ---- builder (CPU): the package and its dependencies in a venv, copied whole into the runtime image ----------
FROM python:3.11-slim-bookworm AS builder-cpu
ARG TORCH_VERSION
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the CPU index, so the package's `torch>=2.5` does not pull CUDA wheels.
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
COPY workers ./workers
RUN pip install ".[s3]"  # the shared KV tier's client (boto3), so one image serves every deployment form

# ---- runtime (CPU) ----------------------------------------------------------------------------------------------
FROM python:3.11-slim-bookworm AS cpu
RUN useradd --create-home --uid 1000 kvstitch && mkdir -p /var/lib/kvstitch /models \
    && chown kvstitch /var/lib/kvstitch
COPY --from=builder-cpu /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 \
    KVSTITCH_HOST=0.0.0.0 KVSTITCH_DATA_DIR=/var/lib/kvstitch/data KVSTITCH_CACHE_DIR=/var/lib/kvstitch/kv
USER kvstitch
WORKDIR /var/lib/kvstitch
EXPOSE 8000 9101
CMD ["kvstitch", "serve"]

# ---- builder (CUDA): the same venv with the CUDA build of torch, on the runtime image's own Python -------------
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS builder-cuda
ARG TORCH_VERSION
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_CUDA_INDEX}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
COPY workers ./workers
RUN pip install ".[s3]"  # the shared KV tier's client (boto3), so one image serves every deployment form

# ---- runtime (CUDA) ---------------------------------------------------------------------------------------------
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS cuda
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1001 kvstitch && mkdir -p /var/lib/kvstitch /models \
    && chown kvstitch /var/lib/kvstitch
COPY --from=builder-cuda /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 \
    KVSTITCH_HOST=0.0.0.0 KVSTITCH_DATA_DIR=/var/lib/kvstitch/data KVSTITCH_CACHE_DIR=/var/lib/kvstitch/kv
USER kvstitch
WORKDIR /var/lib/kvstitch
EXPOSE 8000 9101
CMD ["kvstitch", "serve"]
